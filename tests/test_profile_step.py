"""bench/profile_step.py: the pure parts (categories, busy time, phases) directly, and the whole profile of a
tiny step on the CPU, whose table must account for the profiled wall time."""

import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from conftest import REPO, TINY_FLAGS

sys.path.insert(0, os.path.join(REPO, "bench"))
import profile_step  # noqa: E402


@pytest.mark.parametrize("name, phase, category", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "forward", "GEMM"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT", "backward", "GEMM"),
    ("aten::mm", "forward", "GEMM"),
    ("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "forward", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "backward", "attention"),
    ("triton_red_fused__log_softmax_exp_sub_0", "forward", "loss"),
    ("aten::scatter_add_", "forward", "loss"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_3", "forward", "norm/elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "backward",
     "norm/elementwise"),
    ("Memcpy DtoD (Device -> Device)", "other", "copies"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "backward", "communication"),
    ("void multi_tensor_apply_kernel<FusedAdamMathFunctor>", "other", "optimizer"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "optimizer", "optimizer"),  # Newton-Schulz
])
def test_kernel_category_reads_names_and_gives_the_optimizer_phase_everything(name, phase, category):
    assert profile_step.kernel_category(name, phase) == category


def test_busy_time_counts_overlapping_kernels_once():
    assert profile_step.busy_us([]) == 0
    assert profile_step.busy_us([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25
    assert profile_step.busy_us([(20, 30), (0, 10)]) == 20


def test_phase_at_is_the_range_holding_the_time_and_backward_after_a_forward():
    ranges = [(30, 40, "optimizer"), (0, 10, "forward"), (-5, -1, "data")]
    assert [profile_step.phase_at(t, ranges) for t in (-9, -3, 0, 10, 10.2, 29, 35, 41)] == \
        ["other", "data", "forward", "forward", "backward", "backward", "optimizer", "other"]
    # on a GPU the loop's thread launches a little of the backward itself: the autograd thread's kernels follow
    with_backward = [*ranges, (10.5, 11, "backward")]
    assert [profile_step.phase_at(t, with_backward) for t in (10.7, 20)] == ["backward", "backward"]


def event(name, device, start, end, annotation=False, self_us=0.0):
    """The fields of torch.profiler's FunctionEvent that work_items reads."""
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           is_user_annotation=annotation, self_cpu_time_total=self_us)


def test_cuda_work_is_every_kernel_in_its_gpu_phase_range_and_no_annotation():
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [event("phase:forward", cpu, 0, 5, annotation=True), event("phase:forward", cuda, 10, 20, True),
              event("phase:optimizer", cuda, 40, 45, True), event("Optimizer.step#AdamW.step", cuda, 40, 45, True),
              event("aten::mm", cpu, 1, 2, self_us=1.0), event("gemm_fwd", cuda, 11, 15),
              event("gemm_bwd", cuda, 25, 30), event("adam_kernel", cuda, 41, 44), event("Memcpy HtoD", cuda, 2, 3)]
    assert profile_step.work_items(events, cuda=True) == [
        ("gemm_fwd", "forward", 4, 11, 15), ("gemm_bwd", "backward", 5, 25, 30),
        ("adam_kernel", "optimizer", 3, 41, 44), ("Memcpy HtoD", "other", 1, 2, 3)]
    assert profile_step.work_items(events, cuda=False) == [("aten::mm", "forward", 1.0, 1, 2)]


def test_attribute_sums_by_category_and_phase_and_keeps_names_apart_by_category():
    items = [("aten::mm", "forward", 4.0, 0, 4), ("aten::mm", "optimizer", 2.0, 10, 12),
             ("aten::add", "forward", 1.0, 4, 5)]
    by_cell, by_name, busy = profile_step.attribute(items, cuda=False)
    assert by_cell == {("GEMM", "forward"): 4.0, ("optimizer", "optimizer"): 2.0,
                       ("norm/elementwise", "forward"): 1.0}
    assert by_name[("aten::mm", "GEMM")] == (1, 4.0) and by_name[("aten::mm", "optimizer")] == (1, 2.0)
    assert busy == 7.0
    assert profile_step.attribute([*items, ("k", "forward", 3.0, 1, 4)], cuda=True)[2] == 7.0  # [1, 4] overlaps


def test_profile_of_a_tiny_cpu_step_accounts_for_its_wall_time(tiny_data, tmp_path, capsys):
    out = str(tmp_path / "profile.md")
    profile_step.main(["--steps", "2", "--warmup-steps", "1", "--windows", "1", "--steps-per-window", "1",
                       "--out", out, "--data", tiny_data, *TINY_FLAGS, "--optimizer", "muon"])
    text = open(out).read()
    assert text in capsys.readouterr().out
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    for category in ("GEMM", "attention", "optimizer", "idle (nothing running)", "step (wall, profiled)"):
        assert category in rows, category
    ms = lambda row: float(rows[row].split(" | ")[-2])  # noqa: E731
    parts = sum(ms(row) for row in rows if row in (*profile_step.CATEGORIES, "idle (nothing running)"))
    assert parts == pytest.approx(ms("step (wall, profiled)"), rel=0.02, abs=0.05)
    assert float(rows["optimizer"].split(" | ")[4]) > 0  # the optimizer phase's own column
    assert re.search(r"unprofiled: [\d,]+ tokens/s", text)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_of_a_cuda_step_attributes_kernels_to_their_launching_phase(tiny_data, tmp_path):
    out = str(tmp_path / "profile.md")
    profile_step.main(["--steps", "2", "--warmup-steps", "2", "--windows", "1", "--steps-per-window", "1",
                       "--out", out, "--data", tiny_data, *TINY_FLAGS, "--device", "cuda", "--dtype", "bf16"])
    text = open(out).read()
    assert "GPU kernel time" in text
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    forward, backward, optimizer = (float(rows["GEMM"][i]) for i in (2, 3, 4))
    assert forward > 0 and backward > 0 and optimizer == 0  # AdamW launches no GEMM
    assert float(rows["optimizer"][4]) > 0
    assert sum(float(rows[c][-2]) for c in profile_step.CATEGORIES if c in rows) <= \
        float(rows["step (wall, profiled)"][-2]) * 1.01
