import errno
import glob
import gzip
import hashlib
import json
import os
import platform
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
import tokenizers

import data
import atomic
import prepare
import shards
import sources
import split
from cli import DataError, UsageError
from conftest import WORD_TEXT, split_by_hand, write_word_tokenizer
from data import ShardLoader
from shards import read_shard, write_shard
from tokenizer import TrainingText

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOT = 50256


# ----------------------------------------------------------------------------------------------------------
# prepare()


DOCS = [
    "Hello world.\nIt's a test, isn't it?  Two  spaces.\n",
    "naïve café, ünïcödé: 日本語\n\n    indented\n\tend",
    "x.\n/y  \nz 123\n",
]


def _all_tokens(out_dir):
    """The val split's tokens, then the train shards', in order."""
    shards = [n for n in os.listdir(out_dir) if n.endswith(".bin")]
    names = sorted(shards, key=lambda n: (not n.startswith("val_"), n))  # val first
    assert all(n.startswith("train_") for n in names[1:])
    return np.concatenate([read_shard(out_dir / n) for n in names]).tolist()


def _expected(enc, docs):
    return [t for doc in docs for t in [EOT] + enc.encode_ordinary(doc)]


def _check(enc, out_dir, docs):
    record = json.loads((out_dir / "data.json").read_text())
    assert record["val_from"] == "draws"
    assert _all_tokens(out_dir) == split_by_hand(_expected(enc, docs), record["val_tokens"])


def test_prepare_text_file_in_pieces_equals_whole_file_encoding(gpt2, tmp_path, monkeypatch):
    enc = gpt2[0]
    rng = random.Random(0)
    parts = ["foo", "Bar", ".", "/", " ", "  ", "\n", "\n\n", "'s", "12", "é", "\t", "x\ny", ".\nb", " \nc"]
    text = "".join(rng.choice(parts) for _ in range(3000))
    (tmp_path / "book.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(sources, "TEXT_CHUNK_CHARS", 16)  # many pieces, cut only where encoding is unchanged
    assert len(list(sources._text_pieces(str(tmp_path / "book.txt")))) > 20
    stats = prepare.prepare(tmp_path / "book.txt", tmp_path / "out", shard_tokens=500, val_tokens=100,
                            text_documents="file")
    _check(enc, tmp_path / "out", [text])
    assert stats["documents"] == 1 and stats["val_tokens"] == 100 and stats["train_shards"] > 2
    assert all(len(read_shard(p)) == 500 for p in sorted((tmp_path / "out").glob("train_*"))[:-1])


def test_a_lone_text_file_is_split_at_paragraphs_so_val_is_drawn_across_it(gpt2, tmp_path, monkeypatch, capsys):
    enc = gpt2[0]
    paragraphs = [f"Section {i}: " + " ".join(["topic", str(i % 5)] * (5 + i % 7)) for i in range(300)]
    (tmp_path / "book.txt").write_text("\n\n \n".join(paragraphs) + "\n", encoding="utf-8")
    monkeypatch.setattr(sources, "TEXT_CHUNK_CHARS", 64)  # breaks cut across reads
    stats = prepare.prepare(tmp_path / "book.txt", tmp_path / "out", shard_tokens=5000, val_tokens=600)
    _check(enc, tmp_path / "out", [p + "\n" for p in paragraphs])
    assert (stats["documents"], stats["text_documents"], stats["piece_tokens"]) == (300, "paragraphs", None)
    assert stats["val_documents"] > 5  # drawn from many places, not the file's head
    assert "300 documents (text files cut at blank lines)" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "data.json").read_text())["text_documents"] == "paragraphs"


def test_a_text_file_without_paragraphs_is_cut_into_token_pieces(gpt2, tmp_path, capsys):
    enc = gpt2[0]
    text = "".join(f"line {i} of a file without any blank line\n" for i in range(2000))
    (tmp_path / "log.txt").write_text(text, encoding="utf-8")
    prepare.prepare(tmp_path / "log.txt", tmp_path / "out", val_tokens=2000)
    ids = enc.encode_ordinary(text)
    pieces = [ids[i:i + sources.TEXT_PIECE_TOKENS] for i in range(0, len(ids), sources.TEXT_PIECE_TOKENS)]
    record = json.loads((tmp_path / "out" / "data.json").read_text())
    expected = split_by_hand([t for piece in pieces for t in [enc.eot_token, *piece]], record["val_tokens"])
    assert _all_tokens(tmp_path / "out") == expected  # the file's own tokens, a separator every 1,024
    assert (record["text_documents"], record["piece_tokens"], record["documents"]) == ("tokens", 1024, len(pieces))
    assert "(cut into pieces of at most 1,024 tokens)" in capsys.readouterr().out


def test_one_document_says_val_is_its_head(gpt2, tmp_path, capsys):
    (tmp_path / "book.txt").write_text(DOCS[0] * 50 + "\n\n" + DOCS[1] * 50)
    stats = prepare.prepare(tmp_path / "book.txt", tmp_path / "out", val_tokens=10, text_documents="file")
    assert stats["documents"] == 1 and stats["text_documents"] == "file"
    line = capsys.readouterr().out
    assert "val: 10 tokens in the corpus's only document, its first tokens (--val-tokens 10); " \
           "--text-documents paragraphs or a token count lets val be drawn across it" in line


def test_text_documents_of_a_directory_stay_whole_files(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("one\n\ntwo\n")
    assert sources.text_documents(tmp_path / "src", "auto") == ("file", None)
    assert sources.text_documents(tmp_path / "src" / "a.txt", "auto") == ("paragraphs", None)
    assert sources.text_documents(tmp_path / "src" / "a.txt", 64) == ("tokens", 64)


@pytest.mark.parametrize("argv, message", [
    (["--text-documents", "0"], "error: --text-documents 0: a piece needs at least 1 token"),
    (["--text-documents", "some"], "argument --text-documents: must be auto, paragraphs, file or a token count"),
    (["--text-documents", "64", "--train-tokenizer", "300"], "error: --text-documents 64: --train-tokenizer needs "
                                                            "documents it can tell apart before tokenizing")])
def test_text_documents_refusals(tmp_path, capsys, argv, message):
    (tmp_path / "a.txt").write_text(DOCS[0])
    assert prepare.main(["--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_prepare_directory_recursive_and_glob(gpt2, tmp_path):
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    (src / "a.txt").write_text(DOCS[0])
    (src / "b" / "c.md").write_text(DOCS[1])
    (src / "b" / "d.txt").write_text(DOCS[2])
    (src / "image.bin").write_bytes(b"\x89PNG\0\0binary")  # not text: skipped
    (src / ".hidden.txt").write_text("skipped")
    prepare.prepare(src, tmp_path / "dir", val_tokens=3)
    _check(gpt2[0], tmp_path / "dir", DOCS)
    prepare.prepare(str(src / "**" / "*.txt"), tmp_path / "glob", val_tokens=3)
    _check(gpt2[0], tmp_path / "glob", [DOCS[0], DOCS[2]])


def test_prepare_jsonl_and_parquet(gpt2, tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    pq.write_table(pa.table({"text": DOCS, "id": [0, 1, 2]}), tmp_path / "docs.parquet")
    prepare.prepare(tmp_path / "docs.jsonl", tmp_path / "jsonl", val_tokens=5)
    prepare.prepare(tmp_path / "docs.parquet", tmp_path / "parquet", val_tokens=5)
    _check(gpt2[0], tmp_path / "jsonl", DOCS)
    _check(gpt2[0], tmp_path / "parquet", DOCS)


def test_prepare_hugging_face_dataset_streams_the_train_split(gpt2, tmp_path, monkeypatch):
    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter({"text": d} for d in DOCS)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    prepare.prepare("someone/corpus:small", tmp_path / "hf", val_tokens=5)
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
        prepare.prepare(source, out, val_tokens=10_000 if case == "too-few-tokens" else 1)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_invalid_utf8_is_replaced_with_one_warning_per_file(gpt2, tmp_path, monkeypatch, capsys):
    # Four invalid sequences (the last a character cut short), and one U+FFFD that is really in the file.
    raw = b"caf\xe9 ok\n" + "\ufffd is fine\n".encode() + b"\xff\xfe end \xe2\x82\n"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_bytes(raw * 3)
    (tmp_path / "src" / "b.txt").write_text(DOCS[0])
    monkeypatch.setattr(sources, "TEXT_CHUNK_CHARS", 8)  # counted across many pieces
    prepare.prepare(tmp_path / "src", tmp_path / "out", val_tokens=1)
    _check(gpt2[0], tmp_path / "out", [(raw * 3).decode(errors="replace"), DOCS[0]])
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"warning: {tmp_path / 'src' / 'a.txt'}: 12 invalid UTF-8 sequences replaced with U+FFFD, "
                        "the first at line 1"]
    assert sources._first_invalid_line(str(tmp_path / "src" / "b.txt")) is None
    (tmp_path / "late.txt").write_bytes("é\n".encode() * 5 + b"ok \xe2\x82")  # a character cut short at the end
    assert all(sources._first_invalid_line(str(tmp_path / "late.txt"), block) == 6 for block in (1, 2, 3, 64))


def _reference_shards(enc, docs, shard_tokens, val_tokens):
    """The shard files prepare must write, made the plain way: encode_ordinary per document, the EOT token
    before each non-empty one, val_tokens tokens of the documents split.py draws to val, the rest in train shards
    of shard_tokens."""
    stream = [t for doc in docs if doc for t in [EOT] + enc.encode_ordinary(doc)]
    tokens = np.array(split_by_hand(stream, val_tokens), dtype="<u2")
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
    monkeypatch.setattr(sources, "TEXT_CHUNK_CHARS", 64)  # the book in many pieces
    if batch_chars:
        monkeypatch.setattr(prepare, "ENCODE_BATCH_CHARS", batch_chars)
        monkeypatch.setattr(prepare, "ENCODE_CHARS_PER_THREAD", chars_in_flight)
    prepare.prepare(tmp_path / "src", tmp_path / "out", shard_tokens=997, val_tokens=300)
    written = {p.name: p.read_bytes() for p in (tmp_path / "out").glob("*.bin")}
    expected = _reference_shards(gpt2[0], docs + [book], shard_tokens=997, val_tokens=300)
    assert len(expected) > 5 and written == expected


@pytest.mark.parametrize("failing", ["reader", "writer"])
def test_prepare_error_midway_leaves_no_thread_running(gpt2, tmp_path, monkeypatch, failing):
    # default_corpus deletes its directory after an error: nothing may still be encoding or writing into it.
    lines = [json.dumps({"text": DOCS[0] * 5})] * 200 + ['{"body": "no text"}']
    (tmp_path / "doc.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(prepare, "ENCODE_BATCH_CHARS", 100)
    monkeypatch.setattr(prepare, "ENCODE_CHARS_PER_THREAD", 200)
    monkeypatch.setattr(split, "HOLD_TOKENS", 50)  # train shards written as the stream goes
    written, real_write_shard = [], prepare.write_shard

    def write_shard(path, tokens, vocab_size):
        if failing == "writer" and len(written) == 10:
            raise DataError("disk full")
        written.append(path)
        real_write_shard(path, tokens, vocab_size)

    monkeypatch.setattr(prepare, "write_shard", write_shard)
    with pytest.raises(DataError, match="doc.jsonl:201" if failing == "reader" else "disk full"):
        prepare.prepare(tmp_path / "doc.jsonl", tmp_path / "out", shard_tokens=100, val_tokens=10)
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
    real_write_shard = prepare.write_shard

    def write_shard(path, tokens, vocab_size):  # runs in the writer thread; the signal reaches the main one
        if path.endswith("train_000003.bin"):
            os.kill(os.getpid(), getattr(signal, stop))
        real_write_shard(path, tokens, vocab_size)

    def escaped(*args):  # a signal that prepare.main leaves unhandled fails this test, not the whole session
        raise AssertionError("the signal escaped prepare.main")

    monkeypatch.setattr(prepare, "write_shard", write_shard)
    previous = signal.signal(signal.SIGTERM, escaped)
    try:
        code = prepare.main(args)
    except KeyboardInterrupt:
        code = "KeyboardInterrupt"
    finally:
        handler = signal.signal(signal.SIGTERM, previous)
    assert code == 128 + getattr(signal, stop) and handler == escaped  # prepare.main's own handler is gone
    assert capsys.readouterr().err.splitlines()[-1:] == [
        f"{'interrupted' if stop == 'SIGINT' else 'terminated'}; nothing written to {tmp_path / 'out'}"]
    assert os.listdir(tmp_path) == ["docs.jsonl"]
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("tokenizer", "shard-writer"))]

    monkeypatch.setattr(prepare, "write_shard", real_write_shard)
    for pid in (1, 99999999):
        (tmp_path / f"out.partial-{pid}").mkdir()
        write_shard(str(tmp_path / f"out.partial-{pid}" / "train_000000.bin"), np.arange(10), 50257)
    held = atomic.lock_directory(str(tmp_path / "out.partial-1"))  # as a running preparation holds its own
    (tmp_path / "out").mkdir()  # an empty --out is taken too
    try:
        assert prepare.main(args) == 0
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
        prepare.prepare(source, out, val_tokens=1)
    assert str(e.value).startswith(words) and "\n" not in str(e.value)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing written or lost
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat("/dev").st_dev,
                    reason="needs /dev/shm mounted apart from /dev")
def test_an_out_that_is_a_mount_point_is_refused_before_anything_is_read(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    with pytest.raises(UsageError, match="--out /dev/shm is a mount point"):
        prepare.prepare(str(tmp_path / "a.txt"), "/dev/shm", val_tokens=1)


def test_a_finished_preparation_that_cannot_be_moved_into_place_is_kept(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text(DOCS[0])

    def busy(src, dst):
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))

    monkeypatch.setattr(prepare.os, "rename", busy)
    with pytest.raises(DataError, match="they are complete in") as e:
        prepare.prepare(str(tmp_path / "a.txt"), str(tmp_path / "out"), val_tokens=1)
    kept = str(e.value).split("they are complete in ")[1].split(":")[0]
    assert sorted(os.listdir(kept)) == ["data.json", "train_000000.bin", "val_000000.bin"]


@pytest.mark.parametrize("flags, message", [
    (["--shard-tokens", "0"], "--shard-tokens must be in [1, 2,147,483,648), got 0"),
    (["--shard-tokens", "2147483648"], "--shard-tokens must be in [1, 2,147,483,648)"),
    (["--val-tokens", "-1"], "--val-tokens must be auto or in [0, 2**31), got -1")])
def test_cli_size_errors_name_the_flag(tmp_path, capsys, flags, message):
    assert prepare.main(["--input", "missing", "--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


# ----------------------------------------------------------------------------------------------------------
# --val-tokens auto and --max-tokens


def _corpus(tmp_path, n_docs, seed=0) -> list[str]:
    """n_docs documents of 50 to 400 words (about a token each) in tmp_path/docs.jsonl."""
    rng = random.Random(seed)
    words = ["the", " cat", " sat", ".", "\n", " on", " 42", " mat", ",", " é", " Über"]
    docs = ["".join(rng.choice(words) for _ in range(rng.randrange(50, 400))) for _ in range(n_docs)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def test_prepare_with_default_args_draws_the_val_documents_of_a_small_corpus(gpt2, tmp_path, capsys):
    docs = _corpus(tmp_path, 220)
    stats = prepare.prepare(tmp_path / "docs.jsonl", tmp_path / "out")  # under 1M tokens: refused before auto
    expected = _expected(gpt2[0], docs)
    assert 40_000 < len(expected) < 60_000
    assert stats["val_tokens"] == split.default_val_tokens(len(expected)) == split.MIN_VAL_TOKENS
    assert _all_tokens(tmp_path / "out") == split_by_hand(expected, split.MIN_VAL_TOKENS)
    val = read_shard(tmp_path / "out" / "val_000000.bin")
    assert val[0] == EOT and 60 < stats["val_documents"] == np.count_nonzero(val == EOT) < 110  # not the first ones
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("data: 220 documents") and line.endswith(
        f"val: 16,385 tokens in {stats['val_documents']} documents chosen by a hash of their position (the least: "
        f"one eval batch of 16 x 1,024, plus 1; {16_385 / len(expected):.1%} of the corpus, --val-tokens auto)")
    record = json.loads((tmp_path / "out" / shards.DATA_RECORD).read_text())
    assert {k: record[k] for k in ("tokenizer", "n_vocab", "eot", "documents", "tokens", "val_tokens",
                                   "train_tokens", "val_from", "val_draws")} == {
        "tokenizer": "gpt2", "n_vocab": 50257, "eot": EOT, "documents": 220, "tokens": len(expected),
        "val_tokens": 16_385, "train_tokens": len(expected) - 16_385, "val_from": "draws", "val_draws": 64}


def test_past_the_hold_val_takes_draw_0_and_train_shards_are_written_as_the_stream_goes(gpt2, tmp_path, monkeypatch,
                                                                                        capsys):
    """Bounds made small so that a small corpus meets each rule: 0.5%, then the cap. Past the hold only draw 0's
    documents wait in memory (at most the cap); what val leaves of them ends the last train shard."""
    docs = _corpus(tmp_path, 400)
    stream = np.array(_expected(gpt2[0], docs))
    draw_0 = np.flatnonzero(split.draws(np.cumsum(stream == EOT) - 1) == 0)
    monkeypatch.setattr(split, "HOLD_TOKENS", 500)
    monkeypatch.setattr(split, "MIN_VAL_TOKENS", 10)
    for cap, out in [(1000, "share"), (300, "cap")]:
        monkeypatch.setattr(split, "MAX_VAL_TOKENS", cap)
        stats = prepare.prepare(tmp_path / "docs.jsonl", tmp_path / out, shard_tokens=997)
        val = min(cap, len(stream) * 5 // 1000)
        assert stats["val_tokens"] == val and (val == 300) == (out == "cap")
        taken = draw_0[:cap]
        train = np.concatenate([np.delete(stream, taken), stream[taken[val:]]])
        assert _all_tokens(tmp_path / out) == stream[taken[:val]].tolist() + train.tolist()
        sizes = [len(read_shard(p)) for p in sorted((tmp_path / out).glob("train_*"))]
        assert len(sizes) > 5 and set(sizes[:-1]) == {997} and 0 < sizes[-1] <= 997
        reason = "0.5% of the corpus" if out == "share" else f"the cap; {300 / len(stream):.2%} of the corpus"
        assert capsys.readouterr().out.strip().endswith(f"({reason}, --val-tokens auto)")
    with pytest.raises(DataError, match=r"past its first 500 tokens the val split takes 1 in 64 documents, chosen by "
                                        r"a hash of their position, and those hold only [\d,]+ tokens; give "
                                        r"--val-tokens [\d,]+ or less"):
        prepare.prepare(tmp_path / "docs.jsonl", tmp_path / "explicit", val_tokens=len(draw_0) + 1)
    assert not (tmp_path / "explicit").exists()


def test_the_summary_line_counts_in_the_singular_and_plural():
    stats = {"documents": 1, "tokens": 1200, "train_tokens": 1000, "train_shards": 1, "val_tokens": 200,
             "seconds": 0.5, "val_from": "draws", "val_documents": 1, "text_documents": "file", "piece_tokens": None}
    assert prepare._summary(stats, 200, None) == (
        "data: 1 document, 1,200 tokens (1,000 train in 1 shard) in 0.5s (0.00M tok/s); val: 200 tokens in the "
        "corpus's only document, its first tokens (--val-tokens 200); --text-documents paragraphs or a token "
        "count lets val be drawn across it")
    line = prepare._summary({**stats, "documents": 2, "train_shards": 3, "val_tokens": 1}, 1, None)
    assert "data: 2 documents," in line and "in 3 shards)" in line
    assert "val: 1 token in 1 document chosen" in line
    assert prepare._summary({**stats, "val_tokens": 0}, 0, None).endswith("val: none (--val-tokens 0)")


def test_auto_val_refuses_a_corpus_too_small_to_leave_train_tokens(gpt2, tmp_path):
    (tmp_path / "doc.txt").write_text(DOCS[0] * 100)
    with pytest.raises(DataError) as e:
        prepare.prepare(tmp_path / "doc.txt", tmp_path / "out")
    assert "--val-tokens auto keeps at least 16,385 for val" in str(e.value) and "\n" not in str(e.value)
    assert not list((tmp_path / "out").glob("*.bin"))


def test_max_tokens_cuts_at_the_exact_count(gpt2, tmp_path, monkeypatch, capsys):
    docs = _corpus(tmp_path, 60)
    expected = _expected(gpt2[0], docs)[:5000]
    stats = prepare.prepare(tmp_path / "docs.jsonl", tmp_path / "explicit", shard_tokens=997, val_tokens=100,
                            max_tokens=5000)
    assert _all_tokens(tmp_path / "explicit") == split_by_hand(expected, 100)
    assert stats["tokens"] == 5000 and stats["val_tokens"] == 100 and stats["documents"] == expected.count(EOT)
    captured = capsys.readouterr()
    assert "5,000/5,000 tok" in captured.err  # the progress knows the total: a count out of it, and an ETA
    assert ", cut at --max-tokens 5,000; val: 100 tokens" in captured.out
    monkeypatch.setattr(split, "MIN_VAL_TOKENS", 10)
    stats = prepare.prepare(tmp_path / "docs.jsonl", tmp_path / "auto", shard_tokens=997, max_tokens=5000)
    assert _all_tokens(tmp_path / "auto") == split_by_hand(expected, 25) and stats["val_tokens"] == 25  # 0.5%
    prepare.prepare(tmp_path / "docs.jsonl", tmp_path / "all", val_tokens=100, max_tokens=10**9)
    assert "all of it (fewer than --max-tokens 1,000,000,000)" in capsys.readouterr().out


def test_auto_val_is_the_same_documents_under_any_max_tokens(gpt2, tmp_path, monkeypatch):
    """The rule scaled down (at least 10, at most 40: saturated from 8,000 tokens on). Document 6 is the first of
    draw 0, in the first 3,000 tokens: a smaller cap's val split is a prefix of a larger cap's, and every cap from
    saturation on gives the identical val shard, whether it is chosen in memory or while streaming."""
    expected = _expected(gpt2[0], _corpus(tmp_path, 60))
    assert len(expected) > 12_000 and split.draw_of(6) == 0 and min(split.draws(np.arange(6))) > 0
    monkeypatch.setattr(split, "MIN_VAL_TOKENS", 10)
    monkeypatch.setattr(split, "MAX_VAL_TOKENS", 40)
    vals = {}
    for cap, hold in [(3000, None), (9000, None), (12_000, None), (None, None), (None, 500), (9000, 2000)]:
        if hold:
            monkeypatch.setattr(split, "HOLD_TOKENS", hold)
        out = tmp_path / f"{cap}-{hold}"
        prepare.prepare(tmp_path / "docs.jsonl", out, shard_tokens=997, max_tokens=cap)
        vals[cap, hold] = (out / "val_000000.bin").read_bytes()
    sixth = expected.index(EOT, [i for i, t in enumerate(expected) if t == EOT][6])
    assert read_shard(tmp_path / "3000-None" / "val_000000.bin").tolist() == expected[sixth:sixth + 15]  # 0.5%
    assert len({vals[key] for key in vals if key[0] != 3000}) == 1  # at or past saturation: 40 tokens
    assert read_shard(tmp_path / "None-None" / "val_000000.bin").tolist() == expected[sixth:sixth + 40]


def test_max_tokens_that_leave_no_train_tokens_are_refused(gpt2, tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOCS[0])
    for kwargs, words in [({"val_tokens": 100, "max_tokens": 100}, "(100 tokens)"),
                          ({"max_tokens": 16_385}, "(16,385 tokens, the least of --val-tokens auto)")]:
        with pytest.raises(ValueError, match="leaves no train tokens after the val split " + re.escape(words)):
            prepare.prepare(tmp_path / "doc.txt", tmp_path / "out", **kwargs)
    for max_tokens, said in ("100", "--max-tokens 100 leaves no train tokens"), ("0", "--max-tokens must be >= 1"):
        assert prepare.main(["--input", str(tmp_path / "doc.txt"), "--out", str(tmp_path / "out"),
                             "--max-tokens", max_tokens]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {said}") and err.count("\n") == 1


# ----------------------------------------------------------------------------------------------------------
# Hugging Face datasets: the hub (--hf-config, --hf-split) and save_to_disk directories


def test_hf_config_and_split_reach_load_dataset(gpt2, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter({"text": d} for d in DOCS)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert prepare.main(["--input", "HuggingFaceFW/fineweb-edu", "--hf-config", "sample-10BT", "--hf-split",
                      "validation", "--out", str(tmp_path / "cli"), "--val-tokens", "5"]) == 0
    prepare.prepare("hf:corpus", tmp_path / "plain", val_tokens=5)
    prepare.prepare("someone/corpus:small", tmp_path / "colon", val_tokens=5)  # the older spelling still works
    assert calls == [("HuggingFaceFW/fineweb-edu", "sample-10BT", "validation", True),
                     ("corpus", None, "train", True), ("someone/corpus", "small", "train", True)]
    _check(gpt2[0], tmp_path / "cli", DOCS)
    capsys.readouterr()
    (tmp_path / "doc.txt").write_text(DOCS[0])
    for args, words in [(["--input", "someone/corpus:small", "--hf-config", "big"], "give it once, with --hf-config"),
                        (["--input", str(tmp_path / "doc.txt"), "--hf-split", "test"],
                         "--hf-split applies to Hugging Face datasets")]:
        assert prepare.main([*args, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    assert len(calls) == 3


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
    prepare.prepare(saved / "ds", tmp_path / "ds", val_tokens=5)
    _check(gpt2[0], tmp_path / "ds", DOCS)
    prepare.prepare(saved / "dd", tmp_path / "dd", val_tokens=5)  # the train split by default
    _check(gpt2[0], tmp_path / "dd", DOCS)
    prepare.prepare(saved / "dd", tmp_path / "validation", val_tokens=5, hf_split="validation")
    _check(gpt2[0], tmp_path / "validation", DOCS[::-1])
    prepare.prepare(saved / "dd" / "validation", tmp_path / "one-split", val_tokens=5)  # a split's own directory
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
        prepare.prepare(source, tmp_path / "out", val_tokens=5, **kwargs)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_arrow_files_in_a_text_directory_are_skipped(gpt2, tmp_path, saved):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text(DOCS[0])
    shutil.copyfile(next((saved / "ds").glob("*.arrow")), tmp_path / "src" / "stray.arrow")
    prepare.prepare(tmp_path / "src", tmp_path / "out", val_tokens=3)
    _check(gpt2[0], tmp_path / "out", [DOCS[0]])


# ----------------------------------------------------------------------------------------------------------
# Default corpus


def test_stdlib_sources_are_the_library_without_tests():
    files = sources.stdlib_sources()
    assert files == sources.stdlib_sources() and 300 < len(files) < 3000
    assert all(f.endswith(".py") for f in files)
    parts = {p for f in files for p in f.split(os.sep)}
    assert not parts & {"test", "tests", "idlelib", "site-packages"}
    assert any(f.endswith(os.sep + "os.py") for f in files)


def test_default_corpus_is_built_once_and_rebuilt_when_incomplete(gpt2, tmp_path, monkeypatch, capsys):
    small = [f for f in sources.stdlib_sources() if 2000 < os.path.getsize(f) < 6000][:6]
    monkeypatch.setattr(sources, "stdlib_sources", lambda: small)
    monkeypatch.setattr(prepare, "CORPUS_VAL_TOKENS", 200)
    monkeypatch.setattr(prepare, "CORPUS_SHARD_TOKENS", 1000)
    path = prepare.default_corpus(tmp_path)
    # No --val-tokens was given: the line names the rule that chose the size.
    assert capsys.readouterr().out.strip().endswith("by a hash of their position (the default corpus's fixed val size)")
    assert os.path.dirname(path) == str(tmp_path) and "gpt2" in os.path.basename(path)
    texts = [open(f, encoding="utf-8").read() for f in small]
    assert _all_tokens(tmp_path / os.path.basename(path)) == split_by_hand(_expected(gpt2[0], texts), 200)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt a complete cache")

    with monkeypatch.context() as m:
        m.setattr(prepare, "_build", no_rebuild)
        assert prepare.default_corpus(tmp_path) == path
    os.remove(os.path.join(path, shards.CORPUS_MARKER))  # as if a build had stopped half way
    open(os.path.join(path, "train_000000.bin"), "wb").close()
    assert prepare.default_corpus(tmp_path) == path
    assert _all_tokens(tmp_path / os.path.basename(path)) == split_by_hand(_expected(gpt2[0], texts), 200)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]  # no temporary directory left
    assert shards.data_record(path)["n_vocab"] == 50257 and data.check_vocab(151_936, path) is not None


@pytest.fixture(scope="module")
def stdlib_corpus(gpt2, tmp_path_factory):
    """The default corpus, really built, into a cache of its own."""
    return prepare.default_corpus(tmp_path_factory.mktemp("cache"))


def test_default_corpus_real_build(stdlib_corpus):
    path = stdlib_corpus
    meta = json.load(open(os.path.join(path, shards.CORPUS_MARKER)))
    assert meta["tokens"] > 2_000_000 and meta["train_shards"] >= 3 and meta["val_tokens"] == 131_072
    loader = ShardLoader(path, "train", batch_size=2, seq_len=64, prefetch=0)
    x, y = next(loader)
    assert x.shape == (2, 64) and int(x.max()) < 50257


# The sha256 of the default corpus's shards (each name, then its bytes, in name order) per Python version, as
# the corpus is that version's standard library.
STDLIB_CORPUS_SHA256 = {"3.11.7": "fc29cb09cf62038e4b3a8b3e85412917edd368ddf79cb7dd1abdc466489efb85"}


def test_default_corpus_shards_are_pinned(stdlib_corpus):
    if platform.python_version() not in STDLIB_CORPUS_SHA256:
        pytest.skip(f"no digest recorded for Python {platform.python_version()}'s standard library")
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(stdlib_corpus, "*.bin"))):
        digest.update(os.path.basename(path).encode())
        digest.update(open(path, "rb").read())
    assert digest.hexdigest() == STDLIB_CORPUS_SHA256[platform.python_version()]


# ----------------------------------------------------------------------------------------------------------
# CLI


def _cli(*args, cwd, env=None):
    return subprocess.run([sys.executable, os.path.join(REPO, "prepare.py"), *args], cwd=cwd, env=env,
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


# ----------------------------------------------------------------------------------------------------------
# Tokenizers beyond tiktoken; --text-field and --overwrite

# The digest of the shards below: the tokens as the tiktoken-only preparation wrote them (commit 6872e05), in
# the val split that split.py draws.
GPT2_SHARDS_SHA256 = "ab36bd1fdf1bef77e9b91f46c7b6cab5742d05f0977eb72d643639be1692d38d"


def test_gpt2_shards_are_byte_identical_to_before(gpt2, tmp_path):
    docs = [DOCS[0], DOCS[1] + " <|endoftext|> \ud800 x", DOCS[2]] * 3  # a document's own end-of-text, a surrogate
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare.prepare(tmp_path / "docs.jsonl", tmp_path / "out", shard_tokens=40, val_tokens=25)
    digest = hashlib.sha256()
    for path in sorted((tmp_path / "out").glob("*.bin")):
        digest.update(path.read_bytes())
    assert digest.hexdigest() == GPT2_SHARDS_SHA256


def test_prepare_with_a_tokenizer_json_of_over_65535_ids(word_tokenizer, tmp_path):
    docs = [WORD_TEXT, "a dog sat <|endoftext|>", "the park , the mat"]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    record = prepare.prepare(tmp_path / "docs.jsonl", out, word_tokenizer, val_tokens=5)
    own = tokenizers.Tokenizer.from_file(word_tokenizer)
    own.encode_special_tokens = True  # a document's "<|endoftext|>" is its text
    assert _all_tokens(out) == split_by_hand([t for doc in docs for t in [70_000, *own.encode(doc).ids]], 5, 70_000)
    assert all(read_shard(p).dtype == np.uint32 for p in out.glob("*.bin"))
    assert {k: record[k] for k in ("tokenizer", "n_vocab", "eot", "doc_separator", "uint32", "tokenizer_file")} == {
        "tokenizer": word_tokenizer, "n_vocab": 70_001, "eot": 70_000, "doc_separator": "<|endoftext|>",
        "uint32": True, "tokenizer_file": "tokenizer.json"}
    assert json.loads((out / "data.json").read_text()) == record
    assert (out / "tokenizer.json").read_bytes() == open(word_tokenizer, "rb").read()
    assert data.data_tokenizer(str(out)).sha256 == record["tokenizer_sha256"]


def test_an_empty_tokenizer_or_one_without_tokenizer_files_is_one_line(gpt2, tmp_path, capsys):
    """--tokenizer "" (an unset shell variable, say) is refused, not taken as gpt2; a directory without tokenizer
    files is said to hold none. Each followed as advised prepares: the flag left out, a tokenizer.json put there."""
    (tmp_path / "doc.txt").write_text(WORD_TEXT)
    (tmp_path / "tok").mkdir()
    out = tmp_path / "out"
    args = ["--input", str(tmp_path / "doc.txt"), "--out", str(out), "--val-tokens", "3"]
    assert prepare.main([*args, "--tokenizer", ""]) == 2
    assert capsys.readouterr().err == ("error: argument --tokenizer: is empty: name a tokenizer, or leave the flag "
                                       "out for the default\n")
    assert not out.exists()
    assert prepare.main(args) == 0 and shards.data_record(str(out))["tokenizer"] == "gpt2"
    assert prepare.main([*args, "--overwrite", "--tokenizer", str(tmp_path / "tok")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --tokenizer {tmp_path / 'tok'}: the directory holds no "
                                                   "tokenizer files (no tokenizer.json, "), err
    write_word_tokenizer(tmp_path / "tok" / "tokenizer.json", WORD_TEXT.split(), size=100)
    assert prepare.main([*args, "--overwrite", "--tokenizer", str(tmp_path / "tok")]) == 0
    assert shards.data_record(str(out))["n_vocab"] == 101


def test_prepare_cli_tokenizer_mistakes_are_one_line(tmp_path, capsys):
    no_separator = write_word_tokenizer(tmp_path / "words.json", WORD_TEXT.split(), size=100, separator="[SEP]")
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    (tmp_path / "doc.txt").write_text(WORD_TEXT)
    args = ["--input", str(tmp_path / "doc.txt"), "--out", str(tmp_path / "out"), "--val-tokens", "3", "--tokenizer"]
    for tokenizer, words in [(no_separator, "name the token that separates documents with --doc-separator TOKEN"),
                             (str(tmp_path / "bad.json"), "bad.json: not a tokenizer.json")]:
        assert prepare.main([*args, tokenizer]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and words in err
        assert not (tmp_path / "out").exists()
    assert prepare.main([*args, no_separator, "--doc-separator", "[SEP]"]) == 0
    assert shards.data_record(str(tmp_path / "out"))["doc_separator"] == "[SEP]"
    assert _all_tokens(tmp_path / "out")[0] == 100  # its id


def _word_docs(n_docs: int, n_words: int, seed: int = 0) -> list[str]:
    words = ["the", "cat", "sat", "naïve", "日本語", "return", "x = 1", "\n\n    ", "parks", "dog", "ran", "."]
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(n_words)) for _ in range(n_docs)]


def test_train_tokenizer_prepares_shards_with_its_own_ids(tmp_path):
    docs = _word_docs(8, 200)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    record = prepare.prepare(tmp_path / "docs.jsonl", out, val_tokens=20, train_tokenizer=300)
    own = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    own.encode_special_tokens = True
    assert _all_tokens(out) == split_by_hand([t for doc in docs for t in [299, *own.encode(doc).ids]], 20, 299)
    assert {k: record[k] for k in ("tokenizer", "n_vocab", "eot", "doc_separator", "uint32", "tokenizer_file")} == {
        "tokenizer": "trained:300", "n_vocab": 300, "eot": 299, "doc_separator": "<|endoftext|>", "uint32": False,
        "tokenizer_file": "tokenizer.json"}
    assert json.loads((out / "data.json").read_text()) == record
    loaded = data.data_tokenizer(str(out))  # what train.py, sample.py and val_bpb load
    assert loaded.sha256 == record["tokenizer_sha256"] and loaded.byte_level
    assert loaded.encode(docs[3]) == own.encode(docs[3]).ids
    # the same input trains the same tokenizer, which --overwrite puts in place of the earlier one
    before = (out / "tokenizer.json").read_bytes()
    args = ["--input", str(tmp_path / "docs.jsonl"), "--out", str(out), "--val-tokens", "20"]
    assert prepare.main([*args, "--train-tokenizer", "300", "--overwrite"]) == 0
    assert (out / "tokenizer.json").read_bytes() == before and shards.data_record(str(out)) == {
        **record, "seconds": shards.data_record(str(out))["seconds"]}


def test_train_tokenizer_holds_the_val_splits_documents_out(tmp_path, monkeypatch):
    """The documents the val split can take (of at most TRAINED_TOKEN_BYTES per val token) are not trained on."""
    val_tokens = 30
    docs = _word_docs(40, 30, seed=1)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    trained_on = []
    train_bpe = prepare.train_bpe

    def spy(texts, *args):
        trained_on.extend(texts)
        return train_bpe(trained_on, *args)

    monkeypatch.setattr(prepare, "train_bpe", spy)
    prepare.prepare(tmp_path / "docs.jsonl", tmp_path / "out", val_tokens=val_tokens, train_tokenizer=300)
    draws, last = split.val_held_out([(d, True) for d in docs], val_tokens, None, prepare.TRAINED_TOKEN_BYTES)
    size = [len(d.encode()) for d in docs]  # ASCII and whole characters: cut here at a character's boundary
    whole = sum(size[p] for p in range(len(docs)) if split.draw_of(p) < draws - 1)
    assert whole + last == val_tokens * 16 < whole + sum(size[p] for p in range(len(docs)) if split.draw_of(p) == draws - 1)
    expected, left = [], last  # draw draws - 1's documents, in order, lose their first `last` bytes between them
    for p, d in enumerate(docs):
        if split.draw_of(p) == draws - 1 and left > 0:
            d, left = d.encode()[left:].decode(), left - size[p]
        if split.draw_of(p) >= draws - 1 and d:
            expected.append(d)
    assert trained_on == expected and len(expected) < len(docs)
    enc = data.data_tokenizer(str(tmp_path / "out"))
    val = enc.decode(read_shard(tmp_path / "out" / "val_000000.bin").tolist())
    assert val.startswith("<|endoftext|>" + docs[min(range(len(docs)), key=split.draw_of)][:10])  # the least draw

    text = TrainingText(iter(["héllo", "", "wörld", "abc"]), max_chars=7)
    assert list(text) == ["héllo", "wö"] and (text.chars, text.capped) == (7, True)
    text = TrainingText(["héllo", "wörld", "abc"], max_chars=100)
    assert list(text) == ["héllo", "wörld", "abc"] and (text.chars, text.capped) == (13, False)


def test_train_tokenizer_mistakes_are_one_line_and_leave_out_alone(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(" ".join(_word_docs(1, 300)))
    args = ["--input", str(tmp_path / "doc.txt"), "--out", str(tmp_path / "out")]
    for flags, words in [(["--train-tokenizer", "256"], "--train-tokenizer must be in [257, 1,048,576]"),
                         (["--train-tokenizer", str(2**40)], "--train-tokenizer must be in [257, 1,048,576]"),
                         (["--train-tokenizer", "300", "--tokenizer", "gpt2"], "not allowed with argument"),
                         (["--train-tokenizer", "300", "--doc-separator", "EOS"], "'EOS' could be a token of text"),
                         (["--val-tokens", "1000000", "--train-tokenizer", "300", "--overwrite"],
                          "held out for the val split")]:
        if flags[-1] == "--overwrite":  # fails after the earlier preparation was checked: it stays whole
            assert prepare.main([*args, "--val-tokens", "5", "--train-tokenizer", "257"]) == 0
            capsys.readouterr()
            before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
        assert prepare.main([*args, *flags]) == 2
        err = capsys.readouterr().err.splitlines()
        assert err[-1].startswith("error: ") and words in err[-1]
        assert len(err) == (2 if flags[-1] in ("--overwrite", "EOS") else 1)  # after the training's first line
        assert (tmp_path / "out").exists() == (flags[-1] == "--overwrite")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


def test_text_field_names_the_field_of_jsonl_and_parquet(gpt2, tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": d, "text": 1}) + "\n" for d in DOCS))
    pq.write_table(pa.table({"body": DOCS}), tmp_path / "docs.parquet")
    for name in ("docs.jsonl", "docs.parquet"):
        prepare.prepare(tmp_path / name, tmp_path / name.replace(".", "_"), val_tokens=5, text_field="body")
        _check(gpt2[0], tmp_path / name.replace(".", "_"), DOCS)
    with pytest.raises(DataError, match=r"no 'text' column \(columns: \['body'\]\); --text-field names another"):
        prepare.prepare(tmp_path / "docs.parquet", tmp_path / "default", val_tokens=5)
    with pytest.raises(DataError, match=r"docs.jsonl:1: record has no string 'text' field$"):  # there, not a str
        prepare.prepare(tmp_path / "docs.jsonl", tmp_path / "swapped", val_tokens=5, text_field="text")


def test_overwrite_replaces_a_preparation_only_once_the_new_one_is_whole(gpt2, tmp_path, monkeypatch, capsys):
    def jsonl(name, docs):
        (tmp_path / name).write_text("".join(json.dumps(d if isinstance(d, dict) else {"text": d}) + "\n"
                                             for d in docs))
        return str(tmp_path / name)

    out = tmp_path / "out"
    prepare.prepare(jsonl("old.jsonl", DOCS[:2]), out, val_tokens=5)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    args = ["--input", jsonl("new.jsonl", DOCS[1:]), "--out", str(out), "--val-tokens", "5"]
    assert prepare.main(args) == 2 and "pass --overwrite to replace them" in capsys.readouterr().err

    failing = jsonl("failing.jsonl", [*DOCS, {"body": "no text"}])  # fails after every shard is written
    with pytest.raises(DataError, match="failing.jsonl:4"):
        prepare.prepare(failing, out, val_tokens=5, shard_tokens=8, overwrite=True)
    rename = os.rename

    def refuse_the_new_one(src, dst):
        if prepare.PARTIAL_SUFFIX in str(src):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        rename(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "rename", refuse_the_new_one)
        with pytest.raises(DataError, match="they are complete in .*partial-"):
            prepare.prepare(args[1], out, val_tokens=5, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # both failures left the old one whole
    for partial in tmp_path.glob(f"out{prepare.PARTIAL_SUFFIX}*"):
        shutil.rmtree(partial)

    assert prepare.main([*args, "--overwrite"]) == 0
    _check(gpt2[0], out, DOCS[1:])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == ["out"]  # nothing aside
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="holds notes.txt, which no preparation writes"):
        prepare.prepare(args[1], out, val_tokens=5, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "val_000000.bin").exists()


def test_overwrite_keeps_the_earlier_directory_when_a_file_appeared_in_it(tmp_path, capsys):
    """A file written into --out after the start-up check: the earlier preparation is set aside, not removed."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "train_000000.bin").write_bytes(b"old")
    (tmp_path / "out" / "notes.txt").write_text("mine")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "train_000000.bin").write_bytes(b"new")
    prepare._move_into_place(str(tmp_path / "new"), str(tmp_path / "out"), overwrite=True)
    kept = tmp_path / f"out{prepare.REPLACED_SUFFIX}{os.getpid()}"
    assert (tmp_path / "out" / "train_000000.bin").read_bytes() == b"new" and (kept / "notes.txt").read_text() == "mine"
    assert f"kept the earlier preparation in {kept}: it holds notes.txt" in capsys.readouterr().err


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_a_stop_between_the_overwrite_renames_is_held_until_the_new_preparation_is_in_place(
        gpt2, tmp_path, monkeypatch, capsys, stop):
    """A signal just after the earlier preparation is renamed aside: the new one still takes its place, the earlier
    one is removed, and the one line says so (it once said nothing was written, with --out missing)."""
    (tmp_path / "old.jsonl").write_text(json.dumps({"text": DOCS[0]}) + "\n")
    (tmp_path / "new.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[1:]))
    out = tmp_path / "out"
    prepare.prepare(str(tmp_path / "old.jsonl"), out, val_tokens=5)
    rename = os.rename

    def stop_after_setting_aside(src, dst):
        rename(src, dst)
        if prepare.REPLACED_SUFFIX in str(dst):
            signal.raise_signal(getattr(signal, stop))

    monkeypatch.setattr(os, "rename", stop_after_setting_aside)
    args = ["--input", str(tmp_path / "new.jsonl"), "--out", str(out), "--val-tokens", "5", "--overwrite"]
    assert prepare.main(args) == 0
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"data: {stop} arrived while the finished preparation was moved into place; {out} holds it, complete")
    _check(gpt2[0], out, DOCS[1:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.jsonl", "old.jsonl", "out"]


def test_a_filesystem_that_fills_during_a_preparation_leaves_nothing(gpt2, tmp_path, small_filesystem, capsys):
    docs = _corpus(tmp_path, 400)  # about 90K tokens, 180 KB of shards: more than the 128 KiB there is room for
    out = small_filesystem(128) / "data"
    assert prepare.main(["--input", str(tmp_path / "docs.jsonl"), "--out", str(out), "--shard-tokens", "10000",
                         "--val-tokens", "100"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(rf"error: cannot write file {re.escape(str(out))}\.partial-\d+/\w+\.bin: No space left on "
                        rf"device \([\d.,]+ MiB free on its filesystem\); nothing written to {re.escape(str(out))}",
                        err[-1]), err
    assert os.listdir(out.parent) == [] and len(docs) == 400


def test_a_preparation_that_another_finishes_first_says_what_works(gpt2, tmp_path, monkeypatch, capsys):
    """Two prepare.py into one --out: the second to finish keeps the first's shards when they are the same, and
    otherwise says where its own are whole; following that advice gives a usable preparation."""
    (tmp_path / "a.txt").write_text(DOCS[0] * 30)
    out = tmp_path / "out"
    real_move = prepare._move_into_place
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(gpt2[1]))

    def the_other_finishes_first(val_tokens):
        def move(partial, out_dir, overwrite):
            r = _cli("--input", str(tmp_path / "a.txt"), "--out", out_dir, "--val-tokens", val_tokens, cwd=tmp_path,
                     env=env)
            assert r.returncode == 0, r.stderr
            real_move(partial, out_dir, overwrite)
        return move

    monkeypatch.setattr(prepare, "_move_into_place", the_other_finishes_first("7"))
    record = prepare.prepare(str(tmp_path / "a.txt"), str(out), val_tokens=7)
    assert "another preparation finished --out" in capsys.readouterr().err and record["val_tokens"] == 7
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "out"] and shards.data_record(str(out))["val_tokens"] == 7

    shutil.rmtree(out)
    monkeypatch.setattr(prepare, "_move_into_place", the_other_finishes_first("9"))
    with pytest.raises(DataError, match=r"with other shards \(data.json differs in sha256, train_tokens, val_tokens\); this "
                                        r"one is complete in .*: `mv (\S+) NEW_DIR`, then train with --data NEW_DIR") as e:
        prepare.prepare(str(tmp_path / "a.txt"), str(out), val_tokens=7)
    advice = re.search(r"`(mv \S+) NEW_DIR`", str(e.value)).group(1)
    subprocess.run(f"{advice} {tmp_path / 'mine'}", shell=True, check=True)  # the advice, as given
    assert shards.data_record(str(tmp_path / "mine"))["val_tokens"] == 7 and data.check_split(str(tmp_path / "mine"),
                                                                                            "train", 8)
    assert shards.data_record(str(out))["val_tokens"] == 9  # theirs, untouched
