"""rundir.py: one run per --out-dir (an flock that a killed run does not leave behind), and no fresh run on
top of an old one unless --resume, --resume auto or --overwrite says what to do."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import config
import rundir
from cli import UsageError
from config import CheckpointConfig
from conftest import REPO, TINY_FLAGS

NO_CHECKPOINT = r"--resume: --out-dir d holds no checkpoint to resume from: "


@pytest.mark.parametrize("outputs, has_ckpt, resume, overwrite, expected", [
    ([], False, "off", False, False),
    ([], False, "auto", False, False),
    (["d/ckpt_00000003.pt"], True, "auto", False, True),
    (["d/metrics.jsonl"], False, "auto", False, False),  # a restart before the first checkpoint starts over
    (["d/metrics.jsonl"], False, "off", False, False),  # and so does a rerun: there is nothing to lose
    (["d/metrics.jsonl", "d/report.md", "d/curves.png", "d/summary.json"], False, "off", False, False),  # its report
    (["d/ckpt_00000003.pt", "d/report.md"], True, "off", False, r"already holds a run \(ckpt_00000003.pt, report.md\)"),
    (["d/ckpt_00000003.pt"], True, "on", False, True),
    (["d/ckpt_00000003.pt", "d/metrics.jsonl"], True, "off", True, False),
    (["d/ckpt_00000003.pt", "d/metrics.jsonl"], True, "off", False,
     r"--out-dir d already holds a run \(ckpt_00000003.pt, metrics.jsonl\): pass --resume .*--overwrite"),
    (["d/best.pt"], False, "off", False, r"--out-dir d already holds a run \(best.pt\): pass --overwrite"),
    (["d/best.pt", "d/metrics.jsonl"], False, "auto", False, r"already holds a run \(best.pt\)"),
    (["d/metrics.jsonl"], False, "on", False, NO_CHECKPOINT + r"the run there stopped before its first one; "
                                              r"--resume auto \(or no --resume\) starts it fresh, replacing its "
                                              r"metrics.jsonl$"),
    ([], False, "on", False, NO_CHECKPOINT + "--resume auto starts fresh"),
    (["d/best.pt"], False, "on", False, NO_CHECKPOINT + "only best.pt, which is never resumed from"),
])
def test_decide_resume(outputs, has_ckpt, resume, overwrite, expected):
    if isinstance(expected, str):
        with pytest.raises(UsageError, match=expected):
            rundir.decide_resume("d", outputs, has_ckpt, resume, overwrite)
    else:
        assert rundir.decide_resume("d", outputs, has_ckpt, resume, overwrite) is expected


@pytest.mark.parametrize("name, sharded", [(".lock", False), ("metrics.jsonl", False), ("config.toml", False),
                                           ("config.toml.tmp", False), ("best.pt", False), ("trace.json", True)])
def test_a_directory_where_the_run_writes_a_file_is_refused_before_anything_is_written(tmp_path, name, sharded):
    (tmp_path / name).mkdir()
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(UsageError, match=rf"^{tmp_path / name} is a directory, where this run writes a file: "):
        rundir.claim(CheckpointConfig(out_dir=str(tmp_path), resume="auto"), sharded)
    assert sorted(os.listdir(tmp_path)) == before


def test_a_repeat_from_a_config_file_into_a_used_out_dir_is_told_what_to_add():
    with pytest.raises(UsageError, match=r"^--out-dir d already holds a run \(ckpt_00000003.pt\): add --out-dir "
                                         r"NEW_DIR to repeat --config d/config.toml in a new directory, or pass "
                                         r"--resume to continue it, --overwrite to replace it$"):
        rundir.decide_resume("d", ["d/ckpt_00000003.pt"], True, "off", False, config_file="d/config.toml")


def test_a_file_where_tensorboard_writes_its_directory_is_refused_only_with_tensorboard(tmp_path):
    import telemetry

    (tmp_path / "tensorboard").write_text("the user's")
    with pytest.raises(UsageError, match=rf"^{tmp_path / 'tensorboard'} is not a directory, where --tensorboard "
                                         r"writes its event files: move it aside or choose another --out-dir$"):
        config.parse_args(["--out-dir", str(tmp_path), "--tensorboard"], machine_checks=(telemetry.logger_problems,))
    lock, resume, replaced = rundir.claim(CheckpointConfig(out_dir=str(tmp_path), overwrite=True))
    lock.release()
    assert (resume, replaced) == (False, []) and (tmp_path / "tensorboard").read_text() == "the user's"


def test_best_must_be_of_the_kind_the_run_writes(tmp_path):
    (tmp_path / "best").write_text("")  # a sharded run's best is a directory; a single-file run has no "best"
    assert rundir.misplaced(str(tmp_path), sharded=False) is None
    assert rundir.misplaced(str(tmp_path), sharded=True) == (f"{tmp_path / 'best'} is not a directory, where this "
                                                             "run writes a checkpoint directory")


def test_a_lock_file_that_cannot_be_opened_is_a_usage_error(tmp_path):
    (tmp_path / ".lock").mkdir()
    with pytest.raises(UsageError, match=rf"--out-dir {tmp_path}: cannot open its lock file {tmp_path / '.lock'}"):
        rundir.RunLock(str(tmp_path))


HOLD = "import sys, time, rundir; rundir.RunLock(sys.argv[1]); print('locked', flush=True); time.sleep(60)"


def test_a_second_run_is_refused_naming_the_holder_and_a_killed_holder_leaves_no_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UsageError, match=rf"is in use by another run \(pid {holder.pid}\)"):
            rundir.RunLock(str(tmp_path))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = rundir.RunLock(str(tmp_path))  # the kernel dropped the dead process's lock
    lock.release()


@pytest.fixture
def train(train_in_process):
    return lambda out_dir, *flags: train_in_process("--out-dir", out_dir, *TINY_FLAGS, *flags)


def one_error_line(result):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_a_fresh_run_refuses_a_used_out_dir_until_told_what_to_do(tiny_data, tmp_path, train):
    # A warm-up past every step: extending the run to 6 steps re-warms no decayed LR.
    common = ["--data", tiny_data, "--ckpt-interval", "2", "--eval-interval", "0", "--warmup", "15"]
    assert train(tmp_path, *common, "--max-steps", "4").returncode == 0
    before = sorted(os.listdir(tmp_path))
    assert "already holds a run" in one_error_line(train(tmp_path, *common, "--max-steps", "2"))
    assert sorted(os.listdir(tmp_path)) == before  # nothing touched
    resumed = train(tmp_path, *common, "--max-steps", "6", "--resume", "auto")
    assert resumed.returncode == 0 and "from step 4" in resumed.stdout
    replaced = train(tmp_path, *common, "--max-steps", "2", "--overwrite")
    assert replaced.returncode == 0
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".pt")) == ["ckpt_00000002.pt"]


def test_a_runs_outputs_are_its_checkpoints_records_and_report(tmp_path):
    for name in ("ckpt_00000002.pt", "metrics.jsonl", "report.md", "curves.png", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "tensorboard").mkdir()
    found = rundir.run_outputs(str(tmp_path), [str(tmp_path / "ckpt_00000002.pt")])
    assert sorted(os.path.basename(p) for p in found) == ["ckpt_00000002.pt", "curves.png", "metrics.jsonl",
                                                          "report.md", "tensorboard"]  # --overwrite's; not the user's


@pytest.mark.parametrize("resume", ["off", "auto"])
def test_a_rerun_after_a_run_without_checkpoints_replaces_all_its_records(tmp_path, resume, capsys):
    """Run A halted before its first checkpoint: a rerun B must not keep A's summary (report.py would pair it
    with B's metrics), report, curves or TensorBoard events."""
    records = ["metrics.jsonl", "summary.json", "report.md", "curves.png", "tensorboard"]
    for name in records[:-1]:
        (tmp_path / name).write_text("run A's")
    (tmp_path / "tensorboard").mkdir()
    lock, resumed, replaced = rundir.claim(CheckpointConfig(out_dir=str(tmp_path), resume=resume))
    lock.release()
    assert not resumed and sorted(replaced) == sorted(str(tmp_path / name) for name in records)
    assert capsys.readouterr().err == (f"note: the earlier run in --out-dir {tmp_path} left no checkpoint; starting "
                                       "fresh, its metrics.jsonl, report.md, curves.png, summary.json, tensorboard "
                                       "are replaced\n")


def test_a_run_stopped_before_its_first_checkpoint_is_no_dead_end(tiny_data, tmp_path, capsys):
    import train

    old = [json.dumps({"step": s, "train_loss": 99.0}) + "\n" for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(old) + '{"step": 4, "tra')  # killed mid-line at step 4
    args = ["--out-dir", str(tmp_path), *TINY_FLAGS, "--data", tiny_data, "--max-steps", "2", "--eval-interval", "0",
            "--device", "cpu"]
    with pytest.raises(SystemExit) as refused:
        train.main([*args, "--resume"])
    assert refused.value.code == 2 and "stopped before its first one; --resume auto" in capsys.readouterr().err
    train.main(args)
    assert (f"note: the earlier run in --out-dir {tmp_path} left no checkpoint; starting fresh, its metrics.jsonl "
            "is replaced") in capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["train_loss"] != 99.0 for r in records)


def test_resume_auto_starts_fresh_when_there_is_nothing_to_resume(tiny_data, tmp_path, train):
    result = train(tmp_path, "--data", tiny_data, "--max-steps", "2", "--eval-interval", "0", "--resume", "auto")
    assert result.returncode == 0 and "off (fresh run; --resume auto)" in result.stdout


def test_two_runs_in_one_out_dir_cannot_overlap(tiny_data, tmp_path, train):
    first = subprocess.Popen([sys.executable, "train.py", "--out-dir", str(tmp_path), *TINY_FLAGS, "--data", tiny_data,
                              "--max-steps", "100000", "--eval-interval", "0"], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not os.path.exists(tmp_path / "metrics.jsonl") and time.time() < deadline:
            time.sleep(0.2)
        second = train(tmp_path, "--data", tiny_data, "--max-steps", "2", "--resume", "auto")
        assert f"is in use by another run (pid {first.pid})" in one_error_line(second)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()


def test_a_filesystem_without_flock_warns_and_runs(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    rundir.RunLock(str(tmp_path)).release()
    assert "cannot be locked (No locks available)" in capsys.readouterr().err


def test_files_of_a_runs_names_that_no_run_left_are_replaced_only_with_overwrite(tmp_path):
    """A hand-written config.toml and a report.md and summary.json of the user's, with no metrics.jsonl: not
    an earlier run's records, so a fresh run there is refused, touching nothing, unless --overwrite."""
    files = {"config.toml": "[model]\nn_layer = 2\n", "report.md": "mine", "summary.json": "{}", "trace.json": "{}"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(UsageError, match=rf"^--out-dir {tmp_path} holds config.toml, report.md, summary.json, "
                                         r"trace.json, which no run left there .* or pass --overwrite to replace "
                                         r"them$"):
        rundir.claim(CheckpointConfig(out_dir=str(tmp_path)))
    assert {p.name: p.read_text() for p in tmp_path.iterdir() if p.name != ".lock"} == files
    lock, resumed, replaced = rundir.claim(CheckpointConfig(out_dir=str(tmp_path), overwrite=True))
    lock.release()
    assert not resumed and sorted(map(os.path.basename, replaced)) == ["report.md", "summary.json", "trace.json"]


def test_a_runs_config_keeps_its_records_a_runs_own(tmp_path):
    """A run's config.toml (its digest line, even once edited) or its metrics.jsonl marks the records as a run's."""
    cfg = config.parse_args(["--n-layer", "1"])
    config.write_config(cfg, str(tmp_path / "config.toml"))
    (tmp_path / "report.md").write_text("run A's")
    assert rundir.left_by_no_run(str(tmp_path), [str(tmp_path / "report.md")]) == []
    (tmp_path / "config.toml").write_text((tmp_path / "config.toml").read_text().replace("n_layer = 1", "n_layer = 3"))
    assert rundir.left_by_no_run(str(tmp_path), [str(tmp_path / "report.md")]) == []
    (tmp_path / "config.toml").unlink()
    outputs = [str(tmp_path / "metrics.jsonl"), str(tmp_path / "report.md")]
    assert rundir.left_by_no_run(str(tmp_path), outputs) == []
    assert rundir.left_by_no_run(str(tmp_path), outputs[1:]) == outputs[1:]


def test_a_hand_written_config_in_the_out_dir_is_not_replaced_by_the_run(tiny_data, tmp_path, train):
    path = tmp_path / "config.toml"
    path.write_text("# mine\n[schedule]\nmax_steps = 2\n")
    line = one_error_line(train(tmp_path, "--config", str(path), "--data", tiny_data, "--eval-interval", "0"))
    assert "holds config.toml, which no run left there" in line
    assert path.read_text() == "# mine\n[schedule]\nmax_steps = 2\n" and sorted(os.listdir(tmp_path)) == [
        ".lock", "config.toml"]


def test_a_config_file_in_a_copied_run_must_say_which_run_it_means(tmp_path):
    base, copy = tmp_path / "base", tmp_path / "copy"
    for run in (base, copy):
        run.mkdir()
        (run / "ckpt_00000002.pt").write_text("x")
    with pytest.raises(UsageError, match=rf"^--config {copy}/config.toml is in {copy}, which holds a run, but names "
                                         rf"--out-dir {base}: add --out-dir {copy} for the run it is in"):
        rundir.claim(CheckpointConfig(out_dir=str(base), resume="on"), config_file=str(copy / "config.toml"))
    assert sorted(os.listdir(base)) == ["ckpt_00000002.pt"]  # not even locked
    assert rundir.moved_run(str(base / "config.toml"), str(base)) is None  # the run it is in
    assert rundir.moved_run(str(tmp_path / "kept.toml"), str(base)) is None  # a file kept apart from any run


def test_a_command_refused_at_start_up_leaves_no_directory_it_created(tiny_data, tmp_path, train):
    out = tmp_path / "new" / "run"
    with pytest.raises(UsageError, match="holds no checkpoint"):
        rundir.claim(CheckpointConfig(out_dir=str(out), resume="on"))
    assert not out.exists() and (tmp_path / "new").is_dir()  # only the directory the run would have used
    assert "lr" in one_error_line(train(out, "--data", tiny_data, "--max-steps", "2", "--lr", "-1"))
    assert not out.exists()
    (out / "notes").mkdir(parents=True)  # a directory the user had stays, lock file and all
    with pytest.raises(UsageError):
        rundir.claim(CheckpointConfig(out_dir=str(out), resume="on"))
    assert sorted(os.listdir(out)) == [".lock", "notes"]


def test_resume_in_a_directory_of_the_users_files_says_they_are_not_a_run(tmp_path):
    (tmp_path / "report.md").write_text("mine")
    with pytest.raises(UsageError, match=r"holds report.md, which no run left there"):
        rundir.claim(CheckpointConfig(out_dir=str(tmp_path), resume="on"))


def test_a_runs_config_is_known_by_its_digest_wherever_an_edit_moved_it(tmp_path):
    config.write_config(config.parse_args([]), str(tmp_path / "config.toml"))
    text = (tmp_path / "config.toml").read_text()
    (tmp_path / "config.toml").write_text("# my notes on this run\n\n" + text)
    assert rundir.runs_config(str(tmp_path / "config.toml"))
