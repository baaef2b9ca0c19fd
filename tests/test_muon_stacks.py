"""Tests for muon_stacks.py: where a group's stacks lie in its flat buffers, the views a step uses, and a step whose
matrices change between steps (the optimizer itself against torch.optim.Muon: tests/test_muon.py)."""

import copy

import pytest
import torch

import muon
from muon_stacks import group_layout, group_views, stack_views
from optim import optimizer_state_bytes


def test_group_layout_puts_each_dtypes_stacks_one_after_another_in_its_own_buffer():
    keys = [((8, 4), (8,), torch.float32), ((3, 4), (2, 1), torch.bfloat16), ((4, 8), (4,), torch.float32)]
    layout = group_layout(keys, [2, 3, 1])
    assert layout.dtypes == (torch.float32, torch.bfloat16)
    assert layout.sizes == (2 * 8 * 4 + 4 * 8, 3 * 3 * 4)
    assert layout.stacks == ((0, 0, 2, 8, 4), (1, 0, 3, 3, 4), (0, 64, 1, 4, 8))
    assert layout.splits == ((8,), (2, 1), (4,))


def test_group_views_are_views_of_the_buffers_with_tall_blocks_turned_wide():
    keys = [((6, 2), (4, 2), torch.float32), ((2, 3), (2,), torch.float32)]
    layout = group_layout(keys, [2, 1])
    momenta, updates = [torch.zeros(layout.sizes[0])], [torch.zeros(layout.sizes[0])]
    views = group_views(layout, momenta, updates)
    assert [tuple(s.shape) for s in stack_views(updates, layout)] == [(2, 6, 2), (1, 2, 3)]
    views.update_matrices[1].copy_(torch.arange(12.0).view(6, 2))  # the first stack's second matrix
    assert torch.equal(updates[0][12:24], torch.arange(12.0))
    tall, short = views.wide_blocks[0]
    assert tall.shape == (2, 2, 4) and torch.equal(tall[1], torch.arange(8.0).view(4, 2).T)  # its first 4 rows, wide
    assert short.shape == (2, 2, 2) and torch.equal(short[1], torch.arange(8.0, 12.0).view(2, 2))
    assert group_views(layout, momenta, None).update_matrices is None  # a compiled step's: no update buffer


@pytest.mark.parametrize("scale", ["original", "match_rms_adamw"])
def test_a_matrix_without_a_gradient_keeps_its_momentum_while_the_rest_step_as_torch_muon(scale):
    """The group's layout follows the matrices that have gradients: one left out for a step keeps its momentum and
    its value, and the momenta move to the new buffers and back, bit for bit as torch.optim.Muon (bf16 iteration)."""
    torch.manual_seed(0)
    shapes = [(8, 4), (8, 4), (4, 8)]
    ours = [torch.randn(s) for s in shapes]
    refs = [w.clone() for w in ours]
    group = {"params": ours, "names": ["a", "b", "c"], "kind": "muon", "row_blocks": [[s[0]] for s in shapes],
             "lr": 0.02, "weight_decay": 0.1}
    opt = muon.Muon([group], momentum=0.9, ns_dtype="bf16", muon_scale=scale)
    ref = torch.optim.Muon(refs, lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn=scale)
    for step in range(4):
        for w, r in zip(ours, refs):
            g = torch.randn(w.shape)
            w.grad, r.grad = (None, None) if step == 1 and w is ours[1] else (g, g.clone())
        before = opt.state[ours[1]].get("momentum_buffer", torch.empty(0)).clone()
        opt.step()
        ref.step()
        if step == 1:
            assert torch.equal(opt.state[ours[1]]["momentum_buffer"], before)
    for w, r in zip(ours, refs):
        assert torch.equal(w, r)
        assert torch.equal(opt.state[w]["momentum_buffer"], ref.state[r]["momentum_buffer"])


def test_a_reloaded_state_replaces_the_groups_buffers_and_continues_its_momenta():
    """load_state_dict makes new group dicts (a resume, a rollback): the buffers follow the group's place, so
    one set stays held however many reloads, and the next step continues from the loaded momenta exactly."""
    torch.manual_seed(0)

    def make(weights):
        group = {"params": weights, "names": ["a", "b"], "kind": "muon", "row_blocks": [[8], [8]], "lr": 0.02,
                 "weight_decay": 0.1}
        return muon.Muon([group], momentum=0.9)

    ours = [torch.randn(8, 4), torch.randn(8, 4)]
    fresh = [w.clone() for w in ours]
    opt = make(ours)
    grads = [[torch.randn(8, 4) for _ in ours] for _ in range(5)]
    sizes = []
    for step, gs in enumerate(grads[:4]):
        for w, g in zip(ours, gs):
            w.grad = g.clone()
        opt.step()
        sizes.append(optimizer_state_bytes(opt))
        if step:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert len(set(sizes)) == 1 and len(opt._group_buffers) == 1
    saved = copy.deepcopy(opt.state_dict())
    other = make(fresh)
    for w, v in zip(fresh, ours):
        w.data.copy_(v)
    other.load_state_dict(saved)
    for opt_, ws in ((opt, ours), (other, fresh)):
        for w, g in zip(ws, grads[4]):
            w.grad = g.clone()
        opt_.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, fresh))
