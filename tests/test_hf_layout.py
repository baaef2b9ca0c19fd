"""hf_layout.py: the maps between our state dict and transformers' Qwen3 and Qwen3-Next layouts, and the
configs each layout holds. tests/test_hf.py checks the written directories against transformers itself."""

import dataclasses

import pytest
import torch

from hf_layout import (QWEN3, QWEN3_NEXT, config_from_hf, exportable_problem, from_hf, gated_q_proj, hf_config, layout,
                       our_names, split_gated_q_proj, to_hf)
from model import GPT, QWEN3_VALUES, ModelConfig

TINY = ModelConfig(vocab_size=50257, n_layer=2, n_head=8, n_kv_head=2, n_embd=64, head_dim=16, ffn_dim=96,
                   max_seq_len=32, rope_theta=500.0, **QWEN3_VALUES)
LAYOUTS = {QWEN3: TINY, QWEN3_NEXT: dataclasses.replace(TINY, attn_gate=True)}


def random_model(config: ModelConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0 if p.ndim == 1 else 0.0, 0.5)
    return model


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("tied", [True, False])
def test_our_names_are_the_model_parameters(kind, tied):
    config = dataclasses.replace(LAYOUTS[kind], tie_embeddings=tied)
    assert layout(config) == kind
    assert our_names(config) == list(GPT(config).state_dict())


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("tied", [True, False])
def test_name_mapping_round_trips_bit_for_bit(kind, tied):
    model = random_model(dataclasses.replace(LAYOUTS[kind], tie_embeddings=tied))
    state = model.state_dict()
    theirs = to_hf(model.config, {**state, "blocks.0.attn.qkv._extra_state": torch.zeros(0)})
    assert ("lm_head.weight" in theirs) == (not tied)
    assert "model.layers.0.self_attn.k_proj.weight" in theirs and "model.layers.1.mlp.gate_proj.weight" in theirs
    back = from_hf(model.config, theirs)
    assert list(back) == list(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_qwen3_next_norms_are_zero_centred_in_float64_and_read_back_bit_for_bit():
    """w - 1 in float32 would round for w < 0.5 (0.1 - 1 has bits below float32's last at 0.9); float64 holds
    it exactly for every float32 w from 2**-29 up, and 0."""
    model = GPT(LAYOUTS[QWEN3_NEXT])
    awkward = torch.tensor([0.1, -3.0, 2.0 ** -29, 0.0, 1.0, 0.4999999, 123.456, -1e-6] * 2)
    with torch.no_grad():
        model.norm.weight.copy_(awkward.repeat(4))
    theirs = to_hf(model.config, model.state_dict())
    norm = theirs["model.norm.weight"]
    assert norm.dtype == torch.float64 and torch.equal(norm + 1, model.norm.weight.double())
    assert theirs["model.layers.0.self_attn.q_norm.weight"].dtype == torch.float64
    assert theirs["model.embed_tokens.weight"].dtype == torch.float32
    assert torch.equal(from_hf(model.config, theirs)["norm.weight"], model.norm.weight)
    assert not torch.equal((model.norm.weight - 1) + 1, model.norm.weight)  # what float32 would have lost


def test_the_gate_is_each_heads_row_repeated_after_its_query_rows():
    heads, hd, width = 3, 4, 5
    query, gate = torch.randn(heads * hd, width), torch.randn(heads, width)
    q_proj = gated_q_proj(query, gate, hd)
    per_head = q_proj.view(heads, 2, hd, width)
    assert torch.equal(per_head[:, 0].reshape(-1, width), query)
    assert torch.equal(per_head[:, 1], gate[:, None].expand(heads, hd, width))
    back_query, back_gate = split_gated_q_proj(q_proj, hd, "q_proj")
    assert torch.equal(back_query, query) and torch.equal(back_gate, gate)


def test_an_elementwise_gate_that_differs_within_a_head_is_refused_in_one_line():
    heads, hd, width = 3, 4, 5
    q_proj = gated_q_proj(torch.randn(heads * hd, width), torch.randn(heads, width), hd)
    q_proj[2 * hd + hd + 3, 1] += 1e-3  # head 1's last gate row
    with pytest.raises(ValueError) as e:
        split_gated_q_proj(q_proj, hd, "model.layers.0.self_attn.q_proj.weight")
    assert str(e.value) == ("model.layers.0.self_attn.q_proj.weight: the gate rows of head 1 differ: an elementwise "
                            "gate, which a model with one gate per head cannot hold")


def test_to_hf_rejects_mismatched_weights():
    model = GPT(TINY)
    state = model.state_dict()
    del state["blocks.1.attn.proj.weight"]
    with pytest.raises(ValueError, match="missing \\['blocks.1.attn.proj.weight'\\]"):
        to_hf(model.config, state)


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("overrides", [{}, {"head_dim": None, "ffn_dim": None, "n_head": 4, "tie_embeddings": False}])
def test_config_round_trips(kind, overrides):
    config = dataclasses.replace(LAYOUTS[kind], **overrides)
    written = hf_config(config, eot=50256)
    assert written["model_type"] == kind and config_from_hf(written) == config


@pytest.mark.parametrize("kind, change, words", [
    (QWEN3, {"model_type": "llama"},
     "model_type is 'llama'; only 'qwen3', 'qwen3_next', 'qwen3_look_back', 'qwen3_next_look_back' can be loaded"),
    (QWEN3, {"attention_bias": True}, "unsupported Qwen3ForCausalLM variant: attention_bias"),
    (QWEN3, {"hidden_act": "gelu"}, "variant: hidden_act"),
    (QWEN3, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "variant: rope_type"),
    (QWEN3_NEXT, {"layer_types": ["linear_attention", "full_attention"]},
     "unsupported Qwen3NextForCausalLM variant: linear-attention layers (layer_types must be all full_attention)"),
    (QWEN3_NEXT, {"layer_types": None}, "linear-attention layers"),
    (QWEN3_NEXT, {"layer_types": ["full_attention"] * 3}, "linear-attention layers"),
    (QWEN3_NEXT, {"mlp_only_layers": [0], "num_experts": 512}, "mixture-of-experts layers (mlp_only_layers must "
                                                               "list every layer, or num_experts be 0)"),
    (QWEN3_NEXT, {"mlp_only_layers": [0, 7], "num_experts": None}, "mixture-of-experts layers"),
    (QWEN3_NEXT, {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}},
     "partial rotary embeddings (partial_rotary_factor 0.25, not 1)"),
    (QWEN3_NEXT, {"rope_parameters": None, "partial_rotary_factor": None}, "partial_rotary_factor 0.25"),
    (QWEN3_NEXT, {"mlp_only_layers": "all"}, 'mlp_only_layers must be a list, got "all"'),
])
def test_config_from_hf_rejects_what_we_cannot_run_in_one_line(kind, change, words):
    with pytest.raises(ValueError) as e:
        config_from_hf({**hf_config(LAYOUTS[kind], eot=50256), **change})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_qwen3_next_config_with_dense_layers_by_num_experts_alone_loads():
    written = hf_config(LAYOUTS[QWEN3_NEXT], eot=50256)
    assert config_from_hf({**written, "mlp_only_layers": []}) == LAYOUTS[QWEN3_NEXT]  # num_experts 0
    assert config_from_hf({**written, "num_experts": 512}) == LAYOUTS[QWEN3_NEXT]  # every layer listed


def test_only_toggles_no_layout_holds_keep_a_model_from_export():
    assert exportable_problem(LAYOUTS[QWEN3]) is None and exportable_problem(LAYOUTS[QWEN3_NEXT]) is None
    assert exportable_problem(ModelConfig()) is None  # the default model: gated
    problem = exportable_problem(dataclasses.replace(TINY, unet_skips=True, mlp="relu2", attn_gate=True))
    assert problem == ("--mlp relu2, --unet-skips: neither Qwen3ForCausalLM nor Qwen3NextForCausalLM has such a "
                       "part, so this model cannot be exported (a model trained with --mlp swiglu --no-unet-skips "
                       "can)")
