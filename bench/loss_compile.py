"""The fused loss under torch.compile: trace time, graphs and peak loss-path bytes as the micro-batch grows.

    python bench/loss_compile.py [--micro-batches 4,16,64 --seq-len 1024 --dim 768 --baseline REV]

Compile: loss.linear_cross_entropy is compiled once with Dynamo and AOTAutograd (backend aot_eager: the
trace, without Inductor's code generation) and called at each micro-batch in turn, forward and backward; the
table gives each call's wall time, tracing included, and the graphs compiled so far. What tracing costs
depends on the number of chunks, not on the width or the vocabulary, so these calls use GPT-2's token counts
with a width of 8 and a vocabulary of 512, which make the computation itself negligible.

Peak loss-path bytes, at GPT-2 small's full shape (hidden states [B, T, 768] in bf16 that require grad, a
bf16 [50,304, 768] head): the most bytes held at once by tensors the loss path creates during one eager
forward and backward, against the unfused F.cross_entropy(F.linear(x, W).float(), targets). Fake tensors
(shapes and dtypes without data) make this instant at any shape; a dispatch mode counts each new storage
from its creation until its last tensor is freed.

--baseline REV runs the same measurement with the fused loss as it is at git revision REV (loss.py, or model.py
at revisions before loss.py held it), for comparison.
"""

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
import time
import weakref

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import hardware  # noqa: E402
from cli import HelpFormatter, ScriptParser, count  # noqa: E402
from model import ModelConfig  # noqa: E402

VOCAB = ModelConfig().vocab_size
PADDED_VOCAB = ModelConfig().padded_vocab_size
MIB = 2**20
TRACE_DIM, TRACE_VOCAB = 8, 512


class PeakLiveBytes(TorchDispatchMode):
    """The peak of the bytes held by storages created under this mode (inputs' storages are not counted)."""

    def __init__(self):
        super().__init__()
        self.tensors_of = {}  # storage key -> live tensors viewing it
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor):
        key, nbytes = t.untyped_storage()._cdata, t.untyped_storage().nbytes()
        if key not in self.tensors_of:
            self.tensors_of[key] = 0
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.tensors_of[key] += 1
        weakref.finalize(t, self._release, key, nbytes)

    def _release(self, key, nbytes):
        self.tensors_of[key] -= 1
        if not self.tensors_of[key]:
            del self.tensors_of[key]
            self.live -= nbytes


def loss_inputs(batch: int, seq_len: int, dim: int, vocab: int):
    x = torch.randn(batch, seq_len, dim, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, dim, dtype=torch.bfloat16, requires_grad=True)
    return x, weight, torch.randint(0, vocab, (batch, seq_len))


def peak_bytes(loss_fn, batch: int, seq_len: int, dim: int) -> int:
    with FakeTensorMode():
        x, weight, targets = loss_inputs(batch, seq_len, dim, PADDED_VOCAB)
        with PeakLiveBytes() as mode:
            loss_fn(x, weight, targets).backward()
    return mode.peak


def unfused(x, weight, targets):
    return F.cross_entropy(F.linear(x, weight).float().flatten(0, 1), targets.flatten())


def measure(loss_module, micro_batches: list[int], seq_len: int, dim: int) -> list[dict]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loss_module.linear_cross_entropy, backend="aot_eager")
    rows = []
    for batch in micro_batches:
        x, weight, targets = loss_inputs(batch, seq_len, TRACE_DIM, TRACE_VOCAB)
        t0 = time.perf_counter()
        compiled(x, weight, targets).backward()
        seconds = time.perf_counter() - t0
        tokens = batch * seq_len
        chunks = (loss_module.loss_chunks(tokens, loss_module.LOSS_CHUNK_TOKENS)
                  if hasattr(loss_module, "loss_chunks") else -(-tokens // loss_module.LOSS_CHUNK_TOKENS))
        rows.append(dict(batch=batch, seconds=seconds, graphs=counters["stats"]["unique_graphs"], chunks=chunks,
                         chunk_tokens=-(-tokens // chunks),
                         peak=peak_bytes(loss_module.linear_cross_entropy, batch, seq_len, dim),
                         unfused_peak=peak_bytes(unfused, batch, seq_len, dim)))
    return rows


def loss_at(rev: str):
    """The module that held the fused loss at git revision rev (loss.py, else model.py), imported under another
    name."""
    shown = [subprocess.run(["git", "show", f"{rev}:{name}"], cwd=REPO, capture_output=True, text=True)
             for name in ("loss.py", "model.py")]
    source = next(s.stdout for s in shown if s.returncode == 0)
    path = os.path.join(tempfile.mkdtemp(), f"loss_{rev}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"loss_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table(results: dict[str, list[dict]], seq_len: int) -> str:
    lines = ["| loss at | micro-batch | tokens | chunks x tokens | compile + first call | graphs so far "
             "| peak loss-path bytes | unfused | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for name, rows in results.items():
        for r in rows:
            lines.append(f"| {name} | {r['batch']} | {r['batch'] * seq_len:,} | {r['chunks']} x {r['chunk_tokens']:,} "
                         f"| {r['seconds']:.1f} s | {r['graphs']} | {r['peak'] / MIB:,.0f} MiB "
                         f"| {r['unfused_peak'] / MIB:,.0f} MiB | {r['peak'] / r['unfused_peak']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = ScriptParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--micro-batches", default="4,16,64", help="comma-separated, called in this order")
    p.add_argument("--seq-len", type=count, default=1024, help="tokens per sequence")
    p.add_argument("--dim", type=count, default=768, help="hidden width of the peak-bytes measurement (GPT-2 small's)")
    p.add_argument("--baseline", default=None, help="also measure the fused loss at this git revision")
    args = p.parse_args(argv)
    try:
        micro_batches = [count(b) for b in args.micro_batches.split(",")]
    except argparse.ArgumentTypeError as e:
        p.error(f"--micro-batches: {e}")
    if args.baseline and subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.baseline}^{{commit}}"],
                                        cwd=REPO, capture_output=True).returncode:
        p.error(f"--baseline {args.baseline}: not a git revision here")
    import loss

    results = {}
    if args.baseline:
        results[args.baseline] = measure(loss_at(args.baseline), micro_batches, args.seq_len, args.dim)
    results["this tree"] = measure(loss, micro_batches, args.seq_len, args.dim)
    print(f"Command: `python bench/loss_compile.py {shlex.join(argv)}` (CPU: {hardware.cpu_name()}, torch "
          f"{torch.__version__}, backend aot_eager; peak bytes: bf16 loss path, d={args.dim}, seq {args.seq_len}, "
          f"vocab {PADDED_VOCAB:,} padded)\n")
    print(table(results, args.seq_len))


if __name__ == "__main__":
    main()
