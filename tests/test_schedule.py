"""schedule.py: the LR multiplier's shape, the warnings for a warm-up that does not fit the run, and what a resume's
changed settings do to the LR (a note, or a refused re-warm)."""

import re

import pytest

import config
import schedule
from cli import UsageError
from schedule import lr_multiplier, schedule_warning


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_lr_schedule_warms_up_then_decays_to_min(schedule):
    mults = [lr_multiplier(s, 100, 10, schedule, 0.1, 0.2) for s in range(100)]
    assert mults[0] == pytest.approx(0.1) and mults[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(mults[:10], mults[1:10]))
    assert all(a >= b for a, b in zip(mults[10:], mults[11:]))
    assert mults[-1] == pytest.approx(0.1)


def test_wsd_is_flat_until_the_decay_phase():
    mults = [lr_multiplier(s, 100, 10, "wsd", 0.0, 0.2) for s in range(100)]
    assert mults[10:80] == [1.0] * 70
    assert mults[80] < 1.0 and mults[-1] == 0.0


def test_cosine_midpoint():
    assert lr_multiplier(54, 100, 10, "cosine", 0.0, 0.2) == pytest.approx(0.5)


def test_a_warmup_that_does_not_fit_the_run_is_named():
    assert "reaches only 67% of its peak" in schedule_warning(15, 10, "wsd", 0.2)
    assert "runs into the decay, which starts at step 80" in schedule_warning(90, 100, "wsd", 0.2)
    assert schedule_warning(90, 100, "cosine", 0.2) is None and schedule_warning(15, 150, "wsd", 0.2) is None
    assert "the LR never decays" in schedule_warning(10, 10, "cosine", 0.2)  # the peak, but no decay after it





def test_a_cosine_run_too_short_to_decay_is_warned_and_one_that_decays_is_not():
    assert "the LR never decays" in schedule_warning(2, 3, "cosine", 0.2)
    assert schedule_warning(1, 3, "cosine", 0.2) is None
    assert schedule_warning(2, 3, "wsd", 0.34) is None  # WSD decays in its own last steps


def lr_on_resume(saved_flags, flags, step, lr_scale=1.0, **meta):
    """schedule.resume_lr for the checkpoint at `step` of a run with saved_flags (its last LR multiplier as the
    Checkpointer records it), resumed with flags."""
    saved = config.parse_args(saved_flags)
    s = saved.schedule
    multiplier = lr_scale * lr_multiplier(step - 1, s.max_steps, s.warmup, s.schedule, s.min_lr_ratio, s.decay_frac)
    meta = {"step": step, "lr_multiplier": multiplier, "lr_scale": lr_scale, "train_config": config.to_dict(saved),
            **meta}
    cfg = config.parse_args(flags)
    return schedule.resume_lr(cfg, config.flat_dict(meta["train_config"]), config.flat_values(cfg), meta,
                              cfg.schedule.max_steps)


def test_a_resume_that_changes_the_lr_schedule_says_what_it_does_and_refuses_a_rewarm():
    extended = "the LR goes from 0.0006 at the checkpoint (step 20) to 0.00384 at the next step"
    with pytest.raises(UsageError, match=f"^--resume: {re.escape(extended)}, up again after its decay had begun"):
        lr_on_resume(["--max-steps", "20"], ["--max-steps", "24"], 20)  # a finished WSD run, 10% of its peak
    assert lr_on_resume(["--max-steps", "20"], ["--max-steps", "24", "--allow-lr-rewarm"], 20) == f"note: {extended}"
    with pytest.raises(UsageError, match="after its decay had begun"):  # cosine, halfway down, made longer
        lr_on_resume(["--schedule", "cosine", "--max-steps", "100"], ["--schedule", "cosine", "--max-steps", "150"], 60)
    with pytest.raises(UsageError, match="after its decay had begun"):  # a higher peak, mid-decay
        lr_on_resume(["--max-steps", "20"], ["--max-steps", "20", "--lr", "2e-2"], 18)
    # Told, not refused: in the warm-up, in the stable phase (a new peak there is no re-warm), after a rollback
    # halved the LR, a lower LR mid-decay, and a rise within rounding.
    warm = ["--warmup", "15"]  # both steps well inside it
    assert lr_on_resume([*warm, "--max-steps", "2"], [*warm, "--max-steps", "3"], 2) == (
        "note: the LR goes from 0.0008 at the checkpoint (step 2) to 0.0012 at the next step")
    assert lr_on_resume(["--max-steps", "100"], ["--max-steps", "200", "--lr", "1e-2"], 50) == (
        "note: the LR goes from 0.006 at the checkpoint (step 50) to 0.01 at the next step")
    assert lr_on_resume(["--max-steps", "100"], ["--lr", "1e-2"], 50, lr_scale=0.5).endswith(
        "from 0.003 at the checkpoint (step 50) to 0.005 at the next step")
    assert lr_on_resume(["--max-steps", "20"], ["--max-steps", "24", "--lr", "5e-4"], 20).endswith(
        "to 0.00032 at the next step")
    assert not schedule.is_rewarm(20, 15, 0.1, 6e-4, 1.005 * 6e-4) and schedule.is_rewarm(20, 15, 0.1, 6e-4, 6.1e-4)
    # Nothing the LR depends on changed, or a checkpoint from before the multiplier was recorded: nothing to say.
    assert lr_on_resume(["--max-steps", "20"], ["--max-steps", "20", "--eval-interval", "5"], 20) is None
    assert lr_on_resume(["--max-steps", "20"], ["--max-steps", "24"], 20, lr_multiplier=None) is None
