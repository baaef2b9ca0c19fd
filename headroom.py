"""Whether a run's first step fits in the memory this process may still take, asked at start-up once the model
exists and before anything the size of a batch is allocated (the timing probe, the first step).

    room = free_room(device)                                   # Room(bytes, what sets it)
    extra = first_step_bytes(cfg, model, device, dtype, info)  # extra(batch, seq_len): what the first step adds
    check_first_step(cfg, layout, extra, room, multiple, device)   # UsageError naming the micro-batch that fits
    auto_micro_batch(cfg, model, device, autocast_dtype, info)  # --batch-size auto off CUDA

On a CPU a run that outgrows the machine is not told so: the kernel kills it (or, under `ulimit -v`, torch's
allocator fails halfway through a step). So a CPU run whose estimate (memory.estimate_memory, which a small
run's peak resident set meets within 0.88x to 1.14x) exceeds the room is refused in one line, with the largest
micro-batch that fits; the room is the least of the RAM the kernel reports available (MemAvailable), the
process's address-space and data limits, and its cgroup's memory.max, shared by the ranks on the host. On CUDA
the same estimate is only a warning: it is eager's upper bound (torch.compile saves less), a CUDA out-of-memory
error is caught and the step retried smaller (loop.shrink_micro_batch), and --batch-size auto probes the GPU
itself.
"""

import os
import resource
from typing import NamedTuple

import torch

import batch
import fp8
import memory
from cli import UsageError, plural
from model import ModelConfig

GIB = 2**30


class Room(NamedTuple):
    bytes: int
    why: str  # what sets it, for the refusal


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _status_bytes(field: str) -> int | None:
    """A size from /proc/self/status (VmSize, VmData), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """memory.max less memory.current of this process's cgroup (v2), or the v1 equivalents; None without a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            paths = [line.rstrip("\n").split(":", 2)[2] for line in f if line.startswith("0::")]
    except (OSError, IndexError):
        paths = []
    for limit_file, used_file in [(f"/sys/fs/cgroup{p}/memory.max", f"/sys/fs/cgroup{p}/memory.current")
                                  for p in paths] + [("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                                      "/sys/fs/cgroup/memory/memory.usage_in_bytes")]:
        limit, used = _read_int(limit_file), _read_int(used_file)
        if limit is not None and used is not None and limit < 2**60:  # v1 writes "no limit" as a huge number
            return max(limit - used, 0)
    return None


def cpu_room() -> list[Room]:
    """Every limit on what this process may still allocate in RAM that can be read here (Linux)."""
    found = []
    if (available := _meminfo_available()) is not None:
        found.append(Room(available, "the RAM the kernel reports available, MemAvailable"))
    for limit, field, name in ((resource.RLIMIT_AS, "VmSize", "address-space limit, ulimit -v"),
                               (resource.RLIMIT_DATA, "VmData", "data-segment limit, ulimit -d")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY and (used := _status_bytes(field)) is not None:
            found.append(Room(max(soft - used, 0), f"left under its {name}"))
    if (cgroup := _cgroup_room()) is not None:
        found.append(Room(cgroup, "left under its cgroup's memory.max"))
    return found


def free_room(device: torch.device, local_ranks: int = 1) -> Room | None:
    """What this process may still allocate on device: the least of cpu_room's limits, shared by the
    `local_ranks` processes of the run on this host; on CUDA the GPU's free memory. None where unknown."""
    if device.type == "cuda":
        return Room(torch.cuda.mem_get_info(device)[0], "free on the GPU")
    rooms = cpu_room()
    if not rooms:
        return None
    least = min(rooms, key=lambda r: r.bytes)
    if local_ranks > 1:
        return Room(least.bytes // local_ranks, f"{least.why}, a share of {local_ranks} ranks on this host")
    return least


def step_bytes(model_cfg: ModelConfig, batch_size: int, seq_len: int, optimizer: str, act_ckpt: str,
               autocast_dtype: torch.dtype | None, device_type: str, shards: int, loss_chunk: int,
               state_restored: bool) -> int:
    """Bytes the first step adds to a process that holds the model already (and, after a resume, the
    optimizer's state): the gradients, the optimizer's state, one micro-batch's activations and transients,
    and on a CPU the allocator's share of all the tensors (memory.estimate_memory)."""
    e = memory.estimate_memory(model_cfg, batch_size, seq_len, optimizer, act_ckpt, autocast_dtype, device_type,
                               shards, runtime=0, loss_chunk=loss_chunk)
    return e.total - e.params - (e.optimizer if state_restored else 0)


def largest_fitting(room: int, extra) -> int:
    """The largest micro-batch b (sequences) with extra(b) <= room, 0 when not even one fits: a bisection of
    arithmetic (memory.largest_fitting_batch), up to the first size whose estimate alone passes the room."""
    limit = 1
    while extra(limit) <= room and limit < 2**20:
        limit *= 2
    return memory.largest_fitting_batch(lambda b: extra(b) <= room, limit)


def fit_problem(needed: int, room: Room, micro_batch: int, seq_len: int, fitting: int, suggestion: int,
                grad_accum_derived: bool) -> str:
    """The refusal: what the step needs, what the process has, and what fits. Pure."""
    head = (f"the first step needs ~{needed / GIB:.1f} GiB more (micro-batch {micro_batch} x {seq_len:,} tokens: "
            f"gradients, optimizer state, activations; --estimate-memory shows the parts), and this process may "
            f"take {room.bytes / GIB:.1f} GiB more ({room.why})")
    if suggestion:
        keep = "" if grad_accum_derived else " (raise --grad-accum to keep the step's tokens)"
        return f"{head}; --batch-size {suggestion} fits{keep}"
    if fitting:
        return (f"{head}; a micro-batch of up to {plural(fitting, 'sequence')} fits, but none of those sizes "
                f"divides the step's sequences: change --total-batch-tokens")
    return f"{head}; not even one sequence fits: try --act-ckpt full, a smaller --seq-len or a smaller model"


def first_step_bytes(cfg, model, device: torch.device, autocast_dtype: torch.dtype | None, info,
                     state_restored: bool = False):
    """-> extra(batch, seq_len): step_bytes for this run (a config.Config's, its built model's)."""
    shards = info.world_size if info.mode == "fsdp" else 1
    return lambda batch, seq_len: step_bytes(model.config, batch, seq_len, cfg.optim.name, cfg.speed.act_ckpt,
                                             autocast_dtype, device.type, shards, model.loss_chunk_tokens,
                                             state_restored)


def host_room(device: torch.device, info) -> Room | None:
    """free_room for this rank: the ranks of a run on one host share its RAM."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if info.mode != "none" else 1
    return free_room(device, ranks)


def auto_micro_batch(cfg, model, device: torch.device, autocast_dtype: torch.dtype | None, info) -> int:
    """--batch-size auto off CUDA: the largest micro-batch whose first step (first_step_bytes) fits the room
    (all the step's sequences where the room is unknown) that divides the sequences each rank trains on per
    step and is a multiple of FP8's (fp8.batch_multiple); UsageError when none does."""
    seq_len, room = cfg.model.max_seq_len, host_room(device, info)
    per_rank, multiple = batch.per_rank_sequences(cfg, info.world_size), fp8.batch_multiple(cfg.fp8.mode, seq_len)
    extra = first_step_bytes(cfg, model, device, autocast_dtype, info)
    fitting = per_rank if room is None else min(per_rank, largest_fitting(room.bytes, lambda b: extra(b, seq_len)))
    micro = memory.micro_batch_for(per_rank, fitting, multiple)
    if micro == 0:
        raise UsageError("--batch-size auto: " + fit_problem(extra(multiple, seq_len), room, multiple, seq_len,
                                                              fitting, 0, True))
    return micro


def check_first_step(cfg, layout, extra, room: Room | None, multiple: int, device: torch.device) -> str | None:
    """Before the timing probe: UsageError (fit_problem) on a CPU when layout's micro-batch does not fit the
    room; on CUDA the same words as a warning, returned (module docstring); None when it fits."""
    needed = extra(layout.micro_batch, layout.seq_len)
    if room is None or needed <= room.bytes:
        return None
    fitting = largest_fitting(room.bytes, lambda b: extra(b, layout.seq_len))
    derived = bool(cfg.data.total_batch_tokens)
    suggestion = (memory.micro_batch_for(layout.sequences_per_rank, fitting, multiple) if derived
                  else fitting // multiple * multiple)
    problem = fit_problem(needed, room, layout.micro_batch, layout.seq_len, fitting, suggestion, derived)
    if device.type != "cuda":
        raise UsageError(problem)
    return (f"warning: {problem} (eager's estimate: a compiled step saves less, and an out-of-memory step is "
            "retried at half the micro-batch)")
