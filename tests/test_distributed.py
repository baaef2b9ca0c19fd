"""torchrun with 2 CPU processes on gloo, checked against a single process on the same global batch."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import checkpoint
import cli
import distributed
from conftest import REPO, spawn_on_gloo
from model import GPT, ModelConfig
from shards import write_shard

# B=4, T=32: 128 tokens per micro-batch. 256 tokens per step is 2 micro-steps on 1 rank, 1 on 2 ranks.
COMMON = ["--vocab-size", "256", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2", "--n-embd", "64",
          "--seq-len", "32", "--batch-size", "4", "--total-batch-tokens", "256", "--warmup", "2",
          "--eval-interval", "3", "--eval-tokens", "512", "--device", "cpu", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_data")
    # A learnable sequence (each token determines the next), so that the runs compared visibly train.
    tokens = (np.arange(15000) * 7 % 256).astype(np.uint16)
    for i in range(2):
        write_shard(root / f"train_{i:06d}.bin", tokens[i * 6000:(i + 1) * 6000], vocab_size=256)
    write_shard(root / "val_000000.bin", tokens[12000:], vocab_size=256)
    return str(root)


def child_env(**extra: str) -> dict:
    """The environment of a launched run: one thread a process, no wandb key, and `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def launch(nproc, *args):
    """train.py in `nproc` processes under torchrun (or plainly when nproc is None); returns the result."""
    env = child_env()
    prefix = [sys.executable]
    if nproc is not None:
        prefix += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    result = subprocess.run([*prefix, "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    return result


def train_losses(nproc, out_dir, *args):
    result = launch(nproc, "--out-dir", str(out_dir), *COMMON, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r["train_loss"] for r in records], [r["val_loss"] for r in records if "val_loss" in r]


@pytest.fixture(scope="module")
def single_process(data_dir, tmp_path_factory):
    """Reference 1-process runs, one per optimizer."""
    cache = {}

    def get(optimizer):
        if optimizer not in cache:
            out = tmp_path_factory.mktemp(f"single_{optimizer}")
            cache[optimizer] = train_losses(None, out, "--data", data_dir, "--max-steps", "5",
                                            "--optimizer", optimizer, "--lr", "1e-2")
        return cache[optimizer]

    return get


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_two_ranks_match_one_process(mode, optimizer, data_dir, single_process, tmp_path):
    reference_train, reference_val = single_process(optimizer)
    train, val = train_losses(2, tmp_path, "--data", data_dir, "--max-steps", "5", "--optimizer", optimizer,
                              "--lr", "1e-2", "--dist", mode)
    assert len(train) == 5 and len(val) == 2
    np.testing.assert_allclose(train, reference_train, rtol=2e-6)
    np.testing.assert_allclose(val, reference_val, rtol=2e-6)
    assert reference_train[-1] < reference_train[0]  # the runs compared actually trained


def test_fsdp_with_activation_checkpointing_matches_one_process(data_dir, single_process, tmp_path):
    reference_train, _ = single_process("adamw")
    train, _ = train_losses(2, tmp_path, "--data", data_dir, "--max-steps", "5", "--optimizer", "adamw",
                            "--lr", "1e-2", "--dist", "fsdp", "--act-ckpt", "full")
    np.testing.assert_allclose(train, reference_train, rtol=2e-6)


def fsdp_numerics_worker(rank, world_size, out_file):
    """FSDP2 with bf16 block parameters against DDP under bf16 autocast, on the same weights and batch."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, max_seq_len=32)
    sharded, reference = GPT(cfg), GPT(cfg)
    reference.load_state_dict(sharded.state_dict())
    block_inputs = []
    for block in sharded.blocks:
        block.register_forward_pre_hook(lambda _, args: block_inputs.append([str(a.dtype) for a in args]))
    distributed.apply_fsdp(sharded, sharded.blocks, torch.bfloat16, reshard_after_forward=True)
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(rank))
    losses = {}
    for name, model in (("fsdp", sharded), ("ddp", ddp)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[name] = model(idx, idx)[1]
        if name == "fsdp":  # between forward and backward: the root stays gathered, the blocks do not
            root_gathered = not isinstance(sharded.embed.weight, DTensor)
            block_sharded = isinstance(sharded.blocks[0].attn.qkv.weight, DTensor)
        losses[name].backward()
    grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
    if rank == 0:
        torch.save({"losses": {k: v.item() for k, v in losses.items()}, "block_inputs": block_inputs,
                    "root_gathered": root_gathered, "block_sharded": block_sharded, "grads": grads,
                    "reference_grads": {n: p.grad for n, p in reference.named_parameters()}}, out_file)


def test_fsdp_mixed_precision_keeps_ddp_numerics(tmp_path):
    out_file = tmp_path / "out.pt"
    spawn_on_gloo(fsdp_numerics_worker, 2, tmp_path, str(out_file))
    out = torch.load(out_file)
    # The residual stream and the RoPE tables reach every block in fp32, as under DDP (FSDP2's default
    # cast_forward_inputs would hand them over in bf16).
    assert out["block_inputs"] == [["torch.float32"] * 3] * 2
    assert out["root_gathered"] and out["block_sharded"]
    # The matmuls see the same bf16 operands either way; only the norm weights' gradients pass through bf16.
    assert out["losses"]["fsdp"] == pytest.approx(out["losses"]["ddp"], rel=1e-6)
    for name, grad in out["grads"].items():
        ref = out["reference_grads"][name]
        assert (grad - ref).norm() <= 5e-3 * ref.norm(), name


def test_shutdown_frees_ddp_before_leaving_the_process_group(tmp_path):
    """DDP can sit in a reference cycle (its autograd hooks) that reference counting never frees; left to
    interpreter exit it aborts gloo processes now and then, so shutdown collects it while Python is whole."""
    import gc
    import weakref

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        gc.disable()  # the cycle must survive until shutdown, as it would when no collection happens to run
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        ddp(torch.ones(1, 2)).sum().backward()
        ddp.cycle = ddp  # whether torch's own hooks form one depends on what ran before in this process
        alive = weakref.ref(ddp)
        del ddp
        assert alive() is not None
        distributed.shutdown(distributed.DistInfo(world_size=1, mode="ddp"))
        assert alive() is None and not dist.is_initialized()
    finally:
        gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp2_bf16_on_one_gpu_matches_a_single_device_run(data_dir, tmp_path):
    """NCCL, bf16 parameters in the blocks: the same losses as autocast alone (the first step exactly: the
    norm weights, the only ones FSDP2 rounds differently, start at 1.0, which bf16 holds exactly)."""
    cuda = ["--data", data_dir, "--max-steps", "3", "--device", "cuda", "--dtype", "bf16"]
    reference, _ = train_losses(None, tmp_path / "single", *cuda)
    sharded, _ = train_losses(1, tmp_path / "fsdp", *cuda, "--dist", "fsdp")
    assert sharded[0] == pytest.approx(reference[0], rel=1e-6)
    np.testing.assert_allclose(sharded, reference, rtol=1e-2)


def resume_from(src_out, step, dst_out, nproc, *args):
    """Copy checkpoint `step` of one run into a fresh out dir and resume from it to step 6."""
    os.makedirs(dst_out)
    path = checkpoint.list_checkpoints(str(src_out))
    (src,) = [p for p in path if checkpoint.checkpoint_step(p) == step]
    if os.path.isdir(src):
        shutil.copytree(src, os.path.join(dst_out, os.path.basename(src)))
    else:
        for path in (src, src + checkpoint.DIGEST_SUFFIX):
            shutil.copy(path, dst_out)
    return train_losses(nproc, dst_out, *args, "--resume")


def test_resume_across_world_sizes(data_dir, tmp_path):
    args = ["--data", data_dir, "--max-steps", "6", "--ckpt-interval", "3", "--keep-ckpts", "5"]
    reference, _ = train_losses(None, tmp_path / "one", *args)
    two, _ = train_losses(2, tmp_path / "two", *args, "--dist", "fsdp")
    np.testing.assert_allclose(two, reference, rtol=2e-6)
    assert os.path.isdir(checkpoint.checkpoint_path(str(tmp_path / "two"), 3, sharded=True))

    # Sharded by 2 FSDP ranks, resumed by one plain process; and a single file resumed by 2 FSDP ranks.
    two_to_one, _ = resume_from(tmp_path / "two", 3, tmp_path / "two_to_one", None, *args)
    one_to_two, _ = resume_from(tmp_path / "one", 3, tmp_path / "one_to_two", 2, *args, "--dist", "fsdp")
    # Each resumed log opens with the checkpoint's own record of step 3 (the copy had no metrics.jsonl).
    np.testing.assert_allclose(two_to_one, reference[2:], rtol=2e-6)
    np.testing.assert_allclose(one_to_two, reference[2:], rtol=2e-6)

    # The conversion tool: DCP directory -> single file (what sample/export read) -> DCP directory.
    dcp_dir = checkpoint.checkpoint_path(str(tmp_path / "two"), 6, sharded=True)
    as_file = str(tmp_path / "converted.pt")
    assert checkpoint.main(["to-file", dcp_dir, as_file]) == 0
    single = torch.load(checkpoint.checkpoint_path(str(tmp_path / "one"), 6, sharded=False), weights_only=True)
    converted = torch.load(as_file, weights_only=True)
    assert converted["model_config"] == single["model_config"] and converted["step"] == 6
    assert "blocks.1.attn.gate_weight" in converted["model"]  # the default recipe's state went through DCP
    # The file holds exactly what the directory does, read back the way a resume reads it (into the loading run's
    # own state dict, DCP's planner). Against the one-process run only the losses above are compared: FSDP2 sums
    # the ranks' gradients in another order, and an AdamW row whose gradient is tiny moves as far on that rounding
    # as on signal (one embedding element of 16,384 differed by 6.3e-4 on an Intel Xeon after 6 steps).
    _, read_back = checkpoint.load(dcp_dir, lambda meta: {"model": {k: torch.empty_like(v)
                                                                    for k, v in converted["model"].items()}})
    assert read_back["model"].keys() == converted["model"].keys() == single["model"].keys()
    for name, tensor in converted["model"].items():
        assert torch.equal(read_back["model"][name], tensor), name
    back = str(tmp_path / "back")
    assert checkpoint.main(["to-dcp", as_file, back]) == 0
    assert checkpoint.load(back)[0]["step"] == 6


def test_resume_at_another_world_size_keeps_the_global_batch(data_dir, tmp_path):
    """Without --total-batch-tokens, 2 ranks x 4 x 32 = 256 tokens/step; resumed in one process, grad
    accumulation becomes 2 so that the run goes on with the same batch, tokens and losses."""
    at = COMMON.index("--total-batch-tokens")
    flags = COMMON[:at] + COMMON[at + 2:]
    args = ["--out-dir", "OUT", *flags, "--data", data_dir, "--max-steps", "6", "--ckpt-interval", "3"]

    def run(nproc, out_dir, *extra):
        result = launch(nproc, *[str(out_dir) if a == "OUT" else a for a in args], *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f], result

    two, _ = run(2, tmp_path / "two", "--dist", "fsdp")
    os.makedirs(tmp_path / "one")
    src = checkpoint.checkpoint_path(str(tmp_path / "two"), 3, sharded=True)
    shutil.copytree(src, os.path.join(tmp_path / "one", os.path.basename(src)))
    one, result = run(None, tmp_path / "one", "--resume")
    assert "grad accumulation 1 -> 2 keeps the global batch of 256 tokens/step" in result.stderr
    # The log opens with the checkpoint's own record of step 3 (the copy had no metrics.jsonl), written
    # before that step's eval, which the resume measures again.
    assert one[0].keys() == two[2].keys()
    assert {k: v for k, v in one[0].items() if not k.startswith("val_")} == \
        {k: v for k, v in two[2].items() if not k.startswith("val_")}
    assert one[0]["val_loss"] == pytest.approx(two[2]["val_loss"], rel=2e-6)
    assert [r["tokens"] for r in one[1:]] == [r["tokens"] for r in two[3:]] == [1024, 1280, 1536]
    np.testing.assert_allclose([r["train_loss"] for r in one], [r["train_loss"] for r in two[2:]], rtol=2e-6)


@pytest.mark.parametrize("args, message", [
    (["--dist", "ddp"], "needs torchrun"),
    (["--dist", "fsdp", "--dtype", "fp16"], "fp16 is not supported"),
    (["--dist", "fsdp", "--optimizer", "adamw8bit"], "does not support FSDP2"),
    (["--dist", "ddp", "--ddp-bucket-mb", "0"], "--ddp-bucket-mb"),
])
def test_unsupported_combinations_fail_at_startup(args, message, tmp_path):
    result = launch(None, "--out-dir", str(tmp_path), *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_plain_launch_of_many_processes_is_refused(data_dir, tmp_path):
    result = launch(2, "--data", data_dir, "--out-dir", str(tmp_path), *COMMON)
    assert result.returncode != 0 and "pass --dist ddp or --dist fsdp" in result.stderr


def launch_env(monkeypatch, **values: str) -> None:
    """Exactly `values` of torchrun's per-rank variables (cli.LAUNCH_ENV) in this process's environment."""
    for name in cli.LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


FULL_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, mode, message", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "none", "RANK and WORLD_SIZE are set but not LOCAL_RANK, MASTER_ADDR, "
     "MASTER_PORT: start each rank with torchrun, e.g. torchrun --nproc_per_node=2 train.py --dist ddp ..., "
     "or unset RANK and WORLD_SIZE to train in one process"),
    ({"WORLD_SIZE": "4", "LOCAL_RANK": "0"}, "fsdp", "WORLD_SIZE is set but not RANK, MASTER_ADDR, MASTER_PORT: "
     "start each rank with torchrun, e.g. torchrun --nproc_per_node=4 train.py --dist fsdp ..., or unset "
     "WORLD_SIZE and pass --dist none to train in one process"),
    (FULL_ENV, "none", "launched with 2 processes but --dist none; pass --dist ddp or --dist fsdp"),
    ({**FULL_ENV, "LOCAL_RANK": "", "WORLD_SIZE": "16"}, "ddp", "LOCAL_RANK is not set: a launcher other than "
     "torchrun must set it too, each process's rank on its node (under srun, LOCAL_RANK=$SLURM_LOCALID)"),
    ({}, "ddp", "--dist ddp needs torchrun, e.g. torchrun --nproc_per_node=2 train.py --dist ddp ..."),
    (FULL_ENV, "ddp", None),
    ({"RANK": "0", "WORLD_SIZE": "1"}, "none", None),  # a one-process run that a launcher's variables leave alone
    ({"MASTER_PORT": "x"}, "none", None),
])
def test_a_launch_without_torchruns_whole_environment_is_one_line(monkeypatch, env, mode, message):
    launch_env(monkeypatch, **env)
    assert distributed.check_launch(mode) == message


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE must be a positive integer, got 'abc'"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE must be a positive integer, got '0'"),
    ({**FULL_ENV, "RANK": "2"}, r"RANK must be in \[0, WORLD_SIZE\) = \[0, 2\), got '2'"),
    ({**FULL_ENV, "LOCAL_RANK": "-1"}, r"LOCAL_RANK must be in \[0, WORLD_SIZE\) = \[0, 2\), got '-1'"),
    ({**FULL_ENV, "MASTER_PORT": "http"}, r"MASTER_PORT must be in \[1, 65536\), got 'http'"),
])
def test_a_malformed_launch_variable_is_named_with_its_value(monkeypatch, env, message):
    launch_env(monkeypatch, **env)
    with pytest.raises(cli.UsageError, match=f"^{message}$"):
        distributed.check_launch("ddp")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rendezvous_that_no_other_rank_joins_is_one_line_naming_the_address(monkeypatch, capsys, rank):
    """Rank 0 waits for clients that never come, rank 1 for a rank 0 that never listens: each says so itself
    (rank 0's line is printed by its caller) within --collective-timeout, and no process group is left."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch_env(monkeypatch, **{**FULL_ENV, "RANK": str(rank), "MASTER_PORT": str(port)})
    started = time.monotonic()
    with pytest.raises(cli.UsageError) as error:
        distributed.init("ddp", "cpu", timeout_s=1)
    assert time.monotonic() - started < 10 and not torch.distributed.is_initialized()
    line = str(error.value)
    assert line.startswith(f"rank {rank} of 2 did not meet the other ranks at MASTER_ADDR:MASTER_PORT "
                           f"127.0.0.1:{port} within --collective-timeout 1s (")
    assert line.endswith("e.g. torchrun --nproc_per_node=2 train.py --dist ddp ..., or unset RANK and WORLD_SIZE "
                         "and pass --dist none to train in one process")
    assert capsys.readouterr().err == ("" if rank == 0 else f"error: {line}\n")


def test_a_start_up_error_is_printed_by_rank_0_and_by_any_rank_no_launcher_started(monkeypatch, capsys):
    monkeypatch.setattr(cli, "STARTUP_ERROR_GRACE_S", 0)
    for env, printed in ((FULL_ENV, True), ({**FULL_ENV, "RANK": "1"}, False), ({"RANK": "1", "WORLD_SIZE": "2"},
                                                                                True), ({}, True)):
        launch_env(monkeypatch, **env)
        assert cli.report_startup_error("bad flag") == 2
        assert capsys.readouterr().err == ("error: bad flag\n" if printed else ""), env


def test_a_hand_set_rank_1_prints_its_own_flag_error(tmp_path):
    env = {k: v for k, v in child_env(RANK="1", WORLD_SIZE="2").items()
           if k not in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run([sys.executable, "train.py", "--out-dir", str(tmp_path), "--lr", "abc"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr == "error: argument --lr: invalid float value: 'abc'\n"


def test_the_slurm_script_checkpoints_and_requeues_when_the_time_limit_nears(data_dir, tmp_path):
    """docs/slurm.sbatch as it is, under a stand-in for SLURM: its USR1 stops two torchrun ranks at a checkpoint
    well inside torchrun's 30 s, the job requeues itself, and the requeued script resumes from that checkpoint."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in [("scontrol", 'echo "$@" >> "$SCONTROL_LOG"'),
                       ("torchrun", f'exec {sys.executable} -m torch.distributed.run "$@"')]:
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "run"

    def job(max_steps):
        args = ["--dist", "ddp", "--data", data_dir, "--out-dir", str(out), *COMMON, "--max-steps", str(max_steps),
                "--log-interval", "1"]
        env = child_env(PATH=f"{bin_dir}:{os.environ['PATH']}", NPROC="2", SLURM_JOB_ID="4242",
                        SCONTROL_LOG=str(tmp_path / "scontrol.log"), TRAIN_ARGS=" ".join(args))
        return subprocess.Popen(["bash", os.path.join("docs", "slurm.sbatch")], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = job(10_000)
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.2)
    signalled = time.monotonic()
    first.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@180 sends the batch script
    stdout, stderr = first.communicate(timeout=60)
    assert first.returncode == 0 and time.monotonic() - signalled < 30, stderr[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    done = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert [checkpoint.checkpoint_step(p) for p in checkpoint.list_checkpoints(str(out))][-1] == done
    again = job(done + 2)  # the requeued job runs the same script: --resume auto goes on from that checkpoint
    stdout, stderr = again.communicate(timeout=180)
    assert again.returncode == 0, stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, done + 3))


def _workers(torchrun_pid: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of the train.py processes a torchrun started."""
    found = {}
    for pid in subprocess.run(["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True).stdout.split():
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        ranks = [e.split(b"=", 1)[1] for e in env if e.startswith(b"LOCAL_RANK=")]
        if ranks:
            found[int(ranks[0])] = int(pid)
    return found


# Rank 1 of a first attempt stops before its optimizer's step `steps` + 2 until it is killed, so that the kill lands
# there however slow the test's polling is on a busy machine (the run would go on, and end, without it); rank 0 logs
# step `steps` + 1 (a step's record is written during the next, loop.read_back) and waits in step `steps` + 3.
PAUSE_RANK_1 = """
import os

if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    import time

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    seen = []

    def pause(optimizer, args, kwargs):
        seen.append(id(optimizer))
        if seen.count(seen[0]) == {steps} + 2 and id(optimizer) == seen[0]:
            time.sleep(600)

    register_optimizer_step_pre_hook(pause)
"""


def _torchrun(out, args, *torchrun_flags, pause_after: int | None = None) -> subprocess.Popen:
    """train.py on 2 ranks; pause_after: rank 1 waits before its optimizer step pause_after + 2 (PAUSE_RANK_1)."""
    env = child_env()
    if pause_after is not None:
        shim = out.parent / f"{out.name}_shim"
        shim.mkdir()
        (shim / "sitecustomize.py").write_text(PAUSE_RANK_1.replace("{steps}", str(pause_after)))  # a test's hook
        env["PYTHONPATH"] = f"{shim}:{os.environ.get('PYTHONPATH', '')}"
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             *torchrun_flags, "train.py", "--out-dir", str(out), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_rank_1_after(run: subprocess.Popen, metrics, steps: int) -> list[dict]:
    """SIGKILL to local rank 1 once `steps` steps are logged (the run started with pause_after=steps, so rank 1
    waits there); -> those steps' records, as logged before it."""
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps + 1):  # line `steps` whole
        assert run.poll() is None, run.communicate()[1][-3000:]
        if time.monotonic() > deadline:
            run.kill()
            pytest.fail(f"{steps + 1} records never came: {run.communicate()[1][-3000:]}")
        time.sleep(0.02)
    logged = [json.loads(line) for line in metrics.read_text().splitlines()[:steps]]
    os.kill(_workers(run.pid)[1], signal.SIGKILL)
    return logged


def test_a_filesystem_that_fills_during_an_fsdp2_save_is_one_line_and_keeps_the_previous_checkpoint(
        data_dir, tmp_path, small_filesystem):
    """A real full disk under 2 gloo ranks' DCP save, which torch reports as its zip writer's RuntimeError with no
    OSError inside: the full-disk line on the main rank and no traceback, the partial directory gone, the
    previous checkpoint whole, the summary written, exit 1."""
    flags = ["--data", data_dir, *COMMON, "--dist", "fsdp", "--eval-interval", "0", "--ckpt-interval", "1",
             "--keep-ckpts", "1"]
    probe = launch(2, *flags, "--out-dir", str(tmp_path / "probe"), "--max-steps", "1")
    assert probe.returncode == 0, probe.stderr[-3000:]
    first = tmp_path / "probe" / "ckpt_00000001"
    size = sum(f.stat().st_size for f in first.iterdir())
    out = small_filesystem(int(size * 1.5) // 1024) / "run"  # room for one checkpoint, not for a second beside it
    result = launch(2, *flags, "--out-dir", str(out), "--max-steps", "4")
    assert result.returncode != 0 and not re.search(r"\[rank\d\]: Traceback", result.stderr), result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.fullmatch(
        rf"error: cannot write checkpoint {re.escape(str(out))}/ckpt_00000002: No space left on device \([\d.,]+ MiB "
        r"free on its filesystem\); the previous checkpoints are intact", errors[0]), result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("ckpt_")) == ["ckpt_00000001"]
    checkpoint.verify(str(out / "ckpt_00000001"))
    assert (out / "summary.json").exists()


def first_shards(data: str, rank: int, steps: int) -> set[int]:
    """The shards rank `rank` of two reads for its first `steps` batches, as train.py's loader takes them."""
    from data import ShardLoader

    loader = ShardLoader(data, batch_size=4, seq_len=32, rank=rank, world_size=2, seed=1337, prefetch=0)
    read, check = [], loader.order.watch.check
    loader.order.watch.check = lambda i: (read.append(i), check(i))[1]
    for _ in range(steps):
        next(loader)
    return set(read)


def test_an_error_on_another_rank_is_its_line_and_rank_0_quotes_it(tmp_path):
    """A shard that rank 1 reads in its first batch and rank 0 does not, damaged after prepare.py recorded its
    sha256: rank 1 stops with its line, prefixed with its rank; rank 0, which meets rank 1's absence in its
    next collective, quotes that line instead of advising a relaunch that would fail the same way."""
    from shards import file_sha256, write_data_record

    data = tmp_path / "data"
    data.mkdir()
    tokens = (np.arange(12000) * 7 % 256).astype(np.uint16)
    for i in range(12):  # 4 windows a shard: a rank's batch of 4 rows takes one shard
        write_shard(data / f"train_{i:06d}.bin", tokens[i * 160:(i + 1) * 160], vocab_size=256)
    write_shard(data / "val_000000.bin", tokens[9000:], vocab_size=256)
    write_data_record(str(data), {"tokenizer": "gpt2", "n_vocab": 256, "sha256": {
        p.name: file_sha256(str(p)) for p in sorted(data.glob("*.bin"))}})
    damaged = min(first_shards(str(data), 1, 1) - first_shards(str(data), 0, 3))  # rank 0 prefetches 2 batches
    path = data / f"train_{damaged:06d}.bin"
    with open(path, "r+b") as f:  # same size and inode: only the recorded sha256 tells
        f.seek(path.stat().st_size - 64)
        f.write(b"\x01" * 32)
    result = launch(2, "--data", str(data), "--out-dir", str(tmp_path / "out"), *COMMON, "--dist", "ddp",
                    "--eval-interval", "0", "--max-steps", "5")
    assert result.returncode != 0 and not re.search(r"\[rank\d\]: Traceback", result.stderr), result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    cause = f"{path}: the shard's sha256 is not the one data.json records"
    assert len(errors) == 2 and errors[0].startswith(f"error: rank 1: {cause}"), result.stderr[-3000:]
    assert re.fullmatch(rf"error: rank 0 lost the other ranks in a collective \(.*\): rank 1 stopped first: "
                        rf"{re.escape(cause)}.*prepare the data again, then resume", errors[1]), errors[1]


KILLED_RUN = ["--dist", "ddp", *COMMON, "--eval-interval", "0", "--max-steps", "60", "--ckpt-interval", "20",
              "--log-interval", "1", "--resume", "auto"]


def test_a_rank_killed_mid_run_is_one_line_for_the_others_and_its_checkpoints_stay_whole(data_dir, tmp_path):
    """SIGKILL to rank 1: rank 0 leaves its collective at once with one line naming what happened and how to go
    on; the checkpoints written before the kill verify."""
    out = tmp_path / "killed"
    run = _torchrun(out, ["--data", data_dir, *KILLED_RUN], pause_after=30)
    _kill_rank_1_after(run, out / "metrics.jsonl", 30)
    _, err = run.communicate(timeout=120)
    assert run.returncode != 0, err[-3000:]
    lost = [line for line in err.splitlines() if line.startswith("error: rank 0 lost the other ranks")]
    assert len(lost) == 1 and "another rank died or hung" in lost[0] and "--resume auto" in lost[0], err[-3000:]
    saved = checkpoint.list_checkpoints(str(out))
    assert [checkpoint.checkpoint_step(p) for p in saved] == [20]
    for path in saved:
        checkpoint.verify(path)


def test_torchrun_max_restarts_after_a_killed_rank_resumes_the_run_exactly(data_dir, tmp_path):
    """torchrun --max-restarts 2 restarts both ranks after rank 1's SIGKILL; with --resume auto they go on from
    the step-20 checkpoint, and the steps redone (21..30) have the losses the first attempt logged, bit for bit."""
    out = tmp_path / "restarted"
    run = _torchrun(out, ["--data", data_dir, *KILLED_RUN], "--max-restarts", "2", pause_after=30)
    first = _kill_rank_1_after(run, out / "metrics.jsonl", 30)
    stdout, err = run.communicate(timeout=180)
    assert run.returncode == 0, err[-3000:]
    assert any(line.split()[:4] == ["resume", "from", "step", "20"] for line in stdout.splitlines()), stdout[-3000:]
    after = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in after] == list(range(1, 61))
    assert [r["train_loss"] for r in after[:30]] == [r["train_loss"] for r in first]


KILL_IN_DCP_SAVE = """
import os
import signal

if os.environ.get("RANK") == "1":  # rank 1 dies as its second DCP save begins, rank 0 already inside its own
    import torch.distributed.checkpoint as dcp

    real_save, calls = dcp.save, []

    def save(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(*args, **kwargs)

    dcp.save = save
"""


def test_a_rank_killed_during_a_dcp_save_leaves_the_previous_checkpoint_to_resume_from(data_dir, tmp_path):
    args = ["--dist", "fsdp", "--data", data_dir, *COMMON, "--eval-interval", "0", "--max-steps", "9",
            "--ckpt-interval", "3", "--log-interval", "1"]
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(KILL_IN_DCP_SAVE)  # a test's fault, not a product flag
    out = tmp_path / "killed"
    env = child_env(PYTHONPATH=f"{shim}:{os.environ.get('PYTHONPATH', '')}")
    killed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "train.py", "--out-dir", str(out), *args], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode != 0 and "error: rank 0 lost the other ranks" in killed.stderr, killed.stderr[-3000:]
    saved = checkpoint.list_checkpoints(str(out))
    assert [checkpoint.checkpoint_step(p) for p in saved] == [3]  # step 6's directory, half made, is not one
    checkpoint.verify(saved[0])
    before = [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    resumed, _ = train_losses(2, out, *args, "--resume")  # its exactness: test_resume_across_world_sizes
    assert len(resumed) == 9 and resumed[:3] == before[:3]
