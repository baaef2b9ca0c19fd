"""report.py: OUT/report.md and OUT/curves.png after a stopped run and after its resume, which finishes, written
again alike from the directory alone; its sections' pure parts."""

import json
import os
import signal

import pytest
import torch

import loop
import report
import train
from conftest import TINY_FLAGS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SECTIONS = ("## Summary", "## Settings that differ from the defaults", "## Hardware and software", "## Time by phase",
            "## Curves", "## Evals", "## Last samples")


def run(data, out_dir, *flags):
    train.main(["--data", data, "--out-dir", str(out_dir), *TINY_FLAGS, "--warmup", "2", "--eval-interval", "2",
                "--eval-tokens", "256", "--device", "cpu", "--dtype", "fp32", *flags])


def records(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read(out_dir):
    with open(os.path.join(out_dir, "report.md"), encoding="utf-8") as f:
        return f.read()


def eval_row(record):
    return f"| {record['step']} | {record['tokens']:,} | {record['val_loss']:.4f} | {record['val_bpb']:.4f} |"


def test_a_stopped_run_and_its_resume_leave_a_report_that_report_py_writes_again_alike(tiny_data, tmp_path,
                                                                                         monkeypatch, capsys):
    step, calls = loop.train_step, []

    def stopped_in_step_2(run, *args):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(run, *args)

    flags = ["--max-steps", "4", "--lr", "0.01", "--sample-tokens", "4", "--sample-prompt", "x"]
    monkeypatch.setattr(loop, "train_step", stopped_in_step_2)
    run(tiny_data, tmp_path, *flags)
    stopped = read(tmp_path)
    assert "| outcome | stopped by SIGTERM at step 2;" in stopped and "(2 records, steps 1 to 2)" in stopped
    assert eval_row(records(tmp_path)[1]) in stopped

    monkeypatch.setattr(loop, "train_step", step)
    run(tiny_data, tmp_path, *flags, "--resume")
    assert capsys.readouterr().out.splitlines()[-1] == f"report: {tmp_path / 'report.md'} and {tmp_path / 'curves.png'}"
    text, logged = read(tmp_path), records(tmp_path)
    assert [line for line in text.splitlines() if line.startswith("## ")] == list(SECTIONS)
    assert "| outcome | finished |" in text and "| steps | 4 of 4, resumed at 2 |" in text
    assert "| precision | fp32 (requested) |" in text  # what --dtype resolved to, which config.toml cannot say
    assert "(4 records, steps 1 to 4)" in text and eval_row(logged[1]) in text and eval_row(logged[3]) in text
    assert "| optim.lr | `--lr` | 0.01 | 0.006 |" in text and "| optim.weight_decay |" not in text
    assert f"| torch | {torch.__version__} |" in text and "| forward | " in text
    assert f"Step 4:\n\n```text\n{logged[3]['sample']}\n```" in text and logged[3]["sample"].startswith("x")
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG_SIGNATURE)

    os.remove(tmp_path / "report.md")
    os.remove(tmp_path / "curves.png")
    assert report.main([str(tmp_path)]) == 0
    assert read(tmp_path) == text and (tmp_path / "curves.png").read_bytes().startswith(PNG_SIGNATURE)
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_a_directory_without_a_run_is_one_line_and_exit_2(tmp_path, capsys):
    for target in (tmp_path, tmp_path / "nowhere"):
        with pytest.raises(SystemExit) as exit_info:
            report.main([str(target)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith(f"error: {target}") and err.count("\n") == 1
    assert os.listdir(tmp_path) == []
    (tmp_path / "summary.json").write_text('{"summary": {}}')  # not what after_run writes
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "summary.json: not the facts, rows and" in err


def test_a_directory_where_the_report_goes_or_a_failed_write_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "tokens": 128, "train_loss": 5.0}\n')
    for name in ("report.md", "curves.png"):
        (tmp_path / name).mkdir()
        with pytest.raises(SystemExit) as exit_info:
            report.main([str(tmp_path)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1
        assert err.startswith(f"error: {tmp_path / name} is a directory, which the report would replace")
        assert sorted(os.listdir(tmp_path)) == sorted(["metrics.jsonl", name])  # nothing written
        (tmp_path / name).rmdir()

    def disk_full(path, *chunks):
        raise report.WriteError(f"cannot write file {path}: No space left on device")

    monkeypatch.setattr(report, "atomic_write", disk_full)
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err == f"error: cannot write file {tmp_path / 'report.md'}: No space left on device\n"


def test_a_report_that_cannot_be_written_is_one_warning_line(tmp_path, capsys):
    report.after_run({"out_dir": str(tmp_path / "gone")}, torch.device("cpu"), 1)
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"warning: no report written in {tmp_path / 'gone'} (") and err.count("\n") == 1
    report.after_run(None, torch.device("cpu"), 2)  # another rank: nothing to write
    assert capsys.readouterr() == ("", "")


# ----------------------------------------------------------------------------- the sections


def test_config_rows_are_the_settings_that_differ_from_the_defaults():
    rows = report.config_rows({"optim.lr": 0.01, "optim.name": "muon", "speed.compile": "default",
                               "model.head_dim": None, "ckpt.from_hf": "hf"})
    assert rows == [("optim.lr", "`--lr`", "0.01", "0.006"), ("speed.compile", "`--compile`", '"default"', '"off"'),
                    ("ckpt.from_hf", "`--from-hf`", '"hf"', "unset")]


def test_phase_rows_split_the_loops_clock_and_name_what_remains():
    phases = {"time_data_ms": 100, "time_forward_ms": 1000, "time_backward_ms": 2000, "time_optimizer_ms": 400}
    rows = report.phase_rows([{**phases, "time_s": 4.0}, {**phases, "time_s": 10.0}])
    assert [row[:3] for row in rows] == [("data", "0.2", "2.0%"), ("forward", "2.0", "20.0%"),
                                        ("backward", "4.0", "40.0%"), ("optimizer", "0.8", "8.0%"),
                                        ("other", "3.0", "30.0%"), ("total", "10.0", "100%")]
    over = report.phase_rows([{**phases, "time_s": 3.0}])  # GPU-timed phases past the host's clock
    assert [row[0] for row in over] == ["data", "forward", "backward", "optimizer", "total"]
    assert report.phase_rows([{"time_s": 3.0}]) == []  # a log from before phases were recorded


def test_the_eval_table_has_a_mixtures_sources_and_skipped_evals_and_thins_long_runs():
    logged = [{"step": 1, "tokens": 10, "train_loss": 5.0},
              {"step": 2, "tokens": 20, "val_loss": 4.5, "val_loss/web": 4.25, "val_loss/code": 4.75,
               "hellaswag_acc": 0.25},
              {"step": 4, "tokens": 40, "eval_skipped": "out of memory"}]
    assert report.eval_table(logged) == [
        "| step | tokens | val loss | hellaswag acc | val loss/code | val loss/web |",
        "| --- | --- | --- | --- | --- | --- |",
        "| 2 | 20 | 4.5000 | 0.2500 | 4.7500 | 4.2500 |",
        "| 4 | 40 | skipped: out of memory |  |  |  |"]
    assert report.thin(list(range(100)), 5) == [0, 25, 50, 74, 99]  # round(24.75) = 25, round(74.25) = 74
    long = report.eval_table([{"step": s, "tokens": s, "val_loss": 1.0} for s in range(1, 101)])
    assert len(long) == 2 + report.MAX_EVAL_ROWS + 2 and long[-1].startswith(f"{report.MAX_EVAL_ROWS} of the 100")


def test_a_sample_is_fenced_past_its_own_backticks():
    assert report.fenced("a ```` b") == ["`````text", "a ```` b", "`````"]
    assert report.sample_lines([{"step": 3, "sample": "x"}]) == ["Step 3:", "", "```text", "x", "```"]


def test_a_summary_older_than_the_last_step_says_so():
    """A resumed process killed outright leaves the summary of the process before it."""
    summary = {"facts": {"done": 2}, "rows": [("outcome", "stopped by SIGTERM at step 2")], "machine": [("torch", "2")]}
    logged = [{"step": s, "tokens": 10 * s} for s in (1, 2, 3)]
    text = report.render("out", logged, summary, {}, curves=True)
    assert "| outcome | stopped by SIGTERM at step 2 |\n\nThis is the summary of a process that ended at step 2; " \
           "the steps go on to 3, and their process did not reach its summary." in text
    assert "This is the summary" not in report.render("out", logged[:2], summary, {}, curves=True)
    assert "None: every setting is its default." in text and "| torch | 2 |" in text


@pytest.mark.parametrize("metrics, summary, expected", [
    ('{"step": 1, "tokens": 128}\n\n{"tokens": 256}\n', None, "metrics.jsonl:3: a record without an integer 'step'"),
    ('{"step": 1, "tokens": "128"}\n', None, "metrics.jsonl:1: a record without an integer 'tokens'"),
    ('{"step": 1, "tokens": 128}\n', {"facts": {"done": "3"}, "rows": [], "machine": []},
     "summary.json: not the facts, rows and machine of a run's summary; move it aside"),
    ('{"step": 1, "tokens": 128}\n', {"facts": {"done": 1}, "rows": [3], "machine": []},
     "summary.json: not the facts"),
])
def test_a_record_or_summary_the_report_cannot_show_is_one_line_naming_it(tmp_path, capsys, metrics, summary,
                                                                           expected):
    (tmp_path / "metrics.jsonl").write_text(metrics)
    if summary is not None:
        (tmp_path / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(f"error: {tmp_path}/{expected}") and err.count("\n") == 1
    assert not (tmp_path / "report.md").exists()
