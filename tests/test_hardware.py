"""hardware.py: the TF32 decision, which the start-up table reports and bench/ladder.py's fp32 rung relies on."""

import pytest
import torch

import config
import hardware


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
