import gzip
import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import regex
import tiktoken
import tiktoken.load
import tiktoken.registry
import tiktoken_ext.openai_public as openai_public
import torch

import data
import export
import model
from cli import UsageError
from conftest import write_doc_shards
from data import DataError, ShardLoader, read_shard, write_shard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
R50K_FILE = hashlib.sha1(data.R50K_URL.encode()).hexdigest()
EOT = 50256


def _no_network(*args, **kwargs):
    raise ConnectionError("no network in this test")


# ----------------------------------------------------------------------------------------------------------
# Tokenizer


@pytest.fixture(scope="session")
def gpt2(tmp_path_factory):
    """GPT-2 loaded from an empty cache with tiktoken's own download disabled: only the PyPI route can work.
    The loaded encoding stays cached in data for the rest of the session."""
    cache = tmp_path_factory.mktemp("tiktoken-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        mp.setattr(tiktoken.load, "read_file", _no_network)
        mp.delitem(tiktoken.registry.ENCODINGS, "r50k_base", raising=False)
        data._load_encoding.cache_clear()
        enc = data.get_tokenizer("gpt2")
    return enc, cache


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty tiktoken cache, no network, and no encoding loaded in this process; returns the ranks' path."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiktoken.load, "read_file", _no_network)
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, "r50k_base", raising=False)
    monkeypatch.setattr(data, "_load_encoding", data._load_encoding.__wrapped__)
    return tmp_path / R50K_FILE


def test_gpt2_real_ids_through_the_pypi_route(gpt2):
    enc, cache = gpt2
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.eot_token == EOT and enc.n_vocab == 50257
    # the file came from the whisper sdist and sits where tiktoken's cache looks for it
    assert hashlib.sha256((cache / R50K_FILE).read_bytes()).hexdigest() == data.R50K_SHA256


def test_tokenizer_error_when_no_file_can_be_had(offline_cache, monkeypatch):
    def pip_fails():
        raise subprocess.CalledProcessError(1, ["pip", "download"])

    monkeypatch.setattr(data, "_ranks_from_pypi", pip_fails)
    with pytest.raises(DataError) as e:
        data.get_tokenizer("gpt2")
    msg = str(e.value)
    assert "\n" not in msg and "pip download openai-whisper" in msg and str(offline_cache) in msg


def test_tokenizer_refuses_ranks_with_the_wrong_hash(offline_cache, monkeypatch):
    monkeypatch.setattr(data, "_ranks_from_pypi", lambda: b"IQ== 0\n")
    with pytest.raises(DataError):
        data.get_tokenizer("gpt2")
    assert not offline_cache.exists()


def test_tokenizer_replaces_a_corrupt_cached_file(gpt2, offline_cache, monkeypatch):
    good = (gpt2[1] / R50K_FILE).read_bytes()
    offline_cache.write_bytes(b"corrupt")
    monkeypatch.setattr(data, "_ranks_from_pypi", lambda: good)
    assert data.get_tokenizer("gpt2").encode("Hello world") == [15496, 995]
    assert offline_cache.read_bytes() == good


def test_unknown_tokenizer_is_a_one_line_error():
    with pytest.raises(DataError, match="unknown tokenizer 'nope'"):
        data.get_tokenizer("nope")


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
# prepare()

DOCS = [
    "Hello world.\nIt's a test, isn't it?  Two  spaces.\n",
    "naïve café, ünïcödé: 日本語\n\n    indented\n\tend",
    "x.\n/y  \nz 123\n",
]


def _all_tokens(out_dir):
    shards = [n for n in os.listdir(out_dir) if n.endswith(".bin")]
    names = sorted(shards, key=lambda n: (not n.startswith("val_"), n))  # val first
    assert names[0] == "val_000000.bin" and all(n.startswith("train_") for n in names[1:])
    return np.concatenate([read_shard(out_dir / n) for n in names]).tolist()


def _expected(enc, docs):
    return [t for doc in docs for t in [EOT] + enc.encode_ordinary(doc)]


def _check(enc, out_dir, docs):
    tokens = _all_tokens(out_dir)
    assert tokens == _expected(enc, docs)
    assert enc.decode(tokens) == "".join("<|endoftext|>" + d for d in docs)


def test_prepare_text_file_in_pieces_equals_whole_file_encoding(gpt2, tmp_path, monkeypatch):
    enc = gpt2[0]
    rng = random.Random(0)
    parts = ["foo", "Bar", ".", "/", " ", "  ", "\n", "\n\n", "'s", "12", "é", "\t", "x\ny", ".\nb", " \nc"]
    text = "".join(rng.choice(parts) for _ in range(3000))
    (tmp_path / "book.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(data, "TEXT_CHUNK_CHARS", 16)  # many pieces, cut only where encoding is unchanged
    assert len(list(data._text_pieces(str(tmp_path / "book.txt")))) > 20
    stats = data.prepare(tmp_path / "book.txt", tmp_path / "out", shard_tokens=500, val_tokens=100)
    _check(enc, tmp_path / "out", [text])
    assert stats["documents"] == 1 and stats["val_tokens"] == 100 and stats["train_shards"] > 2
    assert all(len(read_shard(p)) == 500 for p in sorted((tmp_path / "out").glob("train_*"))[:-1])


def test_text_pieces_keep_every_tiktoken_pre_tokenization(tmp_path, monkeypatch):
    # BPE never merges across pre-tokens, so equal pre-tokens on the whole text and on its pieces mean equal
    # ids. Checked with tiktoken's own patterns (their BPE files are not needed for this).
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *a, **k: {})
    monkeypatch.setattr(openai_public, "data_gym_to_mergeable_bpe_ranks", lambda *a, **k: {})
    patterns = {name: make()["pat_str"] for name, make in openai_public.ENCODING_CONSTRUCTORS.items()}
    assert {"r50k_base", "cl100k_base", "o200k_base"} <= set(patterns)
    monkeypatch.setattr(data, "TEXT_CHUNK_CHARS", 5)
    alphabet = list("aZé日\u0301'1.,/!? \t\n") + ["\na", ".\n", "x\n", "\n/", "'s\n"]
    rng = random.Random(0)
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(300))
        (tmp_path / "t.txt").write_text(text, encoding="utf-8")
        pieces = [piece for piece, _ in data._text_pieces(str(tmp_path / "t.txt"))]
        assert "".join(pieces) == text and len(pieces) > 5
        for name, pattern in patterns.items():
            assert regex.findall(pattern, text) == [t for p in pieces for t in regex.findall(pattern, p)], name


def test_a_text_file_within_one_read_is_one_piece(tmp_path):
    # Cutting costs a backwards scan for a safe newline; a file that the first read takes whole needs none.
    text = "def f():\n    return 1\n\nx = f()\n" * 50
    (tmp_path / "m.py").write_text(text)
    assert list(data._text_pieces(str(tmp_path / "m.py"))) == [(text, True)]


def test_prepare_directory_recursive_and_glob(gpt2, tmp_path):
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    (src / "a.txt").write_text(DOCS[0])
    (src / "b" / "c.md").write_text(DOCS[1])
    (src / "b" / "d.txt").write_text(DOCS[2])
    (src / "image.bin").write_bytes(b"\x89PNG\0\0binary")  # not text: skipped
    (src / ".hidden.txt").write_text("skipped")
    data.prepare(src, tmp_path / "dir", val_tokens=3)
    _check(gpt2[0], tmp_path / "dir", DOCS)
    data.prepare(str(src / "**" / "*.txt"), tmp_path / "glob", val_tokens=3)
    _check(gpt2[0], tmp_path / "glob", [DOCS[0], DOCS[2]])


def test_prepare_jsonl_and_parquet(gpt2, tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    pq.write_table(pa.table({"text": DOCS, "id": [0, 1, 2]}), tmp_path / "docs.parquet")
    data.prepare(tmp_path / "docs.jsonl", tmp_path / "jsonl", val_tokens=5)
    data.prepare(tmp_path / "docs.parquet", tmp_path / "parquet", val_tokens=5)
    _check(gpt2[0], tmp_path / "jsonl", DOCS)
    _check(gpt2[0], tmp_path / "parquet", DOCS)


def test_prepare_hugging_face_dataset_streams_the_train_split(gpt2, tmp_path, monkeypatch):
    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter({"text": d} for d in DOCS)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    data.prepare("someone/corpus:small", tmp_path / "hf", val_tokens=5)
    assert calls == [("someone/corpus", "small", "train", True)]
    _check(gpt2[0], tmp_path / "hf", DOCS)


@pytest.mark.parametrize("case, words", [
    ("missing", "not found"), ("mistyped-path", "not found"), ("empty-dir", "no text"), ("glob", "no text"),
    ("out-under-file", "cannot create"), ("existing-shards", "already holds shards"),
    ("too-few-tokens", "lower --val-tokens"), ("no-text-field", "doc.jsonl:2"),
    ("not-utf8", "doc.jsonl:3: not UTF-8 (invalid start byte at byte 11 of the line)"),
    ("binary", "image.png: a binary file"), ("binary-in-glob", "image.png: a binary file"),
    ("compressed", "docs.jsonl.gz: gzip-compressed; compressed input is not supported")])
def test_prepare_errors(gpt2, tmp_path, monkeypatch, case, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text(DOCS[0])
    (tmp_path / "empty").mkdir()
    source, out = "doc.txt", "out"
    if case == "missing":
        source = "missing"
    elif case == "mistyped-path":
        source = "empty/missing"  # looks like owner/name, but "empty" is a local directory
    elif case == "empty-dir":
        source = "empty"
    elif case == "glob":
        source = "*.nothing"
    elif case == "out-under-file":
        (tmp_path / "file").write_text("")
        out = "file/out"
    elif case == "existing-shards":
        write_shard(tmp_path / "empty" / "train_000000.bin", np.arange(10), 50257)
        out = "empty"
    elif case == "too-few-tokens":
        pass
    elif case == "no-text-field":
        (tmp_path / "doc.jsonl").write_text('{"text": "ok"}\n{"body": "no"}\n')
        source = "doc.jsonl"
    elif case == "not-utf8":
        (tmp_path / "doc.jsonl").write_bytes(b'{"text": "ok"}\n' * 2 + b'{"text": "\xff"}\n')
        source = "doc.jsonl"
    elif case.startswith("binary"):
        (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
        source = "image.png" if case == "binary" else "*.*"
    elif case == "compressed":
        (tmp_path / "docs.jsonl.gz").write_bytes(gzip.compress(b'{"text": "ok"}\n'))
        source = "docs.jsonl.gz"
    with pytest.raises(DataError) as e:
        data.prepare(source, out, val_tokens=10_000 if case == "too-few-tokens" else 1)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_invalid_utf8_is_replaced_with_one_warning_per_file(gpt2, tmp_path, monkeypatch, capsys):
    # Four invalid sequences (the last a character cut short), and one U+FFFD that is really in the file.
    raw = b"caf\xe9 ok\n" + "\ufffd is fine\n".encode() + b"\xff\xfe end \xe2\x82\n"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_bytes(raw * 3)
    (tmp_path / "src" / "b.txt").write_text(DOCS[0])
    monkeypatch.setattr(data, "TEXT_CHUNK_CHARS", 8)  # counted across many pieces
    data.prepare(tmp_path / "src", tmp_path / "out", val_tokens=1)
    _check(gpt2[0], tmp_path / "out", [(raw * 3).decode(errors="replace"), DOCS[0]])
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"warning: {tmp_path / 'src' / 'a.txt'}: 12 invalid UTF-8 sequences replaced with U+FFFD, "
                        "the first at line 1"]
    assert data._first_invalid_line(str(tmp_path / "src" / "b.txt")) is None
    (tmp_path / "late.txt").write_bytes("é\n".encode() * 5 + b"ok \xe2\x82")  # a character cut short at the end
    assert all(data._first_invalid_line(str(tmp_path / "late.txt"), block) == 6 for block in (1, 2, 3, 64))


def _reference_shards(enc, docs, shard_tokens, val_tokens):
    """The shard files prepare must write, made the plain way: encode_ordinary per document, the EOT token
    before each non-empty one, the first val_tokens tokens to val, the rest in train shards of shard_tokens."""
    tokens = np.array([t for doc in docs if doc for t in [EOT] + enc.encode_ordinary(doc)], dtype="<u2")
    splits = {"val_000000.bin": tokens[:val_tokens]}
    for i, start in enumerate(range(val_tokens, len(tokens), shard_tokens)):
        splits[f"train_{i:06d}.bin"] = tokens[start:start + shard_tokens]
    return {name: struct.pack("<256i", 20240520, 1, len(t), *[0] * 253) + t.tobytes() for name, t in splits.items()}


@pytest.mark.parametrize("batch_chars, chars_in_flight", [(40, 100), (None, None)])
def test_prepare_shards_are_byte_identical_to_a_plain_reference(gpt2, tmp_path, monkeypatch, batch_chars,
                                                                 chars_in_flight):
    # Pipelined encoding (small batches, many in flight, written by another thread) changes nothing on disk.
    rng = random.Random(1)
    words = ["the", " cat", "Über", "日本語", "\n", "  ", "\t", "'s", "42", ".", "<|endoftext|>", "\ud800", "é"]
    docs = ["".join(rng.choice(words) for _ in range(rng.randrange(0, 300))) for _ in range(60)]  # JSON: surrogates
    docs[5] = ""  # an empty document: skipped
    book = "".join(rng.choice(["word", " ", "\n", ".\n", "x\ny", "ü"]) for _ in range(5000))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "src" / "b.txt").write_text(book, encoding="utf-8")
    monkeypatch.setattr(data, "TEXT_CHUNK_CHARS", 64)  # the book in many pieces
    if batch_chars:
        monkeypatch.setattr(data, "ENCODE_BATCH_CHARS", batch_chars)
        monkeypatch.setattr(data, "ENCODE_CHARS_PER_THREAD", chars_in_flight)
    data.prepare(tmp_path / "src", tmp_path / "out", shard_tokens=997, val_tokens=300)
    written = {p.name: p.read_bytes() for p in (tmp_path / "out").glob("*.bin")}
    expected = _reference_shards(gpt2[0], docs + [book], shard_tokens=997, val_tokens=300)
    assert len(expected) > 5 and written == expected


@pytest.mark.parametrize("failing", ["reader", "writer"])
def test_prepare_error_midway_leaves_no_thread_running(gpt2, tmp_path, monkeypatch, failing):
    # default_corpus deletes its directory after an error: nothing may still be encoding or writing into it.
    lines = [json.dumps({"text": DOCS[0] * 5})] * 200 + ['{"body": "no text"}']
    (tmp_path / "doc.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(data, "ENCODE_BATCH_CHARS", 100)
    monkeypatch.setattr(data, "ENCODE_CHARS_PER_THREAD", 200)
    written, real_write_shard = [], data.write_shard

    def write_shard(path, tokens, vocab_size):
        if failing == "writer" and len(written) == 10:
            raise DataError("disk full")
        written.append(path)
        real_write_shard(path, tokens, vocab_size)

    monkeypatch.setattr(data, "write_shard", write_shard)
    with pytest.raises(DataError, match="doc.jsonl:201" if failing == "reader" else "disk full"):
        data.prepare(tmp_path / "doc.jsonl", tmp_path / "out", shard_tokens=100, val_tokens=10)
    assert len(written) >= 10  # shards were being written when it failed
    assert os.listdir(tmp_path) == ["doc.jsonl"]  # and none is left: no --out, no partial directory
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("tokenizer", "shard-writer"))]


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_a_stopped_preparation_leaves_nothing_and_the_rerun_completes(gpt2, tmp_path, monkeypatch, capsys, stop):
    """A signal while shards are being written: one line, 128 + the signal's number, no --out and no partial
    directory. The rerun completes, into an empty --out too; a partial directory that no live process holds
    (a killed run's) is removed, one that is held is left alone."""
    docs = _corpus(tmp_path, 60)
    args = ["--input", str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "out"), "--shard-tokens", "997",
            "--val-tokens", "100"]
    real_write_shard = data.write_shard

    def write_shard(path, tokens, vocab_size):  # runs in the writer thread; the signal reaches the main one
        if path.endswith("train_000003.bin"):
            os.kill(os.getpid(), getattr(signal, stop))
        real_write_shard(path, tokens, vocab_size)

    def escaped(*args):  # a signal that data.main leaves unhandled fails this test, not the whole session
        raise AssertionError("the signal escaped data.main")

    monkeypatch.setattr(data, "write_shard", write_shard)
    previous = signal.signal(signal.SIGTERM, escaped)
    try:
        code = data.main(args)
    except KeyboardInterrupt:
        code = "KeyboardInterrupt"
    finally:
        handler = signal.signal(signal.SIGTERM, previous)
    assert code == 128 + getattr(signal, stop) and handler == escaped  # data.main's own handler is gone
    assert capsys.readouterr().err.splitlines()[-1:] == [
        f"{'interrupted' if stop == 'SIGINT' else 'terminated'}; nothing written to {tmp_path / 'out'}"]
    assert os.listdir(tmp_path) == ["docs.jsonl"]
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("tokenizer", "shard-writer"))]

    monkeypatch.setattr(data, "write_shard", real_write_shard)
    for pid in (1, 99999999):
        (tmp_path / f"out.partial-{pid}").mkdir()
        write_shard(str(tmp_path / f"out.partial-{pid}" / "train_000000.bin"), np.arange(10), 50257)
    held = data._lock(str(tmp_path / "out.partial-1"))  # as a running preparation holds its own
    (tmp_path / "out").mkdir()  # an empty --out is taken too
    try:
        assert data.main(args) == 0
    finally:
        os.close(held)
    assert f"data: removed {tmp_path / 'out.partial-99999999'}" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl", "out", "out.partial-1"]
    _check(gpt2[0], tmp_path / "out", docs)


@pytest.mark.parametrize("case, error, words", [
    ("user-file", DataError, "--out out is not empty (it holds data.json); choose a new or empty directory"),
    ("prepared", DataError, "out already holds shards (train_000000.bin, ...)"),
    ("input-file", UsageError, "--out src/a.txt is the input src/a.txt"),
    ("input-dir", UsageError, "--out src is the input src"),
    ("inside-input", UsageError, "--out src/shards is inside the input src"),
    ("holds-input", UsageError, "--out out holds the input out/b.txt"),
    ("glob", UsageError, "--out out holds the input out/b.txt")])
def test_out_must_be_new_or_empty_and_apart_from_the_input(tmp_path, monkeypatch, case, error, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text(DOCS[0])
    (tmp_path / "out").mkdir()
    source, out = "src", "out"
    if case == "user-file":
        (tmp_path / "out" / "data.json").write_text('{"mine": true}')
    elif case == "prepared":
        write_shard(tmp_path / "out" / "train_000000.bin", np.arange(10), 50257)
    elif case.startswith("input"):
        source = out = "src/a.txt" if case == "input-file" else "src"
    elif case == "inside-input":
        out = "src/shards"
    else:
        (tmp_path / "out" / "b.txt").write_text(DOCS[1])
        source = "out/b.txt" if case == "holds-input" else "*/b.txt"
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(error) as e:
        data.prepare(source, out, val_tokens=1)
    assert str(e.value).startswith(words) and "\n" not in str(e.value)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing written or lost
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat("/dev").st_dev,
                    reason="needs /dev/shm mounted apart from /dev")
def test_an_out_that_is_a_mount_point_is_refused_before_anything_is_read(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    with pytest.raises(UsageError, match="--out /dev/shm is a mount point"):
        data.prepare(str(tmp_path / "a.txt"), "/dev/shm", val_tokens=1)


def test_a_finished_preparation_that_cannot_be_moved_into_place_is_kept(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text(DOCS[0])

    def busy(src, dst):
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))

    monkeypatch.setattr(data.os, "rename", busy)
    with pytest.raises(data.DataError, match="they are complete in") as e:
        data.prepare(str(tmp_path / "a.txt"), str(tmp_path / "out"), val_tokens=1)
    kept = str(e.value).split("they are complete in ")[1].split(":")[0]
    assert sorted(os.listdir(kept)) == ["data.json", "train_000000.bin", "val_000000.bin"]


@pytest.mark.parametrize("flags, message", [
    (["--shard-tokens", "0"], "--shard-tokens must be in [1, 2,146,483,648) under --val-tokens auto, got 0"),
    (["--shard-tokens", "2147000000"], "--shard-tokens must be in [1, 2,146,483,648) under --val-tokens auto"),
    (["--shard-tokens", "0", "--val-tokens", "5"], "--shard-tokens must be in [1, 2,147,483,648), got 0"),
    (["--val-tokens", "-1"], "--val-tokens must be auto or in [0, 2**31), got -1")])
def test_cli_size_errors_name_the_flag(tmp_path, capsys, flags, message):
    assert data.main(["--input", "missing", "--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


def test_count_in_file_across_blocks(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" + b"abc" * 4 + b"ab")
    assert all(data._count_in_file(str(path), b"abc", block) == 4 for block in range(1, 16))


# ----------------------------------------------------------------------------------------------------------
# --val-tokens auto and --max-tokens


def _corpus(tmp_path, n_docs, seed=0) -> list[str]:
    """n_docs documents of 50 to 400 words (about a token each) in tmp_path/docs.jsonl."""
    rng = random.Random(seed)
    words = ["the", " cat", " sat", ".", "\n", " on", " 42", " mat", ",", " é", " Über"]
    docs = ["".join(rng.choice(words) for _ in range(rng.randrange(50, 400))) for _ in range(n_docs)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def test_default_val_tokens_rule():
    assert data.MIN_VAL_TOKENS == 16 * 1024 + 1 and data.MAX_VAL_TOKENS == 1_000_000
    assert data.default_val_tokens(50_000) == data.MIN_VAL_TOKENS  # 0.5% is 250: one eval batch instead
    assert data.default_val_tokens(3_277_000) == 16_385  # where 0.5% takes over
    assert data.default_val_tokens(10_000_000) == 50_000  # 0.5%
    assert data.default_val_tokens(200_000_000) == 1_000_000
    assert data.default_val_tokens(2_500_000_000) == data.default_val_tokens(10**12) == 1_000_000  # the cap


def test_prepare_with_default_args_keeps_the_first_tokens_of_a_small_corpus_for_val(gpt2, tmp_path, capsys):
    docs = _corpus(tmp_path, 220)
    stats = data.prepare(tmp_path / "docs.jsonl", tmp_path / "out")  # under 1M tokens: refused before auto
    expected = _expected(gpt2[0], docs)
    assert 40_000 < len(expected) < 60_000
    assert stats["val_tokens"] == data.default_val_tokens(len(expected)) == data.MIN_VAL_TOKENS
    assert read_shard(tmp_path / "out" / "val_000000.bin").tolist() == expected[:data.MIN_VAL_TOKENS]
    assert _all_tokens(tmp_path / "out") == expected
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("data: 220 documents") and line.endswith(
        "val: first 16,385 tokens (the least: one eval batch of 16 x 1,024, plus 1; "
        f"{16_385 / len(expected):.1%} of the corpus, --val-tokens auto)")
    record = json.loads((tmp_path / "out" / data.DATA_RECORD).read_text())
    assert {k: record[k] for k in ("tokenizer", "n_vocab", "eot", "documents", "tokens", "val_tokens",
                                   "train_tokens", "val_from")} == {
        "tokenizer": "gpt2", "n_vocab": 50257, "eot": EOT, "documents": 220, "tokens": len(expected),
        "val_tokens": 16_385, "train_tokens": len(expected) - 16_385, "val_from": "start"}


def test_auto_val_writes_train_shards_as_it_goes_and_takes_val_from_the_start(gpt2, tmp_path, monkeypatch, capsys):
    """Bounds made small so that a small corpus meets each rule: 0.5%, then the cap. Train shards are written
    while streaming, from the held first MAX_VAL_TOKENS on; val is the first tokens, and what it leaves of the
    held ones opens the first train shard."""
    docs = _corpus(tmp_path, 60)
    expected = _expected(gpt2[0], docs)
    monkeypatch.setattr(data, "MIN_VAL_TOKENS", 10)
    for cap, out in [(150, "share"), (40, "cap")]:
        monkeypatch.setattr(data, "MAX_VAL_TOKENS", cap)
        stats = data.prepare(tmp_path / "docs.jsonl", tmp_path / out, shard_tokens=997)
        val = min(cap, len(expected) * 5 // 1000)
        assert stats["val_tokens"] == val and (val == 40) == (out == "cap")
        assert read_shard(tmp_path / out / "val_000000.bin").tolist() == expected[:val]
        assert _all_tokens(tmp_path / out) == expected
        sizes = [len(read_shard(p)) for p in sorted((tmp_path / out).glob("train_*"))]
        assert len(sizes) > 5 and sizes[0] == 997 + cap - val and set(sizes[1:-1]) == {997} and 0 < sizes[-1] <= 997
        reason = "0.5% of the corpus" if out == "share" else f"the cap; {40 / len(expected):.2%} of the corpus"
        assert capsys.readouterr().out.strip().endswith(f"val: first {val:,} tokens ({reason}, --val-tokens auto)")
    data.prepare(tmp_path / "docs.jsonl", tmp_path / "explicit", shard_tokens=997, val_tokens=300)
    assert read_shard(tmp_path / "explicit" / "val_000000.bin").tolist() == expected[:300]  # the first N
    assert capsys.readouterr().out.strip().endswith("; val: first 300 tokens (--val-tokens 300)")


def test_auto_val_refuses_a_corpus_too_small_to_leave_train_tokens(gpt2, tmp_path):
    (tmp_path / "doc.txt").write_text(DOCS[0] * 100)
    with pytest.raises(DataError) as e:
        data.prepare(tmp_path / "doc.txt", tmp_path / "out")
    assert "--val-tokens auto keeps at least 16,385 for val" in str(e.value) and "\n" not in str(e.value)
    assert not list((tmp_path / "out").glob("*.bin"))


def test_max_tokens_cuts_at_the_exact_count(gpt2, tmp_path, monkeypatch, capsys):
    docs = _corpus(tmp_path, 60)
    expected = _expected(gpt2[0], docs)[:5000]
    stats = data.prepare(tmp_path / "docs.jsonl", tmp_path / "explicit", shard_tokens=997, val_tokens=100,
                         max_tokens=5000)
    assert _all_tokens(tmp_path / "explicit") == expected
    assert stats["tokens"] == 5000 and stats["val_tokens"] == 100 and stats["documents"] == expected.count(EOT)
    captured = capsys.readouterr()
    assert "5,000/5,000 tok" in captured.err  # the progress knows the total: a count out of it, and an ETA
    assert ", cut at --max-tokens 5,000; val: first 100 tokens" in captured.out
    monkeypatch.setattr(data, "MIN_VAL_TOKENS", 10)
    stats = data.prepare(tmp_path / "docs.jsonl", tmp_path / "auto", shard_tokens=997, max_tokens=5000)
    assert _all_tokens(tmp_path / "auto") == expected and stats["val_tokens"] == 25  # 0.5% of 5,000
    data.prepare(tmp_path / "docs.jsonl", tmp_path / "all", val_tokens=100, max_tokens=10**9)
    assert "all of it (fewer than --max-tokens 1,000,000,000)" in capsys.readouterr().out


def test_auto_val_is_the_same_prefix_under_any_max_tokens(gpt2, tmp_path, monkeypatch):
    """The rule scaled down (at least 10, at most 40: saturated from 8,000 tokens on): a smaller cap's val split
    is a prefix of a larger cap's, every cap from saturation on gives the identical val shard, and train
    starts right after val whether train shards were written while streaming (shards of 997) or not."""
    expected = _expected(gpt2[0], _corpus(tmp_path, 60))
    assert len(expected) > 12_000
    monkeypatch.setattr(data, "MIN_VAL_TOKENS", 10)
    monkeypatch.setattr(data, "MAX_VAL_TOKENS", 40)
    vals = {}
    for cap, shard_tokens in [(3000, 997), (9000, 997), (12_000, 997), (None, 997), (9000, 10**6)]:
        out = tmp_path / f"{cap}-{shard_tokens}"
        data.prepare(tmp_path / "docs.jsonl", out, shard_tokens=shard_tokens, max_tokens=cap)
        vals[cap, shard_tokens] = (out / "val_000000.bin").read_bytes()
        assert _all_tokens(out) == expected[:cap]
    assert read_shard(tmp_path / "3000-997" / "val_000000.bin").tolist() == expected[:15]  # 0.5% of 3,000
    assert len({vals[key] for key in vals if key[0] != 3000}) == 1  # at or past saturation: 40 tokens
    data.prepare(tmp_path / "docs.jsonl", tmp_path / "explicit", shard_tokens=10**6, val_tokens=40, max_tokens=9000)
    assert {p.name: p.read_bytes() for p in (tmp_path / "explicit").glob("*.bin")} == {
        p.name: p.read_bytes() for p in (tmp_path / "9000-1000000").glob("*.bin")}


def test_max_tokens_that_leave_no_train_tokens_are_refused(gpt2, tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOCS[0])
    for kwargs, words in [({"val_tokens": 100, "max_tokens": 100}, "(100 tokens)"),
                          ({"max_tokens": 16_385}, "(16,385 tokens, the least of --val-tokens auto)")]:
        with pytest.raises(ValueError, match="leaves no train tokens after the val split " + re.escape(words)):
            data.prepare(tmp_path / "doc.txt", tmp_path / "out", **kwargs)
    assert data.main(["--input", str(tmp_path / "doc.txt"), "--out", str(tmp_path / "out"),
                      "--max-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --max-tokens 0 leaves no train tokens") and err.count("\n") == 1


# ----------------------------------------------------------------------------------------------------------
# Hugging Face datasets: the hub (--hf-config, --hf-split) and save_to_disk directories


def test_hf_config_and_split_reach_load_dataset(gpt2, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter({"text": d} for d in DOCS)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert data.main(["--input", "HuggingFaceFW/fineweb-edu", "--hf-config", "sample-10BT", "--hf-split",
                      "validation", "--out", str(tmp_path / "cli"), "--val-tokens", "5"]) == 0
    data.prepare("hf:corpus", tmp_path / "plain", val_tokens=5)
    data.prepare("someone/corpus:small", tmp_path / "colon", val_tokens=5)  # the older spelling still works
    assert calls == [("HuggingFaceFW/fineweb-edu", "sample-10BT", "validation", True),
                     ("corpus", None, "train", True), ("someone/corpus", "small", "train", True)]
    _check(gpt2[0], tmp_path / "cli", DOCS)
    capsys.readouterr()
    (tmp_path / "doc.txt").write_text(DOCS[0])
    for args, words in [(["--input", "someone/corpus:small", "--hf-config", "big"], "give it once, with --hf-config"),
                        (["--input", str(tmp_path / "doc.txt"), "--hf-split", "test"],
                         "--hf-split applies to Hugging Face datasets")]:
        assert data.main([*args, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    assert len(calls) == 3


def test_saved_dataset_kind_from_a_listing():
    assert data.saved_dataset_kind(["data-00000-of-00001.arrow", "dataset_info.json", "state.json"]) == "Dataset"
    assert data.saved_dataset_kind(["dataset_dict.json"]) == "DatasetDict"
    assert data.saved_dataset_kind(["state.json", "notes.txt"]) is None
    assert data.saved_dataset_kind([]) is None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """save_to_disk directories: a Dataset of DOCS, a DatasetDict (train: DOCS, validation: reversed), and a
    Dataset without a 'text' column."""
    import datasets

    datasets.disable_progress_bars()
    root = tmp_path_factory.mktemp("saved")
    datasets.Dataset.from_dict({"text": DOCS, "id": [0, 1, 2]}).save_to_disk(str(root / "ds"))
    splits = {"train": datasets.Dataset.from_dict({"text": DOCS}),
              "validation": datasets.Dataset.from_dict({"text": DOCS[::-1]})}
    datasets.DatasetDict(splits).save_to_disk(str(root / "dd"))
    datasets.Dataset.from_dict({"body": DOCS, "id": [0, 1, 2]}).save_to_disk(str(root / "notext"))
    return root


def test_prepare_save_to_disk_directories(gpt2, tmp_path, saved):
    data.prepare(saved / "ds", tmp_path / "ds", val_tokens=5)
    _check(gpt2[0], tmp_path / "ds", DOCS)
    data.prepare(saved / "dd", tmp_path / "dd", val_tokens=5)  # the train split by default
    _check(gpt2[0], tmp_path / "dd", DOCS)
    data.prepare(saved / "dd", tmp_path / "validation", val_tokens=5, hf_split="validation")
    _check(gpt2[0], tmp_path / "validation", DOCS[::-1])
    data.prepare(saved / "dd" / "validation", tmp_path / "one-split", val_tokens=5)  # a split's own directory
    _check(gpt2[0], tmp_path / "one-split", DOCS[::-1])


@pytest.mark.parametrize("source, kwargs, error, words", [
    ("dd", {"hf_split": "test"}, DataError, "no split 'test' in this DatasetDict (splits: train, validation)"),
    ("notext", {}, DataError, "no 'text' column (columns: body, id)"),
    ("ds", {"hf_split": "train"}, UsageError, "is a save_to_disk Dataset, a single split; drop --hf-split"),
    ("dd", {"hf_config": "x"}, UsageError, "is a save_to_disk DatasetDict, which has no configs"),
    ("nested", {}, DataError, "a datasets save_to_disk directory (Dataset) within the input"),
    ("ds/*", {}, DataError, "an Arrow file (datasets' save_to_disk writes these): pass its directory"),
    ("ds/state.json", {}, DataError, "the metadata of the datasets save_to_disk directory"),
])
def test_save_to_disk_mistakes_are_one_line(gpt2, tmp_path, saved, source, kwargs, error, words):
    if source == "nested":  # text files beside a save_to_disk directory: its documents would be left out
        source = tmp_path / "corpus"
        shutil.copytree(saved / "ds", source / "hf")
        (source / "a.txt").write_text(DOCS[0])
    else:
        source = str(saved / source)
    with pytest.raises(error) as e:
        data.prepare(source, tmp_path / "out", val_tokens=5, **kwargs)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_arrow_files_in_a_text_directory_are_skipped(gpt2, tmp_path, saved):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text(DOCS[0])
    shutil.copyfile(next((saved / "ds").glob("*.arrow")), tmp_path / "src" / "stray.arrow")
    data.prepare(tmp_path / "src", tmp_path / "out", val_tokens=3)
    _check(gpt2[0], tmp_path / "out", [DOCS[0]])


# ----------------------------------------------------------------------------------------------------------
# The shards' tokenizer: data.json and check_vocab


def test_check_vocab_against_the_recorded_tokenizer(gpt2, tmp_path):
    (tmp_path / "doc.txt").write_text(DOCS[0] * 30)
    data.prepare(tmp_path / "doc.txt", tmp_path / "gpt2", val_tokens=10)
    shards = str(tmp_path / "gpt2")
    assert data.VOCAB_PAD_MULTIPLE == model.VOCAB_MULTIPLE
    assert data.check_vocab(50257, shards) is None
    assert data.check_vocab(50304, shards) is None  # padded to a multiple of 128, as models pad it
    for vocab in (151_936, 50_305, 50_000):  # Qwen3's; beyond the padding; too small for GPT-2's ids
        problem = data.check_vocab(vocab, shards)
        assert f"({vocab:,} ids)" in problem and "gpt2 tokenizer (50,257 ids" in problem and "\n" not in problem
    # Our own export of a GPT-2-vocabulary model: load_hf gives the unpadded vocabulary (config.json keeps it).
    torch.manual_seed(0)
    config = model.ModelConfig(vocab_size=50257, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, max_seq_len=16)
    export.export_hf(config, model.GPT(config).state_dict(), str(tmp_path / "hf"))
    loaded, _ = export.load_hf(str(tmp_path / "hf"))
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
    (corpus / data.CORPUS_MARKER).write_text(json.dumps({"tokens": 100, "tokenizer": "gpt2"}))
    assert "gpt2 tokenizer (50,257 ids" in data.check_vocab(151_936, str(corpus))
    (broken / data.DATA_RECORD).write_text("{not json")
    assert data.check_vocab(50257, str(broken)).startswith(f"{broken / data.DATA_RECORD}: cannot read")


# ----------------------------------------------------------------------------------------------------------
# Default corpus


def test_stdlib_sources_are_the_library_without_tests():
    files = data.stdlib_sources()
    assert files == data.stdlib_sources() and 300 < len(files) < 3000
    assert all(f.endswith(".py") for f in files)
    parts = {p for f in files for p in f.split(os.sep)}
    assert not parts & {"test", "tests", "idlelib", "site-packages"}
    assert any(f.endswith(os.sep + "os.py") for f in files)


def test_default_corpus_is_built_once_and_rebuilt_when_incomplete(gpt2, tmp_path, monkeypatch):
    small = [f for f in data.stdlib_sources() if 2000 < os.path.getsize(f) < 6000][:6]
    monkeypatch.setattr(data, "stdlib_sources", lambda: small)
    monkeypatch.setattr(data, "CORPUS_VAL_TOKENS", 200)
    monkeypatch.setattr(data, "CORPUS_SHARD_TOKENS", 1000)
    path = data.default_corpus(tmp_path)
    assert os.path.dirname(path) == str(tmp_path) and "gpt2" in os.path.basename(path)
    texts = [open(f, encoding="utf-8").read() for f in small]
    assert _all_tokens(tmp_path / os.path.basename(path)) == _expected(gpt2[0], texts)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt a complete cache")

    with monkeypatch.context() as m:
        m.setattr(data, "_build", no_rebuild)
        assert data.default_corpus(tmp_path) == path
    os.remove(os.path.join(path, data.CORPUS_MARKER))  # as if a build had stopped half way
    open(os.path.join(path, "train_000000.bin"), "wb").close()
    assert data.default_corpus(tmp_path) == path
    assert _all_tokens(tmp_path / os.path.basename(path)) == _expected(gpt2[0], texts)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]  # no temporary directory left
    assert data.data_record(path)["n_vocab"] == 50257 and data.check_vocab(151_936, path) is not None


def test_default_corpus_real_build(gpt2, tmp_path):
    path = data.default_corpus(tmp_path)
    meta = json.load(open(os.path.join(path, data.CORPUS_MARKER)))
    assert meta["tokens"] > 2_000_000 and meta["train_shards"] >= 3 and meta["val_tokens"] == 131_072
    loader = ShardLoader(path, "train", batch_size=2, seq_len=64, prefetch=0)
    x, y = next(loader)
    assert x.shape == (2, 64) and int(x.max()) < 50257


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

    monkeypatch.setattr(loader, "_batch", broken)
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
    ("seq-len", "train_000005.bin"), ("missing", "does not exist"), ("empty", "no train shards"),
    ("corrupt", "train_000002.bin")])
def test_loader_bad_input_is_a_one_line_error(shards, tmp_path, case, words):
    directory, seq_len = shards, T
    if case == "seq-len":
        seq_len = 50  # longer than the 45-token shard
    elif case == "missing":
        directory = tmp_path / "nowhere"
    elif case == "empty":
        directory = tmp_path / "empty"
        directory.mkdir()
    elif case == "corrupt":
        _corrupt(shards / "train_000002.bin", "truncated")
    with pytest.raises(DataError) as e:
        ShardLoader(directory, batch_size=2, seq_len=seq_len)
    assert words in str(e.value) and "\n" not in str(e.value)


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
    assert loader.cropped_fraction is None and loader.stats == {"packing": "bos", "cropped_fraction": None}
    next(loader)
    fraction, rows = loader.stats["cropped_fraction"], 1  # of epoch 0's packing, before epoch 1 repacks
    while loader.epoch == 0:
        next(loader)
        rows += 1
    assert fraction == pytest.approx(1 - rows * (T + 1) / ends[-1]) and 0.05 < fraction < 0.5
    lengths = np.array(LENGTHS)  # windows: only the few tokens at each shard's end that no window reaches
    windows = ShardLoader(shards, batch_size=1, seq_len=T)
    assert windows.cropped_fraction == pytest.approx(((lengths - 1) % T).sum() / lengths.sum())


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
# CLI


def _cli(*args, cwd, env=None):
    return subprocess.run([sys.executable, os.path.join(REPO, "data.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_missing_input_exits_2_with_one_line(tmp_path):
    r = _cli("--input", "missing", "--out", "x", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_cli_help_documents_every_flag(tmp_path):
    r = _cli("--help", cwd=tmp_path)
    assert r.returncode == 0
    for flag in ["--input", "--out", "--tokenizer", "--shard-tokens", "--val-tokens", "auto", "--max-tokens",
                 "--hf-config", "--hf-split", "save_to_disk", "HF_HUB_OFFLINE"]:
        assert flag in r.stdout


def test_cli_writes_shards(gpt2, tmp_path):
    (tmp_path / "doc.txt").write_text(DOCS[0] * 20)
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(gpt2[1]))
    r = _cli("--input", "doc.txt", "--out", "out", "--val-tokens", "7", "--shard-tokens", "100", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    _check(gpt2[0], tmp_path / "out", [DOCS[0] * 20])
