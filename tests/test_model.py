import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import loss as loss_module
import model as model_module
from model import GPT, ModelConfig
from conftest import targets_with_ignored
from sizing import flops_per_token, param_count, param_numels

# GQA with 4 query heads per kv head, a head_dim that is not n_embd // n_head, a vocab that needs padding
# and a small rope_theta so that the rotation is far from the identity over a short sequence. Qwen3's
# architecture (QWEN3_VALUES), whatever the defaults: the tests compare with transformers' Qwen3 and count
# SwiGLU's fused [gate; up] weight; a toggle test turns its toggle on itself.
# Random projections (not the default's zero ones, tested below), so that every parameter has a gradient at init.
TINY = dict(
    vocab_size=200, n_layer=2, n_head=8, n_kv_head=2, n_embd=64, head_dim=16, ffn_dim=96,
    max_seq_len=32, rope_theta=500.0, norm_eps=1e-6, zero_init_proj=False, **model_module.QWEN3_VALUES,
)


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides))


def qwen3_to_ours(hf_state: dict, n_layer: int) -> dict:
    """Map a Qwen3ForCausalLM state dict onto our parameter names (fusing q,k,v and gate,up)."""
    out = {
        "embed.weight": hf_state["model.embed_tokens.weight"],
        "norm.weight": hf_state["model.norm.weight"],
        "lm_head.weight": hf_state["lm_head.weight"],
    }
    for i in range(n_layer):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        out[dst + "attn.qkv.layer_norm_weight"] = hf_state[src + "input_layernorm.weight"]
        out[dst + "attn.qkv.weight"] = torch.cat(
            [hf_state[attn + "q_proj.weight"], hf_state[attn + "k_proj.weight"], hf_state[attn + "v_proj.weight"]]
        )
        out[dst + "attn.q_norm.weight"] = hf_state[attn + "q_norm.weight"]
        out[dst + "attn.k_norm.weight"] = hf_state[attn + "k_norm.weight"]
        out[dst + "attn.proj.weight"] = hf_state[attn + "o_proj.weight"]
        out[dst + "mlp.layer_norm_weight"] = hf_state[src + "post_attention_layernorm.weight"]
        out[dst + "mlp.fc1_weight"] = torch.cat([hf_state[mlp + "gate_proj.weight"], hf_state[mlp + "up_proj.weight"]])
        out[dst + "mlp.fc2_weight"] = hf_state[mlp + "down_proj.weight"]
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers_qwen3(tied):
    transformers = pytest.importorskip("transformers")
    config = tiny_config(tie_embeddings=tied)
    hf_config = transformers.Qwen3Config(
        vocab_size=config.padded_vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.n_kv_head,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=tied,
        attention_bias=False,
        attn_implementation="eager",
    )
    assert hf_config.rope_parameters["rope_theta"] == config.rope_theta
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(hf_config).float().eval()
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
    # Norm weights start at 1, which would hide a swapped or missing norm mapping; matrices get a larger
    # scale so that attention patterns are far from uniform.
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))

    ours = GPT(config).eval()
    ours.load_state_dict(qwen3_to_ours(hf.state_dict(), config.n_layer))
    assert (ours.lm_head.weight is ours.embed.weight) == tied

    idx = torch.randint(0, config.vocab_size, (2, config.max_seq_len))
    with torch.no_grad():
        expected = hf(input_ids=idx).logits
        logits, _ = ours(idx)
    assert logits.dtype == expected.dtype == torch.float32
    rel_err = (logits - expected).abs().max() / expected.abs().max()
    assert rel_err < 1e-5, f"relative error {rel_err:.2e}"


def test_causal_mask():
    model = tiny_model().eval()
    idx = torch.randint(0, 200, (2, 32))
    with torch.no_grad():
        base, _ = model(idx)
        for t in (0, 7, 30):
            changed = idx.clone()
            changed[:, t + 1:] = torch.randint(0, 200, (2, 31 - t))
            changed[:, t + 1] = (idx[:, t + 1] + 1) % 200
            out, _ = model(changed)
            torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)
            assert not torch.allclose(out[:, t + 1:], base[:, t + 1:])


def expected_shapes(c: ModelConfig) -> dict:
    V, D, H, K, hd, F_ = c.padded_vocab_size, c.n_embd, c.n_head, c.n_kv_head, c.resolved_head_dim, c.resolved_ffn_dim
    shapes = {"embed.weight": (V, D), "norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(c.n_layer):
        shapes |= {
            f"blocks.{i}.attn.qkv.layer_norm_weight": (D,),
            f"blocks.{i}.attn.qkv.weight": ((H + 2 * K) * hd, D),
            f"blocks.{i}.attn.q_norm.weight": (hd,),
            f"blocks.{i}.attn.k_norm.weight": (hd,),
            f"blocks.{i}.attn.proj.weight": (D, H * hd),
            f"blocks.{i}.mlp.layer_norm_weight": (D,),
            f"blocks.{i}.mlp.fc1_weight": (2 * F_, D),
            f"blocks.{i}.mlp.fc2_weight": (D, F_),
        }
    return shapes


@pytest.mark.parametrize("tied", [True, False])
def test_state_dict_names_and_shapes(tied):
    model = tiny_model(tie_embeddings=tied)
    got = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert got == expected_shapes(model.config)
    assert got["embed.weight"] == (256, 64)


def test_tied_embedding_shares_storage_and_counts_once():
    tied, untied = tiny_model(tie_embeddings=True), tiny_model(tie_embeddings=False)
    assert tied.lm_head.weight is tied.embed.weight
    assert tied.lm_head.weight.data_ptr() == tied.embed.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.embed.weight.data_ptr()
    total = sum(math.prod(s) for s in expected_shapes(tied.config).values())
    assert untied.num_params() == total
    assert tied.num_params() == total - 256 * 64


def test_defaults_resolve():
    c = ModelConfig(n_layer=12, n_head=12, n_kv_head=4, n_embd=768, max_seq_len=1024)  # GPT-2 small
    assert (c.resolved_head_dim, c.resolved_ffn_dim, c.padded_vocab_size) == (64, 2048, 50304)  # 8/3 * 768
    assert ModelConfig(n_embd=1024, n_head=16).resolved_ffn_dim == 2816
    assert ModelConfig(n_embd=512, n_head=8).resolved_ffn_dim == 1408
    # ReLU^2's: 3/2 of SwiGLU's, the same parameters.
    assert ModelConfig(n_embd=768, n_head=12, mlp="relu2").resolved_ffn_dim == 3072
    assert ModelConfig(n_embd=1024, n_head=16, mlp="relu2").resolved_ffn_dim == 4224
    assert ModelConfig(n_embd=512, n_head=8, mlp="relu2").resolved_ffn_dim == 2112
    assert ModelConfig(vocab_size=128).padded_vocab_size == 128


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(n_head=8, n_kv_head=3), r"n_head \(8\) must be divisible by n_kv_head \(3\)"),
        (dict(n_layer=0), "n_layer must be positive"),
        (dict(n_embd=-4), "n_embd must be positive"),
        (dict(vocab_size=0), "vocab_size must be positive"),
        (dict(head_dim=0), "head_dim must be positive"),
        (dict(ffn_dim=-1), "ffn_dim must be positive"),
        (dict(head_dim=15), "head_dim must be even"),
        (dict(head_dim=None, n_embd=60), r"n_embd \(60\) must be divisible by n_head \(8\)"),
        (dict(head_dim=None, n_embd=24, n_head=8, n_kv_head=2), "head_dim must be even"),
        (dict(norm_eps=0.0), "norm_eps must be positive"),
        (dict(rope_theta=-1.0), "rope_theta must be positive"),
        (dict(mlp="gelu"), "unknown mlp 'gelu'"),
        (dict(logit_softcap=-1.0), "logit_softcap must be >= 0"),
        (dict(value_embeds=2, n_layer=2), r"value_embeds must be in 0..1"),
        (dict(unet_skips=True, n_layer=1), "unet_skips needs at least 2 layers"),
        (dict(embed_skips=True, n_layer=1), "embed_skips needs at least 2 layers"),
        (dict(bigram_embed=1), "bigram_embed must be 0 .off. or at least 2 rows"),
        (dict(bigram_embed=-3), "bigram_embed must be 0"),
    ],
)
def test_validate_rejects_bad_config(overrides, message):
    config = tiny_config(**overrides)
    with pytest.raises(ValueError, match=message) as excinfo:
        config.validate()
    assert "\n" not in str(excinfo.value)
    with pytest.raises(ValueError, match=message):
        GPT(config)


def test_flops_per_token_hand_count():
    c = ModelConfig(vocab_size=100, n_layer=2, n_head=4, n_kv_head=2, n_embd=16, head_dim=4, ffn_dim=32,
                    **model_module.QWEN3_VALUES)
    # per layer: qkv 16*(4+2*2)*4=512, proj 16*16=256, fc1 16*64=1024, fc2 32*16=512 -> 2304
    # N = 2*2304 + lm_head 128*16 = 6656; attention = 12 * 2 layers * 4 heads * 4 hd * 8 tokens = 3072
    assert flops_per_token(c, seq_len=8) == 6 * 6656 + 3072


def test_flops_counts_every_matmul_weight():
    model = tiny_model(tie_embeddings=True)
    norm_params = sum(p.numel() for p in model.parameters() if p.ndim == 1)
    attention = 12 * 2 * 8 * 16 * 32
    assert flops_per_token(model.config, 32) == 6 * (model.num_params() - norm_params) + attention


def test_row_blocks_split_fused_weights():
    model = tiny_model()
    blocks = model.row_blocks()
    params = dict(model.named_parameters())
    assert set(blocks) == {n for n in params if n.endswith(("qkv.weight", "fc1_weight"))}
    for name, rows in blocks.items():
        assert sum(rows) == params[name].shape[0]
    assert blocks["blocks.1.attn.qkv.weight"] == [128, 32, 32]
    assert blocks["blocks.0.mlp.fc1_weight"] == [96, 96]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_param_numels_name_every_parameter(tied):
    model = tiny_model(tie_embeddings=tied)
    assert param_numels(model.config) == {n: p.numel() for n, p in model.named_parameters()}


def test_param_count_costs_nothing_whatever_the_depth():
    """10**20 layers are counted at once: one layer's sizes times n_layer, no walk."""
    one, two, huge = (tiny_config(n_layer=n, tie_embeddings=False) for n in (1, 2, 10**20))
    assert param_count(two) == sum(param_numels(two).values()) == GPT(two).num_params()
    assert param_count(huge) == param_count(one) + (10**20 - 1) * (param_count(two) - param_count(one))


# ----------------------------------------------------------------------------- the fused lm_head + loss


def reference_loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The unfused loss: the full logits of the no-targets path, then F.cross_entropy in float32."""
    logits, _ = model(idx)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


def loss_and_grads(model: GPT, loss_fn) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_close_relative(actual: torch.Tensor, expected: torch.Tensor, tol: float, name: str = ""):
    """Max error within tol of the expected tensor's largest entry: bf16 rounds every entry relative to its
    own size, so small entries of a gradient carry large relative errors however good the whole is."""
    err = (actual - expected).abs().max() / expected.abs().max()
    assert err < tol, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("tied", [True, False])
def test_fused_loss_and_gradients_match_the_unfused_reference(tied):
    model = tiny_model(tie_embeddings=tied)
    model.loss_chunk_tokens = 7  # 64 tokens: ten chunks of 6 or 7
    idx, targets = torch.randint(0, 200, (2, 32)), targets_with_ignored()
    expected, expected_grads = loss_and_grads(model, lambda: reference_loss(model, idx, targets))
    assert model(idx, targets)[0] is None  # the logits are never materialised
    loss, grads = loss_and_grads(model, lambda: model(idx, targets)[1])
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("tied", [True, False])
def test_fused_loss_under_bf16_autocast_matches_the_unfused_bf16_reference(tied):
    model = tiny_model(tie_embeddings=tied)
    model.loss_chunk_tokens = 7
    idx, targets = torch.randint(0, 200, (2, 32)), targets_with_ignored()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, expected_grads = loss_and_grads(model, lambda: reference_loss(model, idx, targets))
        loss, grads = loss_and_grads(model, lambda: model(idx, targets)[1])
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32, name
        assert_close_relative(grad, expected_grads[name], 3e-2, name)
    assert abs(loss.item() - model(idx, targets)[1].item()) < 0.05  # and near the fp32 loss


def test_no_grad_loss_computes_no_gradients(monkeypatch):
    model = tiny_model().eval()
    model.loss_chunk_tokens = 7
    idx, targets = torch.randint(0, 200, (2, 32)), targets_with_ignored()
    with_grad = []
    chunk_loss = loss_module._chunk_loss_and_grad

    def spy(logits, chunk_targets, grad, *rest):
        with_grad.append(grad)
        return chunk_loss(logits, chunk_targets, grad, *rest)

    monkeypatch.setattr(loss_module, "_chunk_loss_and_grad", spy)
    with torch.no_grad():
        logits, loss = model(idx, targets)
        expected = reference_loss(model, idx, targets)
    assert logits is None and loss.grad_fn is None
    assert with_grad == [False] * 10
    torch.testing.assert_close(loss, expected)
    assert model(idx)[1] is None
    model(idx, targets)[1].backward()
    assert with_grad[10:] == [True] * 10


@pytest.mark.parametrize("tied", [True, False])
def test_compiled_loss_matches_eager_and_a_new_micro_batch_recompiles_once(tied, monkeypatch):
    """Dynamo traces one copy of the chunk body per chunk, so the chunk count is bounded; micro-batches with the
    same count share one graph once the first other size has made the token count dynamic."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(loss_module, "MAX_LOSS_CHUNKS", 3)  # fewer copies of the chunk body to trace
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(n_layer=1, tie_embeddings=tied)
    model.loss_chunk_tokens = 8
    compiled = torch.compile(model, backend="aot_eager")
    for batch in (2, 3, 4):  # 64, 96 and 128 tokens: three chunks each
        idx, targets = torch.randint(0, 200, (batch, 32)), targets_with_ignored((batch, 32))
        expected, expected_grads = loss_and_grads(model, lambda: model(idx, targets)[1])
        loss, grads = loss_and_grads(model, lambda: compiled(idx, targets)[1])
        torch.testing.assert_close(loss, expected)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert counters["stats"]["unique_graphs"] == 2  # the first size, then one graph for every other
    torch._dynamo.reset()


@pytest.mark.slow
def test_fused_loss_compiles_in_one_graph():
    model = tiny_model(n_layer=1)
    model.loss_chunk_tokens = 7
    idx, targets = torch.randint(0, 200, (2, 32)), targets_with_ignored()
    expected, expected_grads = loss_and_grads(model, lambda: reference_loss(model, idx, targets))
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break is an error
    loss, grads = loss_and_grads(model, lambda: compiled(idx, targets)[1])
    torch.testing.assert_close(loss, expected)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_rejects_sequence_longer_than_max_seq_len():
    with pytest.raises(ValueError, match="sequence length 33 exceeds max_seq_len 32"):
        tiny_model()(torch.zeros(1, 33, dtype=torch.long))


def test_init_is_deterministic_and_scaled():
    a, b = tiny_model(seed=3), tiny_model(seed=3)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embed.weight, tiny_model(seed=4).embed.weight)
    big = tiny_model(n_layer=8, n_embd=256, n_head=8, head_dim=32, ffn_dim=512)
    for name, p in big.named_parameters():
        if p.ndim == 1:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        std = 0.02 / 4 if name.endswith(("attn.proj.weight", "fc2_weight")) else 0.02
        assert abs(p.std().item() / std - 1) < 0.05, name


@pytest.mark.parametrize("tied", [True, False])
def test_meta_device_then_init_weights_matches_eager_build(tied):
    with torch.device("meta"):
        lazy = GPT(tiny_config(tie_embeddings=tied))
    lazy.to_empty(device="cpu")
    torch.manual_seed(7)
    lazy.init_weights()
    eager = tiny_model(tie_embeddings=tied)
    torch.manual_seed(7)
    eager.init_weights()
    assert (lazy.lm_head.weight is lazy.embed.weight) == tied
    idx = torch.randint(0, 200, (1, 32))
    with torch.no_grad():
        torch.testing.assert_close(lazy(idx)[0], eager(idx)[0], rtol=0, atol=0)


def test_zero_init_proj_zeroes_only_the_residual_projections_and_blocks_start_as_identity():
    assert ModelConfig().zero_init_proj  # the default (docs/recipe.md)
    drawn, zero = tiny_model(tie_embeddings=False), tiny_model(tie_embeddings=False, zero_init_proj=True)
    projections = ("attn.proj.weight", "mlp.fc2_weight")
    for (name, p), q in zip(drawn.named_parameters(), zero.parameters()):
        if name.endswith(projections):
            assert not q.any(), name
        else:  # the same draws as without the flag
            assert torch.equal(p, q), name
    idx = torch.randint(200, (2, 16))
    with torch.no_grad():
        logits, _ = zero(idx)
        expected = zero.lm_head(zero.norm(zero.embed(idx)))
    torch.testing.assert_close(logits, expected)


@pytest.mark.parametrize("gate", [False, True])
def test_zero_init_proj_is_not_part_of_the_exported_architecture(gate):
    import hf_layout
    plain, zero = tiny_config(attn_gate=gate), tiny_config(zero_init_proj=True, attn_gate=gate)
    assert hf_layout.hf_config(zero, eot=199) == hf_layout.hf_config(plain, eot=199)
    assert hf_layout.config_from_hf(hf_layout.hf_config(plain, eot=199)) == zero  # an import takes the default init


# ----------------------------------------------------------------------------- recipe toggles (docs/recipe.md)

ALL_TOGGLES = dict(mlp="relu2", logit_softcap=3.0, value_embeds=1, unet_skips=True, attn_gate=True, smear=True,
                   bigram_embed=64, embed_skips=True)


@pytest.mark.parametrize("toggles", [{}, ALL_TOGGLES], ids=["off", "all-on"])
def test_toggles_param_count_numels_and_flops_follow_the_model(toggles):
    model = tiny_model(n_layer=3, tie_embeddings=False, **toggles)
    c = model.config
    assert param_numels(c) == {n: p.numel() for n, p in model.named_parameters()}
    assert param_count(c) == model.num_params()
    lookups = sum(p.numel() for n, p in model.named_parameters()
                  if p.ndim == 1 or n.startswith(("embed", "value_", "bigram_")))
    assert flops_per_token(c, 32) == 6 * (model.num_params() - lookups) + 12 * 3 * 8 * 16 * 32


def test_the_default_toggles_are_the_gate_and_the_look_backs_and_toggles_are_named_by_their_flags():
    assert ModelConfig().toggles_on() == ["--attn-gate", "--smear", "--bigram-embed 50304"]
    assert tiny_config().toggles_on() == []
    assert tiny_config(**ALL_TOGGLES).toggles_on() == [
        "--mlp relu2", "--logit-softcap 3.0", "--value-embeds 1", "--unet-skips", "--attn-gate", "--smear",
        "--bigram-embed 64", "--embed-skips"]


def test_toggles_say_how_to_get_back_to_qwen3_and_old_records_were_qwen3():
    assert tiny_config(**ALL_TOGGLES).qwen3_flags() == (
        "--mlp swiglu --logit-softcap 0 --value-embeds 0 --no-unet-skips --no-attn-gate --no-smear --bigram-embed 0 "
        "--no-embed-skips")
    on = tiny_config(mlp="relu2", value_embeds=1, attn_gate=True)
    assert on.qwen3_flags(model_module.PLAIN_BACKEND_TOGGLES) == "--value-embeds 0"
    record = dataclasses.asdict(tiny_config(**ALL_TOGGLES))
    assert ModelConfig.from_record(record) == tiny_config(**ALL_TOGGLES)
    older = {k: v for k, v in record.items() if k not in model_module.QWEN3_VALUES}  # written before the toggles
    assert ModelConfig.from_record(older).toggles_on() == []


def test_toggles_state_dict_round_trip_restores_every_new_parameter():
    import io
    model = tiny_model(seed=0, n_layer=3, **ALL_TOGGLES)
    with torch.no_grad():  # move the new parameters off their init, so a reload that skipped them would show
        for name, p in model.named_parameters():
            if name.startswith(("value_embed", "unet_", "smear_", "bigram_", "embed_skip")) or \
                    name.endswith("gate_weight"):
                p.add_(torch.randn_like(p))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    other = tiny_model(seed=1, n_layer=3, **ALL_TOGGLES)
    other.load_state_dict(torch.load(buffer))
    idx = torch.randint(0, 200, (2, 16))
    torch.testing.assert_close(other(idx)[0], model(idx)[0], rtol=0, atol=0)


def test_logit_softcap_caps_logits_and_the_fused_loss_matches_the_capped_reference():
    model = tiny_model(logit_softcap=0.5)  # far below the raw logits' range, so the cap bites
    model.loss_chunk_tokens = 7
    idx, targets = torch.randint(0, 200, (2, 32)), targets_with_ignored()
    logits = model(idx)[0]
    assert logits.abs().max() < 0.5
    raw = model.lm_head(model.norm(model.embed(idx)))  # any logits: soft_cap is cap * tanh(z / cap)
    torch.testing.assert_close(model_module.soft_cap(raw, 0.5), 0.5 * torch.tanh(raw / 0.5))
    expected, expected_grads = loss_and_grads(model, lambda: reference_loss(model, idx, targets))
    loss, grads = loss_and_grads(model, lambda: model(idx, targets)[1])
    torch.testing.assert_close(loss, expected)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad():
        per_token = model(idx, targets, reduction="none")[1]
        expected_tokens = F.cross_entropy(model(idx)[0].flatten(0, 1), targets.flatten(), reduction="none")
    torch.testing.assert_close(per_token.flatten(), expected_tokens)


def test_logit_softcap_applies_under_the_kv_cache():
    model = tiny_model(logit_softcap=0.5)
    idx = torch.randint(0, 200, (1, 8))
    cache = model_module.KVCache(model.config, batch_size=1)
    with torch.no_grad():
        pieces = torch.cat([model(idx[:, :5], cache=cache)[0], model(idx[:, 5:], cache=cache)[0]], dim=1)
        torch.testing.assert_close(pieces, model(idx)[0], rtol=1e-5, atol=1e-6)
    assert pieces.abs().max() < 0.5


@pytest.mark.parametrize("toggles", [dict(smear=True), dict(bigram_embed=64), dict(smear=True, bigram_embed=64)],
                         ids=["smear", "bigram", "both"])
def test_the_look_back_toggles_give_the_full_pass_under_the_kv_cache_in_pieces(toggles):
    """A piece fed after others looks back at the last token of the piece before it (KVCache.last), so
    decoding token by token gives the logits of one pass; a cache rewound to 0 starts a sequence again."""
    model = tiny_model(**toggles)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():  # off their zero init, so that the look-back shows in the logits
                p.normal_(std=0.5)
    idx = torch.randint(0, 200, (2, 8))
    cache = model_module.KVCache(model.config, batch_size=2)
    with torch.no_grad():
        full = model(idx)[0]
        pieces = [model(idx[:, :5], cache=cache)[0]] + [model(idx[:, t:t + 1], cache=cache)[0] for t in range(5, 8)]
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-6)
        cache.pos = 0
        torch.testing.assert_close(model(idx[:, 4:], cache=cache)[0], model(idx[:, 4:])[0], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(model(idx[:, 4:])[0][:, 0], full[:, 4], atol=1e-3)  # it does look back


def test_smear_adds_each_previous_embedding_gated_at_one_half_at_init():
    model = tiny_model(smear=True)
    assert model.smear_weight.shape == (1, 64) and not model.smear_weight.any()
    idx = torch.randint(0, 200, (2, 16))
    with torch.no_grad():
        e = model.embed(idx)
        torch.testing.assert_close(model.embed_inputs(idx), e + 0.5 * torch.cat([torch.zeros_like(e[:, :1]),
                                                                                 e[:, :-1]], dim=1))
    _, grads = loss_and_grads(model, lambda: model(idx, idx)[1])
    assert grads["smear_weight"].abs().sum() > 0


def test_bigram_rows_hash_each_pair_and_keep_the_last_row_for_a_first_token():
    idx = torch.tensor([[5, 7, 5, 7, 9], [7, 5, 7, 9, 9]])
    previous = model_module.previous_tokens(idx)
    assert previous.tolist() == [[-1, 5, 7, 5, 7], [-1, 7, 5, 7, 9]]
    assert model_module.previous_tokens(idx, before=torch.tensor([[3], [4]]))[:, 0].tolist() == [3, 4]
    rows = model_module.bigram_rows(previous, idx, 64)
    assert rows[:, 0].tolist() == [63, 63] and bool((rows[:, 1:] < 63).all()) and bool((rows >= 0).all())
    assert rows[0, 1] == rows[0, 3] == rows[1, 2]  # the pair (5, 7) wherever it stands
    assert len({int(r) for r in rows[0, 1:3]}) == 2  # (5, 7) and (7, 5) are different pairs


def test_bigram_embed_starts_at_zero_and_trains_only_its_batch_rows():
    model = tiny_model(bigram_embed=64)
    idx = torch.randint(0, 200, (2, 16))
    assert model.bigram_embed.weight.shape == (64, 64) and not model.bigram_embed.weight.any()
    with torch.no_grad():
        torch.testing.assert_close(model.embed_inputs(idx), model.embed(idx))  # no change at init
    _, grads = loss_and_grads(model, lambda: model(idx, idx)[1])
    rows = model_module.bigram_rows(model_module.previous_tokens(idx), idx, 64).unique()
    touched = grads["bigram_embed.weight"].abs().sum(dim=1) > 0
    assert touched.nonzero().flatten().tolist() == rows.tolist()


def test_embed_skips_add_the_embedding_to_every_block_after_the_first():
    model = tiny_model(n_layer=3, embed_skips=True)
    assert model.embed_skip_weights.shape == (2,) and bool((model.embed_skip_weights == 1).all())
    with torch.no_grad():
        model.embed_skip_weights.copy_(torch.tensor([0.3, -0.7]))
    idx = torch.randint(0, 200, (2, 16))
    cos, sin = model.rope_cos[:16], model.rope_sin[:16]
    with torch.no_grad():
        e = model.embed(idx)
        x1 = model.blocks[0](e, cos, sin)
        x2 = model.blocks[1](x1 + 0.3 * e, cos, sin)
        x3 = model.blocks[2](x2 - 0.7 * e, cos, sin)
        torch.testing.assert_close(model(idx)[0], model.lm_head(model.norm(x3)))


def test_relu2_mlp_has_swiglus_parameters_and_computes_relu_squared():
    swiglu, relu2 = (ModelConfig(n_embd=768, n_head=12, mlp=kind) for kind in ("swiglu", "relu2"))
    assert relu2.resolved_ffn_dim == 3 * swiglu.resolved_ffn_dim // 2 == 3072
    assert param_count(relu2) == param_count(swiglu)
    assert flops_per_token(relu2, 1024) == flops_per_token(swiglu, 1024)
    model = tiny_model(mlp="relu2")  # ffn_dim 96 given: the hidden width as stated
    mlp = model.blocks[0].mlp
    assert mlp.fc1_weight.shape == (96, 64) and mlp.fc2_weight.shape == (64, 96)
    assert model.row_blocks()["blocks.0.mlp.fc1_weight"] == [96]
    x = torch.randn(2, 5, 64)
    normed = F.rms_norm(x, (64,), mlp.layer_norm_weight, mlp.eps)
    torch.testing.assert_close(mlp(x), F.linear(F.relu(F.linear(normed, mlp.fc1_weight)) ** 2, mlp.fc2_weight))


def test_value_embed_layers_pair_each_table_with_a_first_and_a_last_layer():
    assert model_module.value_embed_layers(tiny_config(n_layer=4, value_embeds=2)) == {0: 0, 1: 1, 2: 1, 3: 0}
    assert model_module.value_embed_layers(tiny_config(n_layer=3, value_embeds=2)) == {0: 0, 1: 1, 2: 0}
    assert model_module.value_embed_layers(tiny_config(n_layer=4)) == {}


def test_value_embeds_shapes_init_and_that_they_reach_the_values():
    model = tiny_model(n_layer=3, value_embeds=1)
    assert [tuple(t.weight.shape) for t in model.value_embeds] == [(256, 2 * 16)]  # the values' width
    assert 0.015 < model.value_embeds[0].weight.std() < 0.025
    torch.testing.assert_close(model.value_embed_lambdas.detach(), torch.ones(2))  # layers 0 and 2
    idx = torch.randint(0, 200, (2, 16))
    _, grads = loss_and_grads(model, lambda: model(idx, idx)[1])
    assert grads["value_embeds.0.weight"].abs().sum() > 0 and grads["value_embed_lambdas"].abs().min() > 0
    # With the scalars at 0 the model is the baseline with the same weights.
    baseline = tiny_model(n_layer=3)
    baseline.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        model.value_embed_lambdas.zero_()
    torch.testing.assert_close(model(idx)[0], baseline(idx)[0])


def test_unet_skips_add_first_half_outputs_into_the_mirrored_second_half():
    model = tiny_model(n_layer=5, unet_skips=True)
    assert model.unet_weights.shape == (2,) and bool((model.unet_weights == 1).all())
    with torch.no_grad():
        model.unet_weights.copy_(torch.tensor([0.3, -0.7]))
    idx = torch.randint(0, 200, (2, 16))
    cos, sin = model.rope_cos[:16], model.rope_sin[:16]
    with torch.no_grad():
        x0 = model.blocks[0](model.embed(idx), cos, sin)
        x1 = model.blocks[1](x0, cos, sin)
        x2 = model.blocks[2](x1, cos, sin)  # the middle block of an odd depth takes no skip
        x3 = model.blocks[3](x2 - 0.7 * x1, cos, sin)
        x4 = model.blocks[4](x3 + 0.3 * x0, cos, sin)
        expected = model.lm_head(model.norm(x4))
        torch.testing.assert_close(model(idx)[0], expected)
    _, grads = loss_and_grads(model, lambda: model(idx, idx)[1])
    assert grads["unet_weights"].abs().min() > 0


def test_attn_gate_starts_at_one_half_per_head_and_learns_per_head():
    gated = tiny_model(attn_gate=True)
    attn = gated.blocks[0].attn
    assert attn.gate_weight.shape == (8, 64) and not attn.gate_weight.any()
    plain = tiny_model()
    plain.load_state_dict(gated.state_dict(), strict=False)
    x = torch.randn(2, 16, 64)
    cos, sin = gated.rope_cos[:16], gated.rope_sin[:16]
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cos, sin), 0.5 * plain.blocks[0].attn(x, cos, sin))
    idx = torch.randint(0, 200, (2, 16))
    _, grads = loss_and_grads(gated, lambda: gated(idx, idx)[1])
    assert (grads["blocks.0.attn.gate_weight"].abs().sum(dim=1) > 0).all()  # every head's row learns


def test_te_backend_refuses_the_toggles_it_does_not_implement_in_one_line():
    class OtherBackend(model_module.Block):
        backend = "te"

    with pytest.raises(ValueError, match=r"^--value-embeds 1: not implemented for the te backend") as excinfo:
        GPT(tiny_config(**ALL_TOGGLES), block=OtherBackend)
    assert "\n" not in str(excinfo.value) and "add --value-embeds 0," in str(excinfo.value)
    taken = dict(ALL_TOGGLES, value_embeds=0)
    assert GPT(tiny_config(**taken), block=OtherBackend).backend == "te"


def test_head_init_zero_zeroes_only_an_untied_lm_head():
    model = tiny_model(tie_embeddings=False, head_init="zero")
    assert not model.lm_head.weight.any() and model.embed.weight.std() > 0.015
    assert not model(torch.randint(0, 200, (1, 8)))[0].any()  # uniform first predictions
    assert tiny_model(tie_embeddings=False).lm_head.weight.std() > 0.015
    with pytest.raises(ValueError, match="--head-init zero needs an untied lm_head"):
        tiny_config(head_init="zero", tie_embeddings=True).validate()


def test_bf16_activations_keep_the_residual_stream_in_bf16_and_the_loss_in_fp32():
    """GPT.activation_dtype (--activation-dtype bf16): under bf16 autocast every block takes and returns bf16 (the
    value embeddings' and skips' too), the loss is float32 and within bf16's error of the float32 stream's, the
    parameters and their gradients stay float32; compiled as one graph it is what eager gives."""
    cfg = ModelConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, max_seq_len=32, value_embeds=1,
                      unet_skips=True)
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), generator=torch.Generator().manual_seed(0))

    def run(activation_dtype, compiled=False):
        torch.manual_seed(0)
        model = GPT(cfg)
        model.activation_dtype = activation_dtype
        dtypes = []
        for block in model.blocks:
            block.register_forward_hook(lambda module, args, out: dtypes.append((args[0].dtype, out.dtype)))
        forward = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward(idx, idx)[1]
        loss.backward()
        return loss, dtypes, {n: p.grad for n, p in model.named_parameters()}, model

    loss32, dtypes32, _, _ = run(None)
    loss16, dtypes16, grads, model = run(torch.bfloat16)
    assert set(dtypes32) == {(torch.float32, torch.float32)} and set(dtypes16) == {(torch.bfloat16, torch.bfloat16)}
    assert loss16.dtype == torch.float32 and abs(loss16.item() - loss32.item()) < 0.02 * loss32.item()
    assert {p.dtype for p in model.parameters()} == {g.dtype for g in grads.values()} == {torch.float32}
    compiled_loss, _, compiled_grads, _ = run(torch.bfloat16, compiled=True)
    torch.testing.assert_close(compiled_loss, loss16, rtol=1e-3, atol=1e-3)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=2e-2, atol=2e-3, msg=name)
