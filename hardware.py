"""The machine: which device and precision to run on, and what it can do (peak FLOP/s, peak memory).

Every entry point (train.py, sample.py, bench/) asks here, so a device or dtype means the same thing
everywhere. Each decision comes back with its reason, for the start-up table: detected, never assumed.
"""

import ctypes
import functools
import os
import platform
import sys
import time
from contextlib import contextmanager, nullcontext

import torch

from cli import UsageError

# glibc's malloc hands every allocation above its mmap threshold (32 MiB at most, by default) fresh pages from
# the kernel and unmaps them on free. A CPU step allocates and frees blocks of hundreds of MiB each micro-step
# (one loss chunk's float32 logits at GPT-2's vocabulary: 1024 x 50,304 x 4 bytes = 196 MiB), and left to
# that default each micro-step page-faults them in anew, in system time (docs/performance.md measures it).
# With both thresholds at 1 GiB, freed blocks stay in the heap for the next micro-step instead.
GLIBC_MMAP_THRESHOLD = GLIBC_TRIM_THRESHOLD = 2**30
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (glibc's malloc.h)
CPU_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}
CPU_PROBE_SIZE = 1024
CPU_BF16_MIN_SPEEDUP = 1.3
# Dense bf16 tensor-core peak per GPU, from the vendors' datasheets. MFU is always quoted
# against this number (the llm.c / PaLM convention), whatever dtype the run uses.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "4090": 165e12,
}


def resolve_device(requested: str) -> tuple[torch.device, str]:
    """-> (torch.device, reason). auto: CUDA, then Apple MPS, then the CPU."""
    has_mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), f"auto: CUDA {torch.cuda.get_device_name()}"
        if has_mps:
            return torch.device("mps"), "auto: Apple MPS (no CUDA)"
        return torch.device("cpu"), "auto: no CUDA or MPS found"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available to this torch build")
    if requested == "mps" and not has_mps:
        raise UsageError("--device mps: MPS is not available")
    return torch.device(requested), "requested"


def keep_freed_memory(device: torch.device) -> bool:
    """On a Linux CPU run, keep freed large blocks in glibc's heap for reuse (see GLIBC_MMAP_THRESHOLD); ->
    whether it applies. Results are unchanged; the process's resident memory stays at its peak. Elsewhere
    (CUDA, whose caching allocator already reuses blocks; macOS; a C library without mallopt) a no-op."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                 GLIBC_TRIM_THRESHOLD))


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_name() -> str:
    """The CPU's model name, its cores and whether it has native bf16, for a benchmark table's heading."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    bf16 = "native bf16" if cpu_flags() & CPU_BF16_FLAGS else "no native bf16"
    return f"{name}, {os.cpu_count()} cores, {bf16}"


@functools.lru_cache(maxsize=None)
def cpu_bf16_speedup(size: int = CPU_PROBE_SIZE, repeats: int = 3) -> float:
    """fp32 time over bf16 time of one size x size matmul on this CPU, best of `repeats` each (a ~0.2 s probe,
    once per process): native bf16 instructions are only worth using if the GEMM library really uses them."""
    def best(dtype):
        a = torch.randn(size, size).to(dtype)
        a @ a  # warm-up: thread pool, kernel selection
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(torch.float32) / best(torch.bfloat16)


def cpu_bf16_decision(flags: set[str], speedup) -> tuple[torch.dtype | None, str]:
    """--dtype auto on a CPU: bf16 autocast when the CPU has native bf16 (avx512_bf16 or AMX) and a probe
    matmul confirms it is at least CPU_BF16_MIN_SPEEDUP x faster than fp32; speedup() runs that probe, only
    when the flags allow. Pure apart from calling speedup."""
    native = sorted(flags & CPU_BF16_FLAGS)
    if not native:
        return None, "fp32 (auto: this CPU has no native bf16: neither avx512_bf16 nor amx_bf16)"
    measured = speedup()
    found = f"CPU has {', '.join(native)}; a {CPU_PROBE_SIZE}x{CPU_PROBE_SIZE} bf16 matmul ran {measured:.1f}x fp32's rate"
    if measured < CPU_BF16_MIN_SPEEDUP:
        return None, f"fp32 (auto: {found}, under {CPU_BF16_MIN_SPEEDUP}x)"
    return torch.bfloat16, f"bf16 autocast (auto: {found})"


def cpu_bf16_warning(requested: str, device_type: str, flags: set[str]) -> str | None:
    """A start-up warning for --dtype bf16 on a CPU without native bf16, where autocast emulates it (about 50x
    slower than fp32 on an AVX2 machine of this project's), or None. Pure."""
    if requested != "bf16" or device_type != "cpu" or flags & CPU_BF16_FLAGS:
        return None
    return ("warning: --dtype bf16 on a CPU without native bf16 (neither avx512_bf16 nor amx_bf16): bf16 is "
            "emulated, far slower than fp32; use --dtype fp32 (or auto, which chooses)")


def resolve_dtype(requested: str, device: torch.device) -> tuple[torch.dtype | None, str]:
    """-> (autocast dtype, or None for plain fp32, reason)."""
    if requested == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            cap = torch.cuda.get_device_capability()
            return torch.bfloat16, f"bf16 autocast (auto: CUDA sm{cap[0]}{cap[1]} supports bf16)"
        if device.type == "cpu":
            return cpu_bf16_decision(cpu_flags(), cpu_bf16_speedup)
        return None, f"fp32 (auto: {device.type} has no fast bf16 path we trust)"
    if requested == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UsageError("--dtype bf16: this GPU does not support bf16; use fp16")
        return torch.bfloat16, "bf16 autocast (requested)"
    if requested == "fp16":
        if device.type == "cpu":
            raise UsageError("--dtype fp16 needs a GPU; use bf16 or fp32 on CPU")
        return torch.float16, "fp16 autocast + GradScaler (requested)"
    return None, "fp32 (requested)"


def precision_name(reason: str) -> str:
    """The choice a resolve_dtype reason names ("fp32", "bf16 autocast", ...), without its why in parentheses:
    what runs made by different processes or CPUs are compared on."""
    return reason.split(" (", 1)[0]


def activation_dtype(requested: str, autocast_dtype: torch.dtype | None, device: torch.device) -> torch.dtype | None:
    """--activation-dtype as model.GPT.activation_dtype: None keeps the residual stream float32 (autocast's own);
    bf16 runs it in bf16. auto is bf16 under bf16 autocast on CUDA, where the stream's elementwise kernels move
    half the bytes (gpt2-124m's step 1.04x as fast on an H200: bench/results/gpu_check_20261130), and float32
    elsewhere: a CPU converts each bf16 operand to float32 and back (the default model at 0.98x the tokens/s with
    native bf16, bench/results/activation_dtype_speed_cpu.md; emulated without). UsageError for bf16 where the
    run's autocast is not bf16."""
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" and autocast_dtype == torch.bfloat16 else None
    if requested == "fp32":
        return None
    if autocast_dtype != torch.bfloat16:
        raise UsageError("--activation-dtype bf16 runs between bf16 autocast's GEMMs, and this run has none "
                         "(--dtype resolved to fp32 or fp16): leave --activation-dtype auto or fp32")
    return torch.bfloat16


def describe_precision(dtype_reason: str, activation: torch.dtype | None, autocast_dtype, requested: str) -> str:
    """The start-up table's precision row: the autocast dtype and why, and under autocast the residual stream's."""
    if autocast_dtype is None:
        return dtype_reason
    stream = "bf16 end to end" if activation == torch.bfloat16 else "fp32 between the GEMMs"
    return f"{dtype_reason}; activations {stream} (--activation-dtype {requested})"


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch's autocast to `dtype` for a forward pass, or a no-op for plain fp32 (dtype None)."""
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


@contextmanager
def forward_context(device: torch.device, dtype: torch.dtype | None, fp8_context=None):
    """For a forward pass only, never the backward: autocast(device, dtype) and, inside it, fp8_context where
    one is given (fp8.fp8_context: Transformer Engine's FP8 autocast under --fp8 te)."""
    with autocast(device, dtype), fp8_context or nullcontext():
        yield


def tf32_decision(device: torch.device, requested: bool) -> tuple[str | None, str]:
    """-> (torch.set_float32_matmul_precision's argument, or None to leave it alone; the start-up table's
    line). Only CUDA has TF32; "highest" is set explicitly when it is off, because the setting is
    process-wide and one process may build several runs (bench/ladder.py)."""
    if device.type != "cuda":
        return None, f"off ({device.type} has no TF32)"
    if requested:
        return "high", "on (fp32 matmuls on TF32 tensor cores, 10-bit mantissa; --no-tf32 for true fp32)"
    return "highest", "off (--no-tf32: fp32 matmuls in true fp32)"


def set_tf32(device: torch.device, requested: bool) -> str:
    """Apply tf32_decision; -> the start-up table's line. Under bf16 autocast it touches only what autocast
    leaves in fp32."""
    precision, reason = tf32_decision(device, requested)
    if precision is not None:
        torch.set_float32_matmul_precision(precision)
    return reason


def peak_flops(device: torch.device, override_tflops: float) -> tuple[float | None, str]:
    """-> (peak FLOP/s or None, reason)."""
    if override_tflops:
        return override_tflops * 1e12, f"{override_tflops:g} TFLOP/s (--peak-tflops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name()
        for key, flops in PEAK_BF16_FLOPS.items():
            if key in name:
                return flops, f"{flops / 1e12:g} TFLOP/s dense bf16 ({name} datasheet)"
        return None, f"unknown peak for {name}; set --peak-tflops"
    return None, f"no datasheet peak for {device.type}; set --peak-tflops"


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory so far: allocated by tensors on CUDA; the process's peak resident set elsewhere. On Linux
    that is /proc/self/status's VmHWM, this program's own: getrusage's ru_maxrss also counts the process it was
    spawned from, whose peak the kernel carries over into a child started by vfork (as Python's subprocess does)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024 / 2**30
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    import resource  # POSIX only: imported here so that Windows can still import this module

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB on Linux
    return peak * (1 if sys.platform == "darwin" else 1024) / 2**30


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a host clock measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def fused_adamw_available(device_type: str) -> bool:
    """Whether torch has a fused AdamW kernel for this device, found by stepping a one-element probe."""
    probe = torch.zeros(1, device=device_type, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    try:
        torch.optim.AdamW([probe], fused=True).step()
    except (RuntimeError, NotImplementedError):
        return False
    return True
