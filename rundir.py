"""The run directory (--out-dir): one run at a time in it, and a fresh run never lands on an old one.

    lock, resume, replaced = claim(cfg.ckpt)   # rank 0: create and lock out_dir, fresh or resume; lock.release()
    replace_outputs(replaced, staged_config)   # once the new run has passed its start-up checks

Two runs writing one directory would replace each other's checkpoints and interleave metrics.jsonl, so the
first takes an exclusive flock on `.lock` and the second stops at once, naming the holder's pid. The kernel
drops the lock when its process dies, however it dies, so a killed run never blocks its own resume.

A fresh run into a directory that holds a run (checkpoints, best, metrics.jsonl) is refused unless the
user says what to do: --resume continues it, --overwrite removes it first, --resume auto continues it when
it has a checkpoint and starts fresh otherwise (what a restart script or a cluster scheduler wants). A run
stopped before its first checkpoint left nothing to resume and nothing to lose (its records: metrics.jsonl, its
report, its TensorBoard events, its profile trace): a rerun starts fresh there, replacing them, with a note, and
--resume says so.
Files of those names that no run left (the user's own report.md, a hand-written config.toml: left_by_no_run)
are replaced only with --overwrite. A repeat of a run from its OUT/config.toml names that run's directory
unless --out-dir says otherwise, so its refusal says to add --out-dir NEW_DIR; a config.toml that sits in
another run's directory (a copied run) must say which of the two it means (moved_run). A command refused at
start-up leaves no directory behind that it created (RunLock.abandon).

Every name the run writes in the directory must be free for it: a directory where metrics.jsonl goes would
fail the run mid-way, so it is refused here, before anything is written (OUT/tensorboard, written only with
--tensorboard, is checked with it: telemetry.tensorboard_problems).
"""

import errno
import os
import sys

import config
import distributed
from atomic import in_the_way
from checkpoint import DIGEST_SUFFIX, best_path, list_checkpoints, remove
from cli import DataError, UsageError
from prepare import default_corpus
from runlog import METRICS_FILE, TENSORBOARD_DIR

LOCK_FILE = ".lock"
CONFIG_FILE = "config.toml"
TRACE_FILE = "trace.json"  # --profile (telemetry.py)
REPORT_FILE, CURVES_FILE, SUMMARY_FILE = "report.md", "curves.png", "summary.json"  # report.py's, at a run's end
# What a run records of itself, besides its checkpoints: all that a run stopped before its first checkpoint
# leaves, which a fresh run there replaces without --overwrite (nothing to resume, nothing lost).
RECORDS = (METRICS_FILE, REPORT_FILE, CURVES_FILE, SUMMARY_FILE, TENSORBOARD_DIR, TRACE_FILE)
CONFIG_READ_LIMIT = 1 << 20  # a run's config.toml is a few KiB; reading a huge file of that name is never needed


class NothingToDo(Exception):
    """A resumed run already at its last step: said in one line, and a success (a restart loop must stop)."""


class RunLock:
    """An exclusive lock on out_dir for this process's lifetime (POSIX flock; no lock where there is none)."""

    def __init__(self, out_dir: str, created: bool = False):
        self.out_dir, self.created = out_dir, created  # created: claim made out_dir (abandon removes it)
        path = self.path = os.path.join(out_dir, LOCK_FILE)
        try:
            import fcntl
        except ImportError:  # Windows: no flock
            self.fd = None
            return
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UsageError(f"--out-dir {out_dir}: cannot open its lock file {path}: {e.strerror or e}") from None
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

    def abandon(self) -> None:
        """Release for a run refused at start-up: a directory that claim created goes too, when nothing but
        the lock is in it, so that a refused command leaves nothing behind (a later one finds no stray
        directory)."""
        try:  # while still locked: a claim that opened the lock file meanwhile waits on it, then is refused
            if self.created and os.listdir(self.out_dir) == [LOCK_FILE]:
                os.remove(self.path)
                os.rmdir(self.out_dir)
        except OSError:  # gone already, or something else is there now: it stays
            pass
        self.release()


def run_outputs(out_dir: str, checkpoints: list[str]) -> list[str]:
    """The paths of what a run leaves in out_dir: its checkpoints (list_checkpoints), best, and its RECORDS,
    which a fresh run there removes with the rest, so that no report, summary or TensorBoard point describes a
    run that is gone. A record counts only as the kind the run writes: a file named tensorboard is the user's."""
    found = list(checkpoints)
    for sharded in (False, True):
        if os.path.exists(best_path(out_dir, sharded)):
            found.append(best_path(out_dir, sharded))
    records = [path for name in RECORDS if os.path.exists(path := os.path.join(out_dir, name))]
    return found + [path for path in records if os.path.isdir(path) == (os.path.basename(path) == TENSORBOARD_DIR)]


def misplaced(out_dir: str, sharded: bool) -> str | None:
    """Why a name this run writes in out_dir is taken by something of the other kind (a directory where a file
    goes, say), or None. sharded: the run writes DCP directories (FSDP2), and its best is one. The names of
    later checkpoints are left out: a checkpoint that cannot be written stops the run in one line
    (CheckpointError), and nothing is lost; so is OUT/tensorboard, which only --tensorboard needs free
    (telemetry.tensorboard_problems)."""
    best = best_path(out_dir, sharded)
    replaced = [os.path.join(out_dir, name) for name in (METRICS_FILE, CONFIG_FILE)]  # written, then renamed
    replaced += [] if sharded else [best, best + DIGEST_SUFFIX]
    files = [os.path.join(out_dir, LOCK_FILE), os.path.join(out_dir, TRACE_FILE), *replaced]
    files += [f"{path}.tmp" for path in replaced]
    for path in files:
        if kind := in_the_way(path, os.path.lexists):
            return f"{path} is {kind}, where this run writes a file"
    for path in [best, f"{best}.tmp"] if sharded else []:
        if os.path.lexists(path) and not os.path.isdir(path):
            return f"{path} is not a directory, where this run writes a checkpoint directory"
    return None


def runs_config(path: str) -> bool:
    """Whether path, an OUT/config.toml, was written by a run: to_toml writes a settings digest line
    (config.DIGEST_LINE), kept through hand edits, wherever they move it; a file the user wrote has none."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(CONFIG_READ_LIMIT)
    except OSError:
        return False
    return any(line.startswith(config.DIGEST_LINE) for line in text.splitlines())


def left_by_no_run(out_dir: str, outputs: list[str]) -> list[str]:
    """What a fresh run in out_dir, which holds `outputs` (run_outputs') and no checkpoint (claim asks only
    then, and before decide_resume, whose advice assumes a run there), would replace although no run left it:
    a config.toml without a run's digest (runs_config), and RECORDS with neither a metrics.jsonl nor a run's
    config.toml beside them (a run writes its config.toml before any record, and its report after its
    metrics.jsonl). These are the user's: --overwrite alone replaces them."""
    path = os.path.join(out_dir, CONFIG_FILE)
    config_there = os.path.isfile(path)
    foreign = [path] if config_there and not runs_config(path) else []
    ran = (config_there and not foreign) or any(os.path.basename(p) == METRICS_FILE for p in outputs)
    return foreign if ran else foreign + [p for p in outputs if os.path.basename(p) in RECORDS]


def moved_run(config_file: str, out_dir: str) -> str | None:
    """Why a --config file that sits in a run's directory, but names another --out-dir (a run copied with its
    config.toml, say), cannot decide which of the two this command means, or None. Resuming or overwriting the
    one it names would change a run the user did not point at."""
    here = os.path.dirname(os.path.abspath(config_file))
    if os.path.realpath(here) == os.path.realpath(out_dir):
        return None
    if not (list_checkpoints(here) or os.path.exists(os.path.join(here, METRICS_FILE))):
        return None  # a config file kept apart from any run: its run goes where it says
    return (f"--config {config_file} is in {here}, which holds a run, but names --out-dir {out_dir}: add "
            f"--out-dir {here} for the run it is in (a copy, say), or --out-dir {out_dir} for the one it names")


def decide_resume(out_dir: str, outputs: list[str], has_checkpoint: bool, resume: str, overwrite: bool,
                  config_file: str | None = None) -> bool:
    """Resume (True) or start fresh (False) in out_dir, which holds `outputs`. Pure.

    on: resume, which needs a checkpoint; auto: resume when there is a checkpoint; off: start fresh. A fresh
    start replaces an earlier run only with overwrite, unless that run never wrote a checkpoint (no ckpt_N, no
    best): its RECORDS are all it left, and nothing a rerun could continue. config_file: the --config file
    of a command line without --out-dir (config.repeated_config), whose refusal says how to repeat its run."""
    if has_checkpoint and resume != "off":
        return True
    kept = outputs if has_checkpoint else [p for p in outputs if os.path.basename(p) not in RECORDS]
    if resume == "on":
        if kept:  # a best without any ckpt_N
            reason = (f"only {os.path.basename(kept[0])}, which is never resumed from; pass --overwrite instead of "
                      "--resume to start over there")
        elif outputs:
            reason = ("the run there stopped before its first one; --resume auto (or no --resume) starts it fresh, "
                      f"replacing its {METRICS_FILE}")
        else:
            reason = "--resume auto starts fresh where there is none"
        raise UsageError(f"--resume: --out-dir {out_dir} holds no checkpoint to resume from: {reason}")
    if kept and not overwrite:
        names = ", ".join(sorted(os.path.basename(p) for p in kept)[:3]) + (", ..." if len(kept) > 3 else "")
        choices = "pass --resume to continue it, --overwrite" if has_checkpoint else "pass --overwrite"
        if config_file:
            raise UsageError(f"--out-dir {out_dir} already holds a run ({names}): add --out-dir NEW_DIR to repeat "
                             f"--config {config_file} in a new directory, or {choices} to replace it")
        raise UsageError(f"--out-dir {out_dir} already holds a run ({names}): {choices} to replace it, or choose "
                         "another --out-dir")
    return False


def replace_outputs(replaced: list[str], staged_config: str | None) -> None:
    """Once the new run has passed its start-up checks, with its config.toml written under a temporary name
    (rank 0; None elsewhere): delete what --overwrite replaces (asked for explicitly), then rename the new
    config.toml into place. Every write comes before anything is removed."""
    for path in replaced:
        remove(path)
    if staged_config is not None:
        os.replace(staged_config, staged_config.removesuffix(".tmp"))


def claim(ckpt_cfg, sharded: bool = False, config_file: str | None = None) -> tuple[RunLock, bool, list[str]]:
    """Create and lock --out-dir, decide fresh or resume -> (lock, resume, what a fresh run replaces: the
    caller removes it once the run has passed its start-up checks). ckpt_cfg: config.CheckpointConfig;
    sharded: the run writes DCP directories (misplaced); config_file: as decide_resume's."""
    out_dir = ckpt_cfg.out_dir
    if config_file and (problem := moved_run(config_file, out_dir)):
        raise UsageError(problem)
    created = not os.path.lexists(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out-dir {out_dir} cannot be created: {e.strerror}") from None
    if not os.access(out_dir, os.W_OK):
        raise UsageError(f"--out-dir {out_dir} is not writable")
    if problem := misplaced(out_dir, sharded):
        raise UsageError(f"{problem}: move it aside or choose another --out-dir")
    lock = RunLock(out_dir, created)
    try:
        checkpoints = list_checkpoints(out_dir)
        outputs = run_outputs(out_dir, checkpoints)
        # Before decide_resume, whose advice for a directory without a checkpoint assumes a run's records there
        foreign = [] if checkpoints or ckpt_cfg.overwrite else left_by_no_run(out_dir, outputs)
        if foreign:
            names = ", ".join(os.path.basename(path) for path in foreign)
            raise UsageError(f"--out-dir {out_dir} holds {names}, which no run left there (a run's config.toml "
                             f"has a settings digest, its records a {METRICS_FILE}): move them aside (--config "
                             "reads a file from anywhere) or pass --overwrite to replace them")
        resume = decide_resume(out_dir, outputs, bool(checkpoints), ckpt_cfg.resume, ckpt_cfg.overwrite,
                               config_file)
    except UsageError:
        lock.abandon()
        raise
    if resume:
        return lock, True, []
    if outputs and not ckpt_cfg.overwrite:  # decide_resume allows only an earlier run's RECORDS here
        names = ", ".join(os.path.basename(path) for path in outputs)
        print(f"note: the earlier run in --out-dir {out_dir} left no checkpoint; starting fresh, its {names} "
              f"{'is' if len(outputs) == 1 else 'are'} replaced", file=sys.stderr)
    return lock, False, outputs


def prepare_outputs(cfg, info, command_line: dict) -> tuple[str, bool, RunLock | None, list, str | None]:
    """Claim --out-dir on rank 0 (rundir.claim: the lock, fresh or resume) and write its new config.toml under a
    temporary name (config.stage_config) -> (the data directory, whether to resume, the lock, what --overwrite
    will replace, that file or None). Rank 0 tokenizes the default corpus once; the other ranks find it cached.
    Every rank gets rank 0's answers or its error, so none waits on a rank that failed."""
    answer, lock, replaced, staged, failure = None, None, [], None, None
    if info.is_main:
        try:
            lock, resume, replaced = claim(cfg.ckpt, info.mode == "fsdp", config.repeated_config(command_line))
            answer = (cfg.data.data or default_corpus(), resume)
            staged = config.stage_config(cfg, os.path.join(cfg.ckpt.out_dir, CONFIG_FILE), resume, command_line)
        except Exception as e:  # a bug keeps its traceback on rank 0; the other ranks get one line
            failure, answer = e, e if isinstance(e, (UsageError, DataError)) else UsageError(f"rank 0: {e!r}")
            if lock is not None:
                lock.abandon()
    answer = distributed.broadcast_object(answer, info)
    if isinstance(answer, Exception):
        raise failure or answer
    return (*answer, lock, replaced, staged)
