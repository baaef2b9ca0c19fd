import json
import os
import subprocess
import sys

import pytest

from runlog import MetricsError, read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _log(path, lines: list[str]) -> str:
    path.write_text("".join(lines))
    return str(path)


def _records(n):
    return [json.dumps({"step": s, "tokens": 256 * s, "train_loss": 5.0 - 0.1 * s, "time_s": 0.5 * s}) + "\n"
            for s in range(1, n + 1)]


def test_a_torn_last_line_is_skipped_with_one_note(tmp_path):
    path = _log(tmp_path / "metrics.jsonl", _records(3) + ['{"step": 4, "tokens": 10'])  # killed mid-write
    records, note = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert note == f"note: {path}:4: the last line was torn (a process stopped mid-write), skipped"
    assert read_metrics(_log(tmp_path / "whole.jsonl", _records(3))) == (read_metrics(path)[0], None)
    # a last line that is whole but lost its newline is a record; a missing file has none
    assert len(read_metrics(_log(tmp_path / "b.jsonl", _records(2) + [_records(3)[2].rstrip("\n")]))[0]) == 3
    assert read_metrics(str(tmp_path / "none.jsonl")) == ([], None)


@pytest.mark.parametrize("lines, words", [
    (_records(1) + ['{"step": 2, "tok\n'] + _records(3)[2:], "metrics.jsonl:2: not a JSON line"),
    (_records(2) + ["not json\n"], "metrics.jsonl:3: not a JSON line"),  # whole lines: damage, not a tear
    (_records(1) + ["[1, 2]\n"], "metrics.jsonl:2: not a JSON object"),
    (_records(1) + ['{"step": 2}\n'], "metrics.jsonl:2: a record without an integer 'tokens'"),
    (["\n"] + _records(1) + ['{"step": -1, "tokens": 0}\n'], "metrics.jsonl:3: a record without an integer 'step'")])
def test_damage_elsewhere_is_refused_naming_the_line(tmp_path, lines, words):
    with pytest.raises(MetricsError, match=words):
        read_metrics(_log(tmp_path / "metrics.jsonl", lines))


def test_report_and_plot_read_a_log_whose_last_line_was_torn(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    _log(out / "metrics.jsonl", _records(6) + ['{"step": 7, "tokens": 17'])
    for script, args in [("report.py", [str(out)]), (os.path.join("bench", "plot.py"), [str(out)])]:
        r = subprocess.run([sys.executable, os.path.join(REPO, script), *args], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert f"note: {out / 'metrics.jsonl'}:7: the last line was torn" in r.stderr
    assert "steps 1 to 6" in (out / "report.md").read_text() and (out / "curves.png").stat().st_size > 0
