"""Fault injection: real kills and signals, damaged checkpoints, NaNs, out-of-memory, a full disk, bad input."""

import errno
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import checkpoint
import cli
import loop
import model
import plan
import runlog
import telemetry
import train
from conftest import step_values
from memory import fits_by_trying, largest_fitting_batch, micro_batch_for
from resilience import EarlyStopping, Guard, LossHealth, StopSignals
from schedule import lr_multiplier
from shards import write_shard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--vocab-size", "256", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2", "--n-embd", "64",
         "--seq-len", "32", "--batch-size", "4", "--device", "cpu", "--dtype", "fp32", "--warmup", "2",
         "--eval-interval", "0"]
ENV = {**{k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("resilience_data")
    tokens = (np.arange(30000) * 7 % 256).astype(np.uint16)
    write_shard(root / "train_000000.bin", tokens[:15000], vocab_size=256)
    write_shard(root / "train_000001.bin", tokens[15000:28000], vocab_size=256)
    write_shard(root / "val_000000.bin", tokens[28000:], vocab_size=256)
    return str(root)


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["train_loss"] for line in f]


def start(data_dir, out_dir, *args):
    return subprocess.Popen([sys.executable, "train.py", "--data", data_dir, "--out-dir", str(out_dir), *MODEL, *args],
                            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


STEPS = 40


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """An uninterrupted run in a subprocess, as the interrupted ones are."""
    out = tmp_path_factory.mktemp("reference")
    proc = start(data_dir, out, "--max-steps", str(STEPS), "--ckpt-interval", "3")
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    return losses(out)


# ----------------------------------------------------------------------------- kills and signals


def steps_logged(out_dir):
    path = os.path.join(out_dir, "metrics.jsonl")
    return len(open(path).read().splitlines()) if os.path.exists(path) else 0


def test_sigkill_at_random_points_then_resume_is_bit_identical(data_dir, reference, tmp_path):
    rng = random.Random(0)
    args = ["--max-steps", str(STEPS), "--ckpt-interval", "3"]
    killed_at, mid_write = [], False
    for kill in range(5):
        resume = ["--resume"] if checkpoint.list_checkpoints(str(tmp_path)) else []
        proc = start(data_dir, tmp_path, *args, *resume)
        if kill == 2:  # this one lands while a checkpoint is being written
            while proc.poll() is None and not any(n.startswith("ckpt_") and n.endswith(".tmp")
                                                 for n in os.listdir(tmp_path)):
                time.sleep(0.0002)
            mid_write = proc.poll() is None
        else:  # the others at a random step, a random moment into it
            # Past the previous kill, so a line left by the killed process cannot satisfy the wait.
            low = (killed_at[-1] if killed_at else 0) + 2
            target = rng.randint(low, low + 4)
            while proc.poll() is None and steps_logged(tmp_path) < target:
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 0.1))
        assert proc.poll() is None, "the run ended before it could be killed"
        killed_at.append(steps_logged(tmp_path))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    newest = checkpoint.checkpoint_step(checkpoint.list_checkpoints(str(tmp_path))[-1])
    if newest < STEPS:  # a kill can land after the final checkpoint, while the process shuts down
        final = start(data_dir, tmp_path, *args, "--resume")
        assert final.wait(timeout=300) == 0, final.stderr.read()
    assert mid_write, killed_at
    assert losses(tmp_path) == reference


def test_sigusr1_stops_the_run_as_sigterm_does():
    """SLURM's warning of a time limit (--signal=USR1@N), which would otherwise kill the process."""
    signals = StopSignals()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)  # the handler runs at the next bytecode
        assert signals.requested == "SIGUSR1"
    finally:
        signals.restore()


def test_sigterm_checkpoints_and_exits_0_then_resumes_exactly(data_dir, reference, tmp_path):
    proc = start(data_dir, tmp_path, "--max-steps", str(STEPS), "--ckpt-interval", "100")
    metrics = tmp_path / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    outcome = next(line for line in out.splitlines() if line.strip().startswith("outcome"))
    assert "stopped by SIGTERM" in outcome and "--resume" in outcome  # the end-of-run summary says how to go on
    stopped_at = checkpoint.checkpoint_step(checkpoint.list_checkpoints(str(tmp_path))[-1])
    assert 3 <= stopped_at < STEPS
    resumed = start(data_dir, tmp_path, "--max-steps", str(STEPS), "--ckpt-interval", "100", "--resume")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert losses(tmp_path) == reference


def test_a_second_ctrl_c_exits_at_once(data_dir, tmp_path):
    # Wider and longer sequences than MODEL, so that a step lasts long enough for both signals to land in it.
    proc = start(data_dir, tmp_path, "--max-steps", "200", "--n-embd", "256", "--seq-len", "256", "--batch-size", "8")
    metrics = tmp_path / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "SIGINT again: exiting now" in err
    assert checkpoint.list_checkpoints(str(tmp_path)) == []  # no checkpoint: it did not wait for the step


# ----------------------------------------------------------------------------- damaged checkpoints


def damage_truncate(path, rng):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(rng.randrange(1, size))


def damage_flip(path, rng):
    with open(path, "r+b") as f:
        f.seek(rng.randrange(os.path.getsize(path)))
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage, seed", [(damage_truncate, 1), (damage_truncate, 2), (damage_flip, 3),
                                          (damage_flip, 4)])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(damage, seed, data_dir, tmp_path, capsys):
    args = ["--data", data_dir, "--out-dir", str(tmp_path), *MODEL, "--ckpt-interval", "2", "--keep-ckpts", "5"]
    train.main([*args, "--max-steps", "6"])
    full = losses(tmp_path)
    newest = checkpoint.list_checkpoints(str(tmp_path))[-1]
    damage(newest, random.Random(seed))
    train.main([*args, "--max-steps", "6", "--resume"])
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and os.path.basename(newest) in err
    assert losses(tmp_path) == full  # resumed from step 4 and redid steps 4 and 5 exactly


def test_a_full_disk_keeps_the_previous_checkpoint(data_dir, tmp_path, monkeypatch, capsys):
    real = checkpoint.write_synced
    calls = {"n": 0}

    def write_until_the_disk_fills(path, write):
        if path.endswith(".pt.tmp"):
            calls["n"] += 1
            if calls["n"] == 2:  # the second checkpoint: write half, then fail as a full disk does
                with open(path, "wb") as f:
                    f.write(b"\0" * 100)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, write)

    monkeypatch.setattr(checkpoint, "write_synced", write_until_the_disk_fills)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--data", data_dir, "--out-dir", str(tmp_path), *MODEL, "--max-steps", "6", "--ckpt-interval", "2"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "No space left on device" in err[-1] and "previous checkpoints are intact" in err[-1]
    good = checkpoint.list_checkpoints(str(tmp_path))
    assert [checkpoint.checkpoint_step(p) for p in good] == [2]
    checkpoint.verify(good[0])
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path))


# ----------------------------------------------------------------------------- NaNs, spikes, rollback


def test_an_injected_nan_is_skipped_and_changes_nothing(data_dir, tmp_path, inject_nan):
    import config

    run = train.setup(config.parse_args(["--data", data_dir, "--out-dir", str(tmp_path), *MODEL]))
    try:
        loop.train_step(run)  # a finite step first, so that the optimizer has state to keep
        before = {k: v.clone() for k, v in run.model.state_dict().items()}
        optimizer_before = {(id(p), k): v.clone() for p, st in run.optimizer.state.items() for k, v in st.items()}
        loader_before = run.loader.state_dict()
        inject_nan(0)
        metrics = loop.train_step(run)
        assert not metrics["finite"] and not torch.isfinite(metrics["train_loss"])
        for name, value in run.model.state_dict().items():
            assert torch.equal(value, before[name]), name
        for p, st in run.optimizer.state.items():
            for k, v in st.items():
                assert torch.equal(v, optimizer_before[(id(p), k)]), k
        assert run.loader.state_dict() != loader_before  # the poisoned batch was consumed, not replayed
    finally:
        run.close()


def test_a_skipped_step_is_logged_and_never_checkpointed(data_dir, tmp_path, inject_nan):
    inject_nan(2)
    train.main(["--data", data_dir, "--out-dir", str(tmp_path), *MODEL, "--max-steps", "4", "--ckpt-interval", "1",
                "--keep-ckpts", "10"])
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["skipped"] for r in records] == [False, False, True, False]
    assert records[2]["train_loss"] is None and records[3]["bad_steps"] == 1
    # Step 3 ended a streak of one non-finite step: no checkpoint of it; step 4 was finite again.
    assert [checkpoint.checkpoint_step(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == [1, 2, 4]


def test_too_many_bad_steps_roll_back_with_a_lower_lr(data_dir, tmp_path, capsys, inject_nan):
    inject_nan(3)
    train.main(["--data", data_dir, "--out-dir", str(tmp_path), *MODEL, "--max-steps", "6", "--ckpt-interval", "2",
                "--max-bad-steps", "1", "--lr", "6e-3"])
    err = capsys.readouterr().err
    assert "rolled back to step 2" in err and "LR now x0.5" in err
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert not any(r["skipped"] for r in records)  # the bad step's line was dropped with the rollback
    assert records[5]["lr"] == pytest.approx(0.5 * lr_multiplier(5, 6, 2, "wsd", 0.1, 0.2) * 6e-3)


class Diverging:
    """A run whose every step from the n-th on is non-finite: a real divergence, not a bad batch."""

    def __init__(self, monkeypatch, n):
        original, self.calls = loop.train_step, 0

        def step(run, *args):
            self.calls += 1
            m = original(run, *args)
            return m if self.calls <= n else {**m, "train_loss": m["train_loss"] * float("nan"),
                                              "finite": torch.zeros_like(m["finite"])}

        monkeypatch.setattr(loop, "train_step", step)


def test_rollbacks_are_capped_and_stop_with_exit_1(data_dir, tmp_path, capsys, monkeypatch):
    Diverging(monkeypatch, 2)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--data", data_dir, "--out-dir", str(tmp_path), *MODEL, "--max-steps", "50", "--ckpt-interval",
                    "2", "--max-bad-steps", "2", "--max-rollbacks", "2"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("rolled back to step 2") == 2
    assert "after 2 rollback(s) (--max-rollbacks 2): the run diverges" in err.strip().splitlines()[-1]
    # Nothing was checkpointed inside the streaks: step 2 is still the newest.
    assert [checkpoint.checkpoint_step(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == [2]


def test_sigterm_is_obeyed_on_the_rollback_path(data_dir, tmp_path, capsys, monkeypatch):
    diverging = Diverging(monkeypatch, 2)
    bad_step = loop.train_step

    def step(run, *args):
        if diverging.calls == 3:  # inside the first bad streak
            os.kill(os.getpid(), signal.SIGTERM)
        return bad_step(run, *args)

    monkeypatch.setattr(loop, "train_step", step)
    train.main(["--data", data_dir, "--out-dir", str(tmp_path), *MODEL, "--max-steps", "50", "--ckpt-interval", "2",
                "--max-bad-steps", "2"])
    out, err = capsys.readouterr()
    assert "rolled back to step 2" in err and "outcome           stopped by SIGTERM after a rollback" in out
    assert diverging.calls == 4


def test_a_divergence_before_the_first_checkpoint_stops_cleanly(data_dir, tmp_path, capsys, monkeypatch):
    Diverging(monkeypatch, 0)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--data", data_dir, "--out-dir", str(tmp_path), *MODEL, "--max-steps", "50",
                    "--max-bad-steps", "2"])
    assert exit_info.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "error: 2 non-finite steps in a row and no checkpoint to roll back to yet; restart with a lower --lr"


def test_too_many_bad_steps_can_stop_the_run(data_dir, tmp_path, capsys, inject_nan):
    inject_nan(1)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--data", data_dir, "--out-dir", str(tmp_path), *MODEL, "--max-steps", "6",
                    "--max-bad-steps", "1", "--on-bad-steps", "stop"])
    assert exit_info.value.code == 1
    assert "non-finite steps in a row" in capsys.readouterr().err.strip().splitlines()[-1]


def test_loss_health_tracks_ema_and_flags_spikes():
    health = LossHealth(spike_factor=2.0, beta=0.5, warmup=3)
    assert not any(health.update(loss, True) for loss in [4.0, 4.0, 4.0, 4.0])
    assert health.ema == pytest.approx(4.0) and health.var == pytest.approx(0.0)
    assert health.update(9.0, True)  # more than 2x the running average
    assert not health.update(float("nan"), False) and health.bad_in_a_row == 1 and health.bad_total == 1
    health.update(4.0, True)
    assert health.bad_in_a_row == 0 and health.bad_total == 1


def test_the_guard_counts_each_step_and_the_record_only_reads_it(tmp_path, capsys):
    """The loop shows the health update (Guard.observe); the step's record reads it and warns from it, and
    must_roll_back acts on it."""
    import config
    from batch import BatchLayout
    from telemetry import Telemetry

    guard = Guard(config.ResilienceConfig(max_bad_steps=2, spike_factor=2.0))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    telemetry = Telemetry(config.parse_args(["--out-dir", str(tmp_path)]), True, torch.device("cpu"), 0, 9, 1.0,
                          None, None, optimizer)
    for _ in range(20):  # the running average's warm-up
        guard.observe(4.0, True)
    health = guard.observe(9.0, True)
    assert health is guard.health and health.spike and health.seen == 21
    telemetry.step_record(0, step_values(9.0), 0.1, BatchLayout(2, 32, 1, 1), 1, health)
    assert health.seen == 21 and "loss spike 9.0000" in capsys.readouterr().err
    health = guard.observe(float("nan"), False)
    record = telemetry.step_record(0, step_values(float("nan"), finite=False), 0.1, BatchLayout(2, 32, 1, 1), 1, health)
    assert health.bad_in_a_row == 1 and record["bad_steps"] == 1 and not guard.must_roll_back()
    assert "update skipped (1 in a row, 1 in all)" in capsys.readouterr().err
    guard.observe(float("nan"), False)
    assert guard.must_roll_back()


def test_early_stopping_waits_for_patience():
    stop = EarlyStopping(patience=2)
    assert stop.update(3.0, 10) == (True, False)
    assert stop.update(3.1, 20) == (False, False)
    assert stop.update(2.9, 30) == (True, False)
    assert stop.update(3.0, 40) == (False, False) and stop.update(3.0, 50) == (False, True)
    assert EarlyStopping(patience=0).update(1.0, 10) == (True, False)


def test_early_stopping_knows_which_evals_it_has_counted():
    stop = EarlyStopping(patience=2)
    stop.update(3.0, 10)
    assert stop.has_counted(10) and not stop.has_counted(20)
    restored = EarlyStopping(patience=2)
    restored.load_state_dict(stop.state_dict())
    assert restored.has_counted(10) and not restored.has_counted(20)
    restored.load_state_dict({"best": 3.0, "evals_since_best": 0})  # written after its eval: counted
    assert restored.has_counted(20)


def test_early_stop_ends_the_run_and_keeps_the_best(data_dir, tmp_path, capsys):
    train.main(["--data", data_dir, "--out-dir", str(tmp_path), *MODEL[:-2], "--max-steps", "40",
                "--eval-interval", "1", "--eval-tokens", "128", "--early-stop-patience", "1", "--lr", "3e-1"])
    assert "early stop at step" in capsys.readouterr().out  # the summary's outcome
    stopped_at = len(losses(tmp_path))
    assert stopped_at < 40
    best = torch.load(checkpoint.best_path(str(tmp_path), sharded=False), weights_only=True)
    assert best["step"] < stopped_at and best["early_stop"]["best"] < float("inf")


# ----------------------------------------------------------------------------- out of memory


class ByteBudget:
    """A real allocator stand-in: raises MemoryError once the bytes in use exceed its budget."""

    def __init__(self, budget, fixed, per_sequence):
        self.budget, self.fixed, self.per_sequence = budget, fixed, per_sequence
        self.asked = []

    def run_batch(self, size):
        self.asked.append(size)
        if self.fixed + size * self.per_sequence > self.budget:
            raise MemoryError(f"{size} sequences need more than {self.budget} bytes")


@pytest.mark.parametrize("budget, expected", [(10_000, 97), (100, 0), (1_000_000, 512), (500, 2)])
def test_auto_batch_size_finds_the_largest_that_fits(budget, expected):
    memory = ByteBudget(budget, fixed=300, per_sequence=100)
    found = largest_fitting_batch(fits_by_trying(memory.run_batch, (MemoryError,)), limit=512)
    assert found == expected
    assert len(memory.asked) <= 2 * 10 + 1  # doubling, then bisection: logarithmic in the limit


def test_the_micro_batch_divides_the_global_batch():
    assert micro_batch_for(64, 24) == 16 and micro_batch_for(48, 48) == 48 and micro_batch_for(7, 5) == 1


def test_out_of_memory_mid_run_retries_with_a_smaller_micro_batch(data_dir, tmp_path, monkeypatch, capsys):
    reference_dir = tmp_path / "reference"
    common = ["--data", data_dir, *MODEL, "--total-batch-tokens", "256", "--max-steps", "4"]
    train.main([*common, "--out-dir", str(reference_dir), "--batch-size", "4"])
    original = model.GPT.forward
    state = {"raised": False}

    def forward_that_runs_out_of_memory_once(self, idx, targets=None, **kw):
        if idx.shape[0] == 8 and not state["raised"]:
            state["raised"] = True
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(self, idx, targets, **kw)

    monkeypatch.setattr(model.GPT, "forward", forward_that_runs_out_of_memory_once)
    monkeypatch.setattr(plan, "PROBE_MAX_S", 0.0)  # the start-up plan estimates: no forward before the first step
    train.main([*common, "--out-dir", str(tmp_path / "shrunk"), "--batch-size", "8"])
    assert state["raised"] and "retrying the step with micro-batch 4 x 2" in capsys.readouterr().err
    np.testing.assert_allclose(losses(tmp_path / "shrunk"), losses(reference_dir), rtol=1e-6)


# ----------------------------------------------------------------------------- bad input and secrets


def bad_inputs(root):
    """(name, argv) pairs: each must end in one `error:` line and exit code 2."""
    def shard(name, tokens, vocab=256):
        d = root / name
        d.mkdir()
        write_shard(d / "train_000000.bin", np.asarray(tokens, dtype=np.uint16), vocab_size=vocab)
        write_shard(d / "val_000000.bin", np.asarray(tokens, dtype=np.uint16), vocab_size=vocab)
        return d

    good = shard("good", np.arange(2000) % 256)
    high_ids = shard("high_ids", np.arange(2000) % 1000, vocab=1000)
    magic = shard("magic", np.arange(2000) % 256)
    with open(magic / "train_000000.bin", "r+b") as f:
        f.write(np.int32(12345).tobytes())
    truncated = shard("truncated", np.arange(2000) % 256)
    with open(truncated / "train_000000.bin", "r+b") as f:
        f.truncate(1500)
    empty = root / "empty"
    empty.mkdir()
    not_ours = root / "not_ours"
    not_ours.mkdir()
    (not_ours / "ckpt_00000002.pt").write_bytes(b"PK\x03\x04 not a checkpoint")
    (not_ours / "ckpt_00000002.pt.sha256").write_text("0" * 64)
    a_file = root / "a_file"
    a_file.write_text("x")
    used = root / "used"  # an earlier run's outputs, a checkpoint among them
    used.mkdir()
    (used / "metrics.jsonl").write_text("")
    (used / "ckpt_00000002.pt").write_bytes(b"x")
    zero = root / "zero"  # a 0-byte checkpoint whose checksum matches
    zero.mkdir()
    (zero / "ckpt_00000002.pt").write_bytes(b"")
    (zero / "ckpt_00000002.pt.sha256").write_text("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
    hf_list = root / "hf_list"
    hf_list.mkdir()
    (hf_list / "config.json").write_text("[]")
    hf_index = root / "hf_index"  # a config that parses, beside an index whose weight_map is a list
    hf_index.mkdir()
    (hf_index / "config.json").write_text('{"model_type": "qwen3"}')
    (hf_index / "model.safetensors.index.json").write_text('{"weight_map": []}')
    config_dir = root / "config_dir"  # a directory where the run writes its config.toml
    (config_dir / "config.toml").mkdir(parents=True)
    d = ["--data", str(good)]
    out = ["--out-dir", str(root / "out")]
    return [
        ("tokens per param inf", [*d, *out, "--depth", "2", "--tokens-per-param", "inf"]),
        ("tokens per param tiny", [*d, *out, "--depth", "2", "--tokens-per-param", "1e-30"]),
        ("layers beyond counting", [*d, *out, "--n-layer", str(10**20)]),
        ("depth beyond counting", [*d, *out, "--depth", str(10**20)]),
        ("from-hf index weight_map a list", [*d, *out, "--from-hf", str(hf_index)]),
        ("config.toml a directory", [*d, "--out-dir", str(config_dir), *MODEL]),
        ("unknown flag", [*d, *out, "--learning-rate", "1"]),
        ("bad int", [*d, *out, "--n-layer", "two"]),
        ("bad choice", [*d, *out, "--schedule", "linear"]),
        ("max steps and tokens", [*d, *out, "--max-steps", "3", "--max-tokens", "100"]),
        ("grad accum and total", [*d, *out, "--grad-accum", "2", "--total-batch-tokens", "256"]),
        ("total not a multiple", [*d, *out, *MODEL, "--total-batch-tokens", "100"]),
        ("heads", [*d, *out, "--n-head", "6", "--n-kv-head", "4"]),
        ("embd per head", [*d, *out, "--n-embd", "100", "--n-head", "3", "--n-kv-head", "1"]),
        ("odd head dim", [*d, *out, *MODEL, "--head-dim", "15"]),
        ("zero layers", [*d, *out, "--n-layer", "0"]),
        ("negative seq len", [*d, *out, "--seq-len", "-1"]),
        ("zero batch", [*d, *out, "--batch-size", "0"]),
        ("batch auto without a global batch", [*d, *out, "--batch-size", "auto"]),
        ("negative lr", [*d, *out, *MODEL, "--lr", "-1"]),
        ("beta out of range", [*d, *out, *MODEL, "--beta2", "1.5"]),
        ("negative warmup", [*d, *out, "--warmup", "-3"]),
        ("min lr ratio", [*d, *out, "--min-lr-ratio", "2"]),
        ("keep ckpts", [*d, *out, "--keep-ckpts", "0"]),
        ("rollback factor", [*d, *out, "--rollback-lr-factor", "0"]),
        ("fp16 on cpu", [*d, *out, *MODEL, "--dtype", "fp16"]),
        ("cuda missing", [*d, *out, "--device", "cuda"]) if not torch.cuda.is_available() else
        ("mps missing", [*d, *out, "--device", "mps"]),
        ("fsdp without torchrun", [*d, *out, "--dist", "fsdp"]),
        ("ddp without torchrun", [*d, *out, "--dist", "ddp"]),
        ("fp8 attn without te", [*d, *out, "--fp8-attn"]),
        ("sampling with te", [*d, *out, "--fp8", "te", "--sample-tokens", "8"]),
        ("negative sample tokens", [*d, *out, "--sample-tokens", "-1"]),
        ("missing data dir", ["--data", str(root / "nowhere"), *out, *MODEL]),
        ("empty data dir", ["--data", str(empty), *out, *MODEL]),
        ("data is a file", ["--data", str(a_file), *out, *MODEL]),
        ("seq len longer than a shard", [*d, *out, *MODEL, "--seq-len", "4096"]),
        ("wrong magic", ["--data", str(magic), *out, *MODEL]),
        ("truncated shard", ["--data", str(truncated), *out, *MODEL]),
        ("token ids above the vocab", ["--data", str(high_ids), *out, *MODEL, "--max-steps", "2"]),
        ("resume without checkpoints", [*d, "--out-dir", str(empty), *MODEL, "--resume"]),
        ("checkpoint not ours", [*d, "--out-dir", str(not_ours), *MODEL, "--resume"]),
        ("out dir under a file", [*d, "--out-dir", str(a_file / "out"), *MODEL]),
        ("profile too short", [*d, *out, *MODEL, "--max-steps", "3", "--profile"]),
        ("from-hf missing", [*d, *out, "--from-hf", str(root / "no_hf")]),
        ("from-hf config a list", [*d, *out, "--from-hf", str(hf_list)]),
        ("max tokens zero", [*d, *out, "--max-tokens", "0"]),
        ("negative peak tflops", [*d, *out, "--peak-tflops", "-5"]),
        ("nan grad clip", [*d, *out, "--grad-clip", "nan"]),
        ("infinite lr", [*d, *out, "--lr", "inf"]),
        ("log interval zero", [*d, *out, "--log-interval", "0"]),
        ("negative seed", [*d, *out, "--seed", "-1"]),
        ("seed too large", [*d, *out, "--seed", str(2**70)]),
        ("negative max rollbacks", [*d, *out, "--max-rollbacks", "-1"]),
        ("sample prompt beyond the vocab", [*d, *out, *MODEL, "--sample-tokens", "4"]),
        ("width beyond memory", [*d, *out, *MODEL, "--n-embd", "16777216", "--n-head", "1", "--n-kv-head", "1"]),
        ("seq len beyond the data", [*d, *out, *MODEL, "--seq-len", "100000000"]),
        ("fresh run into a used out dir", [*d, "--out-dir", str(used), *MODEL]),
        ("overwrite and resume", [*d, *out, "--overwrite", "--resume"]),
        ("zero-byte checkpoint", [*d, "--out-dir", str(zero), *MODEL, "--resume"]),
    ]


def test_bad_input_gets_one_line_and_exit_2(tmp_path, capsys):
    cases = bad_inputs(tmp_path)
    assert len(cases) >= 30
    for name, argv in cases:
        with pytest.raises(SystemExit) as exit_info:
            train.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2, (name, err)
        errors = [line for line in err if line.startswith("error: ")]
        assert len(errors) == 1 and err[-1] == errors[0], (name, err)
        assert "Traceback" not in "\n".join(err), name


def test_the_wandb_key_never_reaches_logs_or_checkpoints(data_dir, tmp_path, monkeypatch, capsys):
    secret = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    train.main(["--data", data_dir, "--out-dir", str(tmp_path), *MODEL, "--max-steps", "2", "--wandb",
                "--wandb-mode", "offline"])
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err
    for root, _, files in os.walk(tmp_path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                assert secret.encode() not in f.read(), name


def test_a_signal_during_startup_is_one_line_and_the_shell_exit_code(capsys, monkeypatch):
    from resilience import stop_at_once

    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        for name, value in (("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")):
            monkeypatch.setenv(name, value)  # started by torchrun
        for rank, said in [("0", "SIGTERM during start-up: stopping before the first step (nothing to save)"),
                           ("1", "")]:  # torchrun's SIGTERM to the other ranks once rank 0 refused the run: quiet
            monkeypatch.setenv("RANK", rank)
            stop_at_once()
            with pytest.raises(SystemExit) as exit_info:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)  # the handler runs at the next bytecode boundary
            assert exit_info.value.code == 128 + signal.SIGTERM
            assert capsys.readouterr().err.strip() == said
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def test_a_signal_after_the_loop_lets_the_run_write_its_records_and_a_second_exits(capsys):
    """A SIGTERM while the records are written or the process exits (a compile worker pool's shutdown can
    take seconds): every step is done, so the first signal only says so (the run writes report.md and exits
    0, as a finished run does); a second exits at once, 128 + its number."""
    from resilience import StopSignals, stop_at_once

    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        stop_at_once()
        StopSignals().restore()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the handler runs at the next bytecode boundary: it returns
        assert capsys.readouterr().err.strip() == ("SIGTERM after the last step: writing the run's records, then "
                                                   "exiting (again to exit at once; every checkpoint written is whole)")
        with pytest.raises(SystemExit) as exit_info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert exit_info.value.code == 128 + signal.SIGTERM
        assert capsys.readouterr().err.strip() == "SIGTERM again: exiting now"

        stop_at_once()  # a loop that a signal stopped: the next one is the second, and exits at once
        signals = StopSignals()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
        signals.restore()
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert exit_info.value.code == 128 + signal.SIGINT
        assert capsys.readouterr().err.strip() == "SIGINT again: exiting now"
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def test_two_sigints_during_one_long_call_still_exit_at_once(monkeypatch, capsys):
    """Python runs a signal's handler once for all deliveries since it last looked, so two Ctrl-Cs that land
    inside one long C call (a matmul, an fsync while a checkpoint is written) reach it as one; StopSignals
    counts the deliveries instead, and the second still exits 130."""
    import threading

    from resilience import StopSignals

    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    inside = threading.Event()

    def press_ctrl_c_twice():
        inside.wait()
        for _ in range(2):
            time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGINT)

    signals = StopSignals()
    try:
        sender = threading.Thread(target=press_ctrl_c_twice)
        sender.start()
        a = torch.rand(2500, 2500)
        inside.set()
        torch.mm(a, a)  # one C call that releases the GIL: the handler can only run after it
        sender.join()
        time.sleep(0.01)  # the next bytecode boundaries: the handler runs
    finally:
        signals.restore()
    assert signals.requested == "SIGINT" and exits == [130]
    assert "SIGINT again: exiting now" in capsys.readouterr().err


def test_a_signal_in_the_first_step_says_there_is_nothing_to_keep_and_suggests_no_plot(data_dir, tmp_path, capsys,
                                                                                      monkeypatch):
    micro_step = telemetry.Telemetry.micro_step

    def signal_inside_step_1(self, done, of):
        micro_step(self, done, of)
        if self.steps_taken == 0 and done == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(telemetry.Telemetry, "micro_step", signal_inside_step_1)
    train.main(["--data", data_dir, *MODEL, "--max-steps", "4", "--grad-accum", "2", "--out-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert "SIGTERM: dropping the step in progress, no step has completed yet: nothing to keep" in err
    assert "keeping the last completed one" not in err
    assert "stopped by SIGTERM during step 1, before this process completed a step" in out
    assert "bench/plot.py" not in out and "python sample.py" not in out  # no records to draw, no weights to sample


@pytest.mark.parametrize("ckpt_interval, kept", [(100, "its checkpoint written in"),
                                                  (4, "its checkpoint on disk already")])
def test_a_signal_mid_step_drops_that_step_keeps_the_last_and_resumes_exactly(data_dir, tmp_path, capsys,
                                                                             monkeypatch, ckpt_interval, kept):
    args = ["--data", data_dir, *MODEL, "--max-steps", "8", "--grad-accum", "2", "--ckpt-interval", str(ckpt_interval)]
    train.main([*args, "--out-dir", str(tmp_path / "reference")])
    micro_step = telemetry.Telemetry.micro_step

    def signal_inside_step_5(self, done, of):  # between step 5's two micro-steps
        micro_step(self, done, of)
        if self.steps_taken == 4 and done == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(telemetry.Telemetry, "micro_step", signal_inside_step_5)
    capsys.readouterr()
    train.main([*args, "--out-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert "SIGTERM: dropping the step in progress, keeping the last completed one" in err
    assert f"stopped by SIGTERM during step 5, which is dropped; kept step 4, {kept}" in out
    assert checkpoint.checkpoint_step(checkpoint.list_checkpoints(str(tmp_path / "run"))[-1]) == 4
    monkeypatch.setattr(telemetry.Telemetry, "micro_step", micro_step)
    train.main([*args, "--out-dir", str(tmp_path / "run"), "--resume"])
    assert losses(tmp_path / "run") == losses(tmp_path / "reference")


def test_a_step_interruption_passes_through_a_librarys_except_exception(capsys):
    """torch.compile catches Exception and re-raises it as its own error: the interruption must not be one."""
    from resilience import StepInterrupted, StopSignals

    signals = StopSignals(interrupt=True)
    try:
        with pytest.raises(StepInterrupted), signals.interruptible():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
            except Exception:  # what Dynamo would do with it
                pytest.fail("the interruption was caught as an Exception")
    finally:
        signals.restore()
    assert signals.requested == "SIGTERM" and "dropping the step in progress" in capsys.readouterr().err


# ----------------------------------------------------------------------------- writes that fail


def test_a_filesystem_that_fills_during_a_checkpoint_ends_the_run_in_one_line(data_dir, tmp_path, small_filesystem,
                                                                              capsys):
    """A real full disk: torch's zip writer turns the OSError into a RuntimeError of its own, which is still the
    disk's error. The partial file goes, the summary is written, exit 1; the previous checkpoint verifies."""
    args = ["--data", data_dir, *MODEL, "--ckpt-interval", "1", "--keep-ckpts", "1"]
    train.main([*args, "--out-dir", str(tmp_path / "probe"), "--max-steps", "1"])
    size = os.path.getsize(tmp_path / "probe" / "ckpt_00000001.pt")
    out = small_filesystem(int(size * 1.5) // 1024) / "run"  # room for one checkpoint, not for a second beside it
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train.main([*args, "--out-dir", str(out), "--max-steps", "4"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(rf"error: cannot write checkpoint {re.escape(str(out))}/ckpt_00000002.pt: No space left on "
                        r"device \([\d.,]+ MiB free on its filesystem\); the previous checkpoints are intact", err[-1])
    assert [checkpoint.checkpoint_step(p) for p in checkpoint.list_checkpoints(str(out))] == [1]
    checkpoint.verify(checkpoint.list_checkpoints(str(out))[0])
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")] and (out / "summary.json").exists()


def test_a_write_that_fails_inside_torch_save_is_the_disks_error(tmp_path, monkeypatch):
    """torch.save raises RuntimeError('unexpected pos ...') when its file's write fails: save_file reports the
    OSError beneath it and removes the partial file."""
    real_open = open

    class FillingFile:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            if self.written + len(data) > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.written += len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def filling_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FillingFile(f) if str(path).endswith(".pt.tmp") else f

    monkeypatch.setattr("builtins.open", filling_open)
    with pytest.raises(cli.WriteError, match=r"^cannot write checkpoint .*ckpt\.pt: No space left on device \("):
        checkpoint.save_file({"w": torch.zeros(10_000)}, str(tmp_path / "ckpt.pt"))
    assert os.listdir(tmp_path) == []


def test_a_dcp_save_that_fails_keeps_the_previous_directory(tmp_path, monkeypatch):
    """dcp.save reports a rank's OSError inside a CheckpointException: the same one line, the temporary
    directory removed, the previous checkpoint at that name whole."""
    path = str(tmp_path / "best")
    checkpoint.save_sharded({"w": torch.ones(8)}, {"step": 1}, path, True, lambda: None)
    before = sorted(os.listdir(path))

    def full(state, checkpoint_id):
        os.makedirs(checkpoint_id, exist_ok=True)
        error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise torch.distributed.checkpoint.CheckpointException("save failed", {0: (error, None)})

    monkeypatch.setattr(checkpoint.dcp, "save", full)
    with pytest.raises(cli.WriteError, match=r"^cannot write checkpoint .*best: No space left on device \("):
        checkpoint.save_sharded({"w": torch.zeros(8)}, {"step": 2}, path, True, lambda: None)
    assert sorted(os.listdir(tmp_path)) == ["best"] and sorted(os.listdir(path)) == before
    checkpoint.verify(path)


@pytest.mark.parametrize("free, line", [
    (0, r"No space left on device \(.*\); the previous checkpoints are intact"),
    (2**40, r"rank 1: RuntimeError: \[enforce fail at inline_container.cc:672\] . unexpected pos 704 vs 598; "
            r"the previous checkpoints are intact")])
def test_a_dcp_failure_without_an_os_error_is_the_full_disk_when_the_space_is_gone(tmp_path, monkeypatch, free,
                                                                                     line):
    """A real full disk inside dcp.save reaches us as torch's zip writer's RuntimeError, no OSError inside: with
    less free space than the checkpoint needs it is the full disk's line; with room to spare, the first failing
    rank and its error. Either way the temporary directory goes and the previous checkpoint stays whole."""
    path = str(tmp_path / "best")
    checkpoint.save_sharded({"w": torch.ones(8)}, {"step": 1}, path, True, lambda: None)

    def fails(state, checkpoint_id):
        os.makedirs(checkpoint_id, exist_ok=True)
        error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        raise torch.distributed.checkpoint.CheckpointException("save failed", {1: (error, None), 2: (error, None)})

    monkeypatch.setattr(checkpoint.dcp, "save", fails)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda _: free)
    with pytest.raises(cli.WriteError) as e:
        checkpoint.save_sharded({"w": torch.zeros(8)}, {"step": 2}, path, True, lambda: None)
    assert re.fullmatch(rf"cannot write checkpoint {re.escape(path)}: {line}", str(e.value))
    assert sorted(os.listdir(tmp_path)) == ["best"]
    checkpoint.verify(path)


def test_a_log_line_that_cannot_be_written_leaves_the_log_whole(tmp_path, monkeypatch):
    log = runlog.MetricsLog(str(tmp_path), start_step=0, wandb_run=None)
    log.log({"step": 1, "tokens": 10})
    real_write, calls = os.write, []

    def half_written(fd, data):
        calls.append(len(data))
        if len(calls) > 1:  # the disk fills after the line's first 5 bytes
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data[:5])

    monkeypatch.setattr(telemetry.os, "write", half_written)
    with pytest.raises(cli.WriteError, match=r"^cannot write the run's log .*metrics.jsonl: No space left on device "
                                             r"\(.*\); its earlier records are whole$"):
        log.log({"step": 2, "tokens": 20})
    monkeypatch.undo()
    assert open(log.path).read() == '{"step": 1, "tokens": 10}\n'


def test_a_shard_damaged_mid_run_stops_it_after_its_last_checkpoint(data_dir, tmp_path, monkeypatch, capsys):
    import shutil

    import data

    shards = tmp_path / "data"
    shutil.copytree(data_dir, shards)
    real_step, steps = data.ShardLoader._step, []

    def step(self, pos):  # the train loader's fifth batch is made after both shards were cut short
        if self.order.shuffle:
            steps.append(pos)
            if len(steps) == 5:
                for name in ("train_000000.bin", "train_000001.bin"):
                    os.truncate(shards / name, 4000)
        return real_step(self, pos)

    monkeypatch.setattr(data.ShardLoader, "_step", step)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--data", str(shards), "--out-dir", str(out), *MODEL, "--max-steps", "8", "--ckpt-interval", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(rf"error: {re.escape(str(shards))}/train_00000[01]\.bin: the shard changed on disk while the "
                        r"run read it \(truncated, overwritten or replaced\); the run stops rather than train on it: "
                        r"restore it \(or prepare the data again\), then resume", err[-1]), err[-1]
    saved = [checkpoint.checkpoint_step(p) for p in checkpoint.list_checkpoints(str(out))]
    assert saved and max(saved) <= 4 and (out / "summary.json").exists()  # no step trained on the damaged shards
    checkpoint.verify(checkpoint.list_checkpoints(str(out))[-1])
