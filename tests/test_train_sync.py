"""The host never waits for the device inside a training step that does not log: non-finite updates are skipped
on the device (optim.step_if_finite) and losses are read back only where something is decided (loop.read_due)."""

import json
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import config
import loop
import optim
import train
from conftest import TINY_FLAGS

REAL_READS_EVERY_STEP = loop.reads_every_step  # before conftest's fixture patches it
from model import GPT, ModelConfig
from optim import OptimConfig, build_optimizer


class HostReads(TorchDispatchMode):
    """Counts the ops that copy one tensor's value to the host (item, bool, ...): each waits for the device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


# Fused AdamW (on the CPU too) takes found_inf. Not here: foreach AdamW, whose flag the host reads (and which
# reads its CPU-held step counts, a wait only where the parameters are on the CPU).
@pytest.mark.parametrize("flags", [
    ["--optimizer", "adamw"], ["--optimizer", "adamw", "--cautious-wd"],
    [],
], ids=["adamw", "adamw-cautious", "muon"])
def test_a_step_that_does_not_log_never_waits_for_the_device(flags, tiny_data, tmp_path, monkeypatch):
    run = train.setup(config.parse_args(["--data", tiny_data, "--out-dir", str(tmp_path), *TINY_FLAGS, *flags,
                                         "--device", "cpu", "--dtype", "fp32", "--eval-interval", "0",
                                         "--max-steps", "4", "--log-interval", "4"]))
    reads, marks, original = HostReads(), [], loop.train_step

    def step(run, *args):
        marks.append(reads.count)
        return original(run, *args)

    monkeypatch.setattr(loop, "train_step", step)
    try:
        with reads:
            loop.run_loop(run)
    finally:
        run.close()
    # Steps 1 to 3 read nothing back; step 4 (the log interval, the last step) reads them all.
    assert [b - a for a, b in zip(marks, marks[1:])] == [0, 0, 0]
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(r["train_loss"] > 0 for r in records)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return GPT(ModelConfig(vocab_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, max_seq_len=8))


def give_grads(model, names, poison=False, seed=1):
    """Random gradients on `names` (a NaN and an inf among them if poison), None elsewhere."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        p.grad = torch.randn(p.shape, generator=g) if name in names else None
        if poison and p.grad is not None:
            p.grad.view(-1)[:2] = torch.tensor([float("nan"), float("inf")])


def take_step(opt, finite):
    """A step of opt, skipped where not finite."""
    optim.step_if_finite(opt, torch.tensor(finite))


OPTIMIZERS = {
    "adamw fused": dict(name="adamw"),
    "adamw foreach": dict(name="adamw", fused=False),
    "cautious fused": dict(name="adamw", cautious_wd=True),
    "cautious foreach": dict(name="adamw", cautious_wd=True, fused=False),
    "muon": dict(name="muon"),
    "muon, cautious": dict(name="muon", cautious_wd=True),
}


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_a_non_finite_step_leaves_parameters_and_state_bit_identical(kind):
    options = OPTIMIZERS[kind]
    fused = options["name"] == "adamw" and options.get("fused", True)
    if fused and not optim.fused_adamw_available("cpu"):
        pytest.skip("no fused AdamW kernel on this CPU build")
    cfg = OptimConfig(**options, lr=0.05, weight_decay=0.5, beta1=0.8, beta2=0.9)
    models = [tiny_model(), tiny_model()]
    opts = [build_optimizer(m, cfg, m.row_blocks(), "cpu") for m in models]
    model, opt = models[0], opts[0]
    assert optim.skips_on_device(opt) == (fused or options["name"] == "muon")
    names = {n for g in opt.param_groups for n in g["names"]}

    # A skipped first step: the next step is then a fresh optimizer's first, bit for bit.
    give_grads(model, names, poison=True)
    take_step(opt, False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), models[1].parameters()))
    for m, o in zip(models, opts):
        give_grads(m, names, seed=2)
        take_step(o, True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), models[1].parameters()))

    # A skipped step after that: parameters and every state tensor as they were.
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {(id(p), k): v.clone() for p, s in opt.state.items() for k, v in s.items() if torch.is_tensor(v)}
    give_grads(model, names, poison=True, seed=3)
    take_step(opt, False)
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
    for p, s in opt.state.items():
        for k, v in s.items():
            if torch.is_tensor(v):
                assert torch.equal(v, state[(id(p), k)]), k
    give_grads(model, names, seed=4)
    take_step(opt, True)
    assert all(not torch.equal(p, params[n]) for n, p in model.named_parameters() if n in names)


def test_reads_are_due_after_the_first_step_on_the_interval_before_checkpoints_and_evals_and_on_a_signal():
    run = types.SimpleNamespace(cfg=types.SimpleNamespace(log=types.SimpleNamespace(log_interval=10)), max_steps=100,
                                start_step=0,
                                checkpointer=types.SimpleNamespace(due=lambda done, max_steps: done % 25 == 0),
                                evaluator=types.SimpleNamespace(due=lambda done, max_steps: done == 7),
                                info=types.SimpleNamespace(mode="none"), device=torch.device("cpu"))
    quiet, signalled = types.SimpleNamespace(requested=None), types.SimpleNamespace(requested="SIGTERM")
    assert [d for d in range(1, 31) if loop.read_due(run, d, quiet)] == [1, 7, 10, 20, 25, 30]
    run.start_step = 20  # a resumed process: its own first step
    assert [d for d in range(21, 31) if loop.read_due(run, d, quiet)] == [21, 25, 30]
    assert loop.read_due(run, 3, signalled)
    run.info.mode = "ddp"  # the ranks must agree on when: the signal waits for the next read
    assert not loop.read_due(run, 3, signalled)


def test_a_cpu_run_reads_every_step_back_as_it_ends(tiny_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loop, "reads_every_step", REAL_READS_EVERY_STEP)
    assert loop.reads_every_step(torch.device("cpu")) and not loop.reads_every_step(torch.device("cuda"))
    run = train.setup(config.parse_args(["--data", tiny_data, "--out-dir", str(tmp_path), *TINY_FLAGS, "--device",
                                         "cpu", "--dtype", "fp32", "--eval-interval", "0", "--max-steps", "4",
                                         "--log-interval", "4"]))
    windows, original = [], loop.read_back

    def read_back(window, *args):
        windows.append([t.index for t in window])
        return original(window, *args)

    monkeypatch.setattr(loop, "read_back", read_back)
    try:
        loop.run_loop(run)
    finally:
        run.close()
    assert windows == [[0], [1], [2], [3]]  # each step alone, whatever --log-interval


def test_a_streak_seen_after_its_step_rolls_back_there_and_drops_the_later_steps(tiny_data, tmp_path, capsys,
                                                                                   inject_nan):
    inject_nan(4)  # step 5, read back at step 8 with the steps after it
    train.main(["--data", tiny_data, "--out-dir", str(tmp_path), *TINY_FLAGS, "--device", "cpu", "--dtype", "fp32",
                "--eval-interval", "0", "--max-steps", "8", "--ckpt-interval", "4", "--log-interval", "4",
                "--max-bad-steps", "1"])
    err = capsys.readouterr().err
    assert "warning: step 5: loss nan" in err and err.count("rolled back to step 4") == 1
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, 9)) and not any(r["skipped"] for r in records)
    times = [r["time_s"] for r in records]
    assert times == sorted(times) and len(set(times)) == len(times)  # each step's own, not its read's


def test_a_run_that_fails_between_read_backs_still_logs_the_steps_it_finished(tiny_data, tmp_path, monkeypatch,
                                                                             capsys):
    original, calls = loop.train_step, []

    def step(run, *args):
        calls.append(run)
        if len(calls) == 4:
            raise train.DataError("train_000001.bin: unreadable")
        return original(run, *args)

    monkeypatch.setattr(loop, "train_step", step)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--data", tiny_data, "--out-dir", str(tmp_path), *TINY_FLAGS, "--device", "cpu", "--dtype",
                    "fp32", "--eval-interval", "0", "--max-steps", "8", "--log-interval", "8"])
    assert exit_info.value.code == 2 and "train_000001.bin: unreadable" in capsys.readouterr().err
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]
