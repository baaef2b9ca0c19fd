"""What a training state is: atomic checksummed files and DCP directories, resume and pruning.

One file per step for single-device and DDP runs, a sharded DCP directory for FSDP2.

    python checkpoint.py to-file out/ckpt_00001000 ckpt.pt   # DCP directory -> single file
    python checkpoint.py to-dcp  ckpt.pt out/ckpt_00001000    # single file -> DCP directory

Both formats hold the same thing: the model and optimizer state dicts keyed by parameter name
(torch.distributed.checkpoint.state_dict's layout, the same for a plain, DDP or FSDP2 model), plus a
few plain entries (format version, step, data-loader position, RNG, configs): the "meta" part. So any
run can resume from either, at any world size: DCP reshards tensors to the loading run's layout.

A checkpoint can never run code. A single file loads with torch.load(weights_only=True); a DCP directory
keeps its meta in meta.pt, loaded the same way, and the rest through safe_load.py. Every reader (resume,
sample.py, hf.py, the converters) verifies the checksums first.

Checkpoints hold the plain backend's parameter contract: Transformer Engine's per-module `_extra_state`
(FP8 scaling metadata; for delayed scaling, a pickle) is left out when saving and rebuilt empty when a TE
model loads. So both formats load into either backend, no pickle is ever read, and a DCP template from a
fresh TE model (whose extra state is empty) matches what was saved. The price: a delayed-scaling run that
resumes or rolls back starts a new amax history, as at step 0 (current scaling keeps no history).

Writes are atomic (temporary name, fsync, rename) and carry sha256 checksums (ckpt_N.pt.sha256 beside a
file, checksums.json inside a directory), so a resume can skip a damaged checkpoint for the one before.

The training state (Checkpointer): the model and optimizer; the meta holds the data loader's position, the
RNG states, the step, the model config and the run's whole config, the LR multiplier of the last step, and
the fault-tolerance state (resilience.Guard: LR scale, loss health, early stopping). The Checkpointer also
decides when to save.
"""

import argparse
import dataclasses
import errno
import hashlib
import json
import os
import pickle
import random
import shutil
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

import distributed
import memory
import records
from atomic import write_synced
from cli import ArgumentParser, UsageError, WriteError, first_line, free_bytes, report_error, write_error
from config import changed_keys
from data import data_change, data_kind
from fp8 import block_state_dict, te_to_plain_state_dict
from model import INIT_ONLY_FIELDS, with_qwen3_toggles
from optim import apply_group_settings, group_settings
from safe_load import SafeLoadPlanner, SafeReader, SafeWholeLoadPlanner, read_dcp_metadata
from schedule import current_multiplier
from shards import file_sha256

CHECKPOINT_VERSION = 1
META_FILE = "meta.pt"
CHECKSUMS_FILE = "checksums.json"  # in a DCP directory: sha256 of every other file
DIGEST_SUFFIX = ".sha256"  # beside a single file: its sha256
# DCP's "... assuming the intent is to save (load) in a single process": the converters', sample.py's, hf.py's: it is
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointError(Exception):
    """A checkpoint the user pointed us at cannot be used; the message is one line."""


def checkpoint_path(out_dir: str, step: int, sharded: bool) -> str:
    name = f"ckpt_{step:08d}"
    return os.path.join(out_dir, name if sharded else f"{name}.pt")


def best_path(out_dir: str, sharded: bool) -> str:
    """Where the checkpoint with the best validation loss so far is kept (never pruned, never resumed from)."""
    return os.path.join(out_dir, "best" if sharded else "best.pt")


def checkpoint_step(path: str) -> int:
    return int(os.path.basename(path).removeprefix("ckpt_").removesuffix(".pt"))


def list_checkpoints(out_dir: str) -> list[str]:
    """Checkpoints in out_dir of either format, oldest first. Temporary (unfinished) ones are ignored."""
    if not os.path.isdir(out_dir):
        return []
    found = []
    for name in os.listdir(out_dir):
        stem = name.removesuffix(".pt")
        if name.startswith("ckpt_") and stem[5:].isdigit():
            found.append(os.path.join(out_dir, name))
    return sorted(found, key=checkpoint_step)


def _fsync_dir(path: str) -> None:
    """Make a rename inside `path` durable: without this a power cut can undo it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A write-only file that hashes what passes through, so a checkpoint need not be read back to be hashed.
    error: the OSError a write raised, which torch's zip writer reports as a RuntimeError of its own."""

    def __init__(self, f):
        self.f, self.sha256, self.error = f, hashlib.sha256(), None

    def write(self, data) -> int:
        self.sha256.update(data)
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _save_hashed(state: dict):
    """A writer for write_synced: torch.save into the file, returning the sha256 of the bytes written."""

    def write(f) -> str:
        writer = _HashingWriter(f)
        try:
            torch.save(state, writer)
        except RuntimeError:
            if writer.error is None:
                raise
            raise writer.error from None  # the disk's error, not the zip writer's account of it
        return writer.sha256.hexdigest()

    return write


def _disk_error(path: str, e: BaseException) -> WriteError:
    """The one-line error of a checkpoint write that failed, its partial files already removed."""
    return write_error("checkpoint", path, e, "; the previous checkpoints are intact")


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a DCP save's failure: dcp.save reports each rank's exception inside a
    CheckpointException (a BaseException) rather than raising it."""
    for error, _ in getattr(e, "failures", {}).values():
        if isinstance(error, OSError):
            return error
    return e if isinstance(e, OSError) else None


def _dcp_error(path: str, e: BaseException, free: int | None, needed: int) -> WriteError:
    """The one line of a DCP save that failed. A filesystem left with less free space than the checkpoint needs
    was filled by it: torch's zip writer reports a full disk inside dcp.save as a RuntimeError ("unexpected pos
    ..."), with no OSError left to read, so the space decides. Anything else names the first failing rank and
    its error."""
    if (error := _os_error(e)) is not None:
        return _disk_error(path, error)
    if free is not None and free < needed:
        return _disk_error(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    failures = getattr(e, "failures", {})
    rank = min(failures) if failures else None
    cause = failures[rank][0] if failures else e
    where = f"rank {rank}: " if rank is not None else ""
    return WriteError(f"cannot write checkpoint {path}: {where}{type(cause).__name__}: {first_line(cause)}; the "
                      "previous checkpoints are intact")


def save_file(state: dict, path: str) -> None:
    """Write to a temporary file and fsync it, and its sha256 beside it, then rename both into place
    (_commit_file).

    A crash or a full disk at any point leaves either the complete new checkpoint or the one it replaces
    (best.pt): the file's rename is the commit, and the checksum lets a resume tell a damaged file from a
    good one.
    """
    tmp, digest_tmp = f"{path}.tmp", f"{path}{DIGEST_SUFFIX}.tmp"
    try:
        digest = write_synced(tmp, _save_hashed(state))
        write_synced(digest_tmp, lambda f: f.write(digest.encode()))
        _commit_file(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):  # not committed: neither staged file is wanted
            for leftover in (tmp, digest_tmp):
                if os.path.exists(leftover):
                    os.remove(leftover)
        raise _disk_error(path, e) from None


def _commit_file(tmp: str, path: str) -> None:
    """tmp, whole, becomes path, then its staged sha256 (path.sha256.tmp) becomes path's. Between the two
    renames the file is new and path.sha256 still the old one's: verify takes the staged digest then, so a
    kill at any moment leaves the old checkpoint or the new one, each verifiable."""
    os.replace(tmp, path)
    os.replace(f"{path}{DIGEST_SUFFIX}.tmp", f"{path}{DIGEST_SUFFIX}")
    _fsync_dir(os.path.dirname(path) or ".")


def save_sharded(tensors: dict, meta: dict, path: str, is_main: bool, barrier) -> None:
    """Every rank writes its shards into a temporary directory; once all are done rank 0 adds the meta and
    the checksums of every file, then renames the directory into place."""
    tmp = f"{path}.tmp"
    if is_main and os.path.exists(tmp):
        shutil.rmtree(tmp)
    barrier()
    try:
        dcp.save(tensors, checkpoint_id=tmp)
    except CheckpointException as e:  # every rank has it: dcp.save gathers the ranks' outcomes
        free = free_bytes(tmp)
        barrier()  # every rank has read the space the partial directory leaves before any rank removes it
        shutil.rmtree(tmp, ignore_errors=True)  # each rank: ranks on filesystems of their own hold parts of it
        error = _dcp_error(path, e, free, memory.state_bytes(tensors))
        error.every_rank = True  # train.py: rank 0's line says it for all
        raise error from None
    if is_main:
        try:
            write_synced(os.path.join(tmp, META_FILE), _save_hashed(meta))
            digests = {name: file_sha256(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
            write_synced(os.path.join(tmp, CHECKSUMS_FILE), lambda f: f.write(json.dumps(digests).encode()))
            _replace_dir(tmp, path)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _disk_error(path, e) from None
    barrier()


def _replace_dir(tmp: str, path: str) -> None:
    """tmp, whole, becomes path; a "best" checkpoint there is moved aside first and removed only once the new
    one is in place, so a kill at any moment leaves one of the two under a name a resume reads."""
    old = f"{path}.old"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")
    shutil.rmtree(old, ignore_errors=True)


def _recorded_digest(path: str) -> str | None:
    """The sha256 a checksum file holds, or None when it is not there or holds no digest (damaged)."""
    try:
        with open(path, "rb") as f:
            text = f.read(100).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    return text if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else None


def verify(path: str) -> None:
    """CheckpointError unless every byte of the checkpoint is what was written (truncation, flipped bytes)."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if os.path.isdir(path):
        try:
            with open(os.path.join(path, CHECKSUMS_FILE)) as f:
                expected = json.load(f)
        except (OSError, ValueError):
            expected = None
        if not (isinstance(expected, dict) and all(isinstance(d, str) for d in expected.values())):
            raise CheckpointError(f"{path} has no readable {CHECKSUMS_FILE}: incomplete or not ours")
        files = {os.path.join(path, name): {digest} for name, digest in expected.items()}
    else:
        # The staged digest as well: a replacement cut short between _commit_file's renames is whole.
        digests = {_recorded_digest(f"{path}{DIGEST_SUFFIX}{staged}") for staged in ("", ".tmp")} - {None}
        if not digests:
            raise CheckpointError(f"{path} has no readable {DIGEST_SUFFIX} checksum beside it: incomplete or not "
                                  "ours")
        files = {path: digests}
    for file, digests in files.items():
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing, though the checkpoint recorded it when it was written")
        if file_sha256(file) not in digests:
            raise CheckpointError(f"{file} is damaged: its sha256 does not match the one recorded when it was written")


def read_meta(path: str) -> tuple[dict]:
    """(the meta of the checkpoint at path,), either format, alone: nothing verified (load does), a file's tensors
    memory-mapped, not loaded. CheckpointError for one that cannot be read."""
    file = os.path.join(path, META_FILE) if os.path.isdir(path) else path
    try:
        meta = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise _load_error(file, e) from None
    return (_check_meta(meta, path),)


def config_changes(meta: dict, model_cfg, out_dir: str, check_run_config=None) -> list[str]:
    """A resume's check of the checkpoint's configs against this run's: UsageError (one line) for another model
    shape, or for a setting check_run_config refuses (config.check_resume); -> the changes it allows."""
    recorded = with_qwen3_toggles(meta["model_config"])
    changes = [c for c in changed_keys(recorded, dataclasses.asdict(model_cfg)) if c[0] not in INIT_ONLY_FIELDS]
    if changes:
        raise UsageError(f"--resume: the checkpoint of step {meta['step']} in {out_dir} was trained with another model "
                         f"shape ({', '.join(f'{k} {a!r} -> {b!r}' for k, a, b in changes)}); pass the same model flags")
    return check_run_config(meta.get("train_config", {})) if check_run_config else []


def load_newest(out_dir: str, read, warn):
    """(path, *read(path)) of the newest checkpoint that read(path) verifies and loads, or None. Each one
    read refuses (CheckpointError) is reported through `warn` and skipped, never deleted: the user may want
    to look at it. read: load with a template (a resume), or trained.read_checkpoint (sample, export)."""
    for path in reversed(list_checkpoints(out_dir)):
        try:
            return (path, *read(path))
        except CheckpointError as e:
            warn(f"warning: skipping checkpoint: {e}")
    return None


def _load_error(path: str, e: BaseException) -> CheckpointError:
    if isinstance(e, CheckpointException):  # DCP's wrapper of the ranks' errors: report the first one
        e = next(iter(e.failures.values()))[0]
    text = str(e).strip()
    if isinstance(e, pickle.UnpicklingError) and text.startswith("Weights only load failed"):
        # Not torch's advice (weights_only=False, or allow-listing what the file names), which would run its code.
        why = (text.partition("WeightsUnpickler error:")[2].strip().splitlines() or [""])[0].split(". ")[0]
        return CheckpointError(f"cannot load checkpoint {path}: not a file this trainer wrote, which unpickles as "
                               "tensors and plain data with weights_only=True" + (f" ({why})" if why else ""))
    first_line = (text.splitlines() or [""])[0]
    return CheckpointError(f"cannot load checkpoint {path}: {type(e).__name__}" + (f": {first_line}" if first_line else ""))


def _torch_load(path: str):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise _load_error(path, e) from None


def _check_meta(meta, path: str) -> dict:
    if not isinstance(meta, dict) or meta.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} is not a checkpoint of this trainer (format version {CHECKPOINT_VERSION})")
    if problem := records.problem(meta, records.CHECKPOINT_META):
        raise CheckpointError(f"{path}: {problem}")
    return meta


def load(path: str, make_template=None) -> tuple[dict, dict | None]:
    """(meta, {"model": ..., "optimizer": ...}) of a checkpoint of either format, verified first (verify).

    A file holds full tensors. A DCP directory's meta comes first (meta.pt); its shards are then read into
    make_template(meta), the loading run's own state dicts, sharded or not, which is how DCP reshards to a
    different world size. Without make_template a directory's tensors are not read (None).
    """
    verify(path)
    if os.path.isdir(path):
        meta = _check_meta(_torch_load(os.path.join(path, META_FILE)), path)
        if make_template is None:
            return meta, None
        template = make_template(meta)
        _dcp_load(template, path, SafeLoadPlanner())
        return meta, template
    state = _torch_load(path)
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not a checkpoint of this trainer (format version {CHECKPOINT_VERSION})")
    tensors = {"model": state.pop("model"), "optimizer": state.pop("optimizer", None)}
    return _check_meta(state, path), tensors


def _dcp_load(state_dict: dict, path: str, planner, load=None) -> None:
    """dcp.load (or `load`) with the safe reader and `planner`; any failure is one CheckpointError line. The
    metadata is checked first, because DCP logs a traceback of its own when it cannot read it."""
    try:
        read_dcp_metadata(path)
        (load or dcp.load)(state_dict, storage_reader=SafeReader(path), planner=planner, no_dist=not _dist_ready())
    except (Exception, CheckpointException) as e:
        raise _load_error(path, e) from None


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        shutil.copy2(src, dst)


def link(src: str, dst: str) -> None:
    """Make dst a second name for the checkpoint at src, without copying its bytes where the filesystem
    allows: checkpoints are only ever replaced by rename, never modified, so the two names cannot diverge."""
    tmp = f"{dst}.tmp"
    if os.path.isdir(src):
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, copy_function=_link_or_copy)
        _replace_dir(tmp, dst)
        return
    for staged, source in ((tmp, src), (f"{dst}{DIGEST_SUFFIX}.tmp", f"{src}{DIGEST_SUFFIX}")):
        if os.path.exists(staged):
            os.remove(staged)
        _link_or_copy(source, staged)
    _commit_file(tmp, dst)


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)
        for digest in (f"{path}{DIGEST_SUFFIX}", f"{path}{DIGEST_SUFFIX}.tmp"):
            if os.path.exists(digest):
                os.remove(digest)


def dcp_to_file(src_dir: str, dst: str) -> None:
    # As torch's own dcp_to_torch_save, with the safe reader and planner: the public dcp.load fills a copy of
    # the state dict it is given, so an empty one (read everything) comes back empty.
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    meta, _ = load(src_dir)
    tensors = {}
    _dcp_load(tensors, src_dir, SafeWholeLoadPlanner(), load=_load_state_dict)
    save_file({**meta, "model": tensors["model"], "optimizer": tensors["optimizer"]}, dst)


def file_to_dcp(src: str, dst_dir: str) -> None:
    meta, tensors = load(src)
    save_sharded(tensors, meta, dst_dir, is_main=True, barrier=lambda: None)


# ----------------------------------------------------------------------------- the training state


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def state_dict_options(full: bool):
    """Full state dicts (gathered to rank 0, on the CPU) for single files; sharded ones for DCP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full)


def for_backend(model_sd: dict, backend: str) -> dict:
    """A model state dict from a checkpoint, for a model of `backend`: TE modules load an empty _extra_state
    ("no FP8 metadata yet"); the plain backend has none. A file that carries TE's has it dropped."""
    return block_state_dict(te_to_plain_state_dict(model_sd), backend)


def tokens_trained(meta: dict, tokens_per_step: int) -> int:
    """Tokens trained up to a checkpoint. Counted by the run, since the batch may change across a resume;
    a checkpoint that records no count is taken to have kept one batch throughout."""
    return meta.get("tokens", meta["step"] * tokens_per_step)


def prunable(checkpoints: list[str], written: int, keep: int, good) -> list[str]:
    """Which of `checkpoints` (oldest first) to delete once step `written` is safely on disk: the oldest of the
    good ones before it (good(path): it verifies), so that `keep` good ones remain counting the new one. A
    damaged one is never deleted (the user may want to look at it) and never counts: it cannot be resumed
    from. Never one after it either: a checkpoint with a higher step is not this run's past (a damaged one
    skipped at resume, say), and deleting by step number alone would delete each new checkpoint as soon as it
    is written."""
    older = [path for path in checkpoints if checkpoint_step(path) < written and good(path)]
    return older[:max(len(older) - (keep - 1), 0)]


class Checkpointer:
    """Saves and restores the training state in out_dir, and decides when to save.

    FSDP2 runs write a sharded DCP directory; the others a single file from rank 0. Both resume any run
    at any world size. Regular checkpoints are pruned to the newest `keep`; the best (lowest val loss) one
    is kept apart and never pruned.
    """

    def __init__(self, out_dir: str, interval: int, keep: int, info: "distributed.DistInfo", model_cfg,
                 run_config: dict, data_id: list, allow_data_change: bool = False, check_run_config=None,
                 tokenizer: dict | None = None):
        """data_id: data.fingerprint of the training shards, saved with every checkpoint; a resume on other
        shards is refused unless allow_data_change. check_run_config(saved run config) -> the changed settings
        to report, or raises UsageError for a change the run cannot survive (config.check_resume). tokenizer:
        data.tokenizer_id of the shards' data.json, which sample.py, hf.py and score.py check theirs against."""
        self.out_dir, self.interval, self.keep, self.info = out_dir, interval, keep, info
        self.model_cfg, self.run_config, self.tokenizer = model_cfg, run_config, tokenizer
        self.data_id, self.allow_data_change = data_id, allow_data_change
        self.check_run_config = check_run_config
        self.sharded = info.mode == "fsdp"
        # path -> whether it verifies, for pruning: known for what this process wrote or restore() tried, and
        # checked (a full read) at most once for the others.
        self.verified: dict[str, bool] = {}

    @property
    def best_path(self) -> str:
        return best_path(self.out_dir, self.sharded)

    def due(self, done: int, max_steps: int) -> bool:
        """Is a regular checkpoint due after `done` steps? On the interval, and always at the end."""
        return (bool(self.interval) and done % self.interval == 0) or done == max_steps

    def save(self, done: int, model, optimizer, loader, guard, tokens: int, regular: bool = True,
             best: bool = False, batch_tokens: int | None = None, record: dict | None = None) -> None:
        """`regular`: the ckpt_N checkpoint; `best`: the one kept for the best validation loss. With both,
        the state is gathered and written once and best links to it. tokens: trained so far, all ranks;
        batch_tokens: the global batch per step, which a resume at another world size keeps
        (batch.resume_layout). record: the step's metrics.jsonl record, which a resume restores if the log
        lost it (runlog.MetricsLog.truncate)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options(full=not self.sharded))
        model_sd = te_to_plain_state_dict(model_sd)  # the plain contract: no FP8 scaling pickles (module docstring)
        meta = {"version": CHECKPOINT_VERSION, "step": done, "tokens": tokens, "batch_tokens": batch_tokens,
                "world_size": self.info.world_size, "loader": loader.state_dict(),
                "data": self.data_id, "tokenizer": self.tokenizer, "rng": rng_state(),
                "model_config": dataclasses.asdict(self.model_cfg), "train_config": self.run_config,
                "lr_multiplier": current_multiplier(optimizer), "record": record, **guard.state_dict()}
        path = checkpoint_path(self.out_dir, done, self.sharded) if regular else self.best_path
        is_main = self.info.is_main
        if self.sharded:
            save_sharded({"model": model_sd, "optimizer": optim_sd}, meta, path, is_main,
                         lambda: distributed.barrier(self.info))
        elif is_main:
            save_file({**meta, "model": model_sd, "optimizer": optim_sd}, path)
        if is_main:
            if regular and best:
                link(path, self.best_path)
            if regular:
                self.verified[path] = True
                for old in prunable(list_checkpoints(self.out_dir), done, self.keep, self.verifies):
                    remove(old)
                    del self.verified[old]
        distributed.barrier(self.info)

    def link_best(self, done: int) -> None:
        """Make step `done`'s regular checkpoint, already written, the best one too: save(best=True) after the
        fact, without gathering or writing the state again."""
        if self.info.is_main:
            link(checkpoint_path(self.out_dir, done, self.sharded), self.best_path)
        distributed.barrier(self.info)

    def verifies(self, path: str) -> bool:
        if path not in self.verified:
            try:
                verify(path)
                self.verified[path] = True
            except CheckpointError:
                self.verified[path] = False
        return self.verified[path]

    def restore(self, model, optimizer, loader, warn) -> dict:
        """Load the newest good checkpoint (either format, any world size) into the live objects; -> its meta,
        whose fault-tolerance part the caller hands to its Guard. Damaged checkpoints (checksum mismatch,
        truncation) are reported through `warn` and skipped for the one before. The optimizer gets the
        checkpoint's state and keeps its own settings: a resume trains with the flags it was given."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        def check_config(meta) -> list[str]:
            return config_changes(meta, self.model_cfg, self.out_dir, self.check_run_config)

        def sharded_template(meta):  # a DCP directory is read into this run's own (maybe sharded) state dicts
            check_config(meta)
            model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options(False))
            return {"model": te_to_plain_state_dict(model_sd), "optimizer": optim_sd}

        def read(path):
            self.verified[path] = False  # until it has loaded: what load refuses, pruning must not delete
            loaded = load(path, sharded_template)
            self.verified[path] = True
            return loaded

        found = load_newest(self.out_dir, read, warn)
        if found is None:
            why = (": each one is damaged or not this trainer's (named above); to start over, move them aside or "
                   "pass --overwrite instead of --resume") if list_checkpoints(self.out_dir) else ""
            raise UsageError(f"--resume: no usable checkpoint in {self.out_dir}{why}")
        path, meta, tensors = found
        changes = check_config(meta)  # before any state is loaded: a refusal leaves the objects as they were
        self.check_resumable(meta, tensors)
        for change in changes:
            warn(f"note: resuming with a setting changed since the checkpoint: {change}")
        sharded = os.path.isdir(path)
        tensors["model"] = for_backend(tensors["model"], model.backend)
        settings = group_settings(optimizer)  # the checkpoint's state, but this run's settings (LRs, betas, ...)
        set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optimizer"],
                       options=state_dict_options(full=not sharded))
        apply_group_settings(optimizer, settings)
        for name in loader.load_state_dict(meta["loader"], other_data=self.allow_data_change):
            warn(f"note: --allow-data-change: {f'source {name}' if name else '--data'} holds other shards than the "
                 "checkpoint's data position counts, so its rows start at their beginning")
        set_rng_state(meta["rng"])
        return meta

    def check_resumable(self, meta: dict, tensors: dict) -> None:
        """UsageError for a checkpoint that would resume something else than it saved: no optimizer state (a
        weights-only file: the optimizer would silently start over), or other training shards."""
        if not (tensors.get("optimizer") or {}).get("state"):
            raise UsageError(f"--resume: the checkpoint of step {meta['step']} in {self.out_dir} has no optimizer "
                             "state; to start from its weights, export them (hf.py) and use --from-hf")
        change = data_change(meta.get("data"), self.data_id)
        kinds = [data_kind(ids) for ids in (meta.get("data") or self.data_id, self.data_id)]
        if change and kinds[0] != kinds[1]:  # no flag can carry a position across: the loaders differ
            saved_data = meta.get("train_config", {}).get("data", {}).get("data")
            raise UsageError(f"--resume: the checkpoint trained on {kinds[0]} and this run's --data is {kinds[1]}; "
                             f"resume with the checkpoint's --data ({saved_data or 'none: the default corpus'}), or "
                             "start a new run from its weights (hf.py, then --from-hf)")
        if change and not self.allow_data_change:
            raise UsageError(f"--resume: the training shards differ from the checkpoint's: {change}; pass "
                             "--allow-data-change to resume on them anyway")


# ----------------------------------------------------------------------------- command line


def check_conversion(direction: str, src: str, dst: str) -> None:
    """CheckpointError (one line) for a conversion that cannot be done: a source of the wrong format, or a
    destination that exists or has no parent directory."""
    if not os.path.exists(src):
        raise CheckpointError(f"checkpoint {src} does not exist")
    wants_dir = direction == "to-file"
    if os.path.isdir(src) != wants_dir:
        raise CheckpointError(f"{direction} converts a {'sharded (DCP) directory' if wants_dir else 'single file'}; "
                              f"{src} is a {'file' if wants_dir else 'directory'}"
                              f" (use {'to-dcp' if wants_dir else 'to-file'})")
    if not dst:
        raise CheckpointError(f"{direction}: the destination is empty; name the {'file' if wants_dir else 'directory'} "
                              "to write")
    if wants_dir and dst.endswith(os.sep):
        raise CheckpointError(f"to-file writes a single file: {dst} names a directory")
    if os.path.exists(dst):
        raise CheckpointError(f"{dst} already exists: a conversion never replaces it; remove it or name another")
    staged = (f"{dst}.tmp", f"{dst}{DIGEST_SUFFIX}", f"{dst}{DIGEST_SUFFIX}.tmp") if wants_dir else (f"{dst}.tmp",
                                                                                                    f"{dst}.old")
    if in_the_way := next((path for path in staged if os.path.lexists(path)), None):
        raise CheckpointError(f"{in_the_way} already exists, where the conversion writes on its way to {dst}; move "
                              "it aside or name another destination")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise CheckpointError(f"cannot write {dst}: directory {parent} does not exist")


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=["to-file", "to-dcp"])
    parser.add_argument("src")
    parser.add_argument("dst")
    try:
        args = parser.parse_args(argv)
        if args.direction == "to-dcp":  # a directory to make, however it is named
            args.dst = args.dst.rstrip(os.sep) or args.dst
        check_conversion(args.direction, args.src, args.dst)
        (dcp_to_file if args.direction == "to-file" else file_to_dcp)(args.src, args.dst)
    except (UsageError, CheckpointError, WriteError) as e:
        return report_error(e)
    print(f"wrote {args.dst}: {args.src} as a {'single file' if args.direction == 'to-file' else 'DCP directory'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
