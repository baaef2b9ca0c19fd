"""Data parallelism under torchrun: process-group set-up, DDP and FSDP2 wrapping, small collectives.

Everything here is PyTorch's own distributed engine (torch.distributed, DDP, fully_shard); there is no
home-made communication layer. A run without torchrun is world size 1 and touches none of it.
"""

import gc
import logging
import os
import re
import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from cli import LAUNCH_ENV, UsageError, first_line, report_error


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    mode: str = "none"  # none | ddp | fsdp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_int(name: str, low: int, high: int | None = None, bound: str = "") -> int | None:
    """Environment variable `name` as an integer in [low, high) (no upper end when high is None), None when it is
    unset or empty; otherwise UsageError naming it and its value. bound names high in the message (WORLD_SIZE)."""
    text = os.environ.get(name)
    if not text:
        return None
    value = int(text) if re.fullmatch(r"[+-]?[0-9]+", text.strip()) else None
    if value is not None and value >= low and (high is None or value < high):
        return value
    rule = f"in [{low}, {bound}) = [{low}, {high})" if bound else f"in [{low}, {high})"
    rule = "a positive integer" if high is None else rule
    raise UsageError(f"{name} must be {rule}, got {text!r}")


def world_size() -> int:
    """The WORLD_SIZE a launcher set (checked), 1 without one."""
    return env_int("WORLD_SIZE", 1) or 1


def check_launch(mode: str) -> str | None:
    """A one-line problem with how the run was launched, or None; UsageError for a malformed variable. RANK or
    WORLD_SIZE without the rest of LAUNCH_ENV is a hand-set environment that no rank 0 or rendezvous store
    stands behind: init would fail on it (a KeyError, or a wait for ranks that never come)."""
    size = world_size()
    if os.environ.get("WORLD_SIZE"):
        for name in ("RANK", "LOCAL_RANK"):
            env_int(name, 0, size, "WORLD_SIZE")
    if mode != "none":
        env_int("MASTER_PORT", 1, 65536)
    given = [name for name in ("RANK", "WORLD_SIZE") if os.environ.get(name)]
    missing = [name for name in LAUNCH_ENV if not os.environ.get(name)]
    if given and missing == ["LOCAL_RANK"] and (mode != "none" or size > 1):  # srun and other launchers
        return ("LOCAL_RANK is not set: a launcher other than torchrun must set it too, each process's rank on its "
                "node (under srun, LOCAL_RANK=$SLURM_LOCALID)")
    if given and missing and (mode != "none" or size > 1):
        return (f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} set but not {', '.join(missing)}: "
                f"start each rank with torchrun, e.g. {torchrun_example(size, mode)}, or unset {' and '.join(given)}"
                f"{'' if mode == 'none' else ' and pass --dist none'} to train in one process")
    if mode == "none" and size > 1:
        return f"launched with {size} processes but --dist none; pass --dist ddp or --dist fsdp"
    if mode != "none" and not given:
        return f"--dist {mode} needs torchrun, e.g. {torchrun_example(2, mode)}"
    return None


def torchrun_example(size: int, mode: str) -> str:
    """A torchrun command for advice: one node's worth of ranks (a world spread over nodes needs --nnodes too)."""
    return f"torchrun --nproc_per_node={min(max(size, 2), 8)} train.py --dist {'ddp' if mode == 'none' else mode} ..."


def init(mode: str, device_type: str, timeout_s: float = 600.0) -> DistInfo:
    """Join the process group torchrun describes (NCCL on CUDA, gloo on CPU); world size 1 without it. A
    collective that waits timeout_s for another rank fails (lost_rank tells such an error), so that a rank that
    hung is not waited for forever (gloo's own default is 30 minutes); so does the rendezvous (join)."""
    if mode == "none":
        return DistInfo()
    if problem := check_launch(mode):
        raise UsageError(problem)
    size = world_size()
    rank, local_rank = (env_int(name, 0, size, "WORLD_SIZE") for name in ("RANK", "LOCAL_RANK"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    join("nccl" if device_type == "cuda" else "gloo", mode, rank, size, timeout_s)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=size, mode=mode)


def join(backend: str, mode: str, rank: int, size: int, timeout_s: float) -> None:
    """init_process_group; a rendezvous that fails within timeout_s (the ranks were not all started, or not
    together) is a UsageError naming MASTER_ADDR:MASTER_PORT. Every rank prints its own such line: rank 0
    reports its start-up errors for all (cli.report_startup_error), but this one is each rank's alone."""
    timeout, where = timedelta(seconds=timeout_s), f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store = attempt_store(size, timeout)
        if store is None and rank != 0 and (why := master_absent(timeout_s)):
            raise dist.DistNetworkError(why)
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    except dist.DistError as error:
        line = (f"rank {rank} of {size} did not meet the other ranks at MASTER_ADDR:MASTER_PORT {where} within "
                f"--collective-timeout {timeout_s:g}s ({first_line(error)}): start all {size} together, e.g. "
                f"{torchrun_example(size, mode)}, or unset RANK and WORLD_SIZE and pass --dist none to train in "
                f"one process")
        if rank != 0:
            report_error(line)
        raise UsageError(line) from None


def master_absent(timeout_s: float) -> str | None:
    """Why MASTER_ADDR:MASTER_PORT accepted no connection within timeout_s, or None once it does. A rank other
    than 0 waits here rather than in init_process_group, whose TCPStore client logs a C++ traceback at every
    failed attempt."""
    deadline, why = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
                                     timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            return None
        except OSError as error:
            why = error.strerror or first_line(error)
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    return f"nothing answered: {why}" if why else "nothing answered"


def attempt_store(world_size: int, timeout: timedelta):
    """The store the ranks meet in, its keys apart for each attempt torchrun starts (--max-restarts), or None
    outside torchrun's own store. Workers share the agent's store across restarts, and the process group's
    keys (each rank's address) do not name the attempt: a restarted rank could read a dead rank's address and
    fail to connect (seen on gloo)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def lost_rank(error: BaseException, info: DistInfo) -> str | None:
    """The one line for an error that a collective raised because another rank is gone (killed, crashed) or
    hung past --collective-timeout, else None. gloo and NCCL report these as RuntimeErrors of their own
    wording (torch's DistError where it wraps them). A rank that stopped on an error of its own left it in the
    store (report_stop): the line quotes it, since launching again would meet it again."""
    if info.mode == "none" or not isinstance(error, RuntimeError):
        return None
    text = str(error)
    if not isinstance(error, dist.DistError) and not any(word in text for word in LOST_RANK_WORDS):
        return None
    why = re.sub(r"^\[[^\]]*\] ", "", first_line(error)).split(". ")[0][:160]  # gloo's source location, then why
    if left := errors_left(info):
        rank, line = left[0]
        return f"rank {info.rank} lost the other ranks in a collective ({why}): rank {rank} stopped first: {line}"
    return (f"rank {info.rank} lost the other ranks in a collective ({why}): another rank died or "
            f"hung (torchrun's summary names it); every checkpoint on disk is whole: launch again with --resume "
            f"(a restart script, a scheduler or torchrun --max-restarts: --resume auto)")


def report_stop(error: BaseException, info: DistInfo, every_rank: bool) -> None:
    """The one line of a run stopped by an error it can name. Rank 0 prints it. Another rank prints it with its
    rank and leaves it in the process group's store, where rank 0, which meets the rank's absence in its next
    collective, reads it (lost_rank); unless every rank stops on it together (every_rank), which rank 0's line
    says once for all."""
    if info.is_main:
        report_error(error)
    elif not every_rank:
        report_error(f"rank {info.rank}: {error}")
        leave_error(str(error))


def leave_error(line: str) -> None:
    """Put this rank's error line in the process group's store (nothing before the group is set up)."""
    if not dist.is_initialized():
        return
    try:
        dist.distributed_c10d._get_default_store().set(f"{RANK_ERROR_KEY}{dist.get_rank()}", line)
    except Exception:  # the store's host is gone too: the line is on this rank's stderr
        pass


def errors_left(info: DistInfo) -> list[tuple[int, str]]:
    """(rank, line) of each other rank that left its error in the store (leave_error)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        keys = {rank: f"{RANK_ERROR_KEY}{rank}" for rank in range(info.world_size) if rank != info.rank}
        return [(rank, store.get(key).decode()) for rank, key in keys.items() if store.check([key])]
    except Exception:  # no store to read (its host went with the lost rank): the plain line
        return []


# Where a rank's error line waits for rank 0 in the process group's store (each torchrun attempt has its own).
RANK_ERROR_KEY = "pretrain/rank_error/"
# What gloo's and NCCL's errors say when a peer is gone or silent.
LOST_RANK_WORDS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out",
                   "timed out", "Timeout", "NCCL communicator was aborted", "ProcessGroupNCCL")


def shutdown(info: DistInfo) -> None:
    """Leave the process group. The caller drops its models first: DDP's autograd hooks hold its reducer,
    and through it gloo's worker threads, in a reference cycle; left to interpreter exit, that cycle is
    freed after Python is half torn down and aborts the process about one time in ten on gloo (SIGABRT,
    "terminate called without an active exception"). Collecting it here frees it while Python is whole."""
    if info.mode != "none" and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.mode != "none":
        dist.barrier()


def mean_across_ranks(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The mean of a scalar tensor over ranks (for logging: each rank saw different tokens)."""
    if info.mode == "none":
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / info.world_size


def min_across_ranks(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.mode == "none":
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return value


def any_across_ranks(flag: bool, info: DistInfo, device: torch.device) -> bool:
    """True on every rank if it is True on any (a signal may reach the ranks at different steps)."""
    if info.mode == "none":
        return flag
    value = torch.tensor(float(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def broadcast_object(obj, info: DistInfo):
    """Rank 0's value of a picklable object, on every rank."""
    if info.mode == "none":
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def apply_ddp(model: torch.nn.Module, info: DistInfo, device: torch.device, bucket_mb: float) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [info.local_rank] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_mb)


def fsdp_block_policy(param_dtype: torch.dtype | None):
    """The blocks' mixed precision: parameters all-gathered in param_dtype (bf16) for compute, gradients
    reduced in fp32; forward inputs are NOT cast (FSDP2 casts them by default), so the residual stream and
    the RoPE tables stay fp32, as under DDP and on one device, where autocast casts only at the matmuls."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def apply_fsdp(model: torch.nn.Module, blocks: torch.nn.ModuleList, param_dtype: torch.dtype | None,
               reshard_after_forward: bool) -> torch.nn.Module:
    """fully_shard each transformer block, then the root (embedding, final norm, lm_head), in place.

    Parameters stay fp32 (the optimizer's master copy). With param_dtype set (the autocast dtype) the blocks
    compute with it (fsdp_block_policy); the root keeps fp32, so the embedding writes an fp32 residual stream
    and autocast casts the lm_head at its matmul, exactly as without FSDP, for the price of all-gathering the
    root in fp32. reshard_after_forward applies to the blocks; the root keeps PyTorch's default, which holds
    it unsharded from forward to backward, since backward starts with it. Each block asks for the next
    block's all-gather during forward and the previous one's during backward, so communication overlaps
    compute instead of waiting for the implicit prefetch.
    """
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=fsdp_block_policy(param_dtype))
    fully_shard(model)
    for prev, nxt in zip(blocks[:-1], blocks[1:]):
        prev.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([prev])
    return model


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to max_norm and return the global norm; under FSDP2 the norm of the sharded grads is reduced."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def set_grad_sync(model: torch.nn.Module, info: DistInfo, enabled: bool):
    """Context for one micro-step: gradients are reduced across ranks only when `enabled` (the last one)."""
    if info.mode == "ddp" and not enabled:
        return model.no_sync()
    if info.mode == "fsdp":
        model.set_requires_gradient_sync(enabled)
    return nullcontext()


def parallelize(model: torch.nn.Module, info: DistInfo, device: torch.device, autocast_dtype: torch.dtype | None,
                cfg, compile_mode: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Wrap the model for training -> (wrapped, compiled). The order is fixed here, torchtitan's:

        1. FP8 (train.build_model)           swaps modules, so every later wrapper sees the FP8 GEMMs
        2. activation checkpointing (memory)  wraps blocks; --batch-size auto probes after this, before 3
        3. DDP or FSDP2 (here)                DDP wraps the root; FSDP2 shards each block, then the root
        4. torch.compile (here)               compiles the wrapped module, so it traces the collectives too

    `wrapped` is what DDP's no_sync and FSDP2's gradient-sync switch act on; `compiled` is what the forward
    calls. cfg: config.DistConfig. fullgraph=False: TE modules are dynamo-disabled, so each one is a graph
    break, not an error.
    """
    wrapped = model
    if info.mode == "ddp":
        wrapped = apply_ddp(model, info, device, cfg.ddp_bucket_mb)
    elif info.mode == "fsdp":
        wrapped = apply_fsdp(model, model.blocks, autocast_dtype, cfg.reshard_after_forward)
    if compile_mode == "off":
        return wrapped, wrapped
    if device.type != "cuda":  # inductor's C++ build helpers warn of a CUDA_HOME that a CPU run never uses
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    return wrapped, torch.compile(wrapped, mode=None if compile_mode == "default" else compile_mode, fullgraph=False)
