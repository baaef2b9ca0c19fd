"""Where a step's time goes, measured: train.py's own step under torch.profiler, its time summed by kind of
work (GEMM, attention, loss, norm/elementwise, optimizer, copies, communication) and by phase (forward,
backward, optimizer), and the idle gaps in which nothing ran.

    python bench/profile_step.py [--steps 3 --warmup-steps 5 --out profile.md] [any train.py flags]

On CUDA the time is the GPU kernels' own (device events), attributed to the phase whose range on the GPU's
timeline holds them; idle is the profiled steps' wall time minus the time at least one kernel was running. On the
CPU it is each operator's self time, and idle is the interpreter's share. Warm-up steps (torch.compile's
compilation) run first and are not profiled; a timed window of unprofiled steps gives the tokens/s beside the
table, so the profiler's own overhead stays out of it. Kernel categories come from kernel names
(kernel_category), except that everything the optimizer phase launches is the optimizer's (Muon's
Newton-Schulz GEMMs included); the table of the largest kernels shows what each category holds.
"""

import contextlib
import datetime
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from atomic import atomic_write  # noqa: E402
import hardware  # noqa: E402
import loop  # noqa: E402
import throughput  # noqa: E402
from cli import HelpFormatter, ScriptParser, count, out_problem, run_writing_results  # noqa: E402
from sizing import flops_per_token  # noqa: E402

PHASES = ("data", "forward", "backward", "optimizer")
CATEGORIES = ("GEMM", "attention", "loss", "norm/elementwise", "optimizer", "copies", "communication")
# First match wins, so the more specific names come first: a fused softmax-scatter kernel is the loss's, an
# attention kernel's internal GEMM is attention's.
NAME_RULES = (
    ("communication", ("nccl", "all_reduce", "allreduce", "all_gather", "reduce_scatter", "c10d")),
    ("copies", ("memcpy", "memset", "aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::cat",
                "aten::contiguous", "aten::fill_", "aten::zero_", "aten::empty")),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "cudnn")),  # cuDNN runs only SDPA here
    ("loss", ("cross_entropy", "log_softmax", "logsumexp", "nll_loss", "scatter", "softmax")),
    ("optimizer", ("adam", "muon", "multi_tensor_apply", "foreach", "newton")),
    ("GEMM", ("gemm", "cutlass", "cublas", "xmma", "nvjet", "matmul", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::linear", "scaled_mm", "wgmma", "hgmma")),
)


def kernel_category(name: str, phase: str | None = None) -> str:
    """The kind of work a kernel (CUDA) or operator (CPU) does, from its name; whatever the optimizer phase
    launched is the optimizer's."""
    if phase == "optimizer":
        return "optimizer"
    lowered = name.lower()
    for category, needles in NAME_RULES:
        if any(needle in lowered for needle in needles):
            return category
    return "norm/elementwise"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of the (start, end) intervals: overlapping kernels count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def phase_at(t: float, ranges: list[tuple[float, float, str]]) -> str:
    """The phase of work that started at time t: that of the (start, end, phase) range holding t; between a
    forward range and the next range, "backward" (on CUDA the autograd engine launches the backward's kernels
    from a thread of its own, so no range of the loop's thread holds them on the GPU's timeline); else "other"
    (data, the step's edges)."""
    before = "other"
    for start, end, phase in sorted(ranges):
        if start <= t <= end:
            return phase
        if end < t:  # the loop's own thread launches a little of the backward (the loss's scaling) in its range
            before = "backward" if phase in ("forward", "backward") else "other"
    return before


class AnnotatedTimer:
    """train.py's phase timer, each phase also a profiler range, so a kernel is attributed to the phase that
    launched it."""

    def __init__(self, timer):
        self.timer = timer

    @contextlib.contextmanager
    def __call__(self, phase: str):
        with record_function(f"phase:{phase}"), self.timer(phase):
            yield

    def __getattr__(self, name):
        return getattr(self.timer, name)


def work_items(events, cuda: bool) -> list[tuple[str, str, float, float, float]]:
    """A profile's events -> (name, phase, microseconds, start, end) per unit of work. CUDA: every device kernel,
    copy and memset, in the phase whose range on the GPU's timeline holds its start (the profiler draws each
    host range again there, over the kernels launched inside it; those drawings are ranges, not work). CPU:
    every operator's self time, in the phase its start falls into."""
    device = DeviceType.CUDA if cuda else DeviceType.CPU
    ranges = [(e.time_range.start, e.time_range.end, e.name.removeprefix("phase:"))
              for e in events if e.name.startswith("phase:") and e.device_type == device]
    if cuda:
        return [(e.name, phase_at(e.time_range.start, ranges), e.time_range.end - e.time_range.start,
                 e.time_range.start, e.time_range.end)
                for e in events if e.device_type == device and not getattr(e, "is_user_annotation", False)
                and not e.name.startswith("phase:")]
    return [(e.name, phase_at(e.time_range.start, ranges), e.self_cpu_time_total, e.time_range.start,
             e.time_range.end)
            for e in events
            if e.device_type == device and not e.name.startswith("phase:") and e.self_cpu_time_total > 0]


def attribute(items, cuda: bool) -> tuple[dict, dict, float]:
    """work_items -> ({(category, phase): us}, {(name, category): (calls, us)}, busy us: the time at least one
    kernel ran on a GPU, where kernels on several streams overlap; the operators' summed self time on a CPU)."""
    by_cell, by_name = defaultdict(float), {}
    for name, phase, us, _, _ in items:
        category = kernel_category(name, phase)
        by_cell[category, phase] += us
        calls, total = by_name.get((name, category), (0, 0.0))
        by_name[name, category] = (calls + 1, total + us)
    busy = busy_us([(start, end) for *_, start, end in items]) if cuda else sum(item[2] for item in items)
    return dict(by_cell), by_name, busy


def profile_table(by_cell: dict, busy: float, wall_us: float, steps: int) -> list[str]:
    """Markdown rows: ms per step by category and phase, each category's share of the step's wall time, and
    the idle row."""
    columns = [*PHASES, "other"]
    lines = ["| category | " + " | ".join(columns) + " | ms/step | share of step |",
             "|---|" + "---|" * (len(columns) + 2)]
    per_step = lambda us: us / steps / 1e3  # noqa: E731
    for category in CATEGORIES:
        cells = [by_cell.get((category, phase), 0.0) for phase in columns]
        if sum(cells) == 0:
            continue
        lines.append(f"| {category} | " + " | ".join(f"{per_step(us):.2f}" for us in cells)
                     + f" | {per_step(sum(cells)):.2f} | {100 * sum(cells) / wall_us:.1f}% |")
    idle = max(0.0, wall_us - busy)
    blank = " | ".join([""] * len(columns))  # no phase columns for these two rows
    lines.append(f"| idle (nothing running) | {blank} | {per_step(idle):.2f} | {100 * idle / wall_us:.1f}% |")
    lines.append(f"| step (wall, profiled) | {blank} | {per_step(wall_us):.2f} | 100% |")
    return lines


def top_kernels(by_name: dict, steps: int, count: int = 25) -> list[str]:
    lines = ["| kernel / operator | category | calls/step | ms/step |", "|---|---|---|---|"]
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:count]
    for (name, category), (calls, us) in ranked:
        short = name if len(name) <= 100 else name[:97] + "..."
        lines.append(f"| `{short.replace('|', '/')}` | {category} | {calls / steps:g} | {us / steps / 1e3:.3f} |")
    return lines


def parse_profile_args(argv):
    p = ScriptParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--steps", type=count, default=3, help="steps profiled (the table is per step)")
    p.add_argument("--warmup-steps", type=int, default=5, help="untimed steps first (includes compilation)")
    p.add_argument("--windows", type=count, default=3, help="timed windows of unprofiled steps, for tokens/s")
    p.add_argument("--steps-per-window", type=count, default=5, help="steps per timed window")
    p.add_argument("--out", default=None, help="also write the report to this markdown file")
    args, train_argv = p.parse_known_args(argv)
    if problem := out_problem(args.out):
        p.error(problem)
    return args, train_argv


def profile_steps(run, steps: int):
    """-> (the profiler's events, wall microseconds of the profiled steps)."""
    run.telemetry.timer = AnnotatedTimer(run.telemetry.timer)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.device.type == "cuda" else [])
    hardware.synchronize(run.device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            loop.train_step(run)
        hardware.synchronize(run.device)
        wall_us = (time.perf_counter() - t0) * 1e6
    run.telemetry.timer = run.telemetry.timer.timer
    return prof.events(), wall_us


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args, train_argv = parse_profile_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        run = throughput.setup_run(train_argv, out_dir)
        try:
            warmup_s, rates = throughput.measure(run, args.windows, args.steps_per_window, args.warmup_steps)
            events, wall_us = profile_steps(run, args.steps)
        finally:
            run.close()
    cuda = run.device.type == "cuda"
    by_cell, by_name, busy = attribute(work_items(events, cuda), cuda)
    rate = statistics.median(rates)
    peak = run.telemetry.peak_flops
    mfu = f"{100 * flops_per_token(run.model_cfg, run.layout.seq_len) * rate / peak:.1f}%" if peak else "n/a"
    device = torch.cuda.get_device_name() if cuda else f"{hardware.cpu_name()}, {torch.get_num_threads()} threads"
    what = "GPU kernel time" if cuda else "operator self time on the CPU"
    lines = [
        "# Profile of one training step", "",
        f"- command: `python bench/profile_step.py {shlex.join(argv)}`",
        f"- device: {device}, torch {torch.__version__}; date: {datetime.date.today()}",
        f"- {run.layout.tokens_per_step:,} tokens/step; unprofiled: {rate:,.0f} tokens/s (median of {len(rates)} "
        f"windows of {args.steps_per_window} steps, {min(rates):,.0f}..{max(rates):,.0f}), MFU {mfu}, "
        f"{1e3 * run.layout.tokens_per_step / rate:.2f} ms/step; warm-up {args.warmup_steps} steps in {warmup_s:.1f} s",
        f"- profiled: {args.steps} steps; {what}, ms per step", "",
        *profile_table(by_cell, busy, wall_us, args.steps), "",
        f"The {min(25, len(by_name))} largest kernels or operators:", "",
        *top_kernels(by_name, args.steps),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        atomic_write(args.out, text.encode())


if __name__ == "__main__":
    run_writing_results(main)
