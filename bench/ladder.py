"""The optimization ladder: one model and batch through cumulative speed-ups, measured rung by rung.

    python bench/ladder.py [--out bench/results/ladder] [train.py flags] 2> ladder.log  # the ladder
    python bench/ladder.py --mfu-sweep [--sizes gpt2-124m --seq-lens 1024,2048 --batch-sizes 8,16]  # GPU only
    python bench/ladder.py --projection                # gpt2-124m's H100 step estimated part by part

A step rung runs everything the last step that ran did plus one change, and later rungs keep it; a variant
rung ("vs: ...") swaps one setting of that step (Muon for fused AdamW, cuDNN attention, CUDA graphs,
max-autotune, 8-bit AdamW, torchao FP8 tensorwise or rowwise) and later rungs do not keep it, so each variant
is compared with the same step. --start-at RUNG applies the steps before RUNG untimed. A rung that cannot run here (no CUDA, no Transformer Engine, head_dim not 128, ...) is reported "n/a" with
the reason, and later rungs go on without its change; a rung that crashes, in set-up or while timed, is
reported "failed" (its traceback goes to stderr) and the ladder goes on. No number in the table is anything
but a measurement on this machine. Each rung is timed with bench/throughput.py's measure(): untimed warm-up
steps (which contain torch.compile's compilation), then the median tokens/s of several timed windows.
After every rung it rewrites OUT.md (the table) and OUT.json (the raw numbers), so a run cut short keeps
what it measured, and OUT.png (a bar chart) when matplotlib is installed and --no-chart is not given; with
--budget-s, rungs that would start after that many seconds are skipped, not started. Every rung's start-up
table goes to stderr. Any train.py flag (model shape, batch, --data, --act-ckpt, ...) applies to every rung.
"""

import contextlib
import gc
import importlib.util
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from atomic import atomic_write, replace_with  # noqa: E402
import config  # noqa: E402
import fp8  # noqa: E402
import memory  # noqa: E402
import sizing  # noqa: E402
import throughput  # noqa: E402
import train  # noqa: E402
from checkpoint import CheckpointError  # noqa: E402
from cli import DataError, HelpFormatter, ScriptParser, UsageError, count, run_writing_results  # noqa: E402
from hardware import cpu_name  # noqa: E402
from loss import LOSS_CHUNK_TOKENS, loss_chunks  # noqa: E402
from model import ModelConfig  # noqa: E402
from sizing import flops_per_token, param_numels  # noqa: E402
from update_math import newton_schulz_flops  # noqa: E402

# The starting point: everything a plain PyTorch loop does without trying.
BASE = {"dtype": "fp32", "tf32": False, "sdpa": "math", "fused": False, "compile": "off", "fp8": "off",
        "fp8_recipe": "current", "fp8_attn": False, "optimizer": "adamw", "loss_chunk": LOSS_CHUNK_TOKENS,
        "activation": "fp32"}
# (key, label, change, rung whose change this one needs, kind). A "step" applies its change on top of the last
# step that ran, and the rungs after it keep it; a "variant" swaps one setting of that step for comparison and
# nothing after it keeps its change. Variants come in the order of what a GPU run's defaults most depend on.
RUNGS = [
    ("fp32", "fp32 (eager, math attention, foreach AdamW)", {}, None, "step"),
    ("tf32", "+ TF32 matmuls", {"tf32": True}, None, "step"),
    ("bf16", "+ bf16 autocast", {"dtype": "bf16"}, None, "step"),
    ("flash", "+ SDPA flash attention", {"sdpa": "flash"}, None, "step"),
    ("fused_adamw", "+ fused AdamW", {"fused": True}, None, "step"),
    ("compile", "+ torch.compile", {"compile": "default"}, None, "step"),
    ("loss_chunks", "+ loss chunks sized from GPU memory", {"loss_chunk": 0}, None, "step"),
    ("bf16_stream", "+ bf16 activations between the GEMMs", {"activation": "bf16"}, "bf16", "step"),
    ("muon", "vs: Muon instead of fused AdamW", {"optimizer": "muon"}, None, "variant"),
    ("cudnn_attn", "vs: cuDNN attention first", {"sdpa": "cudnn"}, None, "variant"),
    ("cuda_graphs", "vs: CUDA graphs (compile reduce-overhead)", {"compile": "reduce-overhead"}, None, "variant"),
    ("max_autotune", "vs: compile max-autotune", {"compile": "max-autotune"}, None, "variant"),
    ("adamw8bit", "vs: 8-bit AdamW instead of fused AdamW", {"optimizer": "adamw8bit"}, None, "variant"),
    ("torchao", "vs: torchao FP8, tensorwise", {"fp8": "torchao"}, None, "variant"),
    ("torchao_rowwise", "vs: torchao FP8, rowwise", {"fp8": "torchao", "fp8_recipe": "rowwise"}, None, "variant"),
    ("fp8_te", "+ FP8 GEMMs (Transformer Engine)", {"fp8": "te"}, None, "step"),
    ("fp8_attn", "+ FP8 attention (TE)", {"fp8_attn": True}, "fp8_te", "step"),
]
# What a CPU cannot run, by the setting a rung changes: -> the reason.
CUDA_ONLY = {"tf32": "TF32 is a CUDA tensor-core mode", "loss_chunk": f"a CPU's loss chunk is {LOSS_CHUNK_TOKENS:,} "
             "tokens either way", "sdpa=cudnn": "cuDNN attention is CUDA's",
             "compile=reduce-overhead": "CUDA graphs are CUDA's",
             "activation": "a CPU keeps the stream fp32 (--activation-dtype auto): bf16 operands cost it conversions"}
# Model and batch when the command line gives none. GPU: GPT-2-small width and depth with head_dim 128, so
# that the FP8-attention rung can run, the default architecture (attention gates), which the Transformer Engine
# rungs build too, with GPT-2's tied head (the GPU results of 2026-11-27/28 were measured with --no-attn-gate).
# CPU: train.py's small default model's shape, tied as its committed results (bench/results/ladder_cpu.md) were
# measured, a small batch.
GPU_DEFAULTS = ["--n-layer", "12", "--n-embd", "768", "--n-head", "6", "--n-kv-head", "2", "--seq-len", "1024",
                "--batch-size", "16", "--tie-embeddings"]
CPU_DEFAULTS = ["--batch-size", "8", "--tie-embeddings"]
# --mfu-sweep sizes: the shapes of train.py's --preset (sizing.py), tied as GPT-2, without the horizon and batch
# it derives.
SIZES = {name: [*(flag for field in ("n_layer", "n_embd", "n_head", "n_kv_head", "head_dim")
                  for flag in (f"--{field.replace('_', '-')}", str(getattr(sizing.preset_shape(name), field)))),
                "--tie-embeddings"]
         for name in sizing.PRESETS}
SWEEP_SETTINGS = {**BASE, "dtype": "bf16", "tf32": True, "sdpa": "flash", "fused": True, "compile": "default",
                  "loss_chunk": 0, "activation": "bf16"}
# Environment variables that change the timings, recorded in the table's header when set.
TIMING_ENV = ("OMP_NUM_THREADS", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE", "CUDA_VISIBLE_DEVICES")
# H100 SXM datasheet figures for the peak and the bandwidth (estimated_step_parts, the MFU column).
H100_PEAK_BF16 = 989e12
H100_HBM_BYTES_PER_S = 3.35e12
H100_MEMORY, _ = memory.TARGET_GPUS["h100"]
# The estimate's assumptions (estimated_step_parts), read from what these kernels reach at GPT-2 small's
# shapes in public H100 reports, not measured here: bf16 GEMMs of width 768 at 60% of the dense peak, causal
# flash attention at 40%, streaming kernels at 80% of HBM bandwidth.
GEMM_EFFICIENCY = 0.6
ATTENTION_EFFICIENCY = 0.4
HBM_EFFICIENCY = 0.8
ACTIVATION_PASSES = 3  # every saved activation: written in forward, read in backward, its gradient written
LOSS_BYTES_PER_LOGIT = 8  # the GEMM writes bf16 logits, the fused softmax reads them twice and writes the gradient
MUON_BYTES_PER_PARAM = 20  # fp32 gradient and momentum read, momentum written, parameter read and written


def parse_ladder_args(argv):
    # No abbreviations: train.py's flags pass through, and --batch-size must not be read as --batch-sizes.
    p = ScriptParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--out", default=None, help="write OUT.md, OUT.png, OUT.json (default: print only)")
    p.add_argument("--windows", type=count, default=5, help="timed windows per rung; the table shows their median")
    p.add_argument("--steps-per-window", type=count, default=5, help="steps timed together as one window")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first (they include compilation)")
    p.add_argument("--rungs", default=None, help="comma-separated rung keys to run (default: all): "
                   + ",".join(key for key, *_ in RUNGS))
    p.add_argument("--start-at", default=None, choices=[key for key, *_ in RUNGS],
                   help="time the rungs from this one on; the steps before it apply their changes untimed")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (later rungs run eager)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip the rungs (or sweep points) that would start after this many seconds")
    p.add_argument("--no-chart", action="store_true", help="write no OUT.png")
    p.add_argument("--mfu-sweep", action="store_true",
                   help="tokens/s and MFU over --sizes x --seq-lens x --batch-sizes")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"--mfu-sweep model presets: {', '.join(SIZES)}")
    p.add_argument("--seq-lens", default="1024", help="--mfu-sweep sequence lengths")
    p.add_argument("--batch-sizes", default="8,16,32", help="--mfu-sweep micro-batch sizes")
    p.add_argument("--projection", action="store_true",
                   help="print the estimated H100 step time of gpt2-124m, part by part, and exit")
    args, train_argv = p.parse_known_args(argv)
    if args.rungs is not None:
        unknown = set(args.rungs.split(",")) - {key for key, *_ in RUNGS}
        if unknown:
            p.error(f"unknown rung(s) {', '.join(sorted(unknown))}")
    return args, train_argv


# ----------------------------------------------------------------------------- one measurement


def settings_argv(settings, out_dir):
    argv = ["--dtype", settings["dtype"], "--compile", settings["compile"], "--fp8", settings["fp8"],
            "--optimizer", settings["optimizer"], "--out-dir", out_dir, "--eval-interval", "0",
            "--loss-chunk-tokens", str(settings["loss_chunk"]), "--fp8-recipe", settings["fp8_recipe"],
            "--activation-dtype", settings["activation"],
            "--tf32" if settings["tf32"] else "--no-tf32", "--fused-adamw" if settings["fused"] else "--no-fused-adamw"]
    return argv + (["--fp8-attn"] if settings["fp8_attn"] else [])


def attention_kernel(sdpa):
    """math: force SDPA's unfused reference kernel (the baseline). flash: every fused kernel and never the
    math one; flash first, and cuDNN or memory-efficient attention where flash cannot take the call (on
    the CPU, flash is the only fused kernel). cudnn: the same with cuDNN's first."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if sdpa == "math":
        return sdpa_kernel(SDPBackend.MATH)
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    if sdpa == "cudnn":
        fused = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return sdpa_kernel(fused, set_priority=True)


def one_line(e):
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def failed(e):
    """A crash in a rung is a result to report, not a reason to stop the ladder: its traceback to stderr."""
    traceback.print_exc(file=sys.stderr)
    return {"status": f"failed ({type(e).__name__}: {one_line(e)})"}


def measure_settings(settings, train_argv, bench):
    """Build train.py's run for these settings and time it. -> a result dict with "status" "ok", "n/a
    (reason)" or "failed (error)"; the start-up table goes to stderr."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            cfg = config.parse_args([*train_argv, *settings_argv(settings, out_dir)])
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            with contextlib.redirect_stdout(sys.stderr):
                run = train.setup(cfg)
        except (UsageError, DataError, CheckpointError, ValueError) as e:
            return {"status": f"n/a ({one_line(e)})"}
        except Exception as e:
            return failed(e)
        try:
            with attention_kernel(settings["sdpa"]):
                warmup_s, rates = throughput.measure(run, bench.windows, bench.steps_per_window, bench.warmup_steps)
        except Exception as e:
            return failed(e)
        finally:
            run.close()
            peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30 if run.device.type == "cuda" else None
            tokens_per_step, peak, model_cfg = run.layout.tokens_per_step, run.telemetry.peak_flops, run.model_cfg
            del run  # free this rung's model and optimizer before the next one is built
            gc.collect()
            torch._dynamo.reset()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    tokens_per_s = statistics.median(rates)
    return {
        "status": "ok", "tokens_per_s": tokens_per_s, "rates": rates, "warmup_s": warmup_s,
        "tokens_per_step": tokens_per_step,
        "compile_s": warmup_s - bench.warmup_steps * tokens_per_step / tokens_per_s
        if settings["compile"] != "off" else None,
        "mfu": flops_per_token(model_cfg, model_cfg.max_seq_len) * tokens_per_s / peak if peak else None,
        "peak_mem_gib": peak_mem_gib,
    }


# ----------------------------------------------------------------------------- the ladder


def over_budget(bench, started):
    return bench.budget_s is not None and time.perf_counter() - started > bench.budget_s


def cpu_refusal(change: dict) -> str | None:
    """Why a rung with this change cannot run without CUDA, or None."""
    for key, value in change.items():
        reason = CUDA_ONLY.get(key) or CUDA_ONLY.get(f"{key}={value}")
        if reason:
            return reason
    return None


def why_not(bench, key, change, needs, ran, started) -> str | None:
    """The status of a rung that is not run ("skipped (...)" or "n/a (...)"), or None to run it."""
    if bench.rungs and key not in bench.rungs.split(","):
        return "skipped (--rungs)"
    if "compile" in change and bench.no_compile:
        return "skipped (--no-compile)"
    if needs is not None and needs not in ran:
        return f"n/a (needs the {needs} rung, which did not run)"
    if not torch.cuda.is_available() and (reason := cpu_refusal(change)):
        return f"n/a ({reason})"
    if over_budget(bench, started):
        return f"skipped (--budget-s {bench.budget_s:g} spent)"
    return None


def run_ladder(bench, train_argv, report):
    """-> list of (key, label, settings, result), one per rung; report(rows so far) after every rung. With
    --start-at, the steps before that rung apply their changes untimed."""
    current, rows, ran, started = dict(BASE), [], set(), time.perf_counter()
    before_start = bench.start_at is not None
    for key, label, change, needs, kind in RUNGS:
        settings = {**current, **change}
        before_start = before_start and key != bench.start_at
        if before_start:
            result = {"status": f"skipped (--start-at {bench.start_at}" + ("; its change kept)" if kind == "step"
                                                                           else ")")}
            current = settings if kind == "step" else current
        elif status := why_not(bench, key, change, needs, ran, started):
            result = {"status": status}
        else:
            print(f"rung {key}: {label} ...", file=sys.stderr, flush=True)
            result = measure_settings(settings, train_argv, bench)
        if result["status"] == "ok":  # a rung that did not run leaves its change out of the later ones
            ran.add(key)
            current = settings if kind == "step" else current
        rows.append((key, label, settings, result))
        report(rows)
    return rows


def fmt_rate(x):
    return f"{x:,.0f}"


def ladder_table(rows):
    first = rows[0][3].get("tokens_per_s")
    lines = ["| # | rung | tokens/s | speedup | MFU | peak memory | compile | note |",
             "|---|---|---|---|---|---|---|---|"]
    for i, (key, label, settings, r) in enumerate(rows, 1):
        if r["status"] != "ok":
            lines.append(f"| {i} | {label} | n/a | | | | | {r['status']} |")
            continue
        speedup = f"{r['tokens_per_s'] / first:.2f}x" if first else "n/a (rung 1 did not run)"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        mem = f"{r['peak_mem_gib']:.2f} GiB" if r["peak_mem_gib"] is not None else "n/a"
        comp = f"{r['compile_s']:.1f} s" if r["compile_s"] is not None else "-"
        spread = f"{fmt_rate(min(r['rates']))}..{fmt_rate(max(r['rates']))} over {len(r['rates'])} windows"
        lines.append(f"| {i} | {label} | {fmt_rate(r['tokens_per_s'])} | {speedup} | {mfu} | {mem} | {comp} | {spread} |")
    return "\n".join(lines)


def describe_machine():
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return (f"CPU ({cpu_name()}, {torch.get_num_threads()} threads), "
            f"torch {torch.__version__}, no CUDA")


def describe_setup(train_argv, bench):
    cfg = config.parse_args(train_argv)
    m = cfg.model
    n_params = sum(param_numels(m).values())
    return (f"model {n_params / 1e6:.2f}M params ({m.n_layer} layers, d={m.n_embd}, heads {m.n_head}q/{m.n_kv_head}kv, "
            f"head_dim {m.resolved_head_dim}, vocab {m.padded_vocab_size}); batch {cfg.data.batch_size} x "
            f"{m.max_seq_len} tokens x {cfg.data.grad_accum} micro-steps; timing: {bench.warmup_steps} warm-up steps, "
            f"median of {bench.windows} windows x {bench.steps_per_window} steps")


def write_chart(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    labels = [f"{i}. {label}" for i, (_, label, _, _) in enumerate(rows, 1)]
    values = [r.get("tokens_per_s", 0.0) for *_, r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    y = list(range(len(rows)))[::-1]
    ax.barh(y, values, color=["tab:blue" if r["status"] == "ok" else "lightgray" for *_, r in rows])
    for yi, value, (*_, r) in zip(y, values, rows):
        text = fmt_rate(value) if r["status"] == "ok" else r["status"].split(" (")[0]
        ax.text(value, yi, f" {text}", va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel("tokens/s (median of timed windows)")
    ax.set_title(title, fontsize=9)
    ax.set_xlim(0, max(values + [1.0]) * 1.25)
    fig.tight_layout()
    replace_with(path, lambda f: fig.savefig(f, dpi=120, format="png"), what="figure")
    plt.close(fig)


def ladder_main(bench, train_argv, argv):
    defaults = GPU_DEFAULTS if torch.cuda.is_available() else CPU_DEFAULTS
    train_argv = [*defaults, *train_argv]  # argparse keeps the last value: the command line wins
    # The FP8-attention rung pairs current-scaling GEMMs with delayed-scaling attention, which TE reads from
    # the environment at its first import, in the FP8 GEMM rung before it. No other rung turns FP8 attention
    # on, and without it the variable does nothing.
    setup = describe_setup(train_argv, bench)  # train.py's flags refused before the environment is touched
    fp8.set_te_attention_env("current", fp8_attn=True)
    header = [f"command: `python bench/ladder.py {shlex.join(argv)}`", f"machine: {describe_machine()}",
              f"setup: {setup}", f"date: {time.strftime('%Y-%m-%d %H:%M')}"]
    env = [f"{k}={os.environ[k]}" for k in TIMING_ENV if k in os.environ]
    if env:
        header.append(f"environment: {' '.join(env)}")
    notes = ["A rung marked n/a did not run on this machine, for the reason given; nothing here is projected."]
    if not torch.cuda.is_available():
        notes.append("MFU n/a: no datasheet peak FLOP/s for a CPU (train.py --peak-tflops sets one). Peak memory "
                     "n/a: CPU has no per-rung allocator peak (CUDA reports torch.cuda.max_memory_allocated).")
    notes.append("compile: the warm-up steps' time minus as many steady steps (torch.compile's compilation; "
                 "inductor's on-disk cache can shorten repeats).")

    def text(rows):
        done = "" if len(rows) == len(RUNGS) else f"\n\n(incomplete: {len(rows)} of {len(RUNGS)} rungs so far)"
        return "\n\n".join(["\n".join(f"- {h}" for h in header), ladder_table(rows) + done, "\n".join(notes)])

    def report(rows):  # after every rung, so that a run cut short still leaves its measurements
        if not bench.out:
            return
        os.makedirs(os.path.dirname(os.path.abspath(bench.out)), exist_ok=True)
        atomic_write(f"{bench.out}.md", f"# Optimization ladder\n\n{text(rows)}\n".encode())
        atomic_write(f"{bench.out}.json", json.dumps({"header": header, "rungs": [
            {"key": k, "label": lab, "settings": st, **r} for k, lab, st, r in rows]}, indent=1).encode())
        if not bench.no_chart and importlib.util.find_spec("matplotlib") is not None:
            write_chart(rows, f"{bench.out}.png", f"Optimization ladder: {describe_machine()}")

    rows = run_ladder(bench, train_argv, report)
    print(text(rows))
    return rows


# ----------------------------------------------------------------------------- MFU sweep


def sweep_row(size, n_params, seq_len, batch, r):
    if r["status"] != "ok":
        status = "OOM" if "out of memory" in r["status"] else r["status"]
        return f"| {size} | {n_params} | {seq_len} | {batch} | {status} | | | |"
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    compile_s = f"{r['compile_s']:.1f} s" if r["compile_s"] is not None else "-"
    return (f"| {size} | {n_params} | {seq_len} | {batch} | {fmt_rate(r['tokens_per_s'])} | {mfu} | "
            f"{r['peak_mem_gib']:.1f} GiB | {compile_s} |")


def sweep_main(bench, train_argv, argv):
    """Every --sizes x --seq-lens x --batch-sizes point, one table row each, written as it is measured."""
    sizes, batches = bench.sizes.split(","), [int(b) for b in bench.batch_sizes.split(",")]
    seq_lens = [int(t) for t in bench.seq_lens.split(",")]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise UsageError(f"unknown --sizes {', '.join(unknown)}; choose from {', '.join(SIZES)}")
    header = (f"- command: `python bench/ladder.py {shlex.join(argv)}`\n- machine: {describe_machine()}\n"
              f"- date: {time.strftime('%Y-%m-%d %H:%M')}\n- settings: bf16 autocast, TF32, flash attention, "
              f"fused AdamW, torch.compile (default mode); timing: {bench.warmup_steps} warm-up steps, median of "
              f"{bench.windows} windows x {bench.steps_per_window} steps")
    lines = ["| size | params | seq len | batch | tokens/s | MFU | peak memory | compile |",
             "|---|---|---|---|---|---|---|---|"]

    def report():
        print(lines[-1], flush=True)
        if bench.out:
            os.makedirs(os.path.dirname(os.path.abspath(bench.out)), exist_ok=True)
            atomic_write(f"{bench.out}.md", (f"# MFU sweep\n\n{header}\n\n" + "\n".join(lines) + "\n").encode())

    print(header, "", *lines, sep="\n")
    started = time.perf_counter()
    for size in sizes:
        for seq_len in seq_lens:
            model_argv = [*GPU_DEFAULTS, *SIZES[size], "--seq-len", str(seq_len), *train_argv]
            m = config.parse_args(model_argv).model
            n_params = f"{sum(param_numels(m).values()) / 1e6:.0f}M"
            for batch in batches:
                if not torch.cuda.is_available():
                    lines.append(f"| {size} | {n_params} | {seq_len} | {batch} | n/a | | | n/a (no CUDA GPU here) |")
                elif over_budget(bench, started):
                    lines.append(f"| {size} | {n_params} | {seq_len} | {batch} | skipped (--budget-s "
                                 f"{bench.budget_s:g} spent) | | | |")
                else:
                    print(f"sweep {size} seq {seq_len} batch {batch} ...", file=sys.stderr, flush=True)
                    r = measure_settings(SWEEP_SETTINGS, [*model_argv, "--batch-size", str(batch)], bench)
                    lines.append(sweep_row(size, n_params, seq_len, batch, r))
                report()


# ----------------------------------------------------------------------------- projection


def ns_flops(rows: int, cols: int, steps: int = 5) -> int:
    """FLOPs of Newton-Schulz on one [rows, cols] block over `steps` iterations: two per multiply-add that
    muon.newton_schulz_flops counts (the Gram matrix, its square, the product with X)."""
    return steps * 2 * newton_schulz_flops(rows, cols)


def muon_flops_per_step(cfg: ModelConfig) -> int:
    """Newton-Schulz FLOPs of one Muon step: every block of every hidden matrix (Q, K and V of the fused
    qkv, gate and up of fc1, as model.GPT.row_blocks splits them)."""
    D, hd = cfg.n_embd, cfg.resolved_head_dim
    F = cfg.resolved_ffn_dim
    blocks = [(cfg.n_head * hd, D), (cfg.n_kv_head * hd, D), (cfg.n_kv_head * hd, D), (D, cfg.n_head * hd),
              (F, D), (F, D), (D, F)]
    return cfg.n_layer * sum(ns_flops(r, c) for r, c in blocks)


def estimated_step_parts(cfg: ModelConfig, seq_len: int, micro_batch: int, step_tokens: int,
                         peak=H100_PEAK_BF16, hbm=H100_HBM_BYTES_PER_S, gemm_eff=GEMM_EFFICIENCY,
                         attn_eff=ATTENTION_EFFICIENCY, hbm_eff=HBM_EFFICIENCY, chunk_tokens: int | None = None
                         ) -> dict[str, float]:
    """Seconds per token of each part of a bf16, compiled training step on one GPU: an estimate read from
    the FLOPs and bytes each part must move, not a measurement.

        block GEMMs   6 x block matmul params                        / (gemm_eff x P)
        lm_head       6 x V x d                                      / (gemm_eff x P)
        attention     (12 x L x H x hd x T) / 2 (causal)            / (attn_eff x P)
        elementwise   ACTIVATION_PASSES x bf16 block activations     / (hbm_eff x BW); the stream in bf16,
                      as train.py runs it on CUDA (--activation-dtype auto)
        loss          LOSS_BYTES_PER_LOGIT x V, plus the float32 [V, d] weight gradient: the first
                      chunk writes it (4 x V x d), each further chunk reads and writes it (8 x V x d)
                      / (hbm_eff x BW); chunks of chunk_tokens (default: what train.py picks on an H100)
        Muon          Newton-Schulz FLOPs per step / step tokens     / (gemm_eff x P),
                      plus MUON_BYTES_PER_PARAM per parameter per step / (hbm_eff x BW)

    Left out: kernel launches, the data loader and, beyond one GPU, communication.
    """
    D, V, L = cfg.n_embd, cfg.padded_vocab_size, cfg.n_layer
    f_attn = 12 * L * cfg.n_head * cfg.resolved_head_dim * seq_len
    f_head = 6 * V * D
    f_blocks = flops_per_token(cfg, seq_len) - f_attn - f_head
    act = L * (memory.attention_bytes_per_token(cfg, 2, True, 2) + memory.mlp_bytes_per_token(cfg, 2, True, 2))
    tokens = micro_batch * seq_len
    chunks = loss_chunks(tokens, chunk_tokens or memory.loss_chunk_tokens(cfg, torch.bfloat16, H100_MEMORY))
    loss_bytes = LOSS_BYTES_PER_LOGIT * V + 4 * V * D * (2 * chunks - 1) / tokens
    bw, flops = hbm_eff * hbm, gemm_eff * peak
    n_params = sum(param_numels(cfg).values())
    return {"block GEMMs": f_blocks / flops, "lm_head": f_head / flops, "attention": f_attn / 2 / (attn_eff * peak),
            "elementwise": ACTIVATION_PASSES * act / bw, "loss": loss_bytes / bw,
            "Muon": (muon_flops_per_step(cfg) / flops + MUON_BYTES_PER_PARAM * n_params / bw) / step_tokens}


def estimated_mfu(cfg: ModelConfig, seq_len: int, micro_batch: int, step_tokens: int, **machine) -> float:
    """MFU of estimated_step_parts: the FLOPs model's work over the summed time, against the peak."""
    parts = estimated_step_parts(cfg, seq_len, micro_batch, step_tokens, **machine)
    return flops_per_token(cfg, seq_len) / (sum(parts.values()) * machine.get("peak", H100_PEAK_BF16))


def projection_main(train_argv):
    cfg = config.parse_args(["--preset", "gpt2-124m", "--seq-len", "1024", *train_argv])
    m, seq, batch, step_tokens = cfg.model, cfg.model.max_seq_len, 16, cfg.data.total_batch_tokens
    parts = estimated_step_parts(m, seq, batch, step_tokens)
    total = sum(parts.values())
    f = flops_per_token(m, seq)
    lines = ["| part | ns per token | share of the step |", "|---|---|---|"]
    lines += [f"| {name} | {1e9 * t:.3f} | {100 * t / total:.0f}% |" for name, t in parts.items()]
    lines.append(f"| **step** | {1e9 * total:.3f} | 100%: {1 / total:,.0f} tokens/s, "
                 f"MFU {100 * f / (total * H100_PEAK_BF16):.0f}% |")
    print(f"Estimate, not measured on a GPU: gpt2-124m ({sum(param_numels(m).values()) / 1e6:.0f}M), seq-len {seq}, "
          f"micro-batch {batch}, {step_tokens:,} tokens per step, bf16 + torch.compile on one H100 SXM: "
          f"P = {H100_PEAK_BF16 / 1e12:g} TFLOP/s, BW = {H100_HBM_BYTES_PER_S / 1e12:g} TB/s, "
          f"gemm_eff = {GEMM_EFFICIENCY}, attn_eff = {ATTENTION_EFFICIENCY}, hbm_eff = {HBM_EFFICIENCY}. "
          "Measure it with: bash bench/gpu_check.sh mfu OUT")
    print(estimated_step_parts.__doc__)
    print("\n".join(lines))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    bench, train_argv = parse_ladder_args(argv)
    try:
        if bench.projection:
            projection_main(train_argv)
        elif bench.mfu_sweep:
            sweep_main(bench, train_argv, argv)
        else:
            ladder_main(bench, train_argv, argv)
    except (UsageError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run_writing_results(main)
