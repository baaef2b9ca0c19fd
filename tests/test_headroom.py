import re
import resource
import subprocess
import sys

import pytest
import torch

import batch
import checkpoint
import config
import headroom
import train
from cli import UsageError
from conftest import REPO, TINY_FLAGS, spawn_on_gloo, write_tiny_shards

GIB = 2**30
CPU = torch.device("cpu")


def linear(per_sequence: int, fixed: int = 0):
    """A first step's bytes that grow by per_sequence a sequence, as activations do."""
    return lambda b, seq_len: fixed + b * per_sequence


def test_the_room_is_the_least_limit_and_names_it(monkeypatch):
    monkeypatch.setattr(headroom, "_cgroup_room", lambda: 8 * GIB)
    monkeypatch.setattr(headroom, "_proc_bytes", lambda path, field: 20 * GIB if field == "MemAvailable" else GIB)
    limits = {resource.RLIMIT_AS: (5 * GIB, resource.RLIM_INFINITY), resource.RLIMIT_DATA: (resource.RLIM_INFINITY,) * 2}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits[which])
    assert headroom.free_room(CPU) == headroom.Room(4 * GIB, "left under its address-space limit, ulimit -v")
    limits[resource.RLIMIT_AS] = (resource.RLIM_INFINITY,) * 2
    assert headroom.free_room(CPU) == headroom.Room(8 * GIB, "left under its cgroup's memory.max")
    assert headroom.free_room(CPU, local_ranks=2) == headroom.Room(
        4 * GIB, "left under its cgroup's memory.max, a share of 2 ranks on this host")
    monkeypatch.setattr(headroom, "_cgroup_room", lambda: None)
    assert headroom.free_room(CPU).why == "the RAM the kernel reports available, MemAvailable"


def test_this_machine_has_a_room():
    room = headroom.free_room(CPU)
    assert room is not None and 0 < room.bytes < 2**50


def test_the_largest_fitting_micro_batch_is_found_by_arithmetic():
    assert headroom.largest_fitting(10 * GIB, lambda b: 1 * GIB + b * GIB) == 9
    assert headroom.largest_fitting(GIB, lambda b: 2 * GIB) == 0
    assert headroom.largest_fitting(2**60, lambda b: b) == 2**20  # a claimed huge room: bounded, never a long loop


def layout(micro, accum=1):
    return batch.BatchLayout(micro_batch=micro, seq_len=1024, grad_accum=accum, world_size=1)


def test_a_cpu_step_that_does_not_fit_is_refused_with_the_batch_that_does():
    cfg = config.parse_args(["--total-batch-tokens", str(16 * 1024), "--seq-len", "1024", "--batch-size", "16"])
    room = headroom.Room(5 * GIB, "the RAM the kernel reports available, MemAvailable")
    with pytest.raises(UsageError) as e:
        headroom.check_first_step(cfg, layout(16), linear(GIB, GIB), room, 1, CPU)
    assert str(e.value) == (
        "the first step needs ~17.0 GiB more (micro-batch 16 x 1,024 tokens: gradients, optimizer state, "
        "activations; --estimate-memory shows the parts), and this process may take 5.0 GiB more (the RAM the "
        "kernel reports available, MemAvailable); --batch-size 4 fits")  # 4 fits, and divides the 16 sequences
    with pytest.raises(UsageError, match="not even one sequence fits: try --act-ckpt full"):
        headroom.check_first_step(cfg, layout(16), linear(GIB, 5 * GIB), room, 1, CPU)
    assert headroom.check_first_step(cfg, layout(2, 8), linear(GIB, GIB), room, 1, CPU) is None


def test_without_a_derived_grad_accum_the_suggestion_keeps_the_steps_tokens_by_grad_accum():
    cfg = config.parse_args(["--batch-size", "16"])
    room = headroom.Room(6 * GIB, "x")
    with pytest.raises(UsageError, match=r"--batch-size 5 fits \(raise --grad-accum to keep the step's tokens\)"):
        headroom.check_first_step(cfg, layout(16), linear(GIB, GIB), room, 1, CPU)


def test_on_cuda_the_estimate_only_warns():
    cfg = config.parse_args(["--batch-size", "16"])
    warning = headroom.check_first_step(cfg, layout(16), linear(GIB), headroom.Room(GIB, "free on the GPU"), 1,
                                        torch.device("cuda"))
    assert warning.startswith("warning: the first step needs") and "a compiled step saves less" in warning


def test_batch_size_auto_on_a_cpu_takes_the_largest_that_fits_and_divides_the_step(tiny_data, tmp_path, monkeypatch):
    flags = ["--data", tiny_data, *TINY_FLAGS, "--device", "cpu", "--batch-size", "auto", "--total-batch-tokens",
             str(12 * 32), "--max-steps", "1", "--eval-interval", "0"]
    run = train.setup(config.parse_args([*flags, "--out-dir", str(tmp_path / "roomy")]))
    run.close()
    assert (run.layout.micro_batch, run.layout.grad_accum) == (12, 1)  # all 12 sequences at once
    extra = headroom.first_step_bytes(run.cfg, run.model, CPU, run.autocast_dtype, run.info)
    room = headroom.Room(extra(5, 32), "the RAM the kernel reports available, MemAvailable")
    monkeypatch.setattr(headroom, "host_room", lambda device, info: room)  # room for 5: 4 divides 12
    run = train.setup(config.parse_args([*flags, "--out-dir", str(tmp_path / "tight")]))
    run.close()
    assert (run.layout.micro_batch, run.layout.grad_accum) == (4, 3)


def test_the_timing_probe_runs_only_what_fits(tiny_data, tmp_path, monkeypatch, capsys):
    # Room for one sequence's first step, not for the micro-batch of 4 (its refusal set aside here): the probe
    # times one sequence and scales it.
    monkeypatch.setattr(headroom, "first_step_bytes", lambda *args, **kwargs: linear(1000))
    monkeypatch.setattr(headroom, "host_room", lambda device, info: headroom.Room(1500, "x"))
    monkeypatch.setattr(headroom, "check_first_step", lambda *args: None)
    train.setup(config.parse_args(["--data", tiny_data, *TINY_FLAGS, "--device", "cpu", "--dtype", "fp32",
                                   "--max-steps", "2", "--eval-interval", "0", "--out-dir", str(tmp_path)])).close()
    assert "a 1 x 32-token micro-batch timed, eager, and scaled by FLOPs x4" in capsys.readouterr().out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ulimit -v (RLIMIT_AS) as Linux counts it")
def test_a_preset_under_a_memory_limit_prints_its_table_and_one_line_not_a_kill(tmp_path):
    (tmp_path / "data").mkdir()
    data = write_tiny_shards(tmp_path / "data", train_tokens=(300_000,), val_tokens=40_000)
    limit = 4 * GIB  # torch's import takes under 1 GiB of address space; the preset's first step wants ~19 in bf16

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    result = subprocess.run([sys.executable, "train.py", "--preset", "gpt2-124m", "--data", data, "--vocab-size",
                             "256", "--out-dir", str(tmp_path / "out")], cwd=REPO, preexec_fn=limited,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "  model            116.77M params, 12 layers" in result.stdout and "  plan  " in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(r"error: the first step needs ~[\d.]+ GiB more \(micro-batch 16 x", lines[0])
    assert "left under its address-space limit, ulimit -v" in lines[0] and "Traceback" not in result.stderr


def test_the_cgroup_room_is_the_least_over_the_parents_less_reclaimable_cache(tmp_path, monkeypatch):
    root = tmp_path / "cgroup"
    (proc := tmp_path / "cgroup.txt").write_text("0::/job_7/task_0\n")
    for level, limit, current, cache in [("job_7", 8 * GIB, 7 * GIB, 3 * GIB), ("job_7/task_0", "max", 7 * GIB, 0)]:
        (root / level).mkdir(parents=True)
        (root / level / "memory.max").write_text(f"{limit}\n")
        (root / level / "memory.current").write_text(f"{current}\n")
        (root / level / "memory.stat").write_text(f"anon 1\ninactive_file {cache}\nactive_file 5\n")
    monkeypatch.setattr(headroom, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(headroom, "PROC_CGROUP", str(proc))
    assert headroom._cgroup_room() == 4 * GIB  # the job's limit, on its parent; its page cache is no obstacle
    (proc).write_text("0::/\n")
    assert headroom._cgroup_room() is None  # the root has no memory.max


def test_ulimits_are_each_process_own_and_the_ranks_agree_on_the_least_room(tmp_path, monkeypatch):
    monkeypatch.setattr(headroom, "cpu_room", lambda: [headroom.Room(8 * GIB, "the RAM the kernel reports "
                                                                                 "available, MemAvailable"),
                                                       headroom.Room(5 * GIB, "left under its address-space limit, "
                                                                              "ulimit -v")])
    assert headroom.free_room(CPU, local_ranks=2).bytes == 4 * GIB  # MemAvailable is shared: 4 each
    assert headroom.free_room(CPU).bytes == 5 * GIB
    spawn_on_gloo(_agree_on_room, 2, tmp_path)


def _agree_on_room(rank, world_size):
    import distributed

    headroom.free_room = lambda device, ranks: headroom.Room((rank + 1) * GIB, f"rank {rank}'s")
    room = headroom.host_room(CPU, distributed.DistInfo(mode="ddp", rank=rank, world_size=world_size))
    assert room == headroom.Room(GIB, "rank 0's" if rank == 0 else "the least room of the run's ranks")


def test_a_run_refused_at_start_up_leaves_the_earlier_runs_log_as_it_was(tiny_data, tmp_path, monkeypatch, capsys):
    flags = ["--data", tiny_data, *TINY_FLAGS, "--eval-interval", "0", "--out-dir", str(tmp_path), "--max-steps", "4",
             "--ckpt-interval", "2", "--keep-ckpts", "2"]
    train.main(flags)
    checkpoint.remove(checkpoint.checkpoint_path(str(tmp_path), 4, sharded=False))  # a resume starts at step 2
    before = (tmp_path / "metrics.jsonl").read_text()

    def refuse(*args):
        raise UsageError("the first step needs ~9 GiB more (refused for this test)")

    monkeypatch.setattr(headroom, "check_first_step", refuse)
    for again in (["--overwrite"], ["--max-steps", "6", "--resume"]):
        with pytest.raises(SystemExit) as e:
            train.main([*flags, *again])
        assert e.value.code == 2 and "refused for this test" in capsys.readouterr().err
        assert (tmp_path / "metrics.jsonl").read_text() == before  # neither emptied nor cut back to step 2
