"""telemetry.py and progress.py: the end-of-run summary, the start-up table's truths, the progress lines."""

import io
import shlex
import sys
import time
import types

import pytest

import config
import loop
import runlog
import telemetry
import train
from cli import UsageError
from conftest import TINY_FLAGS, step_values
from progress import Heartbeat, Progress

FACTS = {"outcome": "finished", "wall_s": 241.4, "compile_s": 25.25, "start_step": 0, "done": 150,
         "max_steps": 150, "tokens": 2_457_600, "session_tokens": 2_457_600, "tokens_per_sec": 10_234.4,
         "mfu": 0.412, "last_eval": {"step": 150, "val_loss": 3.49012, "val_bpb": 1.98541}, "best_val": 3.49012,
         "peak_mem_gib": 1.5, "device": "cuda", "out_dir": "out", "final_ckpt": "out/ckpt_00000150.pt",
         "best_ckpt": "out/best.pt", "epoch_tokens": 921_600, "bos": False, "source_epochs": {},
         "sample_prompt": ""}


def test_the_summary_names_what_the_run_did_and_what_to_run_next():
    rows = dict(telemetry.summary_rows(FACTS))
    assert rows["wall time"] == "4m01s this process (25.2 s of it compiling)"
    assert rows["steps"] == "150 of 150" and rows["tokens"] == "2,457,600"
    assert rows["epochs"] == "2,457,600 tokens of a 921,600-token train split: 2.67 epochs"
    assert rows["val loss"] == "3.4901 at step 150 (bpb 1.9854); best 3.4901"
    assert rows["mean throughput"] == "10,234 tokens/s, MFU 41.2%"
    assert rows["peak memory"] == "1.50 GiB (allocated by tensors)"
    assert rows["sample"] == "python sample.py --ckpt out/best.pt"  # no --sample-prompt: a new document
    assert rows["export"] == "python hf.py --ckpt out/best.pt --out out/hf"
    assert rows["plot"] == "python bench/plot.py out"


def test_the_summary_says_which_flags_make_a_model_transformers_can_load():
    from hf_layout import exportable_problem
    from model import ModelConfig

    problem = exportable_problem(ModelConfig(unet_skips=True))
    rows = dict(telemetry.summary_rows({**FACTS, "export_problem": problem}))
    assert rows["export"] == ("none: --unet-skips: neither Qwen3ForCausalLM nor Qwen3NextForCausalLM has such a "
                              "part, so this model cannot be exported (a model trained with --no-unet-skips can)")
    assert exportable_problem(ModelConfig()) is None  # the default model exports


def test_the_summary_of_a_resumed_run_without_evals_or_checkpoints():
    rows = dict(telemetry.summary_rows({**FACTS, "start_step": 100, "session_tokens": 819_200, "last_eval": None,
                                        "best_val": float("inf"), "compile_s": None, "mfu": None,
                                        "final_ckpt": None, "best_ckpt": None, "train_s": 742.0}))
    assert rows["steps"] == "150 of 150, resumed at 100" and rows["tokens"] == "2,457,600, 819,200 in this process"
    assert rows["val loss"] == "no eval ran in this process"
    assert rows["wall time"] == "4m01s this process; the run's training loop 12m22s over all its processes"
    assert rows["final checkpoint"] == "none written" and "sample" not in rows and "export" not in rows
    assert rows["epochs"].endswith(": 2.67 epochs")  # all the tokens trained, not this process's


def test_the_summary_samples_with_the_runs_own_prompt_shell_quoted():
    rows = dict(telemetry.summary_rows({**FACTS, "sample_prompt": "def main(): print('hi')"}))
    assert rows["sample"] == "python sample.py --ckpt out/best.pt --prompt 'def main(): print('\"'\"'hi'\"'\"')'"
    assert shlex.split(rows["sample"])[-2:] == ["--prompt", "def main(): print('hi')"]


def test_the_optimizer_state_line_says_per_rank_only_with_ranks(tmp_path, capsys):
    import torch

    from batch import BatchLayout
    from resilience import LossHealth

    for world_size, expected in ((1, "optimizer state: 0.0 MiB\n"), (2, "optimizer state: 0.0 MiB per rank\n")):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        tel = telemetry.Telemetry(config.parse_args(["--out-dir", str(tmp_path)]), True, torch.device("cpu"), 0, 9,
                                  1.0, None, None, optimizer)
        tel.step_record(0, step_values(4.0), 0.1, BatchLayout(2, 32, 1, world_size), world_size, LossHealth())
        assert capsys.readouterr().err == expected


def test_the_summary_of_a_mixture_gives_each_sources_epochs():
    rows = dict(telemetry.summary_rows({**FACTS, "epoch_tokens": None, "source_epochs": {"web": 0.5, "code": 2.25}}))
    assert rows["epochs"] == "of each source's train split, read: web 0.50, code 2.25"


def test_a_run_ends_with_its_summary(tmp_path, tiny_data, capsys):
    train.main(["--data", tiny_data, "--out-dir", str(tmp_path), *TINY_FLAGS, "--max-steps", "4", "--warmup", "2",
                "--eval-interval", "2", "--eval-tokens", "256", "--device", "cpu", "--dtype", "fp32"])
    out = capsys.readouterr().out
    summary = out[out.index("run summary"):]
    assert "outcome           finished" in summary and "steps             4 of 4" in summary
    assert f"final checkpoint  {tmp_path}/ckpt_00000004.pt" in summary and "val loss          " in summary
    assert "  batch            4 x 32 tokens x 1 micro-step x 1 rank = 128 tokens/step" in out  # counts in words


@pytest.mark.parametrize("min_interval, expected", [(0.0, [1, 3, 6, 9, 10]), (3600.0, [1, 10])])
def test_progress_off_a_terminal_prints_every_n_steps_unless_they_are_sub_second(min_interval, expected):
    stream = io.StringIO()
    progress = Progress(10, "train", unit="step", stream=stream, every=3, min_interval=min_interval)
    for step in range(10):
        progress.set_postfix(f"loss {step}")
        progress.update()
    lines = stream.getvalue().splitlines()
    assert [int(line.split()[1].split("/")[0]) for line in lines] == expected
    assert all(f"loss {n - 1}" in line for n, line in zip(expected, lines))  # the figures of that step


def test_progress_goes_back_with_a_rollback():
    stream = io.StringIO()
    progress = Progress(10, "train", unit="step", stream=stream, every=1, min_interval=0.0)
    for _ in range(6):
        progress.update()
    progress.reset(4)
    for _ in range(6):
        progress.update()
    assert stream.getvalue().splitlines()[-1].startswith("train 10/10 step")


def test_metrics_from_before_one_based_steps_are_cut_at_the_same_step(tmp_path):
    import json

    old = [{"step": s, "train_loss": 1.0} for s in range(4)]  # 0-based, no time_s: steps 1..4 in today's terms
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    log = runlog.MetricsLog(str(tmp_path), start_step=2, wandb_run=None)
    log.begin()  # the loop's start writes the truncated log
    assert [json.loads(line)["step"] for line in open(log.path)] == [0, 1]  # steps 1 and 2 are kept


def test_a_resume_restores_the_record_its_checkpoint_holds_when_the_log_lost_it(tmp_path):
    """The checkpoint precedes its step's log line: a kill between them leaves metrics.jsonl one record short,
    and the checkpoint's own copy fills the gap; a log that has the record keeps its own (with the eval's)."""
    import json

    def records(n):
        return [{"step": s, "train_loss": float(s), "time_s": 0.1 * s} for s in range(1, n + 1)]

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(2)))
    restored = {"step": 3, "train_loss": 3.0, "time_s": 0.3}
    log = runlog.MetricsLog(str(tmp_path), start_step=3, wandb_run=None, restored=restored)
    log.begin()
    assert [json.loads(line) for line in open(log.path)] == [*records(2), restored] and log.last_kept == restored

    evaluated = [*records(2), {**restored, "val_loss": 2.5}, *records(5)[3:]]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evaluated))
    log = runlog.MetricsLog(str(tmp_path), start_step=3, wandb_run=None, restored=restored)
    log.begin()
    assert [json.loads(line) for line in open(log.path)] == evaluated[:3]


def test_wandb_online_without_a_key_is_refused(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    with pytest.raises(UsageError, match="--wandb-mode online needs a W&B API key"):
        config.parse_args(["--wandb", "--wandb-mode", "online"], machine_checks=(telemetry.wandb_problems,))
    assert config.parse_args(["--wandb", "--wandb-mode", "online"]).log.wandb  # reading a config is not starting it
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert config.parse_args(["--wandb", "--wandb-mode", "online"],
                             machine_checks=(telemetry.wandb_problems,)).log.wandb_mode == "online"


def test_a_wandb_mode_wandb_does_not_take_is_refused_at_start_up(monkeypatch):
    for bad in ("foo", ""):  # wandb.init fails on either, whatever --wandb-mode says
        monkeypatch.setenv("WANDB_MODE", bad)
        with pytest.raises(UsageError, match=f"WANDB_MODE={bad!r} is not a mode wandb takes"):
            config.parse_args(["--wandb", "--wandb-mode", "offline"], machine_checks=(telemetry.wandb_problems,))
        assert config.parse_args([], machine_checks=(telemetry.wandb_problems,))  # no --wandb: not wandb's business
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert config.parse_args(["--wandb", "--wandb-mode", "offline"], machine_checks=(telemetry.wandb_problems,))


def test_a_record_made_after_its_step_holds_that_steps_own_time_phases_memory_and_lr(tmp_path):
    """The loop reads a step back up to --log-interval steps after it ended (loop.read_back): its record holds
    what end_step noted then, not what the clock, the timer, the memory and the LR say when the record is made."""
    import time

    import torch

    from batch import BatchLayout
    from resilience import LossHealth

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    tel = telemetry.Telemetry(config.parse_args(["--out-dir", str(tmp_path)]), True, torch.device("cpu"), 0, 9, 1.0,
                              None, None, optimizer)
    tel.loop_start = time.perf_counter()
    with tel.timing_step(), tel.timer("forward"):
        time.sleep(0.02)
    ended = tel.end_step()
    optimizer.param_groups[0]["lr"] = 0.05  # the next step's, set and timed before the first one's record is made
    with tel.timer("forward"):
        time.sleep(0.05)
    record = tel.step_record(0, step_values(4.0), ended.seconds(), BatchLayout(2, 32, 1, 1), 1, LossHealth(), ended)
    assert ended.seconds() >= 0.02 and record["time_forward_ms"] == 1000 * telemetry.PhaseTimer.read(ended.spans)[
        "forward"] >= 20
    assert record["time_s"] == round(ended.time_s, 3) and ended.time_s < tel.elapsed() - 0.05
    assert record["peak_mem_gib"] == ended.peak_mem_gib and record["lr"] == 0.1
    assert tel.timer.collect()["forward"] >= 0.05  # the next step's span is left for its own record


# ----------------------------------------------------------------------------- --tensorboard


def tensorboard_scalars(log_dir, tag) -> list[tuple[int, float]]:
    """(step, value) of a tag's points, as TensorBoard shows them (the events of redone steps purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_tensorboard_gets_every_number_of_metrics_jsonl(tmp_path, tiny_data, capsys):
    import json

    pytest.importorskip("tensorboard")
    train.main(["--data", tiny_data, "--out-dir", str(tmp_path), *TINY_FLAGS, "--max-steps", "2", "--eval-interval",
                "2", "--eval-tokens", "256", "--device", "cpu", "--tensorboard"])
    assert f"  TensorBoard      on: {tmp_path}/tensorboard\n" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for tag in ("train_loss", "lr", "tokens", "val_loss"):
        expected = [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in records if tag in r]  # stored as float32
        assert expected and tensorboard_scalars(tmp_path / "tensorboard", tag) == expected


def test_a_device_metric_added_in_one_line_reaches_the_log_the_progress_line_and_tensorboard(tmp_path, tiny_data,
                                                                                              monkeypatch, capsys):
    import json

    pytest.importorskip("tensorboard")
    step = loop.train_step

    def with_half_loss(run, *args):
        metrics = step(run, *args)
        metrics["half_loss"] = metrics["train_loss"] / 2  # the one line a new device-side metric takes
        return metrics

    monkeypatch.setattr(loop, "train_step", with_half_loss)
    train.main(["--data", tiny_data, "--out-dir", str(tmp_path), *TINY_FLAGS, "--max-steps", "3", "--eval-interval",
                "0", "--device", "cpu", "--tensorboard"])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["half_loss"] for r in records] == [pytest.approx(r["train_loss"] / 2) for r in records]
    assert f"half_loss {records[0]['half_loss']:.4g}" in capsys.readouterr().err  # the first step's progress line
    assert tensorboard_scalars(tmp_path / "tensorboard", "half_loss") == [
        (r["step"], pytest.approx(r["half_loss"], rel=1e-6)) for r in records]


def test_a_resumed_run_appends_to_tensorboard_and_hides_the_steps_it_redoes(tmp_path):
    pytest.importorskip("tensorboard")

    def run(start_step, losses):
        log = runlog.MetricsLog(str(tmp_path), start_step, None, tensorboard=True)
        for step, loss in losses.items():
            log.log({"step": step, "time_s": 0.1 * step, "train_loss": loss, "skipped": False, "mfu": None})
        log.close()

    run(0, {1: 5.0, 2: 4.0, 3: 3.0})
    run(2, {3: 3.5, 4: 2.5})  # resumed from ckpt_2
    assert tensorboard_scalars(tmp_path / "tensorboard", "train_loss") == [(1, 5.0), (2, 4.0), (3, 3.5), (4, 2.5)]
    assert tensorboard_scalars(tmp_path / "tensorboard", "skipped") == [(1, 0.0), (2, 0.0), (3, 0.0), (4, 0.0)]


def test_tensorboard_without_its_package_is_one_line_at_start_up(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # an import of it fails, as when not installed
    with pytest.raises(SystemExit) as stopped:
        train.main(["--out-dir", str(tmp_path), *TINY_FLAGS, "--device", "cpu", "--tensorboard"])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and "\n" not in err
    assert err.startswith("error: --tensorboard needs the tensorboard package") and "pip install tensorboard" in err
    assert not (tmp_path / "metrics.jsonl").exists()


def log_losses(out_dir, start_step, losses, build_before=lambda: None):
    """A MetricsLog with --tensorboard from start_step, logging {step: train_loss}; build_before runs once the log
    is made and before its first point (train.setup replaces an earlier run's outputs there)."""
    log = runlog.MetricsLog(str(out_dir), start_step, None, tensorboard=True)
    build_before()
    for step, loss in losses.items():
        log.log({"step": step, "time_s": 0.1 * step, "train_loss": loss})
    return log


def test_a_fresh_run_shows_none_of_the_earlier_runs_tensorboard_points(tmp_path):
    pytest.importorskip("tensorboard")
    from config import CheckpointConfig
    from rundir import claim, replace_outputs

    log_losses(tmp_path, 0, {1: 5.0, 2: 4.0, 3: 3.0}).close()  # run A: halted before its first checkpoint
    for overwrite in (False, True):
        lock, _, replaced = claim(CheckpointConfig(out_dir=str(tmp_path), overwrite=overwrite))
        log_losses(tmp_path, 0, {1: 6.0, 2: 4.5}, lambda: replace_outputs(replaced, None)).close()
        lock.release()
        assert tensorboard_scalars(tmp_path / "tensorboard", "train_loss") == [(1, 6.0), (2, 4.5)]


def test_a_rollback_hides_the_tensorboard_points_of_the_steps_it_redoes(tmp_path):
    pytest.importorskip("tensorboard")
    log = log_losses(tmp_path, 0, {1: 5.0, 2: 4.0, 3: float("nan"), 4: float("nan")})
    log.truncate(2)  # Telemetry.rewind, rolled back to ckpt_2
    for step, loss in {3: 3.5, 4: 2.5}.items():
        log.log({"step": step, "time_s": 0.1 * step, "train_loss": loss})
    log.close()
    assert tensorboard_scalars(tmp_path / "tensorboard", "train_loss") == [(1, 5.0), (2, 4.0), (3, 3.5), (4, 2.5)]


def test_the_micro_step_line_counts_from_the_steps_start_not_the_previous_steps_end(tmp_path, monkeypatch, capsys):
    """An eval or checkpoint between two steps is not time inside the next one."""
    import types

    import torch

    now = [0.0]
    monkeypatch.setattr(telemetry, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    tel = telemetry.Telemetry(config.parse_args(["--out-dir", str(tmp_path)]), True, torch.device("cpu"), 0, 9, 1.0,
                              None, None, optimizer)
    with tel.timing_step():
        now[0] = 1.0
    tel.end_step()
    now[0] = 100.0  # step 1's eval and checkpoint
    with tel.timing_step():
        now[0] = 111.0
        tel.micro_step(13, 128)
    assert capsys.readouterr().err == "micro-step 13 of 128 of step 2, 0m11s into it\n"


def test_the_heartbeat_speaks_only_after_its_quiet_time():
    said, last = [], [time.perf_counter()]

    def write(line):
        said.append(time.perf_counter())
        last[0] = said[-1]

    with Heartbeat(0.2, lambda quiet: f"quiet {quiet:.1f}", write, lambda: last[0]):
        time.sleep(0.1)
        assert said == []
        time.sleep(1.0)
    assert 3 <= len(said) <= 6
    assert max(b - a for a, b in zip(said, said[1:])) < 0.5


def test_a_slow_run_to_a_file_is_never_quiet_for_long(tiny_data, tmp_path, monkeypatch):
    """Steps of 1.2 s with --log-interval 10: without the heartbeat the log would say nothing between the first
    step's line and the end; with it (0.5 s here) no gap exceeds a little over its period."""
    lines, step = [], loop.train_step
    monkeypatch.setattr(telemetry, "HEARTBEAT_S", 0.5)
    monkeypatch.setattr(Progress, "write", lambda self, text: lines.append((time.perf_counter(), text)))
    monkeypatch.setattr(loop, "train_step", lambda run, *args: time.sleep(1.2) or step(run, *args))
    train.main(["--data", tiny_data, "--out-dir", str(tmp_path), *TINY_FLAGS, "--device", "cpu", "--dtype", "fp32",
                "--eval-interval", "0", "--max-steps", "4", "--log-interval", "10", "--compile", "off"])
    times = [t for t, _ in lines]
    assert any(text.startswith("train 1/4 step") for _, text in lines)  # the first step's line
    assert sum(text.startswith("still running: step ") for _, text in lines) >= 4
    assert max(b - a for a, b in zip(times, times[1:])) < 2.0


def test_the_heartbeat_says_where_the_step_is_and_that_a_first_step_compiles():
    cfg = config.parse_args(["--compile", "default"])
    t = types.SimpleNamespace(cfg=cfg, in_step=True, micro_done=(2, 8), steps_taken=0, start_step=0,
                              step_start=time.perf_counter() - 75, between_start=time.perf_counter() - 20)
    line = telemetry.Telemetry.still_running(t, 20.0)
    assert line.startswith("still running: step 1, micro-step 3 of 8, 1m15s into it (torch.compile compiles")
    t.steps_taken, t.in_step = 5, False
    assert telemetry.Telemetry.still_running(t, 20.0) == ("still running: 0m20s since the last step (an eval, a "
                                                          "checkpoint or a read-back)")
    t.between_start = t.step_start = time.perf_counter()  # quiet for a while, but what runs has just begun
    assert telemetry.Telemetry.still_running(t, 20.0) is None
    t.in_step = True
    assert telemetry.Telemetry.still_running(t, 20.0) is None


def test_quick_steps_under_a_long_log_interval_get_no_heartbeat(tiny_data, tmp_path, monkeypatch):
    """Steps of 0.25 s with --log-interval 10 and a 0.5 s heartbeat: the log is quiet for longer than the
    heartbeat between its lines, but no step runs that long, so it says nothing."""
    lines, step = [], loop.train_step
    monkeypatch.setattr(telemetry, "HEARTBEAT_S", 0.5)
    monkeypatch.setattr(Progress, "write", lambda self, text: lines.append(text))
    monkeypatch.setattr(loop, "train_step", lambda run, *args: time.sleep(0.25) or step(run, *args))
    train.main(["--data", tiny_data, "--out-dir", str(tmp_path), *TINY_FLAGS, "--device", "cpu", "--dtype", "fp32",
                "--eval-interval", "0", "--max-steps", "8", "--log-interval", "10", "--compile", "off"])
    assert not [line for line in lines if line.startswith("still running")], lines


def test_a_resume_drops_a_torn_last_line_with_a_note_and_refuses_damage_elsewhere(tmp_path, capsys):
    import json

    lines = [json.dumps({"step": s, "tokens": s, "time_s": 0.1 * s}) + "\n" for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines) + '{"step": 4, "tok')  # killed mid-write
    log = runlog.MetricsLog(str(tmp_path), start_step=3, wandb_run=None)
    log.begin()
    assert open(log.path).read() == "".join(lines) and log.last_kept["step"] == 3
    assert "metrics.jsonl:4: the last line was torn (a process stopped mid-write), skipped" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text(lines[0] + "garbage\n" + lines[2])
    with pytest.raises(UsageError, match=r"metrics.jsonl:2: not a JSON line: the run's log is damaged there; mend or "
                                         r"delete that line, then resume"):
        runlog.MetricsLog(str(tmp_path), start_step=3, wandb_run=None)
    assert open(log.path).read() == lines[0] + "garbage\n" + lines[2]  # nothing dropped unasked
