"""The Transformer Engine blocks of fp8.py in model.py's GPT: state-dict conversion and the blocks' wiring on
stand-in TE modules (CPU), and parity with the plain path on the same weights (CUDA with Transformer Engine
only: marked gpu, skipped elsewhere)."""

import dataclasses

import pytest
import torch

import fp8
import memory
from fp8 import TE_MODULES, TEBlock, plain_to_te_state_dict, te_to_plain_state_dict
from model import GPT, QWEN3_VALUES, ModelConfig

# Qwen3's architecture (QWEN3_VALUES), and the default one (attention gates) with each toggle the TE blocks take.
# Random residual projections (not the default's zero ones), so that every parameter has a gradient to compare.
DRAWN = {**QWEN3_VALUES, "zero_init_proj": False}
TINY_QWEN3 = ModelConfig(vocab_size=256, n_layer=3, n_head=4, n_kv_head=2, n_embd=64, max_seq_len=32, **DRAWN)
TINY = dataclasses.replace(TINY_QWEN3, attn_gate=True)
ARCHITECTURES = {"qwen3": {}, "gated": {"attn_gate": True}, "gated-relu2": {"attn_gate": True, "mlp": "relu2"}}
# TE's fused kernels want 16-multiples and FP8 attention wants head_dim 128.
TE_QWEN3 = ModelConfig(vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, n_embd=256, max_seq_len=64, **DRAWN)
FP8_ATTN_CFG = ModelConfig(vocab_size=512, n_layer=2, n_head=2, n_kv_head=1, n_embd=256, max_seq_len=64, **DRAWN)


def te_config(architecture: str, base: ModelConfig = TE_QWEN3) -> ModelConfig:
    return dataclasses.replace(base, **ARCHITECTURES[architecture])


def needs_te(test):
    """CUDA and Transformer Engine: marked gpu (pytest -m gpu), skipped where either is missing."""
    test = pytest.mark.skipif(not fp8.te_installed(), reason="needs transformer_engine")(test)
    test = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test)
    return pytest.mark.gpu(test)


def plain_state_dict(cfg=TINY):
    torch.manual_seed(0)
    return GPT(cfg).state_dict()


def extra_state_keys(n_layer):
    return {f"blocks.{i}.{module}._extra_state" for i in range(n_layer) for module in TE_MODULES}


# ----------------------------------------------------------------------------- TE blocks on stand-ins (CPU)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_te_block_wiring_gives_the_plain_forward_and_gradients(stand_in_te, architecture):
    """TEBlock's own code (the gate on TE's normed output, bshd heads, the MLP's activation) on stand-ins whose
    numerics are the plain modules': the same loss and gradients as the plain blocks, on the same weights."""
    cfg = dataclasses.replace(TINY_QWEN3, **ARCHITECTURES[architecture])
    torch.manual_seed(0)
    plain = GPT(cfg)
    with torch.no_grad():  # gates and norms off their init, so that a dropped or misplaced one would show
        for p in plain.parameters():
            p.add_(0.3 * torch.randn_like(p))
    te_model = GPT(cfg, block=TEBlock)
    te_model.load_state_dict(plain_to_te_state_dict(plain.state_dict()), strict=True)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    losses = [m(idx, idx)[1] for m in (plain, te_model)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    te_params = dict(te_model.named_parameters())
    assert list(te_params) == [name for name, _ in plain.named_parameters()]
    for name, p in plain.named_parameters():
        torch.testing.assert_close(te_params[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def te_twins(cfg, act_ckpt="none"):
    """{--fp8-fused-wgrad: model} on the same weights, built as train.py builds them (fp8.block_class, fp8.convert,
    then activation checkpointing)."""
    models = {}
    for fused in (False, True):
        fp8_cfg = fp8.FP8Config(mode="te", fused_wgrad=fused)
        model = GPT(cfg, block=fp8.block_class(fp8_cfg))
        model.load_state_dict(plain_to_te_state_dict(plain_state_dict(cfg)))
        fp8.convert(model, fp8_cfg)
        memory.apply_activation_checkpointing(model, act_ckpt)
        models[fused] = model
    return models


def train_micro_steps(model, batches, grad_accum, forward=None):
    """train_step's micro-steps without the update: -> each step's gradients by name, zero_grad between."""
    steps = []
    for start in range(0, len(batches), grad_accum):
        for micro, idx in enumerate(batches[start:start + grad_accum]):
            with fp8.micro_step(model, micro, grad_accum):
                ((model if forward is None else forward)(idx, idx)[1] / grad_accum).backward()
        steps.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return steps


def seen(model):
    """What the first block's TE GEMM modules (qkv, proj, mlp) were called with as is_first_microbatch, in order."""
    def unwrapped(module):  # from under memory.py's checkpoint wrapper
        return getattr(module, "_checkpoint_wrapped_module", module)
    block = unwrapped(model.blocks[0])
    return [unwrapped(m).seen for m in (block.attn.qkv, block.attn.proj, block.mlp)]


def batches(n):
    return [torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(n)]


@pytest.mark.parametrize("act_ckpt, grad_accum", [("none", 3), ("full", 3), ("selective", 3), ("none", 1)])
def test_fused_weight_gradients_sum_a_steps_micro_batches_as_autograd_does(stand_in_te, act_ckpt, grad_accum):
    """--fp8-fused-wgrad on stand-ins that write into main_grad as TE does (overwrite at is_first_microbatch=True,
    add at False or None, no gradient to autograd): two steps give every parameter the gradient autograd sums, bit
    for bit, the second step's untouched by the first's, main_grad being the weights' .grad. A step of several
    micro-batches tells TE which is the first (the recomputed forward of a checkpointed block too, in the
    backward); a step of one passes None, and the zeroing at its start keeps TE's adding clean."""
    models = te_twins(TINY, act_ckpt)
    plain_steps, fused_steps = (train_micro_steps(model, batches(2 * grad_accum), grad_accum)
                                for model in models.values())
    for plain, fused in zip(plain_steps, fused_steps):
        assert list(fused) == list(plain)
        for name in plain:
            assert torch.equal(fused[name], plain[name]), name
    fused_model = models[True]
    weights = fp8.fused_weights(fused_model)
    assert len(weights) == 4 * TINY.n_layer and fp8.fused_weights(models[False]) == []
    assert all(w.main_grad.dtype == torch.float32 for w in weights)
    step = [micro == 0 if grad_accum > 1 else None for micro in range(grad_accum)]
    twice = [flag for flag in step for _ in range(2)]  # a checkpointed module: its forward, then its recompute
    attention = twice if act_ckpt == "full" else step  # "selective" checkpoints the MLP alone
    assert seen(fused_model) == [attention * 2, attention * 2, (step if act_ckpt == "none" else twice) * 2]
    with fp8.micro_step(fused_model, 0, grad_accum):
        fused_model(batches(1)[0], batches(1)[0])[1].backward()
    assert all(w.grad is w.main_grad for w in weights)
    fused_model.zero_grad(set_to_none=True)
    fused_model(batches(1)[0], batches(1)[0])[1].backward()  # no micro-step: autograd gets no gradient for them
    assert seen(fused_model)[0][-1] is None and all(w.grad is None for w in weights)


def test_micro_steps_under_torch_compile_pass_each_micro_batch_its_own_flag(stand_in_te):
    """Under torch.compile every call of a TE module sees its own micro-batch's MICRO_STEP (it reaches them
    through the graph breaks at their calls, unguarded), and the gradients are eager's (to float rounding)."""
    eager, fused = te_twins(TINY).values()
    expected = train_micro_steps(eager, batches(4), 2)
    got = train_micro_steps(fused, batches(4), 2, forward=torch.compile(fused, backend="aot_eager"))
    for step, want in zip(got, expected):
        for name, grad in want.items():
            torch.testing.assert_close(step[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    assert seen(fused) == [[True, False] * 2] * 3


def test_batch_size_probes_run_as_a_steps_first_micro_batch(stand_in_te):
    """--batch-size auto's probes (fp8.probing) hold TE's FP8 weight copies in memory, as a step of several
    micro-batches holds them for the run."""
    model = te_twins(TINY)[False]
    with fp8.probing(model, None):
        model(batches(1)[0], batches(1)[0])[1].backward()
    assert seen(model) == [[True]] * 3 and fp8.MICRO_STEP.first is None


def test_the_start_up_line_names_fused_weight_gradients_and_their_buffers_are_float32(stand_in_te):
    plain, fused = te_twins(TINY).values()
    recipe = type("Float8CurrentScaling", (), {"fp8_dpa": False})()
    assert "weight gradients fused into float32 main_grad" in fp8.describe_fp8(fused, recipe)
    assert "fused" not in fp8.describe_fp8(plain, recipe)
    fp8.keep_main_grads(fused.to(torch.bfloat16))  # whatever the weights' dtype, the gradients sum in float32
    assert {w.main_grad.dtype for w in fp8.fused_weights(fused)} == {torch.float32}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_checkpoint_moves_between_plain_and_te_blocks_both_ways(stand_in_te, architecture):
    cfg = dataclasses.replace(TINY_QWEN3, **ARCHITECTURES[architecture])
    torch.manual_seed(1)
    te_model = GPT(cfg, block=TEBlock)
    with torch.no_grad():
        for p in te_model.parameters():
            p.normal_()
    plain = GPT(cfg)
    plain.load_state_dict(te_to_plain_state_dict(te_model.state_dict()), strict=True)
    back = GPT(cfg, block=TEBlock)
    back.load_state_dict(plain_to_te_state_dict(plain.state_dict()), strict=True)
    for name, p in te_model.state_dict().items():
        assert torch.equal(back.state_dict()[name], p), name
    assert cfg.attn_gate == any(name.endswith("attn.gate_weight") for name in plain.state_dict())


def test_te_blocks_refuse_value_embeddings_in_one_line_naming_the_flag(stand_in_te):
    with pytest.raises(ValueError) as e:
        GPT(dataclasses.replace(TINY, value_embeds=1), block=TEBlock)
    assert str(e.value) == ("--value-embeds 1: not implemented for the te backend (--fp8 te); add --value-embeds 0, "
                            "or use the plain blocks (--fp8 off or torchao)")


# ----------------------------------------------------------------------------- conversion (pure, CPU)


def test_plain_to_te_adds_one_empty_extra_state_per_te_module():
    sd = plain_state_dict()
    te_sd = plain_to_te_state_dict(sd)
    assert set(te_sd) - set(sd) == extra_state_keys(TINY.n_layer)
    for key in extra_state_keys(TINY.n_layer):
        assert te_sd[key].dtype == torch.uint8 and te_sd[key].numel() == 0
    assert all(te_sd[k] is v for k, v in sd.items())  # parameters pass through untouched


def test_te_to_plain_drops_every_extra_state_and_round_trips():
    sd = plain_state_dict()
    te_sd = plain_to_te_state_dict(sd)
    te_sd["blocks.0.mlp._extra_state"] = torch.arange(40, dtype=torch.uint8)  # a delayed-scaling pickle
    back = te_to_plain_state_dict(te_sd)
    assert list(back) == list(sd) and all(back[k] is sd[k] for k in sd)
    GPT(TINY).load_state_dict(back, strict=True)


def test_conversion_keeps_existing_extra_state():
    te_sd = plain_to_te_state_dict(plain_state_dict())
    kept = torch.arange(8, dtype=torch.uint8)
    te_sd["blocks.1.attn.qkv._extra_state"] = kept
    assert plain_to_te_state_dict(te_sd)["blocks.1.attn.qkv._extra_state"] is kept


def test_bshd_heads_are_contiguous_and_give_attentions_output():
    """TEAttention's q, k, v: TE's bshd layout, contiguous (a strided v makes TE copy it, and under compile
    fall back to eager), and the same heads the plain Attention attends with."""
    from model import Attention, rope_cos_sin

    torch.manual_seed(0)
    attn, (B, T) = Attention(TINY_QWEN3), (2, 8)
    for p in attn.parameters():  # norm weights away from 1, so that a skipped norm would show
        p.data.normal_(1.0 if p.ndim == 1 else 0.0, 0.3)
    x = torch.randn(B, T, TINY_QWEN3.n_embd)
    cos, sin = rope_cos_sin(TINY_QWEN3.resolved_head_dim, T, TINY_QWEN3.rope_theta)
    q, k, v = fp8.bshd_heads(attn.qkv(x), attn.q_norm, attn.k_norm, cos, sin, TINY_QWEN3.n_head, TINY_QWEN3.n_kv_head)
    hd = TINY_QWEN3.resolved_head_dim
    assert q.shape == (B, T, TINY_QWEN3.n_head, hd) and k.shape == v.shape == (B, T, TINY_QWEN3.n_kv_head, hd)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    y = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True, enable_gqa=True)
    torch.testing.assert_close(attn.proj(y.transpose(1, 2).reshape(B, T, -1)), attn(x, cos, sin))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_te_backend_without_cuda_says_how_to_install():
    with pytest.raises(ValueError, match=r"pip install --no-build-isolation transformer-engine\[pytorch\] on a CUDA machine") as e:
        GPT(TINY, block=TEBlock)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- TE on a GPU


def same_weights(cfg):
    """(plain, te) models on CUDA holding the same weights; gates away from their zero init, so that each head
    gets its own factor."""
    torch.manual_seed(0)
    plain = GPT(cfg).cuda()
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if name.endswith("attn.gate_weight"):
                p.normal_(0.0, 0.1)
    te_model = GPT(cfg, block=TEBlock).cuda()
    te_model.load_state_dict(plain_to_te_state_dict(plain.state_dict()), strict=True)
    return plain, te_model


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@needs_te
def test_te_state_dict_is_the_plain_contract_plus_extra_state(architecture):
    cfg = te_config(architecture)
    plain, te_model = same_weights(cfg)
    te_sd, plain_sd = te_model.state_dict(), plain.state_dict()
    assert set(te_sd) == set(plain_to_te_state_dict(plain_sd))
    for key, value in plain_sd.items():
        assert te_sd[key].shape == value.shape, key
    GPT(cfg).cuda().load_state_dict(te_to_plain_state_dict(te_sd), strict=True)
    assert te_model.row_blocks() == plain.row_blocks()


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@needs_te
def test_te_matches_plain_on_the_same_weights_in_bf16(architecture):
    cfg = te_config(architecture)
    plain, te_model = same_weights(cfg)
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss_p = plain(idx, idx)
        _, loss_t = te_model(idx, idx)
        with torch.no_grad():  # with targets the forward returns no logits
            logits_p, logits_t = plain(idx)[0], te_model(idx)[0]
    loss_p.backward()
    loss_t.backward()
    assert torch.allclose(logits_t.float(), logits_p.float(), atol=3e-2, rtol=3e-2)
    assert abs(loss_t.item() - loss_p.item()) < 1e-2
    grads_t = dict(te_model.named_parameters())
    for name, p in plain.named_parameters():
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), grads_t[name].grad.flatten(), dim=0)
        assert cos > 0.99, (name, cos.item())


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("recipe", fp8.RECIPES_OF["te"])
@needs_te
def test_te_fp8_stays_close_to_bf16(recipe, architecture):
    cfg = te_config(architecture)
    plain, te_model = same_weights(cfg)
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss_p = plain(idx, idx)
        with fp8.te_autocast(fp8.te_recipe(recipe, fp8_attn=False)):
            _, loss_t = te_model(idx, idx)
    loss_t.backward()
    assert abs(loss_t.item() - loss_p.item()) < 0.02 * loss_p.item()
    assert all(torch.isfinite(p.grad).all() for p in te_model.parameters())


@pytest.mark.parametrize("recipe", fp8.RECIPES_OF["te"])
@needs_te
def test_fused_weight_gradients_on_te_are_autograds_in_float32(recipe):
    """--fp8-fused-wgrad on TE's own modules: two steps of two micro-batches under FP8, against the unfused blocks
    on the same weights and batches. Every gradient within 2% (the fused ones are summed in float32, the others
    cast from bf16); main_grad is each fused weight's .grad; a first step's left in it would double the second's."""
    cfg = te_config("gated")
    models = {}
    for fused in (False, True):
        fp8_cfg = fp8.FP8Config(mode="te", recipe=recipe, fused_wgrad=fused)
        models[fused] = GPT(cfg, block=fp8.block_class(fp8_cfg)).cuda()
        models[fused].load_state_dict(plain_to_te_state_dict(plain_state_dict(cfg)))
        fp8.convert(models[fused], fp8_cfg)
    te_recipe = fp8.te_recipe(recipe, fp8_attn=False)
    idx = [torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), device="cuda") for _ in range(4)]
    for step in range(2):
        grads = {}
        for fused, model in models.items():
            for micro in range(2):
                with fp8.micro_step(model, micro, 2):
                    with torch.autocast("cuda", dtype=torch.bfloat16), fp8.te_autocast(te_recipe):
                        loss = model(idx[2 * step + micro], idx[2 * step + micro])[1]
                    (loss / 2).backward()
            grads[fused] = {n: p.grad.clone() for n, p in model.named_parameters()}
            if fused:
                assert all(w.grad is w.main_grad for w in fp8.fused_weights(model))
            model.zero_grad(set_to_none=True)
        for name, grad in grads[False].items():
            error = ((grads[True][name] - grad).norm() / grad.norm()).item()
            assert error < 0.02, (step, name, error)


@needs_te
def test_te_refreshes_its_fp8_weight_copies_after_each_update():
    """Steps of two micro-batches told which is first (TE keeps each weight's FP8 copy from the first and reuses
    it) against the same steps told nothing (TE quantizes every time), current scaling, an SGD update between:
    the same losses, so the copy is refreshed at each step's first micro-batch and never outlives an update."""
    cfg = te_config("gated")
    losses = {}
    for cached in (False, True):
        model = GPT(cfg, block=TEBlock).cuda()
        model.load_state_dict(plain_to_te_state_dict(plain_state_dict(cfg)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.3)  # large: a stale copy would show in the loss
        torch.manual_seed(1)
        idx = [torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), device="cuda") for _ in range(6)]
        losses[cached] = []
        for i, batch in enumerate(idx):
            with fp8.micro_step(model, i % 2, 2 if cached else 1):
                with torch.autocast("cuda", dtype=torch.bfloat16), fp8.te_autocast(fp8.te_recipe("current", False)):
                    loss = model(batch, batch)[1]
                loss.backward()
            losses[cached].append(loss.item())
            if i % 2:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)
    assert abs(losses[False][2] - losses[False][0]) > 0.01  # the updates moved the loss


@pytest.mark.parametrize("architecture", ["qwen3", "gated"])
@needs_te
def test_te_fp8_attention_runs_with_head_dim_128(architecture):
    # Delayed scaling: the current-scaling variant needs NVTE_DPA_FP8_RECIPE before TE's import, which an
    # earlier test in this process has done (tests/test_fp8.py runs it through train.py in a fresh process).
    cfg = te_config(architecture, FP8_ATTN_CFG)
    plain, te_model = same_weights(cfg)
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss_p = plain(idx, idx)
        with fp8.te_autocast(fp8.te_recipe("delayed", fp8_attn=True)):
            _, loss_t = te_model(idx, idx)
    loss_t.backward()
    assert abs(loss_t.item() - loss_p.item()) < 0.05 * loss_p.item()


@needs_te
def test_te_attention_receives_contiguous_q_k_v():
    cfg = te_config("gated")
    _, te_model = same_weights(cfg)
    seen = []
    for block in te_model.blocks:
        block.attn.core_attention.register_forward_pre_hook(
            lambda _, args: seen.append([a.is_contiguous() for a in args]))
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        te_model(idx, idx)
    assert seen == [[True, True, True]] * cfg.n_layer


@needs_te
def test_te_backend_refuses_kv_cache_decoding():
    from model import KVCache

    cfg = te_config("gated")
    _, te_model = same_weights(cfg)
    cache = KVCache(cfg, batch_size=1, device="cuda")
    with pytest.raises(ValueError, match="plain backend"):
        te_model(torch.zeros(1, 4, dtype=torch.long, device="cuda"), cache=cache)
