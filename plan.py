"""What a run will cost before its first step: a micro-step timed, the optimizer, evals and checkpoints priced.

What a run will cost, said before its first step: the tokens and steps it plans, and the time a step and the
whole run will take, with a warning when either is more than a person would wait for without being told.

    step = step_time(model, layout, device, dtype, fp8_recipe, sharded)   # at start-up, rank 0
    describe(step, grad_accum, tokens, tokens_per_step, extras)     # the start-up table's time row
    warnings(step, grad_accum, tokens, tokens_per_step, "--max-steps")   # a run over a day, a step over a minute

A step's time is measured on the model itself, and the time row says how:
- a timed micro-step (forward and backward) of the bare model at the run's micro-batch, eager, outside DDP's
  and torch.compile's wrappers, the faster of two timed after one warm-up, when that costs at most the probe
  budget: PROBE_MAX_S, or PROBE_SHARE of the run as its FLOPs plan it, whichever is more;
- else the same at a smaller batch (one sequence; then a quarter of a sequence), timed and scaled to the
  micro-step by training FLOPs (sizing.flops_per_token): the model's own rate, norms, softmax and launches
  included, on less work;
- else, and under FSDP2 (the unwrapped model is whole on every rank and may not fit), the micro-step's FLOPs
  at the rate of one GEMM of the model's own largest shape in the run's dtype, timed here: an estimate, which
  the matmul alone can put above or below the step (a short GEMM runs below the step's sustained rate).
The matmul rate also prices the probes beforehand, and a probe whose activations would not fit the memory the
process has left (headroom.py) is not run. A step is its micro-steps' time (grad accumulation runs them one after
another) and the optimizer's step, priced from its work (optim.step_work): Newton-Schulz FLOPs at the matmul
rate of its dtype, the elementwise updates' bytes at this device's measured copy rate. The run adds its evals
(forward-only tokens at the micro-step's measured FLOP rate) and its checkpoints (their bytes at a write rate
measured in the run's directory). torch.compile's compilation is not counted.
"""

import math
import os
import time
from typing import NamedTuple

import torch

import fp8
import hardware
from atomic import write_synced
from cli import plural
from progress import duration
from sizing import flops_per_token

PROBE_MAX_S = 2.0  # a probe this cheap (by the FLOP estimate) always runs
PROBE_SHARE = 0.05  # and one costing up to this share of the planned run
TIMED_PASSES = 2  # a probe's timed passes, after its warm-up one
RATE_WINDOW_S = 0.05  # how long the matmul-rate measurement repeats its GEMM (at start-up: kept short)
GEMM_FLOPS = 2 * 10**9  # at most, per GEMM of that measurement: 10 ms on a 2-core CPU, microseconds on a GPU
LONG_RUN_S = 24 * 3600  # a plan over a day gets a warning
# What a CPU run's long-plan warning says one H100 would take: its FLOPs at the MFU that a compiled bf16
# gpt2-124m step reached on one H100 80GB HBM3 (31.2%, bench/results/gpu_check_20261128), of its 989 TFLOP/s.
H100_MEASURED_MFU, H100_PEAK_FLOPS = 0.312, 989e12
SLOW_STEP_S = 60.0  # so does a first step over a minute
COPY_BYTES = 64 * 2**20  # the tensor the copy-rate measurement copies: past any CPU cache
WRITE_PROBE_BYTES = 16 * 2**20  # written and synced to disk to price a checkpoint
FORWARD_SHARE = 1 / 3  # of a training step's FLOPs: the forward, all an eval runs


class StepTime(NamedTuple):
    micro_s: float  # seconds of one micro-step
    how: str  # which measurement, for the time row
    optimizer_s: float = 0.0  # seconds of the optimizer's step, gradient clipping included (optimizer_seconds)


class RunExtras(NamedTuple):
    """What a run does besides its steps, counted by the components that decide it."""
    evals: int = 0
    eval_s: float = 0.0  # each
    checkpoints: int = 0
    checkpoint_s: float | None = 0.0  # each; None: not priced (the disk refused plan.write_rate's test file)


def matmul_rate(device: torch.device, dtype: torch.dtype, m: int, k: int, n: int) -> float:
    """FLOP/s of an [m, k] x [k, n] GEMM in dtype on device: repeated for RATE_WINDOW_S after one warm-up."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    a @ b
    hardware.synchronize(device)
    start, reps = time.perf_counter(), 0
    while reps < 2 or time.perf_counter() - start < RATE_WINDOW_S:
        a @ b
        reps += 1
        if reps % 8 == 0:
            hardware.synchronize(device)
    hardware.synchronize(device)
    return 2 * m * k * n * reps / (time.perf_counter() - start)


def time_micro_step(model: torch.nn.Module, micro_batch: int, seq_len: int, device: torch.device,
                    forward_context) -> float:
    """Seconds of one forward and backward of `model` on a [micro_batch, seq_len] batch: the faster of two
    timed after a warm-up (a process's first passes still pay for first-touch allocations and kernel set-up).
    The gradients are dropped and the RNG restored: training starts as if no probe had run."""
    x = torch.zeros((micro_batch, seq_len), dtype=torch.long, device=device)

    def once():
        with forward_context():
            _, loss = model(x, x)
        loss.backward()

    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            once()
            hardware.synchronize(device)
            times = []
            for _ in range(TIMED_PASSES):
                start = time.perf_counter()
                once()
                hardware.synchronize(device)
                times.append(time.perf_counter() - start)
            return min(times)
    finally:
        model.zero_grad(set_to_none=True)


def probes(micro_batch: int, seq_len: int) -> list[tuple[int, int]]:
    """The (micro-batch, seq_len) shapes a probe may time, largest first: the micro-step itself, one sequence,
    a quarter of one (at least 16 tokens); a smaller one only with a multiple of 16 tokens, which FP8's GEMMs
    need (the micro-step itself passed fp8.check_fp8_config). Pure."""
    shapes = [(micro_batch, seq_len), (1, seq_len), (1, max(16, seq_len // 4 // 16 * 16))]
    return [shape for i, shape in enumerate(shapes) if shape[0] * shape[1] <= micro_batch * seq_len
            and shape not in shapes[:i] and (i == 0 or shape[0] * shape[1] % 16 == 0)]


def step_time(model: torch.nn.Module, layout, device: torch.device, dtype: torch.dtype | None, fp8_recipe,
              sharded: bool, planned_micro_steps: int = 1, fits=None) -> StepTime:
    """A micro-step's time at layout's micro-batch (batch.BatchLayout): the largest probe (probes) whose
    passes cost at most the budget (module docstring) by the FLOP estimate and whose activations fit
    (fits(batch, seq_len), None: all do), timed under the training's autocast and FP8 (fp8.probing's recipe)
    and scaled by FLOPs to the micro-step; else the FLOP estimate. planned_micro_steps: the run's, for the budget."""
    cfg, micro_batch, seq_len = model.config, layout.micro_batch, layout.seq_len
    k, n = cfg.n_embd, max(cfg.resolved_ffn_dim, cfg.padded_vocab_size)  # the model's largest GEMM's shape
    m = max(64, min(micro_batch * seq_len, 4096, GEMM_FLOPS // (2 * k * n)))  # rows: few enough to be quick
    rate = matmul_rate(device, dtype or torch.float32, m, k, n)
    work = lambda batch, seq: flops_per_token(cfg, seq) * batch * seq  # noqa: E731 training FLOPs of a probe
    estimate = StepTime(work(micro_batch, seq_len) / rate,
                        f"an estimate: FLOPs at one GEMM's measured rate, {rate / 1e12:.3g} TFLOP/s")
    budget = max(PROBE_MAX_S, PROBE_SHARE * estimate.micro_s * planned_micro_steps)
    passes = 1 + TIMED_PASSES
    affordable = [(b, s) for b, s in probes(micro_batch, seq_len)
                  if passes * work(b, s) / rate <= budget and (fits is None or fits(b, s))]
    if sharded or not affordable:
        return estimate
    batch, seq = affordable[0]
    try:
        with fp8.probing(model, fp8_recipe) as recipe:
            seconds = time_micro_step(model, batch, seq, device, lambda: hardware.forward_context(device, dtype, fp8.fp8_context(recipe)))
    except torch.cuda.OutOfMemoryError:  # the first step will say so, and retry smaller (loop.shrink_micro_batch)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return estimate
    if (batch, seq) == (micro_batch, seq_len):
        return StepTime(seconds, "one micro-step timed, eager")
    scale = work(micro_batch, seq_len) / work(batch, seq)
    return StepTime(seconds * scale,
                    f"a {batch} x {seq}-token micro-batch timed, eager, and scaled by FLOPs x{scale:.3g}")


def copy_rate(device: torch.device, moved: int = 2 * COPY_BYTES) -> float:
    """Bytes/s moved by copying a tensor (read and write), repeated for RATE_WINDOW_S after one warm-up: what
    an elementwise optimizer update, bound by memory, runs at. moved: the bytes that update moves, which the
    copy matches (a small model's state sits in cache, as its copy does), at most COPY_BYTES read."""
    size = max(1 << 20, min(COPY_BYTES, moved // 2))
    a = torch.empty(size // 4, device=device).fill_(1.0)
    b = torch.empty_like(a)
    b.copy_(a)
    hardware.synchronize(device)
    start, reps = time.perf_counter(), 0
    while reps < 2 or time.perf_counter() - start < RATE_WINDOW_S:
        b.copy_(a)
        reps += 1
    hardware.synchronize(device)
    return 2 * (size // 4 * 4) * reps / (time.perf_counter() - start)


def optimizer_seconds(work, ns_rate: float | None, byte_rate: float) -> float:
    """An optimizer step's seconds from its work (optim.StepWork): Newton-Schulz FLOPs at ns_rate (FLOP/s of
    a GEMM of its shape and dtype; None when it has none) and its elementwise bytes at byte_rate. Pure."""
    return (work.ns_flops / ns_rate if work.ns_flops else 0.0) + work.elementwise_bytes / byte_rate


def write_rate(directory: str, at_most: int = WRITE_PROBE_BYTES) -> float | None:
    """Bytes/s of writing min(at_most, WRITE_PROBE_BYTES) bytes to a file in directory and syncing it to disk,
    as a checkpoint is; the file is removed. None when the disk refuses (a full one is the checkpoint's to
    report, with its own words)."""
    path, size = os.path.join(directory, f".write-rate-{os.getpid()}"), max(1, min(at_most, WRITE_PROBE_BYTES))
    start = time.perf_counter()
    try:
        write_synced(path, lambda f: f.write(bytes(size)))
        return size / max(time.perf_counter() - start, 1e-6)
    except OSError:
        return None
    finally:
        if os.path.exists(path):
            os.remove(path)


def steps_due(start: int, end: int, *intervals: int) -> int:
    """How many steps d in (start, end] are on one of at most two intervals (0: never), or are the last: when a
    component due on its interval and at the end runs (inclusion-exclusion, no loop over steps). Pure."""
    on = [i for i in intervals if i > 0]
    if len(on) > 2:
        raise ValueError("steps_due counts at most two intervals")
    multiples = lambda i: end // i - start // i  # noqa: E731
    count = sum(map(multiples, on)) - (multiples(math.lcm(*on)) if len(on) == 2 else 0)
    return count + (end > start and not any(end % i == 0 for i in on))


def run_extras(step: StepTime, tokens_per_micro_step: int, evals: int, eval_tokens: int, checkpoints: int,
               checkpoint_bytes: int, bytes_per_s: float | None) -> RunExtras:
    """Evals of eval_tokens each, forward only (FORWARD_SHARE of a training token's FLOPs) at the micro-step's
    rate, and checkpoints of checkpoint_bytes at bytes_per_s (write_rate; None: not priced). Pure."""
    return RunExtras(evals, step.micro_s * FORWARD_SHARE * eval_tokens / tokens_per_micro_step, checkpoints,
                     None if bytes_per_s is None else checkpoint_bytes / bytes_per_s)


def step_seconds(step: StepTime, grad_accum: int) -> float:
    return step.micro_s * grad_accum + step.optimizer_s


def run_seconds(step: StepTime, grad_accum: int, tokens: int, tokens_per_step: int,
                extras: RunExtras = RunExtras()) -> float:
    """The run's seconds: its tokens (a batch warm-up's smaller steps counted in them) at a full step's
    micro-steps, an optimizer step per step, then its evals and checkpoints."""
    steps = tokens / tokens_per_step
    return (step.micro_s * grad_accum * steps + step.optimizer_s * steps
            + extras.evals * extras.eval_s + extras.checkpoints * (extras.checkpoint_s or 0.0))


def describe(step: StepTime, grad_accum: int, tokens: int, tokens_per_step: int,
             extras: RunExtras = RunExtras()) -> str:
    """The time row: 'a step ~0.65 s (2 micro-steps of 0.31 s: one micro-step timed, eager; the optimizer
    0.03 s), the run ~1m41s with 3 evals of 0.4 s and 4 checkpoints of 0.02 s (compilation not counted)'. Pure."""
    micro = "micro-step" if grad_accum == 1 else "micro-steps"
    each = (" (not timed: the disk refused a test write)" if extras.checkpoint_s is None
            else f" of {_seconds(extras.checkpoint_s)}")
    parts = [f"{plural(extras.evals, 'eval')} of {_seconds(extras.eval_s)}" if extras.evals else "",
             f"{plural(extras.checkpoints, 'checkpoint')}{each}" if extras.checkpoints else ""]
    besides = " and ".join(filter(None, parts))
    return (f"a step ~{_seconds(step_seconds(step, grad_accum))} ({grad_accum:,} {micro} of "
            f"{_seconds(step.micro_s)}: {step.how}; the optimizer {_seconds(step.optimizer_s)}), the run "
            f"~{_seconds(run_seconds(step, grad_accum, tokens, tokens_per_step, extras))}"
            f"{' with ' + besides if besides else ''} (compilation not counted)")


def warnings(step: StepTime, grad_accum: int, tokens: int, tokens_per_step: int, length_flag: str,
             cpu_flops: float | None = None, extras: RunExtras = RunExtras()) -> list[str]:
    """A warning for a run planned (its evals and checkpoints, extras, included) to take over LONG_RUN_S,
    naming length_flag (what sets the run's length)
    and, on a CPU (cpu_flops: the run's training FLOPs), what one H100 would take; and one for a step over
    SLOW_STEP_S, naming what sets a step's size. Pure."""
    found = []
    total, each = run_seconds(step, grad_accum, tokens, tokens_per_step, extras), step_seconds(step, grad_accum)
    if total > LONG_RUN_S:
        gpu = ("; this run wants a GPU: one H100 would take about "
               f"{_seconds(cpu_flops / (H100_MEASURED_MFU * H100_PEAK_FLOPS))} (its FLOPs at the "
               f"{100 * H100_MEASURED_MFU:.0f}% MFU gpt2-124m reached there)") if cpu_flops else ""
        found.append(f"warning: the run is planned at ~{_seconds(total)} on this device ({tokens:,} tokens at "
                     f"~{_seconds(each)} a step); lower {length_flag} for a shorter one{gpu}")
    if each > SLOW_STEP_S:
        found.append(f"warning: each step will take ~{_seconds(each)} ({grad_accum:,} "
                     f"micro-step{'s' if grad_accum != 1 else ''} of {_seconds(step.micro_s)}, the optimizer "
                     f"{_seconds(step.optimizer_s)}), so the first loss is minutes away; lower "
                     "--total-batch-tokens (or --grad-accum) for smaller steps")
    return found


def _seconds(seconds: float) -> str:
    """A time as a person reads it: 0.312 s, 4m05s, 7h30m, 42.3 days."""
    if seconds < 60:
        return f"{seconds:.3g} s"
    return duration(seconds) if seconds < 2 * 86400 else f"{seconds / 86400:,.1f} days"
