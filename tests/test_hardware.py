"""hardware.py: the TF32 decision, which the start-up table reports and bench/ladder.py's fp32 rung relies on."""

import subprocess
import sys

import pytest
import torch

import config
import hardware
from cli import UsageError
from conftest import REPO


@pytest.mark.parametrize("device, requested, precision, reason", [
    ("cuda", True, "high", "on (fp32 matmuls on TF32"),
    ("cuda", False, "highest", "off (--no-tf32"),
    ("cpu", True, None, "off (cpu has no TF32)"),
    ("mps", False, None, "off (mps has no TF32)"),
])
def test_tf32_is_its_own_decision(device, requested, precision, reason):
    chosen, line = hardware.tf32_decision(torch.device(device), requested)
    assert chosen == precision and line.startswith(reason)


def test_tf32_flag_defaults_on_and_turns_off():
    assert config.parse_args([]).speed.tf32 is True
    assert config.parse_args(["--no-tf32"]).speed.tf32 is False


def test_set_tf32_leaves_a_cpu_process_alone():
    before = torch.get_float32_matmul_precision()
    assert hardware.set_tf32(torch.device("cpu"), True) == "off (cpu has no TF32)"
    assert torch.get_float32_matmul_precision() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_tf32_really_runs_fp32_matmuls_on_cuda():
    a = torch.randn(512, 512, device="cuda")
    exact = (a.double() @ a.double()).float()
    errors = {}
    for requested in (False, True):
        hardware.set_tf32(torch.device("cuda"), requested)
        errors[requested] = ((a @ a) - exact).abs().max().item()
    hardware.set_tf32(torch.device("cuda"), True)
    assert errors[False] < errors[True] / 10  # TF32 keeps 10 mantissa bits, fp32 23


@pytest.mark.parametrize("flags, speedup, chosen, reason", [
    ({"avx2"}, None, None, "fp32 (auto: this CPU has no native bf16"),
    ({"avx512_bf16", "avx2"}, 2.5, torch.bfloat16, "bf16 autocast (auto: CPU has avx512_bf16; a 1024x1024 bf16 "
                                                   "matmul ran 2.5x fp32's rate)"),
    ({"amx_bf16"}, 1.1, None, "fp32 (auto: CPU has amx_bf16; a 1024x1024 bf16 matmul ran 1.1x fp32's rate, under"),
])
def test_cpu_picks_bf16_only_when_detected_and_measured_faster(flags, speedup, chosen, reason):
    def probe():
        assert speedup is not None, "probed a CPU without native bf16"
        return speedup

    dtype, line = hardware.cpu_bf16_decision(flags, probe)
    assert dtype == chosen and line.startswith(reason)


def test_the_cpu_decision_is_what_this_machine_detects():
    dtype, reason = hardware.resolve_dtype("auto", torch.device("cpu"))
    assert (dtype is torch.bfloat16) == reason.startswith("bf16") and "auto" in reason
    assert hardware.resolve_dtype("fp32", torch.device("cpu"))[0] is None  # what determinism tests pin


FAULTS_OF_FREED_BLOCKS = """
import resource, sys, torch
import hardware
if sys.argv[1] == "keep":
    assert hardware.keep_freed_memory(torch.device("cpu"))
for _ in range(12):  # the heap grows until freed blocks fit the aligned requests
    torch.ones(64 * 2**20 // 4)  # 64 MiB, allocated, written and freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.ones(64 * 2**20 // 4)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_cpu_run_reuses_freed_large_blocks_instead_of_faulting_them_in_again():
    faults = {how: int(subprocess.run([sys.executable, "-c", FAULTS_OF_FREED_BLOCKS, how], cwd=REPO, check=True,
                                      capture_output=True, text=True).stdout) for how in ("default", "keep")}
    pages = 5 * 64 * 2**20 // 4096
    assert faults["default"] > pages / 2, faults  # glibc maps each 64 MiB block anew...
    assert faults["keep"] < pages / 20, faults  # ...unless freed blocks stay in the heap
    assert not hardware.keep_freed_memory(torch.device("meta"))  # a no-op off the CPU


PEAK_OF_A_CHILD = """
import subprocess, sys
held = bytearray(1024 * 2**20)  # the parent's peak: 1 GiB, written and freed before the child starts
del held
child = "import torch, hardware; print(hardware.peak_memory_gib(torch.device('cpu')))"
print(subprocess.run([sys.executable, "-c", child], check=True, capture_output=True, text=True).stdout)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_a_cpu_peak_is_the_process_own_not_the_peak_of_the_process_that_started_it():
    """A run started by a large process (a test runner, a notebook) reports its own peak resident set."""
    peak = float(subprocess.run([sys.executable, "-c", PEAK_OF_A_CHILD], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout)
    assert 0.05 < peak < 0.75, peak  # the child imports torch: a few hundred MiB, never the parent's 1 GiB


def test_bf16_on_a_cpu_without_native_bf16_is_warned():
    assert "bf16 is emulated" in hardware.cpu_bf16_warning("bf16", "cpu", {"avx2", "fma"})
    assert hardware.cpu_bf16_warning("bf16", "cpu", {"avx2", "avx512_bf16"}) is None
    assert hardware.cpu_bf16_warning("auto", "cpu", {"avx2"}) is None  # auto decides by itself
    assert hardware.cpu_bf16_warning("bf16", "cuda", set()) is None


def test_activation_dtype_needs_bf16_autocast_and_the_precision_row_says_which_stream_runs():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert hardware.activation_dtype("fp32", torch.bfloat16, cuda) is None
    assert hardware.activation_dtype("bf16", torch.bfloat16, cpu) == torch.bfloat16
    for resolved in (None, torch.float16):  # --dtype auto that chose fp32; fp16 on a GPU
        with pytest.raises(UsageError, match="^--activation-dtype bf16 runs between bf16 autocast's GEMMs, and this"):
            hardware.activation_dtype("bf16", resolved, cuda)
    assert hardware.describe_precision("fp32 (requested)", None, None, "auto") == "fp32 (requested)"
    assert hardware.describe_precision("bf16 autocast (requested)", torch.bfloat16, torch.bfloat16, "bf16") == (
        "bf16 autocast (requested); activations bf16 end to end (--activation-dtype bf16)")
    assert hardware.describe_precision("bf16 autocast (requested)", None, torch.bfloat16, "auto").endswith(
        "activations fp32 between the GEMMs (--activation-dtype auto)")


def test_activation_dtype_auto_is_bf16_only_under_bf16_autocast_on_cuda():
    """A GPU's elementwise kernels gain from half the bytes; a CPU pays for converting bf16 operands."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert hardware.activation_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert hardware.activation_dtype("auto", torch.bfloat16, cpu) is None
    for resolved in (None, torch.float16):  # no autocast, or fp16's: never an error under auto
        assert hardware.activation_dtype("auto", resolved, cuda) is None


@pytest.mark.parametrize("requested, name", [("fp32", "fp32"), ("bf16", "bf16 autocast")])
def test_precision_name_is_the_choice_a_reason_names_without_the_why(requested, name):
    assert hardware.precision_name(hardware.resolve_dtype(requested, torch.device("cpu"))[1]) == name
    assert hardware.precision_name("fp32 (auto: CPU has avx512_bf16; a bf16 matmul ran 0.5x)") == "fp32"
