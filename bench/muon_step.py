"""Muon's optimizer step per rank: its time under data parallelism, and its traffic under FSDP2.

    python bench/muon_step.py [--world-size 2 --n-layer 2 --n-embd 768 --windows 5 --steps-per-window 3]
    python bench/muon_step.py --compile --world-size 1 --n-layer 12 --n-embd 64 --n-head 4 --n-kv-head 2
    python bench/muon_step.py --fsdp --world-size 2 4 --n-layer 12 [--windows 3 --steps-per-window 1]

Without --fsdp, each rank holds the whole model (as under DDP), with the same random gradients on every rank,
and times optimizer.step() alone: every rank orthogonalising every block (redundant) against each rank
orthogonalising its 1/world share and all-gathering the rest (split), with fused AdamW's step on the same
model as the yardstick. --compile adds Muon with compile=True (muon.py: one compiled function for the group's
matrices; with one rank there is no split, so it is the whole step in those functions).

Operations dispatched are counted by OpCounter, a TorchDispatchMode, on one step after the timed ones. Dynamo
refuses to run compiled code under such a mode, so a compiled function runs with the counter paused and counts
as one call, reported beside the operations: what the host dispatches outside compiled code, plus the compiled
functions it calls (each of which runs a few generated kernels and the matmuls' library calls).

With --fsdp, the model is sharded by FSDP2 (fully_shard on each block, then the root) at each world size, and
one Muon step after a warm-up step is counted: the collective calls and the bytes each rank receives (counted
by CollectiveCounter, which sees torch.distributed's collectives and DTensor's functional ones alike), against
the targets of 2 calls per bucket and 2.5 x (fp32 matrix bytes / ranks) received; then its time.

Times are the slowest rank's median over the timed windows, after warm-up steps that allocate the state. Ranks
are CPU processes on gloo, one thread each.
"""

import collections
import functools
import math
import os
import shlex
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hardware  # noqa: E402
import muon  # noqa: E402
import update_math  # noqa: E402
from cli import HelpFormatter, ScriptParser, count  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402
from optim import OptimConfig, build_optimizer  # noqa: E402

VARIANTS = ("adamw (fused)", "muon, redundant", "muon, split across ranks")
COMPILED = "muon, compiled"
NS_ALONE = "Newton-Schulz alone (the same batched calls, fp32)"
MIB = 2**20


# ----------------------------------------------------------------------------- counting collectives


def _nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _own_split(out: torch.Tensor, splits: list[int], rank: int, size: int) -> int:
    """Bytes of an all-to-all's output that come from the rank itself (splits along dim 0; none: equal)."""
    if not splits:
        return _nbytes(out) // size
    return _nbytes(out) // max(out.shape[0], 1) * splits[rank]


def _gathered(args, result, rank, size):
    return _nbytes(args[0]) - _nbytes(args[1])


def _ring_reduced(args, result, rank, size):
    return 2 * (size - 1) * _nbytes(args[0]) // size


# Each collective's bytes that other ranks deliver into this rank's outputs: (op's args, its result, this
# rank's index in the op's group, the group's size) -> bytes. Reductions count what a ring delivers.
RECEIVED = {
    # c10d's, which torch.distributed.all_gather, all_to_all_single, ... run
    "allgather_": _gathered,
    "_allgather_base_": _gathered,
    "allgather_into_tensor_coalesced_": _gathered,
    "alltoall_base_": lambda args, result, rank, size: _nbytes(args[0]) - _own_split(args[0], args[3], rank, size),
    "alltoall_": lambda args, result, rank, size: _nbytes(args[0]) - _nbytes(args[0][rank]),
    "broadcast_": lambda args, result, rank, size: 0 if rank == args[2] else _nbytes(args[0]),
    "allreduce_": _ring_reduced,
    "_reduce_scatter_base_": lambda args, result, rank, size: (size - 1) * _nbytes(args[0]),
    "reduce_scatter_": lambda args, result, rank, size: (size - 1) * _nbytes(args[0]),
    "barrier": lambda args, result, rank, size: 0,
    # the functional ones, which DTensor's redistribute and full_tensor run
    "all_gather_into_tensor": lambda args, result, rank, size: _nbytes(result) - _nbytes(args[0]),
    "all_to_all_single": lambda args, result, rank, size: _nbytes(result) - _own_split(result, args[1], rank, size),
    "all_reduce": _ring_reduced,
    "reduce_scatter_tensor": lambda args, result, rank, size: (size - 1) * _nbytes(result),
    "broadcast": lambda args, result, rank, size: 0 if rank == args[1] else _nbytes(result),
}
NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}  # the functional collectives' bookkeeping


def _group_of(func, args) -> "dist.ProcessGroup":
    if func.namespace == "c10d":
        return dist.ProcessGroup.unbox(next(a for a in args if isinstance(a, torch.ScriptObject)))
    return dist.distributed_c10d._resolve_process_group(args[-1])


class CollectiveCounter(TorchDispatchMode):
    """Inside it, counts the collectives this process runs (calls) and the bytes other ranks deliver into its
    outputs (received), by op name (by_op). It watches the dispatcher, so torch.distributed's functions and
    DTensor's functional collectives are counted alike; an op it has no byte count for is an error, never a
    silent zero."""

    def __init__(self):
        super().__init__()
        self.calls, self.received, self.by_op = 0, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.namespace in ("c10d", "_c10d_functional") and name not in NOT_COLLECTIVES:
            if name not in RECEIVED:
                raise NotImplementedError(f"CollectiveCounter has no byte count for {func}")
            group = _group_of(func, args)
            self.calls += 1
            self.received += RECEIVED[name](args, result, group.rank(), group.size())
            self.by_op[name] = self.by_op.get(name, 0) + 1
        return result


# ----------------------------------------------------------------------------- the benchmark


def parse_bench_args(argv):
    p = ScriptParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--fsdp", action="store_true", help="FSDP2-sharded model: collective calls, bytes and time")
    p.add_argument("--world-size", type=count, nargs="+", default=[2],
                   help="one, or (with --fsdp) several (default: 2)")
    p.add_argument("--n-layer", type=int, default=2, help="fewer layers than 124M's 12 keep the CPU time sane")
    p.add_argument("--n-embd", type=int, default=768, help="model width")
    p.add_argument("--n-head", type=int, default=12, help="query heads")
    p.add_argument("--n-kv-head", type=int, default=4, help="key/value heads")
    p.add_argument("--vocab-size", type=int, default=50304, help="vocabulary (GPT-2's, padded to a multiple of 128)")
    p.add_argument("--windows", type=int, default=5, help="timed windows; the table reports their median (0: "
                                                           "count the operations only)")
    p.add_argument("--steps-per-window", type=count, default=3, help="optimizer steps timed together as one window")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first (they compile, with --compile)")
    p.add_argument("--compile", action="store_true", help="also Muon with compile=True (not with --fsdp)")
    bench = p.parse_args(argv)
    if not bench.fsdp and len(bench.world_size) > 1:
        p.error("several --world-size values need --fsdp")
    if bench.fsdp and bench.compile:
        p.error("--compile times the data-parallel step; --fsdp counts collectives, which compiling does not change")
    if bench.windows < 0:
        p.error(f"--windows must be >= 0, got {bench.windows}")
    try:  # the model's own shape checks (heads that divide the width, ...), before any rank starts
        model_config(bench).validate()
    except ValueError as e:
        p.error(str(e))
    return bench


def model_config(bench) -> ModelConfig:
    """GPT-2's tied head, as the results in bench/results/muon_step_*.md were measured."""
    return ModelConfig(vocab_size=bench.vocab_size, n_layer=bench.n_layer, n_head=bench.n_head,
                       n_kv_head=bench.n_kv_head, n_embd=bench.n_embd, max_seq_len=1024, tie_embeddings=True)


def make_optimizer(variant, model):
    if variant.startswith("adamw"):
        return build_optimizer(model, OptimConfig(name="adamw"), model.row_blocks(), "cpu")
    muon = build_optimizer(model, OptimConfig(name="muon", ns_dtype="fp32"), model.row_blocks(), "cpu",
                           compile=variant == COMPILED)
    muon.split_across_ranks = variant != "muon, redundant"
    return muon


def time_steps(step, bench) -> list[float]:
    """-> seconds per call of step() in each timed window, after the warm-up calls (ranks start each window
    together)."""
    for _ in range(bench.warmup_steps):
        step()
    per_step = []
    for _ in range(bench.windows):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(bench.steps_per_window):
            step()
        per_step.append((time.perf_counter() - t0) / bench.steps_per_window)
    return per_step


def newton_schulz_alone(optimizer, bench) -> list[float]:
    """-> seconds per step of each timed window of Newton-Schulz alone on the blocks one eager step orthogonalises,
    in its batched calls (update_math.wide_batches): the arithmetic that bounds the step once the matrices are not
    tiny. What the step takes beyond it is its AdamW side, its elementwise passes and its host work."""
    group = next(g for g in optimizer.param_groups if g["kind"] == "muon")
    shapes = [tuple(p.shape) for p in group["params"]]
    splits = [tuple(split) for split in group["row_blocks"]]
    stacks = []
    for batch in update_math.wide_batches(shapes, splits):
        s, k = batch[0]
        rows, cols = splits[s][k], shapes[s][1]
        stacks.append(torch.randn(len(batch), min(rows, cols), max(rows, cols)))
    ns = functools.partial(update_math.newton_schulz, steps=group["ns_steps"],
                           dtype=update_math.NS_DTYPES[group["ns_dtype"]])

    def step():
        for stack in stacks:
            ns(stack)

    return time_steps(step, bench)


def ddp_worker(rank, world_size, bench, out_file):
    torch.manual_seed(0)
    model = GPT(model_config(bench))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    medians, dispatched = {}, {}
    for variant in variants(bench):
        optimizer = make_optimizer(variant, model)
        medians[variant] = statistics.median(time_steps(optimizer.step, bench) or [math.nan])
        dispatched[variant] = count_step(optimizer)
        if variant == VARIANTS[1]:
            medians[NS_ALONE] = statistics.median(newton_schulz_alone(optimizer, bench) or [math.nan])
        del optimizer
    slowest = [None] * world_size
    dist.all_gather_object(slowest, medians)
    if rank == 0:
        torch.save({"seconds": {v: max(m[v] for m in slowest) for v in (*variants(bench), NS_ALONE)},
                    "ops": dispatched}, out_file)


def variants(bench) -> tuple[str, ...]:
    return VARIANTS + (COMPILED,) * bench.compile


def count_step(optimizer) -> tuple[int, int]:
    """-> (operations one optimizer.step() dispatches outside compiled code, compiled functions it calls)."""
    compiled = {key: fn for key, fn in getattr(optimizer, "_steps", {}).items()
                if hasattr(fn, "_torchdynamo_orig_callable")}
    calls = [0]

    def paused(fn):
        def call(*args):
            calls[0] += 1
            with _disable_current_modes():
                return fn(*args)
        return call

    optimizer._steps = {**getattr(optimizer, "_steps", {}), **{k: paused(f) for k, f in compiled.items()}}
    try:
        with OpCounter() as counter:
            optimizer.step()
    finally:
        optimizer._steps.update(compiled)
    return counter.count, calls[0]


class OpCounter(TorchDispatchMode):
    """The PyTorch operations one optimizer step dispatches: each is host work (and, on a GPU, most are a kernel
    launch), which bounds the step when its kernels are small."""

    def __enter__(self):
        self.by_func = collections.Counter()  # operation (aten.lerp_, ...) -> how many times
        return super().__enter__()

    @property
    def count(self) -> int:
        return sum(self.by_func.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_func[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


def muon_traffic(model, optimizer) -> dict:
    """The Muon matrices' fp32 bytes and buckets, and one step's collective calls and bytes received here."""
    group = next(g for g in optimizer.param_groups if g["kind"] == "muon")
    todo = list(zip(group["params"], group["row_blocks"]))
    with CollectiveCounter() as counted:
        optimizer.step()
    return {"matrix_bytes": sum(4 * p.numel() for p, _ in todo), "by_op": counted.by_op,
            "buckets": len(muon.muon_buckets(todo, muon.MUON_BUCKET_BYTES)),
            "calls": counted.calls, "received": counted.received}


def fsdp_worker(rank, world_size, bench, out_file):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = GPT(model_config(bench))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    for p in model.parameters():  # each rank's shard of a gradient, as FSDP2's reduce-scatter leaves it
        p.grad = DTensor.from_local(torch.randn_like(p.to_local()) * 1e-3, p.device_mesh, p.placements,
                                    shape=p.shape, stride=p.stride())
    optimizer = make_optimizer("muon, split across ranks", model)
    optimizer.step()  # allocates the state
    traffic = muon_traffic(model, optimizer)
    traffic["seconds"] = statistics.median(time_steps(optimizer.step, bench) or [math.nan])  # --windows 0
    every_rank = [None] * world_size
    dist.all_gather_object(every_rank, traffic)
    if rank == 0:
        torch.save(every_rank, out_file)


def _gloo_process(rank, world_size, worker, bench, init_file, out_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        worker(rank, world_size, bench, out_file)
    finally:
        dist.destroy_process_group()


def run_ranks(worker, world_size, bench):
    """Run worker(rank, world_size, bench, out_file) in world_size gloo processes; -> what rank 0 saved."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "result.pt")
        mp.spawn(_gloo_process, args=(world_size, worker, bench, os.path.join(tmp, "rdzv"), out_file),
                 nprocs=world_size, join=True)
        return torch.load(out_file)


def setup_line(bench, world_size: str, before: str = "") -> str:
    n_params = sum(p.numel() for p in GPT(model_config(bench)).parameters())
    return (f"setup: {world_size} gloo ranks x 1 thread ({torch.__version__}; CPU: {hardware.cpu_name()}); "
            f"{n_params / 1e6:.1f}M params ({bench.n_layer} layers, d={bench.n_embd}, vocab {bench.vocab_size}); "
            f"Muon NS in fp32; {'compiled: torch.compile (inductor), cold compile in the warm-up; ' * bench.compile}"
            f"{before}median of {bench.windows} windows x {bench.steps_per_window} steps after "
            f"{bench.warmup_steps} warm-up steps, slowest rank; not measured on a GPU\n")


def print_ddp_table(bench):
    result = run_ranks(ddp_worker, bench.world_size[0], bench)
    medians, ops = result["seconds"], result["ops"]
    adamw, redundant = medians[VARIANTS[0]], medians[VARIANTS[1]]
    print(setup_line(bench, str(bench.world_size[0])))
    print("| optimizer step | ms per step (slowest rank) | vs fused AdamW | vs redundant Muon | "
          "operations dispatched outside compiled code (rank 0) | compiled-function calls | the two together |")
    print("|---|---|---|---|---|---|---|")
    for variant in variants(bench):
        t, (eager_ops, calls) = medians[variant], ops[variant]
        vs_redundant = f"{t / redundant:.2f}x" if variant.startswith("muon") else ""
        timed = f"{1000 * t:,.1f} | {t / adamw:.2f}x | {vs_redundant}" if t == t else "not timed | | "  # --windows 0
        print(f"| {variant} | {timed} | {eager_ops:,} | {calls} | {eager_ops + calls:,} |")
    ns, rest = medians[NS_ALONE], redundant - medians[NS_ALONE]
    if ns == ns:
        print(f"\n{NS_ALONE}: {1000 * ns:,.1f} ms a step; the redundant Muon step less it (its AdamW side, "
              f"elementwise passes and host work): {1000 * rest:,.1f} ms = {rest / adamw:.2f}x fused AdamW's step")


def print_fsdp_table(bench):
    rows = []
    for world_size in bench.world_size:
        ranks = run_ranks(fsdp_worker, world_size, bench)
        first = ranks[0]
        share = first["matrix_bytes"] / world_size
        received = max(r["received"] for r in ranks)
        calls = max(r["calls"] for r in ranks)
        ops = ", ".join(f"{n} {c}" for n, c in sorted(first["by_op"].items()))
        rows.append(f"| {world_size} | {first['buckets']} | {calls} ({ops}) | {2 * first['buckets']} | "
                    f"{received / MIB:,.1f} | {share / MIB:,.1f} | {received / share:.2f} (target <= 2.5) | "
                    + (f"{1000 * max(r['seconds'] for r in ranks):,.0f} |" if bench.windows else "not timed |"))
    print(setup_line(bench, " and ".join(map(str, bench.world_size)),
                     "a step that allocates the state, then the counted step, then the timed windows' "))
    print("| ranks | buckets | collective calls per step (most on a rank) | target: 2 x buckets | "
          "MiB received per rank per step (most) | fp32 matrix MiB / ranks | received / that | "
          "ms per step (slowest rank) |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    bench = parse_bench_args(argv)
    print(f"command: `python bench/muon_step.py {shlex.join(argv)}`")
    if bench.fsdp:
        print_fsdp_table(bench)
    else:
        print_ddp_table(bench)


if __name__ == "__main__":
    main()
