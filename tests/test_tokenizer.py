import hashlib
import subprocess

import pytest
import tiktoken
import tiktoken.load
import tiktoken.registry

import tokenizer
from conftest import no_network
from tokenizer import DataError

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
