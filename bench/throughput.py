"""Training throughput, and where the time goes: tokens/s and MFU of train.py's own step (median over timed
windows), the split of the timed steps into data, forward, backward and optimizer, the peak memory, and the
loss path's share of the activation bytes.

    python bench/throughput.py [--windows 5 --steps-per-window 5 --warmup-steps 3] [any train.py flags]

Every train.py flag is accepted and means the same thing, so a row of this table is exactly what
`python train.py` with those flags would run. Warm-up steps (compilation, allocator growth) are
timed separately and excluded from the medians and the split.
"""

import os
import shlex
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
import hardware  # noqa: E402
import loop  # noqa: E402
import memory  # noqa: E402
import train  # noqa: E402
from cli import DataError, HelpFormatter, ScriptParser, UsageError, count  # noqa: E402
from sizing import flops_per_token  # noqa: E402


def parse_bench_args(argv):
    p = ScriptParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--windows", type=count, default=5, help="timed windows; the table reports their median")
    p.add_argument("--steps-per-window", type=count, default=5, help="steps timed together as one window")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first (includes compilation)")
    return p.parse_known_args(argv)


def measure(run, windows, steps_per_window, warmup_steps):
    """-> (warm-up seconds, list of tokens/s per window). The LR stays at its peak: it does not affect speed."""
    t0 = time.perf_counter()
    for _ in range(warmup_steps):
        loop.train_step(run)
    hardware.synchronize(run.device)
    warmup_s = time.perf_counter() - t0
    run.telemetry.timer.collect()  # from here on the phase timer holds the timed steps only
    rates = []
    for _ in range(windows):
        hardware.synchronize(run.device)
        t0 = time.perf_counter()
        for _ in range(steps_per_window):
            loop.train_step(run)
        hardware.synchronize(run.device)
        rates.append(steps_per_window * run.layout.tokens_per_step / (time.perf_counter() - t0))
    return warmup_s, rates


def phase_split(phases: dict[str, float]) -> str:
    total = sum(phases.values())
    return ", ".join(f"{name} {100 * seconds / total:.0f}%" for name, seconds in phases.items())


def outside_blocks_share(run) -> str:
    """The estimate (memory.py) of what one micro-batch saves for backward outside its blocks (the embedding's
    look-backs and lookups, the final norm, the fused lm_head + cross-entropy's float32 gradients), against all
    the activations it saves."""
    cfg, layout = run.model_cfg, run.layout
    act = memory.act_bytes(run.autocast_dtype)
    fused = run.device.type == "cuda"
    stream = run.model.activation_dtype
    head = (layout.micro_batch * layout.seq_len * memory.head_bytes_per_token(cfg, act, fused,
                                                                              memory.act_bytes(stream))
            + memory.loss_head_bytes(cfg))
    total, _ = memory.activation_bytes(cfg, layout.micro_batch, layout.seq_len, run.cfg.speed.act_ckpt,
                                       run.autocast_dtype, run.device.type, stream)
    return f"{head / 2**20:,.1f} MiB of {total / 2**20:,.1f} MiB per micro-batch ({100 * head / total:.0f}%)"


def setup_run(train_argv: list[str], out_dir: str):
    """train.py's run for these flags, writing into out_dir, with no evals; a user's mistake is one line, exit 2."""
    try:
        return train.setup(config.parse_args([*train_argv, "--out-dir", out_dir, "--eval-interval", "0"]))
    except (UsageError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    bench_args, train_argv = parse_bench_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        run = setup_run(train_argv, out_dir)
        try:
            warmup_s, rates = measure(run, bench_args.windows, bench_args.steps_per_window, bench_args.warmup_steps)
            phases = run.telemetry.timer.collect()
        finally:
            run.close()

    median = statistics.median(rates)
    flops = flops_per_token(run.model_cfg, run.layout.seq_len)
    peak = run.telemetry.peak_flops
    mfu = f"{100 * flops * median / peak:.1f}%" if peak else "n/a (no peak known)"
    device = torch.cuda.get_device_name() if run.device.type == "cuda" else hardware.cpu_name()
    print()
    print(f"command: python bench/throughput.py {shlex.join(argv)}")
    print(f"device: {device}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    rows = [
        ("tokens/step", f"{run.layout.tokens_per_step:,}"),
        ("warm-up", f"{bench_args.warmup_steps} steps in {warmup_s:.1f} s"),
        ("tokens/s (median)", f"{median:,.0f}"),
        ("tokens/s (min..max)", f"{min(rates):,.0f} .. {max(rates):,.0f} over {len(rates)} windows "
                                f"of {bench_args.steps_per_window} steps"),
        ("model FLOPs/token", f"{flops / 1e6:,.1f} M"),
        ("MFU", mfu),
        ("time split", phase_split(phases)),
        ("peak memory", f"{hardware.peak_memory_gib(run.device):.2f} GiB "
                        f"({'allocated by tensors' if run.device.type == 'cuda' else 'resident set of the process'})"),
        ("activations outside the blocks", outside_blocks_share(run)),
    ]
    width = max(len(k) for k, _ in rows)
    print("| " + "metric".ljust(width) + " | value |")
    print("|" + "-" * (width + 2) + "|-------|")
    for k, v in rows:
        print(f"| {k.ljust(width)} | {v} |")


if __name__ == "__main__":
    main()
