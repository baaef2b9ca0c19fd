"""Evaluate a trained model outside training: HellaSwag accuracy, or validation bits per byte (and loss).

    python eval.py --ckpt out/ckpt_00000150.pt --task hellaswag --n 1000       # the hub's Rowan/hellaswag
    python eval.py --ckpt out/hf --task hellaswag --hellaswag-path hellaswag_val.jsonl   # an export.py directory
    python eval.py --ckpt out/ckpt_00000150.pt --task bpb --data data/mine

--ckpt takes a train.py checkpoint (a file or a sharded directory) or a Hugging Face directory written by
export.py (recognised by its config.json). The figures come from the code training logs them with
(evaluate.Evaluator), so on the same weights, tokens and precision this script prints what metrics.jsonl
holds: hellaswag_acc and hellaswag_acc_sum, or val_loss and val_bpb over the first --n val tokens, taken
--batch-size sequences of the model's seq_len at a time as a training run with that micro-batch takes them.
"""

import argparse
import os
import sys

import torch

from checkpoint import CheckpointError
from cli import ArgumentParser, UsageError, report_error
from config import EvalConfig
from data import DataError, default_corpus
from distributed import DistInfo
from evaluate import Evaluator
from hardware import DEVICES, autocast, resolve_device
from sample import load_model

TASKS = ("hellaswag", "bpb")
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # the autocast dtype; fp32: none


def build_parser() -> argparse.ArgumentParser:
    defaults = EvalConfig()
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, metavar="PATH",
                   help="a train.py checkpoint (file or sharded directory) or an export.py directory")
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--n", type=int, default=None, metavar="N",
                   help=f"hellaswag: the first N examples (default: all); bpb: N val tokens "
                        f"(default: {defaults.eval_tokens}, as --eval-tokens)")
    p.add_argument("--data", metavar="DIR", help="bpb: the directory of val_*.bin shards (default: the stdlib "
                                                 "corpus, as train.py)")
    p.add_argument("--hellaswag-path", default=defaults.hellaswag_path,
                   help=f"a hub dataset name or a .jsonl / .parquet file (default: {defaults.hellaswag_path})")
    p.add_argument("--batch-size", type=int, default=16, help="bpb: sequences per forward (default: 16)")
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES), help="autocast dtype (default: fp32)")
    return p


def load(path: str, device: torch.device):
    """The model at path: an export.py directory if it holds config.json, else a train.py checkpoint."""
    if not os.path.exists(path):
        raise UsageError(f"--ckpt {path}: no such file or directory")
    if os.path.isfile(os.path.join(path, "config.json")):
        return load_model(hf=path, device=device)
    return load_model(ckpt=path, device=device)


def check_args(a: argparse.Namespace) -> None:
    """The numbers, before anything is loaded."""
    if a.n is not None and a.n < 1:
        raise UsageError(f"--n must be >= 1, got {a.n}")
    if a.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {a.batch_size}")


def prepare(a: argparse.Namespace, model, device: torch.device) -> Evaluator:
    """An Evaluator for the task, its inputs read and checked (one-line errors before any forward)."""
    seq_len = model.config.max_seq_len
    if a.task == "hellaswag":
        cfg = EvalConfig(eval_interval=0, hellaswag_path=a.hellaswag_path)
        evaluator = Evaluator(cfg, None, DistInfo(), device, model.config.vocab_size, seed=0)
        evaluator.load_hellaswag(seq_len, a.n)
        return evaluator
    cfg = EvalConfig(eval_tokens=a.n or EvalConfig().eval_tokens)
    evaluator = Evaluator(cfg, a.data or default_corpus(), DistInfo(), device, model.config.vocab_size, seed=0)
    evaluator.check_val(a.batch_size, seq_len)
    return evaluator


def report(a: argparse.Namespace, evaluator: Evaluator, model, device: torch.device) -> list[str]:
    """Run the task -> the lines to print: what was evaluated, then one metric per line."""
    dtype = DTYPES[a.dtype]
    if a.task == "hellaswag":
        metrics, n = evaluator.hellaswag(model, dtype), len(evaluator.choices)
        return [f"hellaswag: {n} examples of {a.hellaswag_path}, model {a.ckpt}",
                f"hellaswag_acc      {metrics['hellaswag_acc']:.4f} ({round(metrics['hellaswag_acc'] * n)}/{n}, "
                "lowest mean loss per ending token)",
                f"hellaswag_acc_sum  {metrics['hellaswag_acc_sum']:.4f} "
                f"({round(metrics['hellaswag_acc_sum'] * n)}/{n}, lowest summed loss)"]
    seq_len = model.config.max_seq_len
    metrics = evaluator.val_metrics(model, model, lambda: autocast(device, dtype), a.batch_size, seq_len)
    lines = [f"bpb: the first {evaluator.cfg.eval_tokens} val tokens of {evaluator.data_dir} (at most; whole "
             f"batches of {a.batch_size} x {seq_len}), model {a.ckpt}",
             f"val_loss  {metrics['val_loss']:.4f}"]
    if "val_bpb" in metrics:
        lines.append(f"val_bpb   {metrics['val_bpb']:.4f}")
    else:
        lines.append("val_bpb   n/a (the model's vocabulary is not GPT-2's, so the bytes per token are unknown)")
    return lines


def main(argv=None) -> int:
    try:
        a = build_parser().parse_args(argv)
        check_args(a)
        device, _ = resolve_device(a.device)
        model = load(a.ckpt, device)
        evaluator = prepare(a, model, device)
    except (UsageError, CheckpointError, DataError, ValueError, OSError) as e:
        return report_error(e)
    print("\n".join(report(a, evaluator, model, device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
