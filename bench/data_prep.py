"""Data preparation throughput: prepare.prepare against raw tiktoken on the same text, tokens/s, medians.

    python bench/data_prep.py [--input SRC] [--repeats 5] [--warmup 1] [--shard-tokens N --val-tokens N]

raw: enc.encode_ordinary_batch over the texts prepare.py would encode (already in memory, the same number of
threads prepare.py uses): the ceiling for data preparation. prepare: prepare.prepare from reading the files to
fsync'ed shards on disk. SRC is anything `python prepare.py --input` accepts; the default is the text of the
default corpus (sources.stdlib_sources(), copied in their order into a temporary directory).

The two are measured in turn (raw, prepare, raw, prepare, ...) after untimed warm-up runs of each, so that
other work on the machine slows both alike; the ratio is reported both of the medians and as the median of
each pair's ratio.
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

import tiktoken

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import prepare  # noqa: E402
import sources  # noqa: E402
import tokenizer  # noqa: E402
from cli import DataError, HelpFormatter, ScriptParser  # noqa: E402
from hardware import cpu_name  # noqa: E402


def parse_args(argv):
    p = ScriptParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--input", metavar="SRC", help="what to tokenize (default: the default corpus's sources)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each; the table reports medians")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of each first (page cache, threads)")
    p.add_argument("--tokenizer", default="gpt2", help="prepare.py --tokenizer for every run")
    p.add_argument("--shard-tokens", type=int, default=prepare.CORPUS_SHARD_TOKENS, metavar="N",
                   help="prepare.py --shard-tokens (default: the default corpus's, %(default)s)")
    p.add_argument("--val-tokens", type=int, default=prepare.CORPUS_VAL_TOKENS, metavar="N",
                   help="prepare.py --val-tokens (default: the default corpus's, %(default)s)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def copy_default_corpus(directory: str) -> str:
    """The default corpus's source files, copied into directory as 0000.py, 0001.py, ... (their order)."""
    for i, path in enumerate(sources.stdlib_sources()):
        shutil.copyfile(path, os.path.join(directory, f"{i:04d}.py"))
    return directory


def measure(run) -> tuple[float, float]:
    """(tokens/s, CPU seconds of this process per million tokens) of one call of run(), which returns its
    token count. CPU time hardly depends on other work on the machine, so it tells work from waiting."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return tokens / wall, cpu / tokens * 1e6


def raw_tokens(enc: tiktoken.Encoding, texts: list[str], threads: int) -> int:
    return sum(map(len, enc.encode_ordinary_batch(texts, num_threads=threads)))


def prepare_tokens(source: str, args, out: str) -> int:
    with contextlib.redirect_stdout(io.StringIO()):  # its summary line, once per run
        return prepare.prepare(source, out, args.tokenizer, args.shard_tokens, args.val_tokens)["tokens"]


def measure_pair(enc, texts, threads, source, args, scratch):
    """One raw run, then one prepare.prepare run into a fresh directory (removed afterwards, untimed)."""
    raw = measure(lambda: raw_tokens(enc, texts, threads))
    out = tempfile.mkdtemp(dir=scratch)
    try:
        return raw, measure(lambda: prepare_tokens(source, args, out))
    finally:
        shutil.rmtree(out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    threads = os.cpu_count() or 1  # as prepare._encode
    with tempfile.TemporaryDirectory() as scratch:
        try:
            source = args.input or copy_default_corpus(tempfile.mkdtemp(dir=scratch))
            enc = tokenizer.get_tokenizer(args.tokenizer)
            texts = [text for text, _ in sources.source_pieces(source)]
            for _ in range(args.warmup):
                measure_pair(enc, texts, threads, source, args, scratch)
            pairs = [measure_pair(enc, texts, threads, source, args, scratch) for _ in range(args.repeats)]
        except (DataError, ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    (raw, raw_cpu), (prep, prep_cpu) = ([list(v) for v in zip(*side)] for side in zip(*pairs))
    med = statistics.median
    ratios = [p / r for r, p in zip(raw, prep)]
    print()
    print(f"command: python bench/data_prep.py {shlex.join(argv)}")
    print(f"input: {args.input or 'default corpus (stdlib sources)'}: {len(texts):,} texts, "
          f"{sum(map(len, texts)) / 1e6:,.1f} M characters; {cpu_name()}, "
          f"{threads} tokenizer threads, tiktoken {tiktoken.__version__}, python {platform.python_version()}")
    rows = [
        ("tokens/s (median)", f"{med(raw):,.0f}", f"{med(prep):,.0f}", f"{med(prep) / med(raw):.3f}"),
        ("tokens/s (min .. max)", f"{min(raw):,.0f} .. {max(raw):,.0f}", f"{min(prep):,.0f} .. {max(prep):,.0f}", ""),
        ("ratio of each pair", "", "", f"{med(ratios):.3f} ({min(ratios):.3f} .. {max(ratios):.3f})"),
        ("CPU s per M tokens (median)", f"{med(raw_cpu):.3f}", f"{med(prep_cpu):.3f}",
         f"{med(prep_cpu) / med(raw_cpu):.3f}"),
    ]
    header = (f"{args.repeats} runs each", "raw encode_ordinary_batch", "prepare.prepare", "prepare / raw")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |")


if __name__ == "__main__":
    main()
