"""bench/ladder.py end to end on the CPU with tiny settings (rungs that need a GPU or a library that is
missing come out n/a with a reason), the MFU sweep's refusal without CUDA, and the projection's formula."""

import json
import os
import sys

import pytest
import torch

import config
import fp8
from conftest import REPO, write_tiny_shards
from model import ModelConfig
from sizing import flops_per_token

sys.path.insert(0, os.path.join(REPO, "bench"))
import ladder  # noqa: E402

TINY = ["--vocab-size", "256", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2", "--n-embd", "64",
        "--seq-len", "32", "--batch-size", "4"]
FAST = ["--windows", "1", "--steps-per-window", "1", "--warmup-steps", "1"]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """One train shard of 5,000 random tokens and a val shard of 2,000."""
    return write_tiny_shards(tmp_path_factory.mktemp("one_shard"), train_tokens=(5000,))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU ladder")
def test_ladder_runs_end_to_end_on_cpu(tiny_data, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(fp8.DPA_RECIPE_ENV, raising=False)  # the ladder sets it; restored afterwards
    out = str(tmp_path / "ladder")
    ladder.main([*FAST, "--no-compile", "--out", out, "--data", tiny_data, *TINY])
    with open(f"{out}.json") as f:
        rungs = {r["key"]: r for r in json.load(f)["rungs"]}
    assert list(rungs) == [key for key, *_ in ladder.RUNGS]
    for key in ("fp32", "bf16", "flash", "fused_adamw", "muon", "adamw8bit", "torchao", "torchao_rowwise"):
        assert rungs[key]["status"] == "ok" and rungs[key]["tokens_per_s"] > 0, rungs[key]
        assert rungs[key]["mfu"] is None and rungs[key]["peak_mem_gib"] is None  # no CPU peak: never invented
    assert rungs["tf32"]["status"] == "n/a (TF32 is a CUDA tensor-core mode)"
    assert rungs["compile"]["status"] == rungs["max_autotune"]["status"] == "skipped (--no-compile)"
    assert rungs["loss_chunks"]["status"] == "n/a (a CPU's loss chunk is 1,024 tokens either way)"
    assert rungs["bf16_stream"]["status"].startswith("n/a (a CPU keeps the stream fp32 (--activation-dtype auto)")
    assert rungs["cudnn_attn"]["status"] == "n/a (cuDNN attention is CUDA's)"
    assert rungs["cuda_graphs"]["status"] == "skipped (--no-compile)"
    assert rungs["fp8_te"]["status"].startswith("n/a (--fp8 te needs a CUDA GPU")
    assert rungs["fp8_attn"]["status"] == "n/a (needs the fp8_te rung, which did not run)"
    step = {**ladder.BASE, "dtype": "bf16", "sdpa": "flash", "fused": True}  # the last step that ran
    assert rungs["muon"]["settings"] == {**step, "optimizer": "muon"}
    assert rungs["torchao_rowwise"]["settings"] == {**step, "fp8": "torchao", "fp8_recipe": "rowwise"}
    assert rungs["fp8_te"]["settings"] == {**step, "fp8": "te"}  # no variant's change carried over
    table = open(f"{out}.md").read()
    assert table.count("\n| ") == 1 + len(ladder.RUNGS)  # header row + one row per rung
    assert "| 1 | fp32 (eager, math attention, foreach AdamW) |" in table and "| 1.00x |" in table
    with open(f"{out}.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "n/a" in capsys.readouterr().out


def test_rung_one_is_true_fp32_and_tf32_is_a_rung_of_its_own():
    argv = ladder.settings_argv(ladder.BASE, "/tmp/x")
    assert "--no-tf32" in argv and "--no-fused-adamw" in argv
    tf32 = dict(ladder.BASE, **ladder.RUNGS[1][2])
    assert ladder.RUNGS[1][0] == "tf32" and "--tf32" in ladder.settings_argv(tf32, "/tmp/x")
    assert config.parse_args(argv).speed.tf32 is False


def test_a_rung_that_crashes_in_setup_is_failed_and_the_ladder_goes_on(monkeypatch, capsys):
    """TE 2.4-2.7 assert in the recipe (not a ValueError); such a rung must not end the ladder."""
    def setup(cfg):
        if cfg.optim.name == "muon":
            raise AssertionError("fp8_dpa is not supported")
        raise ValueError("--fp8 te needs a CUDA GPU")

    monkeypatch.setattr(ladder.train, "setup", setup)
    bench, train_argv = ladder.parse_ladder_args([*FAST, "--no-compile", *TINY])
    rows = ladder.run_ladder(bench, train_argv, lambda rows: None)
    statuses = {key: r["status"] for key, _, _, r in rows}
    assert statuses["muon"] == "failed (AssertionError: fp8_dpa is not supported)"
    assert statuses["fp32"].startswith("n/a (--fp8 te needs a CUDA GPU")
    assert "Traceback" in capsys.readouterr().err


def test_rungs_past_the_time_budget_are_skipped_not_started(monkeypatch):
    monkeypatch.setattr(ladder, "measure_settings", lambda *a: pytest.fail("started past the budget"))
    bench, train_argv = ladder.parse_ladder_args([*FAST, "--budget-s", "0", *TINY])
    rows = ladder.run_ladder(bench, train_argv, lambda rows: None)
    assert rows[0][3]["status"] == "skipped (--budget-s 0 spent)"


def test_start_at_applies_the_earlier_steps_untimed_and_no_variant(monkeypatch):
    measured = []
    monkeypatch.setattr(ladder, "measure_settings", lambda settings, *a: measured.append(settings) or {
        "status": "ok", "tokens_per_s": 1.0, "rates": [1.0], "warmup_s": 0.0, "compile_s": None, "mfu": None,
        "peak_mem_gib": None})
    bench, train_argv = ladder.parse_ladder_args([*FAST, "--start-at", "compile", "--rungs", "compile,muon", *TINY])
    rows = {key: result["status"] for key, _, _, result in ladder.run_ladder(bench, train_argv, lambda rows: None)}
    assert rows["fp32"] == rows["fused_adamw"] == "skipped (--start-at compile; its change kept)"
    assert rows["compile"] == rows["muon"] == "ok" and rows["cudnn_attn"] == "skipped (--rungs)"
    steps = {"tf32": True, "dtype": "bf16", "sdpa": "flash", "fused": True, "compile": "default"}
    assert measured == [{**ladder.BASE, **steps}, {**ladder.BASE, **steps, "optimizer": "muon"}]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_mfu_sweep_without_cuda_reports_na_and_measures_nothing(monkeypatch, capsys):
    monkeypatch.setattr(ladder, "measure_settings", lambda *a: pytest.fail("measured without CUDA"))
    ladder.main(["--mfu-sweep", "--sizes", "gpt2-124m,gpt2-350m", "--batch-sizes", "8,16"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| gpt2-124m") or
            line.startswith("| gpt2-350m")]
    assert len(rows) == 4 and all("n/a (no CUDA GPU here)" in row for row in rows)


def test_the_step_estimate_reduces_to_the_flops_model_when_everything_runs_at_peak():
    cfg = ModelConfig(n_layer=12, n_embd=768, n_head=12, n_kv_head=4)
    F = flops_per_token(cfg, 1024)
    f_attn = 12 * 12 * 12 * 64 * 1024
    # GEMMs at peak, causal attention at half (it does half the counted work), infinite bandwidth, and a step
    # so long that Muon's Newton-Schulz vanishes per token: MFU = 1.
    ideal = dict(gemm_eff=1.0, attn_eff=0.5, hbm=float("inf"))
    assert ladder.estimated_mfu(cfg, 1024, 16, 10**15, **ideal) == pytest.approx(1.0)
    # Only the GEMMs slowed: t = F_mm / (0.5 P) + F_attn / P.
    expected = F / (2 * (F - f_attn) + f_attn)
    assert ladder.estimated_mfu(cfg, 1024, 16, 10**15, **{**ideal, "gemm_eff": 0.5}) == pytest.approx(expected)
    assert 0 < ladder.estimated_mfu(cfg, 1024, 16, 2**19) < ladder.estimated_mfu(cfg, 1024, 16, 2**19, hbm=float("inf")) < 1


def test_muon_newton_schulz_flops_count_each_block_on_its_short_side():
    assert ladder.ns_flops(768, 768, steps=1) == 6 * 768**3
    assert ladder.ns_flops(2048, 768, steps=1) == ladder.ns_flops(768, 2048, steps=1) == 4 * 768**2 * 2048 + 2 * 768**3
    cfg = ModelConfig(n_layer=2, n_embd=64, n_head=4, n_kv_head=2)
    per_layer = (ladder.ns_flops(64, 64) * 2 + ladder.ns_flops(32, 64) * 2 + ladder.ns_flops(cfg.resolved_ffn_dim, 64) * 3)
    assert ladder.muon_flops_per_step(cfg) == 2 * per_layer


def test_the_loss_part_counts_one_weight_gradient_write_and_a_read_modify_write_per_further_chunk():
    cfg = ModelConfig(n_layer=12, n_embd=768, n_head=12, n_kv_head=4)
    V, D = cfg.padded_vocab_size, cfg.n_embd
    one, sixteen = (ladder.estimated_step_parts(cfg, 1024, 16, 2**19, chunk_tokens=c)["loss"] for c in (2**14, 1024))
    bw = ladder.HBM_EFFICIENCY * ladder.H100_HBM_BYTES_PER_S
    assert sixteen - one == pytest.approx(4 * V * D * 30 / 2**14 / bw)
    assert ladder.estimated_step_parts(cfg, 1024, 16, 2**19)["loss"] == one  # an H100 holds 16 x 1024 in one chunk


def test_ladder_flags_do_not_swallow_train_flags():
    bench, train_argv = ladder.parse_ladder_args(["--batch-size", "4", "--rungs", "fp32,muon"])
    assert train_argv == ["--batch-size", "4"] and bench.batch_sizes == "8,16,32"
    with pytest.raises(SystemExit):
        ladder.parse_ladder_args(["--rungs", "fp32,warp"])
