"""Score a checkpoint outside training: HellaSwag accuracy, or bits per byte (and loss) on a val split.

    python score.py --ckpt out/ckpt_00000150.pt --task hellaswag --n 1000       # the hub's Rowan/hellaswag
    python score.py --ckpt out/hf --task hellaswag --hellaswag-path hellaswag_val.jsonl   # an hf.py directory
    python score.py --ckpt out/ckpt_00000150.pt --task bpb                  # the val split it trained with

--ckpt takes a train.py checkpoint (a file or a sharded directory) or a Hugging Face directory written by
hf.py (recognised by its config.json). The figures come from the code training logs them with
(evaluation.Evaluator), so on the same weights, tokens and precision this script prints what metrics.jsonl
holds: hellaswag_acc and hellaswag_acc_sum, or val_loss and val_bpb over --n val tokens in whole batches of
--batch-size sequences of the model's seq_len, the windows a training run with that micro-batch reads.
bpb reads the val split of the data the checkpoint trained on unless --data names other shards, and then
says so; the shards' tokenizer must be the model's, as train.py requires, and counts the bytes. HellaSwag is
encoded with the model's tokenizer (trained.model_tokenizer: its training data's, or an hf.py directory's).
"""

import argparse
import os
import sys

import torch

from checkpoint import CheckpointError
from cli import (ArgumentParser, DataError, HelpFormatter, UsageError, closed_stdout, plural, report_error,
                 unwritable_stdout)
from config import ACTIVATION_DTYPES, DEVICES, DTYPES, EvalConfig
from data import DEFAULT_VOCAB, tokenizer_id
from distributed import DistInfo
from evaluation import Evaluator
from hardware import activation_dtype, autocast, resolve_device, resolve_dtype
from mixture import check_sources, data_fingerprint, is_mixture, label, parse_data, record_dir, vocab_problem
from prepare import default_corpus, default_corpus_dir
from sample import load_model, say
from shards import data_record
from tokenizer import TOKENIZER_FILE, fits_vocab, load_tokenizer, tokenizer_flag
from trained import check_tokenizer, model_tokenizer, trained_meta

TASKS = ("hellaswag", "bpb")
PRECISIONS = {None: "fp32", torch.bfloat16: "bf16 autocast", torch.float16: "fp16 autocast"}


def build_parser() -> argparse.ArgumentParser:
    defaults = EvalConfig()
    p = ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--ckpt", required=True, metavar="PATH",
                   help="a train.py checkpoint (file or sharded directory), a run directory (its newest good "
                        "checkpoint) or an hf.py directory")
    p.add_argument("--task", choices=TASKS, help="what to score (required): " + ", ".join(TASKS))
    p.add_argument("--n", type=int, default=None, metavar="N",
                   help=f"hellaswag: the first N examples (default: all); bpb: N val tokens "
                        f"(default: {defaults.eval_tokens}, as --eval-tokens)")
    p.add_argument("--data", metavar="DIR|MIX",
                   help="bpb: the val_*.bin shards to score, a directory or a mixture as train.py --data takes it "
                        "(default: the data the checkpoint trained on, its recorded --data; an hf.py directory "
                        "records none: the stdlib corpus, GPT-2's tokens, with a note)")
    p.add_argument("--hellaswag-path", default=defaults.hellaswag_path,
                   help=f"a hub dataset name or a .jsonl / .parquet file (default: {defaults.hellaswag_path})")
    p.add_argument("--tokenizer", type=tokenizer_flag, metavar="NAME|PATH",
                   help="hellaswag: the tokenizer the model was trained with, as prepare.py --tokenizer takes it "
                        "(default: the one its training data's data.json records, else GPT-2's)")
    p.add_argument("--batch-size", type=int, default=16, help="bpb: sequences per forward (default: 16)")
    p.add_argument("--device", default="auto", choices=DEVICES, help="where the model runs")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="autocast dtype; auto decides as train.py's --dtype auto does, so that a run's own eval and "
                        "this agree on the machine it ran on")
    p.add_argument("--activation-dtype", default="auto", choices=ACTIVATION_DTYPES,
                   help="the residual stream's dtype under bf16 autocast, as train.py's --activation-dtype takes it "
                        "(auto: bf16 under bf16 autocast on CUDA, else fp32)")
    return p


def load(path: str, device: torch.device):
    """The model at path: an hf.py directory if it holds config.json, else a train.py checkpoint."""
    if not os.path.exists(path):
        raise UsageError(f"--ckpt {path}: no such file or directory")
    if os.path.isfile(os.path.join(path, "config.json")):
        return load_model(hf=path, device=device)
    return load_model(ckpt=path, device=device)


def val_data(given: str | None, meta: dict | None, ckpt: str) -> tuple[str | None, str | None]:
    """bpb: (the data whose val split to score, a directory or a mixture as train.py's --data, None for the
    default corpus; a note to print with the figures, or None). By default the data the checkpoint trained on
    (its recorded --data, None being the default corpus, as in train.py); UsageError when a directory of it is
    not there. Data other than the checkpoint's is scored with a note: told by content (the fingerprint of its
    train shards that the checkpoint recorded), so a copy elsewhere is the same data and a directory prepared
    again is not; by path for a checkpoint without a fingerprint. Nothing recorded (an hf.py directory): --data,
    or the default corpus with a note. meta: the checkpoint's (trained.trained_meta)."""
    meta = meta or {}
    recorded = (meta.get("train_config") or {}).get("data") or {}
    if "data" not in recorded:
        if given is None:
            return None, (f"note: {ckpt} records no training data, so this is the default corpus; give --data "
                          f"for the data it trained on")
        return given, None
    trained = recorded["data"]
    if given is None:
        sources = parse_data(trained) if trained is not None else []
        if missing := [s for s in sources if not os.path.isdir(s.dir)]:
            what = f"whose {label(missing[0])} is" if is_mixture(sources) else "which is"
            raise UsageError(f"--ckpt {ckpt} trained on --data {trained}, {what} not there; give --data DIR "
                             f"for the shards to score")
    scored = given if given is not None else trained
    if meta.get("data") is not None:
        same = same_shards(scored or default_corpus_dir(), meta["data"])
    else:
        same = given is None or given == trained or (
            os.path.realpath(given) == os.path.realpath(trained or default_corpus_dir()))
    if same:
        return scored, None
    return scored, (f"note: --data {scored or 'the default corpus'} is not the data the checkpoint trained on "
                    f"({'prepared again since' if scored == trained else trained or 'the default corpus'}): these "
                    "figures do not compare with the run's")


def same_shards(spec: str, recorded: list) -> bool:
    """Whether --data spec holds the train shards a checkpoint recorded (mixture.data_fingerprint), wherever it
    lies; False where its shards cannot be read (scoring them then says why)."""
    try:
        return data_fingerprint(spec) == recorded
    except (DataError, UsageError, OSError):
        return False


def check_args(a: argparse.Namespace) -> None:
    """The numbers, before anything is loaded."""
    if a.n is not None and a.n < 1:
        raise UsageError(f"--n must be >= 1, got {a.n}")
    if a.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {a.batch_size}")


def prepare(a: argparse.Namespace, model, device: torch.device, data: str | None = None) -> Evaluator:
    """An Evaluator for the task, its inputs read and checked (one-line errors before any forward). data:
    bpb's shards, a directory or a mixture as train.py's --data (None: the default corpus), which must be of
    the model's tokenizer (data.check_vocab)."""
    seq_len = model.config.max_seq_len
    if a.task == "hellaswag":
        cfg = EvalConfig(eval_interval=0, hellaswag_path=a.hellaswag_path)
        enc = load_tokenizer(a.tokenizer) if a.tokenizer else model_tokenizer(a.ckpt) or load_tokenizer()
        check_tokenizer(a.ckpt, tokenizer_id(enc.record()), say)
        evaluator = Evaluator(cfg, None, DistInfo(), device, model.config.vocab_size, seed=0, tokenizer=enc)
        evaluator.load_hellaswag(seq_len, a.n)
        return evaluator
    data = data or scored_default_corpus(model.config.vocab_size, a.ckpt)
    sources = parse_data(data)
    check_sources(sources)
    check_tokenizer(a.ckpt, tokenizer_id(data_record(record_dir(sources))), say, "--data")
    if problem := vocab_problem(model.config.vocab_size, sources):
        raise DataError(problem)
    cfg = EvalConfig(eval_tokens=a.n or EvalConfig().eval_tokens)
    evaluator = Evaluator(cfg, data, DistInfo(), device, model.config.vocab_size, seed=0)
    evaluator.check_val(a.batch_size, seq_len)
    smallest = min(evaluator.val_reads, key=lambda read: read.split_windows)
    if a.batch_size > smallest.split_windows:  # each forward would read windows twice, and hold them all at once
        where = f"source {smallest.name}'s val split" if smallest.name else "the val split"
        raise UsageError(f"--batch-size {a.batch_size:,} is more than {where} holds ({smallest.split_windows:,} "
                         f"windows of {seq_len}): give at most {smallest.split_windows:,}")
    return evaluator


def scored_default_corpus(vocab_size: int, ckpt: str) -> str:
    """The default corpus's directory, built on first use, for bpb with no --data: the checkpoint trained on it
    or records no data. DataError (one line: what to give as --data) before building it, for a model whose
    vocabulary is not GPT-2's, which the corpus is tokenized with (so it records no data: train.py refuses such a
    run on it); an hf.py directory is told the prepare.py command that tokenizes with its own tokenizer."""
    if fits_vocab(vocab_size, DEFAULT_VOCAB):
        return default_corpus()
    own = os.path.isfile(os.path.join(ckpt, TOKENIZER_FILE))
    how = f" (python prepare.py --input TEXT --out DIR --tokenizer {ckpt}, then --data DIR)" if own else ""
    raise DataError(f"--task bpb: {ckpt} records no training data and no --data was given, so it would score the "
                    f"default corpus, made with the gpt2 tokenizer ({DEFAULT_VOCAB:,} ids), which the model's "
                    f"vocabulary ({vocab_size:,} ids) does not fit: pass --data with val shards prepared with the "
                    f"model's tokenizer{how}")


def scored_tokens(evaluator: Evaluator, batch_size: int, seq_len: int) -> list[str]:
    """The line that says how many val tokens bpb scored, then the notes on --n that a training run gives on
    --eval-tokens: --n in whole batches, rounded down, at least one, at most what a val split holds
    (evaluation.eval_batches), as the run's eval reads them; a mixture's from each source."""
    counts = {read.name: read.windows * seq_len for read in evaluator.val_reads}  # check_val's record
    each = "".join(f"{count:,} of {name}; " for name, count in counts.items()) if len(counts) > 1 else ""
    line = (f"bpb: {sum(counts.values()):,} val tokens of {evaluator.data} ({each}whole batches of {batch_size} x "
            f"{seq_len}, the windows a training run's eval reads)")
    return [line] + (evaluator.val_note or "").replace("--eval-tokens", "--n").splitlines()


def precision(model, dtype: torch.dtype | None) -> str:
    """How the model ran: its autocast, and a residual stream in bf16 where it was."""
    return PRECISIONS[dtype] + (", bf16 activations" if model.activation_dtype == torch.bfloat16 else "")


def report(a: argparse.Namespace, evaluator: Evaluator, model, device: torch.device, dtype: torch.dtype | None
           ) -> list[str]:
    """Run the task under autocast to dtype (None: fp32) -> the lines to print: what was evaluated, then one
    metric per line."""
    if a.task == "hellaswag":
        metrics, n = evaluator.hellaswag(model, dtype), len(evaluator.choices)
        return [f"hellaswag: {plural(n, 'example')} of {a.hellaswag_path}, model {a.ckpt}, {precision(model, dtype)}",
                f"hellaswag_acc      {metrics['hellaswag_acc']:.4f} ({round(metrics['hellaswag_acc'] * n)}/{n}, "
                "lowest mean loss per ending token)",
                f"hellaswag_acc_sum  {metrics['hellaswag_acc_sum']:.4f} "
                f"({round(metrics['hellaswag_acc_sum'] * n)}/{n}, lowest summed loss)"]
    seq_len = model.config.max_seq_len
    metrics = evaluator.val_metrics(model, model, lambda: autocast(device, dtype), a.batch_size, seq_len)
    first, *notes = scored_tokens(evaluator, a.batch_size, seq_len)
    lines = [f"{first}, model {a.ckpt}, {precision(model, dtype)}", *notes, f"val_loss  {metrics['val_loss']:.4f}"]
    if "val_bpb" in metrics:
        lines.append(f"val_bpb   {metrics['val_bpb']:.4f}")
    else:
        lines.append(f"val_bpb   n/a ({evaluator.no_bpb_reason or 'the val tokens read hold no bytes of text'})")
    width = max(map(len, metrics))  # a mixture's sources, each under its own name (val_loss/NAME)
    lines += [f"{key.ljust(width)}  {value:.4f}" for key, value in metrics.items() if "/" in key]
    return lines


def main(argv=None) -> int:
    try:
        a = build_parser().parse_args(argv)
        if a.task is None:
            raise UsageError(f"--task is required: choose one of {', '.join(TASKS)}")
        check_args(a)
        device, _ = resolve_device(a.device)
        dtype, _ = resolve_dtype(a.dtype, device)
        stream = activation_dtype(a.activation_dtype, dtype, device)
        model = load(a.ckpt, device)
        model.activation_dtype = stream
        data, note = val_data(a.data, trained_meta(a.ckpt), a.ckpt) if a.task == "bpb" else (None, None)
        evaluator = prepare(a, model, device, data)
    except (UsageError, CheckpointError, DataError, ValueError, OSError) as e:
        return report_error(e)
    lines = report(a, evaluator, model, device, dtype)
    lines[1:1] = [note] if note else []  # under the line that says what was evaluated
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # `| head -n 1`: the reader has what it wanted
        return closed_stdout()
    except OSError as e:  # a redirect to a full disk
        return unwritable_stdout(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
