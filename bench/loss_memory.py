"""The loss path, unfused vs chunked: bytes saved for backward and forward + backward time.

    python bench/loss_memory.py [--windows 3 --steps-per-window 2 --warmup-steps 1 --gpt2-tokens N --dtype auto]

The loss path is what follows the final norm: the lm_head GEMM and the float32 cross-entropy, on hidden
states [B, T, d] that require grad, against a [V, d] weight. Unfused is GPT.forward's loss before the fused
one, F.cross_entropy(F.linear(x, W).float(), targets); chunked is loss.linear_cross_entropy, chunks of
loss.LOSS_CHUNK_TOKENS tokens. Saved for backward: memory.saved_tensor_bytes (saved-tensor hooks, distinct
storages; the weight itself is a parameter and not counted, an autocast copy of it is). Time: one forward and
backward, the median over timed windows after warm-up steps. On CUDA also the peak memory allocated during
one forward + backward above what was allocated before it (the CPU has no such counter).

Two shapes: train.py's default model (d=128, 16 x 128 tokens) and GPT-2 small's loss (d=768, 16 x 1024
tokens), both over GPT-2's vocabulary padded to 50,304. On the CPU the GPT-2 shape defaults to 2 x 1024
tokens (its 16 x 1024 unfused step needs about 10 GiB and minutes per step); the table says what ran, and
a line below it gives the saved bytes at 16 x 1024 tokens, extrapolated from forwards of 1 and 2 sequences
(both paths save a fixed part plus a part linear in tokens).
"""

import os
import shlex
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from atomic import atomic_write  # noqa: E402
import hardware  # noqa: E402
import memory  # noqa: E402
from cli import HelpFormatter, ScriptParser, count, out_problem, run_writing_results  # noqa: E402
from loss import LOSS_CHUNK_TOKENS, linear_cross_entropy  # noqa: E402
from model import ModelConfig  # noqa: E402

VOCAB = ModelConfig().vocab_size  # GPT-2's 50,257, padded to 50,304 below
PADDED_VOCAB = ModelConfig().padded_vocab_size
MIB = 2**20


class UnfusedLoss(nn.Module):
    """The loss path as it was: full logits, their float32 copy, F.cross_entropy."""

    def __init__(self, dim: int, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(0.02 * torch.randn(PADDED_VOCAB, dim, device=device))

    def forward(self, x, targets):
        return None, F.cross_entropy(F.linear(x, self.weight).float().flatten(0, 1), targets.flatten())


class ChunkedLoss(UnfusedLoss):
    def forward(self, x, targets):
        return None, linear_cross_entropy(x, self.weight, targets)


PATHS = {"unfused": UnfusedLoss, "chunked": ChunkedLoss}


def step(head: nn.Module, x: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype | None) -> None:
    x.grad = head.weight.grad = None
    with hardware.autocast(x.device, dtype):
        _, loss = head(x, targets)
    loss.backward()


def median_step_seconds(head, x, targets, dtype, args) -> float:
    for _ in range(args.warmup_steps):
        step(head, x, targets, dtype)
    per_step = []
    for _ in range(args.windows):
        hardware.synchronize(x.device)
        t0 = time.perf_counter()
        for _ in range(args.steps_per_window):
            step(head, x, targets, dtype)
        hardware.synchronize(x.device)
        per_step.append((time.perf_counter() - t0) / args.steps_per_window)
    return statistics.median(per_step)


def cuda_peak_bytes(head, x, targets, dtype) -> int | None:
    """Peak bytes allocated during one forward + backward above those allocated before it; None off CUDA."""
    if x.device.type != "cuda":
        return None
    step(head, x, targets, dtype)  # the gradients exist before the measured step, as in training
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step(head, x, targets, dtype)
    return torch.cuda.max_memory_allocated() - before


def inputs(dim: int, batch: int, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states that require grad, and targets over the unpadded vocabulary; the same for every path."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, seq_len, dim, device=device, generator=g).requires_grad_()
    return x, torch.randint(0, VOCAB, (batch, seq_len), device=device, generator=g)


def measure(dim: int, batch: int, seq_len: int, dtype, device, args) -> dict:
    """-> {"unfused": (saved bytes, peak bytes or None, seconds), "chunked": (...)} on the same inputs."""
    x, targets = inputs(dim, batch, seq_len, device)
    results = {}
    for name, cls in PATHS.items():
        torch.manual_seed(0)
        head = cls(dim, device)
        saved = memory.saved_tensor_bytes(head, x, targets, dtype)
        peak = cuda_peak_bytes(head, x, targets, dtype)
        results[name] = (saved, peak, median_step_seconds(head, x, targets, dtype, args))
    return results


def saved_bytes_extrapolated(cls, dim: int, batch: int, seq_len: int, dtype, device) -> int:
    """Saved bytes at batch x seq_len from forwards of 1 and 2 sequences: both paths save a fixed part plus
    a part linear in tokens, so two points give the line."""
    one, two = (memory.saved_tensor_bytes(cls(dim, device), *inputs(dim, b, seq_len, device), dtype) for b in (1, 2))
    return one + (batch - 1) * (two - one)


def table(rows: list[tuple[str, int, int, int, dict]]) -> str:
    lines = ["| shape | tokens | path | saved for backward | vs unfused | peak (CUDA) | vs unfused "
             "| forward + backward | vs unfused |",
             "|---|---|---|---|---|---|---|---|---|"]
    for shape, dim, batch, seq_len, results in rows:
        base_saved, base_peak, base_s = results["unfused"]
        for name, (saved, peak, seconds) in results.items():
            peak_cells = (f"{peak / MIB:,.1f} MiB | {peak / base_peak:.3f}x" if peak is not None else "n/a | n/a")
            lines.append(f"| {shape}, d={dim} | {batch} x {seq_len} | {name} | {saved / MIB:,.1f} MiB | "
                         f"{saved / base_saved:.3f}x | {peak_cells} | {1e3 * seconds:,.1f} ms | "
                         f"{seconds / base_s:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = ScriptParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--windows", type=count, default=3, help="timed windows; the table reports their median")
    p.add_argument("--steps-per-window", type=count, default=2, help="steps timed together as one window")
    p.add_argument("--warmup-steps", type=int, default=1, help="untimed steps first")
    p.add_argument("--gpt2-tokens", type=int, default=None,
                   help="tokens of the GPT-2 shape, a multiple of 1024 (default: 16 x 1024 on CUDA, 2 x 1024 on CPU)")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: bf16 autocast on CUDA, fp32 on the CPU")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    if problem := out_problem(args.out):
        p.error(problem)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    dtype = torch.bfloat16 if bf16 else None
    gpt2_tokens = args.gpt2_tokens or (16 * 1024 if device.type == "cuda" else 2 * 1024)
    if gpt2_tokens % 1024:
        p.error(f"--gpt2-tokens must be a multiple of 1024, got {gpt2_tokens}")

    rows = []
    for shape, dim, batch, seq_len in (("train.py default", 128, 16, 128),
                                       ("GPT-2 small", 768, gpt2_tokens // 1024, 1024)):
        rows.append((shape, dim, batch, seq_len, measure(dim, batch, seq_len, dtype, device, args)))

    lines = []
    if gpt2_tokens < 16 * 1024:
        full = {name: saved_bytes_extrapolated(cls, 768, 16, 1024, dtype, device) for name, cls in PATHS.items()}
        lines = ["", "GPT-2 small at 16 x 1024 tokens, saved for backward, extrapolated from forwards of 1 x 1024 and "
                 f"2 x 1024 (linear in tokens): unfused {full['unfused'] / MIB:,.1f} MiB, chunked "
                 f"{full['chunked'] / MIB:,.1f} MiB ({full['chunked'] / full['unfused']:.3f}x)."]

    name = (torch.cuda.get_device_name() if device.type == "cuda"
            else f"{hardware.cpu_name()} ({torch.get_num_threads()} threads)")
    text = "\n".join([
        f"command: python bench/loss_memory.py {shlex.join(argv)}",
        f"device: {name}, torch {torch.__version__}, {'bf16 autocast' if bf16 else 'fp32'}, vocab {PADDED_VOCAB} "
        f"(padded), chunks of {LOSS_CHUNK_TOKENS} tokens; time: median of {args.windows} windows of "
        f"{args.steps_per_window} steps after {args.warmup_steps} warm-up",
        "",
        table(rows),
        *lines,
    ])
    print(text)
    if args.out:
        atomic_write(args.out, f"# Loss path: unfused vs chunked lm_head + cross-entropy\n\n{text}\n".encode())


if __name__ == "__main__":
    run_writing_results(main)
