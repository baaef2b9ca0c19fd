"""The transformers layouts (Qwen3, or Qwen3-Next for a gated model) as pure maps of weights and config.

The transformers layouts a model of ours is written in: pure maps between our state dict and config and
transformers' weight names and config.json, with the checks that a layout can hold a model. hf.py reads and
writes the directories.

A model without attention gates is transformers' Qwen3ForCausalLM, weight for weight. A model with them is
Qwen3NextForCausalLM configured as the same block plus an output gate: every layer full attention
(layer_types), every layer a dense SwiGLU MLP (mlp_only_layers, num_experts 0), the rotation over the whole
head (partial_rotary_factor 1). Two things differ in its weights:
- its RMSNorms multiply by 1 + w (zero-centred), so each norm weight is written as w - 1. That is exact in
  float32 only for w >= 0.5, so these few vectors are written in float64, where w - 1 is exact for any
  float32 w from 2**-29 to 2**52 in magnitude (or 0), and an export reads back bit for bit;
- its q_proj holds, head after head, the head's query rows and then its gate rows: the gate is elementwise,
  sigmoid(x W_q_gate) times each channel of the head's output. Our gate is one scalar per head, which is that
  gate with the head's row of W_g repeated over its head_dim channels. A Qwen3-Next model whose gate rows
  differ within a head has a gate ours cannot hold, and is refused.
A model with the smear or the bigram table (the default) is its layout's class from hf_look_back.py, which the
export carries: the same weights, plus look_back.smear_weight and look_back.bigram_embed.weight.
"""

import dataclasses
import itertools
import json
import math

import torch

from fp8 import te_to_plain_state_dict
from model import QWEN3_VALUES, VOCAB_MULTIPLE, ModelConfig
from sizing import block_shapes, outer_shapes, param_numels

QWEN3, QWEN3_NEXT = "qwen3", "qwen3_next"  # config.json's model_type of each layout
ARCHITECTURES = {QWEN3: "Qwen3ForCausalLM", QWEN3_NEXT: "Qwen3NextForCausalLM"}
# The look-back toggles: a model with either is its layout's class from hf_look_back.py, which the export
# carries (remote code), under the layout's model_type plus LOOK_BACK_SUFFIX.
LOOK_BACK_TOGGLES = ("smear", "bigram_embed")
LOOK_BACK_MODULE = "hf_look_back"
LOOK_BACK_SUFFIX = "_look_back"
# Recipe toggles that no layout holds: away from Qwen3's value (QWEN3_VALUES), a model cannot be exported.
# attn_gate is not among them: it picks the layout.
UNEXPORTABLE_TOGGLES = tuple(name for name in QWEN3_VALUES if name not in ("attn_gate", *LOOK_BACK_TOGGLES))

# Per-block weights that map one to one: our name -> the Hugging Face name under model.layers.{i}.
BLOCK_RENAMES = {
    "attn.qkv.layer_norm_weight": "input_layernorm.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "mlp.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.fc2_weight": "mlp.down_proj.weight",
}
# Our fused weights -> the Hugging Face weights stacked in them, in row order (under Qwen3-Next, q_proj also
# holds attn.gate_weight: gated_q_proj).
BLOCK_FUSED = {
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.fc1_weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
GATE = "attn.gate_weight"
TOP_RENAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "lm_head.weight": "lm_head.weight", "smear_weight": "look_back.smear_weight",
               "bigram_embed.weight": "look_back.bigram_embed.weight"}
# Our RMSNorm weights: Qwen3-Next stores each as w - 1.
NORMS = ("attn.qkv.layer_norm_weight", "attn.q_norm.weight", "attn.k_norm.weight", "mlp.layer_norm_weight",
         "norm.weight")
# config.json key for the tokenizer's vocabulary size; "vocab_size" is the padded one, the tensors' row count.
UNPADDED_VOCAB_KEY = "unpadded_vocab_size"
LAYER_PREFIX = "model.layers."
FULL_ATTENTION = "full_attention"
# The JSON type of each config.json entry config_from_hf reads (null counts as absent), checked so that a
# wrong one is a one-line error rather than a TypeError inside ModelConfig.
HF_CONFIG_TYPES = {
    "an integer": ("vocab_size", UNPADDED_VOCAB_KEY, "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                   "num_experts", "bigram_embed"),
    "a number": ("rms_norm_eps", "rope_theta", "partial_rotary_factor"),
    "true or false": ("tie_word_embeddings", "smear"),
    "an object": ("rope_parameters",),
    "a list": ("layer_types", "mlp_only_layers"),
}
JSON_TYPES = {"an integer": int, "a number": (int, float), "true or false": bool, "an object": dict, "a list": list}


def layout(config: ModelConfig) -> str:
    """The layout a model is exported in: Qwen3-Next's for a gated one, else Qwen3's."""
    return QWEN3_NEXT if config.attn_gate else QWEN3


def looks_back(config: ModelConfig) -> bool:
    """Whether the model has a look-back toggle on, so that its export is hf_look_back.py's class."""
    return bool(config.toggles_on(LOOK_BACK_TOGGLES))


def architecture(config: ModelConfig) -> str:
    """The transformers class an export of this model is (config.json's architectures)."""
    return ("LookBack" if looks_back(config) else "") + ARCHITECTURES[layout(config)]


def exportable_problem(config: ModelConfig) -> str | None:
    """Why no transformers layout holds this model (the toggles it has on, and the flags to train one that
    exports), or None."""
    toggles = config.toggles_on(UNEXPORTABLE_TOGGLES)
    if not toggles:
        return None
    return (f"{', '.join(toggles)}: neither Qwen3ForCausalLM nor Qwen3NextForCausalLM has such a part, so this "
            f"model cannot be exported (a model trained with {config.qwen3_flags(UNEXPORTABLE_TOGGLES)} can)")


def our_names(config: ModelConfig) -> list[str]:
    """Every parameter name of GPT(config) that a layout holds, in the state dict's order (a module's own
    parameters, such as smear_weight, before its submodules')."""
    names = (["smear_weight"] if config.smear else []) + ["embed.weight"]
    for i in range(config.n_layer):
        names += [f"blocks.{i}.{n}" for n in block_shapes(config)]
    return names + ["norm.weight", "lm_head.weight"] + (["bigram_embed.weight"] if config.bigram_embed else [])


def hf_names(name: str) -> tuple[str, ...]:
    """The Hugging Face weight(s) our parameter `name` holds, in row order (the gate: none of its own)."""
    if name in TOP_RENAMES:
        return (TOP_RENAMES[name],)
    _, i, rest = name.split(".", 2)
    prefix = f"{LAYER_PREFIX}{i}."
    if rest == GATE:
        return ()
    if rest in BLOCK_FUSED:
        return tuple(prefix + n for n in BLOCK_FUSED[rest])
    return (prefix + BLOCK_RENAMES[rest],)


def row_split(name: str, config: ModelConfig) -> list[int]:
    """Rows of each Hugging Face weight inside a fused weight of ours (q_proj's: the query rows alone)."""
    hd, ffn = config.resolved_head_dim, config.resolved_ffn_dim
    if name.endswith("attn.qkv.weight"):
        return [config.n_head * hd, config.n_kv_head * hd, config.n_kv_head * hd]
    return [ffn, ffn]


def model_names(config: ModelConfig) -> list[str]:
    """Every state-dict name of GPT(config): our_names plus the recipe toggles' parameters (a tied lm_head is
    in a state dict under both of its names)."""
    return [*param_numels(config), *(["lm_head.weight"] if config.tie_embeddings else [])]


def check_names(config: ModelConfig, state: dict) -> None:
    """ValueError (one line) unless state holds exactly the parameters of GPT(config), toggles' included."""
    expected = model_names(config)
    unknown = sorted(set(state) - set(expected))
    missing = [n for n in expected if n not in state]
    if unknown or missing:
        raise ValueError(f"weights do not match the model config: missing {missing[:3]}, unknown {unknown[:3]}")


def is_norm(name: str) -> bool:
    """Whether our parameter `name` is an RMSNorm weight (NORMS: no other parameter's name ends like one)."""
    return name.endswith(NORMS)


def gated_q_proj(query: torch.Tensor, gate: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Our query rows [H * hd, D] and per-head gate [H, D] -> Qwen3-Next's q_proj [H * 2 hd, D]: each head's
    hd query rows, then its gate row hd times."""
    heads, width = gate.shape
    rows = (query.view(heads, head_dim, width), gate[:, None].expand(heads, head_dim, width))
    return torch.cat(rows, dim=1).reshape(2 * heads * head_dim, width)


def split_gated_q_proj(q_proj: torch.Tensor, head_dim: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gated_q_proj's inverse: -> (query rows [H * hd, D], per-head gate [H, D]). ValueError (one line, naming
    the weight and head) where a head's gate rows are not all equal."""
    width = q_proj.shape[1]
    heads = q_proj.view(-1, 2, head_dim, width)
    gates = heads[:, 1]
    differs = (gates != gates[:, :1]).flatten(1).any(dim=1).nonzero()
    if len(differs):
        raise ValueError(f"{name}: the gate rows of head {differs[0].item()} differ: an elementwise gate, which a "
                         "model with one gate per head cannot hold")
    return heads[:, 0].reshape(-1, width), gates[:, 0]


def to_hf(config: ModelConfig, state: dict) -> dict:
    """Our state dict -> the layout's Hugging Face names (views where the layout keeps the tensor; Qwen3-Next's
    norms, w - 1 in float64, and q_proj are new). A tied lm_head is left out, as transformers does: it
    rebuilds it from the embedding."""
    state = te_to_plain_state_dict(state)
    check_names(config, state)
    gated = layout(config) == QWEN3_NEXT
    out = {}
    for name in our_names(config):
        targets = hf_names(name)
        if not targets or (name == "lm_head.weight" and config.tie_embeddings):
            continue
        tensor = state[name]
        if gated and is_norm(name):
            tensor = tensor.detach().double() - 1
        parts = list(tensor.split(row_split(name, config))) if len(targets) > 1 else [tensor]
        if gated and name.endswith("attn.qkv.weight"):
            parts[0] = gated_q_proj(parts[0], state[name.replace("qkv.weight", "gate_weight")],
                                    config.resolved_head_dim)
        out.update(zip(targets, parts))
    return out


def from_hf(config: ModelConfig, hf_state: dict) -> dict:
    """Hugging Face names of the config's layout -> our state dict. A tied lm_head is the embedding tensor
    itself. ValueError (one line) for a missing weight or, under Qwen3-Next, a gate that is not per head."""
    gated = layout(config) == QWEN3_NEXT
    out = {}
    for name in our_names(config):
        if name == "lm_head.weight" and config.tie_embeddings:
            out[name] = out["embed.weight"]
            continue
        sources = hf_names(name)
        if missing := [s for s in sources if s not in hf_state]:
            raise ValueError(f"Hugging Face weights lack {missing[0]}")
        parts = [hf_state[s] for s in sources]
        if gated and name.endswith("attn.qkv.weight"):
            parts[0], out[name.replace("qkv.weight", "gate_weight")] = split_gated_q_proj(
                parts[0], config.resolved_head_dim, sources[0])
        if sources:
            out[name] = torch.cat(parts) if len(parts) > 1 else parts[0]
        if gated and is_norm(name):
            out[name] = (out[name].double() + 1).float()
    return {name: out[name] for name in our_names(config)}  # the state dict's order, the gates in their place


def hf_shapes(config: ModelConfig) -> tuple[dict, dict]:
    """(the shape of each Hugging Face weight outside the layers, the shape of each one of a layer by its name
    under model.layers.{i}.), in the config's layout, by arithmetic on its sizes: nothing is built, whatever
    they claim."""
    top = {TOP_RENAMES[name]: shape for name, shape in outer_shapes(config).items()}
    layer = {}
    for name, shape in block_shapes(config).items():
        if name in BLOCK_FUSED:
            layer.update({hf: (rows, *shape[1:]) for hf, rows in zip(BLOCK_FUSED[name], row_split(name, config))})
        elif name != GATE:
            layer[BLOCK_RENAMES[name]] = shape
    if layout(config) == QWEN3_NEXT:
        q_proj = BLOCK_FUSED["attn.qkv.weight"][0]
        layer[q_proj] = (2 * layer[q_proj][0], config.n_embd)
    return top, layer


def _layer_and_name(name: str) -> tuple[int, str] | None:
    """"model.layers.{i}.{rest}" -> (i, rest); None for another name."""
    if not name.startswith(LAYER_PREFIX):
        return None
    index, _, rest = name[len(LAYER_PREFIX):].partition(".")
    return (int(index), rest) if index.isascii() and index.isdigit() and str(int(index)) == index else None


def check_hf_weights(config: ModelConfig, shapes: dict) -> None:
    """ValueError (one line) unless `shapes` (name -> shape, as a safetensors header has them) holds the Hugging
    Face weights of GPT(config) at their shapes (a tied lm_head may be there too: it is not read). Checked
    before anything is loaded or built, so that a mismatch is this line rather than a load_state_dict error,
    and by arithmetic: a config.json that claims 10**12 layers costs no more than the weights that are there."""
    top, layer = hf_shapes(config)

    def expected(name):
        if name in top:
            return top[name]
        found = _layer_and_name(name)
        return layer.get(found[1]) if found and found[0] < config.n_layer else None

    def in_order():  # walked lazily: it stops at the fourth missing name, past at most the weights present
        embed = TOP_RENAMES["embed.weight"]
        yield embed
        for i in range(config.n_layer):
            yield from (f"{LAYER_PREFIX}{i}.{name}" for name in layer)
        yield from (name for name in top if name != embed)

    def dims(shape):
        return "x".join(map(str, shape))

    missing = list(itertools.islice((name for name in in_order() if name not in shapes), 4))
    unknown = sorted(name for name in shapes if expected(name) is None and name != TOP_RENAMES["lm_head.weight"])
    wrong = [f"{name} {dims(shape)} (config: {dims(expected(name))})" for name, shape in sorted(shapes.items())
             if expected(name) is not None and tuple(shape) != expected(name)]
    problems = [f"{what} {', '.join(items[:3])}{', ...' if len(items) > 3 else ''}"
                for what, items in (("missing", missing), ("unknown", unknown), ("wrong shape", wrong)) if items]
    if problems:
        raise ValueError(f"weights do not match the config: {'; '.join(problems)}")


def hf_config(config: ModelConfig, eot: int) -> dict:
    """config.json for the config's layout. rope_parameters is transformers 5's form; the top-level rope_theta
    (and Qwen3-Next's partial_rotary_factor) is what transformers 4 and other readers (vLLM) look for."""
    kind = layout(config)
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if kind == QWEN3_NEXT:
        rope["partial_rotary_factor"] = 1.0
        shape = {"layer_types": [FULL_ATTENTION] * config.n_layer, "mlp_only_layers": list(range(config.n_layer)),
                 "num_experts": 0, "partial_rotary_factor": 1.0}
    else:
        shape = {"use_sliding_window": False, "sliding_window": None}
    look_back = {}
    if looks_back(config):
        name = f"{LOOK_BACK_MODULE}.{architecture(config)}"
        look_back = {"auto_map": {"AutoConfig": name.removesuffix("ForCausalLM") + "Config",
                                  "AutoModelForCausalLM": name},
                     "smear": config.smear, "bigram_embed": config.bigram_embed}
    return {
        "architectures": [architecture(config)],
        "model_type": kind + (LOOK_BACK_SUFFIX if look_back else ""),
        **look_back,
        "vocab_size": config.padded_vocab_size,
        UNPADDED_VOCAB_KEY: config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.resolved_ffn_dim,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": rope,
        "rope_theta": config.rope_theta,
        **shape,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    }


def check_json_types(d: dict, types: dict) -> None:
    """ValueError (one line) for the first entry of d that is not of its type in types ({type: keys})."""
    for kind, keys in types.items():
        for key in keys:
            value = d.get(key)
            # JSON's true and false are Python ints too, but not numbers here.
            if value is not None and (not isinstance(value, JSON_TYPES[kind])
                                      or isinstance(value, bool) != (kind == "true or false")):
                raise ValueError(f"{key} must be {kind}, got {json.dumps(value)}")
            # Python's json reads integers of any length and Infinity or NaN; no model size is either.
            if kind == "an integer" and value is not None and not -2**63 <= value < 2**63:
                raise ValueError(f"{key} must be a 64-bit integer, got {value}")
            if kind == "a number" and value is not None and not math.isfinite(value):
                raise ValueError(f"{key} must be a finite number, got {json.dumps(value)}")


def next_variant_problems(d: dict, rope: dict) -> list[str]:
    """What keeps a Qwen3-Next config.json from being the Qwen3 block plus a gate. Each check walks only the
    lists the file holds, never a range of the size it claims."""
    layers = d["num_hidden_layers"]
    types = d.get("layer_types")
    dense = d.get("mlp_only_layers") or []
    in_range = {i for i in dense if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers}
    # Qwen3-Next's own default is 0.25; null counts as absent, as everywhere in config.json.
    rotary = next((r for r in (rope.get("partial_rotary_factor"), d.get("partial_rotary_factor")) if r is not None),
                  0.25)
    problems = {
        "linear-attention layers (layer_types must be all full_attention)":
            types is None or len(types) != layers or any(t != FULL_ATTENTION for t in types),
        "mixture-of-experts layers (mlp_only_layers must list every layer, or num_experts be 0)":
            d.get("num_experts", 512) != 0 and len(in_range) != layers,
        f"partial rotary embeddings (partial_rotary_factor {rotary}, not 1)": rotary != 1,
    }
    return [what for what, bad in problems.items() if bad]


def config_from_hf(d: dict) -> ModelConfig:
    """ModelConfig from a Qwen3 or Qwen3-Next config.json dict, or its look-back variant's (hf_look_back.py);
    ValueError (one line) for a model this code cannot run."""
    model_type = d.get("model_type")
    kind = model_type.removesuffix(LOOK_BACK_SUFFIX) if isinstance(model_type, str) else None
    if kind not in ARCHITECTURES:
        known = [*ARCHITECTURES, *(k + LOOK_BACK_SUFFIX for k in ARCHITECTURES)]
        raise ValueError(f"model_type is {model_type!r}; only {', '.join(map(repr, known))} can be loaded")
    look_back = kind != model_type
    check_json_types(d, HF_CONFIG_TYPES)
    rope = d.get("rope_parameters") or {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0)}
    check_json_types(rope, {"a number": ("rope_theta", "partial_rotary_factor")})
    unsupported = [name for name, bad in {
        "attention_bias": d.get("attention_bias", False), "hidden_act": d.get("hidden_act", "silu") != "silu",
        "use_sliding_window": d.get("use_sliding_window", False), "rope_type": rope.get("rope_type") != "default",
    }.items() if bad]
    if kind == QWEN3_NEXT:
        unsupported += next_variant_problems(d, rope)
    if unsupported:
        raise ValueError(f"unsupported {ARCHITECTURES[kind]} variant: {', '.join(unsupported)}")
    vocab = d.get(UNPADDED_VOCAB_KEY, d["vocab_size"])
    toggles = {"attn_gate": kind == QWEN3_NEXT}
    if look_back:
        toggles.update(smear=bool(d.get("smear")), bigram_embed=d.get("bigram_embed") or 0)
    n_embd, n_head, ffn = d["hidden_size"], d["num_attention_heads"], d["intermediate_size"]
    config = ModelConfig(
        vocab_size=vocab, n_layer=d["num_hidden_layers"], n_head=n_head,
        n_kv_head=d.get("num_key_value_heads") or n_head, n_embd=n_embd,
        max_seq_len=d["max_position_embeddings"], rope_theta=float(rope["rope_theta"]),
        norm_eps=d.get("rms_norm_eps", 1e-6), tie_embeddings=d.get("tie_word_embeddings", False),
        **{**QWEN3_VALUES, **toggles},
    )
    # Explicit sizes only where they differ from the defaults, so an exported config comes back equal.
    head_dim = d.get("head_dim") or n_embd // n_head
    config = dataclasses.replace(
        config, head_dim=None if head_dim == config.resolved_head_dim else head_dim,
        ffn_dim=None if ffn == config.resolved_ffn_dim else ffn,
    )
    config.validate()
    if config.padded_vocab_size != d["vocab_size"]:
        raise ValueError(f"vocab_size {d['vocab_size']} is not {vocab} rounded up to a multiple of {VOCAB_MULTIPLE} "
                         f"({config.padded_vocab_size})")
    return config
