"""checkpoint.py: checkpoints hold the plain parameter contract, so a Transformer Engine model whose modules
carry FP8 scaling state (`_extra_state`, a pickle under delayed scaling) saves and resumes in both formats,
FSDP2's DCP directories included. TE needs CUDA, so its modules are stood in for by plain ones whose
extra state behaves as TE's does: a non-empty byte tensor once trained, an empty one when fresh. Loading
never runs code and always verifies: planted pickles and damaged files are refused with one line."""

import dataclasses
import json
import os
import pickle
import random
import subprocess
import sys

import pytest
import torch

import batch
import checkpoint
import config
import distributed
import fp8
import optim
import sample
import schedule
from config import ResilienceConfig
from conftest import REPO, spawn_on_gloo, step_values
from fp8 import TE_MODULES
from model import GPT, ModelConfig
from optim import OptimConfig, build_optimizer
from resilience import Guard, LossHealth
from shards import file_sha256
from telemetry import Telemetry

CFG = ModelConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, max_seq_len=32)


def with_extra_state(module: torch.nn.Module, payload: bytes, loaded: list) -> None:
    """Give `module` TE's extra-state behaviour: get_extra_state -> payload as bytes (empty = fresh);
    set_extra_state records the size of what it was handed."""

    def get_extra_state(self):
        return torch.tensor(list(payload), dtype=torch.uint8)

    def set_extra_state(self, state):
        loaded.append(state.numel())

    module.__class__ = type(f"TE{type(module).__name__}", (type(module),),
                            {"get_extra_state": get_extra_state, "set_extra_state": set_extra_state})


def fake_te_gpt(seed: int, payload: bytes, loaded: list) -> GPT:
    torch.manual_seed(seed)
    model = GPT(CFG)
    model.backend = "te"
    for block in model.blocks:
        block.attn.core_attention = torch.nn.Module()  # TE's attention module: no parameters, extra state
        for name in TE_MODULES:
            with_extra_state(block.get_submodule(name), payload, loaded)
    return model


class StubLoader:
    def state_dict(self):
        return {"position": 7}

    def load_state_dict(self, state, other_data=False):
        assert state == {"position": 7} and not other_data
        return []  # no source starts over


def adamw(model):
    return build_optimizer(model, OptimConfig(name="adamw", lr=1e-2), model.row_blocks(), "cpu")


def one_step(model, optimizer):
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len), generator=torch.Generator().manual_seed(0))
    model(idx, idx)[1].backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def full(model):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def save_and_resume(out_dir, info, shard):
    """Train the fake TE model a step with delayed-scaling-like state, save, resume into a fresh one."""
    trained = fake_te_gpt(0, b"amax history pickle", [])
    loaded = []
    fresh = fake_te_gpt(1, b"", loaded)
    if shard:
        for model in (trained, fresh):
            distributed.apply_fsdp(model, model.blocks, None, reshard_after_forward=True)
    ckpt = checkpoint.Checkpointer(str(out_dir), 1, 2, info, CFG, {}, data_id=[["train_000000.bin", 10, "ab"]])
    ckpt.save(1, trained, one_step(trained, adamw(trained)), StubLoader(), Guard(ResilienceConfig()), tokens=64)
    meta = ckpt.restore(fresh, adamw(fresh), StubLoader(), warn=lambda text: pytest.fail(text))
    return meta, full(trained), full(fresh), loaded


def fsdp_worker(rank, world_size, out_dir, result_file):
    info = distributed.DistInfo(rank=rank, local_rank=rank, world_size=world_size, mode="fsdp")
    meta, trained, resumed, loaded = save_and_resume(out_dir, info, shard=True)
    if rank == 0:
        torch.save({"step": meta["step"], "trained": trained, "resumed": resumed, "loaded": loaded}, result_file)


def check_resumed(trained, resumed, loaded):
    assert set(resumed) == set(trained)
    for name, tensor in trained.items():
        assert torch.equal(resumed[name], tensor), name
    # Every TE module was handed an empty extra state ("no FP8 metadata yet"), never the saved pickle.
    assert loaded == [0] * CFG.n_layer * len(TE_MODULES)


def test_a_te_model_with_fp8_state_resumes_from_a_single_file(tmp_path):
    meta, trained, resumed, loaded = save_and_resume(tmp_path, distributed.DistInfo(), shard=False)
    assert meta["step"] == 1
    check_resumed(trained, resumed, loaded)
    saved = torch.load(checkpoint.checkpoint_path(str(tmp_path), 1, sharded=False), weights_only=True)
    assert not [key for key in saved["model"] if key.endswith("._extra_state")]


def test_a_te_model_with_fp8_state_resumes_from_fsdp2_dcp(tmp_path):
    """The DCP template comes from a fresh TE model (empty extra state) while the trained one's is not:
    saved as it was, DCP's planner would refuse the size mismatch and no checkpoint would load."""
    result_file = tmp_path / "result.pt"
    spawn_on_gloo(fsdp_worker, 2, tmp_path, str(tmp_path / "out"), str(result_file))
    result = torch.load(result_file)
    assert result["step"] == 1
    check_resumed(result["trained"], result["resumed"], result["loaded"])


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fp8.te_installed()), reason="needs CUDA and TE")
def test_fsdp2_te_delayed_scaling_saves_and_resumes_through_train(tiny_data, tmp_path):
    """The real thing on one GPU: FSDP2 (one rank, NCCL) over TE blocks with delayed scaling, whose extra
    state is a pickle, writes a DCP checkpoint and resumes from it."""
    flags = ["--data", tiny_data, "--out-dir", str(tmp_path), "--vocab-size", "256", "--n-layer", "2",
             "--n-embd", "256", "--n-head", "2", "--n-kv-head", "1", "--seq-len", "32", "--batch-size", "4",
             "--eval-interval", "0", "--dtype", "bf16", "--fp8", "te", "--fp8-recipe", "delayed", "--dist", "fsdp",
             "--ckpt-interval", "2"]  # the default model: attention gates
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py"]
    first = subprocess.run([*torchrun, *flags, "--max-steps", "2"], cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = subprocess.run([*torchrun, *flags, "--max-steps", "4", "--resume"], cwd=REPO, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "from step 2" in resumed.stdout and "skipping checkpoint" not in resumed.stderr


# ----------------------------------------------------------------------------- loading is safe and verified


class RunsCode:
    """Pickles to a call of os.system: what an attacker would plant in a checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def saved_file(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    state = {"version": checkpoint.CHECKPOINT_VERSION, "step": 3, "model_config": dataclasses.asdict(CFG),
             "model": model.state_dict(), "optimizer": one_step(model, adamw(model)).state_dict()}
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save_file(state, path)
    return path


def rewrite_checksums(directory):
    """What an attacker who can write the directory does after planting a file: fresh, valid checksums."""
    digests = {name: file_sha256(os.path.join(directory, name)) for name in sorted(os.listdir(directory))
               if name != checkpoint.CHECKSUMS_FILE}
    with open(os.path.join(directory, checkpoint.CHECKSUMS_FILE), "w") as f:
        json.dump(digests, f)


def test_a_file_a_directory_checkpoint_lists_and_lacks_is_called_missing_not_damaged(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "meta.pt").write_bytes(b"x")
    rewrite_checksums(tmp_path / "ckpt")
    checkpoint.verify(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / "meta.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="meta.pt is missing, though the checkpoint recorded it"):
        checkpoint.verify(str(tmp_path / "ckpt"))


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "dcp"])
def test_a_kill_while_best_is_replaced_leaves_a_whole_one(tmp_path, monkeypatch, sharded):
    """best is replaced by a second name for a regular checkpoint (link): killed between any two renames,
    the old best or the new one verifies (a DCP best's old one under best.old, as save_sharded leaves it)."""
    old, new = tmp_path / "ckpt_1", tmp_path / "ckpt_2"
    for path, text in (old, b"old"), (new, b"new"):
        if sharded:
            path.mkdir()
            (path / "meta.pt").write_bytes(text)
            rewrite_checksums(path)
        else:
            path.write_bytes(text)
            (tmp_path / f"{path.name}{checkpoint.DIGEST_SUFFIX}").write_text(file_sha256(str(path)))
    best = str(tmp_path / "best")
    checkpoint.link(str(old), best)
    renames, real_replace = [], os.replace
    for kill_at in range(1, 3):
        def replace(src, dst):
            renames.append(dst)
            if len(renames) == kill_at:
                raise KeyboardInterrupt  # the kill, just before this rename
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        renames.clear()
        with pytest.raises(KeyboardInterrupt):
            checkpoint.link(str(new), best)
        monkeypatch.setattr(os, "replace", real_replace)
        whole = best if os.path.exists(best) else f"{best}.old"
        checkpoint.verify(whole)
        checkpoint.link(str(old), best)  # and a later replacement mends it
        checkpoint.verify(best)


@pytest.mark.parametrize("checksum", [b"\xff\xfe", b"", b"[]", b"null", b"{\"meta.pt\": 3}"])
def test_a_damaged_checksum_file_is_a_checkpoint_that_does_not_verify(tmp_path, checksum):
    (tmp_path / "c.pt").write_bytes(b"weights")
    (tmp_path / "c.pt.sha256").write_bytes(checksum)
    with pytest.raises(checkpoint.CheckpointError, match="has no readable .sha256 checksum beside it"):
        checkpoint.verify(str(tmp_path / "c.pt"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "meta.pt").write_bytes(b"meta")
    (tmp_path / "d" / checkpoint.CHECKSUMS_FILE).write_bytes(checksum)
    with pytest.raises(checkpoint.CheckpointError, match=f"has no readable {checkpoint.CHECKSUMS_FILE}"):
        checkpoint.verify(str(tmp_path / "d"))


def one_error_line(result):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("content", ["random bytes", "a global"])
def test_a_file_that_weights_only_refuses_is_not_ours_without_advice_to_run_it(content, tmp_path, capsys):
    """Random bytes, or a pickle that names a function, with a matching checksum beside it: intact, but not a
    checkpoint this trainer wrote. torch's advice (weights_only=False, allow-listing the global) would run its
    code: the line leaves it out, and says only why the file is refused."""
    path = str(tmp_path / "foreign.pt")
    if content == "random bytes":
        with open(path, "wb") as f:
            f.write(random.Random(0).randbytes(4096))
    else:
        torch.save({"model": {}, "call": open}, path)
    with open(path + checkpoint.DIGEST_SUFFIX, "w") as f:
        f.write(file_sha256(path))
    assert sample.main(["--ckpt", path, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot load checkpoint {path}: not a file this trainer wrote, which unpickles as "
                          "tensors and plain data with weights_only=True (") and err.count("\n") == 1, err
    assert "weights_only=False" not in err and "safe_globals" not in err and "trusted" not in err


def test_a_dcp_metadata_pickle_that_runs_code_is_refused(tmp_path):
    evil, marker = str(tmp_path / "evil"), tmp_path / "pwned"
    assert checkpoint.main(["to-dcp", saved_file(tmp_path), evil]) == 0
    with open(os.path.join(evil, ".metadata"), "wb") as f:
        pickle.dump(RunsCode(marker), f)
    rewrite_checksums(evil)
    with pytest.raises(checkpoint.CheckpointError, match="posix.system is not allowed in checkpoint metadata"):
        checkpoint.load(evil, lambda meta: {"model": GPT(CFG).state_dict()})
    result = subprocess.run([sys.executable, "sample.py", "--ckpt", evil, "--max-new-tokens", "2"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert "not allowed in checkpoint metadata" in one_error_line(result)
    assert not marker.exists()


def test_a_dcp_entry_that_runs_code_is_refused_by_the_converter(tmp_path, capsys):
    """DCP unpickles non-tensor entries with weights_only=False; to-file reads every entry."""
    evil, marker = str(tmp_path / "evil"), tmp_path / "pwned"
    checkpoint.save_sharded({"model": GPT(CFG).state_dict(), "optimizer": {}, "extra": RunsCode(marker)},
                            {"version": checkpoint.CHECKPOINT_VERSION, "step": 1}, evil, True, lambda: None)
    assert not marker.exists()  # saving pickles the object, it does not call it
    assert checkpoint.main(["to-file", evil, str(tmp_path / "out.pt")]) == 2
    assert not marker.exists() and not (tmp_path / "out.pt").exists()
    assert "entry extra is not plain data and could run code" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["flip", "empty"])
def test_every_reader_verifies_the_checksum_first(damage, tmp_path, capsys):
    path = saved_file(tmp_path)
    with open(path, "r+b") as f:
        if damage == "flip":
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x40]))
        else:
            f.truncate(0)
    if damage == "empty":  # a 0-byte file with a matching checksum: not damaged, just not a checkpoint
        with open(path + checkpoint.DIGEST_SUFFIX, "w") as f:
            f.write(file_sha256(path))
    expected = "is damaged" if damage == "flip" else "cannot load checkpoint"
    with pytest.raises(checkpoint.CheckpointError, match=expected):
        checkpoint.load(path)
    assert checkpoint.main(["to-dcp", path, str(tmp_path / "dcp")]) == 2
    assert not (tmp_path / "dcp").exists()
    assert expected in capsys.readouterr().err
    result = subprocess.run([sys.executable, "sample.py", "--ckpt", path, "--max-new-tokens", "2"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert expected in one_error_line(result)


# ----------------------------------------------------------------------------- pruning


def test_pruning_keeps_the_newest_and_never_touches_later_steps():
    paths = [f"d/ckpt_{s:08d}.pt" for s in (3, 6, 9, 99)]

    def good(path):
        return True

    assert checkpoint.prunable(paths, 9, 2, good) == ["d/ckpt_00000003.pt"]
    assert checkpoint.prunable(paths, 9, 1, good) == ["d/ckpt_00000003.pt", "d/ckpt_00000006.pt"]
    assert checkpoint.prunable(paths, 3, 1, good) == []
    assert checkpoint.prunable(paths, 12, 5, good) == []


def test_pruning_keeps_the_newest_good_ones_and_never_deletes_a_damaged_one():
    paths = [f"d/ckpt_{s:08d}.pt" for s in (1, 2, 3, 4)]
    damaged = {"d/ckpt_00000003.pt"}
    assert checkpoint.prunable(paths, 4, 2, lambda path: path not in damaged) == ["d/ckpt_00000001.pt"]
    assert checkpoint.prunable(paths, 4, 1, lambda path: path not in damaged) == ["d/ckpt_00000001.pt",
                                                                                  "d/ckpt_00000002.pt"]


def test_a_damaged_checkpoint_does_not_count_toward_keep_ckpts_and_each_one_is_hashed_once(tiny_data, tmp_path,
                                                                                            monkeypatch):
    import train
    from conftest import TINY_FLAGS

    args = ["--out-dir", str(tmp_path), *TINY_FLAGS, "--data", tiny_data, "--eval-interval", "0", "--device", "cpu",
            "--keep-ckpts", "2"]
    train.main([*args, "--max-steps", "3", "--ckpt-interval", "1"])  # ckpt_2, ckpt_3
    ckpt_3 = checkpoint.checkpoint_path(str(tmp_path), 3, sharded=False)
    os.truncate(ckpt_3, os.path.getsize(ckpt_3) // 2)
    verified, verify = [], checkpoint.verify
    monkeypatch.setattr(checkpoint, "verify", lambda path: (verified.append(path), verify(path)))
    train.main([*args, "--max-steps", "6", "--ckpt-interval", "2", "--resume"])  # from ckpt_2; writes 4 and 6
    names = [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))]
    assert names == ["ckpt_00000003.pt", "ckpt_00000004.pt", "ckpt_00000006.pt"]  # two good ones, the damaged kept
    assert sorted(verified) == [checkpoint.checkpoint_path(str(tmp_path), s, sharded=False) for s in (2, 3)]


def test_a_damaged_later_checkpoint_does_not_make_new_ones_disappear(tiny_data, tmp_path, train_in_process):
    from conftest import TINY_FLAGS

    flags = ["--out-dir", str(tmp_path), *TINY_FLAGS, "--data", tiny_data, "--eval-interval", "0",
             "--ckpt-interval", "3", "--keep-ckpts", "1", "--warmup", "9"]  # a longer run re-warms no decay
    first = train_in_process(*flags, "--max-steps", "3")
    assert first.returncode == 0, first.stderr
    (tmp_path / "ckpt_00000099.pt").write_bytes(b"damaged")
    resumed = train_in_process(*flags, "--max-steps", "9", "--resume")
    assert resumed.returncode == 0 and "skipping checkpoint" in resumed.stderr, resumed.stderr
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt_") and n.endswith(".pt")) == [
        "ckpt_00000009.pt", "ckpt_00000099.pt"]


# ----------------------------------------------------------------------------- what a resume refuses


@pytest.fixture
def run_train(train_in_process):
    from conftest import TINY_FLAGS

    return lambda out_dir, data, *flags: train_in_process("--out-dir", out_dir, "--data", data, *TINY_FLAGS,
                                                          "--eval-interval", "0", *flags)


def test_a_checkpoint_without_optimizer_state_is_refused(tiny_data, tmp_path, run_train):
    assert run_train(tmp_path, tiny_data, "--max-steps", "2").returncode == 0
    path = checkpoint.checkpoint_path(str(tmp_path), 2, sharded=False)
    state = torch.load(path, weights_only=True)
    del state["optimizer"]
    checkpoint.save_file(state, path)  # hand-made, with a valid checksum
    refused = run_train(tmp_path, tiny_data, "--max-steps", "4", "--resume")
    assert "has no optimizer state" in one_error_line(refused)


def test_resuming_on_other_shards_is_refused_unless_allowed(tmp_path, run_train):
    from conftest import write_tiny_shards

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, other = write_tiny_shards(tmp_path / "a"), write_tiny_shards(tmp_path / "b", seed=1)  # same sizes
    out = tmp_path / "out"
    warm = ("--warmup", "15")  # every step in the warm-up: a longer --max-steps re-warms no decayed LR
    assert run_train(out, first, *warm, "--max-steps", "2").returncode == 0
    refused = run_train(out, other, *warm, "--max-steps", "4", "--resume")
    assert "the training shards differ from the checkpoint's: shard contents differ" in one_error_line(refused)
    allowed = run_train(out, other, *warm, "--max-steps", "4", "--resume", "--allow-data-change")
    assert allowed.returncode == 0, allowed.stderr
    assert run_train(out, first, *warm, "--max-steps", "6", "--resume", "--allow-data-change").returncode == 0
    (tmp_path / "c").mkdir()  # shards of other sizes: no position on the old ones means anything on these
    resized = write_tiny_shards(tmp_path / "c", train_tokens=(4000, 3000))
    refused = run_train(out, resized, *warm, "--max-steps", "8", "--resume")
    assert "pass --allow-data-change to resume on them anyway" in one_error_line(refused)
    allowed = run_train(out, resized, *warm, "--max-steps", "8", "--resume", "--allow-data-change")
    assert allowed.returncode == 0, allowed.stderr
    assert ("note: --allow-data-change: --data holds other shards than the checkpoint's data position counts, so "
            "its rows start at their beginning") in allowed.stderr


# ----------------------------------------------------------------------------- what a resume trains with


@pytest.mark.parametrize("name, changed", [
    ("muon", dict(lr=5e-3)), ("muon", dict(adam_lr=1e-2)), ("muon", dict(weight_decay=0.0)),
    ("muon", dict(momentum=0.8)), ("muon", dict(ns_dtype="bf16")), ("muon", dict(beta2=0.99)),
    ("adamw", dict(lr=5e-3)),
])
def test_a_resume_trains_with_the_optimizer_settings_it_is_given(name, changed, tmp_path):
    """The checkpoint holds the optimizer's state; the settings are the resuming run's: its groups, the LR it
    logs, and its next update, which is the one the trained optimizer takes once given those settings."""
    saved_cfg = OptimConfig(name=name, lr=1e-3, adam_lr=3e-3, ns_dtype="fp32")
    cfg = dataclasses.replace(saved_cfg, **changed)
    torch.manual_seed(0)
    trained = GPT(CFG)
    trained_opt = build_optimizer(trained, saved_cfg, trained.row_blocks(), "cpu")
    schedule.set_lr(trained_opt, 0.25)
    one_step(trained, trained_opt)
    ckpt = checkpoint.Checkpointer(str(tmp_path), 1, 2, distributed.DistInfo(), CFG, {}, data_id=[])
    ckpt.save(1, trained, trained_opt, StubLoader(), Guard(ResilienceConfig()), tokens=64)
    resumed = GPT(CFG)
    resumed_opt = build_optimizer(resumed, cfg, resumed.row_blocks(), "cpu")
    settings = optim.group_settings(resumed_opt)
    assert settings != optim.group_settings(trained_opt)
    meta = ckpt.restore(resumed, resumed_opt, StubLoader(), warn=lambda text: pytest.fail(text))
    assert meta["lr_multiplier"] == 0.25 and optim.group_settings(resumed_opt) == settings

    optim.apply_group_settings(trained_opt, settings)
    for model, optimizer in ((trained, trained_opt), (resumed, resumed_opt)):
        schedule.set_lr(optimizer, 0.5)
        one_step(model, optimizer)
    for (key, a), b in zip(trained.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), key
    telemetry = Telemetry(config.parse_args(["--out-dir", str(tmp_path)]), False, torch.device("cpu"), 1, 9, 1.0,
                          None, None, resumed_opt)
    record = telemetry.step_record(1, step_values(5.0), 0.1, batch.BatchLayout(2, 32, 1, 1), 1, LossHealth())
    assert record["lr"] == 0.5 * cfg.lr


def test_extending_a_decayed_run_is_refused_unless_the_rewarm_is_asked_for(tiny_data, tmp_path, capsys):
    """The LR of the last step is saved with the checkpoint: a finished WSD run, its LR down to 10% of the
    peak, resumed with more steps would jump back up to the peak."""
    import train
    from conftest import TINY_FLAGS

    flags = ["--data", tiny_data, "--out-dir", str(tmp_path), *TINY_FLAGS, "--eval-interval", "0", "--warmup", "1",
             "--device", "cpu", "--dtype", "fp32", "--lr", "6e-3"]
    train.main([*flags, "--max-steps", "4"])
    with pytest.raises(SystemExit) as refused:
        train.main([*flags, "--max-steps", "6", "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and not any("Traceback" in line for line in err) and err[-1] == (
        "error: --resume: the LR goes from 0.0006 at the checkpoint (step 4) to 0.006 at the next step, up again "
        "after its decay had begun; resume from a checkpoint from before the decay, or pass --allow-lr-rewarm to "
        "re-warm it")
    train.main([*flags, "--max-steps", "6", "--resume", "--allow-lr-rewarm", "--lr", "1e-3"])
    note = "note: the LR goes from 0.0006 at the checkpoint (step 4) to 0.001 at the next step"
    assert note in capsys.readouterr().err
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["lr"] for line in f][4] == 1e-3  # the resumed run's --lr, as the optimizer has it


def test_the_converter_refuses_what_it_cannot_convert_in_one_line(tmp_path, capsys):
    path = saved_file(tmp_path)
    directory = str(tmp_path / "dcp")
    assert checkpoint.main(["to-dcp", path, directory]) == 0
    assert capsys.readouterr().out == f"wrote {directory}: {path} as a DCP directory\n"
    cases = [
        (["to-file", path, str(tmp_path / "a.pt")], "to-file converts a sharded (DCP) directory"),
        (["to-dcp", directory, str(tmp_path / "b")], "to-dcp converts a single file"),
        (["to-file", directory, str(tmp_path / "no" / "such" / "c.pt")], "does not exist"),
        (["to-dcp", path, directory], "already exists: a conversion never replaces it; remove it or name another"),
        (["to-file", str(tmp_path / "missing"), str(tmp_path / "d.pt")], "does not exist"),
        (["to-dcp", path, ""], "to-dcp: the destination is empty; name the directory to write"),
        (["to-file", directory, f"{tmp_path}/e.pt/"], f"to-file writes a single file: {tmp_path}/e.pt/ names a "
                                                       "directory"),
        (["to-file", directory, "/proc/f.pt"], "cannot write checkpoint /proc/f.pt: "),  # a write that fails
    ]
    (tmp_path / "mine.tmp").mkdir()  # the user's, where a conversion stages its output: never removed
    (tmp_path / "notes.pt.sha256.tmp").write_text("mine")
    for argv, staged in (["to-dcp", path, str(tmp_path / "mine")], "mine.tmp"), (
            ["to-file", directory, str(tmp_path / "notes.pt")], "notes.pt.sha256.tmp"):
        cases.append((argv, f"{tmp_path / staged} already exists, where the conversion writes on its way to "))
    for argv, message in cases:
        assert checkpoint.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, (argv, err)
    assert (tmp_path / "mine.tmp").is_dir() and (tmp_path / "notes.pt.sha256.tmp").read_text() == "mine"
    assert checkpoint.main(["to-dcp", path, f"{tmp_path}/g/"]) == 0 and checkpoint.verify(f"{tmp_path}/g") is None
