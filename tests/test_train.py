import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import atomic
import batch
import checkpoint
import config
import fp8
import hardware
import plan
import runlog
import train
from conftest import REPO, TINY_FLAGS as TINY_MODEL, write_tiny_shards


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_cli(*args, cwd=REPO):
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    return subprocess.run([sys.executable, "train.py", *args], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=300)


# ----------------------------------------------------------------------------- schedule and flags


def test_a_batch_warmup_longer_than_the_run_is_warned_about(tmp_path, tiny_data, capsys):
    from batch import batch_warmup_warning

    layout = batch.BatchLayout(micro_batch=1, seq_len=32, grad_accum=4, world_size=1)
    assert batch_warmup_warning(4, 0.25, 3, layout) == (  # 1, 2, 3 micro-steps of 4
        "warning: --batch-warmup-steps 4 is not shorter than the run (3 steps): the global batch reaches only 3 "
        "of its 4 micro-steps; lower --batch-warmup-steps")
    assert batch_warmup_warning(4, 0.25, 5, layout) is None and batch_warmup_warning(0, 0.25, 1, layout) is None
    assert batch_warmup_warning(8, 0.25, 8, layout) is None  # its last step rounds up to the whole batch
    tiny_run(tiny_data, tmp_path, "--batch-size", "1", "--grad-accum", "4", "--batch-warmup-steps", "8",
             "--max-steps", "2", "--eval-interval", "0")
    assert "warning: --batch-warmup-steps 8 is not shorter than the run (2 steps)" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--batch-warmup-steps", "4"], ["--batch-warmup-steps", "-1", "--grad-accum", "2"],
                                  ["--batch-warmup-steps", "4", "--grad-accum", "2", "--batch-warmup-start", "0"]])
def test_bad_batch_warmup_flags_are_usage_errors(args):
    with pytest.raises(train.UsageError, match="--batch-warmup"):
        config.parse_args(args)


def test_start_up_checks_the_machine_with_the_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    with pytest.raises(SystemExit) as e:
        train.main(["--batch-size", "auto", "--total-batch-tokens", "4096", "--device", "cpu", "--wandb",
                    "--wandb-mode", "online", "--warmup", "-1", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: 2 problems: (1) --warmup must be >= 0") and err.count("\n") == 1
    assert "(2) --wandb-mode online needs a W&B API key" in err


@pytest.mark.parametrize("args, message", [
    (["--no-such-flag"], "unrecognized arguments"),
    (["--max-steps", "10", "--max-tokens", "100"], "not both"),
    (["--grad-accum", "2", "--total-batch-tokens", "4096"], "not both"),
    (["--n-head", "6", "--n-kv-head", "4"], "--n-kv-head"),
    (["--batch-size", "0"], "--batch-size"),
    (["--dtype", "fp8"], "invalid choice"),
])
def test_bad_flags_are_usage_errors(args, message):
    with pytest.raises(train.UsageError, match=message):
        config.parse_args(args)


def test_bad_input_exits_2_with_one_line(tmp_path, tiny_data, train_in_process):
    """The first case through the real entry point (exit code 2, one line, no traceback), the rest in-process."""
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ["--n-head", "6", "--n-kv-head", "4"],
        ["--data", str(tmp_path / "missing")],
        ["--data", str(empty)],
        ["--data", tiny_data, *TINY_MODEL[:-4], "--seq-len", "8192", "--batch-size", "1"],
    ]
    for i, args in enumerate(cases):
        result = (run_cli if i == 0 else train_in_process)(*args, "--out-dir", str(tmp_path / "out"))
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)


def test_a_model_whose_vocabulary_is_not_the_shards_tokenizers_is_refused(tmp_path, train_in_process):
    import prepare

    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 400)
    prepare.prepare(str(tmp_path / "corpus.txt"), str(tmp_path / "shards"), val_tokens=2000)  # GPT-2, recorded
    shards = ["--data", str(tmp_path / "shards"), "--out-dir", str(tmp_path / "out"), "--device", "cpu"]
    for vocab in ("151936", "256"):  # Qwen3's vocabulary, and one too small for GPT-2's ids
        result = train_in_process(*shards, *TINY_MODEL, "--vocab-size", vocab)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert f"vocabulary ({int(vocab):,} ids)" in lines[0] and "gpt2 tokenizer (50,257 ids" in lines[0]


def test_help_documents_every_flag():
    result = run_cli("--help")
    assert result.returncode == 0
    for action in config.build_parser()._actions:
        assert action.help, action.option_strings
        for flag in action.option_strings:
            assert flag in result.stdout


# ----------------------------------------------------------------------------- training


def tiny_run(data, out_dir, *extra):
    train.main(["--data", data, "--out-dir", str(out_dir), *TINY_MODEL, "--warmup", "2", "--eval-interval", "4",
                "--eval-tokens", "256", "--dtype", "fp32", "--device", "cpu", *extra])
    return read_metrics(out_dir)


@pytest.mark.parametrize("grad_accum", [3, 1])
def test_each_micro_batchs_backward_runs_inside_fp8_micro_step(tmp_path, tiny_data, monkeypatch, grad_accum):
    """train_step runs each micro-batch's forward and backward inside fp8.micro_step (what Transformer Engine's
    weight cache and fused weight gradients go by: tests/test_model_te.py): each training forward and each
    backward see their micro-batch's MICRO_STEP.first (None in a step of one micro-batch), as a checkpointed
    block's recompute needs."""
    seen, backward, forward_context = [], torch.autograd.backward, hardware.forward_context

    def backward_seen(*args, **kwargs):
        seen.append(("backward", fp8.MICRO_STEP.first))
        return backward(*args, **kwargs)

    def forward_seen(*args, **kwargs):
        if torch.is_grad_enabled():  # training's forward, not an evaluation's
            seen.append(("forward", fp8.MICRO_STEP.first))
        return forward_context(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "backward", backward_seen)
    monkeypatch.setattr(hardware, "forward_context", forward_seen)
    tiny_run(tiny_data, tmp_path, "--grad-accum", str(grad_accum), "--max-steps", "2")
    step = [micro == 0 for micro in range(grad_accum)] if grad_accum > 1 else [None]
    assert seen[-4 * grad_accum:] == [(phase, first) for first in step for phase in ("forward", "backward")] * 2
    assert fp8.MICRO_STEP.first is None


def test_resume_is_bit_identical(tmp_path, tiny_data):
    full = tiny_run(tiny_data, tmp_path / "full", "--max-steps", "8", "--ckpt-interval", "4", "--keep-ckpts", "5")
    assert [r["step"] for r in full] == list(range(1, 9))  # counted when done, as checkpoints are
    assert {"step", "tokens", "time_s", "train_loss", "lr", "tokens_per_sec", "mfu"} <= set(full[0])
    assert "val_loss" in full[3] and "val_loss" in full[7] and "val_loss" not in full[4]

    # Resume a second run from the step-4 checkpoint; its metrics after step 4 were never written.
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    ckpt = checkpoint.checkpoint_path(str(tmp_path / "full"), 4, sharded=False)
    for path in (ckpt, ckpt + checkpoint.DIGEST_SUFFIX):
        shutil.copy(path, resumed_dir)
    with open(resumed_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in full[:6])  # steps 5 and 6 are stale: redone on resume
    resumed = tiny_run(tiny_data, resumed_dir, "--max-steps", "8", "--ckpt-interval", "4", "--resume")

    assert [r["step"] for r in resumed] == list(range(1, 9))
    times = [r["time_s"] for r in resumed]  # the clock goes on from step 4's record: cumulative, never back
    assert times[:4] == [r["time_s"] for r in full[:4]] and all(b >= a for a, b in zip(times, times[1:]))
    for a, b in zip(full, resumed):
        assert a["train_loss"] == b["train_loss"] and a["grad_norm"] == b["grad_norm"]
        assert a.get("val_loss") == b.get("val_loss")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_compiled_bf16_cuda_run_evaluates_samples_and_resumes_exactly(tmp_path, tiny_data, optimizer, capsys):
    """The everyday GPU run: torch.compile, bf16 autocast, fused kernels, eval, a sample, a checkpoint, a resume.
    The step after the resume computes its loss with the checkpoint's weights on the same batch: bit-equal."""
    flags = ["--device", "cuda", "--dtype", "bf16", "--compile", "default", "--optimizer", optimizer,
             "--max-steps", "8", "--ckpt-interval", "4", "--keep-ckpts", "5", "--sample-tokens", "5",
             "--sample-prompt", "x"]
    train.main(["--data", tiny_data, "--out-dir", str(tmp_path / "full"), *TINY_MODEL, "--warmup", "2",
                "--eval-interval", "4", "--eval-tokens", "256", *flags])
    full = read_metrics(tmp_path / "full")
    assert capsys.readouterr().err.count("sample at step 8: 'x") == 1
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    ckpt = checkpoint.checkpoint_path(str(tmp_path / "full"), 4, sharded=False)
    for path in (ckpt, ckpt + checkpoint.DIGEST_SUFFIX):
        shutil.copy(path, resumed_dir)
    train.main(["--data", tiny_data, "--out-dir", str(resumed_dir), *TINY_MODEL, "--warmup", "2",
                "--eval-interval", "4", "--eval-tokens", "256", *flags, "--resume"])
    resumed = read_metrics(resumed_dir)
    assert [r["step"] for r in resumed][-4:] == [5, 6, 7, 8]
    assert resumed[-4]["train_loss"] == full[4]["train_loss"]
    np.testing.assert_allclose([r["train_loss"] for r in resumed[-4:]], [r["train_loss"] for r in full[4:]],
                               rtol=1e-2)
    assert all("val_loss" in full[i] for i in (3, 7))  # the tiny shards are uniform noise: no loss to fall


def test_logged_tokens_count_what_was_trained_across_a_resume_with_another_batch(tmp_path, tiny_data, capsys):
    first = tiny_run(tiny_data, tmp_path, "--max-steps", "2", "--ckpt-interval", "2")  # 4 x 32 tokens a step
    assert [r["tokens"] for r in first] == [128, 256]
    resumed = tiny_run(tiny_data, tmp_path, "--max-steps", "4", "--resume", "--batch-size", "2")  # 2 x 32
    assert [r["tokens"] for r in resumed] == [128, 256, 320, 384]
    # Epochs count every token trained, before the resume too: 3 shards of 156 windows of 32 tokens an epoch.
    assert [r["epoch"] for r in resumed] == [t / 14_976 for t in (128, 256, 320, 384)]
    assert ("epochs           reads 384 tokens of a 14,976-token train split: 0.03 epochs, counting the 256 "
            "trained before the resume") in capsys.readouterr().out


def test_a_run_over_more_than_one_epoch_says_how_many_at_start_in_each_record_and_at_the_end(tmp_path, capsys):
    data = write_tiny_shards(tmp_path, train_tokens=(100, 100), val_tokens=200)  # 2 x 3 windows of 32 tokens
    records = tiny_run(data, tmp_path / "out", "--max-steps", "3", "--eval-interval", "0")  # 128 tokens a step
    assert [r["epoch"] for r in records] == [128 / 192, 256 / 192, 384 / 192]
    meta, _ = checkpoint.load(checkpoint.checkpoint_path(str(tmp_path / "out"), 3, sharded=False))
    assert meta["loader"]["next_window"] / meta["loader"]["num_windows"] == records[-1]["epoch"]  # what was read
    out, err = capsys.readouterr()
    assert "epochs           reads 384 tokens of a 192-token train split: 2.00 epochs\n" in out
    assert ("warning: the run will read 384 tokens of a 192-token train split: 2.00 epochs, so it trains on the same "
            "data more than once; lower --max-steps for one epoch or less, or prepare more data") in err
    assert "epochs            384 tokens of a 192-token train split: 2.00 epochs" in out[out.index("run summary"):]


def test_batch_warmup_counts_exact_tokens_and_resumes_bit_identically(tmp_path, tiny_data):
    ramp = ["--batch-size", "1", "--grad-accum", "4", "--batch-warmup-steps", "4", "--max-tokens", "640",
            "--keep-ckpts", "5"]
    full = tiny_run(tiny_data, tmp_path / "full", *ramp, "--ckpt-interval", "2")
    assert [r["tokens"] for r in full] == [32, 96, 192, 288, 416, 544, 672]  # 1, 2, 3, 3, then 4 micro-steps
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    ckpt = checkpoint.checkpoint_path(str(tmp_path / "full"), 2, sharded=False)  # inside the ramp
    for path in (ckpt, ckpt + checkpoint.DIGEST_SUFFIX):
        shutil.copy(path, resumed_dir)
    with open(resumed_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in full[:2])
    resumed = tiny_run(tiny_data, resumed_dir, *ramp, "--resume")
    assert [(r["tokens"], r["train_loss"]) for r in resumed] == [(r["tokens"], r["train_loss"]) for r in full]


def test_metrics_survive_a_crash_while_rewritten_at_resume(tmp_path, monkeypatch):
    lines = [json.dumps({"step": s, "train_loss": 1.0}) + "\n" for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines))

    def killed(*_):
        raise KeyboardInterrupt  # the process dies between writing the kept lines and putting them in place

    monkeypatch.setattr(atomic.os, "replace", killed)
    log = runlog.MetricsLog(str(tmp_path), start_step=2, wandb_run=None)
    with pytest.raises(KeyboardInterrupt):
        log.begin()  # the resumed run's loop starts: the log is rewritten
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines)


def test_resume_rejects_a_different_model_before_building_or_timing_one(tmp_path, tiny_data, train_in_process,
                                                                         monkeypatch):
    """The checkpoint's record is enough: the refusal comes before the model is built and its step timed."""
    tiny_run(tiny_data, tmp_path, "--max-steps", "2")

    def too_late(*args, **kwargs):
        raise AssertionError("the refusal should have come first")

    monkeypatch.setattr(train, "build_model", too_late)
    monkeypatch.setattr(plan, "step_time", too_late)
    result = train_in_process("--data", tiny_data, "--out-dir", str(tmp_path), *TINY_MODEL, "--n-layer", "3",
                              "--max-steps", "4", "--resume", "--device", "cpu")
    assert result.returncode == 2 and "another model shape (n_layer 2 -> 3)" in result.stderr
    result = train_in_process("--data", tiny_data, "--out-dir", str(tmp_path), *TINY_MODEL, "--optimizer", "adamw",
                              "--max-steps", "4", "--resume", "--device", "cpu")
    assert result.returncode == 2 and "optim.name 'muon' -> 'adamw'" in result.stderr


def test_resume_names_the_settings_that_changed(tmp_path, tiny_data, train_in_process):
    """The checkpoint stores the resolved config: a changed optimizer is refused, a changed LR is named."""
    tiny_run(tiny_data, tmp_path, "--max-steps", "2")
    common = ["--data", tiny_data, "--out-dir", str(tmp_path), *TINY_MODEL, "--max-steps", "3", "--resume",
              "--device", "cpu", "--eval-interval", "0"]
    result = train_in_process(*common, "--optimizer", "adamw")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == ("error: --resume: the checkpoint was trained with settings "
                                                      "that cannot change within a run: optim.name 'muon' -> 'adamw'")
    result = train_in_process(*common, "--lr", "1e-3")
    assert result.returncode == 0, result.stderr
    assert "setting changed since the checkpoint: optim.lr 0.00849 -> 0.001" in result.stderr  # 6e-3 at width 64
    assert "schedule.max_steps 2 -> 3" in result.stderr


def test_the_resolved_config_is_written_and_reproduces_the_run(tmp_path, tiny_data):
    tiny_run(tiny_data, tmp_path, "--depth", "1", "--max-tokens", "256")  # the tiny model's flags override it
    saved = config.read_config_file(str(tmp_path / "config.toml"))
    assert saved["size.depth"] == 1 and saved["schedule.max_tokens"] == 256 and "schedule.max_steps" not in saved
    assert saved["optim.lr"] == 0.00849  # derived from the given width: 6e-3 x (128/64)^0.5
    again = config.parse_args(["--config", str(tmp_path / "config.toml")])
    assert config.flat_values(again) == {**config.flat_values(again), **saved}
    assert (again.model.n_layer, again.model.n_embd, again.data.data) == (2, 64, tiny_data)


def test_a_relative_data_is_recorded_absolute_and_a_resume_from_elsewhere_finds_it(tmp_path, tiny_data, monkeypatch,
                                                                                     train_in_process):
    """sample.py, score.py and hf.py read the recorded --data from wherever they are run."""
    import trained

    monkeypatch.chdir(os.path.dirname(tiny_data))
    tiny_run(os.path.basename(tiny_data) + "/", tmp_path / "run", "--max-steps", "2")
    assert config.read_config_file(str(tmp_path / "run" / "config.toml"))["data.data"] == tiny_data
    assert trained.trained_config(str(tmp_path / "run"))["data"]["data"] == tiny_data
    monkeypatch.chdir(tmp_path)
    result = train_in_process("--resume", "--config", "run/config.toml", "--max-steps", "3")
    assert result.returncode == 0 and "data.data" not in result.stderr, result.stderr


def test_a_hand_edited_config_toml_is_applied_with_its_own_config_flag_and_otherwise_refused(tmp_path, tiny_data,
                                                                                             capsys):
    tiny_run(tiny_data, tmp_path, "--max-steps", "2")
    path = tmp_path / "config.toml"
    text = path.read_text()
    assert not config.hand_edited(text) and config.hand_edited(text.replace(config.DIGEST_LINE, "# "))
    edited = text.replace("\nlr = ", "\nlr = 0.001\n# lr was ", 1)
    assert config.hand_edited(edited)
    path.write_text(text.replace(config.DIGEST_LINE, "# "))  # no digest, no edit: nothing to refuse
    tiny_run(tiny_data, tmp_path, "--max-steps", "2", "--resume")
    without_digest = "".join(line for line in edited.splitlines(keepends=True) if config.DIGEST_LINE not in line)
    for changed in (edited, without_digest):  # the digest line deleted with the edit: refused all the same
        path.write_text(changed)
        capsys.readouterr()
        with pytest.raises(SystemExit) as refused:
            tiny_run(tiny_data, tmp_path, "--max-steps", "3", "--resume")
        assert refused.value.code == 2 and path.read_text() == changed
        assert capsys.readouterr().err.strip().splitlines() == [
            f"error: {path} was edited by hand and this run does not apply optim.lr = 0.001; pass --config {path} "
            "--resume to apply the edits, or undo them"]
    path.write_text(edited)
    records = tiny_run(tiny_data, tmp_path, "--config", str(path), "--max-steps", "3", "--resume")
    assert records[-1]["step"] == 3 and "optim.lr 0.00849 -> 0.001" in capsys.readouterr().err
    assert config.read_config_file(str(path))["optim.lr"] == 0.001 and not config.hand_edited(path.read_text())


def test_a_finished_run_resumed_has_nothing_to_do_and_exits_0(tmp_path, tiny_data, capsys):
    from rundir import RunLock

    tiny_run(tiny_data, tmp_path, "--max-steps", "2")
    # A changed LR setting too: a finished run has no next step whose LR could re-warm.
    for resume, changed in (("auto", []), ("on", []), ("auto", ["--lr", "0.05"])):
        capsys.readouterr()
        tiny_run(tiny_data, tmp_path, "--max-steps", "2", "--resume", resume, *changed)  # returns: no SystemExit
        assert capsys.readouterr().err.strip().splitlines()[-1] == "nothing to do: already at step 2 of 2"
    tiny_run(tiny_data, tmp_path, "--max-steps", "1", "--resume")  # a run shorter than the checkpoint's step
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("nothing to do: the checkpoint is at step 2, past "
                                                                 "this run's last step, 1")
    train.main(["--data", tiny_data, "--out-dir", str(tmp_path / "zero"), *TINY_MODEL, "--max-steps", "0"])  # fresh
    assert capsys.readouterr().err.strip().splitlines()[-1] == "nothing to do: --max-steps 0 trains no steps"
    RunLock(str(tmp_path)).release()  # released
    assert not (tmp_path / "config.toml.tmp").exists()


def test_overwrite_removes_nothing_until_the_new_config_is_written(tmp_path, tiny_data, monkeypatch):
    tiny_run(tiny_data, tmp_path, "--max-steps", "2")
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path) if name != ".lock"}

    def disk_full(cfg, path):
        raise train.UsageError(f"cannot write {path}: No space left on device")

    monkeypatch.setattr(config, "write_config", disk_full)
    with pytest.raises(SystemExit):
        tiny_run(tiny_data, tmp_path, "--max-steps", "4", "--overwrite")
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path) if name != ".lock"} == before


def test_resume_rejects_a_foreign_checkpoint(tmp_path, tiny_data, train_in_process):
    (tmp_path / "ckpt_00000001.pt").write_bytes(b"not a checkpoint")
    result = train_in_process("--data", tiny_data, "--out-dir", str(tmp_path), *TINY_MODEL, "--resume",
                              "--device", "cpu")
    assert result.returncode == 2
    assert "skipping checkpoint" in result.stderr and "no usable checkpoint" in result.stderr.splitlines()[-1]


def test_keeps_only_the_newest_checkpoints(tmp_path, tiny_data):
    tiny_run(tiny_data, tmp_path, "--max-steps", "6", "--ckpt-interval", "2", "--keep-ckpts", "2")
    names = [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))]
    assert names == ["ckpt_00000004.pt", "ckpt_00000006.pt"]


def test_wandb_offline_without_a_key(tmp_path, tiny_data, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc credentials
    tiny_run(tiny_data, tmp_path, "--max-steps", "2", "--wandb", "--wandb-project", "test")
    runs = [n for n in os.listdir(tmp_path / "wandb") if n.startswith("offline-run-")]
    assert len(runs) == 1
    assert any(n.endswith(".wandb") for n in os.listdir(tmp_path / "wandb" / runs[0]))


def test_loss_decreases_on_the_embedded_corpus(tmp_path):
    train.main(["--out-dir", str(tmp_path), "--n-layer", "2", "--n-head", "2", "--n-kv-head", "1", "--n-embd", "64",
                "--seq-len", "64", "--batch-size", "8", "--max-steps", "40", "--warmup", "5", "--lr", "3e-3",
                "--eval-interval", "40", "--eval-tokens", "4096", "--device", "cpu"])
    records = read_metrics(tmp_path)
    first, last = records[0]["train_loss"], np.mean([r["train_loss"] for r in records[-5:]])
    assert first > 10.0  # ~ln(50304) at init: the model starts knowing nothing
    assert last < first - 3.0
    assert records[-1]["val_loss"] < first - 3.0


def test_metrics_carry_the_phase_split_and_profile_writes_a_trace(tmp_path, tiny_data, capsys):
    records = tiny_run(tiny_data, tmp_path, "--max-steps", "9", "--profile")
    phases = ["time_data_ms", "time_forward_ms", "time_backward_ms", "time_optimizer_ms"]
    for r in records:
        assert all(r[p] >= 0 for p in phases) and r["time_forward_ms"] > 0 and r["peak_mem_gib"] > 0
    with open(tmp_path / "trace.json") as f:
        assert "traceEvents" in json.load(f)
    assert "Self CPU time total" in capsys.readouterr().out


def test_progress_is_plain_lines_when_not_a_terminal(tmp_path, tiny_data):
    result = run_cli("--data", tiny_data, "--out-dir", str(tmp_path), *TINY_MODEL, "--max-steps", "3",
                     "--eval-interval", "0", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr
    assert "train 3/3 step" in result.stderr


@pytest.mark.parametrize("architecture, given", [(["--mlp", "swiglu"], []), (["--no-attn-gate"], ["--attn-gate"])],
                         ids=["default-qwen3-next", "qwen3"])
def test_from_hf_starts_from_the_exported_weights(tmp_path, tiny_data, architecture, given, monkeypatch):
    import torch

    from data import ShardLoader
    from hf import hf_model_config
    from hf import main as export_main
    from sample import load_model

    gpt2_vocab = ["--vocab-size", "50257"]  # export writes the GPT-2 tokenizer next to the weights
    tiny_run(tiny_data, tmp_path / "a", "--max-steps", "3", *gpt2_vocab, *architecture)
    ckpt = checkpoint.checkpoint_path(str(tmp_path / "a"), 3, sharded=False)
    assert export_main(["--ckpt", ckpt, "--out", str(tmp_path / "hf")]) == 0
    # The directory gives the model, shape, architecture and its width's LRs; a model flag with it is refused.
    b = ["--data", tiny_data, "--out-dir", str(tmp_path / "b"), "--seq-len", "32", "--batch-size", "4", "--warmup",
         "2", "--eval-interval", "0", "--dtype", "fp32", "--device", "cpu", "--max-steps", "1", "--from-hf",
         str(tmp_path / "hf")]
    if given:
        with pytest.raises(SystemExit) as refused:
            train.main([*b, *given])
        assert refused.value.code == 2
    sized = []  # the memory check at start-up sizes the directory's model, not the default one
    monkeypatch.setattr(train.memory, "check_fits", lambda model_cfg, *args: sized.append(model_cfg))
    train.main(b)
    records = read_metrics(tmp_path / "b")
    m = config.parse_command_line(["--from-hf", str(tmp_path / "hf")], hf_model=hf_model_config)[0].model
    assert sized == [dataclasses.replace(m, max_seq_len=32)]
    plain = config.parse_args(["--n-embd", str(m.n_embd), "--n-head", str(m.n_head), "--n-kv-head", str(m.n_kv_head)])
    exported = config.parse_command_line(["--from-hf", str(tmp_path / "hf")], hf_model=hf_model_config)[0]
    assert exported.optim.lr == plain.optim.lr != config.parse_args([]).optim.lr  # its width's, not the default's

    model = load_model(ckpt=ckpt)
    x, y = next(ShardLoader(tiny_data, batch_size=4, seq_len=32, seed=1337, prefetch=0))
    with torch.no_grad():
        _, expected = model(x, y)
    assert records[0]["train_loss"] == pytest.approx(expected.item(), rel=1e-6)


def test_sample_at_eval(tmp_path, tiny_data, capsys):
    tiny_run(tiny_data, tmp_path, "--max-steps", "4", "--sample-tokens", "5", "--sample-prompt", "x")
    assert capsys.readouterr().err.count("sample at step 4: 'x") == 1


def test_samples_run_under_the_training_autocast(tiny_data):
    """Under FSDP2 the blocks hold bf16 weights while the residual stream is fp32: without the training's
    autocast the sample's first matmul would mix dtypes."""
    import torch

    from evaluation import Evaluator
    from model import GPT, ModelConfig

    cfg = config.parse_args(["--sample-tokens", "3", "--sample-prompt", "x"]).eval
    model = GPT(ModelConfig(vocab_size=256, n_layer=1, n_head=4, n_kv_head=2, n_embd=64, max_seq_len=32))
    model.blocks.to(torch.bfloat16)  # as FSDP2's mixed precision hands them to the forward
    evaluator = Evaluator(cfg, tiny_data, train.distributed.DistInfo(), torch.device("cpu"), 256, seed=0)
    with pytest.raises(RuntimeError):
        evaluator.sample(model)
    assert evaluator.sample(model, torch.bfloat16).startswith("x")


# ----------------------------------------------------------------------------- an eval that fails


def test_an_eval_out_of_memory_is_skipped_after_the_checkpoint_and_training_goes_on(tmp_path, tiny_data,
                                                                                       monkeypatch, capsys):
    import torch

    original, calls = train.Evaluator.val_metrics, []

    def val_metrics(self, *args, **kwargs):  # the first eval, step 2's, runs out of memory
        calls.append(args)
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(train.Evaluator, "val_metrics", val_metrics)
    records = tiny_run(tiny_data, tmp_path, "--max-steps", "4", "--eval-interval", "2", "--ckpt-interval", "2")
    assert "out of memory in the eval of step 2" in capsys.readouterr().err
    assert records[1]["eval_skipped"] == "out of memory" and "val_loss" not in records[1]
    assert "val_loss" in records[3] and "eval_skipped" not in records[3]
    assert [checkpoint.checkpoint_step(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == [2, 4]
    # Step 4's eval, the first, improved: best is a second name for ckpt_4, not a second write.
    best, ckpt_4 = checkpoint.best_path(str(tmp_path), False), checkpoint.checkpoint_path(str(tmp_path), 4, False)
    assert os.path.samefile(best, ckpt_4)


@pytest.mark.parametrize("error, exit_code", [(train.DataError("val_000000.bin: unreadable"), 2),
                                              (RuntimeError("a bug"), None)])
def test_an_eval_that_fails_at_the_last_step_leaves_the_final_checkpoint(tmp_path, tiny_data, monkeypatch,
                                                                         capsys, error, exit_code):
    def val_metrics(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(train.Evaluator, "val_metrics", val_metrics)
    if exit_code is None:  # a bug keeps its traceback
        with pytest.raises(RuntimeError, match="a bug"):
            tiny_run(tiny_data, tmp_path, "--max-steps", "2")
    else:
        with pytest.raises(SystemExit) as exit_info:
            tiny_run(tiny_data, tmp_path, "--max-steps", "2")
        assert exit_info.value.code == exit_code
        assert capsys.readouterr().err.strip().splitlines()[-1] == "error: val_000000.bin: unreadable"
    checkpoint.verify(checkpoint.checkpoint_path(str(tmp_path), 2, sharded=False))


def test_a_resume_counts_the_eval_its_checkpoint_was_written_before(tmp_path, tiny_data):
    """ckpt_2 is written before step 2's eval; the resumed run measures it again, so its early stopping, and
    so ckpt_4's, is the uninterrupted run's."""
    flags = ["--max-steps", "4", "--eval-interval", "2", "--ckpt-interval", "2"]
    full_log = tiny_run(tiny_data, tmp_path / "full", *flags)
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    ckpt = checkpoint.checkpoint_path(str(tmp_path / "full"), 2, sharded=False)
    for path in (ckpt, ckpt + checkpoint.DIGEST_SUFFIX):
        shutil.copy(path, resumed_dir)
    resumed_log = tiny_run(tiny_data, resumed_dir, *flags, "--resume")
    # The copy had no metrics.jsonl: step 2's record comes back from the checkpoint, its eval measured again.
    keys = ("step", "tokens", "train_loss", "val_loss")
    assert [[r.get(k) for k in keys] for r in resumed_log] == [[r.get(k) for k in keys] for r in full_log[1:]]
    assert resumed_log[0]["val_loss"] is not None
    full, resumed = (checkpoint.load(checkpoint.checkpoint_path(str(d), 4, sharded=False))[0]
                     for d in (tmp_path / "full", resumed_dir))
    assert resumed["early_stop"] == full["early_stop"] and full["early_stop"]["best"] < math.inf


def test_a_fresh_run_from_a_config_file_into_a_new_out_dir(tmp_path, tiny_data):
    path = tmp_path / "run.toml"
    path.write_text(config.to_toml(config.parse_args([*TINY_MODEL, "--max-steps", "2"])))
    tiny_run(tiny_data, tmp_path / "new", "--config", str(path))
    assert os.path.exists(tmp_path / "new" / "ckpt_00000002.pt")
