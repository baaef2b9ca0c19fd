"""Muon (github.com/KellerJordan/Muon; "Muon is Scalable for LLM Training", Moonshot AI 2025): the hidden
matrices updated with their orthogonalised Nesterov momentum, AdamW for everything else, in one optimizer.

    optimizer = Muon(groups, momentum=0.95, ns_dtype="bf16")   # groups: optim.build_optimizer's

Fused weights are orthogonalised one row block at a time (Q, K and V of qkv.weight; gate and up of fc1_weight),
since each block is a separate linear map that happens to share a GEMM. optim.py builds the groups and chooses
between the optimizers; this file holds the update: Newton-Schulz, the stacks of same-shape matrices (one
compiled function each under compile=True), the buckets, the split of the work across DDP ranks and FSDP2's
owner-rank exchange, and the recipe options (Polar Express, NorMuon, cautious decay).
"""

import functools
import itertools
import math
import types

import torch

from hardware import fused_adamw_available
from schedule import muon_momentum

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch built without distributed support: no parameter can be a DTensor
    DTensor = None

MUON_SCALES = ("original", "match_rms_adamw")
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_COEFF_SCHEMES = ("quintic", "polar-express")
# Polar Express (Amsel, Persson, Musco, Gower 2025, Algorithm 1): per iteration, the odd quintic a x + b x^3 +
# c x^5 that is the minimax (equioscillating) approximation of 1 on the interval the previous ones leave, from
# [1e-3, 1], cushioned at 0.0240733 x the upper end and recentred on 1; the 8th repeats from then on.
# tests/test_muon.py re-derives them. Each but the last is applied as p(x / 1.01) against round-off growth.
POLAR_EXPRESS_COEFFICIENTS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS_SAFETY = 1.01
# NorMuon: added to the root of a row's second moment; orthogonalised rows have mean squares near 1/cols.
NORMUON_EPS = 1e-8
# fp32 bytes of the matrices Muon orthogonalises together: big enough to batch a few layers' blocks (and, under
# FSDP2, for few collectives: two a bucket), small enough that a rank's full blocks stay a bounded part of memory.
MUON_BUCKET_BYTES = 256 * 2**20


def scalar_dtype(device: torch.device) -> torch.dtype:
    """The dtype of a step's scalars computed on the device: float64, as Python computes them on the host, so
    that they round to what a host-computed scalar would; MPS has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def per_step(skip: torch.Tensor, value: float, skipped: float, dtype: torch.dtype) -> torch.Tensor:
    """`value`, or `skipped` where skip (a bool scalar): a scalar made on skip's device. A tensor made from a
    Python number there would be copied from the host, which waits for the GPU; a fill does not."""
    return torch.full((), value, dtype=dtype, device=skip.device).masked_fill_(skip, skipped)


def ns_coefficients(scheme: str, steps: int) -> tuple[list[tuple[float, float, float]], float]:
    """-> ((a, b, c) of each of `steps` iterations, the factor the input's norm is scaled by first).

    "quintic": the same polynomial every time (3.4445, -4.7750, 2.0315); it trades convergence for speed,
    leaving singular values roughly in [0.7, 1.2] rather than at 1. "polar-express": Polar Express's
    per-iteration polynomials with their safety factor: p(x / 1.01) instead of p(x), for all but the last of
    the table (the Newton-Schulz fixed point, repeated beyond it), and the input divided by 1.01 x its norm, so
    that round-off cannot push a singular value past the interval the next polynomial is built for.
    """
    if scheme == "quintic":
        return [NS_COEFFICIENTS] * steps, 1.0
    s = POLAR_EXPRESS_SAFETY
    table = [(a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS_COEFFICIENTS[:-1]]
    table.append(POLAR_EXPRESS_COEFFICIENTS[-1])
    return table[:steps] + [table[-1]] * (steps - len(table)), s


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype, coeffs: str = "quintic") -> torch.Tensor:
    """Approximately orthogonalise g (push its singular values towards 1) with `steps` odd quintic iterations
    X <- a X + b (X X^T) X + c (X X^T)^2 X, their coefficients from ns_coefficients(coeffs); g is one matrix
    [rows, cols] or a stack of same-shape ones [n, rows, cols], each orthogonalised on its own. Wide
    orientation keeps X X^T small.
    """
    schedule, safety = ns_coefficients(coeffs, steps)
    x = g.to(dtype)
    single = x.ndim == 2
    if single:
        x = x[None]
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    # The Frobenius norm bounds the spectral norm, so the iteration starts in range.
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) * safety + NS_EPS)
    for a, b, c in schedule:
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    x = x.mT if tall else x
    return x[0] if single else x


def _weight(skip: torch.Tensor, value, skipped: float, dtype: torch.dtype) -> torch.Tensor:
    """per_step of a Python number (eager) or of a float64 scalar tensor (compiled: see Muon._stacked_step)."""
    if torch.is_tensor(value):
        return torch.where(skip, skipped, value).to(dtype)
    return per_step(skip, value, skipped, dtype)


def _add_(targets: list, updates: list, alpha) -> None:
    """targets += alpha x updates; alpha a Python number (eager: rounded once, as torch.optim.Muon's) or a tensor."""
    if torch.is_tensor(alpha):
        torch._foreach_add_(targets, torch._foreach_mul(updates, alpha))
    else:
        torch._foreach_add_(targets, updates, alpha=alpha)


def stack_step_(params: list, grads: list, bufs: list, row_sq: list, skip: torch.Tensor, lr, decay, momentum, *,
                split: tuple, scales: tuple, nesterov: bool, ns, normuon_beta, cautious: bool) -> None:
    """One Muon step for a stack of same-shape matrices (same row split, dtype and device), in place: momentum
    (its EMA), Nesterov, the skip, Newton-Schulz on each row block of all the matrices at once (ns), NorMuon
    where normuon_beta is set, the decay and the update, block k scaled by scales[k].

    No per-matrix loop of operations (off the recipe options): torch.stack reads the gradients and momenta into
    one tensor each and each step is one operation on the stack, which Muon's compile turns into a few kernels.
    Where skip (a bool scalar) parameters and momenta stay exactly as they were. lr, decay (lr x weight decay)
    and momentum are Python numbers or float64 tensors (compiled; momentum [n, 1, 1] under the warm-up)."""
    dtype = params[0].dtype
    g = torch.stack(grads).masked_fill_(skip, 0.0)  # a NaN times a weight of 0 stays NaN
    m = torch.stack(bufs)
    m.lerp_(g, _weight(skip, 1 - momentum, 0.0, m.dtype))
    torch._foreach_copy_(bufs, m.unbind(0))
    update = g.lerp_(m, momentum.to(m.dtype) if torch.is_tensor(momentum) else momentum) if nesterov else m
    orthos = list(update.masked_fill(skip, 0.0).split(split, dim=1))
    for rows in dict.fromkeys(split):  # blocks of one size (K and V; gate and up) in one batch
        ks = [k for k, size in enumerate(split) if size == rows]
        for k, ortho in zip(ks, ns(torch.cat([orthos[k] for k in ks])).chunk(len(ks))):
            orthos[k] = ortho
    if normuon_beta is not None:  # row_sq[j] is matrix j's per-row EMA, cut into the same blocks
        avgs = [r.split(split) for r in row_sq]
        orthos = [torch.stack([normuon_rows(o, avg[k], normuon_beta, skip) for o, avg in zip(ortho, avgs)])
                  for k, ortho in enumerate(orthos)]
    blocks = [p.split(split) if len(split) > 1 else (p,) for p in params]
    if cautious:  # every row is in exactly one block, so each is decayed once
        amount = _weight(skip, decay, 0.0, scalar_dtype(skip.device))
        for k, ortho in enumerate(orthos):
            for block, o in zip((b[k] for b in blocks), ortho):
                cautious_decay_(block, o, amount)
    else:
        torch._foreach_mul_(params, _weight(skip, 1 - decay, 1.0, torch.promote_types(dtype, torch.float32)))
    for k, (ortho, scale) in enumerate(zip(orthos, scales)):
        # In the parameters' dtype, one dtype for foreach's fast path: exact, as the add would widen it anyway.
        _add_([b[k] for b in blocks], list(ortho.to(dtype).unbind(0)), -lr * scale)


def compiled(fn):
    """fn (its static arguments bound in) compiled whole: one graph (fullgraph: a break is an error, not a slow
    path), static shapes. Dynamo keeps graphs, and counts recompiles against a limit of 8, per code object: each
    gets a code object of its own, so that many stacks or models in one process never fall back to eager code."""
    def call(*args):
        return fn(*args)

    code = call.__code__.replace()  # a copy
    return torch.compile(types.FunctionType(code, globals(), "call", None, call.__closure__), fullgraph=True,
                         dynamic=False)


def muon_buckets(todo: list, max_bytes: int) -> list[list]:
    """Consecutive runs of (param, split) pairs whose full fp32 matrices add up to at most max_bytes (a
    larger matrix is a bucket of its own). Muon exchanges and orthogonalises one bucket at a time, so under
    FSDP2 a rank holds the full blocks it owns of one bucket, not of the whole model; every rank cuts the same
    buckets."""
    buckets, size = [[]], 0
    for p, split in todo:
        nbytes = 4 * p.numel()
        if buckets[-1] and size + nbytes > max_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((p, split))
        size += nbytes
    return [b for b in buckets if b]


def orthogonalize_blocks(blocks: list[torch.Tensor], ns, world_size: int = 1, rank: int = 0) -> list[torch.Tensor]:
    """ns (newton_schulz with its settings bound, compiled or not) of every matrix in `blocks`, with same-shape
    ones stacked into one batched call.

    With world_size > 1 (torch.distributed initialised), rank r orthogonalises only the r-th share of each
    stack (padded with zero matrices to a multiple of world_size; NS maps zero to zero) and an all-gather
    hands every rank all the results: each rank does 1/world_size of the work instead of all of it. The
    stacks and shares follow the order of `blocks`, so every rank must pass the same shapes in the same order.
    """
    by_shape: dict[tuple, list[int]] = {}
    for i, block in enumerate(blocks):
        by_shape.setdefault(tuple(block.shape), []).append(i)
    out: list[torch.Tensor] = [None] * len(blocks)
    for indices in by_shape.values():
        stack = torch.stack([blocks[i] for i in indices])
        if world_size > 1:
            share = -(-len(indices) // world_size)
            padded = torch.cat([stack, stack.new_zeros(share * world_size - len(indices), *stack.shape[1:])])
            mine = ns(padded[rank * share:(rank + 1) * share]).contiguous()
            gathered = [torch.empty_like(mine) for _ in range(world_size)]
            torch.distributed.all_gather(gathered, mine)
            result = torch.cat(gathered)[:len(indices)]
        else:
            result = ns(stack)
        for i, ortho in zip(indices, result):
            out[i] = ortho
    return out


def normuon_rows(ortho: torch.Tensor, row_sq_avg: torch.Tensor, beta: float,
                 skip: torch.Tensor | None = None) -> torch.Tensor:
    """NorMuon (Li et al. 2025): one orthogonalised block [rows, cols] -> the block (in float32, or in row_sq_avg's
    dtype if wider) with each row divided by the root of row_sq_avg, the EMA of the row's mean square (updated
    in place, [rows]), then scaled back to the block's Frobenius norm.

    Orthogonalisation evens out the singular values but not the rows: some output neurons still get much larger
    updates than others, which the per-row second moment evens out; the rescale keeps the update's RMS, so
    muon_scale_factor and the LR mean what they meant. No bias correction: the rescale cancels any factor
    common to all rows. A zero block (no gradient yet, a skipped step) stays zero; where skip (a bool scalar),
    row_sq_avg stays as it was."""
    o = ortho.to(torch.promote_types(row_sq_avg.dtype, torch.float32))
    weight = 1 - beta if skip is None else per_step(skip, 1 - beta, 0.0, row_sq_avg.dtype)
    row_sq_avg.lerp_(o.square().mean(dim=1).to(row_sq_avg.dtype), weight)
    normed = o / (row_sq_avg.to(o.dtype).sqrt() + NORMUON_EPS)[:, None]
    return normed.mul_(torch.linalg.vector_norm(o) / torch.linalg.vector_norm(normed).clamp_min(1e-30))


def cautious_decay_(param: torch.Tensor, update: torch.Tensor, amount: float) -> None:
    """Cautious weight decay (Chen et al. 2025), in place: param *= 1 - amount where the update (the step
    subtracts lr x update) and param have the same sign or either is zero, so that the decay never pulls a
    coordinate against the direction its update moves it. Where every sign agrees this is plain decoupled
    decay, param *= 1 - amount."""
    param.mul_(((update * param) >= 0).to(param.dtype).mul_(-amount).add_(1))


def muon_scale_factor(rows: int, cols: int, mode: str) -> float:
    """LR multiplier for one orthogonalised block of shape [rows, cols]."""
    if mode == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def _is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _check_placements(name: str, p: torch.Tensor):
    if not _is_dtensor(p):
        return
    shards = [pl for pl in p.placements if not isinstance(pl, Replicate)]
    if len(shards) > 1 or any(type(pl) is not Shard or pl.dim != 0 for pl in shards):
        raise ValueError(f"Muon needs {name} replicated or sharded on dim 0 (FSDP2), got {p.placements}")


def shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """[first, end) of the rows that `rank` holds of a `rows`-row matrix sharded on dim 0 over world_size ranks:
    torch.chunk's split, as FSDP2's (ceil-sized chunks, trailing ones short or empty)."""
    chunk = -(-rows // world_size)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def held_rows(start: int, rows: int, matrix_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of the rows [start, start + rows) of a block that `rank` holds of its matrix, sharded as
    shard_rows says; lo == hi where it holds none of them."""
    first, end = shard_rows(matrix_rows, world_size, rank)
    lo = max(start, first)
    return lo, max(lo, min(start + rows, end))


def _row_shards(p: torch.Tensor) -> tuple | None:
    """(process group, its size, this rank's index in it) of the mesh dimension that splits p's rows; None where
    this rank holds every row (a plain tensor, a replicated DTensor, a shard on a one-rank mesh dimension)."""
    if _is_dtensor(p):
        mesh = p.device_mesh
        for mesh_dim, placement in enumerate(p.placements):
            if isinstance(placement, Shard) and mesh.size(mesh_dim) > 1:
                return mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    return None


def _rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """t[start:start + count], or t itself where that is all of it: a slice is one more operation for the host."""
    return t if start == 0 and count == t.shape[0] else t[start:start + count]


def _first_local_row(p: torch.Tensor) -> int:
    shards = _row_shards(p)
    return 0 if shards is None else shard_rows(p.shape[0], *shards[1:])[0]


def _layout(p: torch.Tensor) -> tuple | None:
    return (p.device_mesh, tuple(p.placements)) if _is_dtensor(p) else None


def newton_schulz_flops(rows: int, cols: int) -> int:
    """Multiply-adds of one Newton-Schulz iteration on a [rows, cols] block, in the wide orientation: the Gram
    matrix, its square, and the product with X."""
    short, long = min(rows, cols), max(rows, cols)
    return 2 * short * short * long + short**3


def assign_owners(costs: list[int], world_size: int) -> list[int]:
    """The rank that orthogonalises each block, by the blocks' costs: the costliest first, each to the rank with
    the least work so far (the lowest such rank on ties). Every rank computes the same owners from the same
    shapes, so no rank has to be told."""
    load, owners = [0] * world_size, [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: -costs[k]):
        owners[k] = min(range(world_size), key=load.__getitem__)
        load[owners[k]] += costs[k]
    return owners


def _all_to_all(send: list[list[torch.Tensor]], recv_shapes: list[list[tuple]], group, dtype: torch.dtype,
                device: torch.device) -> list[list[torch.Tensor]]:
    """One all_to_all_single over `group`: the tensors of send[r] go to rank r, flattened into one buffer in
    `dtype`; -> received[r], tensors shaped recv_shapes[r], from rank r (views of one buffer)."""
    parts = [t.reshape(-1).to(dtype) for to_rank in send for t in to_rank]
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
    numels = [[math.prod(shape) for shape in shapes] for shapes in recv_shapes]
    out = torch.empty(sum(map(sum, numels)), dtype=dtype, device=device)
    torch.distributed.all_to_all_single(out, flat, [sum(n) for n in numels],
                                        [sum(t.numel() for t in to_rank) for to_rank in send], group=group)
    pieces = iter(out.split([n for from_rank in numels for n in from_rank]))
    return [[next(pieces).view(shape) for shape in shapes] for shapes in recv_shapes]


class Muon(torch.optim.Optimizer):
    """Muon for groups of kind "muon", AdamW for groups of kind "adamw", in one optimizer.

    Muon groups carry "row_blocks": for each parameter, the row sizes to orthogonalise separately. In one process
    (or where each DDP rank takes the whole step) the matrices of one shape and split are a stack, stepped by
    stack_step_ (with compile=True, one compiled function a stack). Across ranks the matrices go in buckets
    (muon_buckets), same-shape blocks through Newton-Schulz in one batched call (orthogonalize_blocks; compiled
    per shape with compile=True). Works on:
    - plain tensors (one device; DDP, where every rank has the same averaged grads): under torch.distributed
      with split_across_ranks each rank computes 1/world_size of the blocks and all-gathers the rest;
    - FSDP2's Shard(0) DTensors, where each rank holds some rows of each matrix: each block has an owner rank
      (assign_owners), one all_to_all per bucket brings each owner its blocks' rows from every rank, the owner
      orthogonalises them, and a second all_to_all hands each rank back the rows it holds. A rank receives about
      two 1/world_size shares of the bucket per step; state stays sharded like the parameters.
    Every matrix must be laid out alike (all plain, or all DTensors on one mesh with the same placements).

    Recipe options: ns_coeffs (newton_schulz's polynomials); normuon_beta (not None: NorMuon, normuon_rows, whose
    per-row state "row_sq_avg" is laid out like the parameter's rows, a DTensor sharded like it under FSDP2, so
    that it saves and resumes at any world size; it travels to the owner and back with the rows); a group's
    "cautious_wd" (cautious_decay_); momentum_warmup (not 0: the momentum ramps from momentum_start,
    schedule.muon_momentum of each matrix's count of steps taken, state "step" like AdamW's, which every
    checkpoint carries, so a resumed run continues the ramp exactly).

    A step handed found_inf (step_if_finite) is skipped on the device: where it is nonzero the gradients are
    zeroed and every weight of the step (the momentum's and second moments' EMAs, the decay, the AdamW update
    and step count) is 0, so the update entering Newton-Schulz is all zeros, which it maps to zeros; where it
    is 0 every weight is the one a host-computed scalar gives, so the step is bit for bit what it is without.
    """

    skips_found_inf = True

    def __init__(self, params, *, momentum=0.95, nesterov=True, ns_steps=5, ns_dtype="fp32",
                 muon_scale="match_rms_adamw", betas=(0.9, 0.95), eps=1e-8, split_across_ranks=True,
                 ns_coeffs="quintic", normuon_beta=None, momentum_warmup=0, momentum_start=0.85, compile=False):
        defaults = dict(lr=1e-3, weight_decay=0.0, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_dtype=ns_dtype, muon_scale=muon_scale, betas=betas, eps=eps, kind="adamw",
                        ns_coeffs=ns_coeffs, normuon_beta=normuon_beta, cautious_wd=False,
                        momentum_warmup=momentum_warmup, momentum_start=momentum_start)
        super().__init__(params, defaults)
        self.split_across_ranks = split_across_ranks
        # The caller's choice (train.py's --compile): cold, a compile costs seconds per stack, which a short eager
        # run (a CPU's, a debugging session's) would pay for nothing. Some builds have no Dynamo.
        self.compile = compile and torch._dynamo.is_dynamo_supported()
        self._stack_steps: dict[tuple, object] = {}  # a group's static settings and a stack's shape -> its step
        self._fused_on: dict[str, bool] = {}  # device type -> whether torch's fused AdamW runs there
        for group in self.param_groups:
            if group["kind"] != "muon":
                continue
            for name, p in zip(group["names"], group["params"]):
                if p.ndim != 2:
                    raise ValueError(f"Muon needs 2-D matrices, {name} has shape {tuple(p.shape)}")
                _check_placements(name, p)
        named = [(n, p) for g in self.param_groups if g["kind"] == "muon" for n, p in zip(g["names"], g["params"])]
        for name, p in named[1:]:  # a bucket is exchanged over one process group, each matrix split alike
            if _layout(p) != _layout(named[0][1]):
                raise ValueError(f"Muon needs its matrices laid out alike (all plain tensors, or all DTensors on one "
                                 f"device mesh with the same placements): {name} is not laid out like {named[0][0]}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)  # step_if_finite's
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon_step(group, found_inf)
            elif not group.get("cautious_wd", False) and self._fused_adamw(group):
                self._adamw_fused(group, found_inf)
            else:
                for p in group["params"]:
                    if p.grad is not None:
                        self._adamw_update(p, group, found_inf)
        return loss

    def _fused_adamw(self, group) -> bool:
        """Whether torch has a fused AdamW kernel on the group's device (probed once per device type)."""
        if not group["params"]:
            return False
        device_type = _local(group["params"][0]).device.type
        if device_type not in self._fused_on:
            self._fused_on[device_type] = fused_adamw_available(device_type)
        return self._fused_on[device_type]

    def _adamw_fused(self, group, found_inf):
        """AdamW on the whole group in torch's fused kernel: a few launches for all its parameters, where
        _adamw_update takes about twenty per parameter, a cost the host pays on a GPU (about 1,000 launches a step
        at GPT-2 small's 50 embedding and norm tensors). The same state as _adamw_update's, so a checkpoint of
        either path resumes on the other. found_inf is the kernel's own skip, as GradScaler hands it: p and its
        moments unchanged, and the count taken back."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        states = [self._adamw_state(p) for p in params]
        steps = [state["step"] for state in states]
        torch._foreach_add_(steps, 1)
        (beta1, beta2) = group["betas"]
        torch._fused_adamw_([_local(p) for p in params], [_local(p.grad) for p in params],
                            [_local(s["exp_avg"]) for s in states], [_local(s["exp_avg_sq"]) for s in states], [],
                            steps, lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                            eps=group["eps"], amsgrad=False, maximize=False, grad_scale=None, found_inf=found_inf)
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf.to(steps[0].device)] * len(steps))

    def _ranks(self) -> tuple[int, int]:
        dist = torch.distributed
        if self.split_across_ranks and dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0

    def _momenta(self, params, group, skip) -> list[torch.Tensor]:
        """Update each p's momentum; -> this rank's rows (all of them, off FSDP2) of each Nesterov-corrected
        update, all zeros where skip (a bool scalar), which leaves the momenta as they were. Multi-tensor (foreach)
        calls over the bucket, each what the per-matrix lerp_ would compute, bit for bit."""
        grads = [_local(p.grad).masked_fill(skip, 0.0) for p in params]  # a NaN times a weight of 0 stays NaN
        bufs = [_local(self._momentum_buffer(p)) for p in params]
        if group.get("momentum_warmup", 0):
            momenta = [self._momentum_now(p, group, skip) for p in params]
            torch._foreach_lerp_(bufs, grads, [(1 - m).masked_fill(skip, 0.0).to(b.dtype)
                                               for m, b in zip(momenta, bufs)])
            momentum = [m.to(b.dtype) for m, b in zip(momenta, bufs)]
        else:
            momentum = group["momentum"]
            weights = {dtype: per_step(skip, 1 - momentum, 0.0, dtype) for dtype in {b.dtype for b in bufs}}
            torch._foreach_lerp_(bufs, grads, [weights[b.dtype] for b in bufs])
        keep = per_step(skip, 1.0, 0.0, torch.float32)
        if not group["nesterov"]:
            return torch._foreach_mul(bufs, keep)
        torch._foreach_lerp_(grads, bufs, momentum)
        torch._foreach_mul_(grads, keep)
        return grads

    def _momentum_buffer(self, p) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        return state["momentum_buffer"]

    def _momentum_now(self, p, group, skip):
        """The momentum under a warm-up: schedule.muon_momentum of p's count of steps taken, as a scalar on
        the device (the host never waits for the count), and the count advanced unless skip."""
        warmup = group["momentum_warmup"]
        state, device = self.state[p], _local(p).device
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        step = state["step"] = state["step"].to(device)  # a checkpoint's comes back on the CPU
        momentum = muon_momentum(step.to(scalar_dtype(device)), warmup, group["momentum_start"], group["momentum"])
        step.add_((~skip).to(step.dtype))
        return momentum

    def _muon_step(self, group, found_inf):
        todo = [(p, split) for p, split in zip(group["params"], group["row_blocks"]) if p.grad is not None]
        if not todo:
            return
        device = _local(todo[0][0]).device
        skip = (torch.zeros((), dtype=torch.bool, device=device) if found_inf is None
                else found_inf.to(device).bool())
        if _row_shards(todo[0][0]) is None and self._ranks()[0] == 1:  # nothing to exchange: no buckets either
            self._stacked_step(todo, group, skip)
            return
        for bucket in muon_buckets(todo, MUON_BUCKET_BYTES):
            self._muon_bucket(bucket, group, skip)

    def _stacked_step(self, todo, group, skip):
        """Muon on todo's (param, row split) pairs, one stack_step_ call a stack. A compiled step takes the step's
        numbers as scalars filled on the device: as constants, each new LR would recompile it."""
        stacks: dict[tuple, list] = {}
        for p, split in todo:
            stacks.setdefault((tuple(p.shape), tuple(split), p.dtype), []).append(p)
        lr, decay, momentum = group["lr"], group["lr"] * group["weight_decay"], group["momentum"]
        if self.compile:
            lr, decay, momentum = (torch.full((), v, dtype=scalar_dtype(skip.device), device=skip.device)
                                   for v in (lr, decay, momentum))
        for (shape, split, _), params in stacks.items():
            if group.get("momentum_warmup", 0):  # each matrix's own, from its count of steps
                momentum = torch.stack([self._momentum_now(p, group, skip) for p in params])[:, None, None]
            row_sq = [_local(self._row_sq_avg(p)) for p in params] if group.get("normuon_beta") is not None else []
            self._stack_step(group, split, shape[1])(
                [_local(p) for p in params], [_local(p.grad) for p in params],
                [_local(self._momentum_buffer(p)) for p in params], row_sq, skip, lr, decay, momentum)

    def _stack_step(self, group, split: tuple, cols: int):
        """stack_step_ with the group's settings and a stack's row split bound, compiled if self.compile."""
        key = (self.compile, split, cols, group["nesterov"], group["ns_steps"], group["ns_dtype"],
               group.get("ns_coeffs"), group["muon_scale"], group.get("normuon_beta"), group.get("cautious_wd", False))
        if key not in self._stack_steps:
            step = functools.partial(
                stack_step_, split=split, nesterov=group["nesterov"], ns=self._ns(group, False),
                scales=tuple(muon_scale_factor(rows, cols, group["muon_scale"]) for rows in split),
                normuon_beta=group.get("normuon_beta"), cautious=group.get("cautious_wd", False))
            self._stack_steps[key] = compiled(step) if self.compile else step
        return self._stack_steps[key]

    def _ns(self, group, compile: bool):
        """newton_schulz with the group's settings (a stack -> its orthogonalised stack), compiled if compile."""
        key = ("ns", compile, group["ns_steps"], group["ns_dtype"], group.get("ns_coeffs"))
        if key not in self._stack_steps:
            ns = functools.partial(newton_schulz, steps=group["ns_steps"], dtype=NS_DTYPES[group["ns_dtype"]],
                                   coeffs=group.get("ns_coeffs", "quintic"))
            self._stack_steps[key] = compiled(ns) if compile else ns
        return self._stack_steps[key]

    def _muon_bucket(self, todo, group, skip):
        """Momentum, Newton-Schulz and the update for a bucket of (param, row split) pairs."""
        updates = self._momenta([p for p, _ in todo], group, skip)
        blocks = [(i, start, rows) for i, (_, split) in enumerate(todo)  # (index into todo, first row, rows)
                  for start, rows in zip(itertools.accumulate(split, initial=0), split)]
        shards = _row_shards(todo[0][0])
        if shards is None:
            orthos = self._orthogonalize_whole(todo, updates, blocks, group, skip)
        else:
            orthos = self._orthogonalize_sharded(todo, updates, blocks, group, skip, *shards)
        self._apply_muon(todo, blocks, orthos, group, skip)

    def _orthogonalize_whole(self, todo, updates, blocks, group, skip) -> list[torch.Tensor]:
        """Each block's orthogonalised (NorMuon'd, if on) update, where every rank holds every row."""
        orthos = orthogonalize_blocks([_rows(updates[i], start, rows) for i, start, rows in blocks],
                                      self._ns(group, self.compile), *self._ranks())
        if group.get("normuon_beta") is None:
            return orthos
        return [normuon_rows(ortho, _local(self._row_sq_avg(todo[i][0]))[start:start + rows], group["normuon_beta"],
                             skip) for (i, start, rows), ortho in zip(blocks, orthos)]

    def _orthogonalize_sharded(self, todo, updates, blocks, group, skip, process_group, world_size, rank):
        """-> this rank's rows of each block's orthogonalised (NorMuon'd, if on) update, where FSDP2 splits the
        rows across the ranks of process_group: each block's owner gathers it, orthogonalises it and sends each
        rank its rows back, one all_to_all each way. NorMuon's row_sq_avg rides along as one more column."""
        params = [p for p, _ in todo]
        normuon = group.get("normuon_beta") is not None
        row_sq = [_local(self._row_sq_avg(p)) for p in params] if normuon else []
        extra = int(normuon)  # columns beyond the matrix's: row_sq_avg's
        owners = assign_owners([newton_schulz_flops(rows, params[i].shape[1]) for i, _, rows in blocks], world_size)
        owned = [[k for k, owner in enumerate(owners) if owner == r] for r in range(world_size)]

        def held(k, r):  # the rows [lo, hi) of block k's matrix that rank r holds
            return held_rows(blocks[k][1], blocks[k][2], params[blocks[k][0]].shape[0], world_size, r)

        def in_shard(k):  # this rank's rows of block k, as a slice of its shard of the matrix
            lo, hi = held(k, rank)
            first = shard_rows(params[blocks[k][0]].shape[0], world_size, rank)[0]
            return slice(lo - first, hi - first)

        def in_block(k, r):  # rank r's rows of block k, as a slice of the block
            lo, hi = held(k, r)
            return slice(lo - blocks[k][1], hi - blocks[k][1])

        def shape(k, r):  # of what travels of block k from or to rank r
            lo, hi = held(k, r)
            return hi - lo, params[blocks[k][0]].shape[1] + extra

        wire = functools.reduce(torch.promote_types, [u.dtype for u in updates] + [r.dtype for r in row_sq])

        def outgoing(k):  # this rank's rows of block k's update, and of row_sq_avg as one more column
            i, rows = blocks[k][0], in_shard(k)
            if not normuon:
                return updates[i][rows]
            return torch.cat([updates[i][rows].to(wire), row_sq[i][rows, None].to(wire)], 1)

        device = updates[0].device
        incoming = _all_to_all([[outgoing(k) for k in owned[r]] for r in range(world_size)],
                               [[shape(k, r) for k in owned[rank]] for r in range(world_size)],
                               process_group, wire, device)
        mine = [torch.cat([incoming[r][j] for r in range(world_size)]) for j in range(len(owned[rank]))]
        results = orthogonalize_blocks([m[:, :m.shape[1] - extra] for m in mine], self._ns(group, self.compile))
        if normuon:
            avgs = [m[:, -1].to(row_sq[blocks[k][0]].dtype) for k, m in zip(owned[rank], mine)]
            normed = [normuon_rows(ortho, avg, group["normuon_beta"], skip) for ortho, avg in zip(results, avgs)]
            results = [torch.cat([n, avg[:, None].to(n.dtype)], 1) for n, avg in zip(normed, avgs)]
            wire = functools.reduce(torch.promote_types, [r.dtype for r in row_sq], torch.float32)
        else:
            wire = NS_DTYPES[group["ns_dtype"]]  # the results' own dtype: bf16 on CUDA halves what comes back
        back = _all_to_all([[results[j][in_block(k, r)] for j, k in enumerate(owned[rank])]
                            for r in range(world_size)],
                           [[shape(k, rank) for k in owned[r]] for r in range(world_size)],
                           process_group, wire, device)
        received = dict(zip(itertools.chain(*owned), itertools.chain(*back)))  # block index -> its rows here
        orthos = [received[k] for k in range(len(blocks))]
        if normuon:
            for k, piece in enumerate(orthos):
                row_sq[blocks[k][0]][in_shard(k)] = piece[:, -1]
                orthos[k] = piece[:, :-1]
        return orthos

    def _apply_muon(self, todo, blocks, orthos, group, skip):
        """Decay and step the parameters; orthos[k] is block k's update for the rows of it this rank holds (all
        zeros where skip, so that only the decay needs its weight set to 0). Foreach calls, as in _momenta: one
        decay for the bucket, one step per update scale (blocks of one shape share it)."""
        lr, cautious = group["lr"], group.get("cautious_wd", False)
        decay, dtype = lr * group["weight_decay"], scalar_dtype(skip.device)
        if not cautious:  # the factor in float32, as a float32 parameter's mul_ would round it
            params = [_local(p) for p, _ in todo]
            torch._foreach_mul_(params, per_step(skip, 1 - decay, 1.0, torch.promote_types(params[0].dtype,
                                                                                           torch.float32)))
        steps: dict[float, tuple[list, list]] = {}  # alpha -> (targets, updates)
        for (i, start, rows), update in zip(blocks, orthos):
            p = todo[i][0]
            first = _first_local_row(p)
            target = _rows(_local(p), max(start, first) - first, update.shape[0])
            if cautious:  # every row of a matrix is in exactly one block, so each is decayed once
                cautious_decay_(target, update, per_step(skip, decay, 0.0, dtype))
            alpha = -lr * muon_scale_factor(rows, p.shape[1], group["muon_scale"])
            targets, updates = steps.setdefault(alpha, ([], []))
            targets.append(target)
            updates.append(update)
        for alpha, (targets, updates) in steps.items():
            torch._foreach_add_(targets, updates, alpha=alpha)

    def _row_sq_avg(self, p) -> torch.Tensor:
        """NorMuon's per-row second moment of p, created at zero on first use, laid out like p's rows (a DTensor
        with p's mesh and placements where p is one) and in p's dtype: the dtype Optimizer.load_state_dict
        casts state to, so that a resumed run computes exactly as before."""
        state = self.state[p]
        if "row_sq_avg" not in state:
            local = torch.zeros(_local(p).shape[0], dtype=p.dtype, device=_local(p).device)
            state["row_sq_avg"] = (DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape[:1],
                                                      stride=(1,)) if _is_dtensor(p) else local)
        return state["row_sq_avg"]

    def _adamw_state(self, p) -> dict:
        """p's AdamW state (step, exp_avg, exp_avg_sq), made at zero on first use, its step count a float32 scalar
        on p's device, where both AdamW paths keep it (a checkpoint's comes back on the CPU)."""
        state, device = self.state[p], _local(p).device
        if not state:
            state["step"] = torch.zeros((), device=device)
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        state["step"] = state["step"].to(device, torch.float32)
        return state

    def _adamw_update(self, p, group, found_inf=None):
        """AdamW on one parameter, its step count and bias corrections kept on the device (nothing waits for the
        GPU). found_inf (step_if_finite's; None: 0) weighs the step: where it is nonzero the gradient (zeroed
        first, as it is likely not finite), the decay, the update and the count's increment all get weight 0, which
        leaves p and its state exactly as they were; where it is 0 each is AdamW's, the scalars computed in
        scalar_dtype as the host would, so the update is the one torch's single-tensor AdamW takes."""
        param, grad = _local(p), _local(p.grad)
        skip = (torch.zeros((), dtype=torch.bool, device=param.device) if found_inf is None
                else found_inf.to(param.device).bool())
        state = self._adamw_state(p)
        exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        (beta1, beta2), lr, decay = group["betas"], group["lr"], group["lr"] * group["weight_decay"]
        dtype = scalar_dtype(param.device)
        grad = grad.masked_fill(skip, 0.0)
        state["step"].add_((~skip).to(state["step"].dtype))
        exp_avg.lerp_(grad, per_step(skip, 1 - beta1, 0.0, exp_avg.dtype))
        exp_avg_sq.mul_(per_step(skip, beta2, 1.0, dtype)).addcmul_(grad, grad, value=1 - beta2)
        if decay != 0:  # on the parameter before this step's update (decoupled)
            if group.get("cautious_wd", False):  # the update is exp_avg over a positive denominator: its sign
                cautious_decay_(param, exp_avg, per_step(skip, decay, 0.0, dtype))
            else:
                param.mul_(per_step(skip, 1 - decay, 1.0, dtype))
        step = state["step"].to(dtype).clamp(min=1)  # a skipped first step's corrections go unused: keep them finite
        denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(group["eps"])
        param.addcdiv_(exp_avg * (-lr / (1 - beta1**step)).masked_fill_(skip, 0.0), denom)
