"""Hugging Face import and export: weights between our checkpoints and transformers' Qwen3ForCausalLM layout.
The command line exports; train.py --from-hf and sample.py --hf import (load_hf).

    python hf.py --ckpt out/ckpt_00000150.pt --out hf_model   # export: write a transformers directory
    python hf.py --ckpt out --out hf_model                    # a run directory: its newest good checkpoint
    python sample.py --hf hf_model                            # import: read it back (load_hf)

The directory holds config.json, model.safetensors (float32, the vocabulary padded as in training),
generation_config.json (the document separator as bos/eos, the padding ids suppressed so transformers'
generate never picks them), tokenizer_note.txt, and the transformers tokenizer files of the tokenizer the
model was trained with (by default the one its training data's data.json records, model_tokenizer): for
GPT-2, vocab.json, merges.txt, tokenizer_config.json, and tokenizer.json for the fast tokenizer, rebuilt
offline from tiktoken's ranks; for a Hugging Face tokenizer, the tokenizer.json the shards were made with and
a tokenizer_config.json. Every file gets the mode open() gives (0644 under the usual umask).

The target must be empty or not yet exist; --overwrite allows a non-empty one, and replaces the earlier
export's files there (a stale shard index included; other files stay). The new files are written aside and
moved in only once all of them are: a failed export leaves the directory as it was.

load_hf(DIR) reads such a directory, or any bias-free Qwen3ForCausalLM directory, back into our names.
"""

import argparse
import dataclasses
import glob
import itertools
import json
import math
import os
import shutil
import sys
import tempfile

import torch

import checkpoint
from cli import ArgumentParser, UsageError, closed_stdout, first_line, plural, report_error
from checkpoint import CheckpointError
from data import data_tokenizer
from fp8 import te_to_plain_state_dict
from mixture import parse_data, record_dir
from model import GPT, QWEN3_VALUES, VOCAB_MULTIPLE, ModelConfig
from sizing import block_shapes, outer_shapes, param_numels
from tokenizer import (TOKENIZER_FILE, DataError, HFTokenizer, TiktokenTokenizer, Tokenizer, check_model_vocab,
                       load_tokenizer, write_gpt2_tokenizer, write_hf_tokenizer)

# Per-block weights that map one to one: our name -> the Hugging Face name under model.layers.{i}.
BLOCK_RENAMES = {
    "attn.qkv.layer_norm_weight": "input_layernorm.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "mlp.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.fc2_weight": "mlp.down_proj.weight",
}
# Our fused weights -> the Hugging Face weights stacked in them, in row order.
BLOCK_FUSED = {
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.fc1_weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
BLOCK_PARAMS = ("attn.qkv.layer_norm_weight", "attn.qkv.weight", "attn.q_norm.weight", "attn.k_norm.weight",
                "attn.proj.weight", "mlp.layer_norm_weight", "mlp.fc1_weight", "mlp.fc2_weight")  # module order
TOP_RENAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "lm_head.weight": "lm_head.weight"}
# config.json key for the tokenizer's vocabulary size; "vocab_size" is the padded one, the tensors' row count.
UNPADDED_VOCAB_KEY = "unpadded_vocab_size"
LAYER_PREFIX = "model.layers."
# The JSON type of each config.json entry config_from_hf reads (null counts as absent), checked so that a
# wrong one is a one-line error rather than a TypeError inside ModelConfig.
HF_CONFIG_TYPES = {
    "an integer": ("vocab_size", UNPADDED_VOCAB_KEY, "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"),
    "a number": ("rms_norm_eps", "rope_theta"),
    "true or false": ("tie_word_embeddings",),
    "an object": ("rope_parameters",),
}
JSON_TYPES = {"an integer": int, "a number": (int, float), "true or false": bool, "an object": dict}
# What an export writes, and what transformers would read along with it (another exporter's sharded weights,
# a fast tokenizer): an export into a directory holding any of these must replace them all, or refuse.
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "tokenizer_note.txt", "vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json")
SHARD_PATTERN = "model-*.safetensors"
STAGING_PREFIX = ".export-"  # export_hf writes here inside the target, then moves the files out


def our_names(config: ModelConfig) -> list[str]:
    """Every parameter name of GPT(config), in the contract's order."""
    names = ["embed.weight"]
    for i in range(config.n_layer):
        names += [f"blocks.{i}.{n}" for n in BLOCK_PARAMS]
    return names + ["norm.weight", "lm_head.weight"]


def hf_names(name: str) -> tuple[str, ...]:
    """The Hugging Face weight(s) our parameter `name` holds, in row order."""
    if name in TOP_RENAMES:
        return (TOP_RENAMES[name],)
    _, i, rest = name.split(".", 2)
    prefix = f"model.layers.{i}."
    if rest in BLOCK_FUSED:
        return tuple(prefix + n for n in BLOCK_FUSED[rest])
    return (prefix + BLOCK_RENAMES[rest],)


def row_split(name: str, config: ModelConfig) -> list[int]:
    """Rows of each Hugging Face weight inside a fused weight of ours."""
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


def to_hf(config: ModelConfig, state: dict) -> dict:
    """Our state dict -> Hugging Face names (views, not copies). A tied lm_head is left out, as transformers
    does: it rebuilds it from the embedding."""
    state = te_to_plain_state_dict(state)
    check_names(config, state)
    out = {}
    for name in our_names(config):
        if name == "lm_head.weight" and config.tie_embeddings:
            continue
        targets = hf_names(name)
        parts = state[name].split(row_split(name, config)) if len(targets) > 1 else (state[name],)
        out.update(zip(targets, parts))
    return out


def hf_shapes(config: ModelConfig) -> tuple[dict, dict]:
    """(the shape of each Hugging Face weight outside the layers, the shape of each one of a layer by its name
    under model.layers.{i}.), by arithmetic on the config's sizes: nothing is built, whatever they claim."""
    top = {TOP_RENAMES[name]: shape for name, shape in outer_shapes(config).items()}
    layer = {}
    for name, shape in block_shapes(config).items():
        if name in BLOCK_FUSED:
            layer.update({hf: (rows, *shape[1:]) for hf, rows in zip(BLOCK_FUSED[name], row_split(name, config))})
        else:
            layer[BLOCK_RENAMES[name]] = shape
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


def from_hf(config: ModelConfig, hf_state: dict) -> dict:
    """Hugging Face names -> our state dict. A tied lm_head is the embedding tensor itself."""
    out = {}
    for name in our_names(config):
        if name == "lm_head.weight" and config.tie_embeddings:
            out[name] = out["embed.weight"]
            continue
        sources = hf_names(name)
        missing = [s for s in sources if s not in hf_state]
        if missing:
            raise ValueError(f"Hugging Face weights lack {missing[0]}")
        out[name] = torch.cat([hf_state[s] for s in sources]) if len(sources) > 1 else hf_state[sources[0]]
    return out


def hf_config(config: ModelConfig, eot: int) -> dict:
    """config.json for Qwen3ForCausalLM. rope_parameters is transformers 5's form; the top-level rope_theta
    is what transformers 4 and other readers (vLLM) look for."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
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
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
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


def config_from_hf(d: dict) -> ModelConfig:
    """ModelConfig from a Qwen3 config.json dict; raises ValueError for a model this code cannot run."""
    if d.get("model_type") != "qwen3":
        raise ValueError(f"model_type is {d.get('model_type')!r}, only 'qwen3' can be loaded")
    check_json_types(d, HF_CONFIG_TYPES)
    rope = d.get("rope_parameters") or {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0)}
    check_json_types(rope, {"a number": ("rope_theta",)})
    unsupported = {
        "attention_bias": d.get("attention_bias", False), "hidden_act": d.get("hidden_act", "silu") != "silu",
        "use_sliding_window": d.get("use_sliding_window", False), "rope_type": rope.get("rope_type") != "default",
    }
    if any(unsupported.values()):
        raise ValueError(f"unsupported Qwen3 variant: {', '.join(k for k, v in unsupported.items() if v)}")
    vocab = d.get(UNPADDED_VOCAB_KEY, d["vocab_size"])
    n_embd, n_head, ffn = d["hidden_size"], d["num_attention_heads"], d["intermediate_size"]
    config = ModelConfig(
        vocab_size=vocab, n_layer=d["num_hidden_layers"], n_head=n_head,
        n_kv_head=d.get("num_key_value_heads") or n_head, n_embd=n_embd,
        max_seq_len=d["max_position_embeddings"], rope_theta=float(rope["rope_theta"]),
        norm_eps=d.get("rms_norm_eps", 1e-6), tie_embeddings=d.get("tie_word_embeddings", False), **QWEN3_VALUES,
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


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ValueError("the safetensors package is needed: pip install safetensors") from None
    return safetensors.torch


def read_checkpoint(path: str) -> tuple[ModelConfig, dict]:
    """A train.py checkpoint's model config and weights (TE `_extra_state` entries dropped), from a single
    file or a sharded DCP directory. Raises CheckpointError for a missing, corrupt or foreign one."""
    def config_of(meta):
        try:
            return ModelConfig.from_record(meta["model_config"])
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: unreadable model_config ({e})") from None

    # A DCP directory is read into the tensors it is given: the model's own, no optimizer.
    meta, tensors = checkpoint.load(path, lambda meta: {"model": GPT(config_of(meta)).state_dict()})
    return config_of(meta), te_to_plain_state_dict(tensors["model"])


def is_run_directory(path: str) -> bool:
    """A directory that is not itself a sharded checkpoint (no meta, checksums or DCP metadata): a train.py
    --out-dir, whose checkpoints are its ckpt_N entries."""
    own = (checkpoint.META_FILE, checkpoint.CHECKSUMS_FILE, ".metadata")
    return os.path.isdir(path) and not any(os.path.exists(os.path.join(path, name)) for name in own)


def read_newest_checkpoint(run_dir: str, warn) -> tuple[str, ModelConfig, dict]:
    """(path, config, weights) of the newest checkpoint of a train.py --out-dir that verifies and loads, either
    format. As a resume does (checkpoint.load_newest), each damaged or foreign one on the way is reported
    through warn and skipped, never deleted. CheckpointError (one line) when none is left."""
    newest = checkpoint.load_newest(run_dir, read_checkpoint, warn)
    if newest is not None:
        return newest
    candidates = checkpoint.list_checkpoints(run_dir)
    found = {0: "it holds no checkpoint", 1: "its one checkpoint does not verify and load"}.get(
        len(candidates), f"none of its {len(candidates)} checkpoints verifies and loads")
    best = _verified_best(run_dir)
    hint = f"; its best-val-loss checkpoint {best} verifies: pass that path" if best else ""
    raise CheckpointError(f"{run_dir}: {found} (ckpt_N.pt files or ckpt_N directories){hint}")


def read_ckpt(path: str, report) -> tuple[ModelConfig, dict]:
    """(config, weights) of a --ckpt: a checkpoint (file or sharded directory), or a run directory (a train.py
    --out-dir), whose newest checkpoint that verifies and loads is taken, as --resume would (damaged ones are
    reported and skipped); which one it took is said through report."""
    if not is_run_directory(path):
        return read_checkpoint(path)
    found, config, state = read_newest_checkpoint(path, report)
    report(f"checkpoint {found} (step {checkpoint.checkpoint_step(found)}): the newest good one in {path}")
    return config, state


def _verified_best(run_dir: str) -> str | None:
    """The run's best-val-loss checkpoint (checkpoint.best_path), if there is one and it verifies: kept apart
    from the ckpt_N ones, it may be all that is left of a run stopped before its first regular checkpoint."""
    for sharded in (False, True):
        path = checkpoint.best_path(run_dir, sharded)
        try:
            checkpoint.verify(path)
            return path
        except CheckpointError:
            continue
    return None


def read_json_object(path: str) -> dict:
    """A JSON file that must hold an object. ValueError (one line) naming the file, and for a syntax error the
    line (json's message has it)."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError; nesting too deep
        raise ValueError(f"{path}: not valid JSON: {first_line(e)}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: not a JSON object")
    return d


def weight_files(directory: str) -> list[str]:
    """The paths of a Hugging Face directory's weights: the files its model.safetensors.index.json maps the
    tensors to, or model.safetensors. ValueError (one line, naming the index) for an index of another shape."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.isfile(index_path):
        return [os.path.join(directory, "model.safetensors")]
    weight_map = read_json_object(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path}: weight_map must be an object of tensor names to file names")
    return [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]


def _read_safetensors(path: str, read):
    """read(path), a safetensors file's error as one line naming it."""
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found")
    try:
        return read(path)
    except Exception as e:  # safetensors' own error type differs between its versions
        raise ValueError(f"cannot read {path}: {first_line(e)}") from None


def _header_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from a safetensors file's header alone."""
    with _safetensors().safe_open(path, framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def load_hf(directory: str) -> tuple[ModelConfig, dict]:
    """A Hugging Face Qwen3ForCausalLM directory -> (ModelConfig, our state dict). The weights' names and
    shapes are checked against config.json from the files' headers before any tensor is read."""
    load_file = _safetensors().load_file
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{directory} is not a Hugging Face model directory (no config.json)")
    d = read_json_object(config_path)
    try:
        config = config_from_hf(d)
    except KeyError as e:
        raise ValueError(f"{config_path} lacks {e}") from None
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    paths = weight_files(directory)
    shapes = {}
    for path in paths:
        shapes.update(_read_safetensors(path, _header_shapes))
    try:
        check_hf_weights(config, shapes)
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None
    hf_state = {}
    for path in paths:
        hf_state.update(_read_safetensors(path, load_file))
    return config, from_hf(config, hf_state)


# ----------------------------------------------------------------------------- tokenizer files


def tokenizer_note(enc: Tokenizer, wrote_files: bool, wrote_fast: bool = True) -> str:
    padding = "The embedding has extra rows that pad the vocabulary to a multiple of 128; no token uses them.\n"
    if isinstance(enc, HFTokenizer):
        return (f"Tokenizer: {enc.name} (sha256 {enc.sha256}), document separator {enc.separator} = {enc.eot}.\n"
                "tokenizer.json is the file the training shards were made with; AutoTokenizer.from_pretrained(DIR)\n"
                "loads it and gives the same ids, except on text that holds a special token's text, such as the\n"
                f"separator {enc.separator}: transformers encodes that as the special token, the shards as text;\n"
                "AutoTokenizer.from_pretrained(DIR, split_special_tokens=True) gives the shards' ids there too.\n"
                + padding)
    if not wrote_files:
        return (f"Tokenizer: tiktoken encoding {enc.name!r}; no transformers tokenizer files were written for it.\n"
                + padding)
    fast = ("tokenizer.json (the fast tokenizer) was built from the same vocabulary and merges.\n" if wrote_fast else
            "tokenizer.json was not written: the exporting machine lacked the tokenizers package; transformers\n"
            "builds the fast tokenizer from vocab.json and merges.txt when it loads them.\n")
    return ("Tokenizer: GPT-2 byte-level BPE (tiktoken r50k_base), end of text <|endoftext|> = 50256.\n"
            "vocab.json and merges.txt were rebuilt from tiktoken's ranks; AutoTokenizer.from_pretrained(DIR)\n"
            "loads them and gives the same ids as tiktoken.get_encoding('r50k_base').encode_ordinary, which made\n"
            "the shards, except on text that holds <|endoftext|>: transformers encodes that as the token 50256;\n"
            "AutoTokenizer.from_pretrained(DIR, split_special_tokens=True) gives the shards' ids there too.\n"
            + fast + padding)


def trained_config(path: str) -> dict | None:
    """The train.py config that the checkpoint at path recorded (its meta's train_config; for a run directory,
    that of its newest checkpoint whose meta reads), {} when it has none; None for an hf.py directory.
    Only the meta is read: a file's tensors are memory-mapped, not loaded."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return None

    def meta(ckpt):
        file = os.path.join(ckpt, checkpoint.META_FILE) if os.path.isdir(ckpt) else ckpt
        try:
            return (torch.load(file, map_location="cpu", weights_only=True, mmap=True),)
        except Exception as e:
            raise CheckpointError(f"{file}: {first_line(e)}") from None

    if is_run_directory(path):
        found = checkpoint.load_newest(path, meta, warn=lambda line: None)
    else:
        found = (path, *meta(path))
    return (found[1].get("train_config") if found else None) or {}


def model_tokenizer(path: str) -> Tokenizer | None:
    """The tokenizer the model at path was trained with, as far as something records it: an hf.py directory's
    tokenizer.json (its tokenizer_config.json names the separator), or for a train.py checkpoint or run
    directory the tokenizer of the data it trained on (its recorded --data's data.json; GPT-2's for the
    default corpus). None when nothing does: a directory without tokenizer.json, shards without data.json, a
    data directory that is not there any more."""
    config = trained_config(path)
    if config is None:
        return load_tokenizer(path) if os.path.isfile(os.path.join(path, TOKENIZER_FILE)) else None
    data = (config.get("data") or {}).get("data", "")
    if data is None:  # the default corpus
        return load_tokenizer("gpt2")
    try:
        present = [s for s in parse_data(data) if os.path.isdir(s.dir)] if data else []
    except UsageError:  # a --data that a run took parses, unless its config was edited by hand
        return None
    return data_tokenizer(record_dir(present)) if present else None  # a mixture's sources share one tokenizer


# ----------------------------------------------------------------------------- export


def export_files(out_dir: str) -> list[str]:
    """The paths of out_dir that belong to an earlier export (EXPORT_FILES and weight shards)."""
    paths = [os.path.join(out_dir, name) for name in EXPORT_FILES]
    shards = glob.glob(os.path.join(glob.escape(out_dir), SHARD_PATTERN))
    return [p for p in paths if os.path.exists(p)] + sorted(shards)


def check_target(out_dir: str, overwrite: bool) -> None:
    """ValueError (one line) for a directory the export must not write into: a file, or a directory that is
    not empty, unless overwrite. A stray file beside a model confuses its readers (another exporter's shard
    index is read before model.safetensors), and --out . by mistake should not litter a source tree."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"{out_dir} exists and is not a directory")
    held = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    if held and not overwrite:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ValueError(f"{out_dir} is not empty ({shown}); pass --overwrite to replace an earlier export there "
                         "(other files stay), or choose another directory")


def _file_mode() -> int:
    """The mode open() gives a new file: 0o666 less the umask. Reading the umask means setting it: it is put
    back at once."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def replace_export(staging: str, out_dir: str) -> None:
    """Move a finished export from staging into out_dir: first remove what an earlier export left that this
    one does not replace (a shard index and its shards, say, or a staging directory of an export that was
    killed), then rename each new file over its old name."""
    names = set(os.listdir(staging))
    leftovers = glob.glob(os.path.join(glob.escape(out_dir), STAGING_PREFIX + "*"))
    for path in export_files(out_dir) + leftovers:
        if os.path.samefile(path, staging) or os.path.basename(path) in names:
            continue
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    for name in sorted(names):
        os.replace(os.path.join(staging, name), os.path.join(out_dir, name))


def write_export(config: ModelConfig, weights: dict, enc: Tokenizer, directory: str) -> None:
    """Every file of the export (see the module docstring) into directory."""
    path = os.path.join(directory, "model.safetensors")
    _safetensors().save_file(weights, path, metadata={"format": "pt"})
    os.chmod(path, _file_mode())  # safetensors writes a private (0600) temporary file and renames it
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(config, enc.eot), f, indent=2)
    generation = {"bos_token_id": enc.eot, "eos_token_id": enc.eot,
                  "suppress_tokens": list(range(config.vocab_size, config.padded_vocab_size))}
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
    gpt2 = isinstance(enc, TiktokenTokenizer) and enc.encoding.name == "r50k_base"
    fast = write_gpt2_tokenizer(enc.encoding, directory, config.max_seq_len) if gpt2 else False
    if isinstance(enc, HFTokenizer):
        write_hf_tokenizer(enc, directory, config.max_seq_len)
    with open(os.path.join(directory, "tokenizer_note.txt"), "w", encoding="utf-8") as f:
        f.write(tokenizer_note(enc, gpt2, fast))


def export_hf(config: ModelConfig, state: dict, out_dir: str, tokenizer: Tokenizer | None = None,
              overwrite: bool = False) -> None:
    """Write a Qwen3ForCausalLM directory (see the module docstring) for a model trained with `tokenizer`
    (None: GPT-2's).

    A non-empty out_dir is an error unless overwrite (check_target). The files are written into a staging
    directory inside out_dir (the same filesystem, so each move is a rename) and moved into place only once
    all of them are written: a failed export leaves an earlier one as it was. With overwrite, the earlier
    export's files (a stale shard index included) are removed then; other files stay."""
    _safetensors()  # the one optional dependency, checked before anything is written
    toggles = config.toggles_on()
    if toggles:
        raise ValueError(f"{', '.join(toggles)}: Qwen3ForCausalLM has no such part, so this model cannot be exported "
                         f"(a model trained with {config.qwen3_flags()} can)")
    enc = tokenizer or load_tokenizer("gpt2")
    check_model_vocab(config.vocab_size, enc)
    check_target(out_dir, overwrite)
    # Fresh float32 copies: safetensors refuses tensors that share storage, as the views of a fused weight do.
    weights = {k: v.detach().to("cpu", torch.float32).clone() for k, v in to_hf(config, state).items()}
    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out_dir)
    try:
        write_export(config, weights, enc, staging)
        replace_export(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not os.listdir(out_dir):  # a failed export into a directory it made: no trace left
            os.rmdir(out_dir)


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, metavar="PATH",
                        help="a checkpoint written by train.py (a .pt file or a sharded directory), or a run's "
                             "--out-dir: its newest good one")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output directory: created if needed, else it must be empty (or --overwrite)")
    parser.add_argument("--tokenizer", metavar="NAME|PATH",
                        help="the tokenizer the model was trained with, as prepare.py --tokenizer takes it "
                             "(default: the one its training data's data.json records, else GPT-2's)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty DIR, replacing an earlier export's weights, config and "
                             "tokenizer files there (other files stay); only once the new export is complete")
    try:
        args = parser.parse_args(argv)
        check_target(args.out, args.overwrite)  # before a checkpoint that may take minutes to read
        config, state = read_ckpt(args.ckpt, lambda line: print(line, file=sys.stderr, flush=True))
        enc = load_tokenizer(args.tokenizer) if args.tokenizer else model_tokenizer(args.ckpt)
        export_hf(config, state, args.out, enc, args.overwrite)
    except (UsageError, CheckpointError, DataError, ValueError, OSError) as e:
        return report_error(e)
    try:
        print(f"wrote {args.out}: Qwen3ForCausalLM, {plural(config.n_layer, 'layer')}, "
              f"vocab {config.padded_vocab_size} (padded from {config.vocab_size}), "
              f"{'tied' if config.tie_embeddings else 'untied'} embeddings", flush=True)
    except BrokenPipeError:
        return closed_stdout()
    return 0


if __name__ == "__main__":
    sys.exit(main())
