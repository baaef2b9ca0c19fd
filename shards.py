"""The shard format and data.json, each written and read here; ShardWatch, for shards that change under a run.

The token shard: llm.c's and modded-nanogpt's format, written and read here, and watched while a run reads it;
and data.json, prepare.py's record of the shards it wrote (the tokenizer, the counts, each shard's sha256).

A shard is a header of 256 little-endian int32 ([0] magic 20240520, [1] version, [2] token count, the rest 0),
then the tokens. Version 1 stores uint16 tokens (vocabularies up to 65,535 ids, e.g. GPT-2); version 2 is this
project's extension for larger vocabularies and stores uint32 tokens. prepare.py records each shard's sha256 in
data.json; ShardWatch stops a run whose shards change under it (a truncation would otherwise end it with a bus
error from the memory map, an overwrite would train on other tokens without a word).
"""

import hashlib
import json
import os

import numpy as np

import records
from atomic import atomic_write
from cli import DataError, first_line
from tokenizer import get_tokenizer

SHARD_MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}  # shard version -> token dtype
DATA_RECORD = "data.json"  # what prepare records about the shards it wrote: the tokenizer and the counts
# The default corpus's marker (prepare.default_corpus); caches built before data.json existed hold only this.
CORPUS_MARKER = "complete.json"


def shard_version(vocab_size: int) -> int:
    return 1 if vocab_size <= 65535 else 2


def write_shard(path, tokens: np.ndarray, vocab_size: int) -> str:
    """Write tokens (ids below vocab_size) as one shard, atomically (temporary file, fsync, rename) -> the
    sha256 of the file, which data.json records (ShardWatch checks it)."""
    path = os.fspath(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or len(tokens) >= 2**31:
        raise ValueError(f"{path}: a shard holds a 1-D array of fewer than 2**31 tokens, got shape {tokens.shape}")
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise DataError(f"{path}: token ids must lie in [0, {vocab_size}), got [{tokens.min()}, {tokens.max()}]")
    version = shard_version(vocab_size)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = SHARD_MAGIC, version, len(tokens)
    body = memoryview(np.ascontiguousarray(tokens, dtype=TOKEN_DTYPES[version])).cast("B")
    atomic_write(path, header.tobytes(), body)
    digest = hashlib.sha256(header.tobytes())
    digest.update(body)
    return digest.hexdigest()


def read_shard(path) -> np.ndarray:
    """The tokens of a shard as a read-only memory map, after checking the header against the file size."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as e:
        raise DataError(f"{path}: cannot read shard ({e.strerror})") from None
    if len(head) < HEADER_BYTES:
        raise DataError(f"{path}: truncated shard: {size} bytes, less than the {HEADER_BYTES}-byte header")
    magic, version, count = (int(v) for v in np.frombuffer(head, dtype="<i4")[:3])
    if magic != SHARD_MAGIC:
        raise DataError(f"{path}: not a token shard (magic number {magic}, expected {SHARD_MAGIC})")
    if version not in TOKEN_DTYPES:
        raise DataError(f"{path}: unknown shard version {version} (1 = uint16 tokens, 2 = uint32 tokens)")
    dtype = TOKEN_DTYPES[version]
    expected = HEADER_BYTES + count * dtype.itemsize
    if count < 0 or size < expected:
        raise DataError(f"{path}: truncated shard: the header says {count} tokens ({expected} bytes) "
                        f"but the file has {size} bytes")
    if size > expected:
        raise DataError(f"{path}: token count mismatch: the header says {count} tokens but the file has "
                        f"{size - expected} bytes more")
    if count == 0:  # mmap cannot map zero bytes
        empty = np.zeros(0, dtype=dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


class ShardWatch:
    """Checks, before a loader reads a shard, that it is the file the loader opened: the same size, inode and
    modification time (one stat), and, the first time it is read, the sha256 that data.json records for it
    (`sha256`: name -> digest; preparations without it are checked by stat alone). DataError, one line naming
    the shard, otherwise: the run stops after its last checkpoint instead of training on other tokens."""

    def __init__(self, paths: list[str], checksums: dict | None):
        self.paths, self.checksums, self.verified = paths, checksums or {}, set()
        self.opened = [self._identity(path) for path in paths]

    @staticmethod
    def _identity(path: str) -> tuple[int, int, int]:
        try:
            st = os.stat(path)
        except OSError as e:
            raise DataError(f"{path}: the shard cannot be read any more ({e.strerror}); the run stops rather than "
                            "train without it: restore it, then resume") from None
        return st.st_size, st.st_ino, st.st_mtime_ns

    def check(self, i: int) -> None:
        path = self.paths[i]
        if self._identity(path) != self.opened[i]:
            raise DataError(f"{path}: the shard changed on disk while the run read it (truncated, overwritten or "
                            "replaced); the run stops rather than train on it: restore it (or prepare the data "
                            "again), then resume")
        if i not in self.verified:
            expected = self.checksums.get(os.path.basename(path))
            if expected is not None and file_sha256(path) != expected:
                raise DataError(f"{path}: the shard's sha256 is not the one data.json records: it was damaged or "
                                "overwritten since prepare.py wrote it; the run stops rather than train on it: "
                                "prepare the data again, then resume")
            self.verified.add(i)


# ----------------------------------------------------------------------------------------------------------
# data.json


def write_data_record(data_dir: str, record: dict) -> None:
    """Write data_dir/data.json, atomically."""
    atomic_write(os.path.join(data_dir, DATA_RECORD), json.dumps(record, indent=1).encode())


def data_record(data_dir: str) -> dict | None:
    """What prepare.py recorded about the shards in data_dir: data.json (prepare and the default corpus write it),
    else the default corpus's complete.json (caches built before data.json existed; it names the tokenizer);
    None when there is neither, as for shards made by llm.c. DataError for a record that cannot be read."""
    for name in (DATA_RECORD, CORPUS_MARKER):
        path = os.path.join(data_dir, name)
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: cannot read the data record ({first_line(e)})") from None
        if name == CORPUS_MARKER:  # an old default corpus's: it names the tokenizer only
            if not isinstance(record, dict) or not isinstance(record.get("tokenizer"), str):
                continue  # some other tool's complete.json
            return {"tokenizer": record["tokenizer"], "n_vocab": get_tokenizer(record["tokenizer"]).n_vocab}
        if problem := records.problem(record, records.DATA_RECORD):
            raise DataError(f"{path}: {problem}; prepare the data again (prepare.py --overwrite) to rewrite it")
        return record
    return None
