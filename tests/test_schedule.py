"""schedule.py: the LR multiplier's shape, and the warnings for a warm-up that does not fit the run."""

import pytest

from schedule import lr_multiplier, muon_momentum, schedule_warning


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


def test_muon_momentum_ramps_linearly_then_holds_exactly():
    assert muon_momentum(0, 300, 0.85, 0.95) == 0.85
    assert muon_momentum(150, 300, 0.85, 0.95) == pytest.approx(0.90)
    assert muon_momentum(300, 300, 0.85, 0.95) == muon_momentum(10**6, 300, 0.85, 0.95) == 0.95
    assert muon_momentum(0, 0, 0.85, 0.95) == 0.95  # no warm-up


def test_a_cosine_run_too_short_to_decay_is_warned_and_one_that_decays_is_not():
    assert "the LR never decays" in schedule_warning(2, 3, "cosine", 0.2)
    assert schedule_warning(1, 3, "cosine", 0.2) is None
    assert schedule_warning(2, 3, "wsd", 0.34) is None  # WSD decays in its own last steps
