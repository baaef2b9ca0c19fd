import contextlib
import math
import os

import pytest
import torch

import batch
import optim
import plan
import telemetry
import train
from conftest import GPT2_TINY, TINY_FLAGS
from model import GPT, ModelConfig
from optim import OptimConfig, build_optimizer
from sizing import flops_per_token

TIMED = plan.StepTime(0.25, "one micro-step timed, eager")


def test_the_time_row_counts_micro_steps_the_optimizer_evals_and_checkpoints():
    step = TIMED._replace(optimizer_s=0.5)
    extras = plan.RunExtras(evals=4, eval_s=3.0, checkpoints=5, checkpoint_s=0.5)
    assert plan.describe(step, 4, 1_228_800, 8192, extras) == (
        "a step ~1.5 s (4 micro-steps of 0.25 s: one micro-step timed, eager; the optimizer 0.5 s), the run "
        "~3m59s with 4 evals of 3 s and 5 checkpoints of 0.5 s (compilation not counted)")  # 150 x 1.5 + 12 + 2.5
    assert plan.describe(TIMED, 1, 2048, 2048).startswith("a step ~0.25 s (1 micro-step of 0.25 s")
    assert plan.describe(TIMED, 1, 2048, 2048).endswith("the run ~0.25 s (compilation not counted)")
    # A batch warm-up's smaller steps: the micro-steps follow the tokens, the optimizer the steps' count of them.
    assert plan.run_seconds(TIMED, 4, 3 * 8192 + 4096, 8192) == pytest.approx(3.5)


def test_steps_due_counts_an_interval_and_the_end_by_arithmetic():
    every = lambda start, end, *intervals: sum(  # noqa: E731 the rule, step by step
        any(i and d % i == 0 for i in intervals) or d == end for d in range(start + 1, end + 1))
    for start, end, intervals in [(0, 100, (25,)), (0, 101, (25,)), (0, 100, (0,)), (10, 100, (25, 10)),
                                  (0, 97, (6, 4)), (0, 10**6, (1000, 250)), (50, 50, (10,)), (0, 7, (0, 3))]:
        assert plan.steps_due(start, end, *intervals) == every(start, end, *intervals), (start, end, intervals)


def test_an_optimizer_step_is_priced_from_its_newton_schulz_flops_and_bytes():
    work = optim.StepWork(ns_flops=2 * 10**9, ns_dtype=torch.float32, elementwise_bytes=10**9)
    assert plan.optimizer_seconds(work, ns_rate=1e9, byte_rate=1e9) == pytest.approx(3.0)
    assert plan.optimizer_seconds(work._replace(ns_flops=0), None, 2e9) == pytest.approx(0.5)
    model = GPT(ModelConfig(**GPT2_TINY))
    muon = build_optimizer(model, OptimConfig(name="muon"), model.row_blocks(), "cpu")
    adamw = build_optimizer(model, OptimConfig(name="adamw"), model.row_blocks(), "cpu")
    n = sum(p.numel() for p in model.parameters())
    assert optim.step_work(adamw, 8 * n) == (0, None, 40 * n)
    blocks = [(rows, p.shape[1]) for name, p in model.named_parameters() if name.endswith(optim.MUON_MATRICES)
              for rows in model.row_blocks().get(name, [p.shape[0]])]
    flops = 5 * sum(2 * (2 * min(r, c) ** 2 * max(r, c) + min(r, c) ** 3) for r, c in blocks)
    assert optim.step_work(muon, 0) == (flops, torch.float32, 24 * n)
    assert optim.step_work(muon, 0, world_size=2, sharded=True) == (flops // 2, torch.float32, 12 * n)


def test_the_copy_and_write_rates_are_measured(tmp_path):
    assert 1e8 < plan.copy_rate(torch.device("cpu")) < 1e13  # bytes/s: a CPU copies 1e9 or more
    assert 1e5 < plan.write_rate(str(tmp_path)) and os.listdir(tmp_path) == []  # the probe file is gone
    assert plan.write_rate(str(tmp_path / "missing")) is None  # a disk that refuses: not priced, no error
    unpriced = plan.RunExtras(checkpoints=2, checkpoint_s=None)
    assert plan.describe(TIMED, 1, 2048, 2048, unpriced).endswith(
        "with 2 checkpoints (not timed: the disk refused a test write) (compilation not counted)")


def test_times_read_as_a_person_reads_them():
    assert [plan._seconds(s) for s in (0.3125, 59.0, 245.0, 27_000.0, 3_654_000.0)] == [
        "0.312 s", "59 s", "4m05s", "7h30m", "42.3 days"]


def test_a_run_over_a_day_or_a_step_over_a_minute_is_warned_of_with_the_flag_to_change():
    assert plan.warnings(TIMED, 4, 1_228_800, 8192, "--max-steps") == []
    slow = plan.StepTime(20.0, "FLOPs at the measured matmul rate", 1.0)  # 4 micro-steps and the optimizer: 81 s
    day = plan.warnings(slow, 4, 8192 * 1100, 8192, "--max-tokens")  # 1,100 steps of 81 s
    assert day[0] == ("warning: the run is planned at ~24h45m on this device (9,011,200 tokens at ~1m21s a "
                      "step); lower --max-tokens for a shorter one")
    assert day[1] == ("warning: each step will take ~1m21s (4 micro-steps of 20 s, the optimizer 1 s), so the "
                      "first loss is minutes away; lower --total-batch-tokens (or --grad-accum) for smaller steps")


def test_a_cpu_run_over_a_day_is_told_what_one_h100_would_take():
    slow = plan.StepTime(20.0, "one micro-step timed, eager")
    flops = plan.H100_MEASURED_MFU * plan.H100_PEAK_FLOPS * 3 * 3600  # three hours of an H100 at that MFU
    (day, _) = plan.warnings(slow, 4, 8192 * 1100, 8192, "--max-tokens", cpu_flops=flops)
    assert day.endswith("lower --max-tokens for a shorter one; this run wants a GPU: one H100 would take about "
                        "3h00m (its FLOPs at the 31% MFU gpt2-124m reached there)")


def test_the_matmul_rate_is_measured():
    rate = plan.matmul_rate(torch.device("cpu"), torch.float32, 64, 128, 256)
    assert math.isfinite(rate) and 1e7 < rate < 1e14  # FLOP/s: a CPU core does 1e9 or more


def test_the_probe_leaves_no_gradient_and_the_rng_where_it_was():
    torch.manual_seed(0)
    model = GPT(ModelConfig(**GPT2_TINY))
    state = torch.get_rng_state()
    seconds = plan.time_micro_step(model, 2, 16, torch.device("cpu"), contextlib.nullcontext)
    assert seconds > 0 and all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), state)


def test_probes_are_the_micro_step_one_sequence_and_a_quarter_of_one():
    assert plan.probes(16, 1024) == [(16, 1024), (1, 1024), (1, 256)]
    assert plan.probes(1, 32) == [(1, 32), (1, 16)]
    assert plan.probes(1, 16) == [(1, 16)]
    assert plan.probes(4, 1000) == [(4, 1000), (1, 240)]  # FP8's multiple of 16 tokens: not (1, 1000)


def test_the_probe_is_the_largest_the_budget_affords_and_is_scaled_by_flops(monkeypatch):
    model = GPT(ModelConfig(**GPT2_TINY))
    layout = batch.BatchLayout(micro_batch=8, seq_len=32, grad_accum=1, world_size=1)
    cpu = torch.device("cpu")
    monkeypatch.setattr(plan, "matmul_rate", lambda *args: 1e9)  # a known rate prices the probes
    passes = 1 + plan.TIMED_PASSES
    micro = passes * flops_per_token(model.config, 32) * 8 * 32 / 1e9  # the micro-step's passes, in seconds
    monkeypatch.setattr(plan, "PROBE_MAX_S", micro / 2)  # affords one sequence, not the micro-batch of 8
    assert plan.step_time(model, layout, cpu, None, None, sharded=False).how == \
        "a 1 x 32-token micro-batch timed, eager, and scaled by FLOPs x8"
    # 5% of a run of 20 micro-steps a pass is the whole micro-step's passes: timed as it is
    assert plan.step_time(model, layout, cpu, None, None, False, planned_micro_steps=20 * passes).how == \
        "one micro-step timed, eager"
    monkeypatch.setattr(plan, "PROBE_MAX_S", micro / 100)  # not even a quarter sequence: the FLOP estimate
    assert plan.step_time(model, layout, cpu, None, None, sharded=False).how.startswith("an estimate: FLOPs at one")


def test_a_sharded_or_out_of_memory_probe_falls_back_to_the_estimate(monkeypatch):
    model = GPT(ModelConfig(**GPT2_TINY))
    layout = batch.BatchLayout(micro_batch=2, seq_len=16, grad_accum=1, world_size=1)
    cpu = torch.device("cpu")
    assert plan.step_time(model, layout, cpu, None, None, sharded=False).how == "one micro-step timed, eager"
    assert plan.step_time(model, layout, cpu, None, None, sharded=True).how.startswith("an estimate")

    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(plan, "time_micro_step", out_of_memory)  # the first step retries smaller; the plan estimates
    assert plan.step_time(model, layout, cpu, None, None, sharded=False).how.startswith("an estimate")


def test_a_long_step_says_which_micro_step_it_is_at(tmp_path, tiny_data, capsys, monkeypatch):
    monkeypatch.setattr(telemetry, "MICRO_LINE_S", 0.0)  # every micro-step's line, not one each 10 s
    train.main(["--data", tiny_data, "--out-dir", str(tmp_path), *TINY_FLAGS, "--grad-accum", "3", "--max-steps", "2",
                "--warmup", "1", "--eval-interval", "0", "--device", "cpu", "--compile", "off"])
    out, err = capsys.readouterr()
    assert "  plan             768 tokens in 2 steps (their time: the last row)" in out
    assert "  time             a step ~" in out and "(3 micro-steps of " in out
    lines = [line for line in err.splitlines() if line.startswith("micro-step")]
    assert [line.split(",")[0] for line in lines] == ["micro-step 1 of 3 of step 1", "micro-step 2 of 3 of step 1",
                                                      "micro-step 1 of 3 of step 2", "micro-step 2 of 3 of step 2"]
