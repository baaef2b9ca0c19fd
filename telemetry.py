"""What a run reports: the start-up table, metrics.jsonl and wandb, the per-step record and its warnings,
the phase timer, torch.profiler and torch.compile's compilation time.

    telemetry = Telemetry(cfg, is_main, device, start_step, max_steps, flops, peak, wandb_run, optimizer)
    with telemetry.timer("forward"): ...                      # train_step's phases
    with telemetry.loop():                                    # progress bar and profiler
        record = telemetry.step_record(step, loss, grad_norm, finite, seconds, lr, layout, world_size, health)
        telemetry.log(record)                                 # metrics.jsonl, wandb, progress, profiler

Only rank 0 writes anything; the other ranks run the same calls as no-ops, so the loop has no rank checks.
"""

import json
import os
import sys
import time
from contextlib import contextmanager
from statistics import median

import torch

import fp8
import memory
import sizing
from config import PROFILE_ACTIVE, PROFILE_WAIT, flat_values
from hardware import peak_memory_gib
from optim import describe_param_groups, optimizer_state_bytes
from progress import Progress

DATA_WAIT_WARN = 0.05  # warn when waiting for batches takes more than this fraction of a step
# Steps timed to separate torch.compile's one-off compilation (in the first step) from the steady step time.
COMPILE_TIMING_STEPS = 6


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows), flush=True)


def startup_rows(run, data_dir: str, reasons: dict) -> list[tuple[str, str]]:
    """The start-up table of a train.Run: what is active and why, each detected rather than assumed."""
    cfg, m, info, layout = run.cfg, run.model_cfg, run.info, run.layout
    return [
        ("device", f"{run.device.type} ({reasons['device']})"),
        ("distributed", f"{info.mode}, {info.world_size} processes" if info.mode != "none" else "off (single process)"),
        ("precision", reasons["dtype"]),
        ("TF32 matmuls", reasons["tf32"]),
        ("size", sizing.describe(cfg.size, flat_values(cfg))),
        ("model", f"{run.model.num_params() / 1e6:.2f}M params, {m.n_layer} layers, d={m.n_embd}, "
                  f"heads {m.n_head}q/{m.n_kv_head}kv, vocab {m.padded_vocab_size}"),
        ("optimizer", describe_param_groups(run.optimizer)),
        ("torch.compile", "off (not requested)" if cfg.speed.compile == "off" else f"on, mode {cfg.speed.compile}"),
        ("FP8", fp8.describe_fp8(run.model, run.fp8_recipe)),
        ("activation ckpt", memory.describe_activation_checkpointing(run.model)),
        ("batch", f"{layout.micro_batch} x {layout.seq_len} tokens x {layout.grad_accum} micro-steps x "
                  f"{layout.world_size} ranks = {layout.tokens_per_step} tokens/step"),
        ("schedule", f"{cfg.schedule.schedule}, peak lr {cfg.optim.lr:g}, warmup {cfg.schedule.warmup}, "
                     f"{run.max_steps} steps"),
        ("data", f"{data_dir} (" + ("--packing bos: rows start at documents, packed best-fit; the cropped "
                                    "fraction is logged as data_cropped_frac" if cfg.data.packing == "bos"
                                    else "windows at any offset") + ")"),
        ("MFU peak", reasons["peak"]),
        ("wandb", reasons["wandb"]),
        ("init", f"the checkpoint of step {run.start_step}" if run.start_step else reasons["init"]),
        ("resume", f"from step {run.start_step}" if run.start_step else f"off (fresh run; --resume {cfg.ckpt.resume})"),
    ]


def message(text: str) -> None:
    """A line for the user outside the step loop (the loop writes through its progress bar)."""
    print(text, file=sys.stderr, flush=True)


def compile_seconds(step_times: list[float]) -> float:
    """Compilation time, estimated as the first step's time minus the median of the later ones."""
    return step_times[0] - median(step_times[1:]) if len(step_times) > 1 else step_times[0]


# ----------------------------------------------------------------------------- metrics.jsonl and wandb


class MetricsLog:
    """metrics.jsonl, plus wandb when asked for. Lines from steps that are redone (after a resume or a
    rollback) are dropped, and so is a line torn by a crash mid-write."""

    def __init__(self, out_dir: str, start_step: int, wandb_run, enabled: bool = True):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.enabled, self.wandb_run = enabled, wandb_run
        self.truncate(start_step)

    def truncate(self, step: int) -> None:
        """Keep only the records of steps before `step`. The kept lines go to a new file that then replaces
        the old one, so a crash at any moment leaves one or the other whole."""
        if not self.enabled:  # only rank 0 writes
            return
        kept = []
        if step > 0 and os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        if json.loads(line)["step"] < step:
                            kept.append(line)
                    except (ValueError, KeyError):
                        pass
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if v is not None}, step=record["step"])

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


def wandb_mode(requested: str) -> str:
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = os.path.expanduser("~/.netrc")
    if os.path.exists(netrc) and "api.wandb.ai" in open(netrc).read():
        return "online"
    return "offline"


def start_wandb(log_cfg, out_dir: str, resume: bool, config_dict: dict):
    """-> (run or None, reason). wandb must never stop a training run, so failures only warn."""
    if not log_cfg.wandb:
        return None, "off (not requested)"
    mode = wandb_mode(log_cfg.wandb_mode)
    try:
        import wandb

        tags = [t.strip() for t in log_cfg.wandb_tags.split(",") if t.strip()] if log_cfg.wandb_tags else None
        run = wandb.init(project=log_cfg.wandb_project, name=log_cfg.wandb_run_name, config=config_dict, mode=mode,
                         tags=tags, dir=out_dir, resume="allow" if resume else None)
        return run, f"on, {mode} (project {log_cfg.wandb_project})"
    except Exception as e:
        return None, f"off: wandb failed to start ({type(e).__name__}: {str(e).splitlines()[0]})"


# ----------------------------------------------------------------------------- timing and profiling


class PhaseTimer:
    """Seconds spent per phase of a step. Waiting for data is host time, so wall clock; on CUDA the
    compute phases are timed with CUDA events, because kernels run asynchronously to the host."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans = []

    @contextmanager
    def __call__(self, phase: str):
        if self.cuda and phase != "data":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.append((phase, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.spans.append((phase, t0, time.perf_counter()))

    def collect(self) -> dict[str, float]:
        """{phase: seconds} since the last collect(); waits for the GPU's timed work to finish."""
        totals = {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        for phase, start, end in self.spans:
            if isinstance(start, float):
                totals[phase] += end - start
            else:
                end.synchronize()
                totals[phase] += start.elapsed_time(end) / 1000
        self.spans = []
        return totals


def start_profiler(device: torch.device, out_dir: str, is_main: bool):
    """torch.profiler over PROFILE_ACTIVE steps after PROFILE_WAIT; writes OUT/trace.json, prints the top ops."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trace = os.path.join(out_dir, "trace.json")

    def report(prof):
        if not is_main:
            return
        prof.export_chrome_trace(trace)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=15), flush=True)
        print(f"profile: {PROFILE_ACTIVE} steps written to {trace} (open in https://ui.perfetto.dev)", flush=True)

    prof = profile(activities=activities, schedule=schedule(wait=PROFILE_WAIT - 1, warmup=1, active=PROFILE_ACTIVE,
                                                             repeat=1), on_trace_ready=report)
    prof.start()
    return prof


# ----------------------------------------------------------------------------- the step loop's reporter


class Telemetry:
    """Everything the step loop reports, and when: the record of each step and its warnings, progress,
    metrics.jsonl / wandb, the profiler's steps. `write` prints a line above the progress bar."""

    def __init__(self, cfg, is_main: bool, device: torch.device, start_step: int, max_steps: int,
                 flops_per_token: float, peak_flops: float | None, wandb_run, optimizer: torch.optim.Optimizer,
                 start_tokens: int = 0):
        """start_tokens: tokens trained before start_step (a resumed run's checkpoint says how many)."""
        self.cfg, self.device, self.start_step, self.max_steps = cfg, device, start_step, max_steps
        self.tokens = start_tokens  # counted step by step: the batch may change across a resume
        self.optimizer = optimizer  # its state's size is reported once it exists, after the first step
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.is_main = is_main
        self.metrics = MetricsLog(cfg.ckpt.out_dir, start_step, wandb_run, enabled=is_main)
        self.timer = PhaseTimer(device)
        self.progress = self.profiler = None  # the step loop's, opened by loop()
        self.step_times, self.data_warned, self.last_loss = [], False, float("nan")

    def step_record(self, step: int, loss: float, grad_norm: float, finite: bool, seconds: float, lr: float,
                    layout, world_size: int, health) -> dict:
        """The metrics.jsonl line of one step; prints the warnings it calls for (skipped update, spike,
        slow data) and, once, the compilation time."""
        self.step_times.append(seconds)
        self.tokens += layout.tokens_per_step
        phases = self.timer.collect()
        tokens_per_sec = layout.tokens_per_step / seconds
        per_device = tokens_per_sec / world_size
        spike = health.update(loss, finite)
        self.last_loss = loss
        record = {
            "step": step, "tokens": self.tokens, "train_loss": loss if finite else None,
            "lr": lr, "grad_norm": grad_norm if finite else None,
            "tokens_per_sec": tokens_per_sec, "tokens_per_sec_per_device": per_device,
            # per device; equal to the whole job's utilisation of its devices
            "mfu": self.flops_per_token * per_device / self.peak_flops if self.peak_flops else None,
            "loss_ema": health.ema, "loss_var": health.var, "skipped": not finite, "bad_steps": health.bad_total,
            **{f"time_{phase}_ms": 1000 * s for phase, s in phases.items()},
            "peak_mem_gib": peak_memory_gib(self.device),
        }
        done = step + 1
        if not finite:
            self.write(f"warning: step {done}: loss {loss}, grad norm {grad_norm}: update skipped "
                       f"({health.bad_in_a_row} in a row, {health.bad_total} in all)")
        if spike:
            self.write(f"warning: step {done}: loss spike {loss:.4f}, {loss / health.ema:.1f}x its running average")
        self._compile_time(record)
        if step == self.start_step:
            self.write(f"optimizer state: {optimizer_state_bytes(self.optimizer) / 2**20:.1f} MiB per rank")
        elif phases["data"] > DATA_WAIT_WARN * seconds and not self.data_warned:  # step 1 also starts the prefetch
            self.data_warned = True
            self.write(f"warning: step {done} spent {100 * phases['data'] / seconds:.0f}% of its time waiting for "
                       "data (time_data_ms in metrics.jsonl has every step); the loader is a bottleneck")
        return record

    def _compile_time(self, record: dict) -> None:
        times, timed_steps = self.step_times, min(COMPILE_TIMING_STEPS, self.max_steps - self.start_step)
        if self.cfg.speed.compile != "off" and len(times) == timed_steps:
            record["compile_s"] = compile_seconds(times)
            self.write(f"torch.compile: first step {times[0]:.1f} s, about {record['compile_s']:.1f} s of it "
                       f"compilation (first minus the median of the next {len(times) - 1} steps)")

    def log(self, record: dict) -> None:
        """Write the step's record, move the progress bar, advance the profiler."""
        step, done = record["step"], record["step"] + 1
        self.metrics.log(record)
        if done % self.cfg.log.log_interval == 0 or done == self.max_steps or step == self.start_step:
            self.progress.set_postfix(f"loss {self.last_loss:.3f}, {record['tokens_per_sec']:,.0f} tok/s")
        self.progress.update()
        if self.profiler is not None:
            self.profiler.step()

    def rewind(self, step: int, tokens: int) -> None:
        """Forget the records from `step` on: they will be redone (after a rollback from a checkpoint holding
        `tokens`)."""
        self.metrics.truncate(step)
        self.tokens = tokens

    @contextmanager
    def loop(self):
        """The step loop's progress bar and profiler, open while it runs."""
        self.progress = Progress(self.max_steps, "train", unit="step", initial=self.start_step, enabled=self.is_main)
        if self.cfg.log.profile:
            self.profiler = start_profiler(self.device, self.cfg.ckpt.out_dir, self.is_main)
        try:
            yield
        finally:
            if self.profiler is not None:
                self.profiler.stop()
            self.progress.close()
            self.progress = self.profiler = None

    def write(self, text: str) -> None:
        """A line for the user: above the progress bar inside the loop, plainly outside it; rank 0 only."""
        if self.progress is not None:
            self.progress.write(text)
        elif self.is_main:
            message(text)

    def close(self) -> None:
        self.metrics.close()
