"""The recipe bench's anchor: GPT-2's architecture (learned positions, LayerNorm, GELU MLP, tied head), built by
transformers' GPT2LMHeadModel as an outside reference, trained with AdamW on train.py's shards and evaluated on
the val tokens train.py's eval reads.

    python bench/anchor.py --data DIR --lr 1e-3 --max-tokens 1048576 --out-dir OUT [--n-layer 4 --n-embd 256
                           --seq-len 256 --batch-size 16 --eval-interval 16 --eval-tokens 32768 --seed 1]

OUT/metrics.jsonl has train.py's fields that bench/recipe.py reads (step, tokens, val_loss, tokens_per_sec),
one line a step, val_loss on eval steps and the last; OUT/summary.json its parameter count. The schedule is
nanoGPT's: linear warm-up over the first 10% of the steps, then cosine to a tenth of the peak; AdamW betas
(0.9, 0.95), weight decay 0.1 on the matrices only, gradients clipped at 1.0.
"""

import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cli import DataError, HelpFormatter, ScriptParser, count  # noqa: E402
from data import ShardLoader  # noqa: E402
from evaluation import VAL_SEED, eval_batches  # noqa: E402
from shards import data_record  # noqa: E402


def gpt2_model(vocab_size: int, n_layer: int, n_embd: int, n_head: int, seq_len: int, seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    return GPT2LMHeadModel(config)


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 10% of the steps, then cosine down to peak / 10 at the last."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup + 1) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def adamw(model, lr: float) -> torch.optim.AdamW:
    """Weight decay on the matrices (embeddings included, as nanoGPT does), none on biases and LayerNorms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


@torch.no_grad()
def val_loss(model, data: str, batch_size: int, seq_len: int, eval_tokens: int) -> float:
    """Mean loss over the val tokens train.py's eval reads at this batch shape on one rank: the first
    eval_batches batches of the val split's windows in the permutation evaluation.VAL_SEED draws."""
    model.eval()
    loader = ShardLoader(data, split="val", batch_size=batch_size, seq_len=seq_len, shuffle=True, seed=VAL_SEED,
                         prefetch=0)
    n = eval_batches(eval_tokens, loader.num_windows, batch_size, seq_len, 1)
    total = 0.0
    with loader:
        for _, (x, y) in zip(range(n), loader):
            total += F.cross_entropy(model(x).logits.flatten(0, 1).float(), y.flatten()).item()
    model.train()
    return total / n


def train(a) -> None:
    vocab = (data_record(a.data) or {}).get("n_vocab", 50257)
    model = gpt2_model(vocab, a.n_layer, a.n_embd, a.n_head, a.seq_len, a.seed)
    optimizer = adamw(model, a.lr)
    tokens_per_step = a.batch_size * a.seq_len
    steps = max(1, a.max_tokens // tokens_per_step)
    os.makedirs(a.out_dir, exist_ok=True)
    params = sum(p.numel() for p in model.parameters())
    with open(os.path.join(a.out_dir, "summary.json"), "w") as f:
        json.dump({"params": params, "steps": steps, "tokens_per_step": tokens_per_step}, f)
    started = time.perf_counter()
    loader = ShardLoader(a.data, split="train", batch_size=a.batch_size, seq_len=a.seq_len, seed=a.seed)
    with loader, open(os.path.join(a.out_dir, "metrics.jsonl"), "w") as log:
        for step, (x, y) in zip(range(steps), loader):
            t0 = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, steps, a.lr)
            loss = F.cross_entropy(model(x).logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - t0
            record = {"step": step + 1, "tokens": (step + 1) * tokens_per_step,
                      "time_s": round(time.perf_counter() - started, 3), "train_loss": loss.item(),
                      "lr": optimizer.param_groups[0]["lr"], "tokens_per_sec": tokens_per_step / seconds}
            if (step + 1) % a.eval_interval == 0 or step + 1 == steps:
                record["val_loss"] = val_loss(model, a.data, a.batch_size, a.seq_len, a.eval_tokens)
                print(f"step {step + 1}/{steps}: train loss {record['train_loss']:.4f}, "
                      f"val loss {record['val_loss']:.4f}", flush=True)
            log.write(json.dumps(record) + "\n")
            log.flush()


def main(argv=None):
    p = ScriptParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--data", required=True, help="shards as prepare.py writes them")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--lr", type=float, required=True, help="AdamW's peak LR")
    p.add_argument("--max-tokens", type=int, required=True, help="train tokens (whole batches)")
    p.add_argument("--n-layer", type=count, default=4, help="transformer blocks")
    p.add_argument("--n-embd", type=count, default=256, help="model width")
    p.add_argument("--n-head", type=count, default=4, help="attention heads; must divide --n-embd")
    p.add_argument("--seq-len", type=count, default=256, help="tokens per training sequence")
    p.add_argument("--batch-size", type=count, default=16, help="sequences per step")
    p.add_argument("--eval-interval", type=count, default=16, help="steps between val-loss evals")
    p.add_argument("--eval-tokens", type=count, default=32768, help="as train.py's --eval-tokens")
    p.add_argument("--seed", type=int, default=1, help="initialisation and batch order")
    args = p.parse_args(argv)
    if not args.lr > 0:
        p.error(f"--lr must be positive, got {args.lr:g}")
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    try:
        train(args)
    except DataError as e:  # the shards: missing, damaged, too few tokens
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
