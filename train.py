"""Pretrain a Qwen3-style GPT on token shards.

    python train.py                          # small model on the embedded stdlib corpus
    python train.py --data DIR --n-layer 12  # your own shards (see `python data.py --help`)
    torchrun --nproc_per_node=8 train.py --dist fsdp --data DIR ...   # data parallel, one node

This file wires the pieces together: model.py builds the network, data.py streams batches,
optim.py builds the optimizer. The loop, checkpoints, logging and the LR schedule live here.
"""

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from statistics import median
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

import checkpoint
from cli import ArgumentParser, UsageError, report_error
import distributed
import fp8
import memory
from checkpoint import CheckpointError
from data import DataError, ShardLoader, default_corpus, get_tokenizer
from export import load_hf
from model import GPT, ModelConfig, flops_per_token, plain_to_te_state_dict, te_to_plain_state_dict
from optim import OptimConfig, build_optimizer, describe_param_groups, optimizer_state_bytes
from progress import Progress
from resilience import EarlyStopping, LossHealth, StopSignals, fits_by_trying, largest_fitting_batch, micro_batch_for
from sample import sample_text

# Dense bf16 tensor-core peak per GPU, from the vendors' datasheets. MFU is always quoted
# against this number (the llm.c / PaLM convention), whatever dtype the run uses.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "4090": 165e12,
}


PROFILE_WAIT, PROFILE_ACTIVE = 5, 3
DATA_WAIT_WARN = 0.05  # warn when waiting for batches takes more than this fraction of a step


@dataclass
class TrainConfig:
    data: str | None = None
    from_hf: str | None = None
    out_dir: str = "out"
    vocab_size: int = 50257
    batch_size: int | str = 16  # or "auto": the largest that fits (CUDA)
    grad_accum: int = 1
    total_batch_tokens: int = 0
    max_steps: int = 150
    max_tokens: int = 0
    warmup: int = 15
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    decay_frac: float = 0.2
    grad_clip: float = 1.0
    eval_interval: int = 50
    eval_tokens: int = 16384
    ckpt_interval: int = 50
    keep_ckpts: int = 2
    resume: bool = False
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"
    compile: str = "off"
    peak_tflops: float = 0.0
    log_interval: int = 10
    sample_tokens: int = 0
    sample_prompt: str = ""
    profile: bool = False
    max_bad_steps: int = 5
    on_bad_steps: str = "rollback"
    rollback_lr_factor: float = 0.5
    spike_factor: float = 3.0
    early_stop_patience: int = 0
    inject_nan_at_step: int = -1
    wandb: bool = False
    wandb_project: str = "pretrain"
    wandb_run_name: str | None = None
    wandb_tags: str | None = None
    wandb_mode: str = "auto"
    dist: str = "none"
    ddp_bucket_mb: float = 25.0
    reshard_after_forward: bool = True
    fp8: str = "off"  # off | te | torchao
    fp8_recipe: str = "current"  # te only: current | delayed
    fp8_attn: bool = False  # te only: FP8 attention (fp8_dpa)
    act_ckpt: str = "none"  # none | full | selective | alternate
    estimate_memory: bool = False


# ----------------------------------------------------------------------------- flags


def build_parser():
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t, m, o = TrainConfig(), ModelConfig(), OptimConfig()

    g = p.add_argument_group("data and output")
    g.add_argument("--data", default=t.data, help="directory of train_*.bin / val_*.bin shards "
                   "(default: the Python stdlib corpus, tokenized once and cached)")
    g.add_argument("--out-dir", default=t.out_dir, help="checkpoints and metrics.jsonl go here")
    g.add_argument("--vocab-size", type=int, default=t.vocab_size,
                   help="tokenizer vocabulary size (GPT-2: 50257); padded to a multiple of 128 in the model")

    g = p.add_argument_group("model")
    g.add_argument("--from-hf", default=t.from_hf, metavar="DIR",
                   help="start from the weights of a Hugging Face Qwen3 directory (export.py writes one); its "
                        "shape replaces the model flags, --seq-len still applies")
    g.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    g.add_argument("--n-head", type=int, default=4, help="query heads")
    g.add_argument("--n-kv-head", type=int, default=2, help="key/value heads (GQA); must divide --n-head")
    g.add_argument("--n-embd", type=int, default=128, help="model width")
    g.add_argument("--head-dim", type=int, default=m.head_dim, help="default: n_embd / n_head")
    g.add_argument("--ffn-dim", type=int, default=m.ffn_dim, help="SwiGLU hidden size (default: see model.py)")
    g.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence")
    g.add_argument("--rope-theta", type=float, default=m.rope_theta, help="RoPE base frequency")
    g.add_argument("--untied", action="store_true", help="separate lm_head and embedding weights")

    g = p.add_argument_group("batch and length")
    g.add_argument("--batch-size", type=batch_size_flag, default=t.batch_size,
                   help="micro-batch size in sequences, or auto (CUDA): the largest that fits in memory, with "
                        "--grad-accum derived so that --total-batch-tokens stays exact")
    # These four default to None so that giving both of a contradictory pair can be detected.
    g.add_argument("--grad-accum", type=int, help=f"micro-batches per optimizer step (default {t.grad_accum})")
    g.add_argument("--total-batch-tokens", type=int,
                   help="tokens per optimizer step; derives --grad-accum from it")
    g.add_argument("--max-steps", type=int, help=f"optimizer steps to train (default {t.max_steps})")
    g.add_argument("--max-tokens", type=int, help="train for this many tokens instead of --max-steps")

    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--optimizer", default=o.name, choices=["adamw", "adamw8bit", "muon"],
                   help="fused AdamW, bitsandbytes 8-bit AdamW, or Muon for the hidden matrices + AdamW for the rest")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (suits the small default model)")
    g.add_argument("--adam-lr", type=float, default=o.adam_lr,
                   help="peak LR of the AdamW side of a Muon run (embeddings, norms); default: --lr")
    g.add_argument("--weight-decay", type=float, default=o.weight_decay, help="decoupled, matrices only")
    g.add_argument("--beta1", type=float, default=o.betas[0], help="Adam first-moment decay")
    g.add_argument("--beta2", type=float, default=o.betas[1], help="Adam second-moment decay")
    g.add_argument("--muon-momentum", type=float, default=o.momentum, help="Muon's Nesterov momentum")
    g.add_argument("--ns-steps", type=int, default=o.ns_steps, help="Newton-Schulz iterations in Muon")
    g.add_argument("--ns-dtype", default=o.ns_dtype, choices=["auto", "bf16", "fp32", "fp64"],
                   help="Newton-Schulz dtype (auto: bf16 on CUDA, fp32 elsewhere)")
    g.add_argument("--muon-scale", default=o.muon_scale, choices=["original", "match_rms_adamw"],
                   help="Muon update scale: sqrt(max(1,rows/cols)) or 0.2*sqrt(max(rows,cols))")
    g.add_argument("--warmup", type=int, default=t.warmup, help="linear warm-up steps")
    g.add_argument("--schedule", default=t.schedule, choices=["cosine", "wsd"],
                   help="cosine decay, or warmup-stable-decay with a linear decay over the last --decay-frac")
    g.add_argument("--min-lr-ratio", type=float, default=t.min_lr_ratio, help="final LR as a fraction of peak")
    g.add_argument("--decay-frac", type=float, default=t.decay_frac, help="wsd: fraction of steps spent decaying")
    g.add_argument("--grad-clip", type=float, default=t.grad_clip, help="max global grad norm (0: off)")

    g = p.add_argument_group("evaluation, checkpoints, logging")
    g.add_argument("--eval-interval", type=int, default=t.eval_interval, help="steps between val-loss evals (0: off)")
    g.add_argument("--eval-tokens", type=int, default=t.eval_tokens, help="val tokens per eval")
    g.add_argument("--ckpt-interval", type=int, default=t.ckpt_interval, help="steps between checkpoints (0: only at the end)")
    g.add_argument("--keep-ckpts", type=int, default=t.keep_ckpts, help="how many recent checkpoints to keep")
    g.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out-dir")
    g.add_argument("--log-interval", type=int, default=t.log_interval, help="steps between progress updates")
    g.add_argument("--sample-tokens", type=int, default=t.sample_tokens,
                   help="at each eval, print a sample of this many tokens (0: off)")
    g.add_argument("--sample-prompt", default=t.sample_prompt, help="prompt for those samples (default: a new document)")
    g.add_argument("--profile", action="store_true",
                   help=f"run torch.profiler over {PROFILE_ACTIVE} steps after {PROFILE_WAIT} warm-up steps; writes "
                        "OUT/trace.json (open in Perfetto or chrome://tracing) and prints the top ops")
    g.add_argument("--wandb", action="store_true", help="log to Weights & Biases (offline when no API key)")
    g.add_argument("--wandb-project", default=t.wandb_project, help="wandb project")
    g.add_argument("--wandb-run-name", default=t.wandb_run_name, help="wandb run name (default: wandb picks one)")
    g.add_argument("--wandb-tags", default=t.wandb_tags, help="comma-separated tags for the wandb run")
    g.add_argument("--wandb-mode", default=t.wandb_mode, choices=["auto", "online", "offline"],
                   help="auto: online with an API key, offline without")

    g = p.add_argument_group("fault tolerance")
    g.add_argument("--max-bad-steps", type=int, default=t.max_bad_steps,
                   help="non-finite steps in a row (each one's update is skipped) before --on-bad-steps acts")
    g.add_argument("--on-bad-steps", default=t.on_bad_steps, choices=["rollback", "stop"],
                   help="rollback: reload the newest checkpoint and scale the LR by --rollback-lr-factor; stop: exit")
    g.add_argument("--rollback-lr-factor", type=float, default=t.rollback_lr_factor,
                   help="LR multiplier applied at each rollback")
    g.add_argument("--spike-factor", type=float, default=t.spike_factor,
                   help="warn when the loss exceeds this multiple of its running average (0: off)")
    g.add_argument("--early-stop-patience", type=int, default=t.early_stop_patience,
                   help="stop after this many evals without a better val loss (0: never)")
    g.add_argument("--inject-nan-at-step", type=int, default=t.inject_nan_at_step,
                   help="testing only: poison this step's loss with NaN (-1: never)")

    g = p.add_argument_group("distributed (under torchrun)")
    g.add_argument("--dist", default=t.dist, choices=["none", "ddp", "fsdp"],
                   help="data parallelism across the processes torchrun starts: DDP, or FSDP2 (fully_shard)")
    g.add_argument("--ddp-bucket-mb", type=float, default=t.ddp_bucket_mb, help="DDP gradient bucket size in MiB")
    g.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=t.reshard_after_forward,
                   help="FSDP2: free gathered parameters after forward (less memory, one more all-gather)")

    g = p.add_argument_group("system")
    g.add_argument("--seed", type=int, default=t.seed, help="initialisation and data order")
    g.add_argument("--device", default=t.device, choices=["auto", "cuda", "mps", "cpu"],
                   help="auto: cuda, then mps, then cpu")
    g.add_argument("--dtype", default=t.dtype, choices=["auto", "bf16", "fp16", "fp32"],
                   help="autocast dtype (auto: bf16 on CUDA that supports it, else fp32); fp16 uses a GradScaler")
    g.add_argument("--compile", default=t.compile, choices=["off", "default", "reduce-overhead", "max-autotune"],
                   help="torch.compile mode for the model")
    g.add_argument("--peak-tflops", type=float, default=t.peak_tflops,
                   help="peak FLOP/s (in TFLOP/s) for MFU; default: the GPU's dense bf16 datasheet figure")

    g = p.add_argument_group("speed and memory (see fp8.py, memory.py)")
    g.add_argument("--fp8", default=t.fp8, choices=fp8.FP8_MODES,
                   help="FP8 block GEMMs: Transformer Engine modules, or torchao float8 linears")
    g.add_argument("--fp8-recipe", default=t.fp8_recipe, choices=fp8.FP8_RECIPES,
                   help="--fp8 te scaling: current (stateless, compile-friendly) or delayed (amax history)")
    g.add_argument("--fp8-attn", action="store_true", help="--fp8 te: FP8 attention too (needs head_dim 128)")
    g.add_argument("--act-ckpt", default=t.act_ckpt, choices=memory.ACT_CKPT_MODES,
                   help="activation checkpointing: every block, every other block, or each block's MLP")
    g.add_argument("--estimate-memory", action="store_true",
                   help="print the memory estimate for these flags (every --act-ckpt mode) and exit")
    return p


def batch_size_flag(text):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or auto, got {text!r}") from None


def parse_args(argv=None):
    """Flags -> (TrainConfig, ModelConfig, OptimConfig). Raises UsageError on bad or contradictory flags."""
    a = build_parser().parse_args(argv)
    if a.total_batch_tokens is not None and a.grad_accum is not None:
        raise UsageError("give --total-batch-tokens or --grad-accum, not both")
    if a.max_tokens is not None and a.max_steps is not None:
        raise UsageError("give --max-tokens or --max-steps, not both")
    given = {f.name: getattr(a, f.name) for f in dataclasses.fields(TrainConfig) if getattr(a, f.name) is not None}
    train_cfg = TrainConfig(**given)
    model_cfg = ModelConfig(
        vocab_size=a.vocab_size, n_layer=a.n_layer, n_head=a.n_head, n_kv_head=a.n_kv_head, n_embd=a.n_embd,
        head_dim=a.head_dim, ffn_dim=a.ffn_dim, max_seq_len=a.seq_len, rope_theta=a.rope_theta,
        tie_embeddings=not a.untied,
    )
    optim_cfg = OptimConfig(
        name=a.optimizer, lr=a.lr, adam_lr=a.adam_lr, weight_decay=a.weight_decay, betas=(a.beta1, a.beta2),
        momentum=a.muon_momentum, ns_steps=a.ns_steps, ns_dtype=a.ns_dtype, muon_scale=a.muon_scale,
    )
    check_train_config(train_cfg, model_cfg.max_seq_len, optim_cfg.name)
    try:
        model_cfg.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return train_cfg, model_cfg, optim_cfg


def check_train_config(c, seq_len, optim_name):
    if c.batch_size == "auto" and (not c.total_batch_tokens or c.dist == "fsdp"):
        raise UsageError("--batch-size auto needs --total-batch-tokens (the global batch it keeps), and --dist none "
                         "or ddp (under FSDP2 a probe that runs out of memory would stall the other ranks)")
    positive = {"--batch-size": 1 if c.batch_size == "auto" else c.batch_size, "--grad-accum": c.grad_accum,
                "--seq-len": seq_len}
    for flag, value in positive.items():
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    non_negative = {"--max-steps": c.max_steps, "--max-tokens": c.max_tokens, "--warmup": c.warmup,
                    "--sample-tokens": c.sample_tokens,
                    "--eval-interval": c.eval_interval, "--ckpt-interval": c.ckpt_interval,
                    "--total-batch-tokens": c.total_batch_tokens, "--grad-clip": c.grad_clip}
    for flag, value in non_negative.items():
        if value < 0:
            raise UsageError(f"{flag} must be >= 0, got {value}")
    if c.eval_interval and c.eval_tokens < 1:
        raise UsageError("--eval-tokens must be >= 1 when evaluating")
    if c.keep_ckpts < 1:
        raise UsageError(f"--keep-ckpts must be >= 1, got {c.keep_ckpts}")
    if c.max_bad_steps < 1 or not 0 < c.rollback_lr_factor <= 1 or c.spike_factor < 0 or c.early_stop_patience < 0:
        raise UsageError("--max-bad-steps must be >= 1, --rollback-lr-factor in (0, 1], "
                         "--spike-factor and --early-stop-patience >= 0")
    if not 0 <= c.min_lr_ratio <= 1 or not 0 < c.decay_frac <= 1:
        raise UsageError("--min-lr-ratio must be in [0, 1] and --decay-frac in (0, 1]")
    check_dist_combination(c, optim_name)
    check_speed_combination(c)


def check_dist_combination(c, optim_name):
    """Combinations that cannot work, refused at startup instead of crashing mid-run."""
    if c.dist == "fsdp" and c.dtype == "fp16":
        raise UsageError("--dist fsdp with --dtype fp16 is not supported (needs a sharded grad scaler); use bf16")
    if c.dist == "fsdp" and optim_name == "adamw8bit":
        raise UsageError("--optimizer adamw8bit does not support FSDP2's sharded (DTensor) parameters; "
                         "use --optimizer adamw or --dist ddp")
    if c.ddp_bucket_mb <= 0:
        raise UsageError(f"--ddp-bucket-mb must be positive, got {c.ddp_bucket_mb}")


def check_speed_combination(c):
    """FP8 flags that only make sense together; shapes, dtype and the machine are checked in setup_fp8."""
    if c.fp8 != "te" and (c.fp8_attn or c.fp8_recipe != TrainConfig.fp8_recipe):
        raise UsageError("--fp8-attn and --fp8-recipe apply to --fp8 te only")
    if c.fp8 == "te" and c.sample_tokens:
        raise UsageError("--sample-tokens needs the plain backend's KV cache; it does not run with --fp8 te")


def derive_grad_accum(c, seq_len, world_size=1):
    """Micro-batches per step, so that the global batch in tokens is what the user asked for."""
    if not c.total_batch_tokens:
        return c.grad_accum
    per_micro = c.batch_size * seq_len * world_size
    if c.total_batch_tokens % per_micro:
        raise UsageError(f"--total-batch-tokens {c.total_batch_tokens} is not a multiple of "
                         f"batch-size * seq-len * world-size = {per_micro}")
    return c.total_batch_tokens // per_micro


def derive_max_steps(c, tokens_per_step):
    return math.ceil(c.max_tokens / tokens_per_step) if c.max_tokens else c.max_steps


# ----------------------------------------------------------------------------- schedule


def lr_multiplier(step, max_steps, warmup, schedule, min_lr_ratio, decay_frac):
    """Fraction of the peak LR at optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = min(1.0, (step - warmup + 1) / max(1, max_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(1, round(decay_frac * max_steps))
    decay_start = max_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return 1.0 - (1 - min_lr_ratio) * progress


# ----------------------------------------------------------------------------- hardware


def resolve_device(requested):
    """-> (torch.device, reason). Detected, never assumed."""
    has_mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), f"auto: CUDA {torch.cuda.get_device_name()}"
        if has_mps:
            return torch.device("mps"), "auto: Apple MPS (no CUDA)"
        return torch.device("cpu"), "auto: no CUDA or MPS found"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available to this torch build")
    if requested == "mps" and not has_mps:
        raise UsageError("--device mps: MPS is not available")
    return torch.device(requested), "requested"


def resolve_dtype(requested, device):
    """-> (autocast dtype or None for fp32, reason)."""
    if requested == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            cap = torch.cuda.get_device_capability()
            return torch.bfloat16, f"bf16 autocast (auto: CUDA sm{cap[0]}{cap[1]} supports bf16)"
        return None, f"fp32 (auto: {device.type} has no fast bf16 path we trust)"
    if requested == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UsageError("--dtype bf16: this GPU does not support bf16; use fp16")
        return torch.bfloat16, "bf16 autocast (requested)"
    if requested == "fp16":
        if device.type == "cpu":
            raise UsageError("--dtype fp16 needs a GPU; use bf16 or fp32 on CPU")
        return torch.float16, "fp16 autocast + GradScaler (requested)"
    return None, "fp32 (requested)"


def peak_flops(device, override_tflops):
    """-> (peak FLOP/s or None, reason)."""
    if override_tflops:
        return override_tflops * 1e12, f"{override_tflops:g} TFLOP/s (--peak-tflops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name()
        for key, flops in PEAK_BF16_FLOPS.items():
            if key in name:
                return flops, f"{flops / 1e12:g} TFLOP/s dense bf16 ({name} datasheet)"
        return None, f"unknown peak for {name}; set --peak-tflops"
    return None, f"no datasheet peak for {device.type}; set --peak-tflops"


# ----------------------------------------------------------------------------- checkpoints


def rng_state():
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- logging


class MetricsLog:
    """metrics.jsonl, plus wandb when asked for. Lines from steps that are redone (after a resume or a
    rollback) are dropped, and so is a line torn by a crash mid-write."""

    def __init__(self, out_dir, start_step, wandb_run, enabled=True):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.enabled, self.wandb_run = enabled, wandb_run
        self.truncate(start_step)

    def truncate(self, step):
        """Keep only the records of steps before `step`."""
        if not self.enabled:  # only rank 0 writes
            return
        kept = []
        if step > 0 and os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        if json.loads(line)["step"] < step:
                            kept.append(line)
                    except (ValueError, KeyError):
                        pass
        with open(self.path, "w") as f:
            f.writelines(kept)

    def log(self, record):
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if v is not None}, step=record["step"])

    def close(self):
        if self.wandb_run is not None:
            self.wandb_run.finish()


def wandb_mode(requested):
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = os.path.expanduser("~/.netrc")
    if os.path.exists(netrc) and "api.wandb.ai" in open(netrc).read():
        return "online"
    return "offline"


def start_wandb(c, config_dict):
    """-> (run or None, reason). wandb must never stop a training run, so failures only warn."""
    if not c.wandb:
        return None, "off (not requested)"
    mode = wandb_mode(c.wandb_mode)
    try:
        import wandb

        tags = [t.strip() for t in c.wandb_tags.split(",") if t.strip()] if c.wandb_tags else None
        run = wandb.init(project=c.wandb_project, name=c.wandb_run_name, config=config_dict, mode=mode, tags=tags,
                         dir=c.out_dir, resume="allow" if c.resume else None)
        return run, f"on, {mode} (project {c.wandb_project})"
    except Exception as e:
        return None, f"off: wandb failed to start ({type(e).__name__}: {str(e).splitlines()[0]})"


def progress_message(message):
    print(message, file=sys.stderr, flush=True)


def print_table(rows):
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows), flush=True)


# ----------------------------------------------------------------------------- training


@torch.no_grad()
def evaluate(run):
    """Mean loss over the first eval_tokens of the val split (the same tokens every time, split across ranks)."""
    c, info = run.cfg, run.dist
    loader = ShardLoader(c.data, split="val", batch_size=c.batch_size, seq_len=run.seq_len, shuffle=False,
                         rank=info.rank, world_size=info.world_size, device=str(run.device), prefetch=0,
                         vocab_size=run.model_cfg.vocab_size)
    n_batches = max(1, c.eval_tokens // (c.batch_size * run.seq_len * info.world_size))
    run.model.eval()
    total = torch.zeros((), device=run.device)
    progress = Progress(n_batches, "eval", unit="batch", enabled=info.is_main)
    for _ in range(n_batches):
        x, y = next(loader)
        with run.autocast():
            _, loss = run.compiled(x, y)
        total += loss.float()
        progress.update()
    progress.close()
    run.model.train()
    loader.close()
    return distributed.mean_across_ranks(total / n_batches, info).item()


@dataclass
class Run:
    """Everything the loop needs, built and checked by setup() before the first step."""

    cfg: TrainConfig
    model_cfg: ModelConfig
    optim_cfg: OptimConfig
    dist: distributed.DistInfo
    model: torch.nn.Module  # the bare model (FSDP2 shards it in place); state dicts come from here
    wrapped: torch.nn.Module  # the model as DDP sees it (DDP's no_sync lives here), else the model
    compiled: torch.nn.Module  # what forward calls: `wrapped`, compiled when asked for
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loader: ShardLoader
    metrics: "MetricsLog"
    device: torch.device
    autocast_dtype: torch.dtype | None
    grad_accum: int
    max_steps: int
    start_step: int
    peak_flops: float | None
    timer: "PhaseTimer"
    fp8_recipe: object = None  # Transformer Engine's recipe under --fp8 te
    lr_scale: float = 1.0  # shrinks with each rollback after non-finite steps
    health: LossHealth = dataclasses.field(default_factory=LossHealth)
    early_stop: EarlyStopping = dataclasses.field(default_factory=lambda: EarlyStopping(0))


    @property
    def seq_len(self):
        return self.model_cfg.max_seq_len

    @property
    def tokens_per_step(self):
        """Global: all ranks and micro-steps together."""
        return self.cfg.batch_size * self.seq_len * self.grad_accum * self.dist.world_size

    @contextmanager
    def autocast(self):
        """For a forward pass only, never the backward: torch's autocast, and TE's FP8 one under --fp8 te."""
        dtype = nullcontext() if self.autocast_dtype is None else torch.autocast(self.device.type, self.autocast_dtype)
        with dtype, fp8.fp8_context(self.fp8_recipe):
            yield


def setup_fp8(c, model_cfg, device, autocast_dtype):
    """Check the FP8 flags against the model, the batch and this machine; -> TE's recipe (None unless --fp8 te)."""
    try:
        # An auto batch size is not known yet: checking with 1 demands seq_len % 8 == 0, enough for any size.
        batch = 1 if c.batch_size == "auto" else c.batch_size
        fp8.check_fp8_config(c.fp8, c.fp8_recipe, c.fp8_attn, model_cfg, batch, model_cfg.max_seq_len,
                             cuda=device.type == "cuda", have_te=fp8.te_installed(), have_torchao=fp8.torchao_installed())
    except ValueError as e:
        raise UsageError(str(e)) from None
    if c.fp8 != "te":
        return None
    if autocast_dtype is None:
        raise UsageError("--fp8 te runs its non-FP8 parts (TE's fused attention) in 16 bits: use --dtype bf16")
    fp8.set_te_attention_env(c.fp8_recipe, c.fp8_attn)
    return fp8.te_recipe(c.fp8_recipe, c.fp8_attn)


def auto_batch_size(model, c, optim_cfg, device, autocast_dtype, info):
    """The largest micro-batch that fits in GPU memory and divides the per-rank batch of --total-batch-tokens.

    Each probe runs a forward and backward at that size while a placeholder holds the optimizer state's
    estimated bytes (the state only exists after the first step). Ranks agree on the smallest answer.
    """
    seq_len = model.config.max_seq_len
    per_rank = c.total_batch_tokens // (seq_len * info.world_size)
    reserve = memory.optimizer_state_bytes_estimate(model.config, optim_cfg.name)
    autocast = torch.autocast("cuda", dtype=autocast_dtype) if autocast_dtype else nullcontext()

    def probe(size):
        placeholder = torch.empty(reserve, dtype=torch.uint8, device=device)
        try:
            x = torch.zeros((size, seq_len), dtype=torch.long, device=device)
            with autocast:
                _, loss = model(x, x)
            loss.backward()
        finally:
            del placeholder
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    fitting = largest_fitting_batch(fits_by_trying(probe, (torch.cuda.OutOfMemoryError,)), limit=per_rank)
    fitting = int(distributed.min_across_ranks(torch.tensor(fitting, device=device), info).item())
    if fitting == 0:
        raise UsageError(f"--batch-size auto: not even one sequence of {seq_len} tokens fits in GPU memory")
    return micro_batch_for(per_rank, fitting)


def setup(c, model_cfg, optim_cfg):
    """Build and check everything; every user mistake surfaces here, before the first step."""
    problem = distributed.check_launch(c.dist)
    if problem:
        raise UsageError(problem)
    device, device_reason = resolve_device(c.device)
    autocast_dtype, dtype_reason = resolve_dtype(c.dtype, device)
    if c.batch_size == "auto" and device.type != "cuda":
        raise UsageError("--batch-size auto needs CUDA: it searches by catching CUDA out-of-memory errors")
    fp8_recipe = setup_fp8(c, model_cfg, device, autocast_dtype)
    info = distributed.init(c.dist, device.type)
    if device.type == "cuda":
        device = torch.device("cuda", info.local_rank if info.mode != "none" else torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if info.is_main:
        try:
            os.makedirs(c.out_dir, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--out-dir {c.out_dir} cannot be created: {e.strerror}") from None
        if not os.access(c.out_dir, os.W_OK):
            raise UsageError(f"--out-dir {c.out_dir} is not writable")
    if c.data is None:  # rank 0 tokenizes the corpus once; the others find it cached
        c.data = default_corpus() if info.is_main else None
        c.data = distributed.broadcast_object(c.data, info)
    seq_len = model_cfg.max_seq_len

    init_state, init_reason = None, f"random (seed {c.seed})"
    if c.from_hf:
        hf_cfg, init_state = load_hf(c.from_hf)
        model_cfg = dataclasses.replace(hf_cfg, max_seq_len=model_cfg.max_seq_len)
        init_reason = f"weights of {c.from_hf}"

    torch.manual_seed(c.seed)
    random.seed(c.seed)
    model = GPT(model_cfg, backend="te" if c.fp8 == "te" else "plain").to(device)
    if init_state is not None:  # before torchao, DDP or FSDP2 take the parameters over
        model.load_state_dict(plain_to_te_state_dict(init_state) if c.fp8 == "te" else init_state)
    if c.fp8 == "torchao":
        fp8.convert_to_torchao_float8(model)
    memory.apply_activation_checkpointing(model, c.act_ckpt)  # before DDP / FSDP2 / compile wrap it
    if c.batch_size == "auto":  # probed on the bare model: a DDP backward would wait on the other ranks
        c.batch_size = auto_batch_size(model, c, optim_cfg, device, autocast_dtype, info)
    grad_accum = derive_grad_accum(c, seq_len, info.world_size)
    max_steps = derive_max_steps(c, c.batch_size * seq_len * grad_accum * info.world_size)
    wrapped = model
    if info.mode == "ddp":
        wrapped = distributed.apply_ddp(model, info, device, c.ddp_bucket_mb)
    elif info.mode == "fsdp":
        param_dtype = autocast_dtype if device.type == "cuda" else None
        wrapped = distributed.apply_fsdp(model, model.blocks, param_dtype, c.reshard_after_forward)
    optimizer = build_optimizer(model, optim_cfg, model.row_blocks(), device.type)
    loader = ShardLoader(c.data, split="train", batch_size=c.batch_size, seq_len=seq_len, rank=info.rank,
                         world_size=info.world_size, seed=c.seed, device=str(device), vocab_size=model_cfg.vocab_size)
    if c.eval_interval:  # fail now, not at the first eval, when there is no usable val split
        ShardLoader(c.data, split="val", batch_size=c.batch_size, seq_len=seq_len, shuffle=False, prefetch=0,
                    vocab_size=model_cfg.vocab_size).close()

    start_step, resumed = 0, None
    if c.resume:
        resumed = restore(c.out_dir, model, optimizer, loader, model_cfg, warn=progress_message if info.is_main else None)
        start_step = resumed["step"]
    if start_step >= max_steps:
        raise UsageError(f"nothing to do: already at step {start_step} of {max_steps}")
    if c.profile and max_steps - start_step < PROFILE_WAIT + PROFILE_ACTIVE:
        raise UsageError(f"--profile needs at least {PROFILE_WAIT + PROFILE_ACTIVE} steps to run")

    compiled = wrapped
    if c.compile != "off":
        # fullgraph=False: TE modules are dynamo-disabled, so each one is a graph break, not an error.
        compiled = torch.compile(wrapped, mode=None if c.compile == "default" else c.compile, fullgraph=False)
    peak, peak_reason = peak_flops(device, c.peak_tflops)
    config_dict = {"train": dataclasses.asdict(c), "model": dataclasses.asdict(model_cfg),
                   "optim": dataclasses.asdict(optim_cfg)}
    wandb_run, wandb_reason = start_wandb(c, config_dict) if info.is_main else (None, "")
    run = Run(cfg=c, model_cfg=model_cfg, optim_cfg=optim_cfg, dist=info, model=model, wrapped=wrapped,
              compiled=compiled, timer=PhaseTimer(device),
              optimizer=optimizer, scaler=torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16),
              loader=loader, metrics=MetricsLog(c.out_dir, start_step, wandb_run, enabled=info.is_main),
              device=device, autocast_dtype=autocast_dtype, grad_accum=grad_accum, max_steps=max_steps,
              start_step=start_step, peak_flops=peak, fp8_recipe=fp8_recipe,
              health=LossHealth(c.spike_factor), early_stop=EarlyStopping(c.early_stop_patience))
    if resumed is not None:
        run.lr_scale = resumed["lr_scale"]
        run.health.load_state_dict(resumed["health"])
        run.early_stop.load_state_dict(resumed["early_stop"])
    if info.is_main:
        print_table([
            ("device", f"{device.type} ({device_reason})"),
            ("distributed", f"{info.mode}, {info.world_size} processes" if info.mode != "none"
                            else "off (single process)"),
            ("precision", dtype_reason),
            ("TF32 matmuls", "on (CUDA)" if device.type == "cuda" else f"off ({device.type})"),
            ("model", f"{model.num_params() / 1e6:.2f}M params, {model_cfg.n_layer} layers, d={model_cfg.n_embd}, "
                      f"heads {model_cfg.n_head}q/{model_cfg.n_kv_head}kv, vocab {model_cfg.padded_vocab_size}"),
            ("optimizer", describe_param_groups(optimizer)),
            ("torch.compile", "off (not requested)" if c.compile == "off" else f"on, mode {c.compile}"),
            ("FP8", fp8.describe_fp8(model, fp8_recipe)),
            ("activation ckpt", memory.describe_activation_checkpointing(model)),
            ("batch", f"{c.batch_size} x {seq_len} tokens x {grad_accum} micro-steps x {info.world_size} ranks "
                      f"= {run.tokens_per_step} tokens/step"),
            ("schedule", f"{c.schedule}, peak lr {optim_cfg.lr:g}, warmup {c.warmup}, {max_steps} steps"),
            ("data", c.data),
            ("MFU peak", peak_reason),
            ("wandb", wandb_reason),
            ("init", init_reason),
            ("resume", f"from step {start_step}" if c.resume else "off (fresh run)"),
        ])
    return run


def state_dict_options(full):
    """Full state dicts (gathered to rank 0, on the CPU) for single files; sharded ones for DCP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full)


def restore(out_dir, model, optimizer, loader, model_cfg, warn):
    """Load the newest good checkpoint (either format, any world size) into the live objects; -> its meta.

    Damaged checkpoints (checksum mismatch, truncation) are reported and skipped for the one before.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def check_config(meta):
        if meta["model_config"] != dataclasses.asdict(model_cfg):
            raise UsageError(f"--resume: the checkpoint of step {meta['step']} in {out_dir} was trained with a "
                             "different model config; pass the same model flags")

    def sharded_template(meta):  # a DCP directory is read into this run's own (possibly sharded) state dicts
        check_config(meta)
        return dict(zip(("model", "optimizer"), get_state_dict(model, optimizer, options=state_dict_options(False))))

    found = checkpoint.load_newest(out_dir, sharded_template, warn or (lambda message: None))
    if found is None:
        raise UsageError(f"--resume: no usable checkpoint in {out_dir}")
    path, meta, tensors = found
    check_config(meta)
    sharded = os.path.isdir(path)
    if not sharded:  # a file may come from the other backend: TE modules carry _extra_state entries
        plain = te_to_plain_state_dict(tensors["model"])
        tensors["model"] = plain_to_te_state_dict(plain) if model.backend == "te" else plain
    set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optimizer"],
                   options=state_dict_options(full=not sharded))
    loader.load_state_dict(meta["loader"])
    set_rng_state(meta["rng"])
    return meta


def save(run, done, regular=True, best=False):
    """FSDP2 runs write a sharded DCP directory; the others a single file from rank 0. `regular`: the
    ckpt_N checkpoint, pruned to the newest --keep-ckpts; `best`: the one kept for the best validation loss,
    which pruning never touches. With both, the state is gathered and written once and best links to it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    info, out_dir = run.dist, run.cfg.out_dir
    sharded = info.mode == "fsdp"
    model_sd, optim_sd = get_state_dict(run.model, run.optimizer, options=state_dict_options(full=not sharded))
    meta = {
        "version": checkpoint.CHECKPOINT_VERSION, "step": done, "loader": run.loader.state_dict(),
        "rng": rng_state(), "model_config": dataclasses.asdict(run.model_cfg), "train_config": dataclasses.asdict(run.cfg),
        "lr_scale": run.lr_scale, "health": run.health.state_dict(), "early_stop": run.early_stop.state_dict(),
    }
    best_path = checkpoint.best_path(out_dir, sharded)
    path = checkpoint.checkpoint_path(out_dir, done, sharded) if regular else best_path
    if sharded:
        checkpoint.save_sharded({"model": model_sd, "optimizer": optim_sd}, meta, path, info.is_main,
                                lambda: distributed.barrier(info))
    elif info.is_main:
        checkpoint.save_file({**meta, "model": model_sd, "optimizer": optim_sd}, path)
    if info.is_main:
        if regular and best:
            checkpoint.link(path, best_path)
        for old in checkpoint.list_checkpoints(out_dir)[:-run.cfg.keep_ckpts]:
            checkpoint.remove(old)
    distributed.barrier(info)


def total_grad_norm(model, max_norm):
    """Clip to max_norm and return the global norm; under FSDP2 the norm of the sharded grads is reduced."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class PhaseTimer:
    """Seconds spent per phase of a step. Waiting for data is host time, so wall clock; on CUDA the
    compute phases are timed with CUDA events, because kernels run asynchronously to the host."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.spans = []

    @contextmanager
    def __call__(self, phase):
        if self.cuda and phase != "data":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.append((phase, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.spans.append((phase, t0, time.perf_counter()))

    def collect(self):
        """{phase: seconds} since the last collect(); waits for the GPU's timed work to finish."""
        totals = {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        for phase, start, end in self.spans:
            if isinstance(start, float):
                totals[phase] += end - start
            else:
                end.synchronize()
                totals[phase] += start.elapsed_time(end) / 1000
        self.spans = []
        return totals


def train_step(run, poison=False):
    """One optimizer step over grad_accum micro-batches -> (mean loss over ranks, grad norm, finite).

    A non-finite loss or gradient norm skips the update: parameters and optimizer state stay exactly as
    they were. Every rank sees the same all-reduced loss and norm, so all ranks skip together. `poison`
    (a test-only flag) makes this step's loss NaN.
    """
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(run.grad_accum):
        with run.timer("data"):
            x, y = next(run.loader)
        with distributed.set_grad_sync(run.wrapped, run.dist, micro == run.grad_accum - 1):
            with run.timer("forward"), run.autocast():
                _, loss = run.compiled(x, y)
                if poison:
                    loss = loss * float("nan")
            loss_sum += loss.detach()
            with run.timer("backward"):
                run.scaler.scale(loss / run.grad_accum).backward()
    with run.timer("optimizer"):
        run.scaler.unscale_(run.optimizer)
        grad_norm = total_grad_norm(run.model, run.cfg.grad_clip if run.cfg.grad_clip > 0 else float("inf"))
        loss = distributed.mean_across_ranks(loss_sum / run.grad_accum, run.dist)
        finite = bool(torch.isfinite(loss) and torch.isfinite(grad_norm))
        if finite:
            run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, finite


def peak_memory_gib(device):
    """Peak memory so far: allocated by tensors on CUDA; the process's peak resident set elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB on Linux
    return peak * (1 if sys.platform == "darwin" else 1024) / 2**30


def start_profiler(run):
    """torch.profiler over PROFILE_ACTIVE steps after PROFILE_WAIT; writes OUT/trace.json, prints the top ops."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.device.type == "cuda" else [])
    trace = os.path.join(run.cfg.out_dir, "trace.json")

    def report(prof):
        if not run.dist.is_main:
            return
        prof.export_chrome_trace(trace)
        sort = "self_cuda_time_total" if run.device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=15), flush=True)
        print(f"profile: {PROFILE_ACTIVE} steps written to {trace} (open in https://ui.perfetto.dev)", flush=True)

    prof = profile(activities=activities, schedule=schedule(wait=PROFILE_WAIT - 1, warmup=1, active=PROFILE_ACTIVE,
                                                             repeat=1), on_trace_ready=report)
    prof.start()
    return prof


# Steps timed to separate torch.compile's one-off compilation (in the first step) from the steady step time.
COMPILE_TIMING_STEPS = 6


def compile_seconds(step_times):
    """Compilation time, estimated as the first step's time minus the median of the later ones."""
    return step_times[0] - median(step_times[1:]) if len(step_times) > 1 else step_times[0]


class TrainingHalted(Exception):
    """The run stopped itself for a reason the user must act on (e.g. non-finite steps with no way back)."""


def rollback(run, progress):
    """After too many non-finite steps: reload the newest good checkpoint and continue with a lower LR."""
    c = run.cfg
    if c.on_bad_steps == "stop":
        raise TrainingHalted(f"{c.max_bad_steps} non-finite steps in a row (--on-bad-steps stop)")
    scale = run.lr_scale * c.rollback_lr_factor
    meta = restore(c.out_dir, run.model, run.optimizer, run.loader, run.model_cfg, warn=progress.write)
    run.health.load_state_dict(meta["health"])
    run.early_stop.load_state_dict(meta["early_stop"])
    run.lr_scale = scale
    run.metrics.truncate(meta["step"])
    progress.write(f"rolled back to step {meta['step']} after {c.max_bad_steps} non-finite steps; "
                   f"LR now x{scale:g} of the schedule")
    return meta["step"]


def shrink_micro_batch(run, loader_state, progress):
    """After an out-of-memory error mid-step: rewind the step and redo it with a smaller micro-batch and more
    micro-steps, so the global batch and the data order stay exactly the same."""
    run.optimizer.zero_grad(set_to_none=True)
    run.timer.collect()
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    per_rank = run.cfg.batch_size * run.grad_accum
    smaller = micro_batch_for(per_rank, run.cfg.batch_size // 2)
    run.loader.load_state_dict(loader_state)
    run.loader.batch_size = run.cfg.batch_size = smaller
    run.grad_accum = per_rank // smaller
    progress.write(f"warning: out of memory; retrying the step with micro-batch {smaller} x {run.grad_accum} "
                   "micro-steps (same global batch)")


def run_loop(run):
    """Train to max_steps; returns a message when the run stopped early on purpose (signal, early stopping)."""
    c, info = run.cfg, run.dist
    flops_tok = flops_per_token(run.model_cfg, run.seq_len)
    progress = Progress(run.max_steps, "train", unit="step", initial=run.start_step, enabled=info.is_main)
    profiler = start_profiler(run) if c.profile else None
    signals = StopSignals()
    data_warned = oom_retried = poisoned = False
    step_times = []
    step = run.start_step
    try:
        while step < run.max_steps:
            t0 = time.perf_counter()
            mult = run.lr_scale * lr_multiplier(step, run.max_steps, c.warmup, c.schedule, c.min_lr_ratio, c.decay_frac)
            for group in run.optimizer.param_groups:
                group["lr"] = group["base_lr"] * mult
            loader_state = run.loader.state_dict()
            poison = step == c.inject_nan_at_step and not poisoned  # once: a rollback must not meet it again
            try:
                loss, grad_norm, finite = train_step(run, poison)
            except torch.cuda.OutOfMemoryError:
                if oom_retried or info.world_size > 1 or run.cfg.batch_size == 1:
                    raise
                oom_retried = True
                shrink_micro_batch(run, loader_state, progress)
                continue
            poisoned = poisoned or poison
            train_loss = loss.item()  # the host sync makes the step time below honest on CUDA
            dt = time.perf_counter() - t0
            step_times.append(dt)
            phases = run.timer.collect()

            done = step + 1
            tokens_per_sec = run.tokens_per_step / dt
            per_device = tokens_per_sec / info.world_size
            spike = run.health.update(train_loss, finite)
            record = {
                "step": step, "tokens": done * run.tokens_per_step, "train_loss": train_loss if finite else None,
                "lr": run.optim_cfg.lr * mult, "grad_norm": grad_norm.item() if finite else None,
                "tokens_per_sec": tokens_per_sec, "tokens_per_sec_per_device": per_device,
                # per device; equal to the whole job's utilisation of its devices
                "mfu": flops_tok * per_device / run.peak_flops if run.peak_flops else None,
                "loss_ema": run.health.ema, "loss_var": run.health.var, "skipped": not finite,
                "bad_steps": run.health.bad_total,
                **{f"time_{phase}_ms": 1000 * seconds for phase, seconds in phases.items()},
                "peak_mem_gib": peak_memory_gib(run.device),
            }
            if not finite:
                progress.write(f"warning: step {done}: loss {train_loss}, grad norm {grad_norm.item()}: update skipped "
                               f"({run.health.bad_in_a_row} in a row, {run.health.bad_total} in all)")
            if spike:
                progress.write(f"warning: step {done}: loss spike {train_loss:.4f}, {train_loss / run.health.ema:.1f}x "
                               f"its running average")
            if c.compile != "off" and len(step_times) == min(COMPILE_TIMING_STEPS, run.max_steps - run.start_step):
                record["compile_s"] = compile_seconds(step_times)
                progress.write(f"torch.compile: first step {step_times[0]:.1f} s, about {record['compile_s']:.1f} s of "
                               f"it compilation (first minus the median of the next {len(step_times) - 1} steps)")
            if step == run.start_step:
                progress.write(f"optimizer state: {optimizer_state_bytes(run.optimizer) / 2**20:.1f} MiB per rank")
            elif phases["data"] > DATA_WAIT_WARN * dt and not data_warned:  # step 1 also starts the prefetch thread
                data_warned = True
                progress.write(f"warning: step {done} spent {100 * phases['data'] / dt:.0f}% of its time waiting for "
                               "data (time_data_ms in metrics.jsonl has every step); the loader is a bottleneck")
            stop_early = improved = False
            if c.eval_interval and (done % c.eval_interval == 0 or done == run.max_steps):
                record["val_loss"] = evaluate(run)
                improved, stop_early = run.early_stop.update(record["val_loss"])
                progress.write(f"step {done}: train loss {train_loss:.4f}, val loss {record['val_loss']:.4f}"
                               + (" (best so far)" if improved else ""))
                if c.sample_tokens:  # on every rank: under FSDP2 each forward is a collective
                    text = sample_text(run.model, get_tokenizer(), c.sample_prompt, c.sample_tokens, seed=c.seed)
                    progress.write(f"sample at step {done}: {text!r}")
            run.metrics.log(record)
            if done % c.log_interval == 0 or done == run.max_steps or step == run.start_step:
                progress.set_postfix(f"loss {train_loss:.3f}, {tokens_per_sec:,.0f} tok/s")
            progress.update()
            if profiler is not None:
                profiler.step()
            step = done

            if run.health.bad_in_a_row >= c.max_bad_steps:
                step = rollback(run, progress)
                continue
            signalled = distributed.any_across_ranks(signals.requested is not None, run.dist, run.device)
            on_interval = bool(c.ckpt_interval) and done % c.ckpt_interval == 0
            regular = on_interval or done == run.max_steps or signalled or stop_early
            if regular or improved:
                save(run, done, regular=regular, best=improved)
            if signalled:
                return (f"stopped by {signals.requested or 'a signal to another rank'} at step {done}; checkpoint "
                        f"written. Resume with the same command plus --resume")
            if stop_early:
                return (f"early stop at step {done}: val loss has not improved on {run.early_stop.best:.4f} for "
                        f"{c.early_stop_patience} evals; the best weights are in "
                        f"{checkpoint.best_path(c.out_dir, info.mode == 'fsdp')}")
        return None
    finally:
        signals.restore()
        if profiler is not None:
            profiler.stop()
        progress.close()


def memory_report(c, model_cfg, optim_cfg):
    """--estimate-memory: the estimate for these flags under every --act-ckpt mode; builds and allocates nothing."""
    device, _ = resolve_device(c.device)
    autocast_dtype, dtype_reason = resolve_dtype(c.dtype, device)
    shards = int(os.environ.get("WORLD_SIZE", "1")) if c.dist == "fsdp" else 1
    estimates = {mode: memory.estimate_memory(model_cfg, c.batch_size, model_cfg.max_seq_len, optim_cfg.name, mode,
                                              autocast_dtype, device.type, shards)
                 for mode in memory.ACT_CKPT_MODES}
    n_params = sum(memory.param_numels(model_cfg).values())
    sharding = f", FSDP2 over {shards} ranks" if shards > 1 else ""
    return "\n".join([
        f"memory estimate per device: {n_params / 1e6:.2f}M params, optimizer {optim_cfg.name}, "
        f"micro-batch {c.batch_size} x {model_cfg.max_seq_len} tokens, {device.type}, {dtype_reason}{sharding}",
        "",
        memory.format_memory_estimates(estimates, c.act_ckpt),
        "",
        "Activations: what the plain backend's eager forward saves for backward (memory.py); torch.compile and",
        "FP8 usually save less. Not counted: the CUDA context, allocator fragmentation, temporaries.",
    ])


def main(argv=None):
    try:
        cfgs = parse_args(argv)
        if cfgs[0].estimate_memory:
            print(memory_report(*cfgs))
            return
        run = setup(*cfgs)
    except (UsageError, DataError, CheckpointError, ValueError) as e:
        # Only setup is guarded: ValueError there is config validation in model.py / optim.py, while an
        # exception inside the loop is a bug and keeps its traceback. Every rank fails alike; rank 0 says why.
        if os.environ.get("RANK", "0") == "0":
            report_error(e)
        sys.exit(2)
    try:
        stopped = run_loop(run)
    except (CheckpointError, DataError, TrainingHalted) as e:  # a full disk, bad tokens, a run that cannot go on
        if run.dist.is_main:
            report_error(e)
        sys.exit(1 if isinstance(e, TrainingHalted) else 2)
    finally:
        run.loader.close()
        run.metrics.close()
        distributed.shutdown(run.dist)
    if stopped and run.dist.is_main:
        print(stopped, file=sys.stderr)


if __name__ == "__main__":
    main()
