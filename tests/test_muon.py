"""Tests for muon.py: Muon against torch.optim.Muon, its recipe options, buckets, DDP and FSDP2 on gloo against one
process, the compiled step against eager (update_math.py's own functions: tests/test_update_math.py)."""

import functools
import io
import math
import os
import sys

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import muon
import optim
import update_math
from conftest import spawn_on_gloo, with_spectrum
from muon import muon_momentum
from optim import OptimConfig, build_optimizer
from test_optim import RECIPE, ToyGPT, batches, matrix, train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import muon_step  # noqa: E402  (its OpCounter and CollectiveCounter)


def muon_stacks(params, row_blocks, lr=0.02, weight_decay=0.1):
    return {"params": params, "names": [f"w{i}" for i in range(len(params))], "kind": "muon",
            "row_blocks": row_blocks, "lr": lr, "weight_decay": weight_decay}


# ----------------------------------------------------------------------------- Muon numerics


def reference_newton_schulz(g, ns_coefficients, ns_steps, eps):
    """The quintic iteration written as its polynomial, in float64, independent of muon.py."""
    a, b, c = ns_coefficients
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(24, 16), (16, 24)])
@pytest.mark.parametrize("scale", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("ns_dtype", ["bf16", "fp32"])
def test_muon_matches_torch_muon(shape, scale, ns_dtype, monkeypatch):
    if ns_dtype == "fp32":
        # torch.optim.Muon always iterates in bf16; give it a float64 iteration to compare fp32 against.
        monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", reference_newton_schulz)
    torch.manual_seed(0)
    ours_w = torch.randn(shape)
    ref_w = ours_w.clone()
    ours = muon.Muon([muon_stacks([ours_w], [[shape[0]]], lr=0.02, weight_decay=0.1)], momentum=0.9,
                      ns_dtype=ns_dtype, muon_scale=scale)
    ref = torch.optim.Muon([ref_w], lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn=scale)
    for _ in range(4):
        g = torch.randn(shape)
        ours_w.grad, ref_w.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    if ns_dtype == "bf16":
        assert torch.equal(ours_w, ref_w)
    else:
        torch.testing.assert_close(ours_w, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scale", ["original", "match_rms_adamw"])
def test_fused_qkv_update_is_three_independent_updates(scale):
    torch.manual_seed(0)
    blocks, cols = [16, 8, 8], 16
    fused = torch.randn(sum(blocks), cols)
    parts = [t.clone() for t in fused.split(blocks)]
    whole = fused.clone()
    opt_fused = muon.Muon([muon_stacks([fused], [blocks])], muon_scale=scale)
    opt_parts = muon.Muon([muon_stacks(parts, [[r] for r in blocks])], muon_scale=scale)
    opt_whole = muon.Muon([muon_stacks([whole], [[sum(blocks)]])], muon_scale=scale)
    for _ in range(3):
        g = torch.randn(sum(blocks), cols)
        fused.grad, whole.grad = g.clone(), g.clone()
        for p, gp in zip(parts, g.split(blocks)):
            p.grad = gp.clone()
        for opt in (opt_fused, opt_parts, opt_whole):
            opt.step()
    assert torch.equal(fused, torch.cat(parts))
    assert not torch.allclose(fused, whole, atol=1e-3)


def test_muon_update_per_block_is_orthogonal_and_scaled():
    # With momentum 0, lr 1 and no decay, the step is exactly scale * NS(grad), block by block;
    # "original" scales the tall 16 x 8 block by sqrt(2) and the square ones by 1.
    torch.manual_seed(0)
    blocks, cols = [16, 8, 8], 8
    w = torch.zeros(sum(blocks), cols)
    opt = muon.Muon([muon_stacks([w], [blocks], lr=1.0, weight_decay=0.0)], momentum=0.0, muon_scale="original")
    w.grad = torch.cat([with_spectrum(r, cols, 1.0, 0.1) * r for r in blocks])
    opt.step()
    for update, scale in zip((-w).split(blocks), [math.sqrt(2), 1.0, 1.0]):
        s = torch.linalg.svdvals(update / scale)
        assert s.min() > 0.68 and s.max() < 1.21, s
    assert torch.linalg.svdvals(-w[:16]).max() > 1.21  # the scale really was applied


@pytest.mark.slow
def test_compiled_stack_step_tracks_eager_skips_exactly_and_resumes_eagerly():
    """One stack (two matrices cut into blocks of 8 and 4 rows), so one compilation (~10 s on a small CPU): the
    LR moving every step does not recompile it; the compiled step tracks the eager one up to rounding; a skipped
    step leaves parameters and state bit for bit; its state_dict is the eager one's, which resumes it."""
    import torch._dynamo.utils as dynamo_utils

    g = torch.Generator().manual_seed(0)
    start = [torch.randn(12, 8, generator=g) for _ in range(2)]
    grads = [[torch.randn(12, 8, generator=g) for _ in range(2)] for _ in range(4)]
    runs = []
    for compile in (False, True):
        ws = [nn.Parameter(w.clone()) for w in start]
        runs.append((ws, muon.Muon([muon_stacks(ws, [[8, 4]] * 2)], ns_dtype="fp32", compile=compile)))
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    for step, step_grads in enumerate(grads[:3]):
        for ws, opt in runs:
            opt.param_groups[0]["lr"] = 0.02 * (1 + step)
            for w, grad in zip(ws, step_grads):
                w.grad = grad.clone()
            opt.step()
    assert dynamo_utils.counters["stats"]["unique_graphs"] - graphs == 1
    (eager_ws, eager), (ws, opt) = runs
    for a, b in zip(eager_ws, ws):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    before = [w.clone() for w in ws], [s["momentum_buffer"].clone() for s in opt.state.values()]
    for w, grad in zip(ws, grads[3]):
        w.grad = grad.clone()
        w.grad[0, 0] = float("nan")
    optim.step_if_finite(opt, torch.tensor(False))
    assert all(torch.equal(a, b) for a, b in zip(before[0], ws))
    assert all(torch.equal(a, s["momentum_buffer"]) for a, s in zip(before[1], opt.state.values()))
    saved = io.BytesIO()  # the compiled step's state, as a checkpoint saves it, resumes an eager run
    torch.save(opt.state_dict(), saved)
    saved.seek(0)
    eager.load_state_dict(torch.load(saved))
    for w, a in zip(eager_ws, ws):
        w.data.copy_(a)
    for ws_, o in runs:
        for w, grad in zip(ws_, grads[3]):
            w.grad = grad.clone()
        o.step()
    for a, b in zip(eager_ws, ws):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_adamw_side_of_muon_matches_torch_adamw():
    model = ToyGPT(n_layer=1, tied=False)
    ref_model = ToyGPT(n_layer=1, tied=False)
    cfg = OptimConfig(name="muon", lr=0.02, adam_lr=3e-3, weight_decay=0.1, beta1=0.8, beta2=0.9, eps=1e-6)
    opt = build_optimizer(model, cfg, model.row_blocks(), "cpu")
    adam_groups = [g for g in opt.param_groups if g["kind"] == "adamw"]
    ref_params = dict(ref_model.named_parameters())
    fused = optim.fused_adamw_available("cpu")  # Muon's AdamW side runs torch's fused kernel where there is one
    ref = torch.optim.AdamW([{"params": [ref_params[n] for n in g["names"]], "weight_decay": g["weight_decay"]}
                             for g in adam_groups], lr=3e-3, betas=(0.8, 0.9), eps=1e-6, foreach=False,
                            fused=fused or None)
    muon_names = [n for g in opt.param_groups if g["kind"] == "muon" for n in g["names"]]
    for x, y in batches(3):
        for m in (model, ref_model):
            m(x, y).backward()
        opt.step()
        ref.step()
        with torch.no_grad():  # the reference has no Muon: give it our matrices so both see the same grads
            for name in muon_names:
                ref_params[name].copy_(model.get_parameter(name))
        for m in (model, ref_model):
            m.zero_grad(set_to_none=True)
    for g in adam_groups:
        for name, p in zip(g["names"], g["params"]):
            assert torch.equal(p, ref_params[name]), name


# ----------------------------------------------------------------------------- FSDP2 and DDP on gloo


def test_adamw_side_of_muon_fused_and_per_parameter_paths_agree_and_resume_each_other(monkeypatch):
    """Fused where the device has the kernel (a few launches for the group), per parameter elsewhere and under
    cautious decay: the same update up to rounding, and one state, so a checkpoint of either resumes on the other."""
    if not optim.fused_adamw_available("cpu"):
        pytest.skip("no fused AdamW kernel on this CPU build")
    cfg = OptimConfig(name="muon", lr=0.02, adam_lr=3e-3, weight_decay=0.1, beta1=0.8, beta2=0.9, eps=1e-6)
    models = [ToyGPT(n_layer=1, tied=False) for _ in range(2)]
    opts = [build_optimizer(m, cfg, m.row_blocks(), "cpu") for m in models]
    opts[1]._fused_on["cpu"] = False  # the per-parameter path
    data = batches(4)
    for step, (x, y) in enumerate(data):
        if step == 2:  # swap paths mid-run through a checkpoint of each
            states = [o.state_dict() for o in opts]
            for o, state in zip(opts, states[::-1]):
                o.load_state_dict(state)
        for m, o in zip(models, opts):
            m(x, y).backward()
            o.step()
            m.zero_grad(set_to_none=True)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    ops = []

    class Dispatched(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    muon_side = {p for g in opts[0].param_groups if g["kind"] == "muon" for p in g["params"]}
    for p in models[0].parameters():  # a step where the AdamW side has no gradients at all takes nothing
        p.grad = torch.zeros_like(p) if p in muon_side else None
    before = [p.clone() for g in opts[0].param_groups if g["kind"] == "adamw" for p in g["params"]]
    optim.step_if_finite(opts[0], torch.tensor(True))
    after = [p for g in opts[0].param_groups if g["kind"] == "adamw" for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    models[0].zero_grad(set_to_none=True)
    models[0](*data[0]).backward()
    with Dispatched():
        opts[0].step()
    assert ops.count(torch.ops.aten._fused_adamw_) == 2 and torch.ops.aten.addcdiv_ not in ops  # two AdamW groups
    assert all(s["step"].item() == 4 for g in opts[1].param_groups if g["kind"] == "adamw"
               for s in (opts[1].state[p] for p in g["params"]))


def test_eager_muon_side_is_a_fixed_number_of_operations_whatever_the_depth():
    """Momentum, Nesterov, the skip, Newton-Schulz, decay and step: operations on stacks of same-shape matrices and on
    Newton-Schulz calls of same-shape blocks, the same number whatever the number of layers (each operation is
    host work, and a launch on a GPU)."""
    cfg = OptimConfig(name="muon", lr=0.02, adam_lr=3e-3, weight_decay=0.1)
    counts = {}
    for n_layer in (1, 3):
        torch.manual_seed(0)
        model = ToyGPT(n_layer=n_layer)
        opt = build_optimizer(model, cfg, model.row_blocks(), "cpu")
        for _ in range(2):  # the second step is counted: the state exists
            model.zero_grad(set_to_none=True)
            model(*batches(1)[0]).backward()
            with muon_step.OpCounter() as counted:
                optim.step_if_finite(opt, torch.tensor(True))
        counts[n_layer] = counted.by_func
    assert counts[3] == counts[1], counts[3] - counts[1]
    # All the gradients copied into one buffer, the skip one where on it: no stack, no copy a matrix.
    assert counts[1][torch.ops.aten._foreach_copy_] == 1 and counts[1][torch.ops.aten.where] == 1
    assert torch.ops.aten.stack not in counts[1] and torch.ops.aten.masked_fill not in counts[1]
    # Three Newton-Schulz calls of 5 iterations: Q with O (8 x 8), K with V (4 x 8), gate and up with fc2's transpose.
    assert counts[1][torch.ops.aten.bmm] == 3 * 5


def run_muon(model, data, compile=False, **cfg):
    opt = build_optimizer(model, OptimConfig(name="muon", lr=0.05, adam_lr=0.01, weight_decay=0.1, ns_dtype="fp64",
                                             **cfg), model.row_blocks(), "cpu", compile=compile)
    train(model, opt, data)
    return opt


def distributed_worker(rank, world_size, out_file, mode):
    # Uneven shards: qkv has 15 rows (blocks 9/3/3) and the embedding 7; with 3 ranks the
    # 4-row proj and fc2 leave the last rank no rows at all.
    model = ToyGPT(vocab=7, d=4, h=3, k=1, hd=3, f=5, n_layer=2, tied=False).double()
    per_rank = 6 // world_size
    data = [(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
            for x, y in batches(3, vocab=7)]
    if mode.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        with pytest.raises(ValueError, match="use --optimizer adamw"):
            build_optimizer(model, OptimConfig(name="adamw8bit"), {}, "cpu")
        opt = run_muon(model, data, compile=mode == "fsdp, compiled")
        if world_size == 1:  # nothing to exchange: the one-process step, its momenta DTensor views of one buffer
            bufs = [state["momentum_buffer"] for state in opt.state.values() if "momentum_buffer" in state]
            assert bufs and all(muon._is_dtensor(b) for b in bufs)
            assert len({b.to_local().untyped_storage().data_ptr() for b in bufs}) == 1
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
    else:
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = build_optimizer(ddp, OptimConfig(name="muon", lr=0.05, adam_lr=0.01, weight_decay=0.1,
                                               ns_dtype="fp64"), model.row_blocks(), "cpu")
        train(ddp, opt, data)
        full = dict(model.named_parameters())
    if rank == 0:
        torch.save({n: t.detach().clone() for n, t in full.items()}, out_file)


@pytest.mark.parametrize("mode,world_size", [("fsdp", 1), ("fsdp", 2), ("fsdp", 3), ("ddp", 2), pytest.param(
    "fsdp, compiled", 2, marks=pytest.mark.slow)])  # the owners' Newton-Schulz compiled (~10 s a rank)
def test_muon_distributed_matches_single_process(mode, world_size, tmp_path):
    out_file = tmp_path / "params.pt"
    spawn_on_gloo(distributed_worker, world_size, tmp_path, str(out_file), mode)
    distributed = torch.load(out_file)

    make = lambda: ToyGPT(vocab=7, d=4, h=3, k=1, hd=3, f=5, n_layer=2, tied=False).double()  # noqa: E731
    model, untrained = make(), make()
    run_muon(model, batches(3, vocab=7))
    for name, p in model.named_parameters():
        assert not torch.equal(p, untrained.get_parameter(name)), f"{name} did not train"
        print(name, (distributed[name] - p.detach()).abs().max().item())
        torch.testing.assert_close(distributed[name], p.detach(), rtol=0, atol=1e-10, msg=name)


def test_shard_rows_follow_torch_chunk():
    for rows, world_size in [(15, 2), (15, 3), (4, 3), (1, 4), (16, 4)]:
        chunks = torch.arange(rows).chunk(world_size)
        for rank in range(world_size):
            first, end = muon.shard_rows(rows, world_size, rank)
            expected = chunks[rank].tolist() if rank < len(chunks) else []
            assert list(range(first, end)) == expected, (rows, world_size, rank)


def test_assign_owners_balances_the_work():
    costs = [update_math.newton_schulz_flops(rows, cols) for rows, cols in
             [(768, 768), (256, 768), (256, 768), (768, 768), (2048, 768), (2048, 768), (768, 2048)] * 2]
    for world_size in (2, 3, 4):
        owners = muon.assign_owners(costs, world_size)
        load = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world_size)]
        assert max(load) <= max(sum(costs) / world_size, max(costs)) * 1.25, (world_size, load)
    assert muon.assign_owners([1, 5, 3, 3], 2) == [0, 0, 1, 1]  # costliest first, ties to the lower rank
    assert muon.assign_owners([3, 1], 4) == [0, 1]


# ----------------------------------------------------------------------------- buckets


def traffic_worker(rank, world_size, out_dir):
    """One FSDP2 Muon step (every recipe option on), in buckets of one layer's matrices: its collectives
    counted; and a plain matrix beside sharded ones refused."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    even = distribute_tensor(torch.ones(world_size * 2, 4), init_device_mesh("cpu", (world_size,)), [Shard(0)])
    with muon_step.CollectiveCounter() as known:  # the counter itself, on c10d's and DTensor's collectives
        torch.distributed.all_gather_into_tensor(torch.empty(world_size * 5), torch.ones(5))
        even.full_tensor()
    assert (known.calls, known.received) == (2, (world_size - 1) * (5 * 4 + 2 * 4 * 4)), vars(known)

    model = ToyGPT(vocab=7, d=16, h=2, k=1, hd=8, f=24, n_layer=2, tied=False)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    with pytest.raises(ValueError, match="laid out alike"):
        muon.Muon([muon_stacks([matrix(4, 4), model.blocks[0].attn.proj.weight], [[4], [16]])])
    muon.MUON_BUCKET_BYTES = 4 * sum(p.numel() for n, p in model.blocks[0].named_parameters() if p.ndim == 2)
    opt = build_optimizer(model, OptimConfig(name="muon", ns_dtype="fp32", **RECIPE), model.row_blocks(), "cpu")
    x, y = batches(1, vocab=7)[0]
    model(x[rank::world_size], y[rank::world_size]).backward()
    torch.save(muon_step.muon_traffic(model, opt), f"{out_dir}/rank{rank}.pt")


def test_muon_under_fsdp_makes_two_collectives_per_bucket_and_receives_about_its_share(tmp_path):
    spawn_on_gloo(traffic_worker, 3, tmp_path, str(tmp_path))
    for rank in range(3):
        counted = torch.load(tmp_path / f"rank{rank}.pt")
        assert counted["buckets"] == 2 and counted["calls"] <= 2 * counted["buckets"], counted
        assert 0 < counted["received"] <= 2.5 * counted["matrix_bytes"] / 3, counted


def test_batched_newton_schulz_equals_one_matrix_at_a_time():
    g = torch.Generator().manual_seed(0)
    blocks = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in
              [(8, 4), (4, 8), (8, 4), (6, 6), (8, 4), (4, 8)]]
    ns = functools.partial(update_math.newton_schulz, steps=5, dtype=torch.float64)
    batched = muon.orthogonalize_blocks(blocks, ns)
    for block, ortho in zip(blocks, batched):
        torch.testing.assert_close(ortho, update_math.newton_schulz(block, 5, torch.float64), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- recipe options (issue 14)


def test_muon_buckets_bound_the_gathered_bytes_and_keep_the_order():
    params = [(torch.empty(n), [n]) for n in (10, 20, 30, 100, 5)]
    buckets = muon.muon_buckets(params, max_bytes=4 * 40)
    assert [[p.numel() for p, _ in b] for b in buckets] == [[10, 20], [30], [100], [5]]
    assert [pair for b in buckets for pair in b] == params


def test_muon_in_small_buckets_matches_one_bucket(monkeypatch):
    make = lambda: ToyGPT(vocab=7, d=4, h=3, k=1, hd=3, f=5, n_layer=2, tied=False).double()  # noqa: E731
    whole, bucketed = make(), make()
    run_muon(whole, batches(3, vocab=7))
    monkeypatch.setattr(muon, "MUON_BUCKET_BYTES", 1)  # every matrix a bucket of its own
    run_muon(bucketed, batches(3, vocab=7))
    for (name, p), q in zip(whole.named_parameters(), bucketed.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-12, msg=name)


def test_muon_step_with_normuon_and_cautious_decay_by_hand():
    # Momentum 0: the step is NS(grad) per block, NorMuon'd, decayed cautiously, then scaled and applied.
    torch.manual_seed(0)
    blocks, cols, lr, wd = [8, 4], 6, 0.1, 0.5
    w = torch.randn(sum(blocks), cols)
    w0, grad = w.clone(), torch.randn(sum(blocks), cols)
    opt = muon.Muon([{**muon_stacks([w], [blocks], lr=lr, weight_decay=wd), "cautious_wd": True}], momentum=0.0,
                     ns_dtype="fp64", ns_coeffs="polar-express", normuon_beta=0.9)
    w.grad = grad
    opt.step()
    for rows, start in zip(blocks, (0, 8)):
        block = slice(start, start + rows)
        ortho = update_math.newton_schulz(grad[block], 5, torch.float64, "polar-express").float()
        v = 0.1 * ortho.square().mean(1)
        normed = ortho / (v.sqrt() + update_math.NORMUON_EPS)[:, None]
        update = normed * ortho.norm() / normed.norm()
        decayed = torch.where(update * w0[block] >= 0, w0[block] * (1 - lr * wd), w0[block])
        expected = decayed - lr * update_math.muon_scale_factor(rows, cols, "match_rms_adamw") * update
        torch.testing.assert_close(w[block], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[w]["row_sq_avg"][:8], 0.1 * update_math.newton_schulz(
        grad[:8], 5, torch.float64, "polar-express").float().square().mean(1))


def recipe_fsdp_resume_worker(rank, world_size, out_file, ckpt_dir):
    """FSDP2 on uneven shards with every Muon recipe option: two steps, a sharded (DCP) save, a fresh model and
    optimizer restored from it, a third step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    per_rank = 6 // world_size
    data = [(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
            for x, y in batches(3, vocab=7)]

    def sharded():
        model = ToyGPT(vocab=7, d=4, h=3, k=1, hd=3, f=5, n_layer=2, tied=False).double()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        cfg = OptimConfig(name="muon", lr=0.05, adam_lr=0.01, weight_decay=0.1, ns_dtype="fp64", **RECIPE)
        return model, build_optimizer(model, cfg, model.row_blocks(), "cpu")

    options = StateDictOptions(full_state_dict=False)
    model, opt = sharded()
    train(model, opt, data[:2])
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=ckpt_dir)
    model, opt = sharded()
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=options)
    train(model, opt, data[2:])
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({n: t.detach().clone() for n, t in full.items()}, out_file)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as intended here
def test_muon_recipe_under_fsdp_with_a_sharded_resume_matches_single_process(tmp_path):
    out_file = tmp_path / "params.pt"
    spawn_on_gloo(recipe_fsdp_resume_worker, 3, tmp_path, str(out_file), str(tmp_path / "dcp"))
    distributed = torch.load(out_file)
    model = ToyGPT(vocab=7, d=4, h=3, k=1, hd=3, f=5, n_layer=2, tied=False).double()
    run_muon(model, batches(3, vocab=7), **RECIPE)
    for name, p in model.named_parameters():
        torch.testing.assert_close(distributed[name], p.detach(), rtol=0, atol=1e-10, msg=name)
    # The 3 ranks' checkpoint resumed in one process: the sharded state (NorMuon's rows too) reassembles.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    resumed = ToyGPT(vocab=7, d=4, h=3, k=1, hd=3, f=5, n_layer=2, tied=False).double()
    opt = build_optimizer(resumed, OptimConfig(name="muon", lr=0.05, adam_lr=0.01, weight_decay=0.1, ns_dtype="fp64",
                                               **RECIPE), resumed.row_blocks(), "cpu")
    model_sd, optim_sd = get_state_dict(resumed, opt)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    set_state_dict(resumed, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    train(resumed, opt, batches(3, vocab=7)[2:])
    for name, p in model.named_parameters():
        torch.testing.assert_close(resumed.get_parameter(name), p, rtol=0, atol=1e-10, msg=name)


def test_muon_momentum_ramps_linearly_then_holds_exactly():
    assert muon_momentum(0, 300, 0.85, 0.95) == 0.85
    assert muon_momentum(150, 300, 0.85, 0.95) == pytest.approx(0.90)
    assert muon_momentum(300, 300, 0.85, 0.95) == muon_momentum(10**6, 300, 0.85, 0.95) == 0.95
    assert muon_momentum(0, 0, 0.85, 0.95) == 0.95  # no warm-up


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_momentum_warmup_follows_muon_momentum_step_by_step(nesterov, monkeypatch):

    w = nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))
    opt = muon.Muon([muon_stacks([w], [[4]], lr=0.0, weight_decay=0.0)], nesterov=nesterov, momentum=0.95,
                     momentum_warmup=3, momentum_start=0.6)
    updates = []  # what enters Newton-Schulz: the (Nesterov-corrected) momentum
    original = muon.newton_schulz
    monkeypatch.setattr(muon, "newton_schulz", lambda stack, *a, **k: updates.append(stack[0].clone()) or original(
        stack, *a, **k))
    g = torch.Generator().manual_seed(0)
    buf = torch.zeros(4, 3, dtype=torch.float64)
    for step in range(5):
        w.grad = torch.randn(4, 3, generator=g, dtype=torch.float64)
        beta = muon_momentum(step, 3, 0.6, 0.95)  # 0.6, 0.7167, 0.8333, then 0.95
        buf = buf.lerp(w.grad, 1 - beta)
        expected = w.grad.lerp(buf, beta) if nesterov else buf
        opt.step()
        torch.testing.assert_close(opt.state[w]["momentum_buffer"], buf, rtol=0, atol=0)
        torch.testing.assert_close(updates[-1], expected.T, rtol=0, atol=0)  # turned wide for Newton-Schulz
    assert opt.state[w]["step"].item() == 5
