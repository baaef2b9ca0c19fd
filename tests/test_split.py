import numpy as np
import pytest

import split
from cli import DataError
from conftest import split_by_hand

EOT = 9


def test_default_val_tokens_rule():
    assert split.MIN_VAL_TOKENS == 16 * 1024 + 1 and split.MAX_VAL_TOKENS == 1_000_000
    assert split.default_val_tokens(50_000) == split.MIN_VAL_TOKENS  # 0.5% is 250: one eval batch instead
    assert split.default_val_tokens(3_277_000) == 16_385  # where 0.5% takes over
    assert split.default_val_tokens(10_000_000) == 50_000  # 0.5%
    assert split.default_val_tokens(200_000_000) == 1_000_000
    assert split.default_val_tokens(2_500_000_000) == split.default_val_tokens(10**12) == 1_000_000  # the cap


def test_draws_are_pinned_and_even():
    # splitmix64's finaliser of the position: a preparation draws the same documents on every machine and version
    assert split.draws(np.arange(8)).tolist() == [split.draw_of(p) for p in range(8)]
    assert split.draws(np.arange(8)).tolist() == [47, 1, 14, 45, 10, 26, 0, 23]
    counts = np.bincount(split.draws(np.arange(64_000)), minlength=split.VAL_DRAWS)
    assert counts.min() > 850 and counts.max() < 1150  # about 1,000 each
    assert split.draws(np.array([2**40])).dtype == np.int64


def test_document_texts_count_documents_as_the_token_stream_does():
    pieces = [("lead", False), ("a", True), ("b", False), ("", True), ("c", True), ("", False), ("d", True)]
    assert list(split.document_texts(pieces)) == [(0, "lead"), (0, "a"), (0, "b"), (1, "c"), (1, ""), (2, "d")]


def _stream(sizes, seed=0):
    """Documents of these sizes, each led by EOT, tokens 0..8."""
    rng = np.random.default_rng(seed)
    return np.concatenate([np.concatenate([[EOT], rng.integers(0, 9, size - 1)]) for size in sizes]).astype(np.uint16)


def _run(sorter, stream, pieces):
    train = []
    for part in np.array_split(stream, pieces):  # documents cut across add() calls
        out = sorter.add(part)
        train += [] if out is None else out.tolist()
    val, rest, documents = sorter.finish("corpus")
    return val.tolist(), train + rest.tolist(), documents


def test_held_stream_takes_documents_draw_by_draw():
    stream = _stream([5 + p % 7 for p in range(100)])
    for val_tokens in (0, 1, 30, 200, len(stream) - 1):
        val, train, documents = _run(split.ValSplit(EOT, val_tokens), stream, pieces=7)
        assert val + train == split_by_hand(stream, val_tokens, EOT) and len(val) == val_tokens
        assert documents == np.count_nonzero(np.array(val) == EOT)


def test_streaming_past_the_hold_equals_the_held_split_while_draw_0_suffices():
    stream = _stream([20 + p % 13 for p in range(3000)], seed=1)
    draw_0 = np.flatnonzero(split.draws(np.cumsum(stream == EOT) - 1) == 0)
    for val_tokens in (100, len(draw_0)):
        held = _run(split.ValSplit(EOT, val_tokens), stream, pieces=50)
        streamed = _run(split.ValSplit(EOT, val_tokens, hold=1000), stream, pieces=50)
        assert streamed[0] == held[0] == stream[draw_0[:val_tokens]].tolist()
        assert streamed == held  # train in stream order either way: val took draw 0's first tokens
    sorter = split.ValSplit(EOT, None, hold=1000)  # auto: 0.5% of 77K is under the least, 16,385, and past
    sorter.add(stream)  # the hold the other draws went to train as they came
    with pytest.raises(DataError, match=f"^corpus: past its first 1,000 tokens the val split takes 1 in 64 documents, "
                                        f"chosen by a hash of their position, and those hold only {len(draw_0):,} "
                                        f"tokens; give --val-tokens {len(draw_0):,} or less, or cut the documents "
                                        r"into more \(--text-documents N: pieces of at most N tokens\)$"):
        sorter.finish("corpus")
    few = split.ValSplit(EOT, 100, hold=1000)  # six long documents: positions 0 to 5 all draw other than 0
    assert (split.draws(np.arange(6)) != 0).all()
    few.add(np.concatenate([[EOT, *range(10, 410)] for _ in range(6)]).astype(np.uint16))
    with pytest.raises(DataError, match=r"and those hold only 0 tokens; cut the documents into more \(--text-"):
        few.finish("corpus")


def test_the_val_cap_sends_later_draw_0_documents_to_train_and_the_unused_to_its_end(monkeypatch):
    stream = _stream([20 + p % 13 for p in range(3000)], seed=2)
    draw_0 = np.flatnonzero(split.draws(np.cumsum(stream == EOT) - 1) == 0)
    val, train, _ = _run(split.ValSplit(EOT, 50, hold=0), stream, pieces=9)
    assert val == stream[draw_0[:50]].tolist() and train == np.delete(stream, draw_0[:50]).tolist()
    monkeypatch.setattr(split, "MIN_VAL_TOKENS", 10)
    monkeypatch.setattr(split, "MAX_VAL_TOKENS", 600)  # auto: up to 600 wait; 0.5% of the total is taken
    val, train, _ = _run(split.ValSplit(EOT, None, hold=0), stream, pieces=9)
    target = len(stream) * 5 // 1000
    assert 10 < target < 600 and val == stream[draw_0[:target]].tolist()
    assert train == np.delete(stream, draw_0[:600]).tolist() + stream[draw_0[target:600]].tolist()


def test_too_small_a_corpus_is_refused_in_one_line():
    with pytest.raises(DataError, match=r"^corpus has only 50 tokens: not more than --val-tokens 50; lower --val-tokens$"):
        _run(split.ValSplit(EOT, 50), _stream([10] * 5), pieces=1)
    with pytest.raises(DataError, match="--val-tokens auto keeps at least 16,385 for val"):
        _run(split.ValSplit(EOT, None), _stream([10] * 5), pieces=1)


def test_val_held_out_bounds_the_val_splits_bytes_by_draw():
    docs = [("x" * 100, True)] * 200
    draws = [split.draw_of(p) for p in range(200)]
    held, last = split.val_held_out(docs, 30, None, 16)  # 480 bytes: five documents' worth
    below = sum(100 for d in draws if d < held - 1)
    assert below < 480 <= below + 100 * draws.count(held - 1) and last == 480 - below
    assert split.val_held_out(iter(()), 100, None, 16) == (split.VAL_DRAWS, 1600)  # nothing to take: all held

    small = [("é" * 10_000, True)] * 3  # 60,003 tokens at most: the least val split
    assert split.val_held_out(small, None, None, 16)[0] == split.VAL_DRAWS  # more than the corpus: all of it

    read = []

    def endless():
        while True:
            read.append(1)
            yield "x" * 10_000_000, True

    # auto: read up to 200M (20 documents), where val reaches its cap, 16M bytes: draws 0 (document 6) and 1
    assert split.val_held_out(endless(), None, None, 16) == (2, 6_000_000) and len(read) == 20
    read.clear()
    read.clear()  # a number: read until draw 0 alone holds it (documents 6 and 149), nothing further
    assert split.val_held_out(endless(), 10**6, None, 16) == (1, 16_000_000) and len(read) == 150
    assert split.val_held_out(endless(), None, 8_000_000, 16)[1] == 40_000 * 16  # 0.5% of --max-tokens


def test_describe_says_how_val_was_chosen():
    assert split.describe({"val_from": "draws", "val_documents": 26}) == "26 documents chosen by a hash of their position"
    assert split.describe({"val_from": "draws", "val_documents": 1}) == "1 document chosen by a hash of their position"
    assert split.describe({"val_from": "start"}) == "the corpus's first tokens"
    assert split.describe({}) == "not recorded in data.json"


def test_cut_documents_gives_pieces_of_at_most_n_tokens_in_any_arrays():
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 5, 500).astype(np.uint16)  # 0 is the separator
    whole, _ = split.cut_documents(stream, 0, 7, 0)
    assert np.array_equal(whole[whole != 0], stream[stream != 0])  # the text's tokens, unchanged and in order
    lengths = np.diff(np.flatnonzero(np.append(whole, 0) == 0)) - 1
    assert lengths.max() <= 7 and (lengths[:-1][lengths[:-1] > 0] >= 1).all()
    for cuts in (1, 3, 50):
        parts, run = [], 0
        for part in np.array_split(stream, cuts):
            part, run = split.cut_documents(part, 0, 7, run)
            parts.append(part)
        assert np.array_equal(np.concatenate(parts), whole)
