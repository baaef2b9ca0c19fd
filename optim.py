"""OptimConfig, parameter groups, AdamW, 8-bit AdamW, and the registry of optimizers that all else reads.

    cfg = OptimConfig(name="muon", lr=3e-4)
    optimizer = build_optimizer(model, cfg, model.row_blocks(), device.type)
    print(describe_param_groups(optimizer))

Every parameter group carries "base_lr"; the training loop scales it by its schedule each step
(schedule.py).
Weight decay is decoupled and goes only on matrices (every parameter with two or more dims, so the
hidden matrices, the embedding and an untied lm_head); norm weights and scalars are not decayed.

Under Muon (muon.py) the hidden matrices get the orthogonalised Nesterov momentum and everything else AdamW
inside the same optimizer, so one state_dict and one LR schedule cover both; this file gives it its groups.

Each optimizer is one OptimizerEntry in OPTIMIZERS (register): its builder, default LRs, the state it keeps per
parameter, and the paths it takes (FSDP2, cautious decay). --optimizer's choices, the LR defaults (here, and the
size dial's in sizing.py), the memory estimate (memory.py) and the start-up checks (config.py) read the entry,
so none of them names an optimizer.
"""

import math
import re
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import torch
from torch import nn

from hardware import fused_adamw_available
from muon import Muon, _is_dtensor, _local
from option import option
from update_math import (MUON_SCALES, NS_COEFF_SCHEMES, NS_DTYPES, cautious_decay_, newton_schulz_flops, per_step,
                         scalar_dtype)

FP32 = 4
# bitsandbytes' 8-bit AdamW (0.50): tensors of at least 4096 elements keep two uint8 states plus one float32
# absmax per 256-element block each; smaller ones, and the embedding / lm_head (FULL_PRECISION_STATE), keep two
# float32 states; two 256-entry float32 quantisation maps are shared.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256
BNB_QMAPS = 2 * 256 * FP32


@dataclass(frozen=True)
class OptimizerEntry:
    """One optimizer: everything the files that plan, size, check and build a run need of it, so that none of
    them names an optimizer. register() adds one; the bottom of this file registers the project's."""

    build: Callable  # (roles, cfg, row_blocks, device_type, compile) -> the optimizer; roles: split_params's
    lr: float  # the default peak LR at the default model's width (the hidden matrices' under hidden_matrices)
    state_bytes: Callable  # (parameter name, numel, one process) -> bytes of the state it keeps for it
    adam_lr: float | None = None  # the AdamW side's default peak LR, under hidden_matrices
    hidden_matrices: bool = False  # steps the hidden matrices (MUON_MATRICES) apart: Muon's toggles apply
    shared_state_bytes: int = 0  # state shared by all parameters (bitsandbytes' quantisation maps)
    fsdp: bool = True  # takes FSDP2's DTensor parameters
    cautious_wd: bool = True  # can decay cautiously (it keeps the update's sign)
    # Its default LRs at width w: those at BASE_WIDTH x (BASE_WIDTH / w) ** width_exponent, for every run.
    width_exponent: float = 1.0
    lr_rule: str = ""  # how its LRs' rule across widths was checked, for the start-up table
    beta1: float = 0.9  # Adam's default first-moment decay (the AdamW side's, under hidden_matrices)


OPTIMIZERS: dict[str, OptimizerEntry] = {}  # --optimizer's choices, in the order registered


def register(name: str, entry: OptimizerEntry) -> None:
    """Make `name` an --optimizer choice (a test may add its own)."""
    OPTIMIZERS[name] = entry


def with_property(prop: str) -> list[str]:
    """The registered optimizers whose entry has `prop` set, for a message naming what would work."""
    return [name for name, entry in OPTIMIZERS.items() if getattr(entry, prop)]

# Suffixes of the hidden matrices Muon owns (model.py's parameter-name contract).
MUON_MATRICES = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc1_weight", "mlp.fc2_weight")
# bitsandbytes advises 32-bit optimizer state for embedding layers, where 8-bit state hurts stability.
FULL_PRECISION_STATE = ("embed.weight", "lm_head.weight")
# The value embeddings' and the bigram embedding's tables (model.py's --value-embeds, --bigram-embed) are indexed
# by tokens like the embedding: a step updates only its batch's rows, so they train as the embedding does, in its
# group (its LR, betas and 32-bit state).
TOKEN_TABLE_PREFIXES = ("value_embeds.", "bigram_embed.")
# Module names that wrappers (torch.compile, activation checkpointing, FSDP1) insert into names.
WRAPPER_NAMES = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


# Under Muon, an untied model's embedding and lm_head LRs as multiples of the AdamW side's: the recipe sweep's
# best (docs/recipe.md#on-top-of-v2). The embedding's rows see sparse gradients and take a much higher LR than
# a matrix that is also the head could; the head itself wants a little more than the AdamW side's.
UNTIED_LR_MULTIPLES = {"embed_lr": 10, "head_lr": 2}
BASE_WIDTH = 128  # the default model's width, where the optimizers' default LRs were measured


@dataclass
class OptimConfig:
    """The optimizer. Each field's metadata is its command-line help: config.py generates train.py's flags."""

    name: str = option("muon", "muon: Muon for the hidden matrices + AdamW for the rest; adamw: fused AdamW; "
                               "adamw8bit: bitsandbytes' 8-bit AdamW", flag="--optimizer", choices=OPTIMIZERS)
    lr: float | None = option(None, "peak learning rate; for muon, the Muon matrices' (default: the optimizer's at "
                                    "width 128, 6e-3 for muon, 3e-3 for adamw and adamw8bit, scaled to the model's "
                                    "width: docs/sizing.md)")
    weight_decay: float = option(0.1, "decoupled, matrices only")
    beta1: float | None = option(None, "Adam first-moment decay (default: the optimizer's, 0.7 for muon's AdamW side, "
                                       "0.9 for adamw and adamw8bit: docs/recipe.md)")
    beta2: float = option(0.95, "Adam second-moment decay")
    eps: float = option(1e-8, "Adam's epsilon", flag="--adam-eps")
    adam_lr: float | None = option(None, "peak LR of the AdamW side of a Muon run (embeddings, norms; default: 3e-3 at "
                                         "width 128, scaled as --lr)")
    momentum: float = option(0.9, "Muon's momentum (docs/recipe.md)", flag="--muon-momentum")
    momentum_warmup: int = option(0, "Muon: ramp the momentum linearly from --muon-momentum-start to --muon-momentum "
                                     "over this many optimizer steps (0: off)", flag="--muon-momentum-warmup")
    momentum_start: float = option(0.85, "Muon's momentum at the first step of --muon-momentum-warmup",
                                   flag="--muon-momentum-start")
    nesterov: bool = option(True, "Muon: Nesterov momentum (--no-muon-nesterov: plain momentum)",
                            flag="--muon-nesterov")
    ns_steps: int = option(5, "Newton-Schulz iterations in Muon")
    ns_dtype: str = option("auto", "Newton-Schulz dtype (auto: bf16 on CUDA, fp32 elsewhere)",
                           choices=("auto", *NS_DTYPES))
    # match_rms_adamw makes Muon's update RMS match AdamW's, so AdamW's lr and weight decay carry over.
    muon_scale: str = option("match_rms_adamw", "Muon update scale: sqrt(max(1,rows/cols)) or 0.2*sqrt(max(rows,cols))",
                             choices=MUON_SCALES)
    fused: bool = option(True, "AdamW: torch's fused kernel where the device has one (--no-fused-adamw: the foreach "
                               "path, the ladder's baseline)", flag="--fused-adamw")
    ns_coeffs: str = option("quintic", "Muon's Newton-Schulz polynomials: the fixed quintic, or Polar Express's "
                                       "per-iteration ones (closer to the exact polar factor)",
                            choices=NS_COEFF_SCHEMES)
    normuon: bool = option(False, "Muon: NorMuon's per-neuron normalisation, each orthogonalised row divided by the "
                                  "root of an EMA of its mean square, then rescaled to the block's RMS")
    normuon_beta: float = option(0.95, "decay of NorMuon's per-row second moment")
    cautious_wd: bool = option(False, "cautious weight decay: decay only the coordinates whose update has the "
                                      "parameter's sign (muon and adamw)")
    embed_lr: float | None = option(None, "peak LR of the embedding (the tied matrix, if tied) and any value "
                                          "embeddings; default: 10x --adam-lr "
                                          "for an untied model under muon, else the AdamW side's LR")
    head_lr: float | None = option(None, "peak LR of an untied lm_head (not with --tie-embeddings); default: 2x "
                                         "--adam-lr under muon, else the AdamW side's LR")
    embed_beta1: float | None = option(None, "Adam first-moment decay of the embedding (the tied matrix, if tied); "
                                             "default: --beta1")
    embed_beta2: float | None = option(None, "Adam second-moment decay of the embedding; default: --beta2")

    @property
    def betas(self) -> tuple[float, float]:
        return self.beta1, self.beta2

    @property
    def embed_betas(self) -> tuple[float, float] | None:
        """The embedding's own Adam betas, or None when neither is set (it shares the AdamW side's)."""
        if self.embed_beta1 is None and self.embed_beta2 is None:
            return None
        return (self.beta1 if self.embed_beta1 is None else self.embed_beta1,
                self.beta2 if self.embed_beta2 is None else self.embed_beta2)

    def validate(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.lr is not None and not self.lr > 0:  # None: the optimizer's default (default_lrs)
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.adam_lr is not None and not self.adam_lr > 0:
            raise ValueError(f"adam_lr must be positive, got {self.adam_lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):  # one message per beta: it names the one flag to fix (None: the default)
            if getattr(self, name) is not None and not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ValueError(f"eps must be positive, got {self.eps}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if isinstance(self.ns_steps, bool) or not isinstance(self.ns_steps, int) or not 1 <= self.ns_steps <= 100:
            # Muon uses 5; each iteration is three matmuls a matrix, so 100 is already 20 optimizer steps' worth
            raise ValueError(f"ns_steps must be a whole number from 1 to 100, got {self.ns_steps!r}")
        if self.ns_dtype != "auto" and self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"unknown ns_dtype {self.ns_dtype!r}; choose one of auto, {', '.join(NS_DTYPES)}")
        if self.muon_scale not in MUON_SCALES:
            raise ValueError(f"unknown muon_scale {self.muon_scale!r}; choose one of {', '.join(MUON_SCALES)}")
        self._validate_recipe()

    def _validate_recipe(self):
        """The recipe toggles: a toggle that would do nothing for this optimizer is refused, not ignored."""
        if self.ns_coeffs not in NS_COEFF_SCHEMES:
            raise ValueError(f"unknown ns_coeffs {self.ns_coeffs!r}; choose one of {', '.join(NS_COEFF_SCHEMES)}")
        if not 0 <= self.normuon_beta < 1:
            raise ValueError(f"normuon_beta must be in [0, 1), got {self.normuon_beta}")
        if isinstance(self.momentum_warmup, bool) or not isinstance(self.momentum_warmup, int) \
                or self.momentum_warmup < 0:
            raise ValueError(f"momentum_warmup must be a whole number of steps >= 0, got {self.momentum_warmup!r}")
        if not 0 <= self.momentum_start < 1:
            raise ValueError(f"momentum_start must be in [0, 1), got {self.momentum_start}")
        muon = " or ".join(with_property("hidden_matrices"))
        if not OPTIMIZERS[self.name].hidden_matrices and self.momentum_warmup:
            raise ValueError(f"--muon-momentum-warmup ramps Muon's momentum: it needs --optimizer {muon}")
        for name in ("embed_lr", "head_lr"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("embed_beta1", "embed_beta2"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if not OPTIMIZERS[self.name].hidden_matrices and (self.normuon or self.ns_coeffs != "quintic"):
            raise ValueError(f"--normuon and --ns-coeffs act on Muon's update: they need --optimizer {muon}")
        if not OPTIMIZERS[self.name].cautious_wd and self.cautious_wd:
            raise ValueError(f"--cautious-wd needs the update's sign, which --optimizer {self.name} does not keep: "
                             f"use --optimizer {' or '.join(with_property('cautious_wd'))}")


def default_lrs(cfg: OptimConfig, tied: bool, width: int | None = None) -> dict[str, tuple[float, str]]:
    """The LRs cfg leaves unset -> {field: (value, its rule)}: the one place an LR default is decided, for a
    shape given by flags and by the size dial alike. The registry's LRs were measured on the default model
    (BASE_WIDTH wide); at the model's width (None: BASE_WIDTH) they scale as (BASE_WIDTH / width) to the
    entry's width_exponent. Under Muon an untied model's embedding and lm_head take UNTIED_LR_MULTIPLES of the
    AdamW side's LR, given or derived; otherwise they share it. Pure."""
    entry = OPTIMIZERS.get(cfg.name)
    if entry is None:  # refused by validate, with the choices
        return {}
    width = width if width is not None and width >= 1 else BASE_WIDTH  # a width under 1 is refused elsewhere
    scale = (BASE_WIDTH / width) ** entry.width_exponent
    per_width = (f"·{BASE_WIDTH}/n_embd" if entry.width_exponent == 1
                 else f"·({BASE_WIDTH}/n_embd)^{entry.width_exponent:g}")
    checked = f"; {entry.lr_rule}" if entry.lr_rule else ""  # said once, on the main LR

    def rule(name: str, value: float) -> str:
        return "default" if width == BASE_WIDTH else f"{value:g}{per_width}{checked if name == 'lr' else ''}"

    found = {name: (float(f"{value * scale:.3g}"), rule(name, value))
             for name, value in (("lr", entry.lr), ("adam_lr", entry.adam_lr))
             if getattr(cfg, name) is None and value is not None}
    if not tied and entry.hidden_matrices:
        side = cfg.adam_lr if cfg.adam_lr is not None else found["adam_lr"][0]
        found |= {name: (float(f"{multiple * side:.3g}"), f"{multiple}·adam_lr")
                  for name, multiple in UNTIED_LR_MULTIPLES.items() if getattr(cfg, name) is None}
    return found


def with_optimizer_defaults(cfg: OptimConfig, tied: bool, width: int | None = None) -> OptimConfig:
    """cfg with every unset LR at its default (default_lrs), and an unset beta1 at the optimizer's:
    config.Config resolves a run's this way, so that its config.toml and the recipe cache see the values;
    build_optimizer, a bare OptimConfig's."""
    entry = OPTIMIZERS.get(cfg.name)
    beta1 = {"beta1": entry.beta1} if cfg.beta1 is None and entry is not None else {}
    return replace(cfg, **beta1, **{name: value for name, (value, _) in default_lrs(cfg, tied, width).items()})


# ----------------------------------------------------------------------------- settings across a resume


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's settings, every key but its parameters: what the run's config and device decide."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def apply_group_settings(optimizer: torch.optim.Optimizer, settings: list[dict]) -> None:
    """Give each parameter group `settings` (group_settings of this optimizer), keeping its parameters and state.

    Optimizer.load_state_dict takes a checkpoint's groups, settings and all: taken before it and applied after,
    these keep the LRs, weight decay, betas, momentum and Newton-Schulz dtype of the run that loads it."""
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        params = group["params"]
        group.clear()
        group.update(own, params=params)
        if group.get("fused") or group.get("capturable"):
            # load_state_dict placed AdamW's step counts by the checkpoint's flags; the fused and capturable
            # kernels want them on the parameter's device, as torch places them for groups that say so.
            for p in params:
                state = optimizer.state.get(p, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


# ----------------------------------------------------------------------------- parameter groups


def canonical_name(name: str) -> str:
    """The parameter's name in the bare model, without the parts wrappers insert (DDP's module. too)."""
    parts = [p for p in name.split(".") if p not in WRAPPER_NAMES]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def param_role(name: str, p: torch.Tensor, use_muon: bool) -> str:
    """The group a parameter belongs to: "muon", "decay" (AdamW with weight decay) or "no_decay"."""
    if use_muon and p.ndim == 2 and name.endswith(MUON_MATRICES):
        return "muon"
    return "decay" if p.ndim >= 2 else "no_decay"


def as_embedding(name: str) -> str:
    """The name whose optimizer settings a parameter takes: "embed.weight" for a value-embedding or bigram
    table, else its own."""
    return "embed.weight" if name.startswith(TOKEN_TABLE_PREFIXES) else name


def split_params(model: nn.Module, use_muon: bool) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Trainable parameters by role, in model order. A tied weight appears once, under its first name."""
    roles = {"muon": [], "decay": [], "no_decay": []}
    for name, p in model.named_parameters():  # named_parameters() already skips tied duplicates
        if p.requires_grad:
            name = canonical_name(name)
            roles[param_role(name, p, use_muon)].append((name, p))
    return roles


def _group(kind: str, named: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float, **extra) -> dict:
    return {"params": [p for _, p in named], "names": [n for n, _ in named], "kind": kind,
            "lr": lr, "base_lr": lr, "weight_decay": weight_decay, **extra}


def adamw_groups(roles: dict, lr: float, weight_decay: float, cfg: OptimConfig) -> list[dict]:
    """The AdamW side: decayed matrices, undecayed vectors, and the embedding and lm_head in groups of their own
    only where cfg gives them their own LR (or the embedding its own betas), so that a run without those flags
    keeps the same groups (and the same optimizer state_dict layout). Groups carry "cautious_wd" only when it
    is on, "betas" only when their own."""
    own = {"embed.weight": (cfg.embed_lr, cfg.embed_betas), "lm_head.weight": (cfg.head_lr, None)}
    own = {name: (group_lr, betas) for name, (group_lr, betas) in own.items() if (group_lr, betas) != (None, None)}
    extra = {"cautious_wd": True} if cfg.cautious_wd else {}
    decay = [(n, p) for n, p in roles["decay"] if as_embedding(n) not in own]
    groups = [_group("adamw", decay, lr, weight_decay, **extra), _group("adamw", roles["no_decay"], lr, 0.0, **extra)]
    for name, (group_lr, betas) in own.items():
        groups.append(_group("adamw", [(n, p) for n, p in roles["decay"] if as_embedding(n) == name],
                             lr if group_lr is None else group_lr, weight_decay,
                             **extra, **({} if betas is None else {"betas": betas})))
    return [g for g in groups if g["params"]]


# ----------------------------------------------------------------------------- building


def build_optimizer(model: nn.Module, cfg: OptimConfig, row_blocks: dict[str, list[int]],
                    device_type: str, compile: bool = False) -> torch.optim.Optimizer:
    """The optimizer cfg names over model's trainable parameters.

    row_blocks maps a fused weight's name to its row split (model.GPT.row_blocks()); Muon
    orthogonalises each block separately. device_type picks fused AdamW and Muon's NS dtype. compile: Muon's
    step as one compiled function over its stacks of same-shape matrices (muon.py), for a run that compiles its
    model (--compile); AdamW's fused kernel is one already.
    """
    cfg.validate()  # unset LRs pass: they are filled below
    entry = OPTIMIZERS[cfg.name]
    roles = split_params(model, use_muon=entry.hidden_matrices)
    cfg = with_optimizer_defaults(cfg, tied=True)  # a bare config's embedding and head share the AdamW side's LR
    if cfg.head_lr is not None and not any(n == "lm_head.weight" for n, _ in roles["decay"]):
        raise ValueError("--head-lr needs an untied lm_head (not --tie-embeddings); a tied one is the embedding: "
                         "use --embed-lr")
    return entry.build(roles, cfg, row_blocks, device_type, compile)


def _build_adamw(roles, cfg, row_blocks, device_type, compile):
    fused = cfg.fused and fused_adamw_available(device_type)
    cls = CautiousAdamW if cfg.cautious_wd else torch.optim.AdamW  # plain torch when off: nothing else changes
    return cls(adamw_groups(roles, cfg.lr, cfg.weight_decay, cfg), lr=cfg.lr, betas=cfg.betas,
               eps=cfg.eps, fused=fused or None, foreach=None if fused else True)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether optimizer.step reads a `found_inf` attribute (a float32 scalar on the parameters' device; nonzero:
    skip) on the device and then leaves the parameters and its state exactly as they were: torch's fused AdamW
    (CautiousAdamW on it too), which declares it to GradScaler, and optimizers that set `skips_found_inf`."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)
                or getattr(optimizer, "skips_found_inf", False))


def step_if_finite(optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
    """optimizer.step() where `finite` (a bool scalar on the parameters' device) is True; where it is False the
    parameters and the optimizer state stay exactly as they were.

    An optimizer that skips on the device (skips_on_device) is handed found_inf = 1 - finite for the step, as
    GradScaler hands it to fused kernels, so the host queues the step without waiting for the GPU. The others
    update their moments whatever the gradient, so the host reads `finite` first, one wait for the GPU a step:
    foreach AdamW (torch's multi-tensor kernels take no found_inf; skipping there on the device would take a copy
    of every parameter and both moments each step) and bitsandbytes' 8-bit AdamW (whose kernels take none
    either)."""
    if not skips_on_device(optimizer):
        if finite:
            optimizer.step()
        return
    optimizer.found_inf = (~finite).float()
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def _build_adamw8bit(roles, cfg, row_blocks, device_type, compile):
    named = roles["decay"] + roles["no_decay"]
    if any(_is_dtensor(p) for _, p in named):
        raise ValueError("adamw8bit does not support FSDP2 (DTensor) parameters; use --optimizer adamw")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ValueError("optimizer adamw8bit needs bitsandbytes: pip install bitsandbytes") from None
    # bitsandbytes looks overrides up by id(param) in a process-wide table, so set every parameter's
    # bits explicitly: a stale entry left by a freed tensor that had the same id must not leak in.
    manager = bnb.optim.GlobalOptimManager.get_instance()
    for name, p in named:
        bits = 32 if as_embedding(name) in FULL_PRECISION_STATE else 8
        manager.override_config(p, key_value_dict={"optim_bits": bits})
    return bnb.optim.AdamW8bit(adamw_groups(roles, cfg.lr, cfg.weight_decay, cfg), lr=cfg.lr, betas=cfg.betas,
                               eps=cfg.eps, weight_decay=0.0)


def _build_muon(roles, cfg, row_blocks, device_type, compile):
    blocks = {canonical_name(k): list(v) for k, v in row_blocks.items()}
    muon_names = {n for n, _ in roles["muon"]}
    unknown = sorted(set(blocks) - muon_names)
    if unknown:
        raise ValueError(f"row_blocks names {unknown[0]}, which is not a Muon matrix of this model")
    splits = []
    for name, p in roles["muon"]:
        split = blocks.get(name, [p.shape[0]])
        if not split or sum(split) != p.shape[0] or min(split) < 1:
            raise ValueError(f"row_blocks for {name} is {split}, which does not split its {p.shape[0]} rows")
        splits.append(split)
    ns_dtype = cfg.ns_dtype if cfg.ns_dtype != "auto" else ("bf16" if device_type == "cuda" else "fp32")
    extra = {"cautious_wd": True} if cfg.cautious_wd else {}
    groups = ([_group("muon", roles["muon"], cfg.lr, cfg.weight_decay, row_blocks=splits, **extra)]
              if roles["muon"] else [])
    groups += adamw_groups(roles, cfg.adam_lr if cfg.adam_lr is not None else cfg.lr, cfg.weight_decay, cfg)
    return Muon(groups, momentum=cfg.momentum, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps, ns_dtype=ns_dtype,
                muon_scale=cfg.muon_scale, betas=cfg.betas, eps=cfg.eps, ns_coeffs=cfg.ns_coeffs,
                normuon_beta=cfg.normuon_beta if cfg.normuon else None, momentum_warmup=cfg.momentum_warmup,
                momentum_start=cfg.momentum_start, compile=compile)


class CautiousAdamW(torch.optim.AdamW):
    """torch's AdamW, fused or foreach kernels and all, with cautious weight decay (cautious_decay_) on the
    groups that carry "cautious_wd".

    The kernels decay every coordinate, so those groups' decay is taken out of their hands: before the step it
    is applied here, on the parameters as they are (the same point AdamW decays them), masked by the sign of
    the update about to be taken, which is the sign of the new first moment lerp(exp_avg, grad, 1 - beta1);
    the kernels then run with weight_decay 0. One parameter-sized temporary at a time.
    """

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # the gradients the mask reads must exist before it is taken
            with torch.enable_grad():
                loss = closure()
        # Fused kernels may be handed the scale (GradScaler) and an inf flag (a skipped step: step_if_finite).
        scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        cautious = [g for g in self.param_groups if g.get("cautious_wd") and g["weight_decay"]]
        for group in cautious:
            self._cautious_decay(group, scale, found_inf)
        saved = [g["weight_decay"] for g in cautious]
        try:
            for group in cautious:
                group["weight_decay"] = 0.0
            super().step()
        finally:
            for group, weight_decay in zip(cautious, saved):
                group["weight_decay"] = weight_decay
        return loss

    def _cautious_decay(self, group, scale, found_inf):
        """The group's decay, masked by the sign of the first moment this step will have; none where found_inf
        is nonzero, decided on the device like the kernel's skip."""
        beta1, amount = group["betas"][0], group["lr"] * group["weight_decay"]
        if found_inf is not None:
            amount = per_step(found_inf.bool(), amount, 0.0, scalar_dtype(found_inf.device))
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = _local(p.grad) if scale is None else _local(p.grad) / scale
            exp_avg = self.state[p].get("exp_avg")
            first_moment = grad * (1 - beta1) if exp_avg is None else _local(exp_avg).lerp(grad, 1 - beta1)
            cautious_decay_(_local(p), first_moment, amount)


# ----------------------------------------------------------------------------- reporting


class StepWork(NamedTuple):
    """What one optimizer step does on this rank, to price it (plan.optimizer_seconds)."""
    ns_flops: int  # Muon's Newton-Schulz, in ns_dtype
    ns_dtype: torch.dtype | None
    elementwise_bytes: int  # read and written by the elementwise updates and gradient clipping


def step_work(optimizer: torch.optim.Optimizer, state_bytes: int, world_size: int = 1, sharded: bool = False) -> StepWork:
    """Muon's Newton-Schulz FLOPs (ns_steps iterations of update_math.newton_schulz_flops on each row block,
    spread over the ranks, as Muon spreads them), and the elementwise bytes: each parameter read and written,
    its gradient read for clipping's norm, scaled in place and read by the update (24 bytes in float32), and
    the state (state_bytes in all, memory.optimizer_state_bytes_estimate) read and written; a rank's share of
    them under FSDP2 (sharded). Pure."""
    params, ns_flops, ns_dtype = 0, 0, None
    for group in optimizer.param_groups:
        params += sum(p.numel() for p in group["params"])  # a DTensor's numel is its whole tensor's
        if group.get("kind") == "muon":
            ns_dtype = NS_DTYPES[group["ns_dtype"]]
            ns_flops += group["ns_steps"] * sum(2 * newton_schulz_flops(rows, p.shape[1]) for p, split
                                                in zip(group["params"], group["row_blocks"]) for rows in split)
    elementwise = 24 * params + 2 * state_bytes
    return StepWork(ns_flops // world_size, ns_dtype, elementwise // world_size if sharded else elementwise)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in the optimizer state on this rank (a DTensor counts its local shard), and of the
    working buffers it keeps between steps (Muon's update buffers: `working_buffers`).

    Tensors shared between parameters (bitsandbytes' quantisation maps) count once. State is
    created lazily, so call this after the first step.
    """
    seen, total = set(), 0
    kept = [{"buffer": t} for t in getattr(optimizer, "working_buffers", lambda: [])()]
    for state in [*optimizer.state.values(), *kept]:
        for value in state.values():
            if isinstance(value, torch.Tensor):
                t = _local(value)
                if t.numel() and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total


def _short_names(names: list[str]) -> str:
    """Names with block indices folded: blocks.0.attn.qkv.weight, blocks.1... -> blocks.*.attn.qkv.weight."""
    folded = dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in names)
    return ", ".join(folded)


def describe_param_groups(optimizer: torch.optim.Optimizer) -> str:
    """A few lines for the startup log: the optimizer, then one line per parameter group."""
    cautious = any(g.get("cautious_wd") for g in optimizer.param_groups)
    if isinstance(optimizer, Muon):
        d = optimizer.defaults
        options = [", nesterov" if d["nesterov"] else "",
                   f", {d['ns_coeffs']} coefficients" if d["ns_coeffs"] != "quintic" else "",
                   f", NorMuon (beta {d['normuon_beta']})" if d["normuon_beta"] is not None else "",
                   f", momentum from {d['momentum_start']} over {d['momentum_warmup']} steps"
                   if d["momentum_warmup"] else "",
                   ", cautious wd" if cautious else ""]
        head = (f"Muon (NS {d['ns_steps']} steps in {d['ns_dtype']}, scale {d['muon_scale']}, "
                f"momentum {d['momentum']}{''.join(options)}) + AdamW")
    elif isinstance(optimizer, torch.optim.AdamW):
        head = (f"AdamW ({'fused' if optimizer.defaults.get('fused') else 'foreach'}"
                f"{', cautious wd' if cautious else ''})")
    else:
        kept = [n for g in optimizer.param_groups for n in g.get("names", [])
                if as_embedding(n) in FULL_PRECISION_STATE]
        head = f"{type(optimizer).__name__} (32-bit state for {', '.join(kept) or 'none'})"
    lines = [head]
    for g in optimizer.param_groups:
        numel = sum(p.numel() for p in g["params"])
        lines.append(f"    {g.get('kind', 'adamw'):<5}  lr {g['base_lr']:g}  wd {g['weight_decay']:g}  "
                     f"{len(g['params'])} tensors, {numel:,} params: {_short_names(g.get('names', []))}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the project's optimizers
# Default peak LRs for train.py's small default model, from the sweep in bench/results/optimizers.md: the best
# of 3e-3 / 6e-3 / 1.2e-2 for Muon, of 1.5e-3 ... 1.2e-2 for AdamW.


def _adamw_state(name: str, numel: int, one_process: bool) -> int:
    return 2 * FP32 * numel  # exp_avg, exp_avg_sq


def _adamw8bit_state(name: str, numel: int, one_process: bool) -> int:
    eight_bit = numel >= BNB_MIN_8BIT_SIZE and as_embedding(name) not in FULL_PRECISION_STATE
    return 2 * numel + 2 * FP32 * math.ceil(numel / BNB_BLOCK) if eight_bit else 2 * FP32 * numel


def _muon_state(name: str, numel: int, one_process: bool) -> int:
    """A hidden matrix keeps its momentum, and in one process an update buffer beside it (muon_stacks.GroupViews;
    counted under compile too, which keeps none, and under DDP, where it errs high); the rest AdamW's two."""
    return (1 + one_process) * FP32 * numel if name.endswith(MUON_MATRICES) else 2 * FP32 * numel


register("adamw", OptimizerEntry(build=_build_adamw, lr=3e-3, state_bytes=_adamw_state))
register("adamw8bit", OptimizerEntry(build=_build_adamw8bit, lr=3e-3, state_bytes=_adamw8bit_state,
                                     shared_state_bytes=BNB_QMAPS, fsdp=False, cautious_wd=False))
register("muon", OptimizerEntry(build=_build_muon, lr=6e-3, adam_lr=3e-3, state_bytes=_muon_state,
                                hidden_matrices=True, width_exponent=0.5, beta1=0.7,
                                lr_rule="measured at widths 128-512 on two corpora, docs/sizing.md"))
