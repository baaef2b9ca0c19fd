"""Muon: its state, the AdamW side, buckets, the split across DDP ranks and FSDP2 owners, recipe options.

Muon (github.com/KellerJordan/Muon; "Muon is Scalable for LLM Training", Moonshot AI 2025): the hidden
matrices updated with their orthogonalised Nesterov momentum, AdamW for everything else, in one optimizer.

    optimizer = Muon(groups, momentum=0.95, ns_dtype="bf16")   # groups: optim.build_optimizer's

Fused weights are orthogonalised one row block at a time (Q, K and V of qkv.weight; gate and up of fc1_weight),
since each block is a separate linear map that happens to share a GEMM. optim.py builds the groups and chooses
between the optimizers; update_math.py holds the arithmetic (Newton-Schulz, NorMuon, cautious decay), muon_stacks.py
a group's step in one process (its matrices as stacks in flat buffers; one compiled function under compile=True).
This file holds the optimizer: its state and buffers, the AdamW side, the buckets, and the split of the work
across DDP ranks and FSDP2's owner-rank exchange.
"""

import functools
import itertools
import math
import types

import torch

from hardware import fused_adamw_available
from muon_stacks import (GroupViews, at_least_float32, group_layout, group_step_, group_step_on_flats_, group_views,
                         stack_views)
from update_math import (NS_DTYPES, cautious_decay_, muon_scale_factor, newton_schulz, newton_schulz_flops,
                         normuon_rows, per_step, scalar_dtype)

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch built without distributed support: no parameter can be a DTensor
    DTensor = None

# fp32 bytes of the matrices Muon orthogonalises together: big enough to batch a few layers' blocks (and, under
# FSDP2, for few collectives: two a bucket), small enough that a rank's full blocks stay a bounded part of memory.
MUON_BUCKET_BYTES = 256 * 2**20


def muon_momentum(step: int | torch.Tensor, warmup: int, start: float, end: float) -> float | torch.Tensor:
    """Muon's momentum at optimizer step `step` (0-based): linear from start at step 0 to end at step warmup,
    then end. Written as end - (end - start) * (1 - fraction), so that it is exactly end once warmed up.
    step may be a scalar tensor, giving one in its dtype: Muon (muon.py) passes its checkpointed count of
    steps as it is on the device, so that the host never waits for it."""
    if not warmup:
        return end
    fraction = step / warmup
    fraction = fraction.clamp(max=1.0) if torch.is_tensor(fraction) else min(1.0, fraction)
    return end - (end - start) * (1 - fraction)


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
    (or where each DDP rank takes the whole step) the matrices of one shape and split are a stack, a view of the
    group's flat momentum and update buffers, and muon_stacks.group_step_ steps them all (with compile=True, one
    compiled function a group); an eager step keeps an update buffer as large as the momenta. Across ranks
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
    muon_momentum of each matrix's count of steps taken, state "step" like AdamW's, which every
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
        # A group's index (load_state_dict replaces the group dicts) -> (its GroupLayout, GroupViews, momenta).
        self._group_buffers: dict[int, tuple] = {}
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
        fused = [group for group in self.param_groups if group["kind"] != "muon"
                 and not group.get("cautious_wd", False) and self._fused_adamw(group)]
        counts = self._count_fused_steps(fused)
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon_step(group, found_inf)
            elif any(group is g for g in fused):
                self._adamw_fused(group, found_inf)
            else:
                for p in group["params"]:
                    if p.grad is not None:
                        self._adamw_update(p, group, found_inf)
        if counts and found_inf is not None:  # the fused kernel skipped: its count taken back
            torch._foreach_sub_(counts, [found_inf.to(counts[0].device)] * len(counts))
        return loss

    def working_buffers(self) -> list[torch.Tensor]:
        """The buffers Muon keeps between steps beside its state: each group's update buffers (one process's eager
        step, muon_stacks.GroupViews), which a checkpoint does not carry."""
        return [flat for _, views, _ in self._group_buffers.values() for flat in views.updates or []]

    def _fused_adamw(self, group) -> bool:
        """Whether torch has a fused AdamW kernel on the group's device (probed once per device type)."""
        if not group["params"]:
            return False
        device_type = _local(group["params"][0]).device.type
        if device_type not in self._fused_on:
            self._fused_on[device_type] = fused_adamw_available(device_type)
        return self._fused_on[device_type]

    def _count_fused_steps(self, groups: list) -> list[torch.Tensor]:
        """Advance the step count of every parameter with a gradient in `groups` (those torch's fused kernel
        steps), in one call for all of them; -> the counts."""
        counts = [self._adamw_state(p)["step"] for group in groups for p in group["params"] if p.grad is not None]
        if counts:
            torch._foreach_add_(counts, 1)
        return counts

    def _adamw_fused(self, group, found_inf):
        """AdamW on the whole group in torch's fused kernel: a few launches for all its parameters, where
        _adamw_update takes about twenty per parameter, a cost the host pays on a GPU (about 1,000 launches a step
        at GPT-2 small's 50 embedding and norm tensors). The same state as _adamw_update's, so a checkpoint of
        either path resumes on the other; the step counts are advanced before (_count_fused_steps). found_inf is
        the kernel's own skip, as GradScaler hands it: p and its moments unchanged."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        states = [self._adamw_state(p) for p in params]
        (beta1, beta2) = group["betas"]
        torch._fused_adamw_([_local(p) for p in params], [_local(p.grad) for p in params],
                            [_local(s["exp_avg"]) for s in states], [_local(s["exp_avg_sq"]) for s in states], [],
                            [s["step"] for s in states], lr=group["lr"], beta1=beta1, beta2=beta2,
                            weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False,
                            grad_scale=None, found_inf=found_inf)

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
        """The momentum under a warm-up: muon_momentum of p's count of steps taken, as a scalar on
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
        split and dtype, laid out in the group's flat buffers (_group_views). A compiled step takes the step's
        numbers as scalars filled on the device (as constants, each new LR would recompile it) and the momentum
        buffers themselves, with no update buffer (muon_stacks.GroupViews)."""
        stacks: dict[tuple, list] = {}
        for p, split in todo:
            stacks.setdefault((tuple(p.shape), tuple(split), p.dtype), []).append(p)
        lr, decay, momentum = group["lr"], group["lr"] * group["weight_decay"], group["momentum"]
        if self.compile:
            lr, decay, momentum = (torch.full((), v, dtype=scalar_dtype(skip.device), device=skip.device)
                                   for v in (lr, decay, momentum))
        layout = group_layout(list(stacks), [len(ps) for ps in stacks.values()])
        if group.get("momentum_warmup", 0):  # each matrix's own, from its count of steps
            momentum = [torch.stack([self._momentum_now(p, group, skip) for p in ps])[:, None, None]
                        for ps in stacks.values()]
        row_sq = ([[_local(self._row_sq_avg(p)) for p in ps] for ps in stacks.values()]
                  if group.get("normuon_beta") is not None else [])
        params = [[_local(p) for p in ps] for ps in stacks.values()]
        grads = [[_local(p.grad) for p in ps] for ps in stacks.values()]
        views = self._group_views(group, layout, [p for ps in stacks.values() for p in ps])
        self._group_step(group, tuple(stacks), layout)(params, grads, views.momenta if self.compile else views, row_sq,
                                                        skip, lr, decay, momentum)

    def _group_step(self, group, stacks: tuple, layout):
        """group_step_ with the group's settings and its stacks' (shape, split, dtype) bound, compiled if
        self.compile: one compiled function for all of the group's matrices, which takes the flat momentum buffers."""
        key = (self.compile, stacks, layout, group["nesterov"], group["ns_steps"], group["ns_dtype"],
               group.get("ns_coeffs"), group["muon_scale"], group.get("normuon_beta"), group.get("cautious_wd", False))
        if key not in self._steps:
            settings = dict(
                splits=layout.splits, nesterov=group["nesterov"],
                scales=tuple(tuple(muon_scale_factor(rows, shape[1], group["muon_scale"]) for rows in split)
                             for shape, split, _ in stacks),
                ns=self._ns(group, False), ns_dtype=NS_DTYPES[group["ns_dtype"]],
                normuon_beta=group.get("normuon_beta"), cautious=group.get("cautious_wd", False))
            self._steps[key] = (compiled(functools.partial(group_step_on_flats_, layout=layout, **settings))
                                if self.compile else functools.partial(group_step_, **settings))
        return self._steps[key]

    def _group_views(self, group, layout, params: list) -> GroupViews:
        """The group's flat buffers (muon_stacks.GroupViews), made on its first step or when its matrices' layout
        or momenta change: the momenta at zero, or the momenta a checkpoint loaded copied in, once. Each matrix's
        state["momentum_buffer"] is a view of its slice (a DTensor like the matrix, where it is one), so that one
        operation a step updates them all, with no copy in or out."""
        index = next(i for i, g in enumerate(self.param_groups) if g is group)
        known, views, momenta = self._group_buffers.get(index, (None, None, []))
        if known == layout and all(self.state[p].get("momentum_buffer") is m for p, m in zip(params, momenta)):
            return views
        self._group_buffers.pop(index, None)  # its update buffers freed first; the state still holds its momenta
        device = _local(params[0]).device
        flats = [torch.zeros(size, dtype=dtype, device=device) for dtype, size in zip(layout.dtypes, layout.sizes)]
        views = group_views(layout, flats, None if self.compile else [torch.empty_like(flat) for flat in flats])
        rows = [m for stack in stack_views(flats, layout) for m in stack.unbind(0)]
        for p, row in zip(params, rows):
            if "momentum_buffer" in self.state[p]:  # a checkpoint's, or the previous layout's
                row.copy_(_local(self.state[p]["momentum_buffer"]))
            self.state[p]["momentum_buffer"] = (DTensor.from_local(row, p.device_mesh, p.placements, shape=p.shape,
                                                                   stride=p.stride()) if _is_dtensor(p) else row)
        self._group_buffers[index] = layout, views, [self.state[p]["momentum_buffer"] for p in params]
        return views

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
            torch._foreach_mul_(params, per_step(skip, 1 - decay, 1.0, at_least_float32(params[0].dtype)))
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
