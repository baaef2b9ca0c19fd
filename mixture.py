"""--data as one directory of shards or a weighted mixture of named ones, and the loader that draws a mixture.

    --data data/web                                   one directory (data.ShardLoader)
    --data web=data/web:0.7,code=data/code:0.3        a mixture (MixtureLoader); weights are normalised

Every row of every batch comes from one source, drawn at random with probability its weight, so a micro-batch
holds the sources in proportion (in expectation) and each step's gradient is the mixture's, not one source's.
The draw of global row i (the rows of all ranks counted together, as ShardLoader counts them) depends on the
seed and i alone (row_sources). So the stream is the same at any world size and micro-batch, ranks take
disjoint rows, and a resume is exact. Each source reads its own rows in the order a run on it alone would (its
own shards' permutation, its own --packing rows, epoch after epoch) and runs out on its own: its next epoch
starts without moving the other sources.

All sources must share one tokenizer (check_sources, from their data.json). The val loss is measured on each
source's val split and reported per source (val_loss/NAME) and as the mixture's weighted mean (val_loss).
"""

import functools
import math
import os
import re
import shlex
from typing import NamedTuple

import numpy as np

from cli import DataError, UsageError
from data import (GPT2_EOT, PACK_BUFFER_DOCS, BatchStream, Position, ShardLoader, check_split, check_state, check_vocab,
                  data_record, fingerprint, split_paths, vocab_from_data)
from tokenizer import recorded_tokenizer_spec

SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # it becomes a metric name: val_loss/NAME, epoch/NAME
MIX_BLOCK = 4096  # rows drawn from one seeded generator: a step reads a block or two, never the rows before it
MIX_STREAM = 0x6D6978  # in the generators' seeds, so that no other seeded draw of the loader shares them


class Source(NamedTuple):
    name: str  # "" for a plain --data DIR
    dir: str
    weight: float  # normalised: the sources' weights sum to 1


def parse_data(spec: str) -> list[Source]:
    """--data's value -> its sources, sorted by name (so that the draw and the data's fingerprint do not depend
    on the order they are listed in). Comma-separated NAME=DIR:WEIGHT items (DIR may hold ":" but not ",") when
    the value starts with a NAME and "=", else one unnamed source of weight 1: a directory (an existing one
    whatever its name holds). UsageError, one line, for an item that does not parse, a weight that is not a
    positive number or is too small against the others to count, or a name given twice."""
    if not SOURCE_NAME.fullmatch(spec.partition("=")[0]) or "=" not in spec or os.path.isdir(spec):
        return [Source("", spec, 1.0)]
    parsed = []
    for name, path, weight in _items(spec):
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"--data: the weight of source {name} must be a positive number, got {weight!r}")
        parsed.append((name, path, value))
    names = [name for name, _, _ in parsed]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise UsageError(f"--data: source {twice[0]} is named twice; give each source its own name")
    largest = max(value for _, _, value in parsed)  # first, so that the sum cannot overflow
    scaled = [(name, path, value / largest) for name, path, value in parsed]
    total = sum(value for _, _, value in scaled)
    sources = sorted(Source(name, path, value / total) for name, path, value in scaled)
    edges = np.cumsum([0.0] + [s.weight for s in sources])  # as the draw (_block_sources) adds them up
    if tiny := [s.name for s, low, high in zip(sources, edges, edges[1:]) if not high > low]:
        raise UsageError(f"--data: the weight of source {tiny[0]} is too small against the others to draw a row")
    return sources


def _items(spec: str) -> list[tuple[str, str, str]]:
    """A mixture's NAME=DIR:WEIGHT items as (name, directory, weight as written); UsageError for one that is not."""
    items = []
    for item in spec.split(","):
        name, _, rest = item.partition("=")
        path, colon, weight = rest.rpartition(":")
        if not SOURCE_NAME.fullmatch(name) or not colon or not path:
            raise UsageError(f"--data: {item!r} is not NAME=DIR:WEIGHT (NAME of letters, digits, '_', '-', '.'; "
                             "e.g. --data web=data/web:0.7,code=data/code:0.3)")
        items.append((name, path, weight))
    return items


def absolute_data(spec: str | None) -> str | None:
    """--data with each source's directory made absolute, its names and weights as given: what a run records
    (config.toml, its checkpoints), so that sample.py, score.py, hf.py and a resume find the shards from any
    working directory. UsageError as parse_data's."""
    if not spec:
        return spec
    if not is_mixture(parse_data(spec)):
        return os.path.abspath(spec)
    return ",".join(f"{name}={os.path.abspath(path)}:{weight}" for name, path, weight in _items(spec))


def is_mixture(sources: list[Source]) -> bool:
    return bool(sources[0].name)


def label(source: Source) -> str:
    """How errors name a source: "source code (data/code)", or the directory alone."""
    return f"source {source.name} ({source.dir})" if source.name else source.dir


def same_tokenizer(a: dict, b: dict) -> bool:
    """Whether two data.json records name one tokenizer and separator: the sha256 when both record one (records
    made before it existed name the tokenizer only), the vocabulary, and the separator (--packing bos starts
    rows at it; GPT-2's end-of-text when a record names none, as the loader takes it)."""
    tokenizer = (a["tokenizer_sha256"] == b["tokenizer_sha256"] if "tokenizer_sha256" in a and "tokenizer_sha256" in b
                 else a["tokenizer"] == b["tokenizer"])
    return tokenizer and a["n_vocab"] == b["n_vocab"] and a.get("eot", GPT2_EOT) == b.get("eot", GPT2_EOT)


def check_sources(sources: list[Source]) -> None:
    """DataError, one line, for a source directory that is not there, one directory under two names (both
    would read the same rows in the same order), or sources whose data.json records different tokenizers (or
    separators). Shards without data.json (llm.c's) record nothing to compare: their ids are checked against
    the model's vocabulary as any source's are (data.check_vocab)."""
    seen = {}
    for source in sources:
        if os.path.isfile(source.dir):
            raise DataError(f"--data: {label(source)} is a file, not a directory of prepared shards: "
                            f"{_prepare_advice(source, sources)}")
        if not os.path.isdir(source.dir):
            raise DataError(f"--data: {label(source)}: no such directory")
        if (other := seen.setdefault(os.path.realpath(source.dir), source)) is not source:
            raise DataError(f"--data: {label(other)} and {label(source)} are one directory: they would read the same "
                            "rows in the same order; give it once, with the sum of their weights")
    recorded = [(source, record) for source in sources if (record := data_record(source.dir)) is not None]
    for source, record in recorded[1:]:
        first, first_record = recorded[0]
        if not same_tokenizer(record, first_record):
            raise DataError(
                f"--data: {label(first)} and {label(source)} were prepared with different tokenizers "
                f"({first_record['tokenizer']}, separator {first_record.get('eot')}; {record['tokenizer']}, "
                f"separator {record.get('eot')}): a mixture needs one; prepare them with the same --tokenizer")


def named_fingerprint(named_paths: list[tuple[str, list[str]]]) -> list[list]:
    """data.fingerprint of each source's shards (name, paths), each shard named NAME/file."""
    return [[f"{name}/{shard}", *rest] for name, paths in named_paths for shard, *rest in fingerprint(paths)]


def data_fingerprint(spec: str) -> list[list]:
    """The fingerprint of the train shards that --data spec names, as its loader's fingerprint() gives it (what a
    checkpoint records), without opening a loader: tells a copy of the data from other data by content."""
    sources = parse_data(spec)
    if not is_mixture(sources):
        return fingerprint(split_paths(sources[0].dir, "train"))
    return named_fingerprint([(s.name, split_paths(s.dir, "train")) for s in sources])


def _prepare_advice(text: Source, sources: list[Source]) -> str:
    """The commands that prepare the text file a source names and then read it: prepare.py with the tokenizer of
    the other sources (a mixture needs one; a trained one by the tokenizer.json beside their shards), then the
    same --data with the prepared directory in its place (weights as a ratio to the largest, which parse_data
    takes alike)."""
    out = os.path.join("data", os.path.splitext(os.path.basename(text.dir))[0] or "mine")
    tokenizer = ""
    for source in sources:
        try:
            record = data_record(source.dir) if os.path.isdir(source.dir) else None
        except DataError:  # told of once the file is prepared: this advice need not say it
            record = None
        if record is not None:
            file = recorded_tokenizer_spec(record, source.dir)
            tokenizer = "" if file == "gpt2" else f" --tokenizer {shlex.quote(file)}"
            break
    data = out
    if text.name:
        largest = max(source.weight for source in sources)
        data = ",".join(f"{s.name}={out if s is text else s.dir}:{s.weight / largest:g}" for s in sources)
    return (f"run python prepare.py --input {shlex.quote(text.dir)} --out {shlex.quote(out)}{tokenizer}, then --data "
            f"{shlex.quote(data)}")


def record_dir(sources: list[Source]) -> str:
    """The directory whose data.json speaks for the sources' shared tokenizer (the model's vocabulary, the eval's
    tokenizer): the first source that has one, else the first source."""
    return next((s.dir for s in sources if data_record(s.dir) is not None), sources[0].dir)


def data_vocab(spec: str | None, model_vocab: int) -> int:
    """The model's vocabulary for --data spec (data.vocab_from_data on the source whose data.json speaks for
    them), settled with the flags: the size dial counts it, --estimate-memory sizes it, config.toml records it.
    model_vocab as it is for the default corpus, and for a --data or record that cannot be read, which the
    start-up's checks then report in one line."""
    if spec is None:
        return model_vocab
    try:
        return vocab_from_data(model_vocab, record_dir(parse_data(spec)))
    except (UsageError, DataError):
        return model_vocab


def describe(sources: list[Source]) -> str:
    """The start-up table's data: the directory, or each source with its share."""
    if not is_mixture(sources):
        return sources[0].dir
    return "mixture " + ", ".join(f"{s.name}={s.dir} ({100 * s.weight:.1f}%)" for s in sources)


# ----------------------------------------------------------------------------- which source each row comes from


@functools.lru_cache(maxsize=4)
def _block_sources(weights: tuple, seed: int, block: int) -> np.ndarray:
    edges = np.cumsum(weights)
    draws = np.random.default_rng([seed, MIX_STREAM, block]).random(MIX_BLOCK) * edges[-1]
    return np.minimum(np.searchsorted(edges, draws, side="right"), len(weights) - 1).astype(np.int64)


def row_sources(weights, seed: int, start: int, count: int) -> np.ndarray:
    """The source index of each global row in [start, start + count): row i's is drawn with probabilities
    `weights` by block i // MIX_BLOCK's generator, seeded by (seed, block), so it depends on nothing else."""
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    first, last = start // MIX_BLOCK, (start + count - 1) // MIX_BLOCK
    drawn = np.concatenate([_block_sources(tuple(weights), seed, b) for b in range(first, last + 1)])
    offset = start - first * MIX_BLOCK
    return drawn[offset:offset + count]


# ----------------------------------------------------------------------------- the loader


class MixPosition(NamedTuple):
    """Where a mixture's stream stands: the global rows drawn so far, how many each source gave, and each
    source's own position."""

    rows: int
    read: tuple
    at: tuple


class MixtureLoader(BatchStream):
    """ShardLoader's batches, each row drawn from one of the sources (row_sources). Each source is a
    ShardLoader that this one reads rows from; its position moves only by the rows it gives."""

    def __init__(self, sources: list[Source], split: str = "train", *, batch_size: int, seq_len: int,
                 rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True, device="cpu",
                 prefetch: int = 2, vocab_size: int | None = None, packing: str = "windows",
                 pack_buffer: int = PACK_BUFFER_DOCS):
        super().__init__(batch_size, seq_len, rank, world_size, device, prefetch)
        self.sources, self.seed = sources, seed
        self.weights = tuple(s.weight for s in sources)
        self.parts = [ShardLoader(s.dir, split, batch_size=1, seq_len=seq_len, seed=seed, shuffle=shuffle,
                                  prefetch=0, vocab_size=vocab_size, packing=packing, pack_buffer=pack_buffer)
                      for s in sources]
        self.packing = packing
        n = len(sources)
        self._next = MixPosition(0, (0,) * n, (Position(0, 0, 0),) * n)

    def _step(self, pos: MixPosition):
        n, B = len(self.parts), self.batch_size
        drawn = row_sources(self.weights, self.seed, pos.rows, self.step_windows)
        before = np.bincount(drawn[:self.rank * B], minlength=n)  # the rows of lower ranks, per source
        at = [part.order.advance(p, int(c)) for part, p, c in zip(self.parts, pos.at, before)]
        buf = np.empty((B, self.seq_len + 1), dtype=np.int64)
        for b, s in enumerate(drawn[self.rank * B:(self.rank + 1) * B]):
            at[s] = self.parts[s].read_row(at[s], buf[b])
        counts = np.bincount(drawn, minlength=n)
        after = MixPosition(pos.rows + len(drawn), tuple(r + int(c) for r, c in zip(pos.read, counts)),
                            tuple(part.order.advance(p, int(c)) for part, p, c in zip(self.parts, pos.at, counts)))
        fields = {f"epoch/{name}": epochs for name, epochs in self._epochs(after.read).items()}
        if self.packing == "bos":  # each source's, over its shards packed so far
            fields.update({f"data_cropped_frac/{s.name}": part.cropped_fraction
                           for s, part in zip(self.sources, self.parts)})
        return self._tensors(buf), after, fields

    tokens_per_epoch = None  # no single epoch: each source has its own (epoch_plan; record_fields' epoch/NAME)

    def epoch_plan(self, tokens: int) -> list[tuple[int, int, str]]:
        """(the tokens each source is expected to give, its tokens_per_epoch, its name) of a run of `tokens`."""
        return [(round(tokens * s.weight), part.tokens_per_epoch, s.name)
                for s, part in zip(self.sources, self.parts)]

    def _epochs(self, read: tuple) -> dict[str, float]:
        """The epochs of each source's split read: the rows it gave, against one epoch's."""
        return {s.name: rows * self.seq_len / part.tokens_per_epoch
                for s, part, rows in zip(self.sources, self.parts, read)}

    def fingerprint(self) -> list[list]:
        """data.fingerprint of every source's shards, each named NAME/file."""
        return named_fingerprint([(s.name, part.paths) for s, part in zip(self.sources, self.parts)])

    def state_dict(self) -> dict:
        pos = self._next
        return {"rows": pos.rows, "mixture": {
            s.name: {**part.order.state(at), **part.order.identity(), "rows_read": read, "weight": s.weight}
            for s, part, read, at in zip(self.sources, self.parts, pos.read, pos.at)}}

    def load_state_dict(self, state: dict, other_data: bool = False) -> list[str]:
        """A mixture's position; the weights may differ from the saved ones (the draw goes on with the new ones
        from the saved row), and so may the sources, which a resume allows only with --allow-data-change
        (checkpoint.check_resumable, which passes other_data): a source added starts at its beginning, one
        removed is no longer read, and one whose shards are others (data.check_state) starts at its beginning
        too -> the names of the sources that were saved and start over."""
        names = [s.name for s in self.sources]
        if "mixture" not in state:
            raise DataError(f"the loader state is of one --data directory; this run reads a mixture of "
                            f"{', '.join(names)}: resume with the same --data")
        saved = state["mixture"]
        restart = [n for n, part in zip(names, self.parts) if n in saved and check_state(part.order, saved[n], n,
                                                                                          other_data)]
        carried = [n in saved and n not in restart for n in names]
        self.close()
        self._next = MixPosition(
            int(state["rows"]), tuple(int(saved[n]["rows_read"]) if kept else 0 for n, kept in zip(names, carried)),
            tuple(part.order.position(saved[n]) if kept else Position(0, 0, 0)
                  for n, part, kept in zip(names, self.parts, carried)))
        return restart


def open_loader(sources: list[Source], **kwargs) -> ShardLoader | MixtureLoader:
    """The train loader of --data: a ShardLoader for one directory, a MixtureLoader for a mixture."""
    if is_mixture(sources):
        return MixtureLoader(sources, **kwargs)
    return ShardLoader(sources[0].dir, **kwargs)


def vocab_problem(model_vocab: int, sources: list[Source]) -> str | None:
    """The first source whose shards the model's vocabulary does not fit (data.check_vocab), else None."""
    return next((problem for s in sources if (problem := check_vocab(model_vocab, s.dir))), None)


def open_sources(data: str, seq_len: int) -> list[Source]:
    """--data's sources (parse_data), checked (check_sources) down to every train split's shards
    (data.check_split), which is cheap: memory maps of them."""
    sources = parse_data(data)
    check_sources(sources)
    for source in sources:
        check_split(source.dir, "train", seq_len)
    return sources
