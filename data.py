"""Data: what the shards' data.json says of their tokenizer, and the resumable loader that streams training rows.

The shards themselves (llm.c's format, read and written, and watched while a run reads them) and data.json (written
and read) are shards.py's.
Each document is preceded by the end-of-text token, as in llm.c and modded-nanogpt (another tokenizer's
separator: its end-of-text or BOS token). Next to the shards, data.json records the tokenizer (name, sha256,
n_vocab, separator id, whether its ids need uint32), the counts and each shard's sha256, and a Hugging Face
tokenizer's tokenizer.json lies beside it; check_vocab, vocab_from_data and data_tokenizer read them.
prepare.py makes shards: `python prepare.py --input corpus.txt --out data/mine`.

The loader reads rows of seq_len + 1 tokens in an order (a RowOrder) chosen by --packing: windows at any
offset (WindowRows), or rows that start at a document, packed best-fit (BosRows).
"""

import bisect
import collections
import glob
import hashlib
import os
import queue
import shlex
import threading
from typing import NamedTuple

import numpy as np
import torch

from cli import DataError
from prepare import unfinished_preparation
from shards import DATA_RECORD, TOKEN_DTYPES, ShardWatch, data_record, read_shard
from tokenizer import Tokenizer, fits_vocab, padded_vocab, recorded_tokenizer

# ----------------------------------------------------------------------------------------------------------
# Which tokenizer made the shards

# model.ModelConfig's default vocab_size, GPT-2's: what a run has when --vocab-size is not given.
DEFAULT_VOCAB = 50257


# What identifies the tokenizer of a data.json record (Tokenizer.record() writes these): a checkpoint keeps them.
TOKENIZER_ID_FIELDS = ("tokenizer", "tokenizer_sha256", "n_vocab", "eot", "doc_separator")


def tokenizer_id(record: dict | None) -> dict | None:
    """The TOKENIZER_ID_FIELDS of a data.json record or of Tokenizer.record(); None for no record."""
    return None if record is None else {key: record.get(key) for key in TOKENIZER_ID_FIELDS}


def same_tokenizer(a: dict, b: dict) -> bool:
    """Whether two tokenizer_ids name one tokenizer: the same ids and separator, and the same sha256 of the
    tokenizer's definition (by name where a record predates the sha256: a path may differ for one file)."""
    keys = ("n_vocab", "eot") + (("tokenizer_sha256",) if a["tokenizer_sha256"] and b["tokenizer_sha256"] else
                                 ("tokenizer",))
    return all(a[key] == b[key] for key in keys)


def data_tokenizer(data_dir: str) -> Tokenizer | None:
    """The tokenizer that made the shards in data_dir, as data.json records it (tokenizer.recorded_tokenizer);
    None when there is no record, as for shards made by llm.c. DataError when it cannot be loaded."""
    record = data_record(data_dir)
    return None if record is None else recorded_tokenizer(record, data_dir)


def vocab_from_data(model_vocab: int, data_dir: str) -> int:
    """The model's vocabulary (unpadded, as ModelConfig.vocab_size) for the shards in data_dir: the n_vocab that
    their data.json records when model_vocab is DEFAULT_VOCAB, which is what a run without --vocab-size has
    (the model pads it to a multiple of VOCAB_PAD_MULTIPLE), else model_vocab, which check_vocab then checks.
    So `--vocab-size 50257` on another tokenizer's shards takes their vocabulary too."""
    record = data_record(data_dir) if model_vocab == DEFAULT_VOCAB else None
    return model_vocab if record is None else record["n_vocab"]


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
        n_vocab, padded = record["n_vocab"], padded_vocab(record["n_vocab"])
        if fits_vocab(model_vocab, n_vocab):
            return None
        return (f"the model's vocabulary ({model_vocab:,} ids) does not fit the shards in {data_dir}: they were "
                f"made with the {record['tokenizer']} tokenizer ({n_vocab:,} ids; a model may pad that to "
                f"{padded:,}); prepare the data with the model's tokenizer (prepare.py --tokenizer)")
    if limit is not None and model_vocab > padded_vocab(limit):
        return (f"the model's vocabulary ({model_vocab:,} ids) is not the one of the shards in {data_dir}: they "
                f"are 16-bit, so their tokenizer has at most {limit:,} ids (they record none: no {DATA_RECORD}); "
                f"prepare the data with the model's tokenizer (prepare.py --tokenizer)")
    return None


# ----------------------------------------------------------------------------------------------------------
# A split's shards


def split_paths(data_dir: str, split: str) -> list[str]:
    """The shard files of a split, in order; DataError when there are none, or when data_dir is a preparation
    that has not finished (prepare.unfinished_preparation)."""
    if not os.path.isdir(data_dir):
        raise DataError(f"data directory {data_dir} does not exist")
    if why := unfinished_preparation(data_dir):  # its shards would load: a run would train on part of the data
        raise DataError(f"--data {data_dir} is an unfinished preparation ({why}); wait for prepare.py to finish, "
                        f"or rerun it, and train on its --out")
    paths = sorted(glob.glob(os.path.join(glob.escape(data_dir), f"{split}_*.bin")))
    if not paths:
        text = split == "train" and any(entry.is_file() for entry in os.scandir(data_dir))  # stops at the first
        advice = (f": to train on the files in it, python prepare.py --input {shlex.quote(data_dir)} --out "
                  f"{shlex.quote(data_dir.rstrip(os.sep) + '_prepared')}, then --data that --out") if text else ""
        raise DataError(f"no {split} shards ({split}_*.bin) in {data_dir}{advice}")
    recorded = sorted(name for name in (data_record(data_dir) or {}).get("sha256", {}) if name.startswith(f"{split}_"))
    if missing := sorted(set(recorded) - {os.path.basename(path) for path in paths}):
        raise DataError(f"{os.path.join(data_dir, missing[0])}: missing ({len(missing)} of the {len(recorded)} "
                        f"{split} shards that {DATA_RECORD} records are not there); restore them, or prepare the "
                        "data again")
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


def data_kind(ids: list) -> str:
    """What a shards' fingerprint (fingerprint, or a mixture's NAME/file one) was taken of, in words."""
    return "a mixture of sources" if any("/" in name for name, *_ in ids) else "one directory"


def data_change(saved: list | None, current: list) -> str | None:
    """How the shards a checkpoint trained on differ from these, in a few words; None when they do not (or
    the checkpoint records none)."""
    if saved is None:
        return None
    before, now = ({name: rest for name, *rest in shards} for shards in (saved, current))  # by name, not order
    if names := set(before) ^ set(now):
        return f"shards added or removed ({', '.join(sorted(names)[:3])})"
    changed = sorted(name for name in before if before[name] != now[name])
    return f"shard contents differ ({', '.join(changed[:3])})" if changed else None


def check_split(data_dir: str, split: str, seq_len: int) -> list[np.ndarray]:
    """The split's shards (memory maps: cheap), checked to hold a sequence in one shard at least (a shorter
    shard, such as the last of a preparation, gives no row: the loaders pass over it); a run calls this before
    it builds a model, so that a sequence too long for the data is refused before anything that size is
    allocated."""
    paths = split_paths(data_dir, split)
    shards = [read_shard(path) for path in paths]
    longest = max(range(len(shards)), key=lambda i: len(shards[i]))
    if len(shards[longest]) < seq_len + 1:
        which = "the longest of its shards" if len(shards) > 1 else "its only shard"
        raise DataError(f"{paths[longest]}: {which} has {len(shards[longest]):,} tokens, fewer than seq_len + 1 = "
                        f"{seq_len + 1:,}: no sequence fits; lower --seq-len or prepare more data")
    return shards


def epoch_tokens(lengths, seq_len: int, packing: str) -> int:
    """The tokens (seq_len a row, as a step counts them) that one epoch over shards of these lengths trains on,
    from the counts alone. --packing windows: exactly every window's, (n - 1) // seq_len a shard (neighbours
    share their edge token). --packing bos: at most n // (seq_len + 1) rows a shard, which share none; fewer by
    the rows the cropped tokens would have filled, which only packing the shard tells (BosRows, every epoch)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = (lengths - 1) // seq_len if packing == "windows" else lengths // (seq_len + 1)
    return int(rows.sum()) * seq_len



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


# ----------------------------------------------------------------------------------------------------------
# Row orders: which row of seq_len + 1 tokens comes next


class Position(NamedTuple):
    """Where a stream of rows stands: its epoch, the place k in that epoch's shard order, and the row within
    that shard's rows."""

    epoch: int
    k: int
    row: int


class RowOrder:
    """The order of a split's rows. Each epoch visits the shards in a seeded permutation, new every epoch
    (shuffle=False: file order, for validation), and each shard's rows in the order a subclass decides; the
    stream is epoch 0, then epoch 1, ..., forever. A subclass gives rows(epoch, k): how many rows the k-th
    shard of the epoch's order gives; read(pos, out): the row at pos copied into out, -> its shard;
    state(pos) and position(state): a position as a checkpoint holds it, and back; and, if some shard can give
    no row, no_rows(): the error for when none gives one."""

    packing = ""  # the --packing value that selects this order

    def __init__(self, shards: list[np.ndarray], seq_len: int, seed: int, shuffle: bool):
        self.shards, self.seq_len, self.seed, self.shuffle = shards, seq_len, seed, shuffle
        self.windows = np.array([(len(s) - 1) // seq_len for s in shards])
        self.num_windows = int(self.windows.sum())
        self.lengths = np.array([len(s) for s in shards], dtype=np.int64)
        self.unread = np.full(len(shards), -1)  # tokens per shard that no row holds; negative: not known yet
        self._orders = {}
        self.watch = None  # a ShardWatch, asked before each read of a shard's tokens

    def tokens(self, shard: int) -> np.ndarray:
        """The shard's tokens, to read now (self.shards[shard] for their count alone)."""
        if self.watch is not None:
            self.watch.check(shard)
        return self.shards[shard]

    def shard_order(self, epoch: int) -> np.ndarray:
        orders = self._orders  # read once: state() may run in the caller's thread while a prefetch thread steps
        if epoch not in orders:
            n = len(self.shards)
            order = np.random.default_rng([self.seed, epoch, 0]).permutation(n) if self.shuffle else np.arange(n)
            orders = self._orders = {epoch: order}
        return orders[epoch]

    def advance(self, pos: Position, n: int) -> Position:
        """The position n rows after pos, at a row that exists (so n=0 skips shards that give no row)."""
        epoch, k, row = pos
        empty = 0  # shards in a row without a row: all of them means no shard gives one
        while True:
            rows = self.rows(epoch, k)
            if row + n < rows:
                return Position(epoch, k, row + n)
            n, row, k = n - (rows - row), 0, k + 1
            empty = empty + 1 if rows == 0 else 0
            if empty >= len(self.shards):
                raise self.no_rows()
            if k == len(self.shards):
                epoch, k = epoch + 1, 0

    @property
    def cropped_fraction(self) -> float | None:
        packed = self.unread >= 0
        return float(self.unread[packed].sum() / self.lengths[packed].sum()) if packed.any() else None

    def identity(self) -> dict:
        """What a saved position only means together with: the data, the order and the packing."""
        return {"seed": self.seed, "seq_len": self.seq_len, "shuffle": self.shuffle,
                "num_windows": self.num_windows, "packing": self.packing}


class WindowRows(RowOrder):
    """Windows: a shard of n tokens gives (n - 1) // T windows; window w is tokens [w*T, w*T + T + 1), so every
    token after the first is a target exactly once per epoch. A shard's windows come in a seeded permutation,
    new every epoch. A checkpoint holds the position as one count of windows, over the epochs."""

    packing = "windows"

    def __init__(self, shards, seq_len, seed, shuffle):
        super().__init__(shards, seq_len, seed, shuffle)
        self.unread = self.lengths - (self.windows * seq_len + 1)
        self._perms = {}

    def rows(self, epoch, k):
        return int(self.windows[self.shard_order(epoch)[k]])

    def _window_perm(self, epoch: int, shard: int):
        key = (epoch, shard)
        if key not in self._perms:
            n = int(self.windows[shard])
            perm = np.random.default_rng([self.seed, epoch, 1, shard]).permutation(n) if self.shuffle else None
            self._perms = {key: perm}
        return self._perms[key]

    def read(self, pos, out):
        shard, T = int(self.shard_order(pos.epoch)[pos.k]), self.seq_len
        perm = self._window_perm(pos.epoch, shard)
        w = int(perm[pos.row]) if perm is not None else pos.row
        out[:] = self.tokens(shard)[w * T: w * T + T + 1]
        return shard

    def state(self, pos):
        before = self.windows[self.shard_order(pos.epoch)[:pos.k]].sum()  # windows of the epoch's earlier shards
        return {"next_window": pos.epoch * self.num_windows + int(before) + pos.row}

    def position(self, state):
        epoch, i = divmod(int(state["next_window"]), self.num_windows)
        order = self.shard_order(epoch)
        ends = np.cumsum(self.windows[order])
        k = int(np.searchsorted(ends, i, side="right"))
        return Position(epoch, k, i - int(ends[k] - self.windows[order[k]]))


class BosRows(RowOrder):
    """Every row starts at a document (a bos_token). The documents of a shard, in a seeded permutation new
    every epoch, are packed into rows of T + 1 tokens by pack_best_fit, and the rows are visited in a seeded
    permutation too. Tokens that no row holds (document tails cropped, tokens before a shard's first
    document, the shard's unfilled last row) are counted in `cropped_fraction`, over the shards packed so far
    (their latest epoch). Documents are found once per shard (find_documents) and kept in memory. A shard's
    row count depends on its epoch's permutation, so a checkpoint holds the position as (epoch, k, row):
    reaching it packs no earlier shard. data_dir and split name the shards in errors."""

    packing = "bos"

    def __init__(self, shards, seq_len, seed, shuffle, bos_token: int, pack_buffer: int, data_dir: str, split: str):
        super().__init__(shards, seq_len, seed, shuffle)
        self.bos_token, self.pack_buffer, self.data_dir, self.split = bos_token, pack_buffer, data_dir, split
        self._documents, self._packs = {}, collections.OrderedDict()  # per shard; per (epoch, shard)

    def _pack(self, epoch: int, k: int):
        """(shard, row order, row_ptr, segment starts, segment lengths) of the k-th shard of an epoch's order,
        packed on first use; the last few are kept, as one step may span several shards."""
        shard = int(self.shard_order(epoch)[k])
        key = (epoch, shard)
        if key in self._packs:
            self._packs.move_to_end(key)
            return self._packs[key]
        if shard not in self._documents:  # found once per shard and kept, as int32 (a shard has < 2**31 tokens)
            self._documents[shard] = find_documents(self.tokens(shard), self.bos_token).astype(np.int32)
        starts, T = self._documents[shard], self.seq_len
        lengths = np.diff(starts, append=len(self.shards[shard]))
        docs = np.random.default_rng([self.seed, epoch, 1, shard]).permutation(len(starts)) if self.shuffle \
            else np.arange(len(starts))
        packing = pack_best_fit(lengths[docs], T + 1, self.pack_buffer)
        rows = len(packing.row_ptr) - 1
        order = np.random.default_rng([self.seed, epoch, 2, shard]).permutation(rows) if self.shuffle \
            else np.arange(rows)  # the packer's last rows hold the crops of long documents: spread them
        self.unread[shard] = len(self.shards[shard]) - rows * (T + 1)
        self._packs[key] = (shard, order, packing.row_ptr, starts[docs][packing.doc], packing.take.astype(np.int32))
        if len(self._packs) > 3:
            self._packs.popitem(last=False)
        return self._packs[key]

    def rows(self, epoch, k):
        return len(self._pack(epoch, k)[1])

    def read(self, pos, out):
        shard, order, row_ptr, starts, takes = self._pack(pos.epoch, pos.k)
        r, filled = int(order[pos.row]), 0
        for start, take in zip(starts[row_ptr[r]:row_ptr[r + 1]], takes[row_ptr[r]:row_ptr[r + 1]]):
            out[filled:filled + take] = self.tokens(shard)[start:start + take]
            filled += take
        return shard

    def no_rows(self):
        return DataError(f"{self.data_dir}: no {self.split} shard holds {self.seq_len + 1:,} tokens of documents that "
                         f"start with the token {self.bos_token} (end-of-text): --packing bos cannot make a row; "
                         "use --packing windows")

    def identity(self):
        return {**super().identity(), "bos_token": self.bos_token, "pack_buffer": self.pack_buffer}

    def state(self, pos):
        return {"next_row": list(pos)}

    def position(self, state):
        return Position(*(int(v) for v in state["next_row"]))


class BatchStream:
    """What the loaders share: batches of [batch_size, seq_len] int64 (x, y) tensors, y being x shifted left by
    one token, made ahead by a prefetch thread and handed over on the device. A subclass gives _step(pos) ->
    (this rank's batch, the position after the step on every rank, what the batch says of the data for its
    step's record) and sets _next, the start position."""

    def __init__(self, batch_size: int, seq_len: int, rank: int, world_size: int, device, prefetch: int):
        if batch_size < 1 or seq_len < 1 or prefetch < 0:
            raise ValueError(f"batch_size and seq_len must be >= 1 and prefetch >= 0, "
                             f"got {batch_size}, {seq_len}, {prefetch}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank {rank}, world_size {world_size}")
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.prefetch, self.device = prefetch, torch.device(device)
        self._thread = None
        self.fields = {}  # record_fields of the last batch taken

    def _tensors(self, buf: np.ndarray):
        """(x, y) of rows of T + 1 tokens: y is x shifted left by one."""
        t = torch.from_numpy(buf)
        x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
        if self.device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        return x, y

    @property
    def step_windows(self) -> int:
        """Rows one step takes, all ranks together."""
        return self.batch_size * self.world_size

    def _work(self, pos, q: queue.Queue, stop: threading.Event):
        def put(item):  # gives up when stopped, so close() never waits on a full queue
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return
                except queue.Full:
                    pass

        try:
            while not stop.is_set():
                batch, pos, fields = self._step(pos)
                put((batch, pos, fields))
        except Exception as e:  # handed to the consumer, which re-raises it
            put(e)

    def __iter__(self):
        return self

    def __next__(self):
        if self.prefetch == 0:
            (x, y), after, fields = self._step(self._next)
        else:
            if self._thread is None:
                self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
                (thread := threading.Thread(target=self._work, args=(self._next, self._queue, self._stop),
                                            daemon=True, name=f"{type(self).__name__}-rank{self.rank}")).start()
                self._thread = thread  # only once started: close() joins it, and a stop may come in between
            item = self._queue.get()
            if isinstance(item, Exception):
                self.close()
                raise item
            (x, y), after, fields = item
        self._next, self.fields = after, fields
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def record_fields(self) -> dict:
        """What the last batch taken says of the data, for its step's record (metrics.jsonl): made with the
        batch, so that a prefetch thread running ahead does not change it."""
        return self.fields

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


def check_state(order: RowOrder, state: dict, where: str = "", other_data: bool = False) -> bool:
    """DataError when a saved position does not belong to this order: other packing, data or seed. where:
    the source it is of, in a mixture ("" for one directory). other_data (--allow-data-change): a position of
    other shards alone (every setting the same but the windows the shards hold) is not an error -> True, the
    rows to start at their beginning, as no position on the old shards means anything on these."""
    state = {"packing": "windows", **state}  # states saved before --packing existed are windows
    of = f" of source {where}" if where else ""
    if state["packing"] != order.packing:
        raise DataError(f"the loader state{of} was saved with --packing {state['packing']}, this run has "
                        f"--packing {order.packing}; resume with the same --packing")
    identity = order.identity()
    for key in sorted(identity, key=lambda k: k == "num_windows"):  # the shards' own windows last
        if state.get(key) != identity[key]:
            if key == "num_windows" and other_data:
                return True
            raise DataError(f"loader state{of} does not fit this data: saved {key}={state.get(key)}, "
                            f"this loader has {key}={identity[key]}")
    return False


class ShardLoader(BatchStream):
    """Yields (x, y) int64 batches of shape [batch_size, seq_len] from data_dir/{split}_*.bin; y is x shifted
    left by one token. Iterates forever, epoch after epoch, in the row order that `packing` selects
    (WindowRows, BosRows).

    The position is global: it counts the rows consumed by all ranks together. Each step consumes
    batch_size * world_size of them and rank r takes rows [g + r*B, g + (r+1)*B) after position g. So ranks
    are disjoint, each epoch's rows are used exactly once across ranks, and the state is the same on every
    rank and can be loaded at another world size or batch size to continue the same stream.
    """

    def __init__(self, data_dir, split: str = "train", *, batch_size: int, seq_len: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True, device="cpu", prefetch: int = 2,
                 vocab_size: int | None = None, packing: str = "windows", bos_token: int | None = None,
                 pack_buffer: int = PACK_BUFFER_DOCS):
        if packing not in PACKING_MODES:
            raise ValueError(f"packing must be one of {PACKING_MODES}, got {packing!r}")
        super().__init__(batch_size, seq_len, rank, world_size, device, prefetch)
        data_dir = os.fspath(data_dir)
        self.paths = split_paths(data_dir, split)
        self.shards = check_split(data_dir, split, seq_len)
        self.vocab_size = vocab_size
        if packing == "bos":
            if bos_token is None:  # the separator prepare.py put before each document, GPT-2's without a record
                bos_token = (data_record(data_dir) or {}).get("eot", GPT2_EOT)
            self.order = BosRows(self.shards, seq_len, seed, shuffle, bos_token, pack_buffer, data_dir, split)
        else:
            self.order = WindowRows(self.shards, seq_len, seed, shuffle)
        self.order.watch = ShardWatch(self.paths, (data_record(data_dir) or {}).get("sha256"))
        self.num_windows = self.order.num_windows
        self._next = Position(0, 0, 0)  # after what the caller consumed (not merely prefetched)

    @property
    def packing(self) -> str:
        return self.order.packing

    def read_row(self, pos: Position, out: np.ndarray) -> Position:
        """The row at pos (a position advance() gave) copied into out, its ids checked -> the next position."""
        shard = self.order.read(pos, out)
        # Checked per row (cheap) rather than per shard at start-up (a full read of the data set).
        if self.vocab_size is not None and out.max() >= self.vocab_size:
            raise DataError(f"{self.paths[shard]}: token id {int(out.max())} is not below the vocabulary "
                            f"size {self.vocab_size}; the shards were made with another tokenizer")
        return self.order.advance(pos, 1)

    def _step(self, pos: Position):
        """This rank's batch of the step at pos, and the position after the step (on every rank)."""
        buf = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64)
        mine = self.order.advance(pos, self.rank * self.batch_size)
        for b in range(self.batch_size):
            mine = self.read_row(mine, buf[b])
        fields = {"data_cropped_frac": self.cropped_fraction} if self.packing == "bos" else {}
        return self._tensors(buf), self.order.advance(pos, self.step_windows), fields

    @property
    def cropped_fraction(self) -> float | None:
        """The fraction of the shards' tokens that no row holds: read (bos: documents' tails cropped to fit a
        row, and what comes before a shard's first document) or left out (the end of a shard) but never
        trained on. Windows: over all shards, a few tokens per shard. bos: over the shards packed so far (their
        latest epoch); None before the first."""
        return self.order.cropped_fraction

    @property
    def tokens_per_epoch(self) -> int:
        """epoch_tokens of this split: what one epoch trains on, exactly for windows, at most for bos."""
        return epoch_tokens(self.order.lengths, self.seq_len, self.packing)

    def epoch_plan(self, tokens: int) -> list[tuple[int, int, str]]:
        """(its tokens, tokens_per_epoch, source) of a run that reads `tokens`: one unnamed source here."""
        return [(tokens, self.tokens_per_epoch, "")]

    def fingerprint(self) -> list[list]:
        """data.fingerprint of the shards, which a checkpoint saves to refuse a resume on other data."""
        return fingerprint(self.paths)

    @property
    def epoch(self) -> int:
        return self._next.epoch

    # -- checkpointing --

    def state_dict(self) -> dict:
        """The position after the batches the caller has taken (prefetched ones excluded); same on all ranks."""
        return {**self.order.state(self._next), **self.order.identity()}

    def load_state_dict(self, state: dict, other_data: bool = False) -> list[str]:
        """The saved position; other_data as check_state's -> [""] where the rows start at their beginning
        instead (the sources that do, as a MixtureLoader names them), else []."""
        if "mixture" in state:
            raise DataError(f"the loader state is of a mixture of sources ({', '.join(state['mixture'])}); this "
                            "run reads one directory: resume with the same --data")
        restart = check_state(self.order, state, other_data=other_data)
        self.close()
        self._next = Position(0, 0, 0) if restart else self.order.position(state)
        return [""] if restart else []
