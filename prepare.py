"""Tokenize a corpus into llm.c shards and data.json, a directory whole or absent; the default corpus.

Tokenize a corpus into token shards (data.py's format) and data.json, the record of the tokenizer and the
counts. Reads text, .jsonl and .parquet files, directories and globs of them, datasets save_to_disk
directories and Hugging Face hub datasets (sources.py). Also builds the embedded default corpus, the Python
standard library's own sources, which train.py uses when it is given no --data.

    python prepare.py --input corpus.txt --out data/mine       # then: python train.py --data data/mine
"""

import argparse
import collections
import contextlib
import errno
import functools
import glob
import json
import os
import platform
import shutil
import signal
import sys
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import sources
import split
from atomic import atomic_write, lock_directory
from cli import (CACHE_ENV, ArgumentParser, DataError, UsageError, WriteError, cache_root, int_or_auto, plural,
                 report_error)
from progress import Progress
from shards import CORPUS_MARKER, DATA_RECORD, TOKEN_DTYPES, data_record, shard_version, write_data_record, write_shard
from sources import TEXT_FIELD, file_pieces, source_pieces
from tokenizer import (TOKENIZER_FILE, TRAINED_SEPARATOR, TRAINED_TOKEN_BYTES, Tokenizer, TrainingText, load_tokenizer,
                       tokenizer_flag, train_bpe)

ENCODE_CHARS_PER_THREAD = 4 << 20  # characters read but not yet taken back encoded, per tokenizer thread
ENCODE_BATCH_CHARS = 1 << 16  # characters a tokenizer thread encodes as one task: small, so threads end together
# ... when the tokenizer spreads one batch over threads of its own (tokenizers): large, so that they have texts
# to balance between them (about 0.72 of encode_batch_fast's throughput at 64K characters, 0.92 at 4M).
SPREAD_BATCH_CHARS = 1 << 22


def _tokens(enc: Tokenizer, batch: list, dtype: np.dtype) -> np.ndarray:
    """The tokens of a batch of (text, starts_a_document) pieces in the shard dtype, the separator (enc.eot)
    before each document. Runs in a tokenizer thread; numpy copies once, and casts on the way (ids fit the
    dtype)."""
    eot = np.array([enc.eot], dtype=np.uint32)
    parts = []
    for (_, starts), ids in zip(batch, enc.encode_batch([text for text, _ in batch])):
        if starts:
            parts.append(eot)
        parts.append(ids)
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


def _encode(pieces, enc: Tokenizer):
    """(tokens, documents) per batch of pieces, in order, all cores encoding while this thread reads ahead.

    Batches go to a pool of tokenizer threads (tiktoken and tokenizers release the GIL while they encode),
    with up to ENCODE_CHARS_PER_THREAD characters per thread in flight: reading the next pieces and whatever
    the caller does with a result (writing a shard) overlap with encoding, and memory stays bounded. tiktoken's
    batches are small, so the threads finish together rather than waiting on the longest text of a large
    batch; tokenizers spreads each batch over threads of its own, which balance a large one better."""
    threads = os.cpu_count() or 1
    dtype = TOKEN_DTYPES[shard_version(enc.n_vocab)]
    batch_chars = SPREAD_BATCH_CHARS if enc.spreads_batches else ENCODE_BATCH_CHARS
    pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenizer")
    in_flight, chars = collections.deque(), 0  # (future, documents, characters) in submission order
    try:
        for batch in _batches(pieces, batch_chars):
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


class _ShardWriter:
    """The train shards of one preparation. Train tokens wait in `pending` until they fill a shard; write()
    hands it to a writer thread, which writes (and fsyncs) it while the next is being encoded, one shard at a
    time, so memory stays bounded."""

    def __init__(self, out_dir: str, n_vocab: int, shard_tokens: int):
        self.out_dir, self.n_vocab, self.shard_tokens = out_dir, n_vocab, shard_tokens
        self.pending, self.n_pending = [], 0
        self.counts = []  # tokens per train shard written
        self.sha256 = {}  # shard name -> the sha256 of its file, for data.json
        self.pool, self.writing = ThreadPoolExecutor(1, thread_name_prefix="shard-writer"), None

    def add(self, tokens: np.ndarray) -> None:
        """Take train tokens, in order; write each shard they complete."""
        self.pending.append(tokens)
        self.n_pending += len(tokens)
        while self.n_pending >= self.shard_tokens:
            self.write(self.shard_tokens)

    def write(self, n: int) -> None:
        """Write the first n pending tokens as the next train shard."""
        self.wait()  # the previous shard is on disk (or its error is raised here), its memory free
        buf = np.concatenate(self.pending)
        name = f"train_{len(self.counts):06d}.bin"
        self.writing = name, self.pool.submit(write_shard, os.path.join(self.out_dir, name), buf[:n], self.n_vocab)
        self.counts.append(n)
        self.pending, self.n_pending = [buf[n:]], len(buf) - n

    def wait(self) -> None:
        if self.writing is not None:
            name, future = self.writing
            self.sha256[name] = future.result()
            self.writing = None

    def close(self) -> None:
        self.pool.shutdown()


def _val_summary(val_tokens: int | None, stats: dict, val_rule: str | None = None) -> str:
    """What the val split is and which rule chose it, for the summary line. val_rule: what set val_tokens when
    no --val-tokens did (the default corpus's fixed size)."""
    val, total = stats["val_tokens"], stats["tokens"]
    if val_tokens is not None:
        why = val_rule or f"--val-tokens {val_tokens}"
    elif val == total * split.VAL_PER_MILLE // 1000:
        why = f"{split.VAL_PER_MILLE / 10:g}% of the corpus, --val-tokens auto"
    elif val == split.MIN_VAL_TOKENS:
        why = f"the least: one eval batch of 16 x 1,024, plus 1; {val / total:.1%} of the corpus, --val-tokens auto"
    else:
        why = f"the cap; {val / total:.2%} of the corpus, --val-tokens auto"
    if not val:
        return f"val: none ({why})"
    alone = ("; --text-documents paragraphs or a token count lets val be drawn across it"
             if stats["documents"] == 1 else "")
    return f"val: {plural(val, 'token')} in {split.describe(stats)} ({why}){alone}"


def _summary(stats: dict, val_tokens: int | None, max_tokens: int | None, val_rule: str | None = None) -> str:
    """The `data:` line that ends a preparation (val_rule: _val_summary's)."""
    how = (f" (cut into pieces of at most {stats['piece_tokens']:,} tokens)" if stats["piece_tokens"] else
           " (text files cut at blank lines)" if stats["text_documents"] == "paragraphs" else "")
    line = (f"data: {plural(stats['documents'], 'document')}{how}, {plural(stats['tokens'], 'token')} "
            f"({stats['train_tokens']:,} train in {plural(stats['train_shards'], 'shard')}) "
            f"in {stats['seconds']:.1f}s ({stats['tokens'] / max(stats['seconds'], 1e-9) / 1e6:.2f}M tok/s)")
    if max_tokens is not None:
        line += (f", cut at --max-tokens {max_tokens:,}" if stats["tokens"] == max_tokens
                 else f", all of it (fewer than --max-tokens {max_tokens:,})")
    return f"{line}; {_val_summary(val_tokens, stats, val_rule)}"


def _build(pieces, out_dir: str, enc: Tokenizer, shard_tokens: int, val_tokens: int | None, desc: str,
           max_tokens: int | None = None, val_rule: str | None = None, documents_from=("file", None)) -> dict:
    """Tokenize pieces into out_dir: val_000000.bin (the documents split.ValSplit draws, val_tokens tokens of
    them; None: split.default_val_tokens(total)) and train_*.bin of shard_tokens each, at most max_tokens in all;
    then a copy of a Hugging Face tokenizer's tokenizer.json, and the record (data.json), last, so that it
    describes only shards that are all on disk. documents_from: sources.text_documents's answer, recorded; under
    ("tokens", N) every document is cut into pieces of at most N tokens. -> the record."""
    t0 = time.time()
    shards, documents, run = _ShardWriter(out_dir, enc.n_vocab, shard_tokens), 0, 0
    sorter = split.ValSplit(enc.eot, val_tokens)
    progress = Progress(max_tokens, desc, unit="tok", unit_scale=True)
    encoded = _encode(pieces, enc)
    try:
        for tokens, docs in encoded:
            if documents_from[1]:
                tokens, run = split.cut_documents(tokens, enc.eot, documents_from[1], run)
                docs = int(np.count_nonzero(tokens == enc.eot))
            if max_tokens is not None and sorter.total + len(tokens) >= max_tokens:
                tokens = tokens[:max_tokens - sorter.total]
                docs = int(np.count_nonzero(tokens == enc.eot))  # a special token: the text never encodes to it
            documents += docs
            progress.update(len(tokens))
            if (train := sorter.add(tokens)) is not None:
                shards.add(train)
            if sorter.total == max_tokens:
                break
        if documents == 0:
            raise DataError(f"no documents found in {desc}")
        val, rest, val_documents = sorter.finish(desc)
        shards.add(rest)
        if shards.n_pending:
            shards.write(shards.n_pending)
        if len(val):
            shards.sha256["val_000000.bin"] = write_shard(os.path.join(out_dir, "val_000000.bin"), val, enc.n_vocab)
        shards.wait()
    finally:  # no thread is left encoding or writing, even after an error (callers may delete out_dir)
        progress.close()  # also before an error's line, which must not land on the progress bar's
        encoded.close()
        shards.close()
    stats = {"documents": documents, "tokens": sorter.total, "val_tokens": len(val),
             "train_tokens": sum(shards.counts), "train_shards": len(shards.counts), "val_from": "draws",
             "val_draws": split.VAL_DRAWS, "val_documents": val_documents, "max_tokens": max_tokens,
             "text_documents": documents_from[0], "piece_tokens": documents_from[1],
             "seconds": round(time.time() - t0, 3), "sha256": dict(sorted(shards.sha256.items()))}
    print(_summary(stats, val_tokens, max_tokens, val_rule))
    record = {**enc.record(), "uint32": shard_version(enc.n_vocab) == 2, **stats}
    if "tokenizer_file" in record:  # sample.py, score.py and hf.py read the tokenizer from here
        atomic_write(os.path.join(out_dir, record["tokenizer_file"]), enc.text.encode("utf-8"))
    write_data_record(out_dir, record)
    return record


def _check_sizes(shard_tokens: int, val_tokens: int | None, max_tokens: int | None) -> None:
    """ValueError for sizes no preparation can meet, before anything is read."""
    if not 0 < shard_tokens < 2**31:
        raise ValueError(f"--shard-tokens must be in [1, {2**31:,}), got {shard_tokens:,}")
    if val_tokens is not None and not 0 <= val_tokens < 2**31:
        raise ValueError(f"--val-tokens must be auto or in [0, 2**31), got {val_tokens:,}")
    least = split.MIN_VAL_TOKENS if val_tokens is None else val_tokens
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens:,}")
    if max_tokens is not None and max_tokens <= least:
        raise ValueError(f"--max-tokens {max_tokens:,} leaves no train tokens after the val split ({least:,} "
                         f"tokens{', the least of --val-tokens auto' if val_tokens is None else ''})")


# --train-tokenizer VOCAB: at least the 256 bytes and the separator; at most four times the largest vocabulary
# in use (Gemma's 262,144), as the trainer's memory grows with it.
MIN_TRAINED_VOCAB = 257
MAX_TRAINED_VOCAB = 1 << 20
# The most characters the tokenizer trains on, about a GB of text: minutes of training, not hours, and plenty
# for vocabularies of the sizes in use.
TOKENIZER_TRAIN_CHARS = 1_000_000_000


def _check_trained_vocab(vocab: int) -> None:
    if not MIN_TRAINED_VOCAB <= vocab <= MAX_TRAINED_VOCAB:
        raise ValueError(f"--train-tokenizer must be in [{MIN_TRAINED_VOCAB}, {MAX_TRAINED_VOCAB:,}] (the 256 bytes, "
                         f"the merges and the separator), got {vocab:,}")


def _trained_tokenizer(pieces, vocab: int, held: tuple[int, int], separator: str, desc: str) -> Tokenizer:
    """tokenizer.train_bpe of vocab ids on the text of pieces that the val split cannot take (held:
    split.val_held_out's), at most TOKENIZER_TRAIN_CHARS characters of it. DataError when none is left."""
    print(f"tokenizer: training a byte-level BPE of {vocab:,} ids on {desc}", file=sys.stderr)
    text = TrainingText(split.texts_outside(pieces, held), TOKENIZER_TRAIN_CHARS)
    enc = train_bpe(text, vocab, f"trained:{vocab}", separator)
    if text.chars == 0:
        raise DataError(f"{desc} has no text outside the documents that the val split can take (up to "
                        f"{TRAINED_TOKEN_BYTES} bytes a token, the longest), held out for the val split; give a "
                        f"smaller --val-tokens N")
    fewer = f" (not {vocab:,}: the text has no more pairs to merge)" if enc.n_vocab < vocab else ""
    which = f"{text.chars:,} characters" + (" (the cap)" if text.capped else "")
    print(f"tokenizer: trained {enc.n_vocab:,} ids{fewer} on {which} of {desc}, the documents that the val split "
          f"can take held out")
    return enc


# A preparation is written into OUT.partial-<pid> and renamed to OUT only once it is whole, so OUT is either
# complete or absent, whatever stops the process.
PARTIAL_SUFFIX = ".partial-"
# Under --overwrite the earlier preparation is renamed to OUT.replaced-<pid> while the new one is renamed to
# OUT, then removed; a process killed between the two renames leaves it there, whole.
REPLACED_SUFFIX = ".replaced-"


def is_preparation_file(name: str) -> bool:
    """Whether a preparation writes a file of this name (what --overwrite may replace)."""
    shard = name.startswith(("train_", "val_")) and name.endswith(".bin")
    return shard or name in (DATA_RECORD, TOKENIZER_FILE)


def partial_target(path: str) -> str | None:
    """The --out that path, a directory of PARTIAL_SUFFIX's naming, is being prepared for; else None."""
    out, suffix, pid = os.path.realpath(path).rpartition(PARTIAL_SUFFIX)
    return out if suffix and pid.isdigit() else None


def unfinished_preparation(directory: str) -> str | None:
    """Why directory holds a preparation that has not finished (one still running, or one that was killed), in
    a few words; None when it does not. Each shard in it looks whole, so a reader (data.py) goes by these
    signs instead: the PARTIAL_SUFFIX naming without data.json, which is written last, or a preparation's file
    that atomic.replace_with was writing (NAME.PID.tmp). OUT.replaced-PID (REPLACED_SUFFIX) is whole."""
    for name in sorted(os.listdir(directory)):
        parts = name.rsplit(".", 2)
        if len(parts) == 3 and parts[1].isdigit() and parts[2] == "tmp" and is_preparation_file(parts[0]):
            return f"it holds {name}, which prepare.py was writing"
    if (out := partial_target(directory)) is not None and not os.path.exists(os.path.join(directory, DATA_RECORD)):
        return f"prepare.py makes {out} here and it has no {DATA_RECORD}, which prepare.py writes last"
    return None


def _local_paths(source: str) -> list[str]:
    """The files and directories that source names here (itself, or a glob's matches); none for a hub name."""
    return [source] if os.path.exists(source) else glob.glob(source, recursive=True)


def _check_out(out_dir: str, inputs: list[str], overwrite: bool = False) -> None:
    """Refuse, before anything is read, an --out that is, holds or lies inside one of the inputs, or that holds
    anything at all: a preparation goes into a new or empty directory, so no file of the user's is replaced.
    overwrite: an --out that holds an earlier preparation (its files and nothing else) is accepted."""
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
    others = [n for n in names if not is_preparation_file(n)]
    if overwrite and others:
        raise DataError(f"--out {out_dir} holds {others[0]}, which no preparation writes; --overwrite replaces only "
                        f"an earlier preparation: choose another --out")
    if overwrite:
        return
    shards = [n for n in names if n.startswith(("train_", "val_")) and n.endswith(".bin")]
    if shards:
        raise DataError(f"{out_dir} already holds shards ({shards[0]}, ...); pass --overwrite to replace them once "
                        f"the new preparation is complete, or choose another --out")
    if names:
        more = ", ..." if len(names) > 1 else ""
        raise DataError(f"--out {out_dir} is not empty (it holds {names[0]}{more}); choose a new or empty directory")


def _partial_dir(out_dir: str) -> tuple[str, int | None]:
    """(a new directory next to out_dir, where a symlink out_dir points, to prepare into; the descriptor that
    locks it). Partial directories that no process holds locked were left by a preparation that was killed:
    they are removed first."""
    target = os.path.realpath(out_dir)
    base = target + PARTIAL_SUFFIX
    for leftover in glob.glob(glob.escape(base) + "*"):
        if partial_target(leftover) == target and (fd := lock_directory(leftover)) is not None:
            shutil.rmtree(leftover, ignore_errors=True)
            os.close(fd)
            print(f"data: removed {leftover}, left by a preparation that was killed", file=sys.stderr)
    path = f"{base}{os.getpid()}"
    try:
        os.makedirs(path)
    except OSError as e:
        raise DataError(f"cannot create {path}, where --out {out_dir} is prepared ({e.strerror})") from None
    return path, lock_directory(path)


@contextlib.contextmanager
def _stops_held():
    """Holds SIGINT and SIGTERM back while the block runs, yielding the list of those that arrived: a stop
    between _move_into_place's renames would leave no OUT, and the new preparation where the next run removes
    it. Signals reach Python handlers only in the main thread: elsewhere there is nothing to hold."""
    stops = []
    if threading.current_thread() is not threading.main_thread():
        yield stops
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: stops.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stops
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _move_into_place(partial: str, out_dir: str, overwrite: bool) -> None:
    """Rename the finished preparation to out_dir. overwrite: an earlier preparation there is renamed aside
    first and removed only once the new one is in place (kept, and said, if something else has appeared in it
    since _check_out); if the new one cannot be moved, the earlier one goes back."""
    target = os.path.realpath(out_dir)
    earlier = None
    if overwrite and os.path.isdir(target) and os.listdir(target):
        earlier = f"{target}{REPLACED_SUFFIX}{os.getpid()}"
        os.rename(target, earlier)
    try:
        os.rename(partial, target)  # replaces it only if it is an empty directory
    except OSError as e:  # the finished work is kept: the user moves it
        if earlier is not None:
            os.rename(earlier, target)
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and (theirs := data_record(target)) is not None:
            _lost_the_race(partial, out_dir, theirs)
            return
        raise DataError(f"cannot move the finished shards to --out {out_dir} ({e.strerror}); they are complete "
                        f"in {partial}: move that directory there yourself") from None
    if earlier is None:
        return
    others = [name for name in os.listdir(earlier) if not is_preparation_file(name)]
    if others:
        print(f"data: kept the earlier preparation in {earlier}: it holds {others[0]}, which no preparation writes",
              file=sys.stderr)
    else:
        shutil.rmtree(earlier, ignore_errors=True)


def _lost_the_race(partial: str, out_dir: str, theirs: dict) -> None:
    """Another preparation finished out_dir while this one ran (their record: theirs). The same shards: this
    copy goes, with a note. Others: DataError saying where this one is whole and how to use it."""
    ours = data_record(partial)
    differ = sorted(key for key in {*ours, *theirs} - {"seconds"} if ours.get(key) != theirs.get(key))
    if not differ:
        shutil.rmtree(partial, ignore_errors=True)
        print(f"data: another preparation finished --out {out_dir} first, with the same shards (data.json agrees); "
              f"kept it and removed this one's copy", file=sys.stderr)
        return
    raise DataError(f"another preparation finished --out {out_dir} while this one ran, with other shards (data.json "
                    f"differs in {', '.join(differ[:3])}); this one is complete in {partial}: `mv {partial} NEW_DIR`, "
                    f"then train with --data NEW_DIR")


def prepare(source, out_dir, tokenizer: str = "gpt2", shard_tokens: int = 100_000_000,
            val_tokens: int | None = None, *, max_tokens: int | None = None, hf_config: str | None = None,
            hf_split: str | None = None, doc_separator: str | None = None, text_field: str = TEXT_FIELD,
            overwrite: bool = False, train_tokenizer: int | None = None, text_documents: str | int = "auto") -> dict:
    """Tokenize source (text file, directory, glob, .jsonl/.parquet with a text_field field, a datasets
    save_to_disk directory, or a Hugging Face hub dataset) into out_dir/train_NNNNNN.bin (shard_tokens each,
    the last one shorter) and out_dir/val_000000.bin, then record the tokenizer and the counts in
    out_dir/data.json. Streams: memory stays bounded by one shard. out_dir must be new or empty and apart
    from the input; it appears, whole, only when the preparation has succeeded (PARTIAL_SUFFIX). overwrite:
    out_dir may hold an earlier preparation, replaced only then.

    tokenizer: anything tokenizer.load_tokenizer takes (a tiktoken encoding, a tokenizer.json, a tokenizer
    directory, a cached hub name); doc_separator names the token before each document when the tokenizer has
    no end-of-text or BOS token of its own. A Hugging Face tokenizer's tokenizer.json is copied into out_dir.
    train_tokenizer: in place of tokenizer, a byte-level BPE of that many ids (tokenizer.train_bpe, named
    trained:VOCAB, its separator doc_separator or <|endoftext|>) trained on the source's documents that the
    val split cannot take (split.val_held_out), at most TOKENIZER_TRAIN_CHARS characters of them, whatever
    max_tokens; the source is read twice more for it. text_documents: sources.text_documents's request.

    The val split is documents drawn by a hash of their position (split.py): val_tokens of their tokens, or
    under None (--val-tokens auto) default_val_tokens(total), 0.5% of the corpus within [MIN_VAL_TOKENS,
    MAX_VAL_TOKENS], so that any corpus gets one that fits it, and a larger --max-tokens only lengthens it (up
    to the same MAX_VAL_TOKENS tokens from 200M tokens on). max_tokens: stop after that many tokens in all,
    val and train, cut exactly there. hf_config, hf_split (default train): for a Hugging Face dataset;
    hf_split also picks a save_to_disk DatasetDict's split.
    Returns the record: the tokenizer's (Tokenizer.record: tokenizer, tokenizer_sha256, n_vocab, eot,
    doc_separator, tokenizer_file for a Hugging Face one), uint32, documents, tokens, val_tokens,
    train_tokens, train_shards, val_from, val_draws, val_documents, max_tokens, text_documents, piece_tokens,
    seconds."""
    _check_sizes(shard_tokens, val_tokens, max_tokens)
    if train_tokenizer is not None:
        _check_trained_vocab(train_tokenizer)
    source, out_dir = os.fspath(source), os.fspath(out_dir)
    _check_out(out_dir, _local_paths(source), overwrite)
    documents_from = sources.text_documents(source, text_documents, train_tokenizer is not None)
    read = functools.partial(source_pieces, source, hf_config, hf_split, text_field,  # a new pass over source
                             paragraphs=documents_from[0] == "paragraphs")
    if train_tokenizer is None:
        enc = load_tokenizer(tokenizer, doc_separator)
    else:
        held = split.val_held_out(read(), val_tokens, max_tokens, TRAINED_TOKEN_BYTES)
        enc = _trained_tokenizer(read(), train_tokenizer, held, doc_separator or TRAINED_SEPARATOR, source)
    pieces = read()
    partial, lock = _partial_dir(out_dir)
    try:
        try:
            record = _build(pieces, partial, enc, shard_tokens, val_tokens, desc=source, max_tokens=max_tokens,
                            documents_from=documents_from)
        except BaseException:  # an error, Ctrl-C or SIGTERM (main): no part of the preparation is left
            shutil.rmtree(partial, ignore_errors=True)
            raise
        with _stops_held() as stops:
            _move_into_place(partial, out_dir, overwrite)
        if stops:  # too late to stop: the preparation is whole, so it is kept and said
            print(f"data: {signal.Signals(stops[0]).name} arrived while the finished preparation was moved into "
                  f"place; {out_dir} holds it, complete", file=sys.stderr)
    finally:
        if lock is not None:
            os.close(lock)
    return record


# ----------------------------------------------------------------------------------------------------------
# The embedded default corpus: the Python standard library's own sources

CORPUS_VERSION = 2  # bump when the corpus recipe changes, so old caches are not reused
CORPUS_VAL_TOKENS = 131_072
CORPUS_SHARD_TOKENS = 1_000_000


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
    files = sources.stdlib_sources()
    if not files:
        raise DataError(f"no Python sources under {sysconfig.get_paths()['stdlib']} for the default corpus")
    enc = load_tokenizer(tokenizer)
    tmp = f"{out}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
    except OSError as e:
        raise DataError(f"cannot create the corpus cache {tmp} ({e.strerror}); set {CACHE_ENV}") from None
    try:
        stats = _build(file_pieces(files), tmp, enc, CORPUS_SHARD_TOKENS, CORPUS_VAL_TOKENS,
                       desc=f"default corpus ({plural(len(files), 'stdlib file')})",
                       val_rule="the default corpus's fixed val size")
        stats.update(python=platform.python_version(), tokenizer=tokenizer, files=len(files))
        atomic_write(os.path.join(tmp, CORPUS_MARKER), json.dumps(stats, indent=1).encode())
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
# CLI


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        description="Tokenize a corpus into llm.c-format token shards: OUT/val_000000.bin and "
                    "OUT/train_000000.bin, ..., and OUT/data.json (the tokenizer and the counts). Each document "
                    "is preceded by the end-of-text token.")
    parser.add_argument("--input", required=True, metavar="SRC",
                        help="a text file (one document), a directory (its text-like, .jsonl and .parquet files, "
                             "recursively), a quoted glob, a .jsonl or .parquet file with a 'text' field (one "
                             "document per record; --text-field names another), a directory written by datasets' "
                             "save_to_disk (its 'text' column), or a Hugging Face hub dataset as owner/name or "
                             "hf:name (streamed; set HF_HUB_OFFLINE=1 to use only the local HF cache)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output directory: new or empty (or an earlier preparation, with --overwrite), apart "
                             "from --input; it appears only once the preparation is complete (until then the "
                             "shards are in DIR.partial-PID)")
    tokenizer = parser.add_mutually_exclusive_group()
    # No default value here, so that an explicit --tokenizer gpt2 also excludes --train-tokenizer.
    tokenizer.add_argument("--tokenizer", type=tokenizer_flag, metavar="NAME|PATH",
                           help="a tiktoken encoding (gpt2 works offline via the package index; cl100k_base, "
                                "o200k_base, ...), a tokenizer.json, a Hugging Face tokenizer directory (with its "
                                "tokenizer.json), or a hub name owner/name already in the local Hugging Face cache "
                                "(never downloaded) (default: gpt2)")
    tokenizer.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                           help=f"instead of --tokenizer, train a byte-level BPE of VOCAB ids ({MIN_TRAINED_VOCAB} to "
                                f"{MAX_TRAINED_VOCAB:,}: the 256 bytes, the merges, then the separator, "
                                f"--doc-separator or {TRAINED_SEPARATOR}) on the input and prepare the shards with it; "
                                f"its tokenizer.json is saved beside them. It trains on the text after the val split's "
                                f"(held out: val tokens x {TRAINED_TOKEN_BYTES} bytes, the longest token), at most "
                                f"{TOKENIZER_TRAIN_CHARS:,} characters of it; the input is read once more for it "
                                f"(twice under --val-tokens auto)")
    parser.add_argument("--doc-separator", metavar="TOKEN",
                        help="the special token put before every document; under --train-tokenizer, the one it "
                             "makes (default: the tokenizer's end-of-text "
                             "or BOS token: its tokenizer_config.json's bos_token or eos_token, else the first "
                             "of <|endoftext|>, </s>, <s>, ... it has)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier preparation in --out (its shards, data.json and tokenizer.json, "
                             "and nothing else), only once the new one is complete")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                        help="tokens per train shard (default: %(default)s)")
    parser.add_argument("--val-tokens", type=int_or_auto, default="auto", metavar="N|auto",
                        help=f"tokens for the validation shard, taken from documents drawn by a hash of their "
                             f"position (1 in {split.VAL_DRAWS}, more draws in a small corpus). auto: "
                             f"{split.VAL_PER_MILLE / 10:g}%% of the corpus, at least {split.MIN_VAL_TOKENS:,} (one "
                             f"eval batch of 16 x 1,024, plus 1) and at most {split.MAX_VAL_TOKENS:,}, so a smaller "
                             f"--max-tokens gives a prefix of a larger one's val split; N: N tokens "
                             f"(default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N",
                        help="stop after N tokens in all, val and train (a sample of a large dataset); the "
                             "progress then shows N and an ETA (default: the whole input)")
    _add_document_arguments(parser)
    return parser


def _add_document_arguments(parser: ArgumentParser) -> None:
    """What in the input is a document, and where its text is."""
    parser.add_argument("--text-documents", type=_documents_mode, default="auto", metavar="auto|paragraphs|file|N",
                        help="how a text file is cut into documents, which the val split draws from: paragraphs: one "
                             "per blank-line paragraph; file: the whole file is one; N: every document cut into "
                             "pieces of at most N tokens; auto: a lone text file by its paragraphs, or in pieces of "
                             f"{sources.TEXT_PIECE_TOKENS:,} tokens where it has no blank line, and each file of a "
                             "directory or glob whole. The choice is recorded in data.json (default: %(default)s)")
    parser.add_argument("--text-field", default=TEXT_FIELD, metavar="NAME",
                        help="the field (.jsonl) or column (.parquet, datasets) that holds each document's text "
                             "(default: %(default)s)")
    parser.add_argument("--hf-config", metavar="NAME",
                        help="the configuration (subset) of a Hugging Face hub dataset, e.g. sample-10BT")
    parser.add_argument("--hf-split", metavar="SPLIT",
                        help="the split of a Hugging Face dataset, on the hub or a save_to_disk DatasetDict "
                             "(default: train)")


def _documents_mode(text: str) -> str | int:
    if text in ("auto", "paragraphs", "file"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto, paragraphs, file or a token count, got {text!r}") from None


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
        prepare(args.input, args.out, args.tokenizer or "gpt2", args.shard_tokens, val_tokens,
                max_tokens=args.max_tokens, hf_config=args.hf_config, hf_split=args.hf_split,
                doc_separator=args.doc_separator, text_field=args.text_field, overwrite=args.overwrite,
                train_tokenizer=args.train_tokenizer, text_documents=args.text_documents)
    except WriteError as e:  # the partial preparation is gone: what the disk has left is what a rerun finds
        print(f"error: {e}; nothing written to {args.out}", file=sys.stderr)
        return 1
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
