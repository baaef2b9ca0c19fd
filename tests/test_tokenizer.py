import hashlib
import json
import subprocess

import pytest
import tiktoken
import tiktoken.load
import tiktoken.registry
import tokenizers

import tokenizer
from cli import DataError
from conftest import WORD_TEXT, no_network, write_word_tokenizer

EOT = 50256
R50K_FILE = hashlib.sha1(tokenizer.R50K_URL.encode()).hexdigest()


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty tiktoken cache, no network, and no encoding loaded in this process; returns the ranks' path."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, "r50k_base", raising=False)
    monkeypatch.setattr(tokenizer, "_load_encoding", tokenizer._load_encoding.__wrapped__)
    return tmp_path / R50K_FILE


def test_gpt2_real_ids_through_the_pypi_route(gpt2):
    enc, cache = gpt2
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.eot_token == EOT and enc.n_vocab == 50257
    # the file came from the whisper sdist and sits where tiktoken's cache looks for it
    assert hashlib.sha256((cache / R50K_FILE).read_bytes()).hexdigest() == tokenizer.R50K_SHA256


def test_tokenizer_error_when_no_file_can_be_had(offline_cache, monkeypatch):
    def pip_fails():
        raise subprocess.CalledProcessError(1, ["pip", "download"])

    monkeypatch.setattr(tokenizer, "_ranks_from_pypi", pip_fails)
    with pytest.raises(DataError) as e:
        tokenizer.get_tokenizer("gpt2")
    msg = str(e.value)
    assert "\n" not in msg and "pip download openai-whisper" in msg and str(offline_cache) in msg


def test_another_tiktoken_encoding_offline_is_one_line_of_advice(offline_cache, monkeypatch):
    """Not the HTTP library's account of the failed fetch: what to run where, and where its files go here."""
    import requests

    def unreachable(*args, **kwargs):
        raise requests.exceptions.ConnectionError("HTTPSConnectionPool(host='openaipublic.blob.core.windows.net', "
                                                  "port=443): Max retries exceeded with url: /encodings/"
                                                  "cl100k_base.tiktoken (Caused by NameResolutionError(...))")

    monkeypatch.setattr(tiktoken.load, "read_file", unreachable)
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, "cl100k_base", raising=False)
    with pytest.raises(DataError) as e:
        tokenizer.get_tokenizer("cl100k_base")
    assert str(e.value) == (
        "could not load tokenizer 'cl100k_base': tiktoken fetches its file on first use, and the fetch failed "
        "(ConnectionError); on a machine online, run python -c \"import tiktoken; tiktoken.get_encoding("
        f"'cl100k_base')\" with TIKTOKEN_CACHE_DIR set, then copy that folder's files to {offline_cache.parent} "
        "here (gpt2 works offline)")


def test_tokenizer_refuses_ranks_with_the_wrong_hash(offline_cache, monkeypatch):
    monkeypatch.setattr(tokenizer, "_ranks_from_pypi", lambda: b"IQ== 0\n")
    with pytest.raises(DataError):
        tokenizer.get_tokenizer("gpt2")
    assert not offline_cache.exists()


def test_tokenizer_replaces_a_corrupt_cached_file(gpt2, offline_cache, monkeypatch):
    good = (gpt2[1] / R50K_FILE).read_bytes()
    offline_cache.write_bytes(b"corrupt")
    monkeypatch.setattr(tokenizer, "_ranks_from_pypi", lambda: good)
    assert tokenizer.get_tokenizer("gpt2").encode("Hello world") == [15496, 995]
    assert offline_cache.read_bytes() == good


def test_unknown_tokenizer_is_a_one_line_error():
    with pytest.raises(DataError, match="unknown tokenizer 'nope'"):
        tokenizer.get_tokenizer("nope")


# ----------------------------------------------------------------------------------------------------------
# Tokenizers beyond tiktoken


def test_tokenizer_json_gives_the_librarys_own_ids(word_tokenizer):
    tok = tokenizer.load_tokenizer(word_tokenizer)
    own = tokenizers.Tokenizer.from_file(word_tokenizer)
    texts = [WORD_TEXT, "the unknown words , a cat", ""]
    assert [ids.tolist() for ids in tok.encode_batch(texts)] == [own.encode(t).ids for t in texts]
    assert tok.encode(WORD_TEXT) == own.encode(WORD_TEXT).ids and 0 not in tok.encode(WORD_TEXT)  # no [UNK]
    assert tok.n_vocab == 70_001 and tok.eot == 70_000 and tok.separator == "<|endoftext|>"
    assert not tok.byte_level and tok.decode(tok.encode("the cat")) == "the cat"
    # as tiktoken's encode_ordinary: a document's own "<|endoftext|>" is text, never the separator
    assert tok.eot not in tok.encode("a <|endoftext|> b") and own.encode("a <|endoftext|> b").ids[1] == tok.eot


def test_tokenizer_directory_and_cached_hub_name(word_tokenizer, tmp_path, monkeypatch):
    """A directory's tokenizer_config.json names the separator; a hub name is read from the local cache only,
    and an uncached one is a line that says what to download."""
    import huggingface_hub.constants

    text = open(word_tokenizer, encoding="utf-8").read()
    snapshot = tmp_path / "hub" / "models--someone--words" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc123")
    spec = json.loads(text)
    spec["added_tokens"][0]["content"] = "</s>"
    (snapshot / "tokenizer.json").write_text(json.dumps(spec))
    named = {"bos_token": "[UNK]", "eos_token": {"content": "</s>"}}
    (snapshot / "tokenizer_config.json").write_text(json.dumps(named))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for spec in (str(snapshot), "someone/words"):
        tok = tokenizer.load_tokenizer(spec)
        assert (tok.name, tok.separator, tok.eot) == (spec, "</s>", 70_000)  # [UNK] is no special token
    with pytest.raises(DataError) as e:
        tokenizer.load_tokenizer("someone/other")
    assert str(e.value) == ("tokenizer someone/other is not in the local Hugging Face cache (it is never downloaded "
                            "here); fetch it first: hf download someone/other tokenizer.json tokenizer_config.json")


@pytest.mark.parametrize("spec", ["prepBPE/tokenizer.json", "tok.json", "./tok", "../tok", "/no/such/tok",
                                  "present/tok"])
def test_a_missing_path_is_no_such_file_not_a_hub_name(spec, tmp_path, monkeypatch):
    """A --tokenizer that reads as a path (a .json name, ./ ../ or / first, or under a directory that is there)
    and is not there is said to be missing, not sent to the Hugging Face cache."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "present").mkdir()
    with pytest.raises(DataError) as e:
        tokenizer.load_tokenizer(spec)
    assert str(e.value) == f"--tokenizer {spec}: no such file or directory"


def test_a_directory_of_slow_tokenizer_files_is_told_how_to_write_tokenizer_json(tmp_path):
    """transformers' files without tokenizer.json: the call that converts them, which, run as given, gives a
    directory that loads."""
    from transformers import AutoTokenizer

    vocab = {token: i for i, token in enumerate(["a", "b", "c", "ab", "<|endoftext|>"])}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    with pytest.raises(DataError) as e:
        tokenizer.load_tokenizer(str(tmp_path))
    call = str(e.value).partition("write one with transformers: ")[2]
    assert call.startswith("AutoTokenizer.from_pretrained("), str(e.value)
    eval(call, {"AutoTokenizer": AutoTokenizer})
    assert tokenizer.load_tokenizer(str(tmp_path)).n_vocab == 5


def test_a_trained_tokenizers_recorded_name_says_where_the_tokenizer_is():
    """trained:N, as data.json and checkpoints record prepare.py --train-tokenizer, names no file: the way to it."""
    with pytest.raises(DataError) as e:
        tokenizer.load_tokenizer("trained:300")
    assert str(e.value).endswith("a data directory, which holds it as tokenizer.json: pass --tokenizer "
                                 "DIR/tokenizer.json")


def test_a_tokenizer_without_a_separator_needs_doc_separator(tmp_path):
    path = write_word_tokenizer(tmp_path / "tok.json", ["a", "b"], size=10, separator="[SEP]")
    with pytest.raises(DataError, match=r"has no end-of-text or BOS special token .*--doc-separator TOKEN"):
        tokenizer.load_tokenizer(path)
    assert tokenizer.load_tokenizer(path, doc_separator="[SEP]").eot == 10
    for token, words in [("a", "is not a special token of .*: text could encode to it"), ("nope", "not a special")]:
        with pytest.raises(DataError, match=words):
            tokenizer.load_tokenizer(path, doc_separator=token)
    with pytest.raises(DataError, match="'nope' is not a special token of the gpt2 tokenizer"):
        tokenizer.load_tokenizer("gpt2", doc_separator="nope")


@pytest.mark.parametrize("content, words", [
    (None, "cannot read the tokenizer"), (b"\xff\xfe", "not a tokenizer.json (not UTF-8"),
    (b'{"version": "1.0"', "not a tokenizer.json (EOF while parsing"), (b'{"a": 1}', "not a tokenizer.json")])
def test_an_unreadable_or_foreign_tokenizer_json_is_one_line(tmp_path, content, words):
    path = tmp_path / "tokenizer.json"
    if content is None:
        path.mkdir()  # a directory of that name, inside a directory given as the tokenizer
        path = tmp_path
    else:
        path.write_bytes(content)
    with pytest.raises(DataError) as e:
        tokenizer.load_tokenizer(str(path))
    assert words in str(e.value) and str(tmp_path) in str(e.value) and "\n" not in str(e.value)


def test_sha256_is_of_what_decides_the_ids(word_tokenizer, tmp_path):
    tok = tokenizer.load_tokenizer(word_tokenizer)
    copy = tokenizers.Tokenizer.from_file(word_tokenizer)
    copy.decoder = tokenizers.decoders.WordPiece()  # decoding only: the same ids, the same sha256
    copy.save(str(tmp_path / "decoder.json"))
    assert tokenizer.load_tokenizer(str(tmp_path / "decoder.json")).sha256 == tok.sha256
    other = write_word_tokenizer(tmp_path / "other.json", ["cat", "the"])  # one word fewer, ids shift
    assert tokenizer.load_tokenizer(other).sha256 != tok.sha256
    gpt2 = tokenizer.load_tokenizer("gpt2")
    assert gpt2.record() == {"tokenizer": "gpt2", "tokenizer_sha256": gpt2.sha256, "n_vocab": 50257, "eot": 50256,
                             "doc_separator": "<|endoftext|>"}


def test_recorded_tokenizer_refuses_a_copy_that_changed(word_tokenizer, tmp_path):
    tok = tokenizer.load_tokenizer(word_tokenizer)
    (tmp_path / "tokenizer.json").write_text(tok.text)
    record = tok.record()
    assert tokenizer.recorded_tokenizer(record, str(tmp_path)).encode(WORD_TEXT) == tok.encode(WORD_TEXT)
    for eot in (10**6, "70000"):
        with pytest.raises(DataError, match="the separator id .* is not one of its 70,001 ids"):
            tokenizer.recorded_tokenizer({**record, "eot": eot}, str(tmp_path))
    write_word_tokenizer(tmp_path / "tokenizer.json", ["cat"])
    with pytest.raises(DataError, match="is not the tokenizer .*data.json records"):
        tokenizer.recorded_tokenizer(record, str(tmp_path))


def test_byte_level_token_bytes_add_up_to_the_texts_bytes():
    """A byte-level BPE tokenizer.json: each token's bytes are exact, so a text's tokens hold its UTF-8 bytes,
    characters split across tokens included; special tokens count none."""
    text = "héllo wörld 日本語 🤖 the the the"
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["héllo the the"] * 4, trainer)  # 日本語 and 🤖 stay single bytes
    tok = tokenizer.HFTokenizer(bpe.to_str(), "bpe", "bpe")
    ids = tok.encode(text)
    assert tok.byte_level and b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.byte_lengths[ids].sum() == len(text.encode()) and tok.byte_lengths[tok.eot] == 0
    assert any(tok.byte_lengths[i] == 1 and tok.token_bytes(i)[0] >= 0x80 for i in ids)  # part of a character


def test_train_bpe_is_deterministic_byte_level_and_ends_with_its_separator():
    # a lone surrogate too, as a JSON escape can make
    texts = ["internationalization = naïve 日本 the cat\n\n    return x = 1 " * 3] * 30 + ["lone \ud800"]
    first, second = (tokenizer.train_bpe(texts, 400, "trained:400", "</s>") for _ in range(2))
    assert first.sha256 == second.sha256 and first.text == second.text  # the same texts, the same tokenizer
    # every pair merged but those past TRAINED_TOKEN_BYTES: fewer ids than asked, the separator the last
    assert (first.n_vocab, first.eot, first.separator, first.byte_level) == (306, 305, "</s>", True)
    assert len(" internationalization".encode()) > tokenizer.TRAINED_TOKEN_BYTES
    assert len(first.encode(" internationalization")) == 2 and first.encode(" cat") == [first.fast.token_to_id("Ġcat")]
    assert max(len(first.token_bytes(i)) for i in range(305)) <= tokenizer.TRAINED_TOKEN_BYTES
    text = "naïve 🤖 </s> <|endoftext|> never seen\ud800"  # a special token's text is text; every byte encodes
    ids = first.encode(text)
    assert first.eot not in ids and first.decode(ids) == text.replace("\ud800", "\ufffd")
    assert first.byte_lengths[ids].sum() == len(text.replace("\ud800", "\ufffd").encode())
