"""Muon (github.com/KellerJordan/Muon; "Muon is Scalable for LLM Training", Moonshot AI 2025): the hidden
matrices updated with their orthogonalised Nesterov momentum, AdamW for everything else, in one optimizer.

    optimizer = Muon(groups, momentum=0.95, ns_dtype="bf16")   # groups: optim.build_optimizer's

Fused weights are orthogonalised one row block at a time (Q, K and V of qkv.weight; gate and up of fc1_weight),
since each block is a separate linear map that happens to share a GEMM. optim.py builds the groups and chooses
between the optimizers; muon_math.py holds the arithmetic (Newton-Schulz, NorMuon, cautious decay). This file
holds the optimizer: its state, a group's step in one process as operations on stacks of same-shape matrices
(one compiled function under compile=True), the buckets, and the split of the work across DDP ranks and
FSDP2's owner-rank exchange.
"""

import functools
import itertools
import math
import types

import torch

from hardware import fused_adamw_available
from muon_math import (NS_DTYPES, cautious_decay_, muon_scale_factor, newton_schulz, newton_schulz_flops,
                       normuon_rows, per_step, scalar_dtype, wide, wide_batches)
from schedule import muon_momentum

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch built without distributed support: no parameter can be a DTensor
    DTensor = None

# fp32 bytes of the matrices Muon orthogonalises together: big enough to batch a few layers' blocks (and, under
# FSDP2, for few collectives: two a bucket), small enough that a rank's full blocks stay a bounded part of memory.
MUON_BUCKET_BYTES = 256 * 2**20


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


def group_step_(params: list, grads: list, bufs: list, row_sq: list, skip: torch.Tensor, lr, decay, momentum, *,
                splits: tuple, scales: tuple, nesterov: bool, ns, normuon_beta, cautious: bool) -> None:
    """One Muon step for all of a group's matrices in one process, in place: operations on stacks of matrices,
    never one per matrix (off the recipe options), which Muon's compile turns into one function.

    Stack s: params[s] and grads[s], matrices of one shape, row split splits[s] and dtype; bufs[s] their momenta as
    one tensor [n, rows, cols] (Muon._momentum_stack); row_sq[s] their NorMuon row EMAs (empty without NorMuon);
    scales[s][k] block k's update scale. Momentum and Nesterov on each stack (_momentum_updates); Newton-Schulz on
    each of wide_batches' calls (ns: a stack -> its orthogonalised stack); NorMuon where normuon_beta is set; the
    decay; the update, one foreach add per scale. Where skip (a bool scalar) parameters and momenta stay exactly as
    they were. lr, decay (lr x weight decay) and momentum are Python numbers or float64 scalars (compiled); under
    the momentum warm-up momentum is a list, stack s's momenta [n, 1, 1]."""
    momenta = momentum if isinstance(momentum, list) else [momentum] * len(bufs)
    updates = _momentum_updates(grads, bufs, momenta, skip, nesterov)
    blocks = [u.split(split, dim=1) if len(split) > 1 else (u,) for u, split in zip(updates, splits)]
    orthos = [[None] * len(split) for split in splits]  # orthos[s][k]: stack s's block k, orthogonalised
    for batch in wide_batches([tuple(ps[0].shape) for ps in params], splits):
        members = [wide(blocks[s][k]) for s, k in batch]
        x = torch.cat(members) if len(members) > 1 else members[0]
        result = ns(x.masked_fill(skip, 0.0))  # a skipped step's update is zeros, which Newton-Schulz keeps
        for (s, k), ortho in zip(batch, result.split([len(m) for m in members])):
            orthos[s][k] = ortho.mT if splits[s][k] > params[s][0].shape[1] else ortho  # tall again
    if normuon_beta is not None:  # row_sq[s][j] is matrix j's per-row EMA, cut into the same blocks
        for stack, rows, split in zip(orthos, row_sq, splits):
            cuts = [r.split(split) for r in rows]
            stack[:] = [torch.stack([normuon_rows(o, cut[k], normuon_beta, skip) for o, cut in zip(block, cuts)])
                        for k, block in enumerate(stack)]
    _decay_(params, orthos, splits, skip, decay, cautious)
    steps: dict = {}  # scale -> (targets, updates): the stacks whose blocks share one scale take one add
    for ps, ortho, split, scale in zip(params, orthos, splits, scales):
        dtype = ps[0].dtype  # the update in the parameters' dtype, foreach's fast path: exact, as the add would widen
        if len(set(scale)) == 1:
            targets, to_add = steps.setdefault(scale[0], ([], []))
            targets += ps
            to_add += (torch.cat(ortho, dim=1) if len(ortho) > 1 else ortho[0]).to(dtype).unbind(0)
            continue
        cuts = [p.split(split) for p in ps]
        for k, (o, block_scale) in enumerate(zip(ortho, scale)):
            targets, to_add = steps.setdefault(block_scale, ([], []))
            targets += [cut[k] for cut in cuts]
            to_add += o.to(dtype).unbind(0)
    for scale, (targets, to_add) in steps.items():
        _add_(targets, to_add, -lr * scale)


def _momentum_updates(grads: list, bufs: list, momenta: list, skip: torch.Tensor, nesterov: bool) -> list:
    """Each stack's momentum EMA, in place on bufs[s], and its update (Nesterov's, or the momentum itself).

    Where skip, the gradient is replaced by the momentum, which averaged with itself stays exactly as it was,
    whatever the weight: so the weights are plain numbers, one foreach call for all stacks (a scalar the skip
    decided would be a tensor, one call a stack), and a non-finite gradient never reaches the arithmetic."""
    gs = [torch.where(skip, buf, torch.stack(grad)) for grad, buf in zip(grads, bufs)]
    _lerp_(bufs, gs, [1 - m for m in momenta])
    if not nesterov:
        return bufs
    _lerp_(gs, bufs, momenta)
    return gs


def _lerp_(targets: list, ends: list, weights: list) -> None:
    """targets[i].lerp_(ends[i], weights[i]): one foreach call where the weights are one Python number, else
    one call each (a tensor weight: the warm-up's [n, 1, 1] momenta, a compiled step's scalars)."""
    if not any(torch.is_tensor(w) for w in weights) and len(set(weights)) == 1:
        torch._foreach_lerp_(targets, ends, weights[0])
        return
    for target, end, w in zip(targets, ends, weights):
        target.lerp_(end, w.to(target.dtype) if torch.is_tensor(w) else w)


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """torch.promote_types(dtype, torch.float32) for a floating dtype: the float32 a decay factor is rounded to, as
    a float32 parameter's mul_ would round it, or float64 for a float64 parameter."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _decay_(params: list, orthos: list, splits: tuple, skip: torch.Tensor, decay, cautious: bool) -> None:
    """group_step_'s decoupled weight decay (none where skip): one foreach multiply, or cautious_decay_ on each
    block of each matrix (every row is in exactly one block, so each is decayed once)."""
    if not cautious:
        everything = [p for ps in params for p in ps]
        factor = _weight(skip, 1 - decay, 1.0, _at_least_float32(everything[0].dtype))
        torch._foreach_mul_(everything, factor)
        return
    amount = _weight(skip, decay, 0.0, scalar_dtype(skip.device))
    for ps, ortho, split in zip(params, orthos, splits):
        cuts = [p.split(split) if len(split) > 1 else (p,) for p in ps]
        for k, stack in enumerate(ortho):
            for cut, o in zip(cuts, stack):
                cautious_decay_(cut[k], o, amount)


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
    (or where each DDP rank takes the whole step) the matrices of one shape and split are a stack, their momenta
    one tensor, and group_step_ steps them all (with compile=True, one compiled function a group). Across ranks
    the matrices go in buckets (muon_buckets), same-shape blocks through Newton-Schulz in one batched call
    (orthogonalize_blocks; compiled per shape with compile=True). Works on:
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
        self._steps: dict[tuple, object] = {}  # a group's static settings and its stacks' shapes -> its step
        self._momentum_stacks: dict[tuple, tuple] = {}  # (group's id, a stack's key) -> (momenta, their views)
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
        """Muon on todo's (param, row split) pairs in one group_step_ call, the matrices in stacks of one shape,
        split and dtype. A compiled step takes the step's numbers as scalars filled on the device: as constants,
        each new LR would recompile it."""
        stacks: dict[tuple, list] = {}
        for p, split in todo:
            stacks.setdefault((tuple(p.shape), tuple(split), p.dtype), []).append(p)
        lr, decay, momentum = group["lr"], group["lr"] * group["weight_decay"], group["momentum"]
        if self.compile:
            lr, decay, momentum = (torch.full((), v, dtype=scalar_dtype(skip.device), device=skip.device)
                                   for v in (lr, decay, momentum))
        if group.get("momentum_warmup", 0):  # each matrix's own, from its count of steps
            momentum = [torch.stack([self._momentum_now(p, group, skip) for p in ps])[:, None, None]
                        for ps in stacks.values()]
        row_sq = ([[_local(self._row_sq_avg(p)) for p in ps] for ps in stacks.values()]
                  if group.get("normuon_beta") is not None else [])
        params = [[_local(p) for p in ps] for ps in stacks.values()]
        grads = [[_local(p.grad) for p in ps] for ps in stacks.values()]
        momenta = [self._momentum_stack((id(group), *key), ps) for key, ps in stacks.items()]
        self._group_step(group, tuple(stacks))(params, grads, momenta, row_sq, skip, lr, decay, momentum)

    def _group_step(self, group, stacks: tuple):
        """group_step_ with the group's settings and its stacks' (shape, split, dtype) bound, compiled if
        self.compile: one compiled function for all of the group's matrices."""
        key = (self.compile, stacks, group["nesterov"], group["ns_steps"], group["ns_dtype"], group.get("ns_coeffs"),
               group["muon_scale"], group.get("normuon_beta"), group.get("cautious_wd", False))
        if key not in self._steps:
            step = functools.partial(
                group_step_, splits=tuple(split for _, split, _ in stacks), nesterov=group["nesterov"],
                scales=tuple(tuple(muon_scale_factor(rows, shape[1], group["muon_scale"]) for rows in split)
                             for shape, split, _ in stacks),
                ns=self._ns(group, False), normuon_beta=group.get("normuon_beta"),
                cautious=group.get("cautious_wd", False))
            self._steps[key] = compiled(step) if self.compile else step
        return self._steps[key]

    def _momentum_stack(self, key: tuple, params: list) -> torch.Tensor:
        """The momenta of a stack of same-shape matrices as one tensor [n, rows, cols], each matrix's
        state["momentum_buffer"] a view of its slice (a DTensor like the matrix, where it is one), so that one
        lerp_ a step updates them all with no copy in or out. Momenta that are not those views (a checkpoint's,
        loaded) are stacked into a new tensor, once."""
        stack, views = self._momentum_stacks.get(key, (None, []))
        if len(views) != len(params) or any(self.state[p].get("momentum_buffer") is not v
                                            for p, v in zip(params, views)):
            stack = torch.stack([_local(self._momentum_buffer(p)) for p in params])
            views = [DTensor.from_local(row, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                     if _is_dtensor(p) else row for p, row in zip(params, stack.unbind(0))]
            for p, view in zip(params, views):
                self.state[p]["momentum_buffer"] = view
            self._momentum_stacks[key] = stack, views
        return stack

    def _ns(self, group, compile: bool):
        """newton_schulz with the group's settings (a stack -> its orthogonalised stack), compiled if compile."""
        key = ("ns", compile, group["ns_steps"], group["ns_dtype"], group.get("ns_coeffs"))
        if key not in self._steps:
            ns = functools.partial(newton_schulz, steps=group["ns_steps"], dtype=NS_DTYPES[group["ns_dtype"]],
                                   coeffs=group.get("ns_coeffs", "quintic"))
            self._steps[key] = compiled(ns) if compile else ns
        return self._steps[key]

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
            torch._foreach_mul_(params, per_step(skip, 1 - decay, 1.0, _at_least_float32(params[0].dtype)))
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
