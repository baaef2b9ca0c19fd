"""The run directory (--out-dir): one run at a time in it, and a fresh run never lands on an old one.

    lock, resume = claim(cfg.ckpt)   # rank 0: create and lock out_dir, then fresh or resume; lock.release()

Two runs writing one directory would replace each other's checkpoints and interleave metrics.jsonl, so the
first takes an exclusive flock on `.lock` and the second stops at once, naming the holder's pid. The kernel
drops the lock when its process dies, however it dies, so a killed run never blocks its own resume.

A fresh run into a directory that holds a run (checkpoints, best, metrics.jsonl) is refused unless the
user says what to do: --resume continues it, --overwrite removes it first, --resume auto continues it when
it has a checkpoint and starts fresh otherwise (what a restart script or a cluster scheduler wants).
"""

import errno
import os
import sys

from checkpoint import best_path, list_checkpoints, remove
from cli import UsageError

LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"
RESUME_MODES = ("off", "on", "auto")


class RunLock:
    """An exclusive lock on out_dir for this process's lifetime (POSIX flock; no lock where there is none)."""

    def __init__(self, out_dir: str):
        try:
            import fcntl
        except ImportError:  # Windows: no flock
            self.fd = None
            return
        path = os.path.join(out_dir, LOCK_FILE)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # a filesystem without flock (some NFS, Lustre)
                print(f"warning: --out-dir {out_dir} cannot be locked ({e.strerror}); make sure no other run "
                      "writes to it", file=sys.stderr)
                return
            holder = os.read(self.fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise UsageError(f"--out-dir {out_dir} is in use by another run (pid {holder}); wait for it to end "
                             "or choose another --out-dir") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, str(os.getpid()).encode())

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def run_outputs(out_dir: str, checkpoints: list[str]) -> list[str]:
    """The paths of what a run leaves in out_dir: its checkpoints (list_checkpoints), best, metrics.jsonl."""
    found = list(checkpoints)
    for sharded in (False, True):
        if os.path.exists(best_path(out_dir, sharded)):
            found.append(best_path(out_dir, sharded))
    if os.path.exists(os.path.join(out_dir, METRICS_FILE)):
        found.append(os.path.join(out_dir, METRICS_FILE))
    return found


def decide_resume(outputs: list[str], has_checkpoint: bool, resume: str, overwrite: bool) -> bool:
    """Resume (True) or start fresh (False) in a directory holding `outputs`. Pure.

    on: resume (the Checkpointer refuses when there is nothing to resume); auto: resume when there is a
    checkpoint; off: start fresh, which an earlier run's outputs forbid unless overwrite."""
    if resume == "on" or (resume == "auto" and has_checkpoint):
        return True
    if outputs and not overwrite and resume == "off":
        names = ", ".join(sorted(os.path.basename(p) for p in outputs)[:3]) + (", ..." if len(outputs) > 3 else "")
        directory = os.path.dirname(outputs[0]) or "."
        raise UsageError(f"--out-dir {directory} already holds a run ({names}): pass --resume to continue it, "
                         "--overwrite to replace it, or choose another --out-dir")
    return False


def remove_outputs(outputs: list[str]) -> None:
    """--overwrite: delete an earlier run's outputs (asked for explicitly)."""
    for path in outputs:
        remove(path)


def claim(ckpt_cfg) -> tuple[RunLock, bool, list[str]]:
    """Create and lock --out-dir, decide fresh or resume -> (lock, resume, what --overwrite replaces: the
    caller removes it once the run has passed its start-up checks). ckpt_cfg: config.CheckpointConfig."""
    out_dir = ckpt_cfg.out_dir
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out-dir {out_dir} cannot be created: {e.strerror}") from None
    if not os.access(out_dir, os.W_OK):
        raise UsageError(f"--out-dir {out_dir} is not writable")
    lock = RunLock(out_dir)
    try:
        checkpoints = list_checkpoints(out_dir)
        outputs = run_outputs(out_dir, checkpoints)
        resume = decide_resume(outputs, bool(checkpoints), ckpt_cfg.resume, ckpt_cfg.overwrite)
    except UsageError:
        lock.release()
        raise
    return lock, resume, outputs if not resume and ckpt_cfg.overwrite else []
