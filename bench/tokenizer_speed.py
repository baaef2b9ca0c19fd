"""Tokenizer throughput of prepare.py with a tokenizer.json: its encoding pipeline against the tokenizers
library's own encode_batch on the same text, tokens/s, medians.

    python bench/tokenizer_speed.py [--input SRC] [--tokenizer PATH] [--repeats 5] [--warmup 1]

encode_batch: tokenizers.Tokenizer.from_file(PATH).encode_batch over the texts prepare.py would encode
(already in memory, in one call: the library spreads it over its own threads), counting each encoding's
tokens; encode_batch_fast: the same without the character offsets, which prepare.py uses.
prepare._encode: what prepare.py does with the same texts between reading them and writing shards,
batches in its tokenizer threads, a separator before each document, the tokens as one array per batch in
the shard dtype. prepare.prepare: the whole preparation, from reading the files to fsync'ed shards on disk
(train shards only).
SRC is anything `python prepare.py --input` accepts; the default is the text of the default corpus
(sources.stdlib_sources(), copied in their order into a temporary directory). PATH defaults to GPT-2's
byte-level BPE written as a tokenizer.json from tiktoken's ranks (hf.py's export does the same).

The four are measured in turn after untimed warm-up runs of each, so that other work on the machine slows
all alike; the ratios to the library's calls are of the medians, and in brackets the median of each round's.
"""

import contextlib
import io
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time

import tokenizers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import prepare  # noqa: E402
import sources  # noqa: E402
import tokenizer  # noqa: E402
from cli import DataError, HelpFormatter, ScriptParser  # noqa: E402
from hardware import cpu_name  # noqa: E402
from data_prep import copy_default_corpus  # noqa: E402


def parse_args(argv):
    p = ScriptParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--input", metavar="SRC", help="what to tokenize (default: the default corpus's sources)")
    p.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json (default: GPT-2's, from tiktoken's ranks)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds; the table reports medians")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (page cache, threads)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def write_gpt2_tokenizer_json(path: str) -> str:
    vocab, merges = tokenizer.gpt2_vocab_and_merges(tokenizer.get_tokenizer("gpt2"))
    tokenizer.fast_tokenizer(vocab, merges).save(path)
    return path


def timed(run) -> float:
    """tokens/s of one call of run(), which returns its token count."""
    start = time.perf_counter()
    tokens = run()
    return tokens / (time.perf_counter() - start)


def one_round(own, enc, texts, pieces, source, path, scratch) -> tuple[float, float, float, float]:
    raw = timed(lambda: sum(map(len, own.encode_batch(texts, add_special_tokens=False))))
    fast = timed(lambda: sum(map(len, own.encode_batch_fast(texts, add_special_tokens=False))))
    pipeline = timed(lambda: sum(len(tokens) for tokens, _ in prepare._encode(iter(pieces), enc)))
    out = tempfile.mkdtemp(dir=scratch)
    os.rmdir(out)  # prepare wants to create it
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its summary line, once per run
            whole = timed(lambda: prepare.prepare(source, out, path, shard_tokens=prepare.CORPUS_SHARD_TOKENS,
                                                  val_tokens=0)["tokens"])  # no val split: any input will do
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return raw, fast, pipeline, whole


def table(header, rows) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join(lines + ["| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |" for row in rows])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        try:
            source = args.input or copy_default_corpus(tempfile.mkdtemp(dir=scratch))
            path = args.tokenizer or write_gpt2_tokenizer_json(os.path.join(scratch, "gpt2_tokenizer.json"))
            enc = tokenizer.load_tokenizer(path)  # first: a path that is no tokenizer is its one-line error
            own = tokenizers.Tokenizer.from_file(path)
            pieces = list(sources.source_pieces(source))
            texts = [text for text, _ in pieces]
            for _ in range(args.warmup):
                one_round(own, enc, texts, pieces, source, path, scratch)
            rounds = [one_round(own, enc, texts, pieces, source, path, scratch) for _ in range(args.repeats)]
        except (DataError, ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    columns = [list(column) for column in zip(*rounds)]
    med = statistics.median

    def ratios(base):
        return [f"{med(c) / med(base):.3f} ({med(x / b for b, x in zip(base, c)):.3f})" for c in columns]

    print()
    print(f"command: python bench/tokenizer_speed.py {shlex.join(argv)}")
    print(f"input: {args.input or 'default corpus (stdlib sources)'}: {len(texts):,} texts, "
          f"{sum(map(len, texts)) / 1e6:,.1f} M characters; tokenizer {args.tokenizer or 'GPT-2 tokenizer.json'} "
          f"({enc.n_vocab:,} ids)")
    print(f"CPU: {cpu_name()}; tokenizers {tokenizers.__version__}, "
          f"python {platform.python_version()}")
    rows = [("tokens/s (median)", *(f"{med(c):,.0f}" for c in columns)),
            ("tokens/s (min .. max)", *(f"{min(c):,.0f} .. {max(c):,.0f}" for c in columns)),
            ("/ encode_batch", *ratios(columns[0])),
            ("/ encode_batch_fast", *ratios(columns[1]))]
    header = (f"{args.repeats} rounds", "encode_batch", "encode_batch_fast", "prepare._encode", "prepare.prepare")
    print(table(header, rows))


if __name__ == "__main__":
    main()
