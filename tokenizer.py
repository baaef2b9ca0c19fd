"""A tiktoken encoding or a tokenizer.json behind one interface, offline for GPT-2; BPE training; HF files.

The tokenizer: a tiktoken encoding, a tokenizer.json, or a Hugging Face tokenizer directory (local, or
in the Hugging Face cache), behind one interface (Tokenizer); GPT-2's (the default) works offline.

tiktoken downloads an encoding's BPE ranks on first use. For GPT-2 they are also taken from tiktoken's cache
or from the openai-whisper source distribution, which pip fetches from the package index, so a machine that
reaches only the package index can tokenize. A tokenizer.json is read with the `tokenizers` library; hub
names are looked up in the local cache only, never downloaded. Beneath the tokenizer lies what data.py,
sources.py and prepare.py share: DataError, the project's cache directory, and atomic writes. Above it: the
text a tokenizer trains on (prepare.py --train-tokenizer), and a tokenizer written as transformers' files
(vocab.json and merges.txt, tokenizer.json) for hf.py's export.
"""

import argparse
import functools
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile

import numpy as np
import tiktoken

from atomic import atomic_write
from cli import DataError, cache_root, first_line

VOCAB_PAD_MULTIPLE = 128  # model.VOCAB_MULTIPLE: a model may pad its tokenizer's ids up to a multiple of it

# ----------------------------------------------------------------------------------------------------------
# GPT-2's ranks, offline

# tiktoken fetches the GPT-2 ranks from this URL and checks this sha256. tiktoken's "gpt2" encoding builds
# the same ranks from two other files; "r50k_base" reads this single file, so "gpt2" maps to r50k_base.
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# The same bytes ship in the openai-whisper source distribution, which pip can fetch from the package
# registry on machines that reach nothing else.
WHISPER_SDIST = "openai-whisper==20250625"
WHISPER_ASSET = "whisper/assets/gpt2.tiktoken"
PIP_DOWNLOAD = f"python -m pip download {WHISPER_SDIST} --no-deps --no-binary :all:"


def _tiktoken_cache_dir() -> str:
    """The directory tiktoken caches downloads in; made explicit (and the project's own) when the user set none."""
    cache_dir = (os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
                 or os.path.join(cache_root(), "tiktoken"))
    os.environ["TIKTOKEN_CACHE_DIR"] = cache_dir
    return cache_dir


def _r50k_cache_path(cache_dir: str) -> str:
    # tiktoken.load.read_file_cached names a cached download by the sha1 of its URL.
    return os.path.join(cache_dir, hashlib.sha1(R50K_URL.encode()).hexdigest())


def _sha256_of(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def _ranks_from_pypi() -> bytes:
    """The GPT-2 BPE ranks, taken from the openai-whisper sdist that pip downloads through the configured index."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", WHISPER_SDIST, "--no-deps", "--no-binary", ":all:",
               "--quiet", "-d", tmp]
        subprocess.run(cmd, check=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=300)
        sdists = glob.glob(os.path.join(tmp, "*.tar.gz"))
        if len(sdists) != 1:
            raise DataError(f"pip download {WHISPER_SDIST} gave {len(sdists)} sdists, expected 1")
        with tarfile.open(sdists[0]) as tar:
            member = next((m for m in tar.getmembers() if m.name.endswith("/" + WHISPER_ASSET)), None)
            if member is None:
                raise DataError(f"{sdists[0]} has no {WHISPER_ASSET}")
            return tar.extractfile(member).read()


def _seed_gpt2_ranks(path: str) -> None:
    """Install the GPT-2 ranks at path from PyPI when the hash matches; on any failure leave path alone."""
    print(f"data: fetching the GPT-2 BPE ranks from the {WHISPER_SDIST} sdist into {os.path.dirname(path)}",
          file=sys.stderr)
    try:
        ranks = _ranks_from_pypi()
        if hashlib.sha256(ranks).hexdigest() == R50K_SHA256:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write(path, ranks)
    except (DataError, OSError, subprocess.SubprocessError, tarfile.TarError):
        pass  # tiktoken's own download is tried next, and its failure is reported with what to do


def get_tokenizer(name: str = "gpt2") -> tiktoken.Encoding:
    """A tiktoken encoding, loaded once per process. "gpt2" (the default) is tiktoken's r50k_base, GPT-2's
    real ids, and works offline: its BPE file is taken from tiktoken's cache, else fetched from the package
    index (openai-whisper sdist), else downloaded by tiktoken. Sets TIKTOKEN_CACHE_DIR when it is unset."""
    return _load_encoding("r50k_base" if name == "gpt2" else name)


@functools.lru_cache(maxsize=None)
def _load_encoding(name: str) -> tiktoken.Encoding:
    if name != "r50k_base":
        if name not in tiktoken.list_encoding_names():
            raise DataError(f"unknown tokenizer {name!r}; choose gpt2 or one of {tiktoken.list_encoding_names()}")
        cache_dir = _tiktoken_cache_dir()
        try:
            return tiktoken.get_encoding(name)
        except Exception as e:  # offline, its message is the HTTP library's account of the failed fetch
            raise DataError(f"could not load tokenizer {name!r}: tiktoken fetches its file on first use, and the "
                            f"fetch failed ({type(e).__name__}); on a machine online, run python -c \"import "
                            f"tiktoken; tiktoken.get_encoding('{name}')\" with TIKTOKEN_CACHE_DIR set, then copy "
                            f"that folder's files to {cache_dir} here (gpt2 works offline)") from None
    path = _r50k_cache_path(_tiktoken_cache_dir())
    if _sha256_of(path) != R50K_SHA256:
        _seed_gpt2_ranks(path)
    try:
        return tiktoken.get_encoding("r50k_base")
    except Exception:
        raise DataError(f"GPT-2 tokenizer file not found and not downloadable: make `{PIP_DOWNLOAD}` work "
                        f"(it is fetched from the package index), or copy r50k_base.tiktoken "
                        f"(sha256 {R50K_SHA256}) to {path}") from None



# ----------------------------------------------------------------------------------------------------------
# One interface over tiktoken encodings and Hugging Face tokenizers

TOKENIZER_FILE = "tokenizer.json"  # a Hugging Face fast tokenizer; prepare.py copies it next to the shards
TOKENIZER_CONFIG = "tokenizer_config.json"  # beside it in a tokenizer directory: its bos_token and eos_token
# The document separator, when neither --doc-separator nor tokenizer_config.json names one: the first of these
# the vocabulary holds. Ends of text first, as GPT-2's <|endoftext|>, then beginnings of text.
SEPARATOR_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|begin_of_text|>", "<s>",
                   "<bos>", "<|bos|>")
HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")
# Parts of a tokenizer.json that decide the ids of a text (added_tokens among them); the rest (decoder,
# post-processor, padding, truncation) do not, and are left out of its sha256.
ID_DECIDING_KEYS = ("added_tokens", "normalizer", "pre_tokenizer", "model")


def byte_to_char() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for every byte (GPT-2's, which tokenizer.json files of byte-level BPE
    use): printable Latin-1 bytes stand for themselves, the rest take the code points from 256 up, in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


CHAR_TO_BYTE = {char: byte for byte, char in byte_to_char().items()}


def _without_surrogates(text: str) -> str:
    """text with its lone surrogates (JSON escapes can make them) as U+FFFD, as tiktoken's encode_ordinary has it."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class Tokenizer:
    """What the project asks of a tokenizer, whichever library holds it. name: what --tokenizer named (a
    tiktoken encoding, a path or a hub name); n_vocab: one more than its largest id; eot: the document
    separator, the token before every document in the shards, and separator its text; byte_level: whether
    token_bytes gives every token's bytes of text exactly (tiktoken, byte-level BPE); spreads_batches: whether
    encode_batch spreads one call over threads of its own (tokenizers) rather than encoding on the caller's."""

    name: str
    n_vocab: int
    eot: int
    separator: str
    byte_level: bool
    spreads_batches: bool

    def encode(self, text: str) -> list[int]:
        """The ids of text as a document's text: a special token's text is encoded as text."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """encode of each text, as uint32 arrays."""
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def token_bytes(self, token: int) -> bytes | None:
        """The bytes of text of one token (byte_level tokenizers; for the others, its text decoded on its own);
        None for an id the tokenizer lacks."""
        raise NotImplementedError

    def special_ids(self) -> set[int]:
        """The ids of special tokens, which stand for no text."""
        raise NotImplementedError

    def _identity(self) -> bytes:
        """What sha256 hashes: the vocabulary and what else decides the ids of a text."""
        raise NotImplementedError

    @functools.cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self._identity()).hexdigest()

    @functools.cached_property
    def byte_lengths(self) -> np.ndarray:
        """[n_vocab] int64: the UTF-8 bytes of each token's text (token_bytes); 0 for special tokens and for ids
        the tokenizer lacks. Built once per tokenizer."""
        special = self.special_ids()
        lengths = np.zeros(self.n_vocab, dtype=np.int64)
        for i in range(self.n_vocab):
            if i not in special and (b := self.token_bytes(i)) is not None:
                lengths[i] = len(b)
        return lengths

    def _check_eot(self, where: str) -> None:
        if not (isinstance(self.eot, int) and 0 <= self.eot < self.n_vocab):
            raise DataError(f"{where}: the separator id {self.eot!r} is not one of its {self.n_vocab:,} ids")

    def record(self) -> dict:
        """What data.json records of the tokenizer."""
        return {"tokenizer": self.name, "tokenizer_sha256": self.sha256, "n_vocab": self.n_vocab, "eot": self.eot,
                "doc_separator": self.separator}


class TiktokenTokenizer(Tokenizer):
    byte_level, spreads_batches = True, False

    def __init__(self, name: str, doc_separator: str | None = None, eot: int | None = None):
        self.name, self.encoding = name, get_tokenizer(name)
        self.n_vocab = self.encoding.n_vocab
        if doc_separator is not None:
            if doc_separator not in self.encoding.special_tokens_set:
                raise DataError(f"--doc-separator {doc_separator!r} is not a special token of the {name} tokenizer "
                                f"({', '.join(sorted(self.encoding.special_tokens_set))})")
            eot = self.encoding.encode_single_token(doc_separator)
        self.eot = self.encoding.eot_token if eot is None else eot
        self._check_eot(f"the {name} tokenizer")
        self.separator = self.encoding.decode_single_token_bytes(self.eot).decode("utf-8", "replace")

    def encode(self, text):
        return self.encoding.encode_ordinary(text)

    def _ids(self, text: str) -> np.ndarray:
        """encode_ordinary(text) as uint32, straight from tiktoken's buffer (tiktoken >= 0.9): no Python int per
        token, which costs about a tenth of the encoding itself, with the GIL held."""
        try:
            return self.encoding.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:
            return self.encoding.encode_to_numpy(_without_surrogates(text), disallowed_special=())

    def encode_batch(self, texts):
        return [self._ids(text) for text in texts]

    def decode(self, ids):
        return self.encoding.decode(list(ids))

    def token_bytes(self, token):
        try:
            return self.encoding.decode_single_token_bytes(token)
        except KeyError:  # a hole in the encoding's ids
            return None

    def special_ids(self):
        return {self.encoding.encode_single_token(token) for token in self.encoding.special_tokens_set}

    def _identity(self):
        tokens = (self.token_bytes(i) for i in range(self.n_vocab))
        return b"".join(b"\xff" * 4 if t is None else len(t).to_bytes(4, "little") + t for t in tokens)


class HFTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer: the text of its tokenizer.json, read with the tokenizers library."""

    spreads_batches = True

    def __init__(self, text: str, name: str, where: str, doc_separator: str | None = None, eot: int | None = None,
                 preferred: tuple = ()):
        """where names the file in errors. The separator: eot (an id), else the token --doc-separator names,
        else the first of preferred (the directory's bos_token and eos_token) and SEPARATOR_NAMES it holds."""
        from tokenizers import Tokenizer as Fast

        try:
            self.fast = Fast.from_str(text)
        except Exception as e:  # the library raises a bare Exception for JSON that is not a tokenizer
            raise DataError(f"{where}: not a tokenizer.json ({first_line(e)})") from None
        self.fast.encode_special_tokens = True  # a document's "<|endoftext|>" is its text, as in tiktoken
        self.text, self.name, self.spec = text, name, json.loads(text)
        vocab = self.fast.get_vocab(with_added_tokens=True)
        if not vocab:
            raise DataError(f"{where}: the tokenizer has an empty vocabulary")
        self.n_vocab = max(vocab.values()) + 1
        decoders = [self.spec.get("decoder") or {}]
        decoders += decoders[0].get("decoders") or []  # a Sequence decoder's parts
        self.byte_level = any(d.get("type") == "ByteLevel" for d in decoders)
        self._added = {t["id"]: t for t in self.spec.get("added_tokens") or []}
        self.eot = eot if eot is not None else self._separator(where, doc_separator, preferred)
        self._check_eot(where)
        self.separator = self.fast.id_to_token(self.eot)

    def _separator(self, where: str, doc_separator: str | None, preferred: tuple) -> int:
        """A special token, which no text encodes to, so that it marks the documents' starts alone."""
        special = self.special_ids()
        if doc_separator is not None:
            if (token := self.fast.token_to_id(doc_separator)) not in special:
                raise DataError(f"--doc-separator {doc_separator!r} is not a special token of {where}"
                                + (": text could encode to it" if token is not None else ""))
            return token
        for name in (*preferred, *SEPARATOR_NAMES):
            if (token := self.fast.token_to_id(name)) in special:
                return token
        raise DataError(f"{where} has no end-of-text or BOS special token ({', '.join(SEPARATOR_NAMES)}): name "
                        f"the token that separates documents with --doc-separator TOKEN")

    def encode(self, text):
        return self.encode_batch([text])[0].tolist()

    def encode_batch(self, texts):
        try:
            encodings = self.fast.encode_batch_fast(texts, add_special_tokens=False)
        except TypeError:  # a lone surrogate, which is no UTF-8
            encodings = self.fast.encode_batch_fast([_without_surrogates(t) for t in texts], add_special_tokens=False)
        return [np.array(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids):
        return self.fast.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, token):
        text = self.fast.id_to_token(token)
        if text is None:
            return None
        if token in self._added:  # matched, and decoded, as its text
            return text.encode("utf-8")
        if self.byte_level and all(c in CHAR_TO_BYTE for c in text):
            return bytes(CHAR_TO_BYTE[c] for c in text)
        return self.decode([token]).encode("utf-8")

    def special_ids(self):
        return {i for i, t in self._added.items() if t.get("special")}

    def record(self):
        """Also the name of the copy of tokenizer.json that prepare.py writes next to the shards (self.text)."""
        return {**super().record(), "tokenizer_file": TOKENIZER_FILE}

    def _identity(self):
        spec = {key: self.spec.get(key) for key in ID_DECIDING_KEYS}
        model = dict(spec["model"] or {})
        if isinstance(model.get("merges"), list):  # older files write a merge as "a b", newer ones as ["a", "b"]
            model["merges"] = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
        spec["model"] = model
        return json.dumps(spec, sort_keys=True, ensure_ascii=False).encode("utf-8")


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not a tokenizer.json (not UTF-8: {e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read the tokenizer ({e.strerror or e})") from None


def _named_tokens(directory: str) -> tuple:
    """The bos_token and eos_token that a tokenizer directory's tokenizer_config.json names (a string, or an
    object with its content), those it has."""
    path = os.path.join(directory, TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return ()
    try:
        config = json.loads(_read_text(path))
    except ValueError as e:
        raise DataError(f"{path}: not valid JSON ({first_line(e)})") from None
    named = [config.get(key) if isinstance(config, dict) else None for key in ("bos_token", "eos_token")]
    named = [t.get("content") if isinstance(t, dict) else t for t in named]
    return tuple(t for t in named if isinstance(t, str))


def _from_directory(directory: str, name: str, doc_separator: str | None) -> HFTokenizer:
    path = os.path.join(directory, TOKENIZER_FILE)
    if not os.path.exists(path) and os.path.exists(os.path.join(directory, TOKENIZER_CONFIG)):
        raise DataError(f"--tokenizer {directory} has no {TOKENIZER_FILE} (the fast tokenizer's file); write one with "
                        f"transformers: AutoTokenizer.from_pretrained({directory!r}).save_pretrained({directory!r})")
    if not os.path.exists(path):  # transformers too needs tokenizer_config.json to know what other files are
        raise DataError(f"--tokenizer {directory}: the directory holds no tokenizer files (no {TOKENIZER_FILE}, nor a "
                        f"{TOKENIZER_CONFIG} that transformers could write one from); pass a {TOKENIZER_FILE}, a "
                        f"directory holding one, or a tiktoken encoding such as gpt2")
    return HFTokenizer(_read_text(path), name, path, doc_separator, preferred=_named_tokens(directory))


def _hub_cache_directory(name: str) -> str | None:
    """The directory of name's tokenizer.json in the local Hugging Face cache, or None; never the network."""
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(name, TOKENIZER_FILE)
    except Exception:  # no huggingface_hub, or a name it does not take
        return None
    return os.path.dirname(path) if isinstance(path, str) else None


def _names_a_path(spec: str) -> bool:
    """Whether a --tokenizer that is not there reads as a file's or directory's path, not a hub name owner/name:
    a .json file, a path from the root, home or current directory, or one under something that is there."""
    parent = os.path.dirname(spec)
    return spec.endswith(".json") or spec.startswith(("/", "~", "./", "../")) or bool(parent) and os.path.exists(parent)


def tokenizer_flag(text: str) -> str:
    """argparse type of every --tokenizer: an empty one (an unset shell variable, say) is not taken for the
    default without a word."""
    if not text:
        raise argparse.ArgumentTypeError("is empty: name a tokenizer, or leave the flag out for the default")
    return text


def load_tokenizer(spec: str = "gpt2", doc_separator: str | None = None) -> Tokenizer:
    """The tokenizer that --tokenizer names: a tiktoken encoding (gpt2, the default, is GPT-2's r50k_base), the
    path of a tokenizer.json or of a directory holding one (transformers' tokenizer files), or a Hugging Face hub
    name owner/name whose tokenizer.json is in the local cache (nothing is downloaded). doc_separator: the
    token that goes before every document, for a tokenizer without an obvious one. DataError, one line, for
    what cannot be loaded."""
    if spec == "gpt2" or spec in tiktoken.list_encoding_names():
        return TiktokenTokenizer(spec, doc_separator)
    if os.path.isdir(spec):
        return _from_directory(spec, spec, doc_separator)
    if os.path.exists(spec):
        return HFTokenizer(_read_text(spec), spec, spec, doc_separator)
    if _names_a_path(spec):
        raise DataError(f"--tokenizer {spec}: no such file or directory")
    if spec.startswith("trained:"):  # what data.json and checkpoints record of prepare.py --train-tokenizer
        raise DataError(f"--tokenizer {spec}: a tokenizer prepare.py --train-tokenizer trained into a data "
                        f"directory, which holds it as {TOKENIZER_FILE}: pass --tokenizer DIR/{TOKENIZER_FILE}")
    if HUB_NAME.fullmatch(spec):
        directory = _hub_cache_directory(spec)
        if directory is None:
            raise DataError(f"tokenizer {spec} is not in the local Hugging Face cache (it is never downloaded "
                            f"here); fetch it first: hf download {spec} {TOKENIZER_FILE} {TOKENIZER_CONFIG}")
        return _from_directory(directory, spec, doc_separator)
    raise DataError(f"unknown tokenizer {spec!r}: no such file or directory, nor a tiktoken encoding "
                    f"({', '.join(tiktoken.list_encoding_names())}) or a hub name owner/name")


def fits_vocab(model_vocab: int, n_vocab: int) -> bool:
    """Whether a model's vocabulary holds a tokenizer's n_vocab ids, padded at most to padded_vocab's."""
    return n_vocab <= model_vocab <= padded_vocab(n_vocab)


def padded_vocab(n_vocab: int) -> int:
    """The largest vocabulary a model of a tokenizer's n_vocab ids may have: n_vocab padded to VOCAB_PAD_MULTIPLE."""
    return -(-n_vocab // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE


def check_model_vocab(vocab_size: int, enc: Tokenizer) -> None:
    """Raise ValueError (one line, with the --tokenizer that would work) where a model's vocabulary cannot be the
    tokenizer's (fits_vocab, as training allows: `--vocab-size 50304` on GPT-2's ids): its ids would mean other
    text. Ids the tokenizer lacks are never sampled (sample.stream) nor generated by an export."""
    if not fits_vocab(vocab_size, enc.n_vocab):
        fewest = (vocab_size - 1) // VOCAB_PAD_MULTIPLE * VOCAB_PAD_MULTIPLE + 1  # the least that pads to vocab_size
        raise ValueError(f"model vocab_size {vocab_size:,} does not fit the {enc.name} tokenizer ({enc.n_vocab:,} "
                         f"tokens; a model may pad that to {padded_vocab(enc.n_vocab):,}); pass --tokenizer with the "
                         f"tokenizer the model was trained with (a tokenizer.json or tiktoken name of {fewest:,} to "
                         f"{vocab_size:,} ids)")


def recorded_tokenizer_spec(record: dict, data_dir: str) -> str:
    """The --tokenizer that names the tokenizer a data.json record names: its tiktoken encoding, or the
    tokenizer.json that prepare.py copied next to the shards (record["tokenizer_file"])."""
    file = record.get("tokenizer_file")
    return record["tokenizer"] if file is None else os.path.join(data_dir, file)


def recorded_tokenizer(record: dict, data_dir: str) -> Tokenizer:
    """The tokenizer a data.json record names: a tiktoken encoding, or the tokenizer.json that prepare.py copied
    next to the shards (record["tokenizer_file"]), with the recorded separator. DataError when it is not the
    tokenizer the record's sha256 names."""
    eot = record.get("eot")
    if record.get("tokenizer_file") is None:
        tok, where = TiktokenTokenizer(record["tokenizer"], eot=eot), f"the {record['tokenizer']} tokenizer"
    else:
        where = recorded_tokenizer_spec(record, data_dir)
        tok = HFTokenizer(_read_text(where), record["tokenizer"], where, eot=eot)
    if record.get("tokenizer_sha256", tok.sha256) != tok.sha256:
        raise DataError(f"{where} is not the tokenizer {os.path.join(data_dir, 'data.json')} records (its sha256 "
                        f"differs): the shards were made with another one")
    return tok


# ----------------------------------------------------------------------------------------------------------
# A byte-level BPE trained on one's own text (prepare.py --train-tokenizer)

# The longest token trained, in bytes, so that n tokens of text hold at most n times as many bytes: prepare.py
# holds the val split's text out of training by that bound. GPT-2's longer tokens are mostly runs of spaces
# and dashes, which split in two at this length.
TRAINED_TOKEN_BYTES = 16
TRAINED_SEPARATOR = "<|endoftext|>"


def train_bpe(texts, n_vocab: int, name: str, separator: str = TRAINED_SEPARATOR) -> HFTokenizer:
    """A byte-level BPE of at most n_vocab ids trained on texts (an iterable of strings) by the tokenizers
    library: GPT-2's pre-tokenizer and its 256 bytes as the first ids, so that every text encodes and
    token_bytes is exact (so is val_bpb); then merges of at most TRAINED_TOKEN_BYTES bytes; then separator, a
    special token, as the last id (GPT-2's order). Fewer ids when the texts run out of pairs to merge. The
    same texts give the same tokenizer. DataError, before training, for a separator that could also be a merge
    of text (one pre-token), as it would then not mark the documents' starts alone."""
    from tokenizers import AddedToken, Tokenizer as Fast, decoders, models, pre_tokenizers, trainers

    fast = Fast(models.BPE())
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if len(fast.pre_tokenizer.pre_tokenize_str(separator)) < 2:
        raise DataError(f"--doc-separator {separator!r} could be a token of text once trained; name one that mixes "
                        f"letters and punctuation, such as {TRAINED_SEPARATOR} or </s>")
    fast.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_vocab - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  max_token_length=TRAINED_TOKEN_BYTES, show_progress=False)
    fast.train_from_iterator((_without_surrogates(text) for text in texts), trainer)
    fast.add_special_tokens([AddedToken(separator, special=True, normalized=False)])
    return HFTokenizer(fast.to_str(), name, name, separator)


class TrainingText:
    """The text the tokenizer trains on, an iterable of strings: that of texts, at most max_chars characters of
    it. chars: how many it gave; capped: whether max_chars cut it."""

    def __init__(self, texts, max_chars: int):
        self.texts, self.max_chars = texts, max_chars
        self.chars, self.capped = 0, False

    def __iter__(self):
        for text in self.texts:
            room = self.max_chars - self.chars
            if len(text) >= room:
                text, self.capped = text[:room], True
            if text:
                self.chars += len(text)
                yield text
            if self.capped:
                return


# ----------------------------------------------------------------------------- transformers' tokenizer files
# hf.py's export writes them beside the weights, so that AutoTokenizer loads the tokenizer the shards were made with.

EOT_TEXT = "<|endoftext|>"  # GPT-2's end of text, id 50256


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list, in priority order, that reproduces tiktoken's byte-pair ranks.

    tiktoken keeps only the ranks; a token of rank r is the merge of the two parts that BPE, restricted to
    tokens ranked below r, leaves of its bytes.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            candidates = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            best, i = min(candidates)
            if best >= rank:
                raise ValueError(f"token rank {rank} cannot be built from lower-ranked tokens")
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def gpt2_vocab_and_merges(enc) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2's vocab (token text -> id, <|endoftext|> included) and merge list, in the byte-to-character
    alphabet of vocab.json and merges.txt, rebuilt from the tiktoken encoding's ranks."""
    ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.eot_token)}
    chars = byte_to_char()  # the alphabet of vocab.json and merges.txt

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    vocab = {text(token): rank for token, rank in ranks.items()}
    vocab[EOT_TEXT] = enc.eot_token
    return vocab, [(text(a), text(b)) for a, b in bpe_merges(ranks)]


def fast_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """GPT-2 as a Hugging Face `tokenizers.Tokenizer` (what tokenizer.json holds), or None without the
    tokenizers package. As GPT-2's own: byte-level BPE after GPT-2's split regex (ByteLevel with use_regex),
    no prefix space, and <|endoftext|> a special token matched before the split, so that it encodes to
    its one id as tiktoken's allowed_special does."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    except ImportError:
        return None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(EOT_TEXT, special=True, normalized=False)])
    return tok


def write_gpt2_tokenizer(enc, out_dir: str, max_len: int) -> bool:
    """vocab.json, merges.txt and tokenizer_config.json for transformers' GPT2Tokenizer, and tokenizer.json for
    its fast one, from the encoding. tokenizer.json is what AutoTokenizer reads first (no conversion from
    vocab.json and merges.txt at load) and what other readers (vLLM, TGI) need. -> whether tokenizer.json was
    written: it needs the tokenizers package (a transformers dependency)."""
    vocab, merges = gpt2_vocab_and_merges(enc)
    with open(os.path.join(out_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        f.writelines(f"{a} {b}\n" for a, b in merges)
    # clean_up_tokenization_spaces off: transformers 4 would otherwise decode " ," as "," and "a 's" as "a's".
    tokenizer_config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": EOT_TEXT, "eos_token": EOT_TEXT,
                        "unk_token": EOT_TEXT, "add_prefix_space": False, "model_max_length": max_len,
                        "clean_up_tokenization_spaces": False}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    fast = fast_tokenizer(vocab, merges)
    if fast is not None:
        fast.save(os.path.join(out_dir, "tokenizer.json"))
    return fast is not None


def write_hf_tokenizer(enc: HFTokenizer, out_dir: str, max_len: int) -> None:
    """The tokenizer.json the shards were made with, as it was, and a tokenizer_config.json that has transformers
    load it as a fast tokenizer with the document separator as its bos and eos token."""
    with open(os.path.join(out_dir, TOKENIZER_FILE), "w", encoding="utf-8") as f:
        f.write(enc.text)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": enc.separator,
                        "eos_token": enc.separator, "model_max_length": max_len, "clean_up_tokenization_spaces": False}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
