"""The --depth dial and --preset table (a depth to shape, LR, batch, horizon); parameter counts, FLOPs.

One dial for the model's size: `--depth N`, or a named `--preset`, derives the shape and the training
settings that go with it, so that a user picks one number instead of seven.

    values = derive(12, explicit={})     # {"model.n_embd": (768, "64·depth"), "optim.lr": (0.001, ...), ...}

The rules, each a constant below:
- width: n_embd = 64 x depth (GPT-2 small's aspect ratio: 768 = 64 x 12), rounded up to a multiple of head_dim;
- head_dim: 128, the size H100 FP8 attention kernels need, or 64 for widths under 512 (a small model would
  otherwise have one or two heads);
- heads: n_head = n_embd / head_dim, and n_kv_head = n_head / 2 (GQA halves the KV cache and the K/V
  projections); an odd head count keeps full multi-head attention, since 2 must divide it;
- ffn_dim: the model's own default (model.ModelConfig): SwiGLU's 8/3 n_embd rounded up to a multiple of 128,
  ReLU^2's 3/2 of that (the same parameters);
- peak LRs (optim.default_lrs decides them, for a shape given by flags too; config.Config sets them): the
  default model's x (128 / n_embd)^0.5 under Muon, for its matrices (6e-3 at width 128) and its AdamW side
  (3e-3), measured at widths 128-512 on two corpora (docs/sizing.md); x 128 / n_embd under AdamW, muP's rule
  for Adam on hidden matrices, which lands within 25% of GPT-3's published AdamW LRs at GPT-2's four widths
  (6e-4 at 768, 3e-4 at 1024, 2.5e-4 at 1536, 2e-4 at 2048);
- global batch: DeepSeek LLM's fitted compute-optimal batch, B = 0.292 x C^0.3271 tokens with C = 6 x params x
  training tokens (--max-tokens when given, else the horizon below), rounded to a power of two (and to whole
  micro-batches), and capped at training tokens / MIN_STEPS (150), so that a short run still takes that many
  steps; below one default micro-batch, the micro-batch itself shrinks to the cap, in whole sequences;
- horizon: --tokens-per-param x params training tokens (Chinchilla's 20 by default), params counting the
  embedding but not the bigram table (dial_params). The WSD decay stays --decay-frac's default at every
  length: a longer decay for longer runs did not hold on both corpora (docs/sizing.md).

The end of the file is what a shape costs, by arithmetic on its config alone (no model is built): each
parameter's shape, the parameter count, and the training FLOPs per token that MFU and the plan divide by.

A value the user gives explicitly (a flag, a --config file, or a preset's override) always wins, and the values
derived after it use it: `--depth 12 --n-embd 1024` derives its heads and LR from width 1024.
"""

import math
from dataclasses import dataclass, replace

from model import ModelConfig, value_embed_layers
from optim import OptimConfig, default_lrs
from option import option

ASPECT_RATIO = 64  # width per layer
HEAD_DIM, SMALL_HEAD_DIM, SMALL_WIDTH = 128, 64, 512
GQA_RATIO = 2  # query heads per key/value head
# What the width rule of an optimizer's LRs rests on, for the start-up table: Muon's four LRs swept at x0.5 and x2
# around the rule at three widths, each within the seed spread of the best (docs/sizing.md's table).
BATCH_COEFF, BATCH_EXPONENT = 0.292, 0.3271  # DeepSeek LLM (2024), optimal batch in tokens against compute C
FFN_RULES = {"swiglu": "8/3·n_embd", "relu2": "3/2 of SwiGLU's 8/3·n_embd"}  # by --mlp, as model.ModelConfig
# The fewest steps the dial's batch leaves a run: the fit is for long horizons, and a short run needs steps.
MIN_STEPS = 150
# --tokens-per-param's range: from a smoke test's horizon (124k tokens at 124M) to well past the most
# over-trained models (Qwen3 0.6B: 36T tokens, 60,000 per parameter).
TOKENS_PER_PARAM_RANGE = (1e-3, 1e6)

# Published GPT-2 sizes as aliases: a depth plus the overrides that reproduce GPT-2's context and width (and,
# for 1.5B, the 25 heads of 64 that 1600 needs; 25 is odd, so it is full multi-head attention, as GPT-2 was).
# What every GPT-2 size shares: its context, and its embedding tied to its lm_head (so that a preset's parameter
# count is GPT-2's).
GPT2 = {"model.max_seq_len": 1024, "model.tie_embeddings": True}
PRESETS = {
    "gpt2-124m": {"size.depth": 12, **GPT2},
    "gpt2-350m": {"size.depth": 24, **GPT2, "model.n_embd": 1024},
    "gpt2-760m": {"size.depth": 36, **GPT2, "model.n_embd": 1280},
    "gpt2-1.5b": {"size.depth": 48, **GPT2, "model.n_embd": 1600, "model.head_dim": 64, "model.n_head": 25,
                  "model.n_kv_head": 25},
}
# The published parameter counts the presets are checked against (tests/test_sizing.py): within 10%.
PUBLISHED_PARAMS = {"gpt2-124m": 124e6, "gpt2-350m": 355e6, "gpt2-760m": 774e6, "gpt2-1.5b": 1558e6}


@dataclass
class SizeConfig:
    """The size dial. Each field's metadata is its command-line help: config.py generates the flags."""

    depth: int | None = option(None, "one dial for the model size: derives width, heads, LR, global batch and training "
                                     "tokens from the number of layers (see sizing.py); explicit flags override any "
                                     "derived value")
    preset: str | None = option(None, "a published GPT-2 size: an alias for a --depth plus overrides",
                                choices=tuple(PRESETS))
    tokens_per_param: float = option(20.0, "with --depth or --preset: train for this many tokens per parameter "
                                           "(Chinchilla: 20), unless --max-steps or --max-tokens is given")

    def validate(self) -> None:
        if self.depth is not None and self.depth < 1:
            raise ValueError(f"--depth must be >= 1, got {self.depth}")
        low, high = TOKENS_PER_PARAM_RANGE
        if not low <= self.tokens_per_param <= high:  # nan and inf fail too
            raise ValueError(f"--tokens-per-param must be in [{low:g}, {high:g}], got {self.tokens_per_param}")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def shape(depth: int, explicit: dict) -> dict[str, tuple[object, str]]:
    """The model shape for `depth` -> {"model.<field>": (value, rule)}; explicit values are used as given."""
    width_given = explicit.get("model.n_embd")
    raw_width = width_given or ASPECT_RATIO * depth
    head_dim = explicit.get("model.head_dim") or (HEAD_DIM if raw_width >= SMALL_WIDTH else SMALL_HEAD_DIM)
    width = width_given or _round_up(raw_width, head_dim)
    n_head = explicit.get("model.n_head") or max(1, width // head_dim)
    n_kv_head = n_head // GQA_RATIO if n_head % GQA_RATIO == 0 else n_head
    width_rule = f"{ASPECT_RATIO}·depth" + ("" if width == raw_width else ", rounded up to head_dim")
    return {
        "model.n_layer": (depth, "depth"),
        "model.n_embd": (width, width_rule),
        "model.head_dim": (head_dim, f"{HEAD_DIM}; {SMALL_HEAD_DIM} under width {SMALL_WIDTH}"),
        "model.n_head": (n_head, "n_embd/head_dim"),
        "model.n_kv_head": (n_kv_head, f"n_head/{GQA_RATIO}" if n_kv_head != n_head else "odd n_head: MHA"),
    }


def compute_optimal_batch(params: int, tokens: float, granule: int) -> int:
    """DeepSeek LLM's fitted optimal batch (tokens) for C = 6 x params x tokens, rounded to a power of two, then
    to a multiple of `granule` (the tokens of one micro-batch), at least one."""
    optimal = BATCH_COEFF * (6 * params * tokens) ** BATCH_EXPONENT
    power = 2 ** round(math.log2(optimal))
    return max(granule, round(power / granule) * granule)


def batch_for_budget(batch: int, tokens: int, granule: int) -> int:
    """The global batch (tokens) capped so that a run of `tokens` takes at least MIN_STEPS steps, in whole
    micro-batches of `granule` tokens, at least one: the fit's batch for a short horizon would make a run of
    a handful of giant steps, each an optimizer update late."""
    return max(granule, min(batch, tokens // MIN_STEPS // granule * granule))


def derive(depth: int, explicit: dict, micro_batch: int | str | None = None,
           model_defaults: ModelConfig | None = None) -> dict[str, tuple[object, str]]:
    """Every value the dial derives -> {"section.field": (value, rule)}, whether or not `explicit` ("section.field"
    -> value, what the user gave) overrides it; the values derived later (LR, batch, horizon) use the explicit
    ones. The caller keeps the explicit values over these. micro_batch: the run's default micro-batch (config's
    DataConfig), for when explicit has none: the batch is rounded to whole micro-batches."""
    base = model_defaults or ModelConfig()
    values = shape(depth, explicit)
    resolved = {key: explicit.get(key, value) for key, (value, _) in values.items()}
    model_fields = {key.split(".", 1)[1]: value for key, value in {**resolved, **explicit}.items()
                    if key.startswith("model.")}
    model_cfg = ModelConfig(**{**base.__dict__, **model_fields})
    width = model_cfg.n_embd
    values["model.ffn_dim"] = (replace(model_cfg, ffn_dim=None).resolved_ffn_dim, FFN_RULES[model_cfg.mlp])
    lrs = default_lrs(OptimConfig(name=explicit.get("optim.name", OptimConfig.name)), True, width)
    values |= {f"optim.{name}": lr for name, lr in lrs.items()}  # said here; config.Config sets them
    params = dial_params(model_cfg)
    tokens_per_param = explicit.get("size.tokens_per_param", SizeConfig.tokens_per_param)
    tokens = max(1, round(tokens_per_param * params))  # 0 would be max_tokens' "unset"
    values["schedule.max_tokens"] = (tokens, f"{tokens_per_param:g}/param x {params / 1e6:.1f}M params")
    micro = explicit.get("data.batch_size", micro_batch)
    granule = model_cfg.max_seq_len * (micro if isinstance(micro, int) else 1)
    budget = explicit.get("schedule.max_tokens") or tokens  # the run's tokens, given or derived
    optimal = compute_optimal_batch(params, budget, granule)
    batch = batch_for_budget(optimal, budget, granule)
    if "data.batch_size" not in explicit and isinstance(micro, int) and budget // MIN_STEPS < granule:
        # Even one default micro-batch leaves the run under MIN_STEPS steps: the micro-batch shrinks instead, in
        # whole sequences (tests: a short run is step-starved, docs/recipe.md's batch rows).
        batch = batch_for_budget(optimal, budget, model_cfg.max_seq_len)
        values["data.batch_size"] = (batch // model_cfg.max_seq_len, f"max_tokens/{MIN_STEPS} steps in sequences")
    values["data.total_batch_tokens"] = (batch, "DeepSeek's batch fit" if batch == optimal else
                                         f"DeepSeek's fit {optimal:,}, capped at max_tokens/{MIN_STEPS} steps")
    return values


def resolve(explicit: dict, micro_batch: int | str | None = None) -> dict:
    """The values a run gets from its size dial: a preset's values under everything explicit, then the derived
    values under both; the keys of the horizon and the batch only when the user fixed neither of their
    alternatives. -> "section.field" -> value, to be overridden by `explicit`."""
    preset = PRESETS.get(explicit.get("size.preset"), {})
    given = {**preset, **explicit}
    depth = given.get("size.depth")
    if depth is None:
        return preset
    # The LRs' rows only say the rule: config.Config sets the LRs themselves (optim.default_lrs).
    derived = {key: value for key, (value, _) in derive(depth, given, micro_batch).items()
               if value is not None and not key.startswith("optim.")}
    if "schedule.max_steps" in given or "schedule.max_tokens" in given:
        derived.pop("schedule.max_tokens")
    if "data.grad_accum" in given or "data.total_batch_tokens" in given:
        derived.pop("data.total_batch_tokens")
        derived.pop("data.batch_size", None)
    return {**derived, **preset}


def preset_shape(name: str) -> ModelConfig:
    """A preset's model shape alone (bench/ladder.py sweeps the shapes without the derived horizon and batch)."""
    values = {**resolve({"size.preset": name}), **PRESETS[name]}
    return ModelConfig(**{key[6:]: v for key, v in values.items() if key.startswith("model.")})


def describe(size: SizeConfig, values: dict) -> str:
    """The start-up table's account of the dial: each derived value with its rule, or where it came from
    instead (the preset, or the user). values: the run's resolved "section.field" -> value."""
    if size.depth is None:
        return f"off (shape from the model flags; {plain_lrs(values)}; --depth N or --preset derives it all)"
    preset = {k: v for k, v in PRESETS.get(size.preset, {}).items() if k != "size.depth"}
    derived_keys = derive(size.depth, {}).keys()
    inputs = {k: v for k, v in values.items() if k not in derived_keys}  # seq-len, optimizer, micro-batch, ...
    # A length in tokens leaves --max-steps unused, and a batch in tokens --grad-accum (derived at run time).
    for used, unused in (("schedule.max_tokens", "schedule.max_steps"), ("data.total_batch_tokens", "data.grad_accum")):
        if values.get(used):
            inputs.pop(unused, None)
    given = {**inputs, **preset}
    while True:  # a value that differs from its derivation was given; the values derived after it follow it
        derived = derive(size.depth, given)
        overridden = [key for key, (value, _) in derived.items()
                      if value is not None and values.get(key, value) != value and key not in given]
        if not overridden:
            break
        given[overridden[0]] = values[overridden[0]]  # in dependency order: the first may explain the rest
    parts = []
    for key, (value, rule) in derived.items():
        name = key.split(".", 1)[1]
        actual = values.get(key, value)
        if not actual:  # fixed another way (--max-steps, --grad-accum)
            parts.append(f"{name} not derived")
            continue
        if value is None:  # not derivable before the run starts: the rule says why
            parts.append(f"{name} {actual:.3g} (not derived: {rule})")
            continue
        source = "preset" if key in preset else "given" if key in given else rule
        parts.append(f"{name} {f'{actual:.3g}' if isinstance(actual, float) else f'{actual:,}'} ({source})")
    name = f"preset {size.preset}, " if size.preset else ""
    return f"{name}depth {size.depth}: " + ", ".join(parts)


def plain_lrs(values: dict) -> str:
    """The LRs of a run whose shape flags gave, each with its rule (optim.default_lrs, by the model's width, as
    the dial's), or "given". values: the run's resolved "section.field" -> value."""
    given = OptimConfig(name=values["optim.name"])
    while True:  # an LR that differs from its rule was given; the ones derived from it (untied) follow it
        rules = default_lrs(given, values["model.tie_embeddings"], values["model.n_embd"])
        differs = [name for name, (value, _) in rules.items() if values[f"optim.{name}"] != value]
        if not differs:
            break
        given = replace(given, **{differs[0]: values[f"optim.{differs[0]}"]})
    parts = [f"{name} {values[f'optim.{name}']:.3g} ({rules[name][1] if name in rules else 'given'})"
             for name in ("lr", "adam_lr", "embed_lr", "head_lr") if name in rules or getattr(given, name) is not None]
    return ", ".join(parts)


# ----------------------------------------------------------------------------- what a shape costs


def block_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each parameter of one block, by its name inside the block, in the state dict's order (a
    module's own parameters before its children's: the gate first). Every block has the same ones, so a size
    multiplies them by n_layer instead of walking the layers: a claimed depth costs nothing."""
    D, hd, F = cfg.n_embd, cfg.resolved_head_dim, cfg.resolved_ffn_dim
    H, K = cfg.n_head, cfg.n_kv_head
    shapes = {"attn.gate_weight": (H, D)} if cfg.attn_gate else {}
    return shapes | {"attn.qkv.layer_norm_weight": (D,), "attn.qkv.weight": ((H + 2 * K) * hd, D),
                     "attn.q_norm.weight": (hd,), "attn.k_norm.weight": (hd,), "attn.proj.weight": (D, H * hd),
                     "mlp.layer_norm_weight": (D,), "mlp.fc1_weight": (cfg.fc1_rows, D), "mlp.fc2_weight": (D, F)}


def outer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each parameter outside the blocks (a tied lm_head is the embedding: not a parameter)."""
    V, D = cfg.padded_vocab_size, cfg.n_embd
    shapes = {"embed.weight": (V, D), "norm.weight": (D,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for table in range(cfg.value_embeds):
        shapes[f"value_embeds.{table}.weight"] = (V, cfg.n_kv_head * cfg.resolved_head_dim)
    if cfg.value_embeds:
        shapes["value_embed_lambdas"] = (len(value_embed_layers(cfg)),)
    if cfg.unet_skips:
        shapes["unet_weights"] = (cfg.n_layer // 2,)
    if cfg.smear:
        shapes["smear_weight"] = (1, D)
    if cfg.bigram_embed:
        shapes["bigram_embed.weight"] = (cfg.bigram_embed, D)
    if cfg.embed_skips:
        shapes["embed_skip_weights"] = (cfg.n_layer - 1,)
    return shapes


def param_count(cfg: ModelConfig) -> int:
    """Every parameter, the embedding included, by arithmetic on the shapes."""
    block = sum(math.prod(shape) for shape in block_shapes(cfg).values())
    return sum(math.prod(shape) for shape in outer_shapes(cfg).values()) + cfg.n_layer * block


def dial_params(cfg: ModelConfig) -> int:
    """The parameters the dial sizes a run by: param_count less the bigram table, whose row count is the hash's
    (GPT-2's padded vocabulary at every width), not the model's: counted, it would make a 124M model's horizon
    and batch those of a 155M one for a lookup that does no matmul."""
    return param_count(replace(cfg, bigram_embed=0))


def param_numels(cfg: ModelConfig) -> dict[str, int]:
    """Elements of every parameter, by its name in the model: one entry per layer's, so only for a model
    about to be built; a size check takes param_count."""
    block = {name: math.prod(shape) for name, shape in block_shapes(cfg).items()}
    numels = {name: math.prod(shape) for name, shape in outer_shapes(cfg).items()}
    for i in range(cfg.n_layer):
        numels.update({f"blocks.{i}.{name}": n for name, n in block.items()})
    return numels


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the convention of the PaLM paper and nanoGPT's MFU.

    6 * N, where N counts the weights of every matrix multiply: qkv, proj, fc1, fc2 (and an attention gate) in
    each block plus the lm_head over the padded vocabulary, and the smear's gate (the embedding, value-embedding
    and bigram lookups, norm weights and the toggles' scalars are not matmuls; a tied matrix counts once, as the
    lm_head). Plus attention scores and the weighted sum, 2 matmuls * 2 FLOPs * seq_len * n_head * head_dim per
    layer forward, times 3 for forward + backward: 12 * n_layer * n_head * head_dim * seq_len. The attention
    term counts the full T x T square even though causal kernels skip half of it.
    """
    hd, ffn, dim = config.resolved_head_dim, config.resolved_ffn_dim, config.n_embd
    per_layer = (
        dim * (config.n_head + 2 * config.n_kv_head) * hd
        + config.n_head * hd * dim
        + dim * config.fc1_rows
        + ffn * dim
        + (config.n_head * dim if config.attn_gate else 0)
    )
    matmul_params = config.n_layer * per_layer + config.padded_vocab_size * dim + (dim if config.smear else 0)
    attention = 12 * config.n_layer * config.n_head * hd * seq_len
    return float(6 * matmul_params + attention)
