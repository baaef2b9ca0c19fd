"""The LR schedule and how the optimizer carries it: a multiplier of each parameter group's peak LR.

    set_lr(optimizer, lr_multiplier(step, max_steps, warmup, "wsd", min_lr_ratio, decay_frac))
    record["lr"] = current_lr(optimizer)   # what the optimizer applies, never recomputed from the flags
    note = resume_lr(cfg, saved, now, meta, max_steps)   # what a resume's changed settings do to the LR

Warm-up is linear; then cosine decay to min_lr_ratio, or WSD (warmup-stable-decay): constant, then a linear
decay over the last decay_frac of the run, which is what lets a run be extended from a pre-decay checkpoint.
"""

import math

import torch

from cli import UsageError


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


def schedule_warning(warmup: int, max_steps: int, schedule: str, decay_frac: float) -> str | None:
    """What is wrong with a warm-up that does not fit the run, for a start-up warning, or None. Not refused:
    a short test run with the default warm-up is legitimate, but the user should know its LR never peaks."""
    if warmup > max_steps:
        peak = lr_multiplier(max_steps - 1, max_steps, warmup, schedule, 0.0, decay_frac)
        return (f"warning: --warmup {warmup} is not shorter than the run ({max_steps} steps): the LR reaches only "
                f"{100 * peak:.0f}% of its peak; lower --warmup")
    decay_start = max_steps - max(1, round(decay_frac * max_steps))
    if schedule == "wsd" and warmup > decay_start:
        return (f"warning: --warmup {warmup} runs into the decay, which starts at step {decay_start} of "
                f"{max_steps}: the LR never holds its peak; lower --warmup or --decay-frac")
    if schedule == "cosine" and warmup >= max_steps - 1:
        return (f"warning: --warmup {warmup} leaves the cosine decay no step of the run's {max_steps}: the LR never "
                "decays; lower --warmup or run longer")
    return None


def set_lr(optimizer: torch.optim.Optimizer, multiplier: float) -> None:
    """Every group's LR to its peak ("base_lr") times `multiplier`."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * multiplier


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The LR the optimizer applies now to the parameters --lr is the peak of (Muon's matrices under muon, the
    decayed matrices under AdamW): build_optimizer puts their group first."""
    return optimizer.param_groups[0]["lr"]


def current_multiplier(optimizer: torch.optim.Optimizer) -> float:
    """The multiplier set_lr last applied: the fraction of its peak every group's LR is at."""
    group = optimizer.param_groups[0]
    return group["lr"] / group["base_lr"]


# ----------------------------------------------------------------------------- the LR across a resume


# The settings that decide the global batch: a resume that changes one of them changes it on purpose
# (batch.resume_layout); the run's length in steps, and so its LR, depends on them.
BATCH_KEYS = ("data.batch_size", "data.grad_accum", "data.total_batch_tokens", "model.max_seq_len")
# The settings the LR of a step depends on: the peak, the schedule, and the run's length in steps.
LR_KEYS = ("optim.lr", "schedule.max_steps", "schedule.max_tokens", "schedule.warmup", "schedule.schedule",
           "schedule.min_lr_ratio", "schedule.decay_frac", "schedule.batch_warmup_steps",
           "schedule.batch_warmup_start", *BATCH_KEYS)
# A resumed LR at most this factor above the checkpoint's is no re-warm: a rounding, or a negligible change.
REWARM_TOLERANCE = 1.01


def resume_lr(cfg, saved: dict, now: dict, meta: dict, max_steps: int) -> str | None:
    """What a resume with a changed LR setting (LR_KEYS) does to the LR: a note "the LR goes from X at the
    checkpoint (step N) to Y at the next step", or None when none changed or the checkpoint records no
    "lr_multiplier". saved, now: the checkpoint's settings and cfg's (config.flat_dict, config.flat_values).
    UsageError for a re-warm (is_rewarm) unless --allow-lr-rewarm. The LRs are those --lr is the peak of, with
    the fault-tolerance LR scale the resumed run keeps (meta "lr_scale")."""
    multiplier = meta.get("lr_multiplier")
    if multiplier is None or not any(key in saved and saved[key] != now[key] for key in LR_KEYS):
        return None
    s, step, scale = cfg.schedule, meta["step"], meta["lr_scale"]
    old = saved["optim.lr"] * multiplier
    new = cfg.optim.lr * scale * lr_multiplier(step, max_steps, s.warmup, s.schedule, s.min_lr_ratio, s.decay_frac)
    effect = f"the LR goes from {old:.3g} at the checkpoint (step {step}) to {new:.3g} at the next step"
    if not s.allow_lr_rewarm and is_rewarm(step, saved["schedule.warmup"], multiplier / scale, old, new):
        raise UsageError(f"--resume: {effect}, up again after its decay had begun; resume from a checkpoint from "
                         "before the decay, or pass --allow-lr-rewarm to re-warm it")
    return f"note: {effect}"


def is_rewarm(step: int, warmup: int, schedule_multiplier: float, old_lr: float, new_lr: float) -> bool:
    """Whether a resume at `step` re-warms the LR: the checkpoint was past its warm-up (`warmup` steps) and
    decaying (its schedule's multiplier at its last step below 1), and the LR of the next step is more than
    REWARM_TOLERANCE times the checkpoint's. In the warm-up the LR rises anyway; in a WSD run's stable phase it
    has not decayed, so a higher --lr there is a new peak, not a re-warm."""
    decaying = step > warmup and schedule_multiplier < 1 and not math.isclose(schedule_multiplier, 1)
    return decaying and new_lr > REWARM_TOLERANCE * old_lr
