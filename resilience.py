"""Guard: loss health, early stopping, the rollback policy; stop signals.

Plain logic, no model or data: train.py wires it.
"""

import math
import os
import signal
import socket
import sys
from contextlib import contextmanager

from cli import speaks_for_the_run


class LossHealth:
    """Tracks the training loss: an EMA and variance for the logs, spikes, and runs of non-finite steps.

    A spike is a loss above `spike_factor` times the EMA, once the EMA has seen `warmup` steps (the first
    steps fall too fast for an average to mean anything). Non-finite steps do not enter the averages.
    """

    def __init__(self, spike_factor: float = 3.0, beta: float = 0.95, warmup: int = 20):
        self.spike_factor, self.beta, self.warmup = spike_factor, beta, warmup
        self.ema, self.var, self.seen = 0.0, 0.0, 0
        self.bad_in_a_row = 0
        self.bad_total = 0
        self.spike = False  # the step recorded last was one: its record warns

    def update(self, loss: float, finite: bool) -> bool:
        """Record one step; returns True when it is a spike worth a warning."""
        self.spike = False
        if not finite:
            self.bad_in_a_row += 1
            self.bad_total += 1
            return False
        self.bad_in_a_row = 0
        self.spike = bool(self.spike_factor) and self.seen >= self.warmup and loss > self.spike_factor * self.ema
        if self.seen == 0:
            self.ema = loss
        else:
            delta = loss - self.ema
            self.ema += (1 - self.beta) * delta
            self.var = self.beta * (self.var + (1 - self.beta) * delta * delta)
        self.seen += 1
        return self.spike

    def state_dict(self) -> dict:
        return {"ema": self.ema, "var": self.var, "seen": self.seen, "bad_in_a_row": self.bad_in_a_row,
                "bad_total": self.bad_total}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class EarlyStopping:
    """Stop when the validation loss has not improved for `patience` evaluations in a row (0: never)."""

    def __init__(self, patience: int):
        self.patience = patience
        self.best = math.inf
        self.evals_since_best = 0
        self.step = 0  # the step of the last eval counted

    def update(self, val_loss: float, step: int) -> tuple[bool, bool]:
        """Count the eval of step `step` -> (improved, should_stop)."""
        self.step = step
        if val_loss < self.best:
            self.best, self.evals_since_best = val_loss, 0
            return True, False
        self.evals_since_best += 1
        return False, bool(self.patience) and self.evals_since_best >= self.patience

    def has_counted(self, step: int) -> bool:
        """Has the eval of step `step` been counted? A regular checkpoint is written before its step's eval
        (loop.run_loop), so the state it holds has not counted that one."""
        return self.step is None or self.step >= step

    def state_dict(self) -> dict:
        return {"best": self.best, "evals_since_best": self.evals_since_best, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.evals_since_best = state["best"], state["evals_since_best"]
        self.step = state.get("step")  # None: a checkpoint that records none was written after its eval


# What stops a run: SIGTERM (preemption, torchrun passing one on, a scheduler's kill), SIGINT (Ctrl-C) and SIGUSR1,
# the warning SLURM sends ahead of a time limit (--signal=USR1@SECONDS), which would otherwise kill the process.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# What a signal outside the step loop does, by phase: before the loop nothing is trained yet, so it stops the run;
# after it every step is done and every checkpoint on disk whole, so the first signal lets the run write its
# records (report.md, summary.json: seconds) and exit 0 as a finished run does, and a second exits at once.
STOP_NOTES = {"start-up": "during start-up: stopping before the first step (nothing to save)",
              "wind-down": "after the last step: writing the run's records, then exiting (again to exit at once; "
                           "every checkpoint written is whole)"}


def stop_at_once(phase: str = "start-up", stopped_by: str | None = None) -> None:
    """A stop signal outside the step loop (which installs StopSignals): one line saying what it means in this
    phase (STOP_NOTES), from the process that speaks for the run only (torchrun stops the others so when rank 0
    has refused the run: its line is the one to read). Exiting, it exits 128 + the signal's number, as a shell
    expects. stopped_by: the signal that stopped the loop, if one did: the next is a second, which exits."""
    signalled = [stopped_by] if stopped_by else []

    def handle(signum, frame):
        name = signal.Signals(signum).name
        note = f"{name} again: exiting now" if signalled else f"{name} {STOP_NOTES[phase]}"
        if speaks_for_the_run():
            print(f"\n{note}", file=sys.stderr, flush=True)
        if phase == "wind-down" and not signalled:
            signalled.append(name)
            return
        sys.exit(128 + signum)

    handle.phase = phase
    for sig in STOP_SIGNALS:
        signal.signal(sig, handle)


class StepInterrupted(BaseException):
    """A stop signal cut a step short before its update (StopSignals.interruptible): the step is dropped. A
    BaseException, as KeyboardInterrupt is, so that no library's `except Exception` (torch.compile's, which
    re-raises what it catches as its own error) turns it into a crash."""


class StopSignals:
    """SIGTERM (preemption), SIGINT (Ctrl-C) and SIGUSR1 (a time limit near) stop the run; a second SIGINT exits
    at once, even while a checkpoint is being written (writes are atomic: a temporary name is never taken for a
    checkpoint).

    In a single process (`interrupt`) a signal during a step's micro-steps ends that step at once: the handler
    raises StepInterrupted there, train.py drops the step (its gradients and data are rewound) and keeps the
    last completed one, so a stop answers within seconds however long a step is; during the update, which
    must not be cut in half, it waits for the step's end. Under torch.distributed every rank must stop at
    the same step, so a signal is acted on at the next read-back, where the ranks agree (loop.read_due).

    Python runs a handler once for all the deliveries of a signal since it last looked, so two Ctrl-Cs inside
    one long C call (a matmul, an fsync) would reach it as one. The interpreter also writes one byte per
    delivery to its wakeup fd: the handler counts those."""

    def __init__(self, interrupt: bool = False):
        self.requested = None  # the name of the signal that asked
        self.steps_done = 0  # the run's completed steps, which the loop keeps up to date: whether any can be kept
        self.sigints = 0
        self.interrupt, self.cut_now = interrupt, False
        self.wakeup, self.wakeup_writer = socket.socketpair()
        for end in (self.wakeup, self.wakeup_writer):
            end.setblocking(False)
        self.previous_wakeup = signal.set_wakeup_fd(self.wakeup_writer.fileno(), warn_on_full_buffer=False)
        self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _delivered(self) -> bytes:
        """The signal numbers delivered since the last call, one byte each."""
        try:
            return self.wakeup.recv(4096)
        except BlockingIOError:
            return b""

    def _handle(self, signum, frame):
        # Each delivery wrote one byte; this call's own may have been read already, by the call before it.
        self.sigints += max(self._delivered().count(signal.SIGINT), int(signum == signal.SIGINT))
        name = signal.Signals(signum).name
        if self.sigints >= 2 or (self.requested and signum == signal.SIGINT):
            print(f"\n{name} again: exiting now, without a checkpoint", file=sys.stderr, flush=True)
            os._exit(130)
        self.requested = name
        if self.cut_now:
            self.cut_now = False
            kept = "keeping the last completed one" if self.steps_done else "no step has completed yet: nothing to keep"
            print(f"\n{name}: dropping the step in progress, {kept} (Ctrl-C again to exit at once)", file=sys.stderr,
                  flush=True)
            raise StepInterrupted(name)
        print(f"\n{name}: finishing this step (under torchrun, the next --log-interval step, where the ranks "
              "agree) and writing a checkpoint (Ctrl-C again to exit at once)", file=sys.stderr, flush=True)

    @contextmanager
    def interruptible(self):
        """Around a step's micro-steps: a first signal inside raises StepInterrupted (in a single process)."""
        self.cut_now = self.interrupt and self.requested is None
        try:
            yield
        finally:
            self.cut_now = False

    def restore(self) -> None:
        """Put back the handlers from before the loop, except a start-up one: the loop is over, not to come."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if any(getattr(h, "phase", None) == "start-up" for h in self.previous.values()):
            stop_at_once("wind-down", self.requested)
        signal.set_wakeup_fd(self.previous_wakeup)
        self.wakeup.close()
        self.wakeup_writer.close()


class TrainingHalted(Exception):
    """The run stopped itself for a reason the user must act on (e.g. non-finite steps with no way back)."""


class Guard:
    """A run's fault-tolerance state and policy: loss health, early stopping, and the LR scale that each
    rollback lowers. Its state_dict is part of every checkpoint's meta (checkpoint.Checkpointer).

    A checkpoint is never written inside a streak of non-finite steps (may_checkpoint): the weights that
    produced the streak would be what the next rollback restores, and the rollbacks would never end. And
    a run gets --max-rollbacks of them: one that diverges again after that needs a lower --lr."""

    def __init__(self, cfg):
        """cfg: config.ResilienceConfig."""
        self.cfg = cfg
        self.health = LossHealth(cfg.spike_factor)
        self.early_stop = EarlyStopping(cfg.early_stop_patience)
        self.lr_scale = 1.0
        self.rollbacks = 0

    def observe(self, loss: float, finite: bool) -> LossHealth:
        """Count one step's loss (finite: its update was applied) -> the run's health, which the step's record
        reads and must_roll_back and may_checkpoint act on."""
        self.health.update(loss, finite)
        return self.health

    def may_checkpoint(self) -> bool:
        return self.health.bad_in_a_row == 0

    def must_roll_back(self) -> bool:
        """True after --max-bad-steps non-finite steps in a row; raises TrainingHalted under --on-bad-steps stop
        or once --max-rollbacks are spent."""
        if self.health.bad_in_a_row < self.cfg.max_bad_steps:
            return False
        streak = f"{self.cfg.max_bad_steps} non-finite steps in a row"
        if self.cfg.on_bad_steps == "stop":
            raise TrainingHalted(f"{streak} (--on-bad-steps stop)")
        if self.rollbacks >= self.cfg.max_rollbacks:
            raise TrainingHalted(f"{streak} after {self.rollbacks} rollback(s) (--max-rollbacks "
                                 f"{self.cfg.max_rollbacks}): the run diverges; restart it with a lower --lr")
        return True

    def unfinished_streak(self) -> str | None:
        """What to tell the user when the run ends inside a streak of non-finite steps (no final checkpoint)."""
        if self.may_checkpoint():
            return None
        return (f"the run ended inside a streak of {self.health.bad_in_a_row} non-finite steps; no final "
                "checkpoint was written (the newest one is from before the streak)")

    def rolled_back(self, meta: dict) -> None:
        """Take the restored checkpoint's health and early stopping, with the LR scaled down once more."""
        scale = self.lr_scale * self.cfg.rollback_lr_factor
        self.load_state_dict(meta)
        self.lr_scale = scale
        self.rollbacks += 1  # counted per process: a restart (with a lower --lr, say) gets its own

    def state_dict(self) -> dict:
        return {"lr_scale": self.lr_scale, "health": self.health.state_dict(),
                "early_stop": self.early_stop.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.lr_scale = state["lr_scale"]
        self.health.load_state_dict(state["health"])
        self.early_stop.load_state_dict(state["early_stop"])
