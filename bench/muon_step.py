"""Muon's optimizer step per rank under data parallelism: every rank orthogonalising every block (redundant)
against each rank orthogonalising its 1/world share and all-gathering the rest (split), with fused AdamW's
step on the same model as the yardstick.

    python bench/muon_step.py [--world-size 2 --n-layer 2 --n-embd 768 --windows 5 --steps-per-window 3]

Each rank holds the whole model (as under DDP), with the same random gradients on every rank, and times
optimizer.step() alone; the table shows, per optimizer, the slowest rank's median over the timed windows,
after warm-up steps that allocate the state. Ranks are CPU processes on gloo, one thread each.
"""

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import GPT, ModelConfig  # noqa: E402
from optim import OptimConfig, build_optimizer  # noqa: E402

VARIANTS = ("adamw (fused)", "muon, redundant", "muon, split across ranks")


def parse_bench_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=2, help="fewer layers than 124M's 12 keep the CPU time sane")
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-kv-head", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--steps-per-window", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=2)
    return p.parse_args(argv)


def make_optimizer(variant, model):
    if variant.startswith("adamw"):
        return build_optimizer(model, OptimConfig(name="adamw"), model.row_blocks(), "cpu")
    muon = build_optimizer(model, OptimConfig(name="muon", ns_dtype="fp32"), model.row_blocks(), "cpu")
    muon.split_across_ranks = variant.endswith("split across ranks")
    return muon


def time_steps(optimizer, bench) -> list[float]:
    """-> seconds per step of each timed window (ranks start each window together)."""
    for _ in range(bench.warmup_steps):
        optimizer.step()
    per_step = []
    for _ in range(bench.windows):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(bench.steps_per_window):
            optimizer.step()
        per_step.append((time.perf_counter() - t0) / bench.steps_per_window)
    return per_step


def worker(rank, bench, init_file, out_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=bench.world_size)
    try:
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=bench.vocab_size, n_layer=bench.n_layer, n_head=bench.n_head,
                          n_kv_head=bench.n_kv_head, n_embd=bench.n_embd, max_seq_len=1024)
        model = GPT(cfg)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        medians = {}
        for variant in VARIANTS:
            optimizer = make_optimizer(variant, model)
            medians[variant] = statistics.median(time_steps(optimizer, bench))
            del optimizer
        slowest = [None] * bench.world_size
        dist.all_gather_object(slowest, medians)
        if rank == 0:
            torch.save({v: max(m[v] for m in slowest) for v in VARIANTS}, out_file)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    bench = parse_bench_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "medians.pt")
        mp.spawn(worker, args=(bench, os.path.join(tmp, "rdzv"), out_file), nprocs=bench.world_size, join=True)
        medians = torch.load(out_file)
    n_params = sum(p.numel() for p in GPT(ModelConfig(vocab_size=bench.vocab_size, n_layer=bench.n_layer,
                                                       n_head=bench.n_head, n_kv_head=bench.n_kv_head,
                                                       n_embd=bench.n_embd, max_seq_len=1024)).parameters())
    adamw, redundant = medians[VARIANTS[0]], medians[VARIANTS[1]]
    print(f"command: `python bench/muon_step.py {shlex.join(argv)}`")
    print(f"setup: {bench.world_size} gloo ranks x 1 thread ({torch.__version__}, CPU); {n_params / 1e6:.1f}M params "
          f"({bench.n_layer} layers, d={bench.n_embd}, vocab {bench.vocab_size}); Muon NS in fp32; median of "
          f"{bench.windows} windows x {bench.steps_per_window} steps after {bench.warmup_steps} warm-up steps, "
          "slowest rank\n")
    print("| optimizer step | ms per step (slowest rank) | vs fused AdamW | vs redundant Muon |")
    print("|---|---|---|---|")
    for variant in VARIANTS:
        t = medians[variant]
        vs_redundant = f"{t / redundant:.2f}x" if variant.startswith("muon") else ""
        print(f"| {variant} | {1000 * t:,.1f} | {t / adamw:.2f}x | {vs_redundant} |")


if __name__ == "__main__":
    main()
