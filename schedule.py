"""The LR schedule and how the optimizer carries it: a multiplier of each parameter group's peak LR.

    set_lr(optimizer, lr_multiplier(step, max_steps, warmup, "wsd", min_lr_ratio, decay_frac))
    record["lr"] = current_lr(optimizer)   # what the optimizer applies, never recomputed from the flags

Warm-up is linear; then cosine decay to min_lr_ratio, or WSD (warmup-stable-decay): constant, then a linear
decay over the last decay_frac of the run, which is what lets a run be extended from a pre-decay checkpoint.
"""

import math

import torch


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


def muon_momentum(step: int | torch.Tensor, warmup: int, start: float, end: float) -> float | torch.Tensor:
    """Muon's momentum at optimizer step `step` (0-based): linear from start at step 0 to end at step warmup,
    then end. Written as end - (end - start) * (1 - fraction), so that it is exactly end once warmed up.
    step may be a scalar tensor, giving one in its dtype: Muon (muon.py) passes its checkpointed count of
    steps as it is on the device, so that the host never waits for it."""
    if not warmup:
        return end
    fraction = step / warmup
    fraction = fraction.clamp(max=1.0) if torch.is_tensor(fraction) else min(1.0, fraction)
    return end - (end - start) * (1 - fraction)


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


def batch_warmup_warning(warmup_steps: int, start: float, max_steps: int, layout) -> str | None:
    """schedule_warning's counterpart for the batch warm-up: a ramp whose last step, the run's, is still short
    of the whole global batch, or None. layout: the run's batch.BatchLayout, whose at_step gives a step's."""
    last = layout.at_step(max_steps - 1, warmup_steps, start).grad_accum
    if last == layout.grad_accum:
        return None
    return (f"warning: --batch-warmup-steps {warmup_steps} is not shorter than the run ({max_steps} steps): the "
            f"global batch reaches only {last} of its {layout.grad_accum} micro-steps; lower --batch-warmup-steps")


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


