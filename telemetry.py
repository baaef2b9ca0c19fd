"""The per-step record and its warnings, wandb's key, the phase timer, the profiler, the run's summary.

    telemetry = Telemetry(cfg, is_main, device, start_step, max_steps, flops, peak, wandb_run, optimizer)
    with telemetry.timer("forward"): ...                      # train_step's phases
    with telemetry.loop():                                    # progress bar and profiler
        with telemetry.timing_step(): ...                     # the whole step
        ended = telemetry.end_step()                          # noted as it ends; the profiler moves on
        # ... once the loop has read the step's loss back from the device (loop.read_back):
        health = guard.observe(loss, finite)                  # resilience.Guard counts the step first
        record = telemetry.step_record(step, loss, grad_norm, finite, ended.seconds(), layout, world_size, health,
                                       ended)
        telemetry.log(record)                                 # metrics.jsonl, wandb, progress

Only rank 0 writes anything; the other ranks run the same calls as no-ops, so the loop has no rank checks.
"""

import importlib
import math
import netrc
import os
import shlex
import sys
import time
import urllib.parse
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from statistics import median

import torch

from batch import describe_epochs
from checkpoint import best_path, list_checkpoints
from cli import first_line, plural
from config import PROFILE_ACTIVE, PROFILE_WAIT
from hardware import peak_memory_gib
from hf_layout import exportable_problem
from optim import optimizer_state_bytes
from progress import Heartbeat, Progress, duration
from rundir import TRACE_FILE
from runlog import TENSORBOARD_DIR, MetricsLog
from schedule import current_lr

DATA_WAIT_WARN = 0.05  # warn when waiting for batches takes more than this fraction of a step
PHASES = ("data", "forward", "backward", "optimizer")  # a step's, timed by PhaseTimer
WANDB_ENV_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")  # wandb 0.2x-0.3x's Settings.mode
STEP_METRICS = ("train_loss", "grad_norm", "finite")  # loop.train_step's own; any other it returns is added as is
# Steps timed to separate torch.compile's one-off compilation (in the first step) from the steady step time.
COMPILE_TIMING_STEPS = 6
MICRO_LINE_S = 10.0  # a step running longer than this says which micro-step it is at, this often
HEARTBEAT_S = 15.0  # the loop is never silent for longer than this (progress.Heartbeat)


def print_table(rows: list[tuple[str, str]], width: int = 0) -> None:
    """Rows of a name and a value, the values lined up after the longest name (or `width`)."""
    width = max(width, *(len(k) for k, _ in rows))
    print("\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows), flush=True)


def message(text: str) -> None:
    """A line for the user outside the step loop (the loop writes through its progress bar)."""
    print(text, file=sys.stderr, flush=True)


def compile_seconds(step_times: list[float]) -> float:
    """Compilation time, estimated as the first step's time minus the median of the later ones."""
    return step_times[0] - median(step_times[1:]) if len(step_times) > 1 else step_times[0]


# ----------------------------------------------------------------------------- metrics.jsonl and wandb


def wandb_key_present() -> bool:
    """Whether wandb can log in without asking: WANDB_API_KEY, or the netrc entry `wandb login` writes for its
    server (WANDB_BASE_URL's host; $NETRC or ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host or "api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_problems(cfg):
    """What --wandb needs of this machine (a config.Config's; one of train.py's machine checks): a key, for
    --wandb-mode online, and a WANDB_MODE wandb takes: wandb.init validates the variable even when given a mode,
    and one it does not know, even an empty one, stops it."""
    env_mode = os.environ.get("WANDB_MODE")
    if cfg.log.wandb and env_mode is not None and env_mode not in WANDB_ENV_MODES:
        yield f"WANDB_MODE={env_mode!r} is not a mode wandb takes ({', '.join(WANDB_ENV_MODES)}): unset or correct it"
    if cfg.log.wandb and cfg.log.wandb_mode == "online" and not wandb_key_present():
        yield ("--wandb-mode online needs a W&B API key (WANDB_API_KEY or `wandb login`); use --wandb-mode offline "
               "to log locally and `wandb sync` later")


def tensorboard_problems(cfg):
    """What --tensorboard needs of this machine (a config.Config's; one of train.py's machine checks, through
    logger_problems): the optional tensorboard package, which torch.utils.tensorboard writes with, and
    OUT/tensorboard free for its directory (rundir.misplaced checks the names every run writes)."""
    if not cfg.log.tensorboard:
        return
    try:
        importlib.import_module("torch.utils.tensorboard")
    except ImportError as e:
        yield f"--tensorboard needs the tensorboard package ({first_line(e)}): pip install tensorboard"
    path = os.path.join(cfg.ckpt.out_dir, TENSORBOARD_DIR)
    if os.path.lexists(path) and not os.path.isdir(path):
        yield (f"{path} is not a directory, where --tensorboard writes its event files: move it aside or choose "
               "another --out-dir")


def logger_problems(cfg):
    """What the loggers asked for need of this machine: wandb_problems and tensorboard_problems."""
    yield from wandb_problems(cfg)
    yield from tensorboard_problems(cfg)


def wandb_mode(requested: str) -> str:
    if requested != "auto":
        return requested
    return "online" if wandb_key_present() else "offline"


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

    def lap(self) -> list:
        """The spans timed since the last lap or collect, not read yet (reading a CUDA span waits for the GPU)."""
        spans, self.spans = self.spans, []
        return spans

    @staticmethod
    def read(spans: list) -> dict[str, float]:
        """{phase: seconds} of spans (a lap); waits for the GPU's timed work in them to finish."""
        totals = dict.fromkeys(PHASES, 0.0)
        for phase, start, end in spans:
            totals[phase] += span_seconds(start, end)
        return totals

    def collect(self) -> dict[str, float]:
        """{phase: seconds} since the last collect() or lap(); waits for the GPU's timed work to finish."""
        return self.read(self.lap())


def span_seconds(start, end) -> float:
    """A PhaseTimer span's seconds: wall clock, or two CUDA events (which waits for the GPU to pass the end)."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1000


@dataclass
class StepEnd:
    """What the host notes as a step's work has been queued (Telemetry.end_step), for the step's record, which is
    made once the loop reads the step back from the device, up to --log-interval steps later (by then the LR is
    a later step's). On CUDA the spans are events, read only then, so that nothing waits for the GPU in
    between; time_s is the host's clock when the step was queued, ahead of the GPU by what is queued after it."""

    spans: list  # the step's phases (PhaseTimer.lap)
    whole: list  # the whole step's span (Telemetry.timing_step)
    time_s: float
    peak_mem_gib: float
    lr: float  # schedule.current_lr: the one the step applied

    def seconds(self) -> float:
        """The step's time; on CUDA, from the GPU reaching its start to finishing its last kernel."""
        return sum(span_seconds(start, end) for _, start, end in self.whole)


def start_profiler(device: torch.device, out_dir: str, is_main: bool):
    """torch.profiler over PROFILE_ACTIVE steps after PROFILE_WAIT; writes OUT/trace.json, prints the top ops."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trace = os.path.join(out_dir, TRACE_FILE)

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
    metrics.jsonl / wandb, the profiler's steps, and the summary at the end. `write` prints a line above the
    progress bar."""

    def __init__(self, cfg, is_main: bool, device: torch.device, start_step: int, max_steps: int,
                 flops_per_token: float, peak_flops: float | None, wandb_run, optimizer: torch.optim.Optimizer,
                 start_tokens: int = 0, restored_record: dict | None = None, epoch_tokens: int | None = None):
        """start_tokens: tokens trained before start_step (a resumed run's checkpoint says how many);
        restored_record: the record of start_step that its checkpoint holds (MetricsLog.truncate);
        epoch_tokens: what one epoch of the train split trains on (ShardLoader.tokens_per_epoch), which the
        records' epoch and the summary count in; None: not known (or a mixture, whose records count each
        source's epochs themselves: MixtureLoader.record_fields), and neither says."""
        self.cfg, self.device, self.start_step, self.max_steps = cfg, device, start_step, max_steps
        self.tokens = self.start_tokens = start_tokens  # counted step by step: the batch may change across a resume
        self.epoch_tokens = epoch_tokens
        self.source_epochs = {}  # a mixture's: each source's epochs read, as the last record gives them
        self.optimizer = optimizer  # its state's size is reported once it exists, after the first step
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.is_main = is_main
        self.metrics = MetricsLog(cfg.ckpt.out_dir, start_step, wandb_run, enabled=is_main, restored=restored_record,
                                  tensorboard=cfg.log.tensorboard)
        # time_s goes on from the resumed step's record: the run's training time across its processes
        self.time_offset = (self.metrics.last_kept or {}).get("time_s", 0.0) if start_step else 0.0
        self.timer = PhaseTimer(device)
        self.clock = PhaseTimer(device)  # whole steps (timing_step)
        self.progress = self.profiler = None  # the step loop's, opened by loop()
        self.loop_start = None
        self.step_times, self.step_tokens, self.data_warned, self.last_loss = [], [], False, float("nan")
        self.extra_names = []  # the step metrics beyond STEP_METRICS, for the progress line
        self.done, self.compile_s, self.last_eval = start_step, None, None
        self.eval_plan = None  # the start-up table's eval row: when val is taken, on which tokens
        self.precision = None  # its precision row: what --dtype auto chose here, which config.toml cannot say
        self.steps_taken = start_step  # queued on the device, read back or not (done: read back)
        self.in_step, self.micro_done = False, (0, 0)
        # timing_step restarts the first two per step; a step run without it (bench/throughput.py) counts from here
        self.step_start = self.micro_line = self.last_write = time.perf_counter()
        self.between_start = self.step_start  # when the loop's work outside a step (eval, checkpoint) began

    def elapsed(self) -> float:
        """Seconds of training since the run started, across resumes (metrics.jsonl's time_s)."""
        return self.time_offset + (time.perf_counter() - self.loop_start if self.loop_start else 0.0)

    @contextmanager
    def timing_step(self):
        """A context around the whole step: timed (wall clock, or CUDA events that the host does not wait for),
        and the start its micro-step lines count from, so the previous step's eval and checkpoint are not in it."""
        self.step_start = self.micro_line = time.perf_counter()
        self.in_step, self.micro_done = True, (0, 0)
        try:
            with self.clock("step"):
                yield
        finally:
            self.in_step, self.between_start = False, time.perf_counter()

    def end_step(self) -> StepEnd:
        """What the host notes as a step's work has been queued, for its record (step_record); the profiler
        moves to the next step."""
        if self.profiler is not None:
            self.profiler.step()
        self.steps_taken += 1
        return StepEnd(self.timer.lap(), self.clock.lap(), self.elapsed(), peak_memory_gib(self.device),
                       current_lr(self.optimizer))

    def micro_step(self, done: int, of: int) -> None:
        """After each of a step's `of` micro-steps: once the step has run MICRO_LINE_S, a line every MICRO_LINE_S
        saying how far it is, so that a run of long steps (many micro-steps, a slow device) is never silent for
        minutes. Host time: on a GPU the host runs ahead of the kernels by at most the queue it fills."""
        now, self.micro_done = time.perf_counter(), (done, of)
        if done < of and now - self.micro_line >= MICRO_LINE_S:
            self.micro_line = now
            self.write(f"micro-step {done:,} of {of:,} of step {self.steps_taken + 1:,}, "
                       f"{duration(now - self.step_start)} into it")

    def step_record(self, step: int, values: dict, seconds: float, layout, world_size: int, health,
                    ended: StepEnd | None = None) -> dict:
        """The metrics.jsonl line of the step that has index `step` (0-based) and is counted as done=step+1;
        prints the warnings it calls for (skipped update, spike, slow data) and, once, the compilation time.
        values: the step's metrics read back from the device (loop.train_step's: train_loss, grad_norm, finite,
        and any other, written under its own name; a skipped step's train_loss and grad_norm are null).
        health: the run's resilience.LossHealth, with this step counted (Guard.observe); only read here.
        seconds: the step's time (ended.seconds()); ended: what end_step noted as the step ended, whose phases,
        time_s, peak memory and LR the line holds; None for a line made as its step ends, which takes them now.
        Its "lr" is the one the optimizer applied (schedule.current_lr), not one recomputed from the flags."""
        if ended is None:
            ended = StepEnd(self.timer.lap(), [], self.elapsed(), peak_memory_gib(self.device),
                            current_lr(self.optimizer))
        self.step_times.append(seconds)
        self.step_tokens.append(layout.tokens_per_step)
        self.tokens += layout.tokens_per_step
        self.done = done = step + 1
        phases = PhaseTimer.read(ended.spans)
        loss, grad_norm, finite = values["train_loss"], values["grad_norm"], bool(values["finite"])
        self.extra_names = [name for name in values if name not in STEP_METRICS]
        tokens_per_sec = layout.tokens_per_step / seconds
        per_device = tokens_per_sec / world_size
        self.last_loss = loss
        record = {
            "step": done, "tokens": self.tokens, "time_s": round(ended.time_s, 3),
            "epoch": self.tokens / self.epoch_tokens if self.epoch_tokens else None,
            "train_loss": loss if finite else None, "lr": ended.lr,
            "grad_norm": grad_norm if finite else None,
            "tokens_per_sec": tokens_per_sec, "tokens_per_sec_per_device": per_device,
            # per device; equal to the whole job's utilisation of its devices
            "mfu": self.mfu(per_device),
            "loss_ema": health.ema, "loss_var": health.var, "skipped": not finite, "bad_steps": health.bad_total,
            **{f"time_{phase}_ms": 1000 * s for phase, s in phases.items()},
            "peak_mem_gib": ended.peak_mem_gib,
            **{name: values[name] for name in self.extra_names},
        }
        if not finite:
            self.write(f"warning: step {done}: loss {loss}, grad norm {grad_norm}: update skipped "
                       f"({health.bad_in_a_row} in a row, {health.bad_total} in all)")
        if health.spike:
            self.write(f"warning: step {done}: loss spike {loss:.4f}, {loss / health.ema:.1f}x its running average")
        self._compile_time(record)
        if step == self.start_step:
            self.write(f"optimizer state: {optimizer_state_bytes(self.optimizer) / 2**20:.1f} MiB"
                       + (" per rank" if world_size > 1 else ""))
        elif phases["data"] > DATA_WAIT_WARN * seconds and not self.data_warned:  # step 1 also starts the prefetch
            self.data_warned = True
            self.write(f"warning: step {done} spent {100 * phases['data'] / seconds:.0f}% of its time waiting for "
                       "data (time_data_ms in metrics.jsonl has every step); the loader is a bottleneck")
        return record

    def mfu(self, tokens_per_sec_per_device: float) -> float | None:
        return self.flops_per_token * tokens_per_sec_per_device / self.peak_flops if self.peak_flops else None

    def _compile_time(self, record: dict) -> None:
        times, timed_steps = self.step_times, min(COMPILE_TIMING_STEPS, self.max_steps - self.start_step)
        if self.cfg.speed.compile != "off" and len(times) == timed_steps:
            record["compile_s"] = self.compile_s = compile_seconds(times)
            self.write(f"torch.compile: first step {times[0]:.1f} s, about {record['compile_s']:.1f} s of it "
                       f"compilation (first minus the median of the next {plural(len(times) - 1, 'step')})")

    def log(self, record: dict) -> None:
        """Write the step's record and move the progress bar (which a failed loop has closed already: its last
        records are written after it, train.log_unread)."""
        self.metrics.log(record)
        self.source_epochs.update({k[len("epoch/"):]: v for k, v in record.items() if k.startswith("epoch/")})
        if "val_loss" in record:
            self._remember_eval(record["step"], record)
        if self.progress is not None:
            extra = "".join(f", {name} {record[name]:.4g}" for name in self.extra_names)
            self.progress.set_postfix(f"loss {self.last_loss:.3f}{extra}, {record['tokens_per_sec']:,.0f} tok/s")
            self.progress.update()

    def _remember_eval(self, done: int, metrics: dict) -> None:
        """The summary's last eval: step `done`'s val loss and bpb."""
        self.last_eval = {"step": done, "val_loss": metrics["val_loss"], "val_bpb": metrics.get("val_bpb")}

    def amend_eval(self, done: int, metrics: dict) -> None:
        """The eval of step `done`, measured again after a resume or rollback, into that step's record when it
        lacks it (MetricsLog.amend) and into the summary's last eval."""
        self.metrics.amend(done, metrics)
        self._remember_eval(done, metrics)

    def rewind(self, step: int, tokens: int, restored_record: dict | None = None) -> None:
        """Forget the records after `step` steps: they will be redone (after a rollback from a checkpoint
        holding `tokens` and the step's record). time_s goes on: the time spent was spent."""
        self.metrics.truncate(step, restored_record)
        self.tokens, self.done, self.steps_taken = tokens, step, step
        if self.last_eval is not None and self.last_eval["step"] > step:
            self.last_eval = None
        if self.progress is not None:
            self.progress.reset(step)

    @contextmanager
    def loop(self):
        """The step loop's progress bar and profiler, open while it runs; its clock (time_s) starts here, and the
        log (truncated to the resumed step, or emptied for a fresh run) is written now that the run starts."""
        self.metrics.begin()
        self.loop_start = time.perf_counter()
        self.progress = Progress(self.max_steps, "train", unit="step", initial=self.start_step, enabled=self.is_main,
                                 every=self.cfg.log.log_interval)
        if self.cfg.log.profile:
            self.profiler = start_profiler(self.device, self.cfg.ckpt.out_dir, self.is_main)
        if self.cfg.speed.compile != "off":
            self.write(f"torch.compile ({self.cfg.speed.compile}): compiling the model during the first step; a line "
                       f"every {HEARTBEAT_S:.0f} s until it is done")
        last_output = lambda: max(self.last_write, self.progress.last_output)  # noqa: E731
        try:
            with Heartbeat(HEARTBEAT_S, self.still_running, self.write, last_output) if self.is_main else nullcontext():
                yield
        finally:
            if self.profiler is not None:
                self.profiler.stop()
            self.progress.close()
            self.progress = self.profiler = None

    def still_running(self, quiet_s: float) -> str | None:
        """The heartbeat's line: where the loop is, and why a first step may be slow; None while the step, or the
        eval, checkpoint or read-back after it, has run less than HEARTBEAT_S (a long --log-interval's quiet)."""
        running = time.perf_counter() - (self.step_start if self.in_step else self.between_start)
        if running < HEARTBEAT_S:
            return None
        if not self.in_step:
            return f"still running: {duration(running)} since the last step (an eval, a checkpoint or a read-back)"
        done, of = self.micro_done
        micro = f", micro-step {done + 1:,} of {of:,}" if of > 1 else ""
        compiling = (" (torch.compile compiles the model during this process's first step)"
                     if self.cfg.speed.compile != "off" and self.steps_taken == self.start_step else "")
        return (f"still running: step {self.steps_taken + 1:,}{micro}, "
                f"{duration(time.perf_counter() - self.step_start)} into it{compiling}")

    def mean_tokens_per_sec(self) -> float | None:
        """This process's tokens over its step time, without its first step (compilation, warm-up) when
        there are others: the steady rate, which a short run's first step would otherwise swamp."""
        times, tokens = (self.step_times[1:], self.step_tokens[1:]) if len(self.step_times) > 1 else \
            (self.step_times, self.step_tokens)
        return sum(tokens) / sum(times) if times else None

    def summary(self, outcome: str, wall_s: float, best_val: float | None, world_size: int) -> dict | None:
        """The end-of-run block (rank 0): what the run did, where its weights are, what to run next. -> the facts
        its rows are made of (summary_rows), for report.py; None on the other ranks."""
        if not self.is_main:
            return None
        rate = self.mean_tokens_per_sec()
        facts = {
            "outcome": outcome, "wall_s": wall_s, "compile_s": self.compile_s, "start_step": self.start_step,
            "train_s": self.elapsed(),
            "done": self.done, "max_steps": self.max_steps, "tokens": self.tokens,
            "session_tokens": self.tokens - self.start_tokens, "tokens_per_sec": rate,
            "mfu": self.mfu(rate / world_size) if rate else None, "last_eval": self.last_eval,
            "best_val": best_val, "peak_mem_gib": peak_memory_gib(self.device), "device": self.device.type,
            "out_dir": self.cfg.ckpt.out_dir, "final_ckpt": newest_checkpoint(self.cfg.ckpt.out_dir),
            "best_ckpt": existing_best(self.cfg.ckpt.out_dir), "epoch_tokens": self.epoch_tokens,
            "bos": self.cfg.data.packing == "bos", "source_epochs": self.source_epochs,
            "sample_prompt": self.cfg.eval.sample_prompt, "eval_plan": self.eval_plan, "precision": self.precision,
            # what keeps the model from transformers (hf.py's export): --from-hf's came from there
            "export_problem": None if self.cfg.ckpt.from_hf else exportable_problem(self.cfg.model),
        }
        print("\nrun summary", flush=True)
        print_table(summary_rows(facts))
        return facts

    def write(self, text: str) -> None:
        """A line for the user: above the progress bar inside the loop, plainly outside it; rank 0 only."""
        self.last_write = time.perf_counter()
        if self.progress is not None:
            self.progress.write(text)
        elif self.is_main:
            message(text)

    def close(self) -> None:
        self.metrics.close()


# ----------------------------------------------------------------------------- the end-of-run summary


def newest_checkpoint(out_dir: str) -> str | None:
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def existing_best(out_dir: str) -> str | None:
    return next((best_path(out_dir, s) for s in (False, True) if os.path.exists(best_path(out_dir, s))), None)


def summary_rows(f: dict) -> list[tuple[str, str]]:
    """The summary block's rows from the facts Telemetry.summary gathers. Pure."""
    compiled = f" ({f['compile_s']:.1f} s of it compiling)" if f["compile_s"] is not None else ""
    steps = f"{f['done']:,} of {f['max_steps']:,}" + (f", resumed at {f['start_step']:,}" if f["start_step"] else "")
    session = f", {f['session_tokens']:,} in this process" if f["start_step"] else ""
    ev = f["last_eval"]
    val = "no eval ran in this process" if ev is None else (
        f"{ev['val_loss']:.4f} at step {ev['step']:,}" + (f" (bpb {ev['val_bpb']:.4f})" if ev["val_bpb"] else ""))
    if f["best_val"] is not None and math.isfinite(f["best_val"]):
        val += f"; best {f['best_val']:.4f}"
    rate = "n/a" if f["tokens_per_sec"] is None else f"{f['tokens_per_sec']:,.0f} tokens/s" + (
        f", MFU {100 * f['mfu']:.1f}%" if f["mfu"] is not None else ", MFU n/a (no peak FLOP/s known)")
    memory_kind = "allocated by tensors" if f["device"] == "cuda" else "process resident set"
    # A resumed run's training loop time across all its processes (metrics.jsonl's time_s goes on over resumes).
    across = f"; the run's training loop {duration(f['train_s'])} over all its processes" \
        if f["start_step"] and f.get("train_s") else ""
    rows = [("outcome", f["outcome"]), ("wall time", f"{duration(f['wall_s'])} this process{compiled}{across}"),
            ("steps", steps),
            ("tokens", f"{f['tokens']:,}{session}"),
            *([("epochs", describe_epochs(f["tokens"], f["epoch_tokens"], f["bos"]))] if f["epoch_tokens"] else []),
            *([("epochs", "of each source's train split, read: " + ", ".join(
                f"{name} {epochs:.2f}" for name, epochs in f["source_epochs"].items()))] if f["source_epochs"] else []),
            ("val loss", val), ("mean throughput", rate),
            *([("precision", f["precision"])] if f.get("precision") else []),  # summaries before it: none
            ("peak memory", f"{f['peak_mem_gib']:.2f} GiB ({memory_kind})"),
            ("final checkpoint", f["final_ckpt"] or "none written"),
            ("best checkpoint", f["best_ckpt"] or "none (no eval improved on the best yet)")]
    weights = f["best_ckpt"] or f["final_ckpt"]
    if weights:
        prompt = f" --prompt {shlex.quote(f['sample_prompt'])}" if f["sample_prompt"] else ""
        export = (f"python hf.py --ckpt {shlex.quote(weights)} --out {shlex.quote(os.path.join(f['out_dir'], 'hf'))}"
                  if not f.get("export_problem") else f"none: {f['export_problem']}")
        rows += [("sample", f"python sample.py --ckpt {shlex.quote(weights)}{prompt}"), ("export", export)]
    if f["done"]:  # metrics.jsonl has records to draw
        rows.append(("plot", f"python bench/plot.py {shlex.quote(f['out_dir'])}"))
    return rows
