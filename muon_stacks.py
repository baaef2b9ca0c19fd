"""Muon's step in one process: a group's matrices as stacks in flat buffers, a fixed number of operations.

Muon's step for all of a group's matrices in one process (one device, or a DDP rank that takes the whole step):
the matrices in stacks of one shape, row split and dtype, their momenta in one flat buffer a dtype, each stack a
view of it, so that a step is a few operations on whole buffers and stacks, the same number whatever the depth.
muon.py keeps the buffers (GroupViews) and calls group_step_, compiled or not; update_math.py holds the arithmetic.
"""

import math
from typing import NamedTuple

import torch

from update_math import NS_EPS, cautious_decay_, normuon_rows, per_step, scalar_dtype, wide, wide_batches


class GroupLayout(NamedTuple):
    """Where a group's stacks lie in its flat buffers: stack s is stacks[s] = (flat, start, n, rows, cols), n
    matrices [rows, cols] from element `start` of flat buffer `flat` (one a dtype: dtypes[flat], sizes[flat]
    elements), cut into row blocks splits[s]."""
    dtypes: tuple
    sizes: tuple
    stacks: tuple
    splits: tuple


def group_layout(keys: list[tuple], counts: list[int]) -> GroupLayout:
    """The layout of stacks keyed (shape, row split, dtype), counts[s] matrices in stack s, in that order."""
    dtypes = tuple(dict.fromkeys(dtype for _, _, dtype in keys))
    sizes, stacks = [0] * len(dtypes), []
    for ((rows, cols), _, dtype), n in zip(keys, counts):
        flat = dtypes.index(dtype)
        stacks.append((flat, sizes[flat], n, rows, cols))
        sizes[flat] += n * rows * cols
    return GroupLayout(dtypes, tuple(sizes), tuple(stacks), tuple(split for _, split, _ in keys))


def stack_views(flats: list, layout: GroupLayout) -> list[torch.Tensor]:
    """Each stack [n, rows, cols], a view of its flat buffer."""
    return [flats[f][start:start + n * rows * cols].view(n, rows, cols) for f, start, n, rows, cols in layout.stacks]


def wide_blocks(update_flats: list, layout: GroupLayout) -> list[list[torch.Tensor]]:
    """blocks[s][k]: stack s's row block k of the updates, turned wide (update_math.wide) as Newton-Schulz takes it."""
    return [[wide(block) for block in (u.split(split, dim=1) if len(split) > 1 else (u,))]
            for u, split in zip(stack_views(update_flats, layout), layout.splits)]


class GroupViews(NamedTuple):
    """A group's flat momentum buffers and, for an eager step, an update buffer beside each (updates: where the
    gradients are copied, then the update made) with the views of it a step uses: each matrix's, and each row
    block turned wide (wide_blocks). Made once, so an eager step dispatches no view; a compiled step takes
    updates None and makes its update buffers in its graph, where a view costs nothing and writing through one
    would cost a copy of the whole buffer."""
    layout: GroupLayout
    momenta: list
    updates: list | None = None
    update_matrices: list | None = None
    wide_blocks: list | None = None


def group_views(layout: GroupLayout, momenta: list, updates: list | None) -> GroupViews:
    if updates is None:
        return GroupViews(layout, momenta)
    matrices = [m for stack in stack_views(updates, layout) for m in stack.unbind(0)]
    return GroupViews(layout, momenta, updates, matrices, wide_blocks(updates, layout))


def group_step_(params: list, grads: list, views: GroupViews, row_sq: list, skip: torch.Tensor, lr, decay, momentum,
                *, splits: tuple, scales: tuple, nesterov: bool, ns, ns_dtype: torch.dtype, normuon_beta,
                cautious: bool) -> None:
    """One Muon step for all of a group's matrices, in place: operations on flat buffers and stacks, never one per
    matrix (off the recipe options), which Muon's compile turns into one function.

    Stack s: params[s] and grads[s], matrices of one shape, row split splits[s] and dtype, laid out in views
    (GroupViews); row_sq[s] their NorMuon row EMAs (empty without NorMuon); scales[s][k] block k's update scale.
    Momentum and Nesterov on the flat buffers (_momentum_updates); Newton-Schulz on each of wide_batches' calls
    (ns: a stack and its eps -> the orthogonalised stack, in ns_dtype); NorMuon where normuon_beta is set; the
    decay; the update, one foreach add per scale. Where skip (a bool scalar) parameters and momenta stay exactly
    as they were. lr, decay (lr x weight decay) and momentum are Python numbers or float64 scalars (compiled);
    under the momentum warm-up momentum is a list, stack s's momenta [n, 1, 1]."""
    updates = _momentum_updates(grads, views, momentum, skip, nesterov)
    blocks = views.wide_blocks if views.wide_blocks is not None else wide_blocks(updates, views.layout)
    # Newton-Schulz divides by norm + eps: an infinite eps where skip makes the update zeros, which it keeps. In
    # float32 or wider, as a Python eps enters the CPU's arithmetic (a bf16 GPU kernel may round it to bf16 first,
    # which shows only where a norm is under about 1e-5).
    eps = per_step(skip, NS_EPS, math.inf, at_least_float32(ns_dtype))
    orthos = [[None] * len(split) for split in splits]  # orthos[s][k]: stack s's block k, orthogonalised
    for batch in wide_batches([tuple(ps[0].shape) for ps in params], splits):
        members = [blocks[s][k] for s, k in batch]
        result = ns(torch.cat(members) if len(members) > 1 else members[0], eps=eps)
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


def _momentum_updates(grads: list, views: GroupViews, momentum, skip: torch.Tensor, nesterov: bool) -> list:
    """The momentum EMA, in place on views.momenta; -> the update (Nesterov's, or the momentum itself) in a flat
    buffer a dtype: views.updates, where the gradients are copied first (eager), or their concatenation (compiled).

    Where skip, the gradient is replaced by the momentum, which averaged with itself stays exactly as it was,
    whatever the weight: so the weights are plain numbers, one foreach call for all the buffers (a scalar the skip
    decided would be a tensor, one call a buffer), and a non-finite gradient never reaches the arithmetic.
    momentum: a number, or under the warm-up a list, stack s's momenta [n, 1, 1] (lerped through each stack's
    view, which in a compiled step costs a copy of the buffer a stack)."""
    if views.updates is None:
        per_flat = [[] for _ in views.momenta]
        for (f, *_), stack in zip(views.layout.stacks, grads):
            per_flat[f] += [g.reshape(-1) for g in stack]
        updates = [torch.cat(flat) for flat in per_flat]
    else:
        torch._foreach_copy_(views.update_matrices, [g for stack in grads for g in stack])
        updates = views.updates
    for momentum_flat, update_flat in zip(views.momenta, updates):
        torch.where(skip, momentum_flat, update_flat, out=update_flat)
    if isinstance(momentum, list):  # the warm-up's, [n, 1, 1] a stack: stack by stack, through views
        bufs, ends, weights = stack_views(views.momenta, views.layout), stack_views(updates, views.layout), momentum
    else:
        bufs, ends, weights = views.momenta, updates, [momentum] * len(updates)
    _lerp_(bufs, ends, [1 - w for w in weights])
    if nesterov:
        _lerp_(ends, bufs, weights)
    else:
        torch._foreach_copy_(updates, views.momenta)
    return updates


def _lerp_(targets: list, ends: list, weights: list) -> None:
    """targets[i].lerp_(ends[i], weights[i]): one foreach call where the weights are one Python number, else
    one call each (a tensor weight: the warm-up's momenta, a compiled step's scalars)."""
    if not any(torch.is_tensor(w) for w in weights) and len(set(weights)) == 1:
        torch._foreach_lerp_(targets, ends, weights[0])
        return
    for target, end, w in zip(targets, ends, weights):
        target.lerp_(end, w.to(target.dtype) if torch.is_tensor(w) else w)


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


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """torch.promote_types(dtype, torch.float32) for a floating dtype: the float32 a decay factor is rounded to, as
    a float32 parameter's mul_ would round it, or float64 for a float64 parameter."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _decay_(params: list, orthos: list, splits: tuple, skip: torch.Tensor, decay, cautious: bool) -> None:
    """group_step_'s decoupled weight decay (none where skip): one foreach multiply, or cautious_decay_ on each
    block of each matrix (every row is in exactly one block, so each is decayed once)."""
    if not cautious:
        everything = [p for ps in params for p in ps]
        factor = _weight(skip, 1 - decay, 1.0, at_least_float32(everything[0].dtype))
        torch._foreach_mul_(everything, factor)
        return
    amount = _weight(skip, decay, 0.0, scalar_dtype(skip.device))
    for ps, ortho, split in zip(params, orthos, splits):
        cuts = [p.split(split) if len(split) > 1 else (p,) for p in ps]
        for k, stack in enumerate(ortho):
            for cut, o in zip(cuts, stack):
                cautious_decay_(cut[k], o, amount)


def group_step_on_flats_(params: list, grads: list, momenta: list, *args, layout: GroupLayout, **settings) -> None:
    """group_step_ on the flat momentum buffers themselves, with no update buffer: a compiled step's form, which so
    takes no two views of one buffer as inputs and writes through no view."""
    group_step_(params, grads, group_views(layout, momenta, None), *args, **settings)
