"""Optimizers: AdamW (fused where the device has the kernel), 8-bit AdamW (bitsandbytes) and Muon.

    cfg = OptimConfig(name="muon", lr=3e-4)
    optimizer = build_optimizer(model, cfg, model.row_blocks(), device.type)
    print(describe_param_groups(optimizer))

Every parameter group carries "base_lr"; the training loop scales it by its schedule each step.
Weight decay is decoupled and goes only on matrices (every parameter with two or more dims, so the
hidden matrices, the embedding and an untied lm_head); norm weights and scalars are not decayed.

Muon (github.com/KellerJordan/Muon; "Muon is Scalable for LLM Training", Moonshot AI 2025) updates
the hidden matrices with the orthogonalised Nesterov momentum. Fused weights are orthogonalised
one row block at a time (Q, K and V of qkv.weight; gate and up of fc1_weight), since each block is
a separate linear map that happens to share a GEMM. Everything else gets AdamW inside the same
optimizer, so one state_dict and one LR schedule cover both.
"""

import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch built without distributed support: no parameter can be a DTensor
    DTensor = None

OPTIMIZERS = ("adamw", "adamw8bit", "muon")
MUON_SCALES = ("original", "match_rms_adamw")
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
# Full fp32 matrices Muon gathers and orthogonalises together: big enough to batch a few layers' blocks,
# small enough that FSDP2's sharding still bounds the optimizer's peak memory.
MUON_BUCKET_BYTES = 256 * 2**20

# Suffixes of the hidden matrices Muon owns (model.py's parameter-name contract).
MUON_MATRICES = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc1_weight", "mlp.fc2_weight")
# bitsandbytes advises 32-bit optimizer state for embedding layers, where 8-bit state hurts stability.
FULL_PRECISION_STATE = ("embed.weight", "lm_head.weight")
# Module names that wrappers (torch.compile, activation checkpointing, FSDP1) insert into names.
WRAPPER_NAMES = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


@dataclass
class OptimConfig:
    """The optimizer. Each field's metadata is its command-line help: config.py generates train.py's flags."""

    name: str = field(default="adamw", metadata={
        "flag": "--optimizer", "choices": OPTIMIZERS,
        "help": "fused AdamW, bitsandbytes 8-bit AdamW, or Muon for the hidden matrices + AdamW for the rest"})
    lr: float = field(default=3e-3, metadata={
        "help": "peak learning rate; for muon, the Muon matrices' (the default suits the small default model)"})
    weight_decay: float = field(default=0.1, metadata={"help": "decoupled, matrices only"})
    beta1: float = field(default=0.9, metadata={"help": "Adam first-moment decay"})
    beta2: float = field(default=0.95, metadata={"help": "Adam second-moment decay"})
    eps: float = field(default=1e-8, metadata={"flag": "--adam-eps", "help": "Adam's epsilon"})
    adam_lr: float | None = field(default=None, metadata={
        "help": "peak LR of the AdamW side of a Muon run (embeddings, norms); default: --lr"})
    momentum: float = field(default=0.95, metadata={"flag": "--muon-momentum", "help": "Muon's momentum"})
    nesterov: bool = field(default=True, metadata={
        "flag": "--muon-nesterov", "help": "Muon: Nesterov momentum (--no-muon-nesterov: plain momentum)"})
    ns_steps: int = field(default=5, metadata={"help": "Newton-Schulz iterations in Muon"})
    ns_dtype: str = field(default="auto", metadata={
        "choices": ("auto", *NS_DTYPES), "help": "Newton-Schulz dtype (auto: bf16 on CUDA, fp32 elsewhere)"})
    # match_rms_adamw makes Muon's update RMS match AdamW's, so AdamW's lr and weight decay carry over.
    muon_scale: str = field(default="match_rms_adamw", metadata={
        "choices": MUON_SCALES, "help": "Muon update scale: sqrt(max(1,rows/cols)) or 0.2*sqrt(max(rows,cols))"})
    fused: bool = field(default=True, metadata={
        "flag": "--fused-adamw", "help": "AdamW: torch's fused kernel where the device has one "
                                         "(--no-fused-adamw: the foreach path, the ladder's baseline)"})

    @property
    def betas(self) -> tuple[float, float]:
        return self.beta1, self.beta2

    def validate(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; choose one of {', '.join(OPTIMIZERS)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.adam_lr is not None and not self.adam_lr > 0:
            raise ValueError(f"adam_lr must be positive, got {self.adam_lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ValueError(f"eps must be positive, got {self.eps}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if isinstance(self.ns_steps, bool) or not isinstance(self.ns_steps, int) or self.ns_steps < 1:
            raise ValueError(f"ns_steps must be a positive integer, got {self.ns_steps!r}")
        if self.ns_dtype != "auto" and self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"unknown ns_dtype {self.ns_dtype!r}; choose one of auto, {', '.join(NS_DTYPES)}")
        if self.muon_scale not in MUON_SCALES:
            raise ValueError(f"unknown muon_scale {self.muon_scale!r}; choose one of {', '.join(MUON_SCALES)}")


# ----------------------------------------------------------------------------- LR schedule


def lr_multiplier(step: int, max_steps: int, warmup: int, schedule: str, min_lr_ratio: float,
                  decay_frac: float) -> float:
    """Fraction of the peak LR at optimizer step `step` (0-based): linear warm-up, then cosine decay to
    min_lr_ratio, or "wsd": constant, then a linear decay over the last decay_frac of the steps."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = min(1.0, (step - warmup + 1) / max(1, max_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(1, round(decay_frac * max_steps))
    decay_start = max_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return 1.0 - (1 - min_lr_ratio) * progress


def set_lr(optimizer: torch.optim.Optimizer, multiplier: float) -> None:
    """Every group's LR to its peak ("base_lr") times `multiplier`."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * multiplier


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


def _adamw_groups(roles: dict, lr: float, weight_decay: float) -> list[dict]:
    groups = [_group("adamw", roles["decay"], lr, weight_decay), _group("adamw", roles["no_decay"], lr, 0.0)]
    return [g for g in groups if g["params"]]


# ----------------------------------------------------------------------------- building


def build_optimizer(model: nn.Module, cfg: OptimConfig, row_blocks: dict[str, list[int]],
                    device_type: str) -> torch.optim.Optimizer:
    """The optimizer cfg names over model's trainable parameters.

    row_blocks maps a fused weight's name to its row split (model.GPT.row_blocks()); Muon
    orthogonalises each block separately. device_type picks fused AdamW and Muon's NS dtype.
    """
    cfg.validate()
    roles = split_params(model, use_muon=cfg.name == "muon")
    if cfg.name == "adamw":
        return _build_adamw(roles, cfg, device_type)
    if cfg.name == "adamw8bit":
        return _build_adamw8bit(roles, cfg)
    return _build_muon(roles, cfg, row_blocks, device_type)


def fused_adamw_available(device_type: str) -> bool:
    """Whether torch has a fused AdamW kernel for this device, found by stepping a one-element probe."""
    probe = torch.zeros(1, device=device_type, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    try:
        torch.optim.AdamW([probe], fused=True).step()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _build_adamw(roles, cfg, device_type):
    fused = cfg.fused and fused_adamw_available(device_type)
    return torch.optim.AdamW(_adamw_groups(roles, cfg.lr, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                             eps=cfg.eps, fused=fused or None, foreach=None if fused else True)


def _build_adamw8bit(roles, cfg):
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
        manager.override_config(p, key_value_dict={"optim_bits": 32 if name in FULL_PRECISION_STATE else 8})
    return bnb.optim.AdamW8bit(_adamw_groups(roles, cfg.lr, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                               eps=cfg.eps, weight_decay=0.0)


def _build_muon(roles, cfg, row_blocks, device_type):
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
    groups = [_group("muon", roles["muon"], cfg.lr, cfg.weight_decay, row_blocks=splits)] if roles["muon"] else []
    groups += _adamw_groups(roles, cfg.adam_lr if cfg.adam_lr is not None else cfg.lr, cfg.weight_decay)
    return Muon(groups, momentum=cfg.momentum, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps, ns_dtype=ns_dtype,
                muon_scale=cfg.muon_scale, betas=cfg.betas, eps=cfg.eps)


# ----------------------------------------------------------------------------- Muon


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Approximately orthogonalise g (push its singular values towards 1) with the quintic iteration; g is
    one matrix [rows, cols] or a stack of same-shape ones [n, rows, cols], each orthogonalised on its own.

    The coefficients trade exact convergence for speed: singular values end up roughly in
    [0.7, 1.2] rather than at 1, which does not hurt training. Wide orientation keeps X X^T small.
    """
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    single = x.ndim == 2
    if single:
        x = x[None]
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    # The Frobenius norm bounds the spectral norm, so the iteration starts in range.
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    x = x.mT if tall else x
    return x[0] if single else x


def muon_buckets(todo: list, max_bytes: int) -> list[list]:
    """Consecutive runs of (param, split) pairs whose full fp32 matrices add up to at most max_bytes (a
    larger matrix is a bucket of its own). Muon gathers and orthogonalises one bucket at a time, so under
    FSDP2 a rank holds a bucket's full matrices, not the whole model's; every rank cuts the same buckets."""
    buckets, size = [[]], 0
    for p, split in todo:
        nbytes = 4 * p.numel()
        if buckets[-1] and size + nbytes > max_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((p, split))
        size += nbytes
    return [b for b in buckets if b]


def orthogonalize_blocks(blocks: list[torch.Tensor], steps: int, dtype: torch.dtype, world_size: int = 1,
                         rank: int = 0) -> list[torch.Tensor]:
    """newton_schulz of every matrix in `blocks`, with same-shape ones stacked into one batched call.

    With world_size > 1 (torch.distributed initialised), rank r orthogonalises only the r-th share of each
    stack (padded with zero matrices to a multiple of world_size; NS maps zero to zero) and an all-gather
    hands every rank all the results: each rank does 1/world_size of the work instead of all of it. The
    stacks and shares follow the order of `blocks`, so every rank must pass the same shapes in the same order.
    """
    by_shape: dict[tuple, list[int]] = {}
    for i, block in enumerate(blocks):
        by_shape.setdefault(tuple(block.shape), []).append(i)
    out: list[torch.Tensor] = [None] * len(blocks)
    for indices in by_shape.values():
        stack = torch.stack([blocks[i] for i in indices])
        if world_size > 1:
            share = -(-len(indices) // world_size)
            padded = torch.cat([stack, stack.new_zeros(share * world_size - len(indices), *stack.shape[1:])])
            mine = newton_schulz(padded[rank * share:(rank + 1) * share], steps, dtype).contiguous()
            gathered = [torch.empty_like(mine) for _ in range(world_size)]
            torch.distributed.all_gather(gathered, mine)
            result = torch.cat(gathered)[:len(indices)]
        else:
            result = newton_schulz(stack, steps, dtype)
        for i, ortho in zip(indices, result):
            out[i] = ortho
    return out


def muon_scale_factor(rows: int, cols: int, mode: str) -> float:
    """LR multiplier for one orthogonalised block of shape [rows, cols]."""
    if mode == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def _is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _check_placements(name: str, p: torch.Tensor):
    if not _is_dtensor(p):
        return
    shards = [pl for pl in p.placements if not isinstance(pl, Replicate)]
    if len(shards) > 1 or any(type(pl) is not Shard or pl.dim != 0 for pl in shards):
        raise ValueError(f"Muon needs {name} replicated or sharded on dim 0 (FSDP2), got {p.placements}")


def _first_local_row(p: torch.Tensor) -> int:
    """Index of this rank's first row of p; shards follow torch.chunk (ceil-sized, trailing ones short or empty)."""
    if not _is_dtensor(p):
        return 0
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            chunk = -(-p.shape[0] // p.device_mesh.size(mesh_dim))
            return min(p.device_mesh.get_local_rank(mesh_dim) * chunk, p.shape[0])
    return 0


def _full_matrix(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The whole matrix whose shard on this rank is `local` (laid out like p); a no-op off DTensors."""
    if not _is_dtensor(p):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()


class Muon(torch.optim.Optimizer):
    """Muon for groups of kind "muon", AdamW for groups of kind "adamw", in one optimizer.

    Muon groups carry "row_blocks": for each parameter, the row sizes to orthogonalise separately.
    Works on plain tensors (one device, DDP: every rank has the same averaged grads) and on FSDP2's
    Shard(0) DTensors (each rank gathers the full momentum-corrected matrix and applies its own rows;
    state stays sharded like the parameters). Every block of every matrix is orthogonalised in one
    batched call per shape (orthogonalize_blocks); under torch.distributed with split_across_ranks each
    rank computes 1/world_size of them and all-gathers the rest, instead of every rank repeating it all.
    """

    def __init__(self, params, *, momentum=0.95, nesterov=True, ns_steps=5, ns_dtype="fp32",
                 muon_scale="match_rms_adamw", betas=(0.9, 0.95), eps=1e-8, split_across_ranks=True):
        defaults = dict(lr=1e-3, weight_decay=0.0, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_dtype=ns_dtype, muon_scale=muon_scale, betas=betas, eps=eps, kind="adamw")
        super().__init__(params, defaults)
        self.split_across_ranks = split_across_ranks
        for group in self.param_groups:
            if group["kind"] != "muon":
                continue
            for name, p in zip(group["names"], group["params"]):
                if p.ndim != 2:
                    raise ValueError(f"Muon needs 2-D matrices, {name} has shape {tuple(p.shape)}")
                _check_placements(name, p)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon_step(group)
            else:
                for p in group["params"]:
                    if p.grad is not None:
                        self._adamw_update(p, group)
        return loss

    def _ranks(self) -> tuple[int, int]:
        dist = torch.distributed
        if self.split_across_ranks and dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0

    def _momentum(self, p, group) -> torch.Tensor:
        """Update p's momentum; -> the full (gathered, under FSDP2) Nesterov-corrected update matrix."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        grad, buf = _local(p.grad), _local(state["momentum_buffer"])
        buf.lerp_(grad, 1 - group["momentum"])
        update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        return _full_matrix(update, p)

    def _muon_step(self, group):
        todo = [(p, split) for p, split in zip(group["params"], group["row_blocks"]) if p.grad is not None]
        for bucket in muon_buckets(todo, MUON_BUCKET_BYTES):
            self._muon_bucket(bucket, group)

    def _muon_bucket(self, todo, group):
        """Momentum, Newton-Schulz and the update for a bucket of (param, row split) pairs."""
        blocks, where = [], []  # where[k]: (index into todo, first row) of blocks[k]
        for i, (p, split) in enumerate(todo):
            full, start = self._momentum(p, group), 0
            for rows in split:
                blocks.append(full[start:start + rows])
                where.append((i, start))
                start += rows
        orthos = orthogonalize_blocks(blocks, group["ns_steps"], NS_DTYPES[group["ns_dtype"]], *self._ranks())
        lr = group["lr"]
        for p, _ in todo:
            _local(p).mul_(1 - lr * group["weight_decay"])
        for (i, start), ortho in zip(where, orthos):
            p = todo[i][0]
            param, first = _local(p), _first_local_row(p)
            lo, hi = max(start, first), min(start + ortho.shape[0], first + param.shape[0])
            if lo < hi:  # this block overlaps this rank's rows
                scale = muon_scale_factor(ortho.shape[0], ortho.shape[1], group["muon_scale"])
                param[lo - first:hi - first].add_(ortho[lo - start:hi - start], alpha=-lr * scale)

    def _adamw_update(self, p, group):
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        param, grad = _local(p), _local(p.grad)
        exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        (beta1, beta2), lr = group["betas"], group["lr"]
        state["step"] += 1
        step = state["step"].item()
        if group["weight_decay"] != 0:
            param.mul_(1 - lr * group["weight_decay"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(group["eps"])
        param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


# ----------------------------------------------------------------------------- reporting


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in the optimizer state on this rank (a DTensor counts its local shard).

    Tensors shared between parameters (bitsandbytes' quantisation maps) count once. State is
    created lazily, so call this after the first step.
    """
    seen, total = set(), 0
    for state in optimizer.state.values():
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
    if isinstance(optimizer, Muon):
        d = optimizer.defaults
        nesterov = ", nesterov" if d["nesterov"] else ""
        head = (f"Muon (NS {d['ns_steps']} steps in {d['ns_dtype']}, scale {d['muon_scale']}, "
                f"momentum {d['momentum']}{nesterov}) + AdamW")
    elif isinstance(optimizer, torch.optim.AdamW):
        head = "AdamW (fused)" if optimizer.defaults.get("fused") else "AdamW (foreach)"
    else:
        kept = [n for g in optimizer.param_groups for n in g.get("names", []) if n in FULL_PRECISION_STATE]
        head = f"{type(optimizer).__name__} (32-bit state for {', '.join(kept) or 'none'})"
    lines = [head]
    for g in optimizer.param_groups:
        numel = sum(p.numel() for p in g["params"])
        lines.append(f"    {g.get('kind', 'adamw'):<5}  lr {g['base_lr']:g}  wd {g['weight_decay']:g}  "
                     f"{len(g['params'])} tensors, {numel:,} params: {_short_names(g.get('names', []))}")
    return "\n".join(lines)
