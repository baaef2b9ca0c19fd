"""The training loop on its Run: the step, the read-back, each step's eval and checkpoint, recovery.

The training loop and everything it does to its Run: one optimizer step (train_step), the loop that asks
each component whether it is due (run_loop), the read-back of the steps queued on the device, the eval and
checkpoint of a step, and what happens when a step does not go as planned (a stop signal, an out-of-memory
error, a streak of non-finite steps). One loop serves a single device, DDP and FSDP2; train.py builds the Run.

    run = train.setup(cfg)        # a Run, checked and announced
    run_loop(run)                 # -> why the run stopped early, or None

The host queues steps without waiting for the GPU: each one's loss, grad norm and finite flag stay tensors
until a read-back fetches a window of them in one transfer (one wait for the GPU), so that the host can queue
the next step's kernels while the device still runs this one; read_due decides when (on a CPU, after every
step), and the window then becomes the guard's observations and telemetry's records, in step order.
"""

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

import batch
import distributed
import fp8
import hardware
import memory
import mixture
from checkpoint import Checkpointer, tokens_trained
from cli import UsageError
from config import Config
from data import ShardLoader
from evaluation import Evaluator
from model import ModelConfig
from optim import step_if_finite
from resilience import Guard, StepInterrupted, StopSignals, TrainingHalted
from rundir import RunLock
from schedule import lr_multiplier, set_lr
from telemetry import StepEnd, Telemetry


@dataclass
class Run:
    """Everything the loop needs, built and checked by setup() before the first step."""

    cfg: Config
    model_cfg: ModelConfig  # cfg.model, or the shape of the --from-hf weights
    info: distributed.DistInfo
    device: torch.device
    autocast_dtype: torch.dtype | None
    fp8_recipe: object  # Transformer Engine's recipe under --fp8 te, else None
    model: torch.nn.Module  # the bare model (FSDP2 shards it in place); state dicts come from here
    wrapped: torch.nn.Module  # what DDP's no_sync / FSDP2's gradient sync act on
    compiled: torch.nn.Module  # what the forward calls
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loader: ShardLoader | mixture.MixtureLoader
    layout: batch.BatchLayout  # replaced (not changed) by the out-of-memory retry
    max_steps: int
    start_step: int
    guard: Guard
    evaluator: Evaluator
    checkpointer: Checkpointer
    telemetry: Telemetry
    lock: RunLock | None  # rank 0's hold on --out-dir
    step_layout: batch.BatchLayout | None = None  # the step in progress under the batch warm-up (run_loop sets it)

    def autocast(self):
        return hardware.forward_context(self.device, self.autocast_dtype, fp8.fp8_context(self.fp8_recipe))

    def close(self):
        self.loader.close()
        self.telemetry.close()
        if self.lock is not None:
            self.lock.release()


# ----------------------------------------------------------------------------- the step


def train_step(run: Run, interruptible=nullcontext):
    """One optimizer step over grad_accum micro-batches (run.step_layout's during the batch warm-up) -> its
    metrics by name, scalars on the device (train_loss: the mean over ranks, grad_norm, finite): the host
    queues the step without waiting for the GPU, and read_back fetches them all in one transfer. A stop signal
    may cut the micro-steps short (StopSignals.interruptible), never the update. Each micro-batch's forward and
    backward run inside fp8.micro_step, which tells Transformer Engine's modules which one of the step it is.

    A non-finite loss or gradient norm skips the update: parameters and optimizer state stay exactly as
    they were, decided on the device where the optimizer can (optim.step_if_finite). The fp16 GradScaler's
    own skip is part of it (an overflowed gradient has a non-finite norm), so its step is not called: it
    would read its flag on the host. Every rank sees the same all-reduced loss and norm, so all ranks skip
    together.
    """
    timer, grad_accum = run.telemetry.timer, (run.step_layout or run.layout).grad_accum
    loss_sum = torch.zeros((), device=run.device)
    with interruptible():
        for micro in range(grad_accum):
            with timer("data"):
                x, y = next(run.loader)
            last = micro == grad_accum - 1
            with distributed.set_grad_sync(run.wrapped, run.info, last), fp8.micro_step(run.model, micro, grad_accum):
                with timer("forward"), run.autocast():
                    _, loss = run.compiled(x, y)
                loss_sum += loss.detach()
                with timer("backward"):
                    run.scaler.scale(loss / grad_accum).backward()
            run.telemetry.micro_step(micro + 1, grad_accum)
    with timer("optimizer"):
        run.scaler.unscale_(run.optimizer)
        clip = run.cfg.schedule.grad_clip
        grad_norm = distributed.clip_grad_norm(run.model, clip if clip > 0 else float("inf"))
        loss = distributed.mean_across_ranks(loss_sum / grad_accum, run.info)
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        step_if_finite(run.optimizer, finite)
        run.scaler.update()  # from the overflow check unscale_ made
        run.optimizer.zero_grad(set_to_none=True)
    return {"train_loss": loss, "grad_norm": grad_norm, "finite": finite}  # a device-side metric: one more entry


# ----------------------------------------------------------------------------- the loop


def run_loop(run: Run) -> str | None:
    """Train to max_steps; -> why the run stopped early on purpose (signal, early stopping), or what the
    user should know about its end; the end-of-run summary shows it.

    The host queues steps without waiting for the GPU and reads their losses back only when read_due says;
    then the guard counts each of them in order and each gets its record, as if they had been read one by one."""
    s, signals = run.cfg.schedule, StopSignals(interrupt=run.info.mode == "none")
    step, oom_retried, taken = run.start_step, False, []
    try:
        with run.telemetry.loop():
            if run.start_step:  # resumed
                recount_restored_eval(run, run.start_step)
            while step < run.max_steps:
                multiplier = run.guard.lr_scale * lr_multiplier(step, run.max_steps, s.warmup, s.schedule,
                                                                s.min_lr_ratio, s.decay_frac)
                set_lr(run.optimizer, multiplier)
                run.step_layout = run.layout.at_step(step, s.batch_warmup_steps, s.batch_warmup_start)
                loader_state, signals.steps_done = run.loader.state_dict(), step
                try:
                    with run.telemetry.timing_step():
                        metrics = train_step(run, signals.interruptible)
                except StepInterrupted:
                    rewind_step(run, loader_state)
                    return keep_last_step(run, step, taken, signals)
                except torch.cuda.OutOfMemoryError:
                    smaller = 0 if oom_retried else memory.retry_micro_batch(run.layout, run.cfg.fp8)
                    if not smaller:
                        raise
                    oom_retried = True
                    shrink_micro_batch(run, loader_state, smaller)
                    continue
                taken.append(Taken(step, metrics, run.step_layout, run.telemetry.end_step(),
                                   run.loader.record_fields()))
                step += 1
                if not read_due(run, step, signals):
                    continue
                window, taken = taken, []
                signalled = stop_requested(run, signals)  # acted on after the window's last step
                for done, record in read_back(window, run.guard, run.telemetry, run.info.world_size):
                    signal_now = signalled and done == step
                    # The step's checkpoint before its eval: an eval that fails cannot cost it.
                    saved = save_if_due(run, done, record,
                                        regular=run.checkpointer.due(done, run.max_steps) or signal_now)
                    improved, stop_early = evaluate_if_due(run, record, done)
                    run.telemetry.log(record)
                    if run.guard.must_roll_back():  # the window's later steps are dropped with the weights
                        step = rollback(run)
                        if stop_requested(run, signals):  # the checkpoint just restored is where a resume starts
                            return f"stopped by {signals.requested or 'a signal to another rank'} after a rollback"
                        recount_restored_eval(run, step)
                        break
                    saved = save_if_due(run, done, record, regular=stop_early, best=improved, written=saved)
                    if stopped := stop_reason(run, done, signals, signal_now, stop_early, saved):
                        return stopped
        return run.guard.unfinished_streak()
    except Exception:
        log_unread(taken, run.guard, run.telemetry, run.info.world_size)
        raise
    finally:
        signals.restore()


def stop_requested(run: Run, signals: StopSignals) -> bool:
    return distributed.any_across_ranks(signals.requested is not None, run.info, run.device)


def save_if_due(run: Run, done: int, record: dict, regular: bool, best: bool = False, written: bool = False) -> bool:
    """Write step `done`'s regular checkpoint when asked, unless `written` (it is on disk already), and the
    best one when the val loss improved: a second name for the regular one when that exists. Never a regular
    one inside a streak of non-finite steps (resilience.Guard). -> whether the step's regular one is on disk."""
    regular = regular and not written and run.guard.may_checkpoint()
    if best and written:
        run.checkpointer.link_best(done)
    elif regular or best:  # skipped steps leave the weights as they were, so a new best is still good
        run.checkpointer.save(done, run.model, run.optimizer, run.loader, run.guard, run.telemetry.tokens,
                              regular=regular, best=best, batch_tokens=run.layout.tokens_per_step,
                              record=record)
    return written or regular


def keep_last_step(run: Run, step: int, taken: list, signals: StopSignals) -> str:
    """After a stop signal cut step step + 1 short: log the steps taken since the last read-back and write step
    `step`'s checkpoint, unless it is on disk (the read-back at a due checkpoint wrote it) -> the stop reason."""
    record, on_disk = None, not taken and run.checkpointer.due(step, run.max_steps) and run.guard.may_checkpoint()
    for _, record in read_back(taken, run.guard, run.telemetry, run.info.world_size):
        run.telemetry.log(record)
    if step == run.start_step:
        return f"stopped by {signals.requested} during step {step + 1}, before this process completed a step"
    started = time.perf_counter()
    saved = save_if_due(run, step, record, regular=True, written=on_disk)
    return interrupted_reason(signals.requested, step, saved, None if on_disk else time.perf_counter() - started)


# ----------------------------------------------------------------------------- read-back


@dataclass
class Taken:
    """A step taken whose results are still on the device, with what the host noted as it ended."""

    index: int  # 0-based: done once index + 1 steps are
    metrics: dict  # train_step's: {name: a scalar on the device}
    layout: batch.BatchLayout
    ended: StepEnd
    data: dict  # what the loader said of the data as the step ended (its record_fields)


def read_back(window: list[Taken], guard: Guard, telemetry: Telemetry, world_size: int):
    """The window's step metrics (train_step's, by name: the loss, grad norm and finite flag, and any other),
    fetched in one transfer, then each step counted in order: the guard observes it, then its record is made
    -> (done, record) pairs, lazily, so that a rollback ends the window at the step that calls for it.
    Non-finite steps were skipped on the device as they ran, so the guard's verdict may come later without
    anything to undo."""
    if not window:
        return
    names = list(window[0].metrics)
    rows = torch.stack([t.metrics[name].float() for t in window for name in names]).view(-1, len(names)).tolist()
    for t, row in zip(window, rows):
        values = dict(zip(names, row))
        health = guard.observe(values["train_loss"], bool(values["finite"]))
        record = telemetry.step_record(t.index, values, t.ended.seconds(), t.layout, world_size, health, t.ended)
        record.update(t.data)
        yield t.index + 1, record


def log_unread(window: list[Taken], guard: Guard, telemetry: Telemetry, world_size: int) -> None:
    """Write the records of the steps taken since the last read-back, for a run that fails before the next one
    (a bad shard, a bug): the log keeps every step that finished. Only what can be read: where the device
    itself failed, the run's own error is the one to report."""
    if not window:
        return
    try:
        for _, record in read_back(window, guard, telemetry, world_size):
            telemetry.log(record)
    except RuntimeError:  # the device failed (a CUDA error): what it held is lost
        pass


def reads_every_step(device: torch.device) -> bool:
    """Whether the host reads each step back as it ends: on a CPU, which runs a step's kernels as the host
    queues them, a window saves no wait, and the progress line moves a step at a time."""
    return device.type == "cpu"


def read_due(run: Run, done: int, signals) -> bool:
    """Read the steps taken back from the device after step `done`? Every step on a CPU (reads_every_step);
    elsewhere after this process's first step (its line comes whatever --log-interval is), every
    --log-interval steps, at the end, and where something acts on them: a checkpoint (never one inside a
    streak of non-finite steps) or an eval; in a single process also once a stop signal has come. Under
    torch.distributed every rank must read at the same steps (all run on the same kind of device), so a signal
    waits for the next of those (stop_requested asks all ranks then)."""
    return (reads_every_step(run.device) or done % run.cfg.log.log_interval == 0 or done == run.start_step + 1
            or run.checkpointer.due(done, run.max_steps)
            or run.evaluator.due(done, run.max_steps)
            or (run.info.mode == "none" and signals.requested is not None))


# ----------------------------------------------------------------------------- a step that does not go as planned


RESUME_HINT = "Resume with the same command plus --resume"
NOT_IN_A_STREAK = "no checkpoint inside a streak of non-finite steps"


def stop_reason(run: Run, done: int, signals, signalled: bool, stop_early: bool, saved: bool) -> str | None:
    """Why the run stops after step `done` (saved: its checkpoint is on disk), or None when it goes on."""
    if signalled:
        written = "checkpoint written" if saved else NOT_IN_A_STREAK
        return f"stopped by {signals.requested or 'a signal to another rank'} at step {done}; {written}. {RESUME_HINT}"
    if stop_early:
        return (f"early stop at step {done}: val loss has not improved on {run.guard.early_stop.best:.4f} for "
                f"{run.cfg.resilience.early_stop_patience} evals; the best weights are in {run.checkpointer.best_path}")
    return None


def interrupted_reason(signal_name: str, step: int, saved: bool, write_s: float | None) -> str:
    """The stop reason after a signal cut step step + 1 short (keep_last_step); write_s: how long step
    `step`'s checkpoint took to write, None when it was on disk already."""
    kept = ("its checkpoint on disk already" if write_s is None else f"its checkpoint written in {write_s:.1f} s"
            ) if saved else NOT_IN_A_STREAK
    return f"stopped by {signal_name} during step {step + 1}, which is dropped; kept step {step}, {kept}. {RESUME_HINT}"


def rollback(run: Run) -> int:
    """After too many non-finite steps: reload the newest good checkpoint and continue with a lower LR."""
    try:
        meta = run.checkpointer.restore(run.model, run.optimizer, run.loader, warn=run.telemetry.write)
    except UsageError:
        raise TrainingHalted(f"{run.cfg.resilience.max_bad_steps} non-finite steps in a row and no checkpoint to "
                             "roll back to yet; restart with a lower --lr") from None
    if fp8.is_delayed(run.fp8_recipe):  # the restored weights start a fresh amax history, as a resume's do
        fp8.reset_delayed_scaling(run.model)
    run.guard.rolled_back(meta)
    run.telemetry.rewind(meta["step"], tokens_trained(meta, run.layout.tokens_per_step), meta.get("record"))
    run.telemetry.write(f"rolled back to step {meta['step']} after {run.cfg.resilience.max_bad_steps} non-finite "
                        f"steps; LR now x{run.guard.lr_scale:g} of the schedule")
    return meta["step"]


def rewind_step(run: Run, loader_state: dict) -> None:
    """Undo a step cut short before its update: its gradients, phase times and batches (the loader as before it)."""
    run.optimizer.zero_grad(set_to_none=True)
    run.telemetry.timer.collect()
    run.loader.load_state_dict(loader_state)


def shrink_micro_batch(run: Run, loader_state: dict, smaller: int) -> None:
    """After an out-of-memory error mid-step: rewind the step and redo it with a smaller micro-batch and more
    micro-steps, so the global batch and the data order stay exactly the same."""
    rewind_step(run, loader_state)
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    run.layout = run.layout.with_micro_batch(smaller)
    run.loader.resize(smaller)
    run.telemetry.write(f"warning: out of memory; retrying the step with micro-batch {smaller} x "
                        f"{run.layout.grad_accum} micro-steps (same global batch)")


# ----------------------------------------------------------------------------- evals during training
# The eval of a step that is due, and the one a restored checkpoint missed.


def evaluate_if_due(run: Run, record: dict, done: int) -> tuple[bool, bool]:
    """Validation loss and bits per byte, HellaSwag accuracy (all into the record) and a sample, when the
    Evaluator says so -> (improved, stop early). An eval that runs out of memory is skipped (the record's
    "eval_skipped" says so) and training goes on; any other failure ends the run, after the step's checkpoint."""
    if not run.evaluator.due(done, run.max_steps):
        return False, False
    result = _measure(run, done)
    if result is None:
        record["eval_skipped"] = "out of memory"
        return False, False
    metrics, text = result
    record.update(metrics)
    improved, stop_early = run.guard.early_stop.update(record["val_loss"], done)
    write = run.telemetry.write
    write(f"step {done}: train loss {run.telemetry.last_loss:.4f}, {run.evaluator.describe(record)}"
          + (" (best so far)" if improved else ""))
    if text is not None:
        record["sample"] = text  # for report.py's last samples
        write(f"sample at step {done}: {text!r}")
    return improved, stop_early


def _measure(run: Run, done: int, full: bool = True):
    return run.evaluator.measure(run.compiled, run.model, run.autocast, run.autocast_dtype, run.layout.micro_batch,
                                 run.layout.seq_len, run.telemetry.write, done, full)


def recount_restored_eval(run: Run, done: int) -> None:
    """A regular checkpoint is written before its step's eval (run_loop): once one is restored (a resume, a
    rollback) whose early stopping has not counted that eval, measure its val loss again and count it, as the
    run that wrote it did, and give it to the step's record if the log lost it. best stays as it is (it may
    hold a later step)."""
    if not run.evaluator.due(done, run.max_steps) or run.guard.early_stop.has_counted(done):
        return
    if (result := _measure(run, done, full=False)) is not None:
        metrics = result[0]
        run.guard.early_stop.update(metrics["val_loss"], done)
        run.telemetry.amend_eval(done, metrics)
        run.telemetry.write(f"step {done}: val loss {metrics['val_loss']:.4f}, measured again for early stopping "
                            "(the checkpoint precedes its eval)")
