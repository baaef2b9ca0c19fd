"""Whether the first step fits the memory the process may still take (RAM, ulimit, cgroup).

Whether a run's first step fits in the memory this process may still take, asked at start-up once the model
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
error in a single process is caught and the step retried smaller (loop.shrink_micro_batch), and --batch-size
auto probes the GPU itself. The ranks of a run agree on the least room (host_room), so they decide alike.
"""

import os
import resource
from typing import NamedTuple

import torch

import batch
import distributed
import fp8
import memory
from cli import UsageError, plural
from model import ModelConfig

GIB = 2**30
CGROUP_ROOT, PROC_CGROUP = "/sys/fs/cgroup", "/proc/self/cgroup"  # where Linux shows a process's cgroup limits


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


def _proc_bytes(path: str, field: str) -> int | None:
    """A size in kB from a /proc file of `field: N kB` lines (MemAvailable, VmSize, VmData), in bytes."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _inactive_file(stat_path: str, key: str) -> int:
    """Page cache the kernel reclaims before it kills (memory.stat's inactive_file): counted in a cgroup's
    usage, but no obstacle to a run."""
    try:
        with open(stat_path) as f:
            return next((int(line.split()[1]) for line in f if line.split()[0] == key), 0)
    except (OSError, ValueError, IndexError):
        return 0


def _cgroup_room() -> int | None:
    """The least of memory.max less the working set (memory.current less inactive page cache) over this
    process's cgroup (v2) and its parents, where the limit may sit (a Slurm job's, a systemd slice's), or the v1
    equivalents; None without a limit."""
    try:
        with open(PROC_CGROUP) as f:
            path = next((line.rstrip("\n").split(":", 2)[2] for line in f if line.startswith("0::")), None)
    except (OSError, IndexError):
        path = None
    levels = []
    while path is not None:
        base = f"{CGROUP_ROOT}{path.rstrip('/')}"
        levels.append((f"{base}/memory.max", f"{base}/memory.current", f"{base}/memory.stat", "inactive_file"))
        path = None if path in ("", "/") else os.path.dirname(path.rstrip("/"))
    v1 = f"{CGROUP_ROOT}/memory/memory"
    levels.append((f"{v1}.limit_in_bytes", f"{v1}.usage_in_bytes", f"{v1}.stat", "total_inactive_file"))
    rooms = []
    for limit_file, used_file, stat_file, key in levels:
        limit, used = _read_int(limit_file), _read_int(used_file)
        if limit is not None and used is not None and limit < 2**60:  # v1 writes "no limit" as a huge number
            rooms.append(max(limit - used + _inactive_file(stat_file, key), 0))
    return min(rooms, default=None)


def cpu_room() -> list[Room]:
    """Every limit on what this process may still allocate in RAM that can be read here (Linux)."""
    found = []
    if (available := _proc_bytes("/proc/meminfo", "MemAvailable")) is not None:
        found.append(Room(available, "the RAM the kernel reports available, MemAvailable"))
    for limit, field, name in ((resource.RLIMIT_AS, "VmSize", "address-space limit, ulimit -v"),
                               (resource.RLIMIT_DATA, "VmData", "data-segment limit, ulimit -d")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY and (used := _proc_bytes("/proc/self/status", field)) is not None:
            found.append(Room(max(soft - used, 0), f"left under its {name}"))
    if (cgroup := _cgroup_room()) is not None:
        found.append(Room(cgroup, "left under its cgroup's memory.max"))
    return found


def free_room(device: torch.device, local_ranks: int = 1) -> Room | None:
    """What this process may still allocate on device: the least of cpu_room's limits, the host-wide ones
    (MemAvailable, the cgroup's) shared by the `local_ranks` processes of the run on this host, the
    per-process ones (ulimit) not; on CUDA the GPU's free memory. None where unknown."""
    if device.type == "cuda":
        return Room(torch.cuda.mem_get_info(device)[0], "free on the GPU")
    rooms = [room if "ulimit" in room.why or local_ranks == 1 else
             Room(room.bytes // local_ranks, f"{room.why}, a share of {local_ranks} ranks on this host")
             for room in cpu_room()]
    return min(rooms, key=lambda r: r.bytes, default=None)


def step_bytes(model_cfg: ModelConfig, batch_size: int, seq_len: int, optimizer: str, act_ckpt: str,
               autocast_dtype: torch.dtype | None, device_type: str, shards: int, loss_chunk: int,
               state_restored: bool, stream_dtype: torch.dtype | None = None) -> int:
    """Bytes the first step adds to a process that holds the model already (and, after a resume, the
    optimizer's state): the gradients, the optimizer's state, one micro-batch's activations and transients,
    and on a CPU the allocator's share of all the tensors (memory.estimate_memory); stream_dtype: the residual
    stream's (model.GPT.activation_dtype)."""
    e = memory.estimate_memory(model_cfg, batch_size, seq_len, optimizer, act_ckpt, autocast_dtype, device_type,
                               shards, runtime=0, loss_chunk=loss_chunk, stream_dtype=stream_dtype)
    return e.total - e.params - (e.optimizer if state_restored else 0)


def largest_fitting(room: int, extra) -> int:
    """The largest micro-batch b (sequences, at most 2**20) with extra(b) <= room, 0 when not even one fits:
    memory.largest_fitting_batch's doubling and bisection, over arithmetic."""
    return memory.largest_fitting_batch(lambda b: extra(b) <= room, 2**20)


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
                                             state_restored, model.activation_dtype)


def host_room(device: torch.device, info) -> Room | None:
    """free_room for this rank (the ranks of a run on one host share its RAM), agreed across ranks: the least
    of theirs, so that every rank takes the same micro-batch and refuses alike. Every rank must call it."""
    ranks = (distributed.env_int("LOCAL_WORLD_SIZE", 1) or 1) if info.mode != "none" else 1
    room = free_room(device, ranks)
    if info.mode == "none":
        return room
    unknown = 2**62
    mine = torch.tensor(room.bytes if room is not None else unknown, device=device)
    least = int(distributed.min_across_ranks(mine, info).item())
    if least >= unknown:
        return None
    return room if room is not None and room.bytes == least else Room(least, "the least room of the run's ranks")


def auto_micro_batch(cfg, model, device: torch.device, autocast_dtype: torch.dtype | None, info) -> int:
    """--batch-size auto off CUDA: the largest micro-batch whose first step (first_step_bytes) fits the room
    (all the step's sequences where the room is unknown) that divides the sequences each rank trains on per
    step and is a multiple of FP8's (fp8.batch_multiple); UsageError when none does."""
    seq_len, room = cfg.model.max_seq_len, host_room(device, info)
    per_rank, multiple = batch.per_rank_sequences(cfg, info.world_size), fp8.batch_multiple(cfg.fp8, seq_len)
    extra = first_step_bytes(cfg, model, device, autocast_dtype, info)
    fitting = per_rank if room is None else min(per_rank, largest_fitting(room.bytes, lambda b: extra(b, seq_len)))
    micro = memory.micro_batch_for(per_rank, fitting, multiple)
    if micro == 0 and (room is None or fitting):
        raise UsageError(f"--batch-size auto: no micro-batch of up to {plural(fitting, 'sequence')} that is a "
                         f"multiple of {multiple} divides the step's {per_rank:,} sequences: change --total-batch-tokens")
    if micro == 0:
        raise UsageError("--batch-size auto: " + fit_problem(extra(1, seq_len), room, 1, seq_len, 0, 0, True))
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
    retry = ("an out-of-memory step is retried at half the micro-batch" if layout.world_size == 1 else
             "with several ranks an out-of-memory step is not retried")
    return f"warning: {problem} (eager's estimate: a compiled step saves less; {retry})"
