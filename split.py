"""Which documents are val: a sample drawn by a hash of each one's position, and its size.

Which documents of a corpus are val: a sample drawn by a hash of each document's position, so that the val
loss is measured on documents like the ones trained on, wherever they sit in the corpus, and not on its first
files (a corpus sorted by path or by date would put one kind of document there).

Every document gets a draw, 0 to VAL_DRAWS - 1, from a hash of its position in the stream (the count of documents
before it). The val split is the first N tokens of the documents taken draw by draw, in stream order within a
draw; every other token is train. Which documents a position draws never changes, so a preparation cut by
--max-tokens has the same val split as the whole corpus whenever its draw-0 documents hold N tokens, as a
prefix would; and a trained tokenizer can leave out every document that val may take before any is tokenized.

A preparation streams: tokens go to train shards as they come. While the corpus is small (HOLD_TOKENS) all of it
stays in memory, so that val can take any draw; past that, val takes draw 0 only (1 in VAL_DRAWS documents),
whose tokens wait in memory until the end, when the total, and so the size of --val-tokens auto, is known.
"""

import numpy as np

from cli import DataError, plural

VAL_DRAWS = 64
# Held whole until then (at most 32 MB of uint32): the corpora whose val split needs more than draw 0.
HOLD_TOKENS = 8_000_000
# --val-tokens auto: 0.5% of the corpus, within these bounds.
VAL_PER_MILLE = 5
MAX_VAL_TOKENS = 1_000_000  # plenty for a steady val loss, and what a default eval can use; 200M tokens reach it
# The least auto val split: one micro-batch at train.py's defaults (--batch-size 16 of --seq-len 1,024) plus one
# token, as a window's targets are its tokens shifted by one. Any less and a default run's evaluation cannot
# read one whole batch without reading some windows twice.
MIN_VAL_TOKENS = 16 * 1024 + 1

_MASK64 = (1 << 64) - 1


def default_val_tokens(total: int) -> int:
    """The val split of --val-tokens auto for a corpus of `total` tokens: 0.5% of it, at least MIN_VAL_TOKENS
    (one eval batch), at most MAX_VAL_TOKENS. Pure, so the rule is tested without a large corpus."""
    return min(MAX_VAL_TOKENS, max(MIN_VAL_TOKENS, total * VAL_PER_MILLE // 1000))


def draws(positions: np.ndarray) -> np.ndarray:
    """The draw of the documents at these positions: splitmix64's finaliser of the position, mod VAL_DRAWS
    (neighbouring positions get unrelated draws). Pure integer arithmetic: the same on every machine."""
    z = positions.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as the hash intends
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((z ^ (z >> np.uint64(31))) % np.uint64(VAL_DRAWS)).astype(np.int64)


def draw_of(position: int) -> int:
    return int(draws(np.array([position]))[0])


def cut_documents(tokens: np.ndarray, eot: int, every: int, run: int) -> tuple[np.ndarray, int]:
    """tokens with a separator (eot) inserted wherever a document reaches `every` tokens, so none is longer ->
    (tokens, the last document's tokens so far). run: the tokens of the document the array starts in, from
    the arrays before it (0 at the stream's start). Pure: the tokens of the text are unchanged, and in order."""
    if not len(tokens):
        return tokens, run
    index = np.arange(len(tokens))
    separators = tokens == eot
    last = np.maximum.accumulate(np.where(separators, index, -1))
    within = np.where(last >= 0, index - last - 1, run + index)  # a token's place in its document
    cuts = np.flatnonzero(~separators & (within > 0) & (within % every == 0))
    return np.insert(tokens, cuts, np.asarray(eot, dtype=tokens.dtype)), 0 if separators[-1] else int(within[-1] % every) + 1


def document_texts(pieces):
    """(position, text) for the (text, starts_a_document) pieces, positions counted as the token stream counts
    documents: one per separator, an empty document dropped (it is never tokenized), a first piece that
    starts none belonging to the first document."""
    position = -1
    for text, starts in pieces:
        if starts and not text:
            continue
        position += bool(starts)
        yield max(position, 0), text


class ValSplit:
    """Sorts a preparation's token stream (documents each led by the separator `eot`) into train and val.
    add() takes the stream in order and returns the train tokens it frees, in order; finish() returns the val
    split and the train tokens still held. val_tokens: --val-tokens N, or None for auto."""

    def __init__(self, eot: int, val_tokens: int | None, hold: int | None = None):
        self.eot, self.val_tokens, self.hold = eot, val_tokens, HOLD_TOKENS if hold is None else hold
        self.cap = MAX_VAL_TOKENS if val_tokens is None else val_tokens  # the most val can be
        self.held, self.n_held = [], 0  # the whole stream so far, while it is small
        self.val, self.n_val = [], 0  # draw-0 tokens taken for val, once held no more
        self.documents = -1  # the position of the document the stream is in
        self.total = 0

    def _positions(self, tokens: np.ndarray) -> np.ndarray:
        """Each token's document position; the stream's position moves on past the array."""
        positions = self.documents + np.cumsum(tokens == self.eot)
        self.documents = int(positions[-1]) if len(positions) else self.documents
        return np.maximum(positions, 0)

    def add(self, tokens: np.ndarray) -> np.ndarray | None:
        self.total += len(tokens)
        if self.held is not None:
            self.held.append(tokens)
            self.n_held += len(tokens)
            if self.n_held <= self.hold:
                return None
            tokens, self.held, self.documents = np.concatenate(self.held), None, -1  # positions counted anew
        taken = np.flatnonzero(draws(self._positions(tokens)) == 0)[:max(self.cap - self.n_val, 0)]
        to_val = np.zeros(len(tokens), dtype=bool)
        to_val[taken] = True
        self.val.append(tokens[to_val])
        self.n_val += len(taken)
        return tokens[~to_val]

    def finish(self, desc: str) -> tuple[np.ndarray, np.ndarray, int]:
        """-> (val tokens, train tokens not yet handed out, val's documents). DataError where the corpus
        leaves no train token, or (past HOLD_TOKENS) its draw-0 documents hold fewer than --val-tokens."""
        target = default_val_tokens(self.total) if self.val_tokens is None else self.val_tokens
        if self.total <= target:
            why = (f"--val-tokens auto keeps at least {MIN_VAL_TOKENS:,} for val (one eval batch of 16 x 1,024, "
                   f"plus 1) and leaves none for train; give a smaller --val-tokens N" if self.val_tokens is None
                   else f"not more than --val-tokens {target:,}; lower --val-tokens")
            raise DataError(f"{desc} has only {self.total:,} tokens: {why}")
        if self.held is not None:
            return self._finish_held(target)
        val = np.concatenate(self.val)
        if len(val) < target:
            fewer = f"give --val-tokens {len(val):,} or less, or " if len(val) else ""
            raise DataError(f"{desc}: past its first {self.hold:,} tokens the val split takes 1 in {VAL_DRAWS} "
                            f"documents, chosen by a hash of their position, and those hold only {len(val):,} tokens; "
                            f"{fewer}cut the documents into more (--text-documents N: pieces of at most N tokens)")
        return val[:target], val[target:], self._count_documents(val[:target])

    def _finish_held(self, target: int) -> tuple[np.ndarray, np.ndarray, int]:
        """The whole stream is here: val takes documents draw by draw, in stream order within each."""
        tokens = np.concatenate(self.held) if self.held else np.zeros(0, dtype=np.uint16)
        self.documents = -1
        order = np.argsort(draws(self._positions(tokens)), kind="stable")[:target]
        to_val = np.zeros(len(tokens), dtype=bool)
        to_val[order] = True
        val = tokens[order]
        return val, tokens[~to_val], self._count_documents(val)

    def _count_documents(self, val: np.ndarray) -> int:
        """Documents in val: each begins with the separator (a first document of the stream may lack it)."""
        return int(np.count_nonzero(val == self.eot)) + int(len(val) > 0 and val[0] != self.eot)


def val_held_out(pieces, val_tokens: int | None, max_tokens: int | None, token_bytes: int) -> tuple[int, int]:
    """What the val split can take of pieces' documents, whatever tokenizer --train-tokenizer trains, as
    (draws, last): every document of the draws below draws - 1, and the first `last` bytes (in stream order) of
    draw draws - 1's. Val holds at most token_bytes bytes per token (the longest token); under --val-tokens auto
    it grows with the total, of which every token but a separator holds at least one byte: counted from pieces
    until that bound, or max_tokens, is reached, or until draw 0 alone holds the most bytes val can have."""
    most = MAX_VAL_TOKENS * 1000 // VAL_PER_MILLE if val_tokens is None else None
    region = min(x for x in (most, max_tokens, float("inf")) if x is not None)
    largest = (MAX_VAL_TOKENS if val_tokens is None else val_tokens) * token_bytes
    by_draw, total = np.zeros(VAL_DRAWS, dtype=np.int64), 0
    for position, text in document_texts(pieces):
        size = len(text.encode("utf-8", "surrogatepass"))
        by_draw[draw_of(position)] += size
        total += size + 1  # the separator
        if total >= region or by_draw[0] >= largest:  # draw 0 alone is enough, whatever follows
            break
    bound = (default_val_tokens(min(total, region)) if val_tokens is None else val_tokens) * token_bytes
    before = np.concatenate([[0], np.cumsum(by_draw)])  # bytes of the draws below each
    draws = min(int(np.searchsorted(before, bound)), VAL_DRAWS)  # the first draw count whose bytes reach it
    return max(draws, 1), int(bound - before[max(draws, 1) - 1])


def texts_outside(pieces, held: tuple[int, int]):
    """The text of pieces less what the val split can take (held: val_held_out's), document by document."""
    draws, left = held
    for position, text in document_texts(pieces):
        draw = draw_of(position)
        if draw < draws - 1:
            continue
        if draw == draws - 1 and left > 0:  # a character cut in two is dropped
            raw = text.encode("utf-8", "surrogatepass")
            text, left = raw[left:].decode("utf-8", "ignore"), left - len(raw)
        if text:
            yield text


def describe(record: dict) -> str:
    """How a preparation's data.json says its val split was chosen, for the start-up table and the report."""
    if record.get("val_from") == "draws":
        count = record.get("val_documents")
        if record.get("documents") == 1:
            return "the corpus's only document, its first tokens"
        return f"{'documents' if count is None else plural(count, 'document')} chosen by a hash of their position"
    return "the corpus's first tokens" if record.get("val_from") == "start" else "not recorded in data.json"
