import hashlib
import json
import os
import re
import shutil
import struct

import numpy as np
import pytest
import torch

import data
import hf
import model
import prepare
import tokenizer
from cli import DataError
from conftest import TINY_FLAGS, WORD_TEXT, write_doc_shards, write_tiny_shards
from data import ShardLoader
from shards import CORPUS_MARKER, DATA_RECORD, read_shard, write_data_record, write_shard
from test_prepare import DOCS

EOT = 50256


# ----------------------------------------------------------------------------------------------------------
# Shards


@pytest.mark.parametrize("vocab_size, version, fmt", [(50257, 1, "H"), (100277, 2, "I")])
def test_shard_round_trip_matches_llmc_bytes(tmp_path, vocab_size, version, fmt):
    tokens = np.random.default_rng(0).integers(0, vocab_size, size=1000)
    tokens[:2] = 0, vocab_size - 1
    path = tmp_path / "train_000000.bin"
    write_shard(path, tokens, vocab_size)
    expected = struct.pack("<256i", 20240520, version, len(tokens), *[0] * 253)
    expected += struct.pack(f"<{len(tokens)}{fmt}", *tokens.tolist())
    assert path.read_bytes() == expected
    assert os.listdir(tmp_path) == ["train_000000.bin"]  # no temporary file left behind
    back = read_shard(path)
    assert isinstance(back, np.memmap) and not back.flags.writeable
    np.testing.assert_array_equal(back, tokens)


def test_write_shard_rejects_ids_outside_the_vocabulary(tmp_path):
    with pytest.raises(DataError, match="bad.bin"):
        write_shard(tmp_path / "bad.bin", np.array([1, 50257]), 50257)


def _corrupt(path, how):
    raw = path.read_bytes()
    if how == "truncated":
        raw = raw[:-1]
    elif how == "header-cut":
        raw = raw[:100]
    else:
        header = np.frombuffer(raw[:1024], dtype="<i4").copy()
        field, delta = {"magic": (0, 1), "version": (1, 2), "count-too-small": (2, -1), "count-too-large": (2, 5)}[how]
        header[field] += delta
        raw = header.tobytes() + raw[1024:]
    path.write_bytes(raw)


@pytest.mark.parametrize("how, words", [
    ("truncated", "truncated"), ("header-cut", "truncated"), ("magic", "magic"),
    ("version", "version"), ("count-too-small", "count mismatch"), ("count-too-large", "truncated")])
def test_corrupt_shard_is_a_one_line_error_naming_the_file(tmp_path, how, words):
    path = tmp_path / "train_000007.bin"
    write_shard(path, np.arange(100), 50257)
    _corrupt(path, how)
    with pytest.raises(DataError) as e:
        read_shard(path)
    assert "train_000007.bin" in str(e.value) and words in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------------------
# The shards' tokenizer: data.json and check_vocab


def test_check_vocab_against_the_recorded_tokenizer(gpt2, tmp_path):
    (tmp_path / "doc.txt").write_text(DOCS[0] * 30)
    prepare.prepare(tmp_path / "doc.txt", tmp_path / "gpt2", val_tokens=10)
    shards = str(tmp_path / "gpt2")
    assert tokenizer.VOCAB_PAD_MULTIPLE == model.VOCAB_MULTIPLE
    assert data.check_vocab(50257, shards) is None
    assert data.check_vocab(50304, shards) is None  # padded to a multiple of 128, as models pad it
    for vocab in (151_936, 50_305, 50_000):  # Qwen3's; beyond the padding; too small for GPT-2's ids
        problem = data.check_vocab(vocab, shards)
        assert f"({vocab:,} ids)" in problem and "gpt2 tokenizer (50,257 ids" in problem and "\n" not in problem
    # Our own export of a GPT-2-vocabulary model: load_hf gives the unpadded vocabulary (config.json keeps it).
    torch.manual_seed(0)
    config = model.ModelConfig(vocab_size=50257, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, max_seq_len=16,
                               **model.QWEN3_VALUES)  # the architecture an export writes
    hf.export_hf(config, model.GPT(config).state_dict(), str(tmp_path / "hf"))
    loaded, _ = hf.load_hf(str(tmp_path / "hf"))
    assert loaded.vocab_size == 50257 and data.check_vocab(loaded.vocab_size, shards) is None


def test_check_vocab_without_a_record(gpt2, tmp_path):
    llmc, wide, corpus, broken = (tmp_path / name for name in ("llmc", "wide", "corpus", "broken"))
    for d in (llmc, wide, corpus, broken):
        d.mkdir()
    write_shard(llmc / "train_000000.bin", np.arange(100), 50257)  # 16-bit, as llm.c writes them
    assert data.check_vocab(50257, str(llmc)) is None and data.check_vocab(65536, str(llmc)) is None
    problem = data.check_vocab(151_936, str(llmc))
    assert "(151,936 ids)" in problem and "16-bit" in problem and "65,536" in problem and "\n" not in problem
    write_shard(wide / "train_000000.bin", np.arange(100), 151_936)  # 32-bit: no limit to tell
    assert data.check_vocab(151_936, str(wide)) is None
    assert data.check_vocab(151_936, str(tmp_path)) is None  # no shards: the loader says so
    # A default corpus cache from before data.json: its complete.json names the tokenizer only.
    (corpus / CORPUS_MARKER).write_text(json.dumps({"tokens": 100, "tokenizer": "gpt2"}))
    assert "gpt2 tokenizer (50,257 ids" in data.check_vocab(151_936, str(corpus))
    (broken / DATA_RECORD).write_text("{not json")
    assert data.check_vocab(50257, str(broken)).startswith(f"{broken / DATA_RECORD}: cannot read")


def test_vocab_from_data_when_vocab_size_is_not_given(tmp_path):
    (tmp_path / DATA_RECORD).write_text(json.dumps({"tokenizer": "words.json", "n_vocab": 70_001}))
    assert data.vocab_from_data(data.DEFAULT_VOCAB, str(tmp_path)) == 70_001  # the model pads it to 70,016
    assert data.vocab_from_data(256, str(tmp_path)) == 256  # given: check_vocab refuses it
    assert data.vocab_from_data(data.DEFAULT_VOCAB, str(tmp_path / "llmc")) == data.DEFAULT_VOCAB  # no record


def test_train_sizes_the_model_from_data_json(word_tokenizer, tmp_path, capsys):
    """Shards of a 70,001-id tokenizer.json: without --vocab-size the model takes its vocabulary (padded to
    70,016); a --vocab-size that does not fit is refused in one line, as before."""
    import train

    (tmp_path / "docs.jsonl").write_text((json.dumps({"text": WORD_TEXT}) + "\n") * 12)
    prepare.prepare(tmp_path / "docs.jsonl", tmp_path / "data", word_tokenizer, val_tokens=40)
    i = TINY_FLAGS.index("--vocab-size")
    flags = TINY_FLAGS[:i] + TINY_FLAGS[i + 2:]
    args = ["--data", str(tmp_path / "data"), *flags, "--max-steps", "2", "--eval-interval", "0", "--device", "cpu"]
    train.main([*args, "--out-dir", str(tmp_path / "out")])
    meta = torch.load(tmp_path / "out" / "ckpt_00000002.pt", weights_only=True)
    assert meta["model_config"]["vocab_size"] == 70_001 and "vocab 70016" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        train.main([*args, "--vocab-size", "256", "--out-dir", str(tmp_path / "refused")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "(256 ids) does not fit the shards" in err


# ----------------------------------------------------------------------------------------------------------
# Loader: shards of consecutive integers, so a window is identified by its first token.


LENGTHS = [101, 57, 80, 66, 90, 45]


T = 8


@pytest.fixture
def shards(tmp_path):
    offset = 0
    for i, n in enumerate(LENGTHS):
        write_shard(tmp_path / f"train_{i:06d}.bin", np.arange(offset, offset + n), 50257)
        offset += n
    write_shard(tmp_path / "val_000000.bin", np.arange(40), 50257)
    return tmp_path


def _all_windows():
    starts, offset = [], 0
    for n in LENGTHS:
        starts += [offset + w * T for w in range((n - 1) // T)]
        offset += n
    return starts


N = len(_all_windows())


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _stream(shards, n, **kw):
    """The global stream of window starts: batch size 1, one rank."""
    loader = ShardLoader(shards, batch_size=1, seq_len=T, prefetch=0, **kw)
    return [int(x[0, 0]) for x, _ in _take(loader, n)]


def test_loader_yields_shifted_int64_windows(shards):
    loader = ShardLoader(shards, batch_size=4, seq_len=T)
    for x, y in _take(loader, 20):
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, T)
        # consecutive integers: each row is one contiguous window and y is x shifted by one token
        assert torch.equal(x, x[:, :1] + torch.arange(T)) and torch.equal(y, x + 1)
    loader.close()


def test_global_stream_uses_every_window_once_per_epoch_with_new_orders(shards):
    stream = _stream(shards, 3 * N)
    epochs = [stream[e * N:(e + 1) * N] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == _all_windows()  # a permutation: no repeats, nothing skipped
    assert epochs[0] != epochs[1] != epochs[2]
    bounds = np.cumsum(LENGTHS)
    shard_orders = [list(dict.fromkeys(int(np.searchsorted(bounds, s, side="right")) for s in e)) for e in epochs]
    assert len({tuple(o) for o in shard_orders}) > 1 and all(sorted(o) == list(range(6)) for o in shard_orders)
    assert _stream(shards, N) == epochs[0] and _stream(shards, N, seed=1) != epochs[0]
    assert _stream(shards, N, shuffle=False) == _all_windows()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_are_disjoint_and_cover_each_epoch(shards, world_size):
    B, steps = 3, 2 * N // 3 + 1  # about two epochs; N is not a multiple of B * world_size
    stream = _stream(shards, steps * B * world_size)
    seen = {}
    for rank in range(world_size):
        loader = ShardLoader(shards, batch_size=B, seq_len=T, rank=rank, world_size=world_size)
        for k, (x, _) in enumerate(_take(loader, steps)):
            starts = x[:, 0].tolist()
            g = k * B * world_size + rank * B
            assert starts == stream[g:g + B]
            seen.update({g + b: (rank, s) for b, s in enumerate(starts)})
        loader.close()
    first_epoch = [seen[g] for g in range(N)]
    assert sorted(s for _, s in first_epoch) == _all_windows()
    per_rank = [{s for r, s in first_epoch if r == rank} for rank in range(world_size)]
    assert sum(len(p) for p in per_rank) == N  # disjoint


def test_state_dict_counts_consumed_batches_not_prefetched_ones(shards):
    loader = ShardLoader(shards, batch_size=4, seq_len=T, prefetch=3)
    _take(loader, 5)
    assert loader.state_dict()["next_window"] == 20
    thread = loader._thread
    loader.close()
    assert not thread.is_alive()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_mid_epoch_and_across_the_epoch_boundary(shards, tmp_path, prefetch):
    a = ShardLoader(shards, batch_size=4, seq_len=T, seed=3, prefetch=prefetch)
    _take(a, 5)
    torch.save(a.state_dict(), tmp_path / "state.pt")
    expected = _take(a, 12)  # 13 batches make an epoch: these cross into the second one
    b = ShardLoader(shards, batch_size=4, seq_len=T, seed=3, prefetch=prefetch)
    _take(b, 9)  # a running loader with prefetched batches is rewound exactly
    b.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    for (xa, ya), (xb, yb) in zip(expected, _take(b, 12)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    a.close(), b.close()


def test_resume_at_another_world_size_continues_the_global_stream(shards):
    before = [ShardLoader(shards, batch_size=3, seq_len=T, rank=r, world_size=2) for r in range(2)]
    for loader in before:
        _take(loader, 4)
        loader.close()
    state = before[0].state_dict()
    assert state == before[1].state_dict() and state["next_window"] == 24
    stream = _stream(shards, 24 + 5 * 6)
    for rank in range(3):
        loader = ShardLoader(shards, batch_size=2, seq_len=T, rank=rank, world_size=3)
        loader.load_state_dict(state)
        for k, (x, _) in enumerate(_take(loader, 5)):
            g = 24 + k * 6 + rank * 2
            assert x[:, 0].tolist() == stream[g:g + 2]
        loader.close()


def test_an_error_in_the_prefetch_thread_reaches_the_caller(shards, monkeypatch):
    loader = ShardLoader(shards, batch_size=2, seq_len=T, prefetch=2)

    def broken(g):
        raise DataError("disk gone")

    monkeypatch.setattr(loader, "_step", broken)
    with pytest.raises(DataError, match="disk gone"):
        next(loader)
    assert loader._thread is None and loader.state_dict()["next_window"] == 0


def test_loading_a_state_for_other_data_is_an_error(shards):
    state = ShardLoader(shards, batch_size=2, seq_len=T).state_dict()
    with pytest.raises(DataError, match="seq_len"):
        ShardLoader(shards, batch_size=2, seq_len=T + 1).load_state_dict(state)


def test_validation_loader_reads_in_order(shards):
    loader = ShardLoader(shards, "val", batch_size=2, seq_len=T, shuffle=False)
    assert [x[:, 0].tolist() for x, _ in _take(loader, 3)] == [[0, 8], [16, 24], [0, 8]]  # 4 windows, then wrap
    loader.close()


@pytest.mark.parametrize("case, words", [
    ("seq-len", "train_000000.bin: the longest of its shards has 101 tokens"), ("missing", "does not exist"),
    ("empty", "no train shards"),
    ("text", "no train shards (train_*.bin) in {dir}: to train on the files in it, python prepare.py --input {dir}"),
    ("corrupt", "train_000002.bin")])
def test_loader_bad_input_is_a_one_line_error(shards, tmp_path, case, words):
    directory, seq_len = shards, T
    if case == "seq-len":
        seq_len = 101  # no shard holds a sequence (the shorter ones give no row, and are passed over)
    elif case == "missing":
        directory = tmp_path / "nowhere"
    elif case == "empty":
        directory = tmp_path / "empty"
        directory.mkdir()
    elif case == "text":  # files to prepare, given to train.py as they are
        directory = tmp_path / "notes"
        directory.mkdir()
        (directory / "a.md").write_text("# notes\n")
    elif case == "corrupt":
        _corrupt(shards / "train_000002.bin", "truncated")
    with pytest.raises(DataError) as e:
        ShardLoader(directory, batch_size=2, seq_len=seq_len)
    assert words.format(dir=directory) in str(e.value) and "\n" not in str(e.value)
    assert (case == "text") == ("prepare.py" in str(e.value))


def test_an_unfinished_preparation_is_refused_in_one_line_naming_data(gpt2, tmp_path):
    """A killed prepare.py leaves OUT.partial-PID with whole-looking shards (and maybe a shard's temporary file):
    refused, not trained on. One that finished (data.json written last) loads whatever its name: the partial
    directory that could not be moved into place, or the earlier preparation that --overwrite set aside."""
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    whole = tmp_path / "out"
    prepare.prepare(tmp_path / "docs.jsonl", whole, val_tokens=5)
    partial, replaced = tmp_path / f"out{prepare.PARTIAL_SUFFIX}123", tmp_path / f"out{prepare.REPLACED_SUFFIX}123"
    for copy in partial, replaced:
        shutil.copytree(whole, copy)
    for directory in whole, partial, replaced:
        assert data.check_split(str(directory), "train", 2)
    (partial / "data.json").unlink()
    (whole / "train_000001.bin.4567.tmp").write_bytes(b"half")
    for directory, why in [(partial, f"prepare.py makes {whole} here"), (whole, "holds train_000001.bin.4567.tmp")]:
        with pytest.raises(DataError) as e:
            ShardLoader(directory, batch_size=1, seq_len=2)
        assert str(e.value).startswith(f"--data {directory} is an unfinished preparation") and why in str(e.value)
        assert "\n" not in str(e.value)
    (whole / "notes.4567.tmp").write_text("not a file of prepare.py's")  # the user's: no sign of a preparation
    (whole / "train_000001.bin.4567.tmp").unlink()
    assert data.check_split(str(whole), "train", 2)


def test_a_shard_too_short_for_a_sequence_gives_no_row_unless_every_shard_is(tmp_path):
    """prepare.py's last shard may hold fewer than seq_len + 1 tokens: the loader passes over it, epoch after
    epoch. Refused (either packing) only when no shard holds a sequence, naming the longest."""
    for name in "short", "none":
        (tmp_path / name).mkdir()
    short = write_tiny_shards(tmp_path / "short", train_tokens=(1000, 10), val_tokens=100)
    loader = ShardLoader(short, batch_size=4, seq_len=32, prefetch=0)
    assert loader.num_windows == (1000 - 1) // 32
    for _ in range(3 * 1000 // (4 * 32)):  # three epochs of the long shard
        x, y = next(loader)
        assert x.shape == y.shape == (4, 32)
    assert loader.epoch == 2
    loader.close()
    none = write_tiny_shards(tmp_path / "none", train_tokens=(10, 20), val_tokens=100)
    for packing in "windows", "bos":
        with pytest.raises(DataError) as e:
            ShardLoader(none, batch_size=1, seq_len=32, packing=packing, bos_token=0)
        assert str(e.value) == (f"{none}/train_000001.bin: the longest of its shards has 20 tokens, fewer than "
                                "seq_len + 1 = 33: no sequence fits; lower --seq-len or prepare more data")


def test_a_shard_that_data_json_records_and_that_is_not_there_is_named(gpt2, tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 20))
    out = tmp_path / "out"
    prepare.prepare(tmp_path / "docs.jsonl", out, shard_tokens=200, val_tokens=5)
    shards = len(data.split_paths(str(out), "train"))
    assert shards >= 3
    (out / "train_000001.bin").unlink()  # a partial copy, say
    with pytest.raises(DataError) as e:
        ShardLoader(out, batch_size=1, seq_len=2)
    assert str(e.value) == (f"{out}/train_000001.bin: missing (1 of the {shards} train shards that data.json "
                            "records are not there); restore them, or prepare the data again")


# ----------------------------------------------------------------------------------------------------------
# BOS-aligned packing: documents whose tokens (after the end-of-text) are their positions in the stream, so a
# row's segments say which document they came from and that each is a prefix of it.


def test_pack_best_fit_by_hand():
    # Buffer of 3, rows of 6. Row 0: 5 (the longest that fits 6), then nothing fits 1: crop the shortest
    # (doc 3, 2 -> 1). Row 1: 4, then 1, then crop doc 1 (3 -> 1). Row 2: doc 2 (9) cropped to 6.
    packing = data.pack_best_fit([5, 3, 9, 2, 4, 1], row_len=6, buffer_docs=3)
    assert packing.rows() == [[(0, 5), (3, 1)], [(4, 4), (5, 1), (1, 1)], [(2, 6)]]
    assert packing.cropped == 1 + 2 + 3 and packing.tokens == 24 and packing.cropped_fraction == 0.25
    # The documents run out before a row is full: no padding, so the row is dropped and all of it is cropped.
    short = data.pack_best_fit([4, 1], row_len=6)
    assert short.rows() == [] and short.cropped_fraction == 1.0
    assert data.pack_best_fit([], row_len=6).cropped_fraction == 0.0


@pytest.mark.parametrize("buffer_docs", [1, 4, 64])
def test_pack_best_fit_rows_are_full_and_documents_used_once(buffer_docs):
    lengths = np.random.default_rng(0).integers(1, 40, size=500)
    packing = data.pack_best_fit(lengths, row_len=33, buffer_docs=buffer_docs)
    rows = packing.rows()
    docs = [d for row in rows for d, _ in row]
    assert len(docs) == len(set(docs))  # a document is in one row at most
    for row in rows:
        assert sum(take for _, take in row) == 33
        assert all(take == lengths[d] for d, take in row[:-1])  # only a row's last segment may be a crop
        assert 0 < row[-1][1] <= lengths[row[-1][0]]
    assert packing.cropped == lengths.sum() - 33 * len(rows)


def test_best_fit_crops_less_than_taking_documents_in_order():
    lengths = np.random.default_rng(1).integers(1, 129, size=2000)  # all fit a row: only the choice crops
    in_order = data.pack_best_fit(lengths, row_len=129, buffer_docs=1).cropped_fraction
    best_fit = data.pack_best_fit(lengths, row_len=129).cropped_fraction
    assert best_fit < in_order / 3, (best_fit, in_order)  # 6.4% against 26.8%


def test_find_documents_chunked_equals_whole():
    tokens = np.random.default_rng(0).integers(0, 50257, size=10_000).astype(np.uint16)
    tokens[::97] = EOT
    expected = np.flatnonzero(tokens == EOT)
    for chunk in (1, 7, 4096, 1 << 24):
        found = data.find_documents(tokens, EOT, chunk=chunk)
        assert found.dtype == np.int64 and np.array_equal(found, expected)
    assert len(data.find_documents(tokens[:0], EOT)) == 0


@pytest.fixture
def doc_shards(tmp_path):
    """937 tokens of 140 documents of 1 to 12 tokens (a row holds T + 1 = 9; a quarter are longer) in 7 shards;
    -> (directory, document starts, shard ends)."""
    directory = tmp_path / "docs"  # not tmp_path itself, which the `shards` fixture fills
    directory.mkdir()
    lengths = np.random.default_rng(0).integers(1, 13, size=140).tolist()
    starts = write_doc_shards(directory, lengths, shard_tokens=150)
    ends = np.cumsum([len(read_shard(p)) for p in sorted(directory.glob("train_*.bin"))])
    assert len(ends) == 7 and ends[-1] - ends[-2] > T
    return directory, starts, ends


def _segments(row, starts, ends):
    """The (document start, tokens) segments of a row, each checked to be a prefix of its document, within
    its shard; a lone end-of-text (a document cropped to its first token) gives (None, 1)."""
    assert row[0] == EOT
    cuts = [i for i, t in enumerate(row) if t == EOT] + [len(row)]
    found = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if b - a == 1:
            found.append((None, 1))
            continue
        start = row[a + 1] - 1
        assert start in starts and row[a + 1:b] == list(range(start + 1, start + b - a))
        assert start + (b - a) <= ends[np.searchsorted(ends, start, side="right")]  # never past its shard
        found.append((start, b - a))
    return found


def _bos_loader(directory, **kw):
    return ShardLoader(directory, seq_len=T, packing="bos", **{"batch_size": 1, "prefetch": 0, **kw})


def _rows(batch):
    x, y = batch
    assert torch.equal(x[:, 1:], y[:, :-1])
    return [tuple(r) for r in torch.cat([x, y[:, -1:]], dim=1).tolist()]


def _bos_stream(directory, n, **kw):
    """The global stream of rows and the epoch of each: batch size 1, one rank."""
    loader = _bos_loader(directory, **kw)
    epochs = []
    rows = []
    for _ in range(n):
        epochs.append(loader.state_dict()["next_row"][0])
        rows += _rows(next(loader))
    return rows, epochs


def _documents(rows, starts, ends):
    return [s for row in rows for s, _ in _segments(list(row), starts, ends) if s is not None]


def test_bos_rows_start_at_documents_and_each_epoch_uses_a_document_once(doc_shards):
    directory, starts, ends = doc_shards
    rows, epochs = _bos_stream(directory, 400, seed=5)
    per_epoch = [[r for r, e in zip(rows, epochs) if e == epoch] for epoch in range(3)]
    assert epochs[-1] >= 3 and all(per_epoch)
    for epoch in per_epoch:
        docs = _documents(epoch, starts, ends)
        assert len(docs) == len(set(docs)) and len(docs) > len(epoch)  # rows hold several documents
    assert per_epoch[0] != per_epoch[1] != per_epoch[2]  # a new order (and packing) every epoch
    assert _bos_stream(directory, 50, seed=5)[0] == rows[:50] and _bos_stream(directory, 50, seed=6)[0] != rows[:50]


def test_bos_cropped_fraction_is_what_no_row_holds(doc_shards, shards):
    directory, starts, ends = doc_shards
    one = directory.parent / "one"
    one.mkdir()
    write_doc_shards(one, np.diff([*starts, ends[-1]]).tolist(), shard_tokens=10_000)  # all in one shard
    loader = _bos_loader(one)
    assert loader.cropped_fraction is None and loader.record_fields() == {}
    next(loader)
    fraction, rows = loader.record_fields()["data_cropped_frac"], 1  # of epoch 0's packing, before epoch 1 repacks
    while loader.epoch == 0:
        next(loader)
        rows += 1
    assert fraction == pytest.approx(1 - rows * (T + 1) / ends[-1]) and 0.05 < fraction < 0.5
    lengths = np.array(LENGTHS)  # windows: only the few tokens at each shard's end that no window reaches
    windows = ShardLoader(shards, batch_size=1, seq_len=T)
    assert windows.cropped_fraction == pytest.approx(((lengths - 1) % T).sum() / lengths.sum())
    next(windows)
    assert windows.record_fields() == {}  # the step records say it only under --packing bos


@pytest.mark.parametrize("world_size", [2, 3])
def test_bos_ranks_are_disjoint_and_cover_each_epoch(doc_shards, world_size):
    directory, starts, ends = doc_shards
    B, steps = 3, 25  # past the first epoch; its row count is not a multiple of B * world_size
    rows, epochs = _bos_stream(directory, steps * B * world_size)
    first_epoch = epochs.count(0)
    assert first_epoch < steps * B * world_size and first_epoch % (B * world_size)
    taken = {}
    for rank in range(world_size):
        loader = _bos_loader(directory, batch_size=B, rank=rank, world_size=world_size, prefetch=2)
        for k, batch in enumerate(_take(loader, steps)):
            g = k * B * world_size + rank * B
            assert _rows(batch) == rows[g:g + B]
            taken.update({g + b: (rank, row) for b, row in enumerate(_rows(batch))})
        loader.close()
    per_rank = [_documents([row for g, (r, row) in taken.items() if g < first_epoch and r == rank], starts, ends)
                for rank in range(world_size)]
    union = [d for docs in per_rank for d in docs]
    assert len(union) == len(set(union))  # no document trained twice in the epoch, on any two ranks
    assert sorted(union) == sorted(_documents(rows[:first_epoch], starts, ends))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_bos_resume_exactly_at_any_micro_batch_and_world_size(doc_shards, tmp_path, prefetch):
    directory = doc_shards[0]
    a = _bos_loader(directory, batch_size=4, seed=3, prefetch=prefetch)
    _take(a, 5)
    torch.save(a.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    expected = [row for batch in _take(a, 30) for row in _rows(batch)]  # crosses into the second epoch
    assert a.epoch >= 1
    b = _bos_loader(directory, batch_size=4, seed=3, prefetch=prefetch)
    _take(b, 9)  # a running loader with prefetched batches is rewound exactly
    b.load_state_dict(state)
    assert [row for batch in _take(b, 30) for row in _rows(batch)] == expected
    c = _bos_loader(directory, batch_size=2, seed=3, prefetch=prefetch)  # the out-of-memory retry's half batch
    c.load_state_dict(state)
    assert [row for batch in _take(c, 60) for row in _rows(batch)] == expected
    ranks = [_bos_loader(directory, batch_size=1, seed=3, rank=r, world_size=2) for r in range(2)]
    for loader in ranks:
        loader.load_state_dict(state)
    assert [row for _ in range(60) for loader in ranks for row in _rows(next(loader))] == expected
    assert ranks[0].state_dict() == ranks[1].state_dict() == c.state_dict() == a.state_dict()
    a.close(), b.close(), c.close()


def test_bos_state_does_not_load_into_windows_and_back(doc_shards):
    directory = doc_shards[0]
    bos, windows = _bos_loader(directory), ShardLoader(directory, batch_size=1, seq_len=T)
    with pytest.raises(DataError, match="saved with --packing bos, this run has --packing windows"):
        windows.load_state_dict(bos.state_dict())
    with pytest.raises(DataError, match="--packing windows, this run has --packing bos"):
        bos.load_state_dict(windows.state_dict())
    old = {k: v for k, v in windows.state_dict().items() if k != "packing"}  # a checkpoint from before --packing
    windows.load_state_dict(old)
    with pytest.raises(DataError, match="pack_buffer"):
        _bos_loader(directory, pack_buffer=10).load_state_dict(bos.state_dict())


@pytest.mark.parametrize("prefetch", [0, 2])
def test_bos_without_documents_is_a_one_line_error(shards, prefetch):
    loader = _bos_loader(shards, prefetch=prefetch)  # consecutive integers: no end-of-text anywhere
    with pytest.raises(DataError) as e:
        next(loader)
    assert "end-of-text" in str(e.value) and "--packing windows" in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------------------
# The stream of a seed, pinned: a checkpoint's loader state means the same position in every version.


@pytest.mark.parametrize("packing, first_tokens, digest, positions", [
    ("windows", [[278, 270, 294, 238], [286, 246, 262, 254], [214, 222, 158, 182], [174, 206, 166, 198]],
     "063cfd5e38d453ccbd05812b6a1a516e1bcecad0e096ff79ecfb60581c17b0d6", [{"next_window": 16}, {"next_window": 160}]),
    ("bos", [[428, 386, 394, 365], [414, 326, 305, 348], [374, 338, 360, 405], [441, 320, 640, 688]],
     "8ba09dba0642ded1eabf1e258571926819e20a44260cb987021d6c29c660469e",
     [{"next_row": [0, 1, 2]}, {"next_row": [1, 6, 0]}])], ids=["windows", "bos"])
def test_the_stream_and_states_of_seed_0_are_pinned(shards, doc_shards, packing, first_tokens, digest, positions):
    directory, identity = (shards, {"num_windows": 52}) if packing == "windows" else (
        doc_shards[0], {"num_windows": 112, "bos_token": EOT, "pack_buffer": 1000})
    identity.update(seed=0, seq_len=T, shuffle=True, packing=packing)
    loader = ShardLoader(directory, batch_size=4, seq_len=T, prefetch=0, packing=packing)
    column = 0 if packing == "windows" else 1  # a bos row starts at the end-of-text token: the next token tells
    batches = [next(loader) for _ in range(40)]
    assert [x[:, column].tolist() for x, _ in batches[:4]] == first_tokens
    digest_of = hashlib.sha256(b"".join(x.numpy().tobytes() + y[:, -1].numpy().tobytes() for x, y in batches))
    assert digest_of.hexdigest() == digest
    assert loader.state_dict() == {**positions[1], **identity}
    resumed = ShardLoader(directory, batch_size=4, seq_len=T, prefetch=0, packing=packing)
    resumed.load_state_dict({**positions[0], **identity})  # as a checkpoint of this stream's 4th step holds it
    assert resumed.state_dict() == {**positions[0], **identity}
    for (xa, ya), (xb, yb) in zip(batches[4:8], [next(resumed) for _ in range(4)]):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_bos_packing_starts_rows_at_the_separator_data_json_records(word_tokenizer, tmp_path):
    """Shards of another tokenizer separate documents with its own token (data.json's eot), not GPT-2's."""
    docs = [WORD_TEXT * 3, "a dog sat on the mat", WORD_TEXT * 2, "the park , the mat"] * 4
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    record = prepare.prepare(tmp_path / "docs.jsonl", tmp_path / "out", word_tokenizer, val_tokens=8)
    loader = ShardLoader(tmp_path / "out", batch_size=2, seq_len=8, packing="bos", prefetch=0)
    x, _ = next(loader)
    assert record["eot"] == 70_000 and (x[:, 0] == 70_000).all()


# ----------------------------------------------------------------------------- shards that change under a run


def _watched(tmp_path, record_digests=True):
    tokens = (np.arange(4000) * 7 % 250).astype(np.uint16)
    digests = {name: write_shard(tmp_path / name, tokens[i * 1000:(i + 1) * 1000], 256)
               for i, name in enumerate(["train_000000.bin", "train_000001.bin", "val_000000.bin"])}
    if record_digests:
        write_data_record(str(tmp_path), {"tokenizer": "t.json", "n_vocab": 256, "eot": 0, "sha256": digests})
    return tokens


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("damage", ["truncate", "overwrite", "remove"])
def test_a_shard_that_changes_while_the_loader_reads_stops_it_in_one_line(tmp_path, prefetch, damage):
    _watched(tmp_path, record_digests=False)  # the stat alone catches these
    loader = ShardLoader(tmp_path, batch_size=4, seq_len=16, prefetch=prefetch, shuffle=False)
    next(loader)
    path = tmp_path / "train_000000.bin"
    if damage == "truncate":  # reading the memory map past the new end would be a bus error
        os.truncate(path, 600)
    elif damage == "overwrite":  # same size, other tokens
        with open(path, "r+b") as f:
            f.seek(2000)
            f.write(b"\xff\x00" * 10)
            os.utime(path, ns=(1, 1))  # a clock that did not move would hide nothing from the size check alone
    else:
        os.remove(path)
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}: the shard (changed on disk while the run read it|"
                                        r"cannot be read any more)"):
        for _ in range(10):
            next(loader)
    loader.close()


def test_a_shard_whose_sha256_is_not_data_jsons_is_refused_when_first_read(tmp_path):
    _watched(tmp_path)
    with open(tmp_path / "train_000001.bin", "r+b") as f:  # damaged before the run: the stat cannot tell
        f.seek(1500)
        f.write(b"\x01\x00")
    loader = ShardLoader(tmp_path, batch_size=4, seq_len=16, prefetch=0, shuffle=False)
    for _ in range(15):  # shard 0's 62 windows read, then the damaged one's first
        next(loader)
    with pytest.raises(DataError, match=r"train_000001.bin: the shard's sha256 is not the one data.json records"):
        for _ in range(2):
            next(loader)
    assert ShardLoader(tmp_path, "val", batch_size=4, seq_len=16, prefetch=0).num_windows == 62  # val is whole
