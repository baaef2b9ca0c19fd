"""batch.py: how a step's batch is cut, how many steps a run takes and how many epochs they read, and what a resume
keeps of both."""

import math

import pytest

import batch
import config
import data
from cli import UsageError

# ----------------------------------------------------------------------------- the layout of a step


def test_batch_layout_is_the_one_tokens_per_step():
    cfg = config.parse_args(["--batch-size", "4", "--seq-len", "32", "--grad-accum", "3"])
    layout = batch.batch_layout(cfg, world_size=2)
    assert layout == batch.BatchLayout(micro_batch=4, seq_len=32, grad_accum=3, world_size=2)
    assert layout.tokens_per_step == 4 * 32 * 3 * 2 and layout.sequences_per_rank == 12


def test_a_smaller_micro_batch_keeps_the_global_batch():
    layout = batch.BatchLayout(micro_batch=8, seq_len=16, grad_accum=2, world_size=1)
    smaller = layout.with_micro_batch(4)
    assert (smaller.micro_batch, smaller.grad_accum) == (4, 4)
    assert smaller.tokens_per_step == layout.tokens_per_step


def test_auto_batch_layout_derives_accumulation_from_the_probed_size():
    cfg = config.parse_args(["--batch-size", "auto", "--total-batch-tokens", "4096", "--seq-len", "64"])
    assert batch.per_rank_sequences(cfg, world_size=2) == 32
    assert batch.batch_layout(cfg, world_size=2, micro_batch=8).grad_accum == 4


def test_total_batch_tokens_derives_grad_accum():
    cfg = config.parse_args(["--total-batch-tokens", "4096", "--batch-size", "4", "--seq-len", "256"])
    assert batch.batch_layout(cfg).grad_accum == 4
    assert batch.batch_layout(cfg, world_size=2).grad_accum == 2
    with pytest.raises(UsageError, match="not a multiple of .* = 3072: --total-batch-tokens 3072 fits --batch-size 4$"):
        batch.batch_layout(cfg, world_size=3)  # 4096 is not whole sequences on each of 3 ranks
    wide = config.parse_args(["--total-batch-tokens", "2048", "--batch-size", "8", "--seq-len", "256"])
    with pytest.raises(UsageError, match="= 4096: --batch-size 4 divides it, or --total-batch-tokens 4096 fits"):
        batch.batch_layout(wide, world_size=2)


def test_max_tokens_derives_max_steps():
    cfg = config.parse_args(["--max-tokens", "10000"])
    layout = batch.BatchLayout(micro_batch=32, seq_len=128, grad_accum=1, world_size=1)  # 4096 tokens a step
    assert batch.max_steps(cfg, layout) == math.ceil(10000 / 4096)


def test_batch_warmup_ramps_whole_micro_steps_to_the_full_batch():
    steps = [batch.warmup_micro_steps(step, 8, 4, 0.25) for step in range(6)]
    assert steps == [2, 4, 5, 7, 8, 8]  # 0.25, 0.4375, 0.625, 0.8125 of 8, rounded; then all of it
    assert [batch.warmup_micro_steps(s, 3, 10, 0.01) for s in (0, 9, 10)] == [1, 3, 3]  # at least one
    assert batch.warmup_micro_steps(0, 8, 0, 0.25) == 8  # off
    layout = batch.BatchLayout(micro_batch=2, seq_len=16, grad_accum=8, world_size=2)
    assert layout.at_step(1, 4, 0.25) == batch.BatchLayout(2, 16, 4, 2) and layout.at_step(4, 4, 0.25) is layout


def test_batch_warmup_keeps_max_tokens_the_same_budget():
    layout = batch.BatchLayout(micro_batch=1, seq_len=32, grad_accum=4, world_size=1)  # 32 tokens a micro-step
    # Ramp: 1, 2, 3, 3 micro-steps (224 tokens short of 4 full steps), then 4 a step.
    assert batch.steps_for_tokens(640, layout, 4, 0.25) == 7 and batch.steps_for_tokens(640, layout) == 5
    assert batch.steps_for_tokens(64, layout, 4, 0.25) == 2  # the budget ends inside the ramp
    cfg = config.parse_args(["--max-tokens", "640", "--batch-warmup-steps", "4", "--grad-accum", "4"])
    assert batch.max_steps(cfg, layout) == 7


# ----------------------------------------------------------------------------- passes over the data


def test_planned_tokens_count_the_batch_warmup_and_what_a_resume_trained_before():
    layout = batch.BatchLayout(micro_batch=1, seq_len=32, grad_accum=4, world_size=1)  # 32 tokens a micro-step
    # Ramp: 1, 2, 3, 3 micro-steps, then 4 a step.
    assert [batch.tokens_for_steps(layout, 0, end, 4, 0.25) for end in (0, 2, 4, 7)] == [0, 96, 288, 672]
    assert batch.tokens_for_steps(layout, 2, 7, 4, 0.25) == 576 and batch.tokens_for_steps(layout, 5, 7, 4, 0.25) == 256
    assert batch.tokens_for_steps(layout, 0, 150) == 150 * 128
    cfg = config.parse_args(["--max-tokens", "640", "--batch-warmup-steps", "4", "--grad-accum", "4"])
    assert batch.planned_tokens(cfg, layout, 0, batch.max_steps(cfg, layout)) == 672  # steps_for_tokens' steps
    assert batch.planned_tokens(cfg, layout, 2, 7, start_tokens=1000) == 1576  # the checkpoint's count, then ours


def test_epochs_are_the_tokens_read_over_what_one_epoch_of_the_split_trains_on():
    assert data.epoch_tokens([5000, 4001], 32, "windows") == (156 + 125) * 32  # (n - 1) // 32 windows a shard
    assert data.epoch_tokens([5000, 4001], 32, "bos") == (151 + 121) * 32  # at most n // 33 rows a shard
    assert batch.describe_epochs(307_200, 92_160, False) == "307,200 tokens of a 92,160-token train split: 3.33 epochs"
    assert batch.describe_epochs(307_200, 92_160, True).endswith("at most 92,160 tokens an epoch: at least 3.33 epochs")
    assert batch.epochs_warning(config.parse_args([]), 92_160, 92_160) is None  # one epoch exactly
    assert batch.epochs_warning(config.parse_args([]), 307_200, 92_160) == (
        "warning: the run will read 307,200 tokens of a 92,160-token train split: 3.33 epochs, so it trains on the "
        "same data more than once; lower --max-steps for one epoch or less, or prepare more data")
    by_tokens = batch.epochs_warning(config.parse_args(["--max-tokens", "307200", "--packing", "bos"]), 307_200, 92_160)
    assert "at least 3.33 epochs" in by_tokens and "lower --max-tokens for one epoch" in by_tokens


def test_a_mixture_warns_of_each_source_it_reads_more_than_once():
    cfg = config.parse_args(["--warmup", "2"])
    layout = batch.BatchLayout(micro_batch=4, seq_len=32, grad_accum=1, world_size=1)
    plan = [(70_000, 500_000, "web"), (30_000, 20_000, "code")]  # MixtureLoader.epoch_plan of 100,000 tokens
    assert batch.plan_warnings(cfg, layout, 100, plan) == [
        "warning: the run will read 30,000 tokens of source code's 20,000-token train split: 1.50 epochs, so it "
        "trains on the same data more than once; lower --max-steps for one epoch or less, or prepare more data, "
        "or lower the weight of code"]
    assert len(batch.plan_warnings(cfg, layout, 1, plan)) == 2  # and a warm-up longer than the run


# ----------------------------------------------------------------------------- resuming


def test_resume_at_another_world_size_derives_grad_accum_or_refuses():
    cfg = config.parse_args(["--batch-size", "4", "--seq-len", "32"])
    saved = {"batch_tokens": 256, "world_size": 2, "train_config": config.to_dict(cfg)}
    notes = []
    one_rank = batch.batch_layout(cfg, world_size=1)
    assert batch.resume_layout(cfg, one_rank, saved, notes.append).grad_accum == 2
    assert "grad accumulation 1 -> 2 keeps the global batch of 256 tokens/step" in notes[0]
    with pytest.raises(UsageError, match="not a whole number of micro-steps of 384 tokens .* no --batch-size can "
                                         "keep it: it is not whole sequences of 32 on each of 3 ranks"):
        batch.resume_layout(cfg, batch.batch_layout(cfg, world_size=3), saved, notes.append)
    eight = config.parse_args(["--batch-size", "8", "--seq-len", "32"])
    with pytest.raises(UsageError, match="--batch-size 4 divides it"):  # 512 tokens: 4 sequences a rank on 4
        batch.resume_layout(eight, batch.batch_layout(eight, world_size=4), {**saved, "batch_tokens": 512,
                                                                              "train_config": config.to_dict(eight)},
                            notes.append)
    # The same world size, a checkpoint that predates batch_tokens, or a batch changed on purpose: as asked.
    assert batch.resume_layout(cfg, one_rank, {**saved, "world_size": 1}, notes.append) == one_rank
    assert batch.resume_layout(cfg, one_rank, {"train_config": saved["train_config"]}, notes.append) == one_rank
    bigger = config.parse_args(["--batch-size", "4", "--seq-len", "32", "--grad-accum", "4"])
    layout = batch.batch_layout(bigger, world_size=1)
    assert batch.resume_layout(bigger, layout, saved, notes.append) == layout
    assert len(notes) == 1


