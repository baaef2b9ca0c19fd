"""The inputs of a preparation (prepare.py), as one stream of (text, starts_a_document) pieces.

A text file is one document, or one per blank-line paragraph (text_documents decides which, and whether a
lone file without paragraphs is cut into pieces of a token count, which prepare.py does on the token stream),
read in pieces cut where tokenizing is unchanged; a .jsonl or .parquet file, a datasets save_to_disk directory
or a Hugging Face hub dataset gives one document per record (its 'text' field, or the one --text-field
names). Directories and globs are read recursively, in sorted order. source_pieces checks a source before any
work and reads it lazily.
"""

import codecs
import glob
import json
import os
import random
import re
import sys
import sysconfig

from cli import DataError, UsageError, first_line

TEXT_CHUNK_CHARS = 1 << 20  # a large text file is read and tokenized this many characters at a time
SNIFF_BYTES = 8192  # the start of a file that decides whether it is text
# Signatures of compressed formats. No text file starts with one, and their bytes would tokenize as noise.
COMPRESSED = {"gzip": rb"\x1f\x8b", "bzip2": rb"BZh[1-9]1AY&SY", "xz": rb"\xfd7zXZ\x00", "zstd": rb"\x28\xb5\x2f\xfd",
              "zip": rb"PK\x03\x04"}
HF_PREFIX = "hf:"
TEXT_FIELD = "text"  # the field of a record that holds its text, unless --text-field names another
# A line's end and the blank lines (spaces allowed) after it, before a line with text: where one paragraph
# ends and the next begins (blank lines at a read's end wait for the next read, which may add more).
PARAGRAPH_BREAK = re.compile(r"\n(?:[^\S\n]*\n)+(?=[^\S\n]*\S)")
BETWEEN_TEXT = re.compile(r"\S[^\S\n]*" + PARAGRAPH_BREAK.pattern + r"[^\S\n]*\S")  # a break with text on each side
# --text-documents auto cuts a lone text file without a blank line into documents of this many tokens: enough
# of them that the val split draws across the file, each as long as the default model's context.
TEXT_PIECE_TOKENS = 1024


def _safe_cut(text: str, start: int = 0) -> int:
    """The index just after the last newline (at or after start) that has a non-space character before it and
    a letter after it; 0 if there is none. No pre-token of tiktoken's encodings crosses such a newline, so
    the two sides encode to the same ids separately as together."""
    i = text.rfind("\n", start, len(text) - 1)
    while i > 0:
        if not text[i - 1].isspace() and text[i + 1].isalpha():
            return i + 1
        i = text.rfind("\n", start, i)
    return 0


def _count_in_file(path: str, pattern: bytes, block: int = 1 << 24) -> int:
    """How often pattern occurs in the file's bytes, read a block at a time."""
    count, tail = 0, b""
    with open(path, "rb") as f:
        while chunk := f.read(block):
            count += (tail + chunk).count(pattern)
            tail = (tail + chunk)[1 - len(pattern):]  # too short to hold a whole match, so none counts twice
    return count


def _text_pieces(path: str, paragraphs: bool = False):
    """One text file as one document, or one per paragraph (PARAGRAPH_BREAK, which is dropped: the separator
    stands for it), read in pieces so a huge file never sits in memory whole. Invalid UTF-8 becomes U+FFFD,
    with one warning for the file."""
    starts = True
    rest = ""
    replacements = 0  # U+FFFD read: one per invalid sequence, and those the file really holds
    with open(path, encoding="utf-8", errors="replace") as f:
        while chunk := f.read(TEXT_CHUNK_CHARS):
            replacements += chunk.count("\ufffd")
            rest += chunk
            if paragraphs:
                *whole, rest = PARAGRAPH_BREAK.split(rest)
                for paragraph in whole:
                    if paragraph or not starts:  # a break at the file's start begins no document
                        yield paragraph + "\n", starts
                    starts = True
            if len(chunk) < TEXT_CHUNK_CHARS:
                break  # a text read returns fewer characters only at the end of the file: the last piece
            cut = _safe_cut(rest, start=max(len(rest) - len(chunk) - 1, 0))  # the older part has no cut
            if cut:
                yield rest[:cut], starts
                starts, rest = False, rest[cut:]
    if rest:
        yield rest, starts
    if replacements:  # rare, so only then is the file read again, to tell the two apart
        invalid = replacements - _count_in_file(path, "\ufffd".encode())
        if invalid:
            print(f"warning: {path}: {invalid:,} invalid UTF-8 sequences replaced with U+FFFD, the first at line "
                  f"{_first_invalid_line(path)}", file=sys.stderr)


def has_paragraphs(path: str, block: int = 1 << 24) -> bool:
    """Whether the text file holds a blank line between two lines of text: read a block at a time until the
    first one, each block after the last text of the one before (its trailing blank lines as bare newlines)."""
    tail = ""
    with open(path, encoding="utf-8", errors="replace") as f:
        while chunk := f.read(block):
            text = tail + chunk
            if BETWEEN_TEXT.search(text):
                return True
            stripped = text.rstrip()
            tail = stripped[-1:] + "\n" * min(text[len(stripped):].count("\n"), 2) if stripped else ""
    return False


def text_documents(source, requested: str | int, train_tokenizer: bool = False) -> tuple[str, int | None]:
    """How prepare.py makes documents of text files -> (mode, tokens a piece): ("file", None), ("paragraphs",
    None) or ("tokens", N), every document longer than N tokens cut into pieces of N. requested: --text-documents,
    "auto": a lone text file by its paragraphs, or in pieces of TEXT_PIECE_TOKENS where it has no blank line,
    so that the val split draws across it; each file of a directory or glob, which are documents already, whole.
    Under --train-tokenizer the documents must be known before any text is tokenized (split.val_held_out), so
    auto keeps such a file whole and a token count is refused."""
    if isinstance(requested, int):
        if requested < 1:
            raise UsageError(f"--text-documents {requested}: a piece needs at least 1 token")
        if train_tokenizer:
            raise UsageError(f"--text-documents {requested}: --train-tokenizer needs documents it can tell apart "
                             "before tokenizing; use paragraphs or file")
        return "tokens", requested
    if requested != "auto":
        return requested, None
    source = os.fspath(source)
    if not os.path.isfile(source) or source.endswith((".jsonl", ".parquet")) or _not_text(source):
        return "file", None
    if has_paragraphs(source):
        return "paragraphs", None
    return ("file", None) if train_tokenizer else ("tokens", TEXT_PIECE_TOKENS)


def _first_invalid_line(path: str, block: int = 1 << 24) -> int | None:
    """The line (from 1) of the file's first invalid UTF-8 sequence, read a block at a time; None if it has none."""
    decoder, line = codecs.getincrementaldecoder("utf-8")(), 1
    with open(path, "rb") as f:
        while True:
            chunk = f.read(block)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:  # e.object: the bytes held back from the last block, then this one
                return line + e.object.count(b"\n", 0, e.start)
            if not chunk:
                return None
            line += chunk.count(b"\n")


def _text_of(record, where: str, field: str = TEXT_FIELD) -> str:
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        fields = f" (its fields: {', '.join(map(str, record))}); --text-field names another" \
            if isinstance(record, dict) and field not in record else ""
        raise DataError(f"{where}: record has no string {field!r} field{fields}")
    return text


def _jsonl_pieces(path: str, field: str):
    with open(path, "rb") as f:  # decoded a line at a time, so that invalid UTF-8 is reported at its line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 ({e.reason} at byte {e.start + 1} of the line)") from None
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
                yield _text_of(record, f"{path}:{lineno}", field), True


def _parquet_pieces(path: str, field: str):
    import pyarrow.parquet as pq  # only needed for parquet input

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    if field not in pf.schema_arrow.names:
        raise DataError(f"{path}: parquet file has no {field!r} column (columns: {pf.schema_arrow.names}); "
                        f"--text-field names another")
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield _text_of({field: text}, path, field), True


def file_pieces(paths, field: str = TEXT_FIELD, paragraphs: bool = False):
    for path in paths:
        if path.endswith(".jsonl"):
            yield from _jsonl_pieces(path, field)
        elif path.endswith(".parquet"):
            yield from _parquet_pieces(path, field)
        else:
            yield from _text_pieces(path, paragraphs)


def _not_text(path: str) -> str | None:
    """Why path cannot be tokenized (it is compressed, binary, or part of a datasets save_to_disk directory),
    or None when it can."""
    if path.endswith(".parquet"):
        return None
    if path.endswith(".arrow"):
        return "an Arrow file (datasets' save_to_disk writes these): pass its directory as --input"
    directory = os.path.dirname(path) or "."
    if os.path.basename(path) in SAVED_METADATA and saved_dataset_kind(os.listdir(directory)):
        return f"the metadata of the datasets save_to_disk directory {directory}: pass the directory as --input"
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    compressed = next((name for name, signature in COMPRESSED.items() if re.match(signature, head)), None)
    if compressed:
        return f"{compressed}-compressed; compressed input is not supported, decompress it first"
    if b"\0" in head:
        return f"a binary file (NUL bytes in its first {SNIFF_BYTES} bytes), not UTF-8 text"
    return None


def _files_under(directory: str) -> list[str]:
    """Text-like, .jsonl and .parquet files under directory, recursively, sorted; hidden ones skipped, and so
    are other files that are not text (.arrow files among them).

    A datasets save_to_disk directory met here (inside a directory, or matched by a glob) is refused with a
    DataError rather than skipped: its documents are in Arrow files, which are never read as text, and its
    JSON metadata is no document either, so skipping it would leave its documents out without a word.
    Given as --input on its own, it is read (_saved_pieces)."""
    found = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if kind := saved_dataset_kind(names):
            raise DataError(f"{root}: a datasets save_to_disk directory ({kind}) within the input; its "
                            f"documents are in Arrow files: pass it as --input on its own")
        found += [os.path.join(root, n) for n in names if not n.startswith(".")]
    return sorted(p for p in found if _not_text(p) is None)


# The files of a datasets save_to_disk directory: a Dataset has these two (and data-*.arrow), a DatasetDict
# has dataset_dict.json and one such Dataset directory per split.
SAVED_DATASET = ("dataset_info.json", "state.json")
SAVED_DATASET_DICT = "dataset_dict.json"
SAVED_METADATA = {*SAVED_DATASET, SAVED_DATASET_DICT}


def saved_dataset_kind(names) -> str | None:
    """"DatasetDict" or "Dataset" when the file names of a directory are those datasets' save_to_disk
    writes, else None. Pure: takes the listing, so a test needs no directory."""
    names = set(names)
    if SAVED_DATASET_DICT in names:
        return "DatasetDict"
    if set(SAVED_DATASET) <= names:
        return "Dataset"
    return None


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise DataError("reading a Hugging Face dataset needs the datasets package: pip install datasets") from None
    return datasets


def _saved_pieces(path: str, kind: str, split: str | None, field: str):
    """The text column (field) of a save_to_disk directory (of --hf-split, default train, for a DatasetDict), read
    with datasets.load_from_disk. The split and the column are checked now; the rows are read lazily."""
    datasets = _import_datasets()
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:
        raise DataError(f"{path}: could not load the save_to_disk {kind} ({first_line(e)})") from None
    if isinstance(ds, datasets.DatasetDict):
        split = split or "train"
        if split not in ds:
            raise DataError(f"{path}: no split {split!r} in this DatasetDict (splits: {', '.join(ds)}); "
                            f"choose one with --hf-split")
        ds, where = ds[split], f"{path} split {split}"
    elif split:
        raise UsageError(f"--hf-split {split}: {path} is a save_to_disk Dataset, a single split; drop --hf-split")
    else:
        where = path
    if field not in ds.column_names:
        raise DataError(f"{where}: no {field!r} column (columns: {', '.join(ds.column_names)}); --text-field "
                        f"names another")
    return ((_text_of({field: text}, where, field), True)
            for batch in ds.select_columns([field]).iter(batch_size=1024) for text in batch[field])


def _hf_pieces(source: str, config: str | None = None, split: str = "train", field: str = TEXT_FIELD):
    """A Hugging Face hub dataset NAME (or NAME:CONFIG, the older spelling of --hf-config), its split, streamed.
    Set HF_HUB_OFFLINE=1 to use only the local cache."""
    datasets = _import_datasets()
    name, _, named = source.removeprefix(HF_PREFIX).partition(":")
    if named and config:
        raise UsageError(f"--input {source} names the config {named!r} and --hf-config names {config!r}; "
                         f"give it once, with --hf-config")
    config = config or named or None
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:
        what = f"{name!r}" + (f" (config {config!r}, split {split!r})" if config else f" (split {split!r})")
        raise DataError(f"could not load Hugging Face dataset {what}: {first_line(e)}") from None
    return ((_text_of(record, f"dataset {name}", field), True) for record in ds)


def _is_hf_name(source: str) -> bool:
    if source.startswith(HF_PREFIX):
        return True
    # "owner/name[:config]", unless its first part exists here: then it is a mistyped local path.
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+(:[\w.-]+)?", source)) and not os.path.exists(source.split("/")[0])


def source_pieces(source, hf_config: str | None = None, hf_split: str | None = None, text_field: str = TEXT_FIELD,
                  paragraphs: bool = False):
    """The (text, starts_a_document) pieces of a file, directory, glob, datasets save_to_disk directory or
    Hugging Face hub dataset. Checks that the source exists now, before any work; reads lazily. hf_config
    applies to a hub dataset, hf_split (default train) to a hub dataset or a save_to_disk DatasetDict,
    text_field to records (.jsonl, .parquet, datasets), paragraphs to text files (a document each)."""
    source = os.fspath(source)
    if os.path.isdir(source) and (kind := saved_dataset_kind(os.listdir(source))):
        if hf_config:
            raise UsageError(f"--hf-config {hf_config}: {source} is a save_to_disk {kind}, which has no configs")
        return _saved_pieces(source, kind, hf_split, text_field)
    if os.path.isdir(source) or os.path.isfile(source) or any(c in source for c in "*?["):
        if hf_config or hf_split:
            flag = "--hf-config" if hf_config else "--hf-split"
            raise UsageError(f"{flag} applies to Hugging Face datasets (a hub name or a save_to_disk "
                             f"directory), not to {source}")
        matches = [source] if os.path.exists(source) else sorted(glob.glob(source, recursive=True))
        for path in matches:  # a file named or globbed must be text; a directory's other files are skipped
            if not os.path.isdir(path) and (why := _not_text(path)):
                raise DataError(f"{path}: {why}")
        files = [f for m in matches for f in (_files_under(m) if os.path.isdir(m) else [m])]
        if not files:
            raise DataError(f"no text, .jsonl or .parquet files found in {source}")
        return file_pieces(files, text_field, paragraphs)
    if _is_hf_name(source):
        return _hf_pieces(source, hf_config, hf_split or "train", text_field)
    raise DataError(f"input {source} not found: expected a file, a directory, a glob, "
                    f"or a Hugging Face dataset as owner/name or {HF_PREFIX}NAME")


# The default corpus (prepare.default_corpus): the Python standard library's own sources.
STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "__pycache__"}


def stdlib_sources() -> list[str]:
    """The standard library's .py files (no tests, no idlelib, no site-packages) in a fixed shuffled order,
    so that the val split and each train shard sample the whole library rather than an alphabetical slice."""
    files = []
    for root, dirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = [d for d in dirs if d not in STDLIB_SKIP_DIRS]
        files += [os.path.join(root, n) for n in names if n.endswith(".py")]
    files.sort()
    random.Random(0).shuffle(files)
    return files
