import importlib
import json
import math
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
import cli  # noqa: E402
import curves  # noqa: E402
import default_run  # noqa: E402
import docs_corpus  # noqa: E402
import optimizers  # noqa: E402
import plot  # noqa: E402
import recipe  # noqa: E402
import recipe_cache  # noqa: E402
import recipe_verdict  # noqa: E402
import throughput  # noqa: E402
import tokenizer_speed  # noqa: E402
from conftest import TINY_FLAGS, WORD_TEXT  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(out_dir, steps, loss0, lr, seconds_per_step=None):
    """A metrics.jsonl as train.py writes it: every step, with val_loss every 4 steps; time_s when
    seconds_per_step is given (runs logged before train.py wrote it have none)."""
    os.makedirs(out_dir)
    with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
        for step in range(steps):
            record = {"step": step, "tokens": (step + 1) * 256, "train_loss": loss0 - 0.1 * step, "lr": lr,
                      "grad_norm": 1.0, "tokens_per_sec": 1000.0 + step, "mfu": None}
            if seconds_per_step is not None:
                record["time_s"] = (step + 1) * seconds_per_step
            if (step + 1) % 4 == 0:
                record["val_loss"] = loss0 - 0.1 * step + 0.05
            f.write(json.dumps(record) + "\n")
    return str(out_dir)


def run_plot(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "bench", "plot.py"), *args], capture_output=True,
                          text=True, timeout=60)


def test_plot_cli_overlays_two_runs_into_a_valid_png(tmp_path):
    a = write_run(tmp_path / "run_a", 12, 5.0, 1e-3)
    b = write_run(tmp_path / "run_b", 8, 5.5, 3e-3)
    out = tmp_path / "curves.png"
    result = run_plot(a, b, "--out", str(out))
    assert result.returncode == 0, result.stderr
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    # The IHDR chunk follows the signature; a figure with three panels is taller than it is wide.
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert 0 < width < height


def test_plot_cli_missing_metrics_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plot.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "metrics.jsonl" in err and not (tmp_path / "x.png").exists()


def test_a_run_named_with_a_leading_underscore_has_its_legend_entry(tmp_path):
    """matplotlib leaves labels that start with _ out of a legend: the run's name still shows."""
    runs = {"_sig": curves.read_metrics(write_run(tmp_path / "_sig", 8, 5.0, 1e-3))}
    fig = curves.draw_runs(runs, ["loss"], None, None, None, "tokens", 0, False)
    texts = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert texts and all(t.strip().startswith("_sig") for t in texts)


def test_plot_cli_names_an_out_dir_given_twice_not_a_flag_it_was_not_given(tmp_path, capsys):
    a = write_run(tmp_path / "run", 4, 5.0, 1e-3)
    with pytest.raises(SystemExit) as e:
        plot.main([a, a])
    assert e.value.code == 2 and capsys.readouterr().err == f"error: OUT_DIR {a} is given twice\n"


def test_read_metrics_keeps_val_loss_only_on_eval_steps(tmp_path):
    records = curves.read_metrics(write_run(tmp_path / "run", 8, 5.0, 1e-3))
    assert curves.series(records, "val_loss") == ([1024, 2048], [pytest.approx(4.75), pytest.approx(4.35)])


def test_read_metrics_rejects_a_corrupt_line(tmp_path):
    out_dir = write_run(tmp_path / "run", 4, 5.0, 1e-3)
    with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
        f.write("{not json\n")
    with pytest.raises(curves.MetricsError, match=r"metrics.jsonl:5: not a JSON line"):
        curves.read_metrics(out_dir)


def test_plot_runs_rejects_an_unknown_panel_and_draws_any_logged_metric(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown panel 'perplexity': neither one of loss, "):
        curves.plot_runs({}, str(tmp_path / "x.png"), panels=("loss", "perplexity"))
    run = write_run(tmp_path / "run", 4, 5.0, 1e-3)
    fig = curves.draw_runs({"run": curves.read_metrics(run)}, panels=("grad_norm",), x="step")
    assert fig.axes[0].get_ylabel() == "grad_norm" and lines_of(fig, "run")["run"][0] == [0, 1, 2, 3]
    with pytest.raises(SystemExit) as e:
        plot.main([run, "--panels", "loss", "perplexity"])
    assert e.value.code == 2 and "unknown panel 'perplexity'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="panel 'mfu': the runs logged it without a value"):  # a CPU run's
        curves.draw_runs({"run": curves.read_metrics(run)}, panels=("mfu",), x="step")


def test_ema_is_debiased_and_steps_over_non_finite_values():
    assert curves.ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # no pull toward zero at the start
    assert curves.ema([0.0, 10.0], 0.5) == pytest.approx([0.0, 20 / 3])  # weights 1/3 and 2/3
    assert curves.ema([1.0, 5.0, 3.0], 0.0) == [1.0, 5.0, 3.0]
    smoothed = curves.ema([1.0, math.nan, 3.0], 0.5)
    assert smoothed[0] == 1.0 and math.isnan(smoothed[1]) and smoothed[2] == pytest.approx(7 / 3)


def lines_of(fig, label):
    """{line label: (x data, y data)} of every labelled line on the first panel."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].lines
            if line.get_label() == label or line.get_label().startswith(f"{label} (")}


def test_draw_runs_against_steps_and_time_smoothed_on_a_log_scale(tmp_path):
    records = curves.read_metrics(write_run(tmp_path / "run", 12, 5.0, 1e-3, seconds_per_step=30.0))
    fig = curves.draw_runs({"run": records}, x="step", smooth=0.8, log_y=True)
    assert fig.axes[0].get_yscale() == "log" and fig.axes[1].get_yscale() == "linear"  # loss only
    assert fig.axes[-1].get_xlabel() == "step"
    lines = lines_of(fig, "run")
    steps, raw = curves.series(records, "train_loss", "step")
    assert lines["run (train)"] == (steps, pytest.approx(curves.ema(raw, 0.8)))
    assert lines["run (val)"] == curves.series(records, "val_loss", "step")  # val loss is never smoothed
    assert raw in [list(line.get_ydata()) for line in fig.axes[0].lines]  # the raw curve, faint, behind it
    fig = curves.draw_runs({"run": records}, x="time")
    assert fig.axes[-1].get_xlabel() == "wall-clock time (min)"  # 360 s: in minutes
    assert lines_of(fig, "run")["run (train)"][0] == pytest.approx([(step + 1) * 0.5 for step in range(12)])


def test_plot_cli_x_time_needs_time_s_in_every_record(tmp_path, capsys):
    a = write_run(tmp_path / "run_a", 4, 5.0, 1e-3, seconds_per_step=1.0)
    b = write_run(tmp_path / "run_b", 4, 5.0, 1e-3)
    with pytest.raises(SystemExit) as exit_info:
        plot.main([a, b, "--x", "time", "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and not (tmp_path / "x.png").exists()
    assert err.startswith(f"error: {os.path.join(b, 'metrics.jsonl')}: 4 of 4 records have no time_s")
    plot.main([a, "--x", "time", "--smooth", "0.9", "--log-y", "--out", str(tmp_path / "x.png")])
    assert (tmp_path / "x.png").read_bytes().startswith(PNG_SIGNATURE)


def test_plot_cli_writes_beside_the_first_runs_metrics_by_default(tmp_path, monkeypatch, capsys):
    a = write_run(tmp_path / "run_a", 4, 5.0, 1e-3)
    b = write_run(tmp_path / "run_b", 4, 5.5, 1e-3)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    plot.main([a, b, "--x", "step"])
    assert capsys.readouterr().out == f"wrote {os.path.join(a, 'curves.png')}\n"
    assert (tmp_path / "run_a" / "curves.png").read_bytes().startswith(PNG_SIGNATURE)
    assert not os.listdir(tmp_path / "cwd") and not (tmp_path / "run_b" / "curves.png").exists()


@pytest.mark.parametrize("argv, words", [
    (["--smooth", "1"], "argument --smooth: must be an ema factor in [0, 1)"), (["--smooth", "x"], "got 'x'"),
    (["--x", "seconds"], "argument --x: invalid choice: 'seconds'")])
def test_plot_cli_bad_flags_are_one_line(tmp_path, capsys, argv, words):
    with pytest.raises(SystemExit) as exit_info:
        plot.main([write_run(tmp_path / "run", 4, 5.0, 1e-3), *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and words in err and err.count("\n") == 1


def plot_error(capsys, argv):
    """plot.main's one error line for argv, which must exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        plot.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1
    return err


def test_plot_cli_refuses_what_is_no_figure_file_and_says_what_it_wrote(tmp_path, monkeypatch, capsys):
    run = write_run(tmp_path / "run", 4, 5.0, 1e-3)
    monkeypatch.chdir(tmp_path)
    os.mkdir("dir")
    open("file.txt", "w").close()
    assert "--out dir names a directory, not a file; name the file to write, as --out dir/curves.png" in plot_error(
        capsys, [run, "--out", "dir"])
    assert "--out file.txt/sub/x.png: file.txt is a file, not a directory" in plot_error(
        capsys, [run, "--out", "file.txt/sub/x.png"])
    assert "--out x.txt: no .txt figures; end the name in one of " in plot_error(capsys, [run, "--out", "x.txt"])
    os.mkdir(os.path.join(run, "curves.png"))  # the default figure's place
    assert f"{run}/curves.png is a directory, which the figure would replace; move it aside, or pass --out" in (
        plot_error(capsys, [run]))
    assert sorted(os.listdir()) == ["dir", "file.txt", "run"]
    plot.main([run, "--out", "noext"])  # as matplotlib names it
    assert capsys.readouterr().out == "wrote noext.png\n" and open("noext.png", "rb").read(8) == PNG_SIGNATURE


def test_plot_cli_replaces_the_file_out_names_only_once_the_new_one_is_whole(tmp_path, monkeypatch, capsys):
    run, out = write_run(tmp_path / "run", 4, 5.0, 1e-3), tmp_path / "mine.png"
    out.write_bytes(b"old")
    savefig = curves.plt.Figure.savefig

    def disk_full(fig, f, **kwargs):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(curves.plt.Figure, "savefig", disk_full)
    assert f"cannot write figure {out}: No space left on device" in plot_error(capsys, [run, "--out", str(out)])
    assert sorted(os.listdir(tmp_path)) == ["mine.png", "run"]  # no temporary file left
    assert out.read_bytes() == b"old"
    monkeypatch.setattr(curves.plt.Figure, "savefig", savefig)
    plot.main([run, "--out", str(out)])  # named by --out: asked for
    assert capsys.readouterr().out == f"wrote {out}\n" and out.read_bytes().startswith(PNG_SIGNATURE)


def test_loss_limits_leave_out_the_first_steps_far_higher_losses():
    falling = [3.0 + 8.0 * math.exp(-step / 10) for step in range(200)]  # 11 down to 3, most of it near 3
    low, quantile = falling[-1], falling[20]  # the 90% quantile of 200 losses: the 180th lowest
    high = quantile + 0.5 * (quantile - low)
    pad = 0.05 * (high - low)
    assert curves.loss_limits(falling + [math.nan]) == pytest.approx((low - pad, high + pad))
    assert high < 5.0  # the first 16 losses, up to 11, are above the axis
    assert curves.loss_limits([5.0, 5.1, 4.9, 5.2]) == pytest.approx((4.9 - 0.015, 5.2 + 0.015))  # flat: all of it
    assert curves.loss_limits([5.0, 5.0]) is None and curves.loss_limits([]) is None


def test_auto_smoothing_spans_about_one_percent_of_a_long_curve_and_leaves_a_short_one():
    assert curves.auto_smoothing(0) == curves.auto_smoothing(50) == curves.auto_smoothing(100) == 0.0
    assert curves.auto_smoothing(1000) == pytest.approx(0.9) and curves.auto_smoothing(10_000) == pytest.approx(0.99)


def test_the_default_figure_is_legible_without_flags(tmp_path):
    """A long run with a steep start: the train loss smoothed over its raw steps, the loss axis not squashed by
    the first steps, every axis from 0 but the loss's."""
    records = [{"step": s, "tokens": 1000 * s, "train_loss": 3.0 + 8.0 * math.exp(-s / 20) + 0.1 * (-1) ** s,
                "lr": 1e-3, "tokens_per_sec": 5000.0 + 100 * (-1) ** s} for s in range(1, 1001)]
    fig = curves.draw_runs({"run": records})
    loss, rate, lr = fig.axes
    assert loss.get_xlim()[0] == 0 and loss.get_ylim()[1] < 4.0 and rate.get_ylim()[0] == lr.get_ylim()[0] == 0
    raw = [r["train_loss"] for r in records]
    assert lines_of(fig, "run")["run (train)"][1] == pytest.approx(curves.ema(raw, 0.9))
    assert raw in [list(line.get_ydata()) for line in loss.lines]
    assert plot.main([write_run(tmp_path / "run", 4, 5.0, 1e-3), "--smooth", "auto"]) is None


@pytest.mark.parametrize("target, expected", [
    (3.0, 250.0),  # halfway between the evals at 200 (3.5) and 300 (2.5)
    (2.5, 300.0),  # exactly on an eval
    (4.0, 100.0),  # already there at the first eval: no earlier measurement to interpolate from
    (1.0, None),  # never reached
])
def test_tokens_to_reach_interpolates_linearly_between_evals(target, expected):
    curve = [(100, 4.0), (200, 3.5), (300, 2.5), (400, 2.0)]
    assert optimizers.tokens_to_reach(curve, target) == expected


def test_tokens_to_reach_uses_the_first_crossing_and_skips_diverged_points():
    assert optimizers.tokens_to_reach([(10, 5.0), (20, 3.0), (30, 4.0), (40, 1.0)], 3.5) == pytest.approx(17.5)
    assert optimizers.tokens_to_reach([(10, 5.0), (20, math.nan), (30, 3.0)], 4.0) == 30.0
    assert optimizers.tokens_to_reach([(10, math.inf), (20, math.nan)], 4.0) is None


def test_best_lr_ignores_diverged_runs():
    def run(final):
        return [{"step": 0, "tokens": 1, "val_loss": 9.0}, {"step": 1, "tokens": 2, "val_loss": final}]

    assert optimizers.best_lr({1e-3: run(4.0), 3e-3: run(3.0), 1e-2: run(math.nan)}) == 3e-3
    assert optimizers.best_lr({1e-2: run(math.nan)}) is None


def test_bench_refuses_train_flags_it_sets_itself():
    with pytest.raises(optimizers.BenchError, match="--lr is set by this benchmark"):
        optimizers.parse_bench_args(["--steps", "10", "--lr=1e-3"])
    _, passed = optimizers.parse_bench_args(["--n-layer", "2", "--steps", "10"])
    assert passed == ["--n-layer", "2"]


# ----------------------------------------------------------------------------- bench/recipe.py

def test_recipe_summary_compares_each_toggle_with_the_baseline_against_the_noise():
    rows = recipe.summarize({"baseline": [3.0, 3.1], "better": [2.7, 2.8], "same": [3.02, 3.12]})
    assert rows["better"]["mean"] == pytest.approx(2.75) and rows["better"]["spread"] == pytest.approx(0.1)
    assert rows["better"]["delta"] == pytest.approx(-0.3) and rows["better"]["beyond_noise"] is True
    assert rows["same"]["beyond_noise"] is False and rows["baseline"]["beyond_noise"] is None
    assert recipe.summarize({"baseline": [3.0], "one_seed": [2.0]})["one_seed"]["beyond_noise"] is None


def test_recipe_reads_a_flags_value_in_either_spelling_the_last_one_as_argparse_does():
    assert recipe.flag_value(["--data", "a", "--lr", "1"], "--data") == "a"
    assert recipe.flag_value(["--data=a", "--data", "b"], "--data") == "b"
    assert recipe.flag_value(["--lr", "1"], "--data") is None and recipe.flag_value(["--data"], "--data") == ""


def test_recipe_marks_toggles_that_cannot_apply_and_refuses_its_own_flags():
    def selected(*argv):
        a, train_argv = recipe.parse_bench_args(list(argv))
        return recipe.select_toggles(a, recipe.config.parse_args(recipe.common_flags(a, train_argv)))

    toggles = selected("--optimizer", "adamw", "--only", "normuon,wsd", "--batch-size", "8")
    assert list(toggles) == ["baseline", "normuon", "wsd"]
    assert toggles["normuon"][1] == "needs --optimizer muon" and toggles["wsd"] == (["--schedule", "wsd"], None)
    no_accumulation = selected("--only", "batch-warmup", "--batch-size", "8")
    assert "gradient accumulation" in no_accumulation["batch-warmup"][1]
    own_accumulation = selected("--only", "ramp", "--toggle",
                                "ramp=--batch-size 4 --grad-accum 4 --batch-warmup-steps 8")
    assert own_accumulation["ramp"][1] is None
    one_micro_step = selected("--only", "ramp", "--toggle", "ramp=--grad-accum=1 --batch-warmup-steps 8")
    assert "gradient accumulation" in one_micro_step["ramp"][1]
    with pytest.raises(recipe.BenchError, match="--seed is set by this benchmark"):
        recipe.parse_bench_args(["--seed", "3"])


@pytest.mark.parametrize("argv, message", [
    (["--jobs", "0"], "--jobs must be >= 1, got 0"), (["--max-tokens", "-5"], "--max-tokens must be >= 1, got -5"),
    (["--anchor-factor", "0"], "--anchor-factor must be >= 1, got 0"),
    (["--seeds", "1", "1"], "--seeds must be distinct, got 1 1")])
def test_recipe_names_the_one_flag_at_fault(argv, message):
    with pytest.raises(recipe.BenchError) as e:
        recipe.parse_bench_args(["--smoke", *argv])
    assert str(e.value) == message


@pytest.mark.parametrize("in_the_way, said", [
    ("t.md", "--out {out}: a directory, where a file is to be written"),
    ("t.json", "--out {out}: a directory at {tmp}/t.json, where the table's record is to be written"),
    (None, "--out {tmp}/t.json: the table's record is written beside it as .json; name the table .md")])
def test_recipe_refuses_an_out_it_could_not_write_before_any_run(tmp_path, capsys, in_the_way, said):
    """The table or its record beside it: a directory in its place would fail only after the sweep's hours, and
    a table named .json would be overwritten by its record."""
    if in_the_way:
        (tmp_path / in_the_way).mkdir()
    with pytest.raises(SystemExit) as e:
        recipe.main(["--smoke", "--out", str(tmp_path / ("t.md" if in_the_way else "t.json"))])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"error: {said.format(out=tmp_path / 't.md', tmp=tmp_path)}\n"


def test_recipe_names_the_toggle_whose_flags_train_py_refuses():
    with pytest.raises(recipe.BenchError, match=r"^toggle x \(--no-such-flag\): unrecognized arguments: --no-such"):
        recipe.toggle_sizes({"x": (["--no-such-flag"], None)}, TINY_FLAGS)
    with pytest.raises(recipe.BenchError, match=r"^toggle y \(--lr -1\): --lr must be positive"):
        recipe.toggle_sizes({"y": (["--lr", "-1"], None)}, TINY_FLAGS)


def test_a_toggle_that_sets_the_defaults_is_not_run_again():
    """wsd is the default schedule: its toggle would repeat the baseline's runs; --schedule cosine would not."""
    selected = {"baseline": ([], None), "wsd": (["--schedule", "wsd"], None),
                "cosine": (["--schedule", "cosine"], None), "normuon": (["--normuon"], "needs --optimizer muon")}
    marked = recipe.without_no_ops(selected, TINY_FLAGS)
    assert marked["wsd"] == (["--schedule", "wsd"], "the baseline's configuration already (its flags set the defaults)")
    assert marked["baseline"][1] is None and marked["cosine"][1] is None
    assert marked["normuon"][1] == "needs --optimizer muon"


def test_recipe_tokens_to_reach_interpolates_final_losses_in_log_tokens():
    assert recipe.tokens_to_reach([100, 400], [4.0, 3.0], 3.5) == (pytest.approx(200.0), "")
    assert recipe.tokens_to_reach([100, 400], [4.0, 3.0], 4.5) == (100.0, "<=")
    assert recipe.tokens_to_reach([100, 400], [4.0, 3.0], 2.0) == (None, ">")
    assert recipe.ratio_text([100, 400], [4.0, 3.0], 2.0, 1600) == "> 0.250 (not reached by 400 tokens)"


def test_recipe_step_cost_compares_step_times_only_on_one_cpu():
    base = {"intel": [4.0, 4.2, 4.1], "amd": [6.0]}
    assert recipe.step_cost({"amd": [6.6]}, base, "amd") == "6,600 ms (1.10x)"
    assert recipe.step_cost({"intel": [4.1, 4.3, 4.5]}, base, "amd") == "4,300 ms (1.05x, on intel)"
    assert recipe.step_cost({"intel": [4.1], "amd": [6.3]}, base, "amd") == "6,300 ms (1.05x)"  # here first
    assert recipe.step_cost({"arm": [1.0]}, base, "amd") == "n/a (no baseline run timed on arm)"
    assert recipe.step_cost({"amd": [1.65]}, base, "amd", step_tokens=0.25) == "1,650 ms (1.10x per token)"


def test_recipe_a_fresh_rerun_keeps_step_times_measured_on_other_cpus(tmp_path):
    cache = recipe.Cache(str(tmp_path / "cache.json"))
    cache.put("k", {"val_loss": 5.0, "step_s": 4.0, "step_s_on": {"intel": 4.0}})
    cache.put("k", {"val_loss": 5.1, "step_s": 6.0, "step_s_on": {"amd": 6.0}})
    assert recipe.Cache(cache.path).entries["k"] == {"val_loss": 5.1, "step_s": 6.0,
                                                      "step_s_on": {"intel": 4.0, "amd": 6.0}}


def test_recipe_two_sweeps_at_once_keep_each_others_runs(tmp_path):
    first, second = (recipe.Cache(str(tmp_path / "cache.json")) for _ in range(2))  # both read it empty
    first.put("a", {"val_loss": 5.0})
    second.put("b", {"val_loss": 4.0})
    first.put("c", {"val_loss": 3.0})
    assert set(recipe.Cache(first.path).entries) == {"a", "b", "c"}


def test_recipe_cache_key_is_the_resolved_configuration_not_the_spelling():
    key = lambda *flags: recipe.cache_key("corpus", ["--max-tokens", "4096", *flags])  # noqa: E731
    assert key() == key("--mlp", "swiglu", "--out-dir", "/elsewhere", "--data", "/moved")  # defaults, locations
    assert key() != key("--mlp", "relu2") and key() != key("--warmup", "15")
    assert key("--seed", "1") != key("--seed", "2") and recipe.cache_key("other", ["--max-tokens", "4096"]) != key()


def test_recipe_cache_keys_outlive_a_new_model_toggle(tmp_path):
    """A run keyed before a toggle existed trained at the toggle's Qwen3 value: the same run as one keyed now; one
    keyed before the bench pinned --device cpu, at auto, ran on the CPU."""
    key = recipe.cache_key("corpus", ["--max-tokens", "4096", "--device", "cpu"])
    corpus, values = json.loads(key)
    assert "model.unet_skips" not in values and values["model.attn_gate"] is True  # the gate is on by default
    assert "fp8.head" not in values  # a field added later, at the value the earlier runs had
    assert values["model.smear"] is True and values["model.bigram_embed"] == 50304  # so are the look-backs
    stored = json.dumps([corpus, {**values, "model.unet_skips": False, "speed.device": "auto"}])  # as written before
    with open(tmp_path / "cache.json", "w") as f:
        json.dump({stored: {"val_loss": 5.0}, json.dumps(["corpus", "anchor", "--lr", "1"]): {"val_loss": 6.0}}, f)
    entries = recipe.Cache(str(tmp_path / "cache.json")).entries
    assert entries[key] == {"val_loss": 5.0} and entries['["corpus", "anchor", "--lr", "1"]'] == {"val_loss": 6.0}
    assert recipe.cache_key("corpus", ["--max-tokens", "4096", "--device", "cpu", "--no-smear"]) != key
    with pytest.raises(recipe.BenchError, match="^--device: this benchmark trains on the CPU"):
        recipe.parse_bench_args(["--device", "cuda"])
    with pytest.raises(recipe.BenchError, match="^toggle gpu: --device: this benchmark trains on the CPU"):
        recipe.parse_bench_args(["--toggle", "gpu=--device=cuda"])
    with pytest.raises(recipe.BenchError, match="^toggle s: --seed is set by this benchmark"):
        recipe.parse_bench_args(["--toggle", "s=--seed 3"])


# The v4 baseline's seed-1 runs at 65,536 tokens in the committed cache, made under --dtype auto (docs/recipe.md).
COMMITTED_V4_RUNS = {"linux-doc-6.1-6.1.176-1-gpt2-8000000-262144@be2c319fac678802": 4.9958,
                     "stdlib-docs-3.11.7-gpt2-262144@5afe9ffe0eaa654a": 5.0939}


def test_recipe_reads_the_committed_runs_back_under_the_precision_they_were_made_at():
    """A config field added since (fp8.fused_wgrad, say), or a default changed, must not make the committed runs
    unreachable; they ran under --dtype auto, so that reads them, and the bench's pinned fp32 is another run."""
    entries = recipe.Cache(os.path.join(recipe.REPO, "bench", "results", "recipe_cache.json")).entries

    def key(corpus, *argv):
        a, train_argv = recipe.parse_bench_args(list(argv))
        return recipe.cache_key(corpus, [*recipe.common_flags(a, train_argv), "--max-tokens", "65536", "--seed", "1"])

    for corpus, loss in COMMITTED_V4_RUNS.items():  # recipe v4's defaults, which the runs had
        assert round(entries[key(corpus, "--dtype", "auto", *recipe.RECIPE_V4)]["val_loss"], 4) == loss
        assert len({key(corpus), key(corpus, "--dtype", "bf16"), key(corpus, "--dtype", "auto")}) == 3


def test_recipe_pins_one_precision_and_says_which():
    a, train_argv = recipe.parse_bench_args([])
    cfg = recipe.config.parse_args([*recipe.common_flags(a, train_argv), "--max-tokens", "4096"])
    assert (cfg.speed.dtype, cfg.speed.activation_dtype) == ("fp32", "fp32")
    a, train_argv = recipe.parse_bench_args(["--dtype", "bf16"])
    assert recipe.config.parse_args([*recipe.common_flags(a, train_argv), "--max-tokens", "4096"]).speed.dtype == "bf16"
    assert recipe.precision_text("fp32", "fp32") == ("train.py's `--dtype fp32 --activation-dtype fp32`: fp32; the "
                                                     "anchor in fp32")
    assert "each CPU's choice" in recipe.precision_text("auto", "fp32")
    assert "`--dtype bf16 --activation-dtype bf16`" in recipe.precision_text("bf16", "bf16")


def test_recipe_keys_the_stdlib_corpus_on_its_directory_and_shards(monkeypatch, tiny_data):
    """The default corpus differs by Python version (its directory's name says which): not one id for all."""
    import argparse

    import prepare
    monkeypatch.setattr(prepare, "default_corpus", lambda: tiny_data)
    flags, corpus, _ = recipe.corpus_of(argparse.Namespace(corpus="stdlib"), [])
    assert flags == [] and corpus == f"{os.path.basename(tiny_data)}@{recipe.shards_digest(tiny_data)}"


def test_recipe_files_a_step_time_under_the_cpu_its_bf16_and_its_threads(monkeypatch):
    """Two CPUs of one model name, one with native bf16: their step times must not be compared."""
    monkeypatch.setattr(recipe_cache, "cpu_model", lambda: "AMD EPYC")
    monkeypatch.setattr(recipe_cache, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert recipe.timing_machine(1) == "AMD EPYC, native bf16, 1 thread a run"
    monkeypatch.setattr(recipe_cache, "cpu_flags", lambda: {"avx2"})
    assert recipe.timing_machine(2) == "AMD EPYC, no native bf16, 2 threads a run"


def test_recipe_cache_runs_only_what_it_lacks_and_fresh_runs_all(tmp_path, monkeypatch):
    ran = []

    def fake_train(cmd, out_dir, threads):
        ran.append(cmd[-1])
        if not os.path.exists(out_dir):
            write_run(out_dir, 8, 5.0, 1e-3, seconds_per_step=0.5)
        return 4.0

    monkeypatch.setattr(recipe, "train_once", fake_train)
    cache = recipe.Cache(str(tmp_path / "cache.json"))
    job = lambda key: {"key": key, "label": key, "cmd": [key], "out_dir": str(tmp_path / key), "params": 7}  # noqa
    first = recipe.run_all([job("a"), job("b")], cache, False, 2, 1, "a CPU")
    assert sorted(ran) == ["a", "b"] and first["a"]["val_loss"] == pytest.approx(4.35)
    assert first["a"]["params"] == 7 and first["a"]["curve"] == [[1024, pytest.approx(4.75)], [2048, pytest.approx(4.35)]]
    reread = recipe.Cache(str(tmp_path / "cache.json"))  # a later invocation
    recipe.run_all([job("a"), job("c")], reread, False, 1, 1, "a CPU")
    assert ran[2:] == ["c"]
    recipe.run_all([job("a")], reread, True, 1, 1, "a CPU")
    assert ran[3:] == ["a"]


def test_the_anchor_scores_the_val_tokens_train_pys_eval_reads(tiny_data):
    """The anchor's val loss and train.py's, for one model, on the same windows: the ratio compares like with
    like. The model is transformers' GPT-2, scored once by anchor.val_loss and once by evaluation.Evaluator."""
    import contextlib

    import torch
    import torch.nn.functional as F

    import anchor
    import config
    import distributed
    from evaluation import Evaluator

    model = anchor.gpt2_model(256, n_layer=1, n_embd=32, n_head=2, seq_len=16, seed=0)

    def forward(x, y, reduction):
        losses = F.cross_entropy(model(x).logits.flatten(0, 1).float(), y.flatten(), reduction=reduction)
        return None, losses

    cfg = config.parse_args(["--eval-tokens", "96"]).eval
    evaluator = Evaluator(cfg, tiny_data, distributed.DistInfo(), torch.device("cpu"), 256, seed=0)
    ours = evaluator.val_metrics(forward, model, contextlib.nullcontext, 2, 16)["val_loss"]
    assert anchor.val_loss(model, tiny_data, 2, 16, 96) == pytest.approx(ours, rel=1e-6)


@pytest.mark.parametrize("batch", [["--grad-accum", "2"], ["--total-batch-tokens", str(16 * 256)]])
def test_the_anchor_trains_at_the_runs_shape_and_batch(tmp_path, batch):
    """A --n-embd 512 sweep counts tokens against a width-512 anchor, not the bench's default shape, and the anchor
    takes the runs' global batch in one step."""
    argv = ["--max-tokens", "65536", "131072", "--anchor-lrs", "1e-3", "--anchor-factor", "2", "--n-embd", "512",
            "--n-head", "8", "--n-kv-head", "4", "--batch-size", "8", *batch]
    a, train_argv = recipe.parse_bench_args(argv)
    cfg = recipe.config.parse_args(recipe.common_flags(a, train_argv))
    [job] = recipe.anchor_jobs(a, cfg, "corpus", str(tmp_path), str(tmp_path))
    flags = job["cmd"][job["cmd"].index("--n-layer"):]
    assert recipe.flag_value(flags, "--n-embd") == "512" and recipe.flag_value(flags, "--n-head") == "8"
    assert recipe.flag_value(flags, "--batch-size") == "16" and recipe.flag_value(flags, "--max-tokens") == "262144"


def test_recipe_smoke_runs_toggles_and_anchor_then_reads_them_from_the_cache(tmp_path, tiny_data, capsys,
                                                                               monkeypatch):
    out, cache = tmp_path / "recipe.md", tmp_path / "cache.json"
    argv = ["--only", "baseline,cautious-wd", "--seeds", "1", "--jobs", "3",
            "--max-tokens", "128", "--out", str(out), "--cache", str(cache), "--data", tiny_data, *TINY_FLAGS,
            "--eval-tokens", "128", "--warmup", "1", "--toggle", "lr-x2=--lr 6e-3", "--runs-dir", str(tmp_path / "runs"),
            "--anchor-lrs", "1e-3", "--anchor-factor", "1"]
    recipe.main(argv)  # in this process; the runs are train.py and anchor.py processes
    assert "0 of 3 runs cached; running 3" in capsys.readouterr().out
    text = out.read_text()
    assert "python bench/recipe.py --only baseline,cautious-wd" in text
    rows = [line for line in text.splitlines() if line.startswith("| baseline") or line.startswith("| cautious-wd")]
    assert len(rows) == 4 and "`--cautious-wd`" in rows[1] and "| 128 |" in rows[0] and "(1.00x)" in rows[0]
    assert "| lr-x2" not in text  # added as a toggle, but not chosen by --only
    assert "| 0.001 (tuned) |" in text and "Tokens for ours to reach the anchor's final loss" in text
    record = json.loads((tmp_path / "recipe.json").read_text())  # beside the table, for bench/recipe_verdict.py
    assert set(record["toggles"]) == {"baseline", "cautious-wd"} and record["toggles"]["baseline"]["step_cost"] == 1
    assert len(record["toggles"]["cautious-wd"]["losses"]["128"]) == 1
    recipe.main(argv)
    assert "3 of 3 runs cached; running 0" in capsys.readouterr().out
    assert out.read_text().split("- time:")[0] == text.split("- time:")[0]

    def full_disk(path, *chunks):
        raise cli.WriteError(f"cannot write file {path}: No space left on device (0 MiB free on its filesystem)")

    monkeypatch.setattr(recipe, "atomic_write", full_disk)  # a disk that filled during the sweep: one line
    with pytest.raises(SystemExit) as e:
        recipe.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err == (
        f"error: cannot write file {out}: No space left on device (0 MiB free on its filesystem); the runs are "
        "cached: run the same command again once there is room\n")
    assert out.read_text().split("- time:")[0] == text.split("- time:")[0]


def test_tokenizer_speed_prints_its_table(word_tokenizer, tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(WORD_TEXT * 100)
    argv = ["--input", str(tmp_path / "doc.txt"), "--tokenizer", word_tokenizer, "--repeats", "2", "--warmup", "0"]
    tokenizer_speed.main(argv)
    out = capsys.readouterr().out
    assert f"command: python bench/tokenizer_speed.py --input {tmp_path / 'doc.txt'}" in out and "bf16" in out
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines() if line.startswith("| ")}
    assert rows["/ encode_batch"][0].strip() == "1.000 (1.000)" and len(rows["tokens/s (median)"]) == 4


def test_plan_accuracy_plans_and_times_a_run(tiny_data):
    import plan_accuracy

    m = plan_accuracy.measure_shape(["--data", tiny_data, *TINY_FLAGS, "--max-steps", "3", "--eval-interval", "2"])
    assert m["steps"] == 3 and m["planned_step"] > 0 and m["measured_step"] > 0 and m["measured_run"] > 0
    assert m["planned_run"] > 0 and m["besides"] == "with 2 evals of" + m["besides"].split("evals of")[1]
    assert plan_accuracy.read_seconds("4m05s") == 245 and plan_accuracy.read_seconds("1.5 days") == 129600


def test_the_docs_corpus_keeps_a_modules_docstrings_and_comments_in_order_and_leaves_out_its_code(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text('''#!/usr/bin/env python3
"""The module's docstring."""
# A comment that runs
# over two lines.
x = 1  # a trailing comment
#
class A:
    """A class's docstring."""
    def f(self):
        """A method's docstring."""
        return "not prose"
''')
    assert docs_corpus.module_prose(str(source)) == (
        "The module's docstring.\n\nA class's docstring.\n\nA method's docstring.\n\n"
        "A comment that runs over two lines. a trailing comment")
    (tmp_path / "broken.py").write_text("def (:\n")
    (tmp_path / "bare.py").write_text("x = 1\n")
    assert docs_corpus.module_prose(str(tmp_path / "broken.py")) is None
    assert docs_corpus.module_prose(str(tmp_path / "bare.py")) is None


def test_a_toggle_is_adopted_only_where_it_wins_on_every_corpus_within_its_step_cost(tmp_path, capsys):
    """Wins beyond both spreads at 2 of 3 horizons on both corpora: adopted; on one: reported, not adopted; a win
    at 1 of 3, a loss, or a step cost over 10%: no."""
    def record(corpus, toggles):
        base = {"flags": [], "losses": {h: [3.0, 3.01] for h in ("1", "2", "3")}, "step_cost": 1.0}
        return {"corpus": corpus, "horizons": [1, 2, 3], "toggles": {"baseline": base, **{
            name: {"flags": [], "losses": dict(zip(("1", "2", "3"), losses)), "step_cost": cost}
            for name, (losses, cost) in toggles.items()}}}

    better, same, worse = [2.9, 2.91], [3.0, 3.01], [3.1, 3.11]
    prose = record("prose", {"both": ([better, better, same], 1.05), "one": ([better] * 3, 1.0),
                             "slow": ([better] * 3, 1.2), "once": ([better, same, same], 1.0),
                             "lr": ([better] * 3, 1.3)})
    docs = record("docs", {"both": ([same, better, better], 1.0), "one": ([worse] * 3, 1.0),
                           "slow": ([better] * 3, 1.2), "once": ([better, same, same], 1.0),
                           "lr": ([better] * 3, 1.0)})
    for r in (prose, docs):  # an LR alone runs the baseline's kernels: a slower measurement is the machine's
        r["toggles"]["lr"]["flags"] = ["--lr", "1e-3", "--head-lr=2e-3"]
    assert recipe_verdict.wins(prose, "both") == [1, 2] and recipe_verdict.wins(docs, "one") == []
    assert [recipe_verdict.verdict([prose, docs], n) for n in ("both", "one", "slow", "once", "lr")] == [
        "**adopt**", "holds on prose only: not adopted", "no", "no", "**adopt**"]
    assert not recipe_verdict.same_work(["--lr", "1e-3", "--normuon"]) and not recipe_verdict.same_work([])
    assert recipe_verdict.same_work(["--zero-init-proj", "--muon-momentum", "0.9", "--warmup", "1"])  # an init
    assert recipe_verdict.same_work(["--beta1", "0.8", "--head-init", "zero"])  # Adam's scalars, an init
    paths = []
    for r in (prose, docs):
        paths.append(str(tmp_path / f"{r['corpus']}.json"))
        with open(paths[-1], "w") as f:
            json.dump(r, f)
    assert recipe_verdict.main([*paths, "--out", str(tmp_path / "v.md")]) == 0
    text = (tmp_path / "v.md").read_text()
    assert "| both | 2 of 3 (1, 2) / 1.05x | 2 of 3 (2, 3) / 1.00x | **adopt** |" in text
    assert "| lr | 3 of 3 (1, 2, 3) / same work (1.30x) | 3 of 3 (1, 2, 3) / same work (1.00x) | **adopt** |" in text
    # The slow one's runs shared the machine: measured side by side it costs 1.02x, on every corpus.
    assert recipe_verdict.main([*paths, "--step-cost", "slow=1.02", "--out", str(tmp_path / "v.md")]) == 0
    assert "| slow | 3 of 3 (1, 2, 3) / 1.02x side by side | 3 of 3 (1, 2, 3) / 1.02x side by side | **adopt** |" \
        in (tmp_path / "v.md").read_text()
    assert recipe_verdict.main([*paths, "--step-cost", "nosuch=1.0"]) == 2
    assert "no such toggle" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        recipe_verdict.main([*paths, "--step-cost", "slow=fast"])
    capsys.readouterr()
    for other in ({}, [1, 2], {"corpus": "a", "horizons": [], "toggles": {"x": 1}}):  # JSON, but no record
        (tmp_path / "other.json").write_text(json.dumps(other))
        assert recipe_verdict.main([paths[0], str(tmp_path / "other.json")]) == 2
        assert capsys.readouterr().err == f"error: {tmp_path / 'other.json'} is not a record bench/recipe.py wrote " \
                                          "(its .json beside the table)\n"
    (tmp_path / "other.json").write_text("{not json")
    assert recipe_verdict.main([paths[0], str(tmp_path / "other.json")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'other.json'}: not JSON (")


@pytest.mark.parametrize("program, argv, message", [
    ("anchor", ["--eval-interval", "0"], "argument --eval-interval: must be >= 1, got 0"),
    ("anchor", ["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    ("anchor", ["--n-head", "3", "--n-embd", "64"], "--n-embd 64 must be a multiple of --n-head 3"),
    ("ladder", ["--windows", "0"], "argument --windows: must be >= 1, got 0"),
    ("ladder", ["--steps-per-window", "0"], "argument --steps-per-window: must be >= 1, got 0")])
def test_a_benchmarks_count_or_shape_at_fault_is_refused_as_it_parses(program, argv, message, tmp_path, capsys):
    """Refused as the flags are read, before a model is built or a rung measured (they ended in a division by
    zero, or in transformers' error, after minutes)."""
    module = importlib.import_module(program)
    required = ["--data", str(tmp_path), "--out-dir", str(tmp_path / "o"), "--lr", "1e-3", "--max-tokens", "64"]
    with pytest.raises(SystemExit) as e:
        module.main([*(required if program == "anchor" else []), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().splitlines()[-1].endswith(message) and "Traceback" not in err, err


def test_tail_ema_averages_the_checkpoints_from_each_start_and_keeps_the_last_weights(tmp_path):
    import tail_ema
    import torch

    from conftest import write_checkpoint
    from model import GPT, ModelConfig

    cfg = ModelConfig(vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, max_seq_len=8)
    models = []
    for step in (2, 3, 4):
        torch.manual_seed(step)
        models.append(GPT(cfg))
        write_checkpoint(tmp_path / f"ckpt_{step}.pt", models[-1])
    paths = [str(tmp_path / f"ckpt_{step}.pt") for step in (2, 3, 4)]
    emas, last = tail_ema.emas_of(paths, starts=[3], decays=[0.75])
    w = [m.state_dict()["embed.weight"] for m in models]
    torch.testing.assert_close(emas[3, 0.75]["embed.weight"], 0.75 * w[1] + 0.25 * w[2])
    torch.testing.assert_close(last["embed.weight"], w[2])
    assert list(emas) == [(3, 0.75)]
    with pytest.raises(recipe.BenchError, match="--starts and --decays must be in"):
        tail_ema.parse_args(["--decays", "1"])
    with pytest.raises(recipe.BenchError, match=f"^--out {tmp_path}: a directory, where a file is to be written$"):
        tail_ema.parse_args(["--out", str(tmp_path)])


def test_an_optimizer_sweep_keeps_an_earlier_run_until_its_own_has_finished(tmp_path):
    """The sweep writes into bench/results by default, over the committed runs: a typo is refused before any
    directory is touched, and a run that fails puts the earlier one back."""
    with pytest.raises(optimizers.BenchError, match="unrecognized arguments: --step 1"):
        optimizers.parse_bench_args(["--step", "1"])
    out_dir = tmp_path / "adamw_lr0.003"
    out_dir.mkdir()
    (out_dir / "metrics.jsonl").write_text("the committed run\n")
    with pytest.raises(optimizers.BenchError, match="exited with 3"):
        optimizers.train_once([sys.executable, "-c", "import sys; sys.exit(3)"], str(out_dir))
    assert (out_dir / "metrics.jsonl").read_text() == "the committed run\n"
    assert not (tmp_path / "adamw_lr0.003.earlier").exists()
    optimizers.train_once([sys.executable, "-c", "pass"], str(out_dir))
    assert not (out_dir / "metrics.jsonl").exists() and (out_dir / optimizers.RUN_INFO).exists()


def test_the_docs_corpus_never_removes_a_text_directory_it_finds(tmp_path, capsys):
    (tmp_path / "corpus.text").mkdir()
    (tmp_path / "corpus.text" / "keep.txt").write_text("notes")
    assert docs_corpus.main([str(tmp_path / "corpus")]) == 2
    assert "corpus.text is in the way" in capsys.readouterr().err
    assert (tmp_path / "corpus.text" / "keep.txt").read_text() == "notes"


def test_a_verdict_counts_each_corpus_once_however_many_records_it_has():
    """Two records of one corpus (two widths) must both hold, and never stand in for a second corpus."""
    def record(corpus, toggle_losses):
        base = {"flags": [], "losses": {"1": [3.0, 3.01], "2": [3.0, 3.01]}, "step_cost": 1.0}
        toggle = {"flags": [], "losses": {"1": toggle_losses, "2": toggle_losses}, "step_cost": 1.0}
        return {"corpus": corpus, "horizons": [1, 2], "toggles": {"baseline": base, "t": toggle}}

    win, lose = [2.9, 2.91], [3.1, 3.11]
    assert recipe_verdict.verdict([record("docs", win), record("docs", win)], "t") == "holds on docs only: not adopted"
    assert recipe_verdict.verdict([record("docs", win), record("docs", win), record("prose", win)], "t") == "**adopt**"
    assert recipe_verdict.verdict([record("docs", win), record("docs", lose), record("prose", win)], "t") == (
        "holds on prose only: not adopted")


def test_throughput_prints_its_table_for_a_run_with_the_bf16_stream(tiny_data, tmp_path, capsys):
    """bench/throughput.py end to end on the CPU: the command, the device line, every row of its table, the loss
    path's share from the estimate of the run's own stream."""
    throughput.main(["--windows", "2", "--steps-per-window", "2", "--warmup-steps", "1", "--data", tiny_data,
                     *TINY_FLAGS, "--dtype", "bf16", "--activation-dtype", "bf16", "--out-dir", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert "command: python bench/throughput.py --windows 2" in out and "\ndevice: " in out
    rows = dict((cell.strip() for cell in line.strip("| ").split(" | ")) for line in out.splitlines()
                if line.startswith("| "))
    assert float(rows["tokens/s (median)"].replace(",", "")) > 0 and rows["tokens/step"] == "128"
    assert rows["tokens/s (min..max)"].endswith("over 2 windows of 2 steps")
    assert re.fullmatch(r"[\d.,]+ MiB of [\d.,]+ MiB per micro-batch \(\d+%\)", rows["activations outside the blocks"])



def test_default_run_says_the_precision_each_revision_ran_at():
    """--dtype auto resolves per revision (a revision before the CPU probe ran fp32 everywhere): a speed-up
    across revisions is only a speed-up at one precision."""
    fp32, bf16 = "fp32", default_run.decision("bf16 autocast (auto: CPU has avx512_bf16; a 1024x1024 bf16 matmul ran "
                                               "2.1x fp32's rate); activations bf16 end to end (--activation-dtype auto)")
    assert bf16 == "bf16 autocast, bf16 stream" and default_run.decision(None) == "not recorded"
    assert default_run.decision("fp32 (auto: this CPU has no native bf16: neither avx512_bf16 nor amx_bf16)") == fp32
    text = default_run.table({"old": [(100.0, 0.5, 10.0, ("not recorded", "not recorded"))],
                              "this tree": [(150.0, 0.0, 8.0, (fp32, fp32)), (148.0, 0.0, 8.1, (fp32, bf16))]})
    assert "| old | 100 | 1.00x | - | 50% | 10.0 s | not recorded |" in text
    assert "| this tree | 149 | 1.49x | 1.49x | 0% | 8.1 s | fp32 / bf16 autocast, bf16 stream |" in text


def test_an_optimizer_sweep_reuses_a_run_only_at_the_settings_it_ran_with(tmp_path, monkeypatch):
    """--reuse: the same command at a commit with other defaults is another run, and so is one recorded before
    runs recorded their settings, or one whose precision is not what --dtype chooses here."""
    out_dir = str(tmp_path / "run")
    write_run(out_dir, 8, 5.0, 1e-3)
    cmd = [sys.executable, "train.py", "--lr", "0.001", "--dtype", "fp32"]
    settings = optimizers.resolved_settings(cmd)
    info = {"command": optimizers.shlex.join(cmd), "settings": settings, "wall_s": 12.0}
    summary = os.path.join(out_dir, "summary.json")
    for recorded, reused in ((settings, 12.0), ({**settings, "optim.beta1": 0.8}, None), (None, None)):
        with open(os.path.join(out_dir, optimizers.RUN_INFO), "w") as f:
            json.dump({**info, "settings": recorded}, f)
        with open(summary, "w") as f:
            json.dump({"facts": {"precision": "fp32 (requested)"}}, f)
        assert optimizers.finished_wall(out_dir, cmd, 7) == reused  # write_run logs steps 0 to 7
    with open(summary, "w") as f:  # made where --dtype chose otherwise: another run
        json.dump({"facts": {"precision": "bf16 autocast (auto: CPU has avx512_bf16; ...)"}}, f)
    assert optimizers.finished_wall(out_dir, cmd, 7) is None
    os.remove(summary)  # made before runs recorded their precision
    assert optimizers.finished_wall(out_dir, cmd, 7) is None
    monkeypatch.setattr(optimizers.hardware.torch.cuda, "is_available", lambda: False)  # a GPU run, on a CPU
    assert optimizers.precision_here([sys.executable, "train.py", "--device", "cuda"]) is None


def test_recipe_keeps_the_precision_a_run_recorded_and_says_when_stored_runs_merge(tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    write_run(out_dir, 8, 5.0, 1e-3, seconds_per_step=0.5)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({"facts": {"precision": "fp32 (requested)"}}, f)
    assert recipe_cache.run_result(out_dir, 7, "cpu")["precision"] == "fp32 (requested)"
    os.remove(os.path.join(out_dir, "summary.json"))  # a run whose report was not written: no precision
    assert "precision" not in recipe_cache.run_result(out_dir, 7, "cpu")
    key = recipe.cache_key("corpus", ["--max-tokens", "4096", "--device", "cpu"])
    corpus, values = json.loads(key)
    with open(tmp_path / "cache.json", "w") as f:  # one run stored twice: before and after --device was pinned
        json.dump({json.dumps([corpus, {**values, "speed.device": "auto"}]): {"val_loss": 5.0}, key: {"val_loss": 4.0}}, f)
    assert recipe.Cache(str(tmp_path / "cache.json")).entries == {key: {"val_loss": 4.0}}
    assert "1 stored run(s) read as another's configuration" in capsys.readouterr().err
