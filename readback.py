"""Steps the host has queued on the device and not yet read: each one's loss, grad norm and finite flag stay
tensors until a read-back fetches a window of them in one transfer (one wait for the GPU), so that the host
can queue the next step's kernels while the device still runs this one. read_due decides when to read (the
rule in one place); here a window becomes the guard's observations and telemetry's records, in step order."""

from dataclasses import dataclass

import torch

from batch import BatchLayout
from resilience import Guard
from telemetry import StepEnd, Telemetry


@dataclass
class Taken:
    """A step taken whose results are still on the device, with what the host noted as it ended."""

    index: int  # 0-based: done once index + 1 steps are
    loss: torch.Tensor
    grad_norm: torch.Tensor
    finite: torch.Tensor
    layout: BatchLayout
    ended: StepEnd
    data: dict  # what the loader said of the data as the step ended (its record_fields)


def read_back(window: list[Taken], guard: Guard, telemetry: Telemetry, world_size: int):
    """The window's losses, grad norms and finite flags, fetched in one transfer, then each step counted in
    order: the guard observes it, then its record is made -> (done, record) pairs, lazily, so that a rollback
    ends the window at the step that calls for it. Non-finite steps were skipped on the device as they ran, so
    the guard's verdict may come later without anything to undo."""
    if not window:
        return
    values = torch.stack([v.float() for t in window for v in (t.loss, t.grad_norm, t.finite)]).view(-1, 3).tolist()
    for t, (loss, grad_norm, finite) in zip(window, values):
        health = guard.observe(loss, bool(finite))
        record = telemetry.step_record(t.index, loss, grad_norm, bool(finite), t.ended.seconds(), t.layout,
                                       world_size, health, t.ended)
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


def read_due(run, done: int, signals) -> bool:
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
