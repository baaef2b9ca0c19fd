import random

import pytest
import regex
import tiktoken_ext.openai_public as openai_public

import sources
import split


def test_text_pieces_keep_every_tiktoken_pre_tokenization(tmp_path, monkeypatch):
    # BPE never merges across pre-tokens, so equal pre-tokens on the whole text and on its pieces mean equal
    # ids. Checked with tiktoken's own patterns (their BPE files are not needed for this).
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *a, **k: {})
    monkeypatch.setattr(openai_public, "data_gym_to_mergeable_bpe_ranks", lambda *a, **k: {})
    patterns = {name: make()["pat_str"] for name, make in openai_public.ENCODING_CONSTRUCTORS.items()}
    assert {"r50k_base", "cl100k_base", "o200k_base"} <= set(patterns)
    monkeypatch.setattr(sources, "TEXT_CHUNK_CHARS", 5)
    alphabet = list("aZé日\u0301'1.,/!? \t\n") + ["\na", ".\n", "x\n", "\n/", "'s\n"]
    rng = random.Random(0)
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(300))
        (tmp_path / "t.txt").write_text(text, encoding="utf-8")
        pieces = [piece for piece, _ in sources._text_pieces(str(tmp_path / "t.txt"))]
        assert "".join(pieces) == text and len(pieces) > 5
        for name, pattern in patterns.items():
            assert regex.findall(pattern, text) == [t for p in pieces for t in regex.findall(pattern, p)], name


def test_a_text_file_within_one_read_is_one_piece(tmp_path):
    # Cutting costs a backwards scan for a safe newline; a file that the first read takes whole needs none.
    text = "def f():\n    return 1\n\nx = f()\n" * 50
    (tmp_path / "m.py").write_text(text)
    assert list(sources._text_pieces(str(tmp_path / "m.py"))) == [(text, True)]


def test_count_in_file_across_blocks(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" + b"abc" * 4 + b"ab")
    assert all(sources._count_in_file(str(path), b"abc", block) == 4 for block in range(1, 16))


def test_saved_dataset_kind_from_a_listing():
    assert sources.saved_dataset_kind(["data-00000-of-00001.arrow", "dataset_info.json", "state.json"]) == "Dataset"
    assert sources.saved_dataset_kind(["dataset_dict.json"]) == "DatasetDict"
    assert sources.saved_dataset_kind(["state.json", "notes.txt"]) is None
    assert sources.saved_dataset_kind([]) is None


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_paragraphs_are_documents_whatever_the_reads(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(sources, "TEXT_CHUNK_CHARS", chunk)
    (tmp_path / "t.txt").write_text("\n\nfirst line\n  indented\n \t\n\n    second\nx\n\n\nthird")
    docs = {}
    for position, text in split.document_texts(sources._text_pieces(str(tmp_path / "t.txt"), paragraphs=True)):
        docs[position] = docs.get(position, "") + text
    assert docs == {0: "first line\n  indented\n", 1: "    second\nx\n", 2: "third"}


@pytest.mark.parametrize("text, found", [("a\n\nb", True), ("a\n \t\n  b\n", True), ("a\nb\n", False),
                                         ("\n\na\n", False), ("a\n\n\n", False), ("", False)])
def test_has_paragraphs_needs_text_on_both_sides(tmp_path, text, found):
    (tmp_path / "t.txt").write_text(text)
    assert all(sources.has_paragraphs(str(tmp_path / "t.txt"), block) == found for block in (1, 2, 5, 1 << 20))
