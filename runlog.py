"""metrics.jsonl, written (with wandb and TensorBoard beside it) and read back.

A record is one JSON line, written whole and flushed as each step is counted. A process killed mid-write can
leave its last line torn: no newline, and not JSON. Such a line holds no record anyone could use, so every
reader skips it with one note, and a resume drops it when it rewrites the log. Any other line that is not a
record is damage a person should look at: it is refused, naming the file and line, never dropped.
"""

import json
import os
import sys

from atomic import replace_with
from cli import UsageError, write_error
from records import row_problem

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"  # --tensorboard's event files in the run's directory (MetricsLog)


class MetricsError(Exception):
    """A metrics file that cannot be read as records; its message names the file and line."""


def read_metrics(path: str, required: tuple[str, ...] = ("step", "tokens")) -> tuple[list[dict], str | None]:
    """-> (the records of the metrics.jsonl at path, in file order; a note when a torn last line was
    skipped). No file: no records. MetricsError for a line, other than a torn last one, that is not a JSON
    object with an integer under each key of `required` (blank lines hold nothing and are passed over)."""
    if not os.path.isfile(path):
        return [], None
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines) and not line.endswith("\n"):
                return records, f"note: {path}:{lineno}: the last line was torn (a process stopped mid-write), skipped"
            raise MetricsError(f"{path}:{lineno}: not a JSON line") from None
        if not isinstance(record, dict):
            raise MetricsError(f"{path}:{lineno}: not a JSON object")
        if missing := [key for key in required if not is_count(record.get(key))]:
            raise MetricsError(f"{path}:{lineno}: a record without an integer '{missing[0]}'")
        if problem := row_problem(record, required):
            raise MetricsError(f"{path}:{lineno}: {problem}")
        records.append(record)
    return records, None


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class MetricsLog:
    """metrics.jsonl, plus wandb and TensorBoard (OUT/tensorboard) when asked for. Lines from steps that are
    redone (after a resume or a rollback) are dropped, and so is a line torn by a crash mid-write.

    Steps are counted when done, as everywhere in the project: the record of step N is written once N
    optimizer steps are done, and is the state that ckpt_N holds."""

    def __init__(self, out_dir: str, start_step: int, wandb_run, enabled: bool = True, restored: dict | None = None,
                 tensorboard: bool = False):
        self.path = os.path.join(out_dir, METRICS_FILE)
        self.enabled, self.wandb_run = enabled, wandb_run
        self.tensorboard_dir = os.path.join(out_dir, TENSORBOARD_DIR) if enabled and tensorboard else None
        self.tensorboard = self.purge_step = None  # the writer, opened at the first point (_scalars)
        self.pending = None  # start-up's truncation, written by begin(): a run refused before it starts leaves
        self.last_kept = self.truncate(start_step, restored, deferred=True)  # the earlier run's log as it was

    def truncate(self, done: int, restored: dict | None = None, deferred: bool = False) -> dict | None:
        """Keep only the records of steps up to `done` -> the last of them. `restored`: the record of step
        `done` that its checkpoint holds, written in when the log lacks it: the checkpoint precedes its step's
        eval and log line (loop.run_loop), so a kill between them leaves the log one record short. deferred:
        written by begin(), when the run starts."""
        if not self.enabled:  # only rank 0 writes
            return None
        self._purge_tensorboard_after(done)
        kept, last = [], None
        if done > 0:
            try:
                records, note = read_metrics(self.path, required=("step",))
            except MetricsError as e:
                raise UsageError(f"{e}: the run's log is damaged there; mend or delete that line, then resume (the "
                                 f"resume rewrites the log from its records)") from None
            if note:
                print(note, file=sys.stderr, flush=True)
            # A record without time_s counts its steps from 0 (tested): its step N is step N+1 here.
            records = [r for r in records if r["step"] + ("time_s" not in r) <= done]
            kept, last = [json.dumps(r) + "\n" for r in records], (records[-1] if records else None)
        restored = restored if restored is not None and restored["step"] == done and (
            last is None or last["step"] < done) else None
        if restored is not None:
            kept.append(json.dumps(restored) + "\n")
            last = restored
        self.pending = (kept, restored)
        if not deferred:
            self.begin()
        return last

    def begin(self) -> None:
        """Write the truncated log (and a restored record's TensorBoard points), once, as the run starts."""
        if self.pending is not None:
            (kept, restored), self.pending = self.pending, None
            self._replace(kept)
            if restored is not None:
                self._scalars(restored)

    def amend(self, done: int, fields: dict) -> None:
        """Add to the record of step `done`, the log's last, the `fields` it lacks: the eval a resume measures
        again, whose step's record its checkpoint restored without it (truncate)."""
        self.begin()
        if not self.enabled or not os.path.exists(self.path):
            return
        with open(self.path) as f:
            lines = f.readlines()
        if lines and json.loads(lines[-1])["step"] == done:
            lines[-1] = json.dumps({**fields, **json.loads(lines[-1])}) + "\n"
            self._replace(lines)
            self._scalars({"step": done, **fields})

    def _replace(self, lines: list[str]) -> None:
        """The log becomes `lines`, atomically (atomic.replace_with): a crash at any moment leaves one or the
        other whole."""
        replace_with(self.path, lambda f: f.writelines(line.encode() for line in lines), "the run's log",
                     f"; {self.path} is as it was")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.begin()
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size, written = os.fstat(fd).st_size, 0
            while written < len(line):  # unbuffered: nothing is left to fail at close
                written += os.write(fd, line[written:])
        except OSError as e:  # a line cut short would read as a torn one: the log goes back to its last line
            os.ftruncate(fd, size)
            raise write_error("the run's log", self.path, e, "; its earlier records are whole") from None
        finally:
            os.close(fd)
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if v is not None}, step=record["step"])
        self._scalars(record)

    def _purge_tensorboard_after(self, done: int) -> None:
        """TensorBoard hides the points of the steps after `done`, which are redone (after a resume or a
        rollback), as truncate drops their lines: the next writer's purge_step starts there."""
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        self.purge_step = done + 1 if done else None

    def _scalars(self, record: dict) -> None:
        """The record's numbers as TensorBoard scalars at its step (booleans as 0 and 1; null is no point)."""
        if self.tensorboard_dir is None:
            return
        if self.tensorboard is None:  # tensorboard_problems made sure it imports
            from torch.utils.tensorboard import SummaryWriter

            # Opened here, not with the log: a fresh run removes the earlier run's event files only once it has
            # passed its start-up checks (rundir.replace_outputs), after the log is made.
            self.tensorboard = SummaryWriter(self.tensorboard_dir, purge_step=self.purge_step)
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self.tensorboard.add_scalar(key, float(value), global_step=record["step"])

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
