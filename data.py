"""Data: the GPT-2 tokenizer (offline), token shards, the embedded default corpus, and the loader.

Shards use the llm.c / modded-nanogpt format, so they interoperate with those projects:
a header of 256 little-endian int32 ([0] magic 20240520, [1] version, [2] token count, the rest 0),
then the tokens. Version 1 stores uint16 tokens (vocabularies up to 65,535 ids, e.g. GPT-2);
version 2 is this project's extension for larger vocabularies and stores uint32 tokens.
Each document is preceded by the end-of-text token, as in llm.c and modded-nanogpt. Next to the shards,
data.json records the tokenizer (name, n_vocab, end-of-text id) and the counts; check_vocab reads it.

    python data.py --input corpus.txt --out data/mine          # then: python train.py --data data/mine
"""

import bisect
import codecs
import collections
import functools
import glob
import hashlib
import json
import os
import platform
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import tiktoken
import torch

from cli import ArgumentParser, UsageError, first_line, int_or_auto, report_error
from progress import Progress


class DataError(Exception):
    """A problem with the user's data or environment. The message is one line and names the file at fault."""


CACHE_ENV = "PRETRAIN_CACHE_DIR"


def cache_root() -> str:
    """The project's cache (tokenizer file, default corpus): $PRETRAIN_CACHE_DIR, else ~/.cache/pretrain."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "pretrain")


def _atomic_write(path: str, *chunks) -> None:
    """Write bytes-like chunks to path so that readers see the old file or the whole new one, never a part."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


# ----------------------------------------------------------------------------------------------------------
# Tokenizer

# tiktoken fetches the GPT-2 ranks from this URL and checks this sha256. tiktoken's "gpt2" encoding builds
# the same ranks from two other files; "r50k_base" reads this single file, so "gpt2" maps to r50k_base.
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# The same bytes ship in the openai-whisper source distribution, which pip can fetch from the package
# registry on machines that reach nothing else.
WHISPER_SDIST = "openai-whisper==20250625"
WHISPER_ASSET = "whisper/assets/gpt2.tiktoken"
PIP_DOWNLOAD = f"python -m pip download {WHISPER_SDIST} --no-deps --no-binary :all:"


def _tiktoken_cache_dir() -> str:
    """The directory tiktoken caches downloads in; made explicit (and the project's own) when the user set none."""
    cache_dir = (os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
                 or os.path.join(cache_root(), "tiktoken"))
    os.environ["TIKTOKEN_CACHE_DIR"] = cache_dir
    return cache_dir


def _r50k_cache_path(cache_dir: str) -> str:
    # tiktoken.load.read_file_cached names a cached download by the sha1 of its URL.
    return os.path.join(cache_dir, hashlib.sha1(R50K_URL.encode()).hexdigest())


def _sha256_of(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def _ranks_from_pypi() -> bytes:
    """The GPT-2 BPE ranks, taken from the openai-whisper sdist that pip downloads through the configured index."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", WHISPER_SDIST, "--no-deps", "--no-binary", ":all:",
               "--quiet", "-d", tmp]
        subprocess.run(cmd, check=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=300)
        sdists = glob.glob(os.path.join(tmp, "*.tar.gz"))
        if len(sdists) != 1:
            raise DataError(f"pip download {WHISPER_SDIST} gave {len(sdists)} sdists, expected 1")
        with tarfile.open(sdists[0]) as tar:
            member = next((m for m in tar.getmembers() if m.name.endswith("/" + WHISPER_ASSET)), None)
            if member is None:
                raise DataError(f"{sdists[0]} has no {WHISPER_ASSET}")
            return tar.extractfile(member).read()


def _seed_gpt2_ranks(path: str) -> None:
    """Install the GPT-2 ranks at path from PyPI when the hash matches; on any failure leave path alone."""
    print(f"data: fetching the GPT-2 BPE ranks from the {WHISPER_SDIST} sdist into {os.path.dirname(path)}",
          file=sys.stderr)
    try:
        ranks = _ranks_from_pypi()
        if hashlib.sha256(ranks).hexdigest() == R50K_SHA256:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _atomic_write(path, ranks)
    except (DataError, OSError, subprocess.SubprocessError, tarfile.TarError):
        pass  # tiktoken's own download is tried next, and its failure is reported with what to do


def get_tokenizer(name: str = "gpt2") -> tiktoken.Encoding:
    """A tiktoken encoding, loaded once per process. "gpt2" (the default) is tiktoken's r50k_base, GPT-2's
    real ids, and works offline: its BPE file is taken from tiktoken's cache, else fetched from the package
    index (openai-whisper sdist), else downloaded by tiktoken. Sets TIKTOKEN_CACHE_DIR when it is unset."""
    return _load_encoding("r50k_base" if name == "gpt2" else name)


@functools.lru_cache(maxsize=None)
def _load_encoding(name: str) -> tiktoken.Encoding:
    if name != "r50k_base":
        if name not in tiktoken.list_encoding_names():
            raise DataError(f"unknown tokenizer {name!r}; choose gpt2 or one of {tiktoken.list_encoding_names()}")
        try:
            return tiktoken.get_encoding(name)
        except Exception as e:
            raise DataError(f"could not load tokenizer {name!r} (tiktoken downloads it on first use): "
                            f"{first_line(e)}") from None
    path = _r50k_cache_path(_tiktoken_cache_dir())
    if _sha256_of(path) != R50K_SHA256:
        _seed_gpt2_ranks(path)
    try:
        return tiktoken.get_encoding("r50k_base")
    except Exception:
        raise DataError(f"GPT-2 tokenizer file not found and not downloadable: make `{PIP_DOWNLOAD}` work "
                        f"(it is fetched from the package index), or copy r50k_base.tiktoken "
                        f"(sha256 {R50K_SHA256}) to {path}") from None


# ----------------------------------------------------------------------------------------------------------
# Shards

SHARD_MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}  # shard version -> token dtype


def shard_version(vocab_size: int) -> int:
    return 1 if vocab_size <= 65535 else 2


def write_shard(path, tokens: np.ndarray, vocab_size: int) -> None:
    """Write tokens (ids below vocab_size) as one shard, atomically (temporary file, fsync, rename)."""
    path = os.fspath(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or len(tokens) >= 2**31:
        raise ValueError(f"{path}: a shard holds a 1-D array of fewer than 2**31 tokens, got shape {tokens.shape}")
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise DataError(f"{path}: token ids must lie in [0, {vocab_size}), got [{tokens.min()}, {tokens.max()}]")
    version = shard_version(vocab_size)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = SHARD_MAGIC, version, len(tokens)
    body = np.ascontiguousarray(tokens, dtype=TOKEN_DTYPES[version])
    _atomic_write(path, header.tobytes(), memoryview(body).cast("B"))


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


# ----------------------------------------------------------------------------------------------------------
# Documents: every source becomes a stream of (text, starts_a_document) pieces

TEXT_CHUNK_CHARS = 1 << 20  # a large text file is read and tokenized this many characters at a time
SNIFF_BYTES = 8192  # the start of a file that decides whether it is text
# Signatures of compressed formats. No text file starts with one, and their bytes would tokenize as noise.
COMPRESSED = {"gzip": rb"\x1f\x8b", "bzip2": rb"BZh[1-9]1AY&SY", "xz": rb"\xfd7zXZ\x00", "zstd": rb"\x28\xb5\x2f\xfd",
              "zip": rb"PK\x03\x04"}
ENCODE_CHARS_PER_THREAD = 4 << 20  # characters read but not yet taken back encoded, per tokenizer thread
ENCODE_BATCH_CHARS = 1 << 16  # characters a tokenizer thread encodes as one task: small, so threads end together
HF_PREFIX = "hf:"


def _safe_cut(text: str, start: int = 0) -> int:
    """The index just after the last newline (at or after start) that has a non-space character before it and
    a letter after it; 0 if there is none. No pre-token of tiktoken's encodings crosses such a newline, so
    the two sides encode to the same ids separately as together."""
    i = text.rfind("\n", start, len(text) - 1)
    while i > 0:
        if not text[i - 1].isspace() and text[i + 1].isalpha():
            return i + 1
        i = text.rfind("\n", start, i)
    return 0


def _count_in_file(path: str, pattern: bytes, block: int = 1 << 24) -> int:
    """How often pattern occurs in the file's bytes, read a block at a time."""
    count, tail = 0, b""
    with open(path, "rb") as f:
        while chunk := f.read(block):
            count += (tail + chunk).count(pattern)
            tail = (tail + chunk)[1 - len(pattern):]  # too short to hold a whole match, so none counts twice
    return count


def _text_pieces(path: str):
    """One text file as one document, read in pieces so a huge file never sits in memory whole. Invalid UTF-8
    becomes U+FFFD, with one warning for the file."""
    starts = True
    rest = ""
    replacements = 0  # U+FFFD read: one per invalid sequence, and those the file really holds
    with open(path, encoding="utf-8", errors="replace") as f:
        while chunk := f.read(TEXT_CHUNK_CHARS):
            replacements += chunk.count("\ufffd")
            rest += chunk
            if len(chunk) < TEXT_CHUNK_CHARS:
                break  # a text read returns fewer characters only at the end of the file: the last piece
            cut = _safe_cut(rest, start=max(len(rest) - len(chunk) - 1, 0))  # the older part has no cut
            if cut:
                yield rest[:cut], starts
                starts, rest = False, rest[cut:]
    if rest:
        yield rest, starts
    if replacements:  # rare, so only then is the file read again, to tell the two apart
        invalid = replacements - _count_in_file(path, "\ufffd".encode())
        if invalid:
            print(f"warning: {path}: {invalid:,} invalid UTF-8 sequences replaced with U+FFFD, the first at line "
                  f"{_first_invalid_line(path)}", file=sys.stderr)


def _first_invalid_line(path: str, block: int = 1 << 24) -> int | None:
    """The line (from 1) of the file's first invalid UTF-8 sequence, read a block at a time; None if it has none."""
    decoder, line = codecs.getincrementaldecoder("utf-8")(), 1
    with open(path, "rb") as f:
        while True:
            chunk = f.read(block)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:  # e.object: the bytes held back from the last block, then this one
                return line + e.object.count(b"\n", 0, e.start)
            if not chunk:
                return None
            line += chunk.count(b"\n")


def _text_of(record, where: str) -> str:
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise DataError(f"{where}: record has no string 'text' field")
    return text


def _jsonl_pieces(path: str):
    with open(path, "rb") as f:  # decoded a line at a time, so that invalid UTF-8 is reported at its line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 ({e.reason} at byte {e.start + 1} of the line)") from None
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
                yield _text_of(record, f"{path}:{lineno}"), True


def _parquet_pieces(path: str):
    import pyarrow.parquet as pq  # only needed for parquet input

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    if "text" not in pf.schema_arrow.names:
        raise DataError(f"{path}: parquet file has no 'text' column (columns: {pf.schema_arrow.names})")
    for batch in pf.iter_batches(columns=["text"], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield _text_of({"text": text}, path), True


def _file_pieces(paths):
    for path in paths:
        if path.endswith(".jsonl"):
            yield from _jsonl_pieces(path)
        elif path.endswith(".parquet"):
            yield from _parquet_pieces(path)
        else:
            yield from _text_pieces(path)


def _not_text(path: str) -> str | None:
    """Why path cannot be tokenized (it is compressed, binary, or part of a datasets save_to_disk directory),
    or None when it can."""
    if path.endswith(".parquet"):
        return None
    if path.endswith(".arrow"):
        return "an Arrow file (datasets' save_to_disk writes these): pass its directory as --input"
    directory = os.path.dirname(path) or "."
    if os.path.basename(path) in SAVED_METADATA and saved_dataset_kind(os.listdir(directory)):
        return f"the metadata of the datasets save_to_disk directory {directory}: pass the directory as --input"
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    compressed = next((name for name, signature in COMPRESSED.items() if re.match(signature, head)), None)
    if compressed:
        return f"{compressed}-compressed; compressed input is not supported, decompress it first"
    if b"\0" in head:
        return f"a binary file (NUL bytes in its first {SNIFF_BYTES} bytes), not UTF-8 text"
    return None


def _files_under(directory: str) -> list[str]:
    """Text-like, .jsonl and .parquet files under directory, recursively, sorted; hidden ones skipped, and so
    are other files that are not text (.arrow files among them).

    A datasets save_to_disk directory met here (inside a directory, or matched by a glob) is refused with a
    DataError rather than skipped: its documents are in Arrow files, which are never read as text, and its
    JSON metadata is no document either, so skipping it would leave its documents out without a word.
    Given as --input on its own, it is read (_saved_pieces)."""
    found = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if kind := saved_dataset_kind(names):
            raise DataError(f"{root}: a datasets save_to_disk directory ({kind}) within the input; its "
                            f"documents are in Arrow files: pass it as --input on its own")
        found += [os.path.join(root, n) for n in names if not n.startswith(".")]
    return sorted(p for p in found if _not_text(p) is None)


# The files of a datasets save_to_disk directory: a Dataset has these two (and data-*.arrow), a DatasetDict
# has dataset_dict.json and one such Dataset directory per split.
SAVED_DATASET = ("dataset_info.json", "state.json")
SAVED_DATASET_DICT = "dataset_dict.json"
SAVED_METADATA = {*SAVED_DATASET, SAVED_DATASET_DICT}


def saved_dataset_kind(names) -> str | None:
    """"DatasetDict" or "Dataset" when the file names of a directory are those datasets' save_to_disk
    writes, else None. Pure: takes the listing, so a test needs no directory."""
    names = set(names)
    if SAVED_DATASET_DICT in names:
        return "DatasetDict"
    if set(SAVED_DATASET) <= names:
        return "Dataset"
    return None


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise DataError("reading a Hugging Face dataset needs the datasets package: pip install datasets") from None
    return datasets


def _saved_pieces(path: str, kind: str, split: str | None):
    """The 'text' column of a save_to_disk directory (of --hf-split, default train, for a DatasetDict), read
    with datasets.load_from_disk. The split and the column are checked now; the rows are read lazily."""
    datasets = _import_datasets()
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:
        raise DataError(f"{path}: could not load the save_to_disk {kind} ({first_line(e)})") from None
    if isinstance(ds, datasets.DatasetDict):
        split = split or "train"
        if split not in ds:
            raise DataError(f"{path}: no split {split!r} in this DatasetDict (splits: {', '.join(ds)}); "
                            f"choose one with --hf-split")
        ds, where = ds[split], f"{path} split {split}"
    elif split:
        raise UsageError(f"--hf-split {split}: {path} is a save_to_disk Dataset, a single split; drop --hf-split")
    else:
        where = path
    if "text" not in ds.column_names:
        raise DataError(f"{where}: no 'text' column (columns: {', '.join(ds.column_names)})")
    return ((_text_of({"text": text}, where), True)
            for batch in ds.select_columns(["text"]).iter(batch_size=1024) for text in batch["text"])


def _hf_pieces(source: str, config: str | None = None, split: str = "train"):
    """A Hugging Face hub dataset NAME (or NAME:CONFIG, the older spelling of --hf-config), its split, streamed.
    Set HF_HUB_OFFLINE=1 to use only the local cache."""
    datasets = _import_datasets()
    name, _, named = source.removeprefix(HF_PREFIX).partition(":")
    if named and config:
        raise UsageError(f"--input {source} names the config {named!r} and --hf-config names {config!r}; "
                         f"give it once, with --hf-config")
    config = config or named or None
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:
        what = f"{name!r}" + (f" (config {config!r}, split {split!r})" if config else f" (split {split!r})")
        raise DataError(f"could not load Hugging Face dataset {what}: {first_line(e)}") from None
    return ((_text_of(record, f"dataset {name}"), True) for record in ds)


def _is_hf_name(source: str) -> bool:
    if source.startswith(HF_PREFIX):
        return True
    # "owner/name[:config]", unless its first part exists here: then it is a mistyped local path.
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+(:[\w.-]+)?", source)) and not os.path.exists(source.split("/")[0])


def _source_pieces(source, hf_config: str | None = None, hf_split: str | None = None):
    """The (text, starts_a_document) pieces of a file, directory, glob, datasets save_to_disk directory or
    Hugging Face hub dataset. Checks that the source exists now, before any work; reads lazily. hf_config
    applies to a hub dataset, hf_split (default train) to a hub dataset or a save_to_disk DatasetDict."""
    source = os.fspath(source)
    if os.path.isdir(source) and (kind := saved_dataset_kind(os.listdir(source))):
        if hf_config:
            raise UsageError(f"--hf-config {hf_config}: {source} is a save_to_disk {kind}, which has no configs")
        return _saved_pieces(source, kind, hf_split)
    if os.path.isdir(source) or os.path.isfile(source) or any(c in source for c in "*?["):
        if hf_config or hf_split:
            flag = "--hf-config" if hf_config else "--hf-split"
            raise UsageError(f"{flag} applies to Hugging Face datasets (a hub name or a save_to_disk "
                             f"directory), not to {source}")
        matches = [source] if os.path.exists(source) else sorted(glob.glob(source, recursive=True))
        for path in matches:  # a file named or globbed must be text; a directory's other files are skipped
            if not os.path.isdir(path) and (why := _not_text(path)):
                raise DataError(f"{path}: {why}")
        files = [f for m in matches for f in (_files_under(m) if os.path.isdir(m) else [m])]
        if not files:
            raise DataError(f"no text, .jsonl or .parquet files found in {source}")
        return _file_pieces(files)
    if _is_hf_name(source):
        return _hf_pieces(source, hf_config, hf_split or "train")
    raise DataError(f"input {source} not found: expected a file, a directory, a glob, "
                    f"or a Hugging Face dataset as owner/name or {HF_PREFIX}NAME")


# ----------------------------------------------------------------------------------------------------------
# Tokenizing into shards


def _ids(enc: tiktoken.Encoding, text: str) -> np.ndarray:
    """enc.encode_ordinary(text) as uint32, straight from tiktoken's buffer (tiktoken >= 0.9): no Python int
    per token, which costs about a tenth of the encoding itself, with the GIL held."""
    try:
        return enc.encode_to_numpy(text, disallowed_special=())
    except UnicodeEncodeError:  # lone surrogates (JSON escapes can make them): replaced as encode_ordinary does
        return enc.encode_to_numpy(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"),
                                   disallowed_special=())


def _tokens(enc: tiktoken.Encoding, batch: list, dtype: np.dtype) -> np.ndarray:
    """The tokens of a batch of (text, starts_a_document) pieces in the shard dtype, the EOT token before each
    document. Runs in a tokenizer thread; numpy copies once, and casts on the way (ids fit the dtype)."""
    eot = np.array([enc.eot_token], dtype=np.uint32)
    parts = []
    for text, starts in batch:
        if starts:
            parts.append(eot)
        parts.append(_ids(enc, text))
    return np.concatenate(parts, dtype=dtype, casting="unsafe")


def _batches(pieces, chars: int):
    """Consecutive pieces grouped into lists of about `chars` characters (a piece is never split); empty
    documents are dropped, as they would add only a lone EOT."""
    batch, n = [], 0
    for text, starts in pieces:
        if not text and starts:
            continue
        batch.append((text, starts))
        n += len(text)
        if n >= chars:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


def _encode(pieces, enc: tiktoken.Encoding):
    """(tokens, documents) per batch of pieces, in order, all cores encoding while this thread reads ahead.

    Small batches go to a pool of tokenizer threads (tiktoken releases the GIL while it encodes), with up to
    ENCODE_CHARS_PER_THREAD characters per thread in flight: reading the next pieces and whatever the caller
    does with a result (writing a shard) overlap with encoding, the threads finish together rather than
    waiting on the longest text of a large batch, and memory stays bounded."""
    threads = os.cpu_count() or 1
    dtype = TOKEN_DTYPES[shard_version(enc.n_vocab)]
    pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenizer")
    in_flight, chars = collections.deque(), 0  # (future, documents, characters) in submission order
    try:
        for batch in _batches(pieces, ENCODE_BATCH_CHARS):
            n = sum(len(text) for text, _ in batch)
            in_flight.append((pool.submit(_tokens, enc, batch, dtype), sum(starts for _, starts in batch), n))
            chars += n
            while chars > threads * ENCODE_CHARS_PER_THREAD:
                future, documents, n = in_flight.popleft()
                chars -= n
                yield future.result(), documents
        for future, documents, _ in in_flight:
            yield future.result(), documents
    finally:  # also on an error or a stop: no thread outlives the call
        pool.shutdown(cancel_futures=True)


# --val-tokens auto: the val split is the first 0.5% of the corpus, within these bounds.
VAL_PER_MILLE = 5
MAX_VAL_TOKENS = 1_000_000  # plenty for a steady val loss, and what a default eval can use; 200M tokens reach it
# The least auto val split: one micro-batch at train.py's defaults (--batch-size 16 of --seq-len 1,024) plus one
# token, as a window's targets are its tokens shifted by one. Any less and a default run's evaluation cannot
# read one whole batch without reading some windows twice.
MIN_VAL_TOKENS = 16 * 1024 + 1
DATA_RECORD = "data.json"  # what prepare records about the shards it wrote: the tokenizer and the counts


def default_val_tokens(total: int) -> int:
    """The val split of --val-tokens auto for a corpus of `total` tokens: 0.5% of it, at least MIN_VAL_TOKENS
    (one eval batch), at most MAX_VAL_TOKENS. Pure, so the rule is tested without a large corpus."""
    return min(MAX_VAL_TOKENS, max(MIN_VAL_TOKENS, total * VAL_PER_MILLE // 1000))


class _ShardWriter:
    """The shards of one preparation. Tokens encoded but not yet written wait in `pending`; write() hands the
    first n of them to a writer thread, which writes (and fsyncs) that shard while the next is being encoded,
    one shard at a time, so memory stays bounded."""

    def __init__(self, out_dir: str, n_vocab: int):
        self.out_dir, self.n_vocab = out_dir, n_vocab
        self.pending, self.n_pending = [], 0
        self.counts = {"val": [], "train": []}  # tokens per shard written
        self.pool, self.writing = ThreadPoolExecutor(1, thread_name_prefix="shard-writer"), None

    @property
    def total(self) -> int:
        """Tokens taken so far, written or pending."""
        return sum(self.counts["val"]) + sum(self.counts["train"]) + self.n_pending

    def add(self, tokens: np.ndarray) -> None:
        self.pending.append(tokens)
        self.n_pending += len(tokens)

    def _path(self, split: str, index: int) -> str:
        return os.path.join(self.out_dir, f"{split}_{index:06d}.bin")

    def write(self, split: str, n: int, skip: int = 0) -> None:
        """Write pending tokens [skip, skip + n) as the split's next shard; the others stay pending, in order."""
        self.wait()  # the previous shard is on disk (or its error is raised here), its memory free
        buf = np.concatenate(self.pending)
        path = self._path(split, len(self.counts[split]))
        self.writing = self.pool.submit(write_shard, path, buf[skip:skip + n], self.n_vocab)
        self.counts[split].append(n)
        self.pending, self.n_pending = [buf[:skip], buf[skip + n:]], len(buf) - n

    def prepend(self, split: str, n: int) -> None:
        """Put the first n pending tokens in front of the split's first shard, which is written anew."""
        self.wait()
        buf, path = np.concatenate(self.pending), self._path(split, 0)
        write_shard(path, np.concatenate([buf[:n], read_shard(path)]), self.n_vocab)
        self.counts[split][0] += n
        self.pending, self.n_pending = [buf[n:]], len(buf) - n

    def wait(self) -> None:
        if self.writing is not None:
            self.writing.result()

    def close(self) -> None:
        self.pool.shutdown()


def _flush(shards: _ShardWriter, shard_tokens: int, val_tokens: int | None) -> None:
    """Write the shards that the pending tokens complete. An explicit val_tokens: the first val_tokens tokens
    go to val, then train shards follow. Auto (None): the val split is the corpus's first tokens, and how many
    is known only at the end, so the first MAX_VAL_TOKENS stay pending and train shards are written from there
    on; _finish puts what val leaves of them in front of the first train shard."""
    if val_tokens is None:
        while shards.n_pending >= MAX_VAL_TOKENS + shard_tokens:
            shards.write("train", shard_tokens, skip=MAX_VAL_TOKENS)
        return
    while True:
        split, size = ("val", val_tokens) if val_tokens and not shards.counts["val"] else ("train", shard_tokens)
        if shards.n_pending < size:
            return
        shards.write(split, size)


def _finish(shards: _ShardWriter, shard_tokens: int, val_tokens: int | None, desc: str) -> None:
    """Write what is still pending. Auto (None): val is the first default_val_tokens(total) tokens; if train
    shards were written past the held MAX_VAL_TOKENS, the held tokens after val go in front of the first of
    them, so train starts right after val either way. Then the last train shard. DataError when no train
    token is left."""
    total = shards.total
    if val_tokens is None:
        val = default_val_tokens(total)
        if total <= val:
            raise DataError(f"{desc} has only {total:,} tokens: --val-tokens auto keeps at least "
                            f"{MIN_VAL_TOKENS:,} for val (one eval batch of 16 x 1,024, plus 1) and leaves none "
                            f"for train; give a smaller --val-tokens N")
        if shards.counts["train"]:
            shards.write("val", val)
            if val < MAX_VAL_TOKENS:
                shards.prepend("train", MAX_VAL_TOKENS - val)
        else:  # all still pending: the shards of --val-tokens val
            _flush(shards, shard_tokens, val)
        val_tokens = val
    if (val_tokens and not shards.counts["val"]) or (shards.n_pending == 0 and not shards.counts["train"]):
        raise DataError(f"{desc} has only {total:,} tokens, not more than --val-tokens {val_tokens:,}; "
                        f"lower --val-tokens")
    if shards.n_pending:
        shards.write("train", shards.n_pending)


def _val_summary(val_tokens: int | None, val: int, total: int) -> str:
    """What the val split is and which rule chose it, for the summary line."""
    if val_tokens is not None:
        return f"val: first {val:,} tokens (--val-tokens {val_tokens})" if val else "val: none (--val-tokens 0)"
    if val == total * VAL_PER_MILLE // 1000:
        why = f"{VAL_PER_MILLE / 10:g}% of the corpus"
    elif val == MIN_VAL_TOKENS:
        why = f"the least: one eval batch of 16 x 1,024, plus 1; {val / total:.1%} of the corpus"
    else:
        why = f"the cap; {val / total:.2%} of the corpus"
    return f"val: first {val:,} tokens ({why}, --val-tokens auto)"


def _summary(stats: dict, val_tokens: int | None, max_tokens: int | None) -> str:
    """The `data:` line that ends a preparation."""
    line = (f"data: {stats['documents']:,} documents, {stats['tokens']:,} tokens ({stats['train_tokens']:,} "
            f"train in {stats['train_shards']} shards) in {stats['seconds']:.1f}s "
            f"({stats['tokens'] / max(stats['seconds'], 1e-9) / 1e6:.2f}M tok/s)")
    if max_tokens is not None:
        line += (f", cut at --max-tokens {max_tokens:,}" if stats["tokens"] == max_tokens
                 else f", all of it (fewer than --max-tokens {max_tokens:,})")
    return f"{line}; {_val_summary(val_tokens, stats['val_tokens'], stats['tokens'])}"


def _build(pieces, out_dir: str, enc: tiktoken.Encoding, shard_tokens: int, val_tokens: int | None, desc: str,
           max_tokens: int | None = None, tokenizer: str | None = None) -> dict:
    """Tokenize pieces into out_dir: val_000000.bin (the first val_tokens tokens; None: the first
    default_val_tokens(total)) and train_*.bin of shard_tokens each (under auto the first one may hold up to
    MAX_VAL_TOKENS more: _finish), at most max_tokens in all; then the record (DATA_RECORD), last, so that it
    describes only shards that are all on disk. -> the record."""
    t0 = time.time()
    shards, documents = _ShardWriter(out_dir, enc.n_vocab), 0
    progress = Progress(max_tokens, desc, unit="tok", unit_scale=True)
    encoded = _encode(pieces, enc)
    try:
        for tokens, docs in encoded:
            if max_tokens is not None and shards.total + len(tokens) >= max_tokens:
                tokens = tokens[:max_tokens - shards.total]
                docs = int(np.count_nonzero(tokens == enc.eot_token))  # the text never encodes to it
            documents += docs
            shards.add(tokens)
            progress.update(len(tokens))
            _flush(shards, shard_tokens, val_tokens)
            if shards.total == max_tokens:
                break
        if documents == 0:
            raise DataError(f"no documents found in {desc}")
        _finish(shards, shard_tokens, val_tokens, desc)
        shards.wait()
    finally:  # no thread is left encoding or writing, even after an error (callers may delete out_dir)
        progress.close()  # also before an error's line, which must not land on the progress bar's
        encoded.close()
        shards.close()
    counts = shards.counts
    stats = {"documents": documents, "tokens": sum(counts["val"]) + sum(counts["train"]),
             "val_tokens": sum(counts["val"]), "train_tokens": sum(counts["train"]),
             "train_shards": len(counts["train"]), "val_from": "start",
             "max_tokens": max_tokens, "seconds": round(time.time() - t0, 3)}
    print(_summary(stats, val_tokens, max_tokens))
    record = {"tokenizer": tokenizer or enc.name, "n_vocab": enc.n_vocab, "eot": enc.eot_token, **stats}
    _atomic_write(os.path.join(out_dir, DATA_RECORD), json.dumps(record, indent=1).encode())
    return record


def _check_sizes(shard_tokens: int, val_tokens: int | None, max_tokens: int | None) -> None:
    """ValueError for sizes no preparation can meet, before anything is read."""
    # Under auto the first train shard also takes what val leaves of the MAX_VAL_TOKENS held back (_finish).
    limit, under = (2**31 - MAX_VAL_TOKENS, " under --val-tokens auto") if val_tokens is None else (2**31, "")
    if not 0 < shard_tokens < limit:
        raise ValueError(f"--shard-tokens must be in [1, {limit:,}){under}, got {shard_tokens:,}")
    if val_tokens is not None and not 0 <= val_tokens < 2**31:
        raise ValueError(f"--val-tokens must be auto or in [0, 2**31), got {val_tokens:,}")
    least = MIN_VAL_TOKENS if val_tokens is None else val_tokens
    if max_tokens is not None and max_tokens <= least:
        raise ValueError(f"--max-tokens {max_tokens:,} leaves no train tokens after the val split ({least:,} "
                         f"tokens{', the least of --val-tokens auto' if val_tokens is None else ''})")


# A preparation is written into OUT.partial-<pid> and renamed to OUT only once it is whole, so OUT is either
# complete or absent, whatever stops the process.
PARTIAL_SUFFIX = ".partial-"


def _local_paths(source: str) -> list[str]:
    """The files and directories that source names here (itself, or a glob's matches); none for a hub name."""
    return [source] if os.path.exists(source) else glob.glob(source, recursive=True)


def _check_out(out_dir: str, inputs: list[str]) -> None:
    """Refuse, before anything is read, an --out that is, holds or lies inside one of the inputs, or that holds
    anything at all: a preparation goes into a new or empty directory, so no file of the user's is replaced."""
    out = os.path.realpath(out_dir)
    for path in inputs:
        real = os.path.realpath(path)
        common = os.path.commonpath([out, real])
        if common in (out, real):
            how = "is" if out == real else "holds" if common == out else "is inside"
            raise UsageError(f"--out {out_dir} {how} the input {path}; choose an output directory apart from --input")
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise DataError(f"--out {out_dir} is a file, not a directory")
    parent = os.path.dirname(out) or os.sep
    if os.path.isdir(out_dir) and os.stat(out).st_dev != os.stat(parent).st_dev:
        raise UsageError(f"--out {out_dir} is a mount point: the shards are made beside it and renamed into place, "
                         f"which cannot cross filesystems; choose a new directory inside it, e.g. {out_dir}/shards")
    names = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    shards = [n for n in names if n.startswith(("train_", "val_")) and n.endswith(".bin")]
    if shards:
        raise DataError(f"{out_dir} already holds shards ({shards[0]}, ...); remove them or choose another --out")
    if names:
        more = ", ..." if len(names) > 1 else ""
        raise DataError(f"--out {out_dir} is not empty (it holds {names[0]}{more}); choose a new or empty directory")


def _lock(directory: str) -> int | None:
    """A descriptor of directory that holds an exclusive flock on it until it is closed or the process ends;
    None when another process holds it or there is no flock (Windows, some network filesystems)."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _partial_dir(out_dir: str) -> tuple[str, int | None]:
    """(a new directory next to out_dir, where a symlink out_dir points, to prepare into; the descriptor that
    locks it). Partial directories that no process holds locked were left by a preparation that was killed:
    they are removed first."""
    base = os.path.realpath(out_dir) + PARTIAL_SUFFIX
    for leftover in glob.glob(glob.escape(base) + "*"):
        if leftover[len(base):].isdigit() and (fd := _lock(leftover)) is not None:
            shutil.rmtree(leftover, ignore_errors=True)
            os.close(fd)
            print(f"data: removed {leftover}, left by a preparation that was killed", file=sys.stderr)
    path = f"{base}{os.getpid()}"
    try:
        os.makedirs(path)
    except OSError as e:
        raise DataError(f"cannot create {path}, where --out {out_dir} is prepared ({e.strerror})") from None
    return path, _lock(path)


def prepare(source, out_dir, tokenizer: str = "gpt2", shard_tokens: int = 100_000_000,
            val_tokens: int | None = None, *, max_tokens: int | None = None, hf_config: str | None = None,
            hf_split: str | None = None) -> dict:
    """Tokenize source (text file, directory, glob, .jsonl/.parquet with a 'text' field, a datasets
    save_to_disk directory, or a Hugging Face hub dataset) into out_dir/train_NNNNNN.bin (shard_tokens each,
    the last one shorter) and out_dir/val_000000.bin, then record the tokenizer and the counts in
    out_dir/data.json. Streams: memory stays bounded by one shard. out_dir must be new or empty and apart
    from the input; it appears, whole, only when the preparation has succeeded (PARTIAL_SUFFIX).

    val_tokens None (--val-tokens auto): the val split is the corpus's first default_val_tokens(total)
    tokens, 0.5% of it within [MIN_VAL_TOKENS, MAX_VAL_TOKENS], so that any corpus gets one that fits it, and
    a larger --max-tokens only lengthens it (up to the same MAX_VAL_TOKENS tokens from 200M tokens on). The
    total is known only at the end: the first MAX_VAL_TOKENS tokens stay in memory until then. A number: the
    first val_tokens tokens (the default corpus passes one). max_tokens: stop after that many tokens in all,
    val and train, cut exactly there. hf_config, hf_split (default train): for a Hugging Face dataset;
    hf_split also picks a save_to_disk DatasetDict's split.
    Returns the record: tokenizer, n_vocab, eot, documents, tokens, val_tokens, train_tokens, train_shards,
    val_from, max_tokens, seconds."""
    _check_sizes(shard_tokens, val_tokens, max_tokens)
    source, out_dir = os.fspath(source), os.fspath(out_dir)
    _check_out(out_dir, _local_paths(source))
    pieces = _source_pieces(source, hf_config, hf_split)
    partial, lock = _partial_dir(out_dir)
    try:
        try:
            record = _build(pieces, partial, get_tokenizer(tokenizer), shard_tokens, val_tokens, desc=source,
                            max_tokens=max_tokens, tokenizer=tokenizer)
        except BaseException:  # an error, Ctrl-C or SIGTERM (main): no part of the preparation is left
            shutil.rmtree(partial, ignore_errors=True)
            raise
        try:
            os.rename(partial, os.path.realpath(out_dir))  # replaces it only if it is an empty directory
        except OSError as e:  # the finished work is kept: the user moves it
            raise DataError(f"cannot move the finished shards to --out {out_dir} ({e.strerror}); they are complete "
                            f"in {partial}: move that directory there yourself") from None
    finally:
        if lock is not None:
            os.close(lock)
    return record


# ----------------------------------------------------------------------------------------------------------
# The embedded default corpus: the Python standard library's own sources

STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "__pycache__"}
CORPUS_VERSION = 1  # bump when the corpus recipe changes, so old caches are not reused
CORPUS_VAL_TOKENS = 131_072
CORPUS_SHARD_TOKENS = 1_000_000
CORPUS_MARKER = "complete.json"


def stdlib_sources() -> list[str]:
    """The standard library's .py files (no tests, no idlelib, no site-packages) in a fixed shuffled order,
    so that the val split and each train shard sample the whole library rather than an alphabetical slice."""
    files = []
    for root, dirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = [d for d in dirs if d not in STDLIB_SKIP_DIRS]
        files += [os.path.join(root, n) for n in names if n.endswith(".py")]
    files.sort()
    random.Random(0).shuffle(files)
    return files


def default_corpus_dir(cache_dir=None, tokenizer: str = "gpt2") -> str:
    """Where default_corpus keeps its shards: in cache_dir (default: <cache_root()>/corpus), keyed by Python
    version and tokenizer. Only the path: nothing is built."""
    root = os.fspath(cache_dir) if cache_dir is not None else os.path.join(cache_root(), "corpus")
    return os.path.join(root, f"stdlib-v{CORPUS_VERSION}-py{platform.python_version()}-{tokenizer}")


def default_corpus(cache_dir=None, tokenizer: str = "gpt2") -> str:
    """The directory of the default corpus's shards (default_corpus_dir), built on first use and reused
    afterwards."""
    out = default_corpus_dir(cache_dir, tokenizer)
    marker = os.path.join(out, CORPUS_MARKER)
    if os.path.exists(marker):
        return out
    files = stdlib_sources()
    if not files:
        raise DataError(f"no Python sources under {sysconfig.get_paths()['stdlib']} for the default corpus")
    enc = get_tokenizer(tokenizer)
    tmp = f"{out}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
    except OSError as e:
        raise DataError(f"cannot create the corpus cache {tmp} ({e.strerror}); set {CACHE_ENV}") from None
    try:
        stats = _build(_file_pieces(files), tmp, enc, CORPUS_SHARD_TOKENS, CORPUS_VAL_TOKENS,
                       desc=f"default corpus ({len(files)} stdlib files)", tokenizer=tokenizer)
        stats.update(python=platform.python_version(), tokenizer=tokenizer, files=len(files))
        _atomic_write(os.path.join(tmp, CORPUS_MARKER), json.dumps(stats, indent=1).encode())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.isdir(out) and not os.path.exists(marker):
        shutil.rmtree(out, ignore_errors=True)  # a half-built cache, e.g. copied in part
    try:
        os.rename(tmp, out)
    except OSError:
        if not os.path.exists(marker):  # unless another process finished the same build first
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------------------------------------
# Which tokenizer made the shards

# Models pad their vocabulary to a multiple of this (model.VOCAB_MULTIPLE; data.py does not import the model).
VOCAB_PAD_MULTIPLE = 128


def data_record(data_dir: str) -> dict | None:
    """What data.py recorded about the shards in data_dir: data.json (prepare and the default corpus write it),
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
        if not isinstance(record, dict) or not isinstance(record.get("tokenizer"), str):
            if name == CORPUS_MARKER:
                continue  # some other tool's complete.json
            raise DataError(f"{path}: not a data record (no tokenizer name)")
        if not isinstance(record.get("n_vocab"), int):  # complete.json names the tokenizer only
            record = {**record, "n_vocab": get_tokenizer(record["tokenizer"]).n_vocab}
        return record
    return None


def _shard_id_limit(data_dir: str) -> int | None:
    """The ids the shards' format can hold (their first shard's header: 2**16 for 16-bit shards), or None when
    it sets no limit that matters (32-bit shards) or there is no shard to read."""
    paths = sorted(glob.glob(os.path.join(glob.escape(data_dir), "train_*.bin"))
                   + glob.glob(os.path.join(glob.escape(data_dir), "val_*.bin")))
    if not paths:
        return None
    return 2**16 if read_shard(paths[0]).dtype == TOKEN_DTYPES[1] else None


def check_vocab(model_vocab: int, data_dir: str) -> str | None:
    """A one-line problem when a model of model_vocab token ids (unpadded, as ModelConfig.vocab_size) cannot
    have been meant for the shards in data_dir, else None.

    With a record (data_record): the model's vocabulary must hold the tokenizer's n_vocab ids and be at most
    n_vocab rounded up to VOCAB_PAD_MULTIPLE (a model may pad; a larger vocabulary is another tokenizer's,
    e.g. Qwen3's 151,936 against GPT-2's 50,257). Without one (llm.c's shards), only the shard header can
    tell: 16-bit shards hold ids below 65,536, so a vocabulary beyond that, rounded up, is another tokenizer's.
    A record that cannot be read is the problem returned; no shards at all is left to the loader (None)."""
    try:
        record = data_record(data_dir)
        limit = _shard_id_limit(data_dir) if record is None else None
    except DataError as e:
        return str(e)
    if record is not None:
        n_vocab, padded = record["n_vocab"], _round_up(record["n_vocab"], VOCAB_PAD_MULTIPLE)
        if n_vocab <= model_vocab <= padded:
            return None
        return (f"the model's vocabulary ({model_vocab:,} ids) does not fit the shards in {data_dir}: they were "
                f"made with the {record['tokenizer']} tokenizer ({n_vocab:,} ids; a model may pad that to "
                f"{padded:,}); prepare the data with the model's tokenizer (data.py --tokenizer)")
    if limit is not None and model_vocab > _round_up(limit, VOCAB_PAD_MULTIPLE):
        return (f"the model's vocabulary ({model_vocab:,} ids) is not the one of the shards in {data_dir}: they "
                f"are 16-bit, so their tokenizer has at most {limit:,} ids (they record none: no {DATA_RECORD}); "
                f"prepare the data with the model's tokenizer (data.py --tokenizer)")
    return None


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ----------------------------------------------------------------------------------------------------------
# Loader


def split_paths(data_dir: str, split: str) -> list[str]:
    """The shard files of a split, in order; DataError when there are none."""
    if not os.path.isdir(data_dir):
        raise DataError(f"data directory {data_dir} does not exist")
    paths = sorted(glob.glob(os.path.join(glob.escape(data_dir), f"{split}_*.bin")))
    if not paths:
        raise DataError(f"no {split} shards ({split}_*.bin) in {data_dir}")
    return paths


def fingerprint(paths: list[str], block: int = 1 << 16) -> list[list]:
    """What tells one set of shards from another, cheaply: each shard's name, size and token count, and a
    hash of its first and last `block` bytes (reading whole shards would cost minutes on a large corpus)."""
    found = []
    for path in paths:
        size, digest = os.path.getsize(path), hashlib.sha256()
        with open(path, "rb") as f:
            digest.update(f.read(block))
            f.seek(max(size - block, 0))
            digest.update(f.read(block))
        found.append([os.path.basename(path), size, digest.hexdigest()[:16]])
    return found


def data_change(saved: list | None, current: list) -> str | None:
    """How the shards a checkpoint trained on differ from these, in a few words; None when they do not (or
    the checkpoint predates fingerprints)."""
    if saved is None or saved == current:
        return None
    names = {name for name, *_ in saved} ^ {name for name, *_ in current}
    if names:
        return f"shards added or removed ({', '.join(sorted(names)[:3])})"
    changed = [a[0] for a, b in zip(saved, current) if a != b]
    return f"shard contents differ ({', '.join(changed[:3])})"


def check_split(data_dir: str, split: str, seq_len: int) -> list[np.ndarray]:
    """The split's shards (memory maps: cheap), each checked to hold at least one sequence; a run calls this
    before it builds a model, so that a sequence too long for the data is refused before anything that size
    is allocated."""
    shards = []
    for path in split_paths(data_dir, split):
        shard = read_shard(path)
        if len(shard) < seq_len + 1:
            raise DataError(f"{path}: shard has {len(shard):,} tokens, fewer than seq_len + 1 = {seq_len + 1:,}")
        shards.append(shard)
    return shards


# BOS-aligned packing: rows that start at a document

GPT2_EOT = 50256  # GPT-2's end-of-text token, which precedes every document in a shard and so acts as its BOS
PACKING_MODES = ("windows", "bos")
# Candidate documents the packer chooses from. More candidates leave less space that only a crop can fill, at
# the cost of a longer wait for a long document; a thousand is far more than a row usually holds.
PACK_BUFFER_DOCS = 1000
FIND_CHUNK_TOKENS = 1 << 24  # tokens compared at a time when finding documents: bounds the temporary mask


def find_documents(tokens: np.ndarray, bos: int, chunk: int = FIND_CHUNK_TOKENS) -> np.ndarray:
    """The offsets (int64, ascending) of the bos tokens in a shard, i.e. where its documents start.
    Vectorised and a chunk at a time, so a 100M-token memory map is scanned once, quickly, with a mask of one
    chunk rather than of the whole shard in memory."""
    found = [np.flatnonzero(tokens[i:i + chunk] == bos) + i for i in range(0, len(tokens), chunk)]
    return np.concatenate(found).astype(np.int64) if found else np.zeros(0, dtype=np.int64)


class Packing(NamedTuple):
    """Rows of documents, as segments in CSR form: row i is segments row_ptr[i]:row_ptr[i + 1], and segment s
    is the first take[s] tokens of document doc[s]. Every document is in at most one row; `cropped` counts
    the tokens of `tokens` (all the documents' tokens) that no row holds."""

    row_ptr: np.ndarray
    doc: np.ndarray
    take: np.ndarray
    cropped: int
    tokens: int

    @property
    def cropped_fraction(self) -> float:
        return self.cropped / self.tokens if self.tokens else 0.0

    def rows(self) -> list[list[tuple[int, int]]]:
        """The rows as lists of (document, tokens taken): for tests and for reading."""
        return [list(zip(self.doc[a:b].tolist(), self.take[a:b].tolist()))
                for a, b in zip(self.row_ptr[:-1], self.row_ptr[1:])]


def pack_best_fit(lengths, row_len: int, buffer_docs: int = PACK_BUFFER_DOCS) -> Packing:
    """Pack documents (their lengths, in stream order) into rows of exactly row_len tokens, best fit.

    A buffer holds the next `buffer_docs` documents of the stream. Each row takes, again and again, the longest
    buffered document that fits the space left; when none fits, the shortest one is cropped to the space (the
    crop that wastes fewest tokens), so rows are always full and need no padding. A document longer than a row
    is therefore cropped too, once nothing shorter is left to choose. Each segment starts at its document's
    start, so every row starts at a document. The last row, if the documents run out before it is full, is
    dropped (its tokens count as cropped)."""
    if row_len < 1 or buffer_docs < 1:
        raise ValueError(f"row_len and buffer_docs must be >= 1, got {row_len}, {buffer_docs}")
    lengths = [int(n) for n in lengths]  # Python ints: the loop below is Python, and numpy scalars are slower
    if lengths and min(lengths) < 1:
        raise ValueError("document lengths must be >= 1 (a document holds at least its BOS token)")
    n, buffer, pending = len(lengths), [], 0  # buffer: sorted (length, document)
    row_ptr, doc, take, space = [0], [], [], row_len
    while True:
        while len(buffer) < buffer_docs and pending < n:
            bisect.insort(buffer, (lengths[pending], pending))
            pending += 1
        if not buffer:
            break
        i = bisect.bisect_right(buffer, (space, n)) - 1  # the longest that fits; -1 when none does
        length, d = buffer.pop(max(i, 0))  # none fits: the shortest, cropped
        doc.append(d)
        take.append(min(length, space))
        space -= take[-1]
        if space == 0:
            row_ptr.append(len(doc))
            space = row_len
    del doc[row_ptr[-1]:], take[row_ptr[-1]:]  # the unfilled last row
    tokens = sum(lengths)
    return Packing(np.array(row_ptr, dtype=np.int64), np.array(doc, dtype=np.int64),
                   np.array(take, dtype=np.int64), tokens - (len(row_ptr) - 1) * row_len, tokens)


class ShardLoader:
    """Yields (x, y) int64 batches of shape [batch_size, seq_len] from data_dir/{split}_*.bin; y is x shifted
    left by one token. Iterates forever, epoch after epoch.

    Windows: a shard of n tokens gives (n - 1) // T windows; window w is tokens [w*T, w*T + T + 1), so every
    token after the first is a target exactly once per epoch. Order: the stream is epoch 0, then epoch 1, ...;
    each epoch visits the shards in a seeded permutation and the windows of each shard in a seeded
    permutation, both new every epoch (shuffle=False: file order, for validation).

    packing="bos": every row starts at a document (a bos_token). The documents of a shard, in a seeded
    permutation new every epoch, are packed into rows of T + 1 tokens by pack_best_fit, and the rows are
    visited in a seeded permutation too; shards come in the same order as windows do. Tokens that no row holds
    (document tails cropped, tokens before a shard's first document, the shard's unfilled last row) are
    counted in `cropped_fraction`. Documents are found once per shard (find_documents) and kept in memory.

    The position is global: g counts the windows (rows) consumed by all ranks together. Each step consumes
    batch_size * world_size of them and rank r takes windows [g + r*B, g + (r+1)*B). So ranks are disjoint,
    each epoch's windows are used exactly once across ranks, and the state is the same on every rank and can
    be loaded at another world size or batch size to continue the same stream. Under packing="bos" a shard's
    row count depends on its epoch's permutation, so the position is (epoch, shard in the epoch's order, row)
    instead of a single count: the same guarantees, without packing earlier shards to find it.
    """

    def __init__(self, data_dir, split: str = "train", *, batch_size: int, seq_len: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True, device="cpu", prefetch: int = 2,
                 vocab_size: int | None = None, packing: str = "windows", bos_token: int = GPT2_EOT,
                 pack_buffer: int = PACK_BUFFER_DOCS):
        if packing not in PACKING_MODES:
            raise ValueError(f"packing must be one of {PACKING_MODES}, got {packing!r}")
        if batch_size < 1 or seq_len < 1 or prefetch < 0:
            raise ValueError(f"batch_size and seq_len must be >= 1 and prefetch >= 0, "
                             f"got {batch_size}, {seq_len}, {prefetch}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank {rank}, world_size {world_size}")
        data_dir = os.fspath(data_dir)
        paths = split_paths(data_dir, split)
        self.shards = check_split(data_dir, split, seq_len)
        self.data_dir, self.split = data_dir, split
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.seed, self.shuffle, self.prefetch, self.vocab_size = seed, shuffle, prefetch, vocab_size
        self.paths = paths
        self.device = torch.device(device)
        self.windows = np.array([(len(s) - 1) // seq_len for s in self.shards])
        self.num_windows = int(self.windows.sum())
        self.packing, self.bos_token, self.pack_buffer = packing, bos_token, pack_buffer
        # The position after what the caller consumed (not merely prefetched): windows, or (epoch, k, row).
        self._next = 0 if packing == "windows" else (0, 0, 0)
        self._plans, self._perms = {}, {}
        self._documents, self._packs = {}, collections.OrderedDict()  # bos: per shard; per (epoch, shard)
        lengths = np.array([len(s) for s in self.shards], dtype=np.int64)
        # Tokens per shard that no row holds; bos: learnt as each shard is packed (negative: not packed yet).
        self._unread = lengths - (self.windows * seq_len + 1) if packing == "windows" else np.full(len(lengths), -1)
        self._lengths = lengths
        self._thread = None

    # -- order --

    def _shard_plan(self, epoch: int):
        """Shard order of an epoch and, for each position in that order, the global index where it ends."""
        if epoch not in self._plans:
            n = len(self.shards)
            order = np.random.default_rng([self.seed, epoch, 0]).permutation(n) if self.shuffle else np.arange(n)
            self._plans = {epoch: (order, np.cumsum(self.windows[order]))}
        return self._plans[epoch]

    def _window_perm(self, epoch: int, shard: int):
        key = (epoch, shard)
        if key not in self._perms:
            n = int(self.windows[shard])
            perm = np.random.default_rng([self.seed, epoch, 1, shard]).permutation(n) if self.shuffle else None
            self._perms = {key: perm}
        return self._perms[key]

    def _locate(self, g: int) -> tuple[int, int]:
        """(shard, window) of global window index g."""
        epoch, i = divmod(g, self.num_windows)
        order, ends = self._shard_plan(epoch)
        k = int(np.searchsorted(ends, i, side="right"))
        shard = int(order[k])
        local = i - int(ends[k] - self.windows[shard])
        perm = self._window_perm(epoch, shard)
        return shard, int(perm[local]) if perm is not None else local

    def _batch(self, g: int):
        """This rank's batch of the step that starts at global window g, on the CPU (pinned for CUDA)."""
        T = self.seq_len
        buf = np.empty((self.batch_size, T + 1), dtype=np.int64)
        for b in range(self.batch_size):
            shard, w = self._locate(g + self.rank * self.batch_size + b)
            buf[b] = self.shards[shard][w * T: w * T + T + 1]
            self._check_ids(buf[b], shard)
        return self._tensors(buf)

    def _check_ids(self, row: np.ndarray, shard: int) -> None:
        # Checked per batch (cheap) rather than per shard at start-up (a full read of the data set).
        if self.vocab_size is not None and row.max() >= self.vocab_size:
            raise DataError(f"{self.paths[shard]}: token id {int(row.max())} is not below the vocabulary "
                            f"size {self.vocab_size}; the shards were made with another tokenizer")

    def _tensors(self, buf: np.ndarray):
        """(x, y) of rows of T + 1 tokens: y is x shifted left by one."""
        t = torch.from_numpy(buf)
        x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
        if self.device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        return x, y

    # -- BOS-aligned packing --

    def _pack(self, epoch: int, k: int):
        """(shard, row order, row_ptr, segment starts, segment lengths) of the k-th shard of an epoch's order,
        packed on first use; the last few are kept, as one step may span several shards."""
        shard = int(self._shard_plan(epoch)[0][k])
        key = (epoch, shard)
        if key in self._packs:
            self._packs.move_to_end(key)
            return self._packs[key]
        if shard not in self._documents:  # found once per shard and kept, as int32 (a shard has < 2**31 tokens)
            self._documents[shard] = find_documents(self.shards[shard], self.bos_token).astype(np.int32)
        starts, T = self._documents[shard], self.seq_len
        lengths = np.diff(starts, append=len(self.shards[shard]))
        docs = np.random.default_rng([self.seed, epoch, 1, shard]).permutation(len(starts)) if self.shuffle \
            else np.arange(len(starts))
        packing = pack_best_fit(lengths[docs], T + 1, self.pack_buffer)
        rows = len(packing.row_ptr) - 1
        order = np.random.default_rng([self.seed, epoch, 2, shard]).permutation(rows) if self.shuffle \
            else np.arange(rows)  # the packer's last rows hold the crops of long documents: spread them
        self._unread[shard] = len(self.shards[shard]) - rows * (T + 1)
        self._packs[key] = (shard, order, packing.row_ptr, starts[docs][packing.doc], packing.take.astype(np.int32))
        if len(self._packs) > 3:
            self._packs.popitem(last=False)
        return self._packs[key]

    def _advance(self, pos: tuple, n: int) -> tuple:
        """The position n rows after pos, at a row that exists (so n=0 skips shards too short for a row)."""
        epoch, k, row = pos
        empty = 0  # shards in a row without a row: all of them means no shard has a long enough document
        while True:
            rows = len(self._pack(epoch, k)[1])
            if row + n < rows:
                return epoch, k, row + n
            n, row, k = n - (rows - row), 0, k + 1
            empty = empty + 1 if rows == 0 else 0
            if empty >= len(self.shards):
                raise DataError(f"{self.data_dir}: no {self.split} shard holds {self.seq_len + 1:,} tokens of "
                                f"documents that start with the token {self.bos_token} (end-of-text): "
                                "--packing bos cannot make a row; use --packing windows")
            if k == len(self.shards):
                epoch, k = epoch + 1, 0

    def _bos_batch(self, pos: tuple):
        """This rank's batch of the step that starts at pos: rows of whole documents, each starting at one."""
        T = self.seq_len
        buf = np.empty((self.batch_size, T + 1), dtype=np.int64)
        pos = self._advance(pos, self.rank * self.batch_size)
        for b in range(self.batch_size):
            shard, order, row_ptr, starts, takes = self._pack(pos[0], pos[1])
            r, filled = int(order[pos[2]]), 0
            for start, take in zip(starts[row_ptr[r]:row_ptr[r + 1]], takes[row_ptr[r]:row_ptr[r + 1]]):
                buf[b, filled:filled + take] = self.shards[shard][start:start + take]
                filled += take
            self._check_ids(buf[b], shard)
            pos = self._advance(pos, 1)
        return self._tensors(buf)

    def _step(self, pos):
        """This rank's batch of the step at pos, and the position after the step (on every rank)."""
        if self.packing == "windows":
            return self._batch(pos), pos + self.step_windows
        return self._bos_batch(pos), self._advance(pos, self.step_windows)

    @property
    def cropped_fraction(self) -> float | None:
        """The fraction of the shards' tokens that no row holds: read (bos: documents' tails cropped to fit a
        row, and what comes before a shard's first document) or left out (the end of a shard) but never
        trained on. Windows: over all shards, a few tokens per shard. bos: over the shards packed so far (their
        latest epoch); None before the first."""
        packed = self._unread >= 0
        return float(self._unread[packed].sum() / self._lengths[packed].sum()) if packed.any() else None

    @property
    def stats(self) -> dict:
        """What a run may log about its data: the packing and the cropped fraction."""
        return {"packing": self.packing, "cropped_fraction": self.cropped_fraction}

    # -- iteration and prefetch --

    @property
    def step_windows(self) -> int:
        return self.batch_size * self.world_size

    @property
    def epoch(self) -> int:
        return self._next // self.num_windows if self.packing == "windows" else self._next[0]

    def _work(self, g, q: queue.Queue, stop: threading.Event):
        def put(item):  # gives up when stopped, so close() never waits on a full queue
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return
                except queue.Full:
                    pass

        try:
            while not stop.is_set():
                batch, g = self._step(g)
                put((batch, g))
        except Exception as e:  # handed to the consumer, which re-raises it
            put(e)

    def __iter__(self):
        return self

    def __next__(self):
        if self.prefetch == 0:
            (x, y), after = self._step(self._next)
        else:
            if self._thread is None:
                self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
                self._thread = threading.Thread(target=self._work, args=(self._next, self._queue, self._stop),
                                                daemon=True, name=f"ShardLoader-rank{self.rank}")
                self._thread.start()
            item = self._queue.get()
            if isinstance(item, Exception):
                self.close()
                raise item
            (x, y), after = item
        self._next = after
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def close(self):
        """Stop the prefetch thread; iterating again restarts it at the consumed position."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def resize(self, batch_size: int) -> None:
        """Take batches of `batch_size` sequences from the current position on (the out-of-memory retry's
        smaller micro-batch); batches already prefetched at the old size are dropped."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.close()
        self.batch_size = batch_size

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- checkpointing --

    def _identity(self) -> dict:
        """What a saved position only means together with: the data, the order and the packing."""
        found = {"seed": self.seed, "seq_len": self.seq_len, "shuffle": self.shuffle,
                 "num_windows": self.num_windows, "packing": self.packing}
        if self.packing == "bos":
            found.update(bos_token=self.bos_token, pack_buffer=self.pack_buffer)
        return found

    def state_dict(self) -> dict:
        """The position after the batches the caller has taken (prefetched ones excluded); same on all ranks."""
        if self.packing == "windows":
            return {"next_window": self._next, **self._identity()}
        return {"next_row": list(self._next), **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        state = {"packing": "windows", **state}  # states saved before --packing existed are windows
        if state["packing"] != self.packing:
            raise DataError(f"the loader state was saved with --packing {state['packing']}, this run has "
                            f"--packing {self.packing}; resume with the same --packing")
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise DataError(f"loader state does not fit this data: saved {key}={state.get(key)}, "
                                f"this loader has {key}={value}")
        self.close()
        if self.packing == "windows":
            self._next = int(state["next_window"])
        else:
            self._next = tuple(int(v) for v in state["next_row"])


# ----------------------------------------------------------------------------------------------------------
# CLI


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        description="Tokenize a corpus into llm.c-format token shards: OUT/val_000000.bin and "
                    "OUT/train_000000.bin, ..., and OUT/data.json (the tokenizer and the counts). Each document "
                    "is preceded by the end-of-text token.")
    parser.add_argument("--input", required=True, metavar="SRC",
                        help="a text file (one document), a directory (its text-like, .jsonl and .parquet files, "
                             "recursively), a quoted glob, a .jsonl or .parquet file with a 'text' field (one "
                             "document per record), a directory written by datasets' save_to_disk (its 'text' "
                             "column), or a Hugging Face hub dataset as owner/name or hf:name (streamed; set "
                             "HF_HUB_OFFLINE=1 to use only the local HF cache)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output directory: new or empty, apart from --input; it appears only once the "
                             "preparation is complete (until then the shards are in DIR.partial-PID)")
    parser.add_argument("--tokenizer", default="gpt2",
                        help="tiktoken encoding; gpt2 (default) works offline via the package index")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                        help="tokens per train shard (default: %(default)s)")
    parser.add_argument("--val-tokens", type=int_or_auto, default="auto", metavar="N|auto",
                        help=f"tokens for the validation shard, always the first ones. auto (default): "
                             f"{VAL_PER_MILLE / 10:g}%% of the corpus, at least {MIN_VAL_TOKENS:,} (one eval "
                             f"batch of 16 x 1,024, plus 1) and at most {MAX_VAL_TOKENS:,}, so a smaller "
                             f"--max-tokens gives a prefix of a larger one's val split; N: the first N tokens")
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N",
                        help="stop after N tokens in all, val and train (a sample of a large dataset); the "
                             "progress then shows N and an ETA (default: the whole input)")
    parser.add_argument("--hf-config", metavar="NAME",
                        help="the configuration (subset) of a Hugging Face hub dataset, e.g. sample-10BT")
    parser.add_argument("--hf-split", metavar="SPLIT",
                        help="the split of a Hugging Face dataset, on the hub or a save_to_disk DatasetDict "
                             "(default: train)")
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is, so it stops a preparation the
    same way: its threads end and its partial output is removed."""


def _terminate(signum, frame):
    raise Terminated()


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return report_error(e)
    # Ctrl-C's own handler too, whatever the process had installed (train.py's start-up handler exits at once)
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _terminate),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
    try:
        val_tokens = None if args.val_tokens == "auto" else args.val_tokens
        prepare(args.input, args.out, args.tokenizer, args.shard_tokens, val_tokens,
                max_tokens=args.max_tokens, hf_config=args.hf_config, hf_split=args.hf_split)
    except (UsageError, DataError, ValueError, OSError) as e:
        return report_error(e)
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        print(f"{'terminated' if terminated else 'interrupted'}; nothing written to {args.out}", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
