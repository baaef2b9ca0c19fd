"""The tokenizer: a tiktoken encoding, loaded once per process; GPT-2's (the default) works offline.

tiktoken downloads an encoding's BPE ranks on first use. For GPT-2 they are also taken from tiktoken's cache
or from the openai-whisper source distribution, which pip fetches from the package index, so a machine that
reaches only the package index can tokenize. Beneath the tokenizer lies what data.py, sources.py and
prepare.py share: DataError, the project's cache directory, and atomic writes.
"""

import functools
import glob
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile

import tiktoken

from cli import first_line


class DataError(Exception):
    """A problem with the user's data or environment. The message is one line and names the file at fault."""


CACHE_ENV = "PRETRAIN_CACHE_DIR"


def cache_root() -> str:
    """The project's cache (tokenizer file, default corpus): $PRETRAIN_CACHE_DIR, else ~/.cache/pretrain."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "pretrain")


def atomic_write(path: str, *chunks) -> None:
    """Write bytes-like chunks to path so that readers see the old file or the whole new one, never a part."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


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
        try:
            return tiktoken.get_encoding(name)
        except Exception as e:
            raise DataError(f"could not load tokenizer {name!r} (tiktoken downloads it on first use): "
                            f"{first_line(e)}") from None
    path = _r50k_cache_path(_tiktoken_cache_dir())
    if _sha256_of(path) != R50K_SHA256:
        _seed_gpt2_ranks(path)
    try:
        return tiktoken.get_encoding("r50k_base")
    except Exception:
        raise DataError(f"GPT-2 tokenizer file not found and not downloadable: make `{PIP_DOWNLOAD}` work "
                        f"(it is fetched from the package index), or copy r50k_base.tiktoken "
                        f"(sha256 {R50K_SHA256}) to {path}") from None

