"""memory.py: activation checkpointing changes memory, never gradients or names; the estimate matches what
autograd actually saves (measured with saved-tensor hooks) and what the optimizers actually allocate."""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

import loss
import memory
import train
from cli import UsageError
from config import ACT_CKPT_MODES, SpeedConfig
from model import GPT, QWEN3_VALUES, ModelConfig
from optim import OptimConfig, build_optimizer, canonical_name, optimizer_state_bytes
from sizing import param_numels

CFG = ModelConfig(vocab_size=256, n_layer=3, n_head=4, n_kv_head=2, n_embd=64, max_seq_len=32)
# A second shape: untied, head_dim set explicitly, an explicit ffn_dim, an odd number of layers.
CFG2 = ModelConfig(vocab_size=1000, n_layer=5, n_head=6, n_kv_head=2, n_embd=96, head_dim=32, ffn_dim=320,
                   max_seq_len=48, tie_embeddings=False)
B = 2
LOOK_BACK = {"smear": True, "bigram_embed": 512, "embed_skips": True}  # the toggles that read the previous token


def batch(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (B, cfg.max_seq_len), generator=g),
            torch.randint(0, cfg.vocab_size, (B, cfg.max_seq_len), generator=g))


def model_with(cfg, mode):
    torch.manual_seed(0)
    return memory.apply_activation_checkpointing(GPT(cfg), mode)


# ----------------------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("mode", ["full", "selective", "alternate"])
def test_checkpointing_gives_the_same_loss_and_gradients(mode):
    idx, targets = batch(CFG)
    reference, model = model_with(CFG, "none"), model_with(CFG, mode)
    _, loss_ref = reference(idx, targets)
    _, loss = model(idx, targets)
    loss_ref.backward()
    loss.backward()
    assert loss.item() == loss_ref.item()
    grads = {canonical_name(n): p.grad for n, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("mode", ACT_CKPT_MODES)
def test_checkpointing_keeps_state_dict_names_and_the_optimizer_groups(mode):
    model = model_with(CFG2, mode)
    plain = model_with(CFG2, "none")
    assert list(model.state_dict()) == list(plain.state_dict())
    GPT(CFG2).load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(plain.state_dict(), strict=True)
    optimizer = build_optimizer(model, OptimConfig(name="muon"), model.row_blocks(), "cpu")
    names = sorted(n for g in optimizer.param_groups for n in g["names"])
    assert names == sorted(n for n, _ in plain.named_parameters())


def test_checkpointing_wraps_the_modules_its_mode_names():
    def described(mode):
        return memory.describe_activation_checkpointing(model_with(CFG2, mode))

    assert described("none") == "off"
    assert described("full") == "on, non-reentrant: every block of 5 recomputed in backward"
    assert described("alternate") == "on, non-reentrant: blocks 0, 2, 4 of 5 recomputed in backward"
    assert described("selective") == "on, non-reentrant: the MLP of 5 of 5 blocks recomputed in backward"
    with pytest.raises(ValueError, match="unknown activation checkpointing mode 'some'"):
        memory.apply_activation_checkpointing(GPT(CFG), "some")


# ----------------------------------------------------------------------------- the estimate vs measurements


def test_size_checks_cost_nothing_whatever_the_depth():
    """10**20 layers are estimated and refused at once: one layer's sizes times n_layer, no walk (the count
    itself: tests/test_model.py)."""
    one, two, huge = (dataclasses.replace(CFG2, n_layer=n) for n in (1, 2, 10**20))
    for size in (functools.partial(memory.optimizer_state_bytes_estimate, optimizer=name)
                 for name in ("adamw", "adamw8bit", "muon")):
        assert size(huge) == size(one) + (10**20 - 1) * (size(two) - size(one))
    with pytest.raises(UsageError, match=r"this model needs [\d,.]+ GiB for its parameters"):
        memory.check_fits(huge, "adamw", torch.device("cpu"))


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "muon"])
def test_optimizer_state_estimate_matches_the_allocated_state(name):
    cfg = ModelConfig(vocab_size=1000, n_layer=2, n_head=4, n_kv_head=2, n_embd=128, max_seq_len=16)
    model = GPT(cfg)
    optimizer = build_optimizer(model, OptimConfig(name=name), model.row_blocks(), "cpu")
    idx, targets = batch(cfg)
    model(idx, targets)[1].backward()
    optimizer.step()
    estimate = memory.optimizer_state_bytes_estimate(cfg, name)
    assert estimate == pytest.approx(optimizer_state_bytes(optimizer), rel=1e-3)  # step counters aside


@pytest.mark.parametrize("dtype, stream", [(None, None), (torch.bfloat16, None), (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "bf16", "bf16-stream"])
@pytest.mark.parametrize("mode", ACT_CKPT_MODES)
@pytest.mark.parametrize("cfg", [CFG, CFG2], ids=["tied", "untied"])
@pytest.mark.parametrize("architecture", [{}, QWEN3_VALUES, {"mlp": "relu2"}, LOOK_BACK],
                         ids=["default", "qwen3", "relu2", "look-back"])
def test_activation_estimate_is_within_10_percent_of_saved_tensor_bytes(cfg, architecture, mode, dtype, stream):
    """Under bf16 autocast with the stream in float32 or in bf16 (--activation-dtype), whose checkpointed blocks
    keep bf16 inputs."""
    cfg = dataclasses.replace(cfg, **architecture)
    idx, targets = batch(cfg)
    model = model_with(cfg, mode)
    model.activation_dtype = stream
    measured = memory.saved_tensor_bytes(model, idx, targets, dtype)
    estimated, _ = memory.activation_bytes(cfg, B, cfg.max_seq_len, mode, dtype, "cpu", stream)
    assert estimated == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("toggle", LOOK_BACK)
def test_what_a_look_back_toggle_adds_to_the_saved_bytes_is_estimated(toggle, dtype):
    """The toggles' own bytes, too small to show within the whole step's 10%: each one's delta, within 10%."""
    on = dataclasses.replace(CFG, **{toggle: LOOK_BACK[toggle]})
    idx, targets = batch(CFG)
    measured = [memory.saved_tensor_bytes(model_with(c, "none"), idx, targets, dtype) for c in (CFG, on)]
    estimated = [memory.activation_bytes(c, B, CFG.max_seq_len, "none", dtype, "cpu")[0] for c in (CFG, on)]
    assert estimated[1] - estimated[0] == pytest.approx(measured[1] - measured[0], rel=0.10, abs=64)


def test_each_mode_saves_what_it_promises():
    idx, targets = batch(CFG2)
    saved = {mode: memory.saved_tensor_bytes(model_with(CFG2, mode), idx, targets) for mode in ACT_CKPT_MODES}
    assert saved["full"] < saved["alternate"] < saved["none"]
    assert saved["full"] < saved["selective"] < saved["none"]


def test_estimate_totals_and_sharding():
    cfg = dataclasses.replace(CFG2, **QWEN3_VALUES)  # SwiGLU's block: recomputing it outweighs the loss chunk
    one = memory.estimate_memory(cfg, 4, 48, "adamw", "none", torch.bfloat16, "cuda")
    n = sum(param_numels(cfg).values())
    assert (one.params, one.grads, one.optimizer) == (4 * n, 4 * n, 8 * n)
    four = memory.estimate_memory(cfg, 4, 48, "adamw", "full", torch.bfloat16, "cuda", shards=4)
    assert four.params == one.params // 4 and four.optimizer == one.optimizer // 4
    assert four.activations < one.activations and four.transient > one.transient
    assert one.total == one.params + one.grads + one.optimizer + one.activations + one.transient
    assert one.transient == memory.loss_chunk_bytes(cfg, 4 * 48, 2)  # no recompute: the loss chunk is the peak


def test_the_loss_chunk_grows_only_past_max_loss_chunks_chunks():
    gpt2 = ModelConfig(n_layer=12, n_head=12, n_kv_head=12, n_embd=768, max_seq_len=1024)
    per_chunk = {b: memory.loss_chunk_bytes(gpt2, b * 1024, 2) for b in (1, 16, 64)}
    logits = 1024 * gpt2.padded_vocab_size * (2 + 4)  # bf16 and float32 logits of 1,024 tokens
    assert per_chunk[1] == per_chunk[16] == logits + 2 * gpt2.padded_vocab_size * 768
    assert per_chunk[64] == 4 * logits + 2 * gpt2.padded_vocab_size * 768  # 16 chunks of 4,096 tokens


GPT2_124M = ModelConfig(n_layer=12, n_head=6, n_kv_head=3, n_embd=768, head_dim=128, max_seq_len=1024)


@pytest.mark.parametrize("gpu, most_chunks", [("h100", 1), ("a100-40gb", 2), ("rtx4090", 4), ("l4", 4)])
def test_a_gpu_with_room_runs_gpt2s_loss_in_few_chunks_within_its_share_of_memory(gpu, most_chunks):
    capacity, _ = memory.TARGET_GPUS[gpu]
    chunk = memory.loss_chunk_tokens(GPT2_124M, torch.bfloat16, capacity)
    assert loss.loss_chunks(16 * 1024, chunk) <= most_chunks
    assert chunk * memory.loss_bytes_per_token(GPT2_124M, 2) <= capacity // memory.LOSS_CHUNK_SHARE
    assert memory.loss_chunk_bytes(GPT2_124M, 16 * 1024, 2, chunk) > memory.loss_chunk_bytes(GPT2_124M, 16 * 1024, 2)


def test_the_loss_chunk_is_sized_by_memory_on_a_cpu_too_small_under_fp16_or_without_a_capacity_and_a_request_wins():
    h100, _ = memory.TARGET_GPUS["h100"]
    small = loss.LOSS_CHUNK_TOKENS
    ram = 24 * 2**30  # a CPU's RAM is its capacity: the default micro-batch (16 x 128) in one chunk
    assert memory.loss_chunk_tokens(ModelConfig(), None, ram) >= 16 * 128
    assert memory.loss_chunk_tokens(GPT2_124M, torch.float16, h100) == small
    assert memory.loss_chunk_tokens(GPT2_124M, torch.bfloat16, None) == small
    assert memory.loss_chunk_tokens(GPT2_124M, torch.bfloat16, 2**20) == small  # a tiny budget: the floor
    assert memory.loss_chunk_tokens(GPT2_124M, None, h100) < \
        memory.loss_chunk_tokens(GPT2_124M, torch.bfloat16, h100)  # fp32 logits take more per token
    assert memory.loss_chunk_tokens(GPT2_124M, torch.bfloat16, h100, requested=512) == 512
    assert memory.loss_chunk_tokens(GPT2_124M, None, None, requested=4096) == 4096


def test_configure_sets_the_models_loss_chunk_and_the_table_describes_it():
    model = GPT(CFG2)
    memory.configure(model, SpeedConfig(loss_chunk_tokens=64), torch.device("cpu"), None)
    assert model.loss_chunk_tokens == 64
    assert memory.describe_loss_path(model, 4 * 48) == (
        "fused lm_head + cross-entropy in 3 chunks of about 64 tokens per micro-batch (--loss-chunk-tokens: 64 "
        "a chunk)")
    memory.configure(model, SpeedConfig(), torch.device("cpu"), None)
    assert model.loss_chunk_tokens == memory.loss_chunk_tokens(CFG2, None, memory.device_capacity_bytes(
        torch.device("cpu")))


def test_estimate_memory_flag_prints_every_mode_and_builds_nothing(monkeypatch, capsys):
    def no_setup(*_):
        raise AssertionError("--estimate-memory must not build the run")

    monkeypatch.setattr(train, "setup", no_setup)
    monkeypatch.setattr(train, "GPT", no_setup)  # train.build_model builds every training model
    train.main(["--estimate-memory", "--act-ckpt", "full", "--optimizer", "muon", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "optimizer muon" in out
    for mode in ACT_CKPT_MODES:
        assert f"| {mode}" in out
    assert "| full (selected) |" in out


def test_the_cpu_estimate_counts_the_process_and_the_allocator_a_gpu_estimate_does_not():
    cpu = memory.estimate_memory(CFG2, 4, 48, "adamw", "none", None, "cpu", runtime=300 * 2**20)
    assert cpu.runtime == 300 * 2**20 and cpu.allocator == int(memory.CPU_ALLOCATOR_SHARE * cpu.tensors) > 0
    assert cpu.total == cpu.tensors + cpu.runtime + cpu.allocator
    assert cpu.tensors == cpu.params + cpu.grads + cpu.optimizer + cpu.activations + cpu.transient
    gpu = memory.estimate_memory(CFG2, 4, 48, "adamw", "none", None, "cuda", runtime=300 * 2**20)
    assert gpu.runtime == gpu.allocator == 0 and gpu.total == gpu.tensors
    table = memory.format_memory_estimates({"none": cpu}, "none").splitlines()
    assert table[0] == ("| act-ckpt | params | grads | optimizer | activations | transient | runtime | allocator "
                        "| total |")
    assert table[2].startswith("| none (selected) |") and f"| 0.293 GiB | {cpu.allocator / 2**30:.3f} GiB |" in table[2]
    assert "runtime" not in memory.format_memory_estimates({"none": gpu}, "none")


# The estimate against a run's measured peak: within this factor either way. Measured 0.88x to 1.14x on a quiet
# machine (memory.py), and up to 1.36x beside other work: glibc opens more malloc arenas when threads contend.
CPU_TOLERANCE = 1.5


def test_the_cpu_estimate_is_the_resident_set_a_run_peaks_at(tiny_data, tmp_path):
    """--estimate-memory, then 3 steps of the same flags, in one fresh process (its peak resident set is its own):
    the estimate's total is the peak_mem_gib the run reports, within CPU_TOLERANCE. The tensors (0.23 GiB) are
    about as large as the process's runtime here, so an estimate without either falls outside."""
    flags = ["--vocab-size", "256", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2", "--n-embd", "256",
             "--seq-len", "256", "--batch-size", "16", "--data", tiny_data, "--device", "cpu", "--dtype", "fp32"]
    run = ["--max-steps", "3", "--out-dir", str(tmp_path), "--eval-interval", "0", "--ckpt-interval", "0"]
    code = f"import sys, train; train.main(sys.argv[1:] + ['--estimate-memory']); train.main(sys.argv[1:] + {run!r})"
    done = subprocess.run([sys.executable, "-c", code, *flags], cwd=os.path.dirname(os.path.abspath(memory.__file__)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    selected = next(line for line in done.stdout.splitlines() if "(selected)" in line)
    estimate = float(selected.split("|")[-2].split()[0])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    peak = max(r["peak_mem_gib"] for r in records)
    assert 1 / CPU_TOLERANCE < peak / estimate < CPU_TOLERANCE, f"peak {peak:.3f} GiB, estimate {estimate:.3f} GiB"


@pytest.mark.parametrize("text, expected", [
    ("h100", 81559 * 2**20), (" H200 ", 143771 * 2**20), ("80GiB", 80 * 2**30), ("80gib", 80 * 2**30),
    ("80GB", 80 * 10**9), ("24G", 24 * 2**30), ("79.6 GiB", int(79.6 * 2**30)), ("512MiB", 2**29),
    ("1.5TB", 15 * 10**11), ("40Gi", 40 * 2**30)])
def test_parse_target_gpu_reads_names_and_sizes(text, expected):
    assert memory.parse_target_gpu(text)[0] == expected


@pytest.mark.parametrize("text", ["h101", "80", "GB", "-1GB", "0GiB", "nanGB", "infGB", "80XB", "80 gigabytes", ""])
def test_parse_target_gpu_refuses_anything_else_in_one_line(text):
    with pytest.raises(train.UsageError) as e:
        memory.parse_target_gpu(text)
    message = str(e.value)
    assert "\n" not in message and all(name in message for name in memory.TARGET_GPUS) and "80GiB" in message


def test_fit_line_and_the_margin_left_for_the_cuda_context():
    gib = 2**30
    assert memory.fit_line("full", 10 * gib, 12 * gib) == "  full         10.00 GiB  fits, 2.0 GiB headroom"
    assert memory.fit_line("none", 13.5 * gib, 12 * gib).endswith("does not fit: 1.5 GiB over")
    assert memory.usable_bytes(81 * gib) == int(80 * gib * (1 - memory.ALLOCATOR_MARGIN))


def estimate_output(monkeypatch, capsys, *argv) -> str:
    def no_local_device(*_):
        raise AssertionError("--target-gpu must not look at this machine's devices")

    monkeypatch.setattr(train, "setup", no_local_device)
    monkeypatch.setattr(memory.hardware, "resolve_device", no_local_device)
    monkeypatch.setattr(memory.hardware, "resolve_dtype", no_local_device)
    train.main(["--estimate-memory", "--n-layer", "2", "--n-embd", "64", "--n-head", "4", *argv])
    return capsys.readouterr().out


def test_estimate_memory_for_a_target_gpu_needs_no_gpu(monkeypatch, capsys):
    out = estimate_output(monkeypatch, capsys, "--target-gpu", "h100", "--device", "cuda")
    assert "cuda (h100, not this machine), bf16 autocast (auto" in out
    fits = [line for line in out.splitlines() if line.startswith("  ")]
    assert [line.split()[0] for line in fits] == list(ACT_CKPT_MODES)
    assert all("fits," in line and "GiB headroom" in line for line in fits)
    assert "fit on h100 (H100 80GB" in out and "70.8 GiB for training" in out

    out = estimate_output(monkeypatch, capsys, "--target-gpu", "1MiB", "--dtype", "fp32")
    assert "fp32 (requested)" in out and "fit on 1MiB (1MiB of GPU memory)" in out
    assert sum("does not fit:" in line for line in out.splitlines()) == len(ACT_CKPT_MODES)


def test_estimate_memory_target_gpu_mistakes_are_one_line(monkeypatch, capsys):
    for argv, words in ((["--target-gpu", "h1000"], "--target-gpu 'h1000': not a GPU name (h100, h200"),
                        (["--target-gpu", "h100", "--device", "cpu"], "leave out --device cpu")):
        with pytest.raises(SystemExit) as exit_info:
            estimate_output(monkeypatch, capsys, *argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith("error: ") and words in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_estimate_memory_on_cuda_without_a_gpu_points_to_target_gpu(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--estimate-memory", "--device", "cuda"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: --device cuda: no CUDA device") and "pass --target-gpu" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ACT_CKPT_MODES)
@pytest.mark.parametrize("stream", [None, torch.bfloat16], ids=["fp32-stream", "bf16-stream"])
def test_activation_estimate_on_cuda_bf16(mode, stream):
    """On CUDA rms_norm runs ATen's fused kernel, which saves less than the CPU decomposition, and saves a bf16
    stream's input as it is."""
    idx, targets = (t.cuda() for t in batch(CFG2))
    model = model_with(CFG2, mode).cuda()
    model.activation_dtype = stream
    measured = memory.saved_tensor_bytes(model, idx, targets, torch.bfloat16)
    estimated, _ = memory.activation_bytes(CFG2, B, CFG2.max_seq_len, mode, torch.bfloat16, "cuda", stream)
    assert estimated == pytest.approx(measured, rel=0.10)


# ----------------------------------------------------------------------------- --batch-size auto


class ProbedModel(torch.nn.Module):
    """Stands in for the model in auto_batch_size: runs out of CUDA memory above `budget` sequences and
    records each probe's size and whether it ran inside the forward context."""

    def __init__(self, budget):
        super().__init__()
        self.config = ModelConfig(max_seq_len=8)
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.budget, self.probes, self.in_context = budget, [], False

    def forward(self, x, y):
        self.probes.append((x.shape[0], self.in_context))
        if x.shape[0] > self.budget:
            raise torch.cuda.OutOfMemoryError("simulated")
        return None, self.weight * x.shape[0]


def auto(model, per_rank, multiple, reserve=0):
    from contextlib import contextmanager

    @contextmanager
    def forward_context():
        model.in_context = True
        yield
        model.in_context = False

    return memory.auto_batch_size(model, per_rank, multiple, reserve, forward_context, torch.device("cpu"),
                                  train.distributed.DistInfo())


@pytest.mark.parametrize("budget, per_rank, multiple, expected", [
    (37, 64, 1, 32), (37, 64, 2, 32), (37, 48, 4, 24), (37, 96, 16, 32), (15, 96, 16, None), (40, 36, 8, None)])
def test_auto_batch_size_probes_only_fp8_legal_sizes_under_the_forward_context(budget, per_rank, multiple, expected):
    model = ProbedModel(budget)
    if expected is None:
        with pytest.raises(train.UsageError, match="--batch-size auto"):
            auto(model, per_rank, multiple)
    else:
        assert auto(model, per_rank, multiple) == expected
    assert model.probes and all(size % multiple == 0 and inside for size, inside in model.probes)


def test_micro_batch_for_keeps_the_fp8_multiple():
    assert memory.micro_batch_for(96, 40, multiple=16) == 32
    assert memory.micro_batch_for(48, 40, multiple=16) == 16
    assert memory.micro_batch_for(40, 40, multiple=16) == 0  # no multiple of 16 divides 40
    assert memory.micro_batch_for(64, 24) == 16


def test_probe_reserves_the_optimizer_state_and_ddp_buckets():
    n_params = sum(param_numels(CFG).values())
    state = memory.optimizer_state_bytes_estimate(CFG, "adamw")
    assert memory.probe_reserve_bytes(CFG, "adamw", "none") == state
    assert memory.probe_reserve_bytes(CFG, "adamw", "fsdp") == state
    assert memory.probe_reserve_bytes(CFG, "adamw", "ddp") == state + 4 * n_params
    # Muon in one process (a one-rank FSDP2 mesh too) keeps an update buffer beside its momenta; split across
    # ranks it does not.
    muon_one, muon_split = (memory.optimizer_state_bytes_estimate(CFG, "muon", one) for one in (True, False))
    assert memory.probe_reserve_bytes(CFG, "muon", "fsdp", 1) == muon_one > muon_split
    assert memory.probe_reserve_bytes(CFG, "muon", "fsdp", 2) == muon_split


def test_auto_batch_size_says_when_the_layout_leaves_no_fp8_legal_size():
    model = ProbedModel(budget=1000)
    with pytest.raises(train.UsageError, match="more than the 8 each rank trains on per step; raise --total-batch"):
        auto(model, per_rank=8, multiple=16)
    assert model.probes == []


def test_estimate_memory_refuses_an_auto_batch_in_one_line():
    import config
    from cli import UsageError

    cfg = config.parse_args(["--estimate-memory", "--batch-size", "auto", "--total-batch-tokens", "65536",
                             "--target-gpu", "h100"])
    with pytest.raises(UsageError, match="needs a number for --batch-size"):
        memory.memory_report(cfg)


@pytest.mark.parametrize("world_size", ["0", "two"])
def test_estimate_memory_under_fsdp_names_a_bad_world_size(monkeypatch, world_size):
    import config

    monkeypatch.setenv("WORLD_SIZE", world_size)
    cfg = config.parse_args(["--estimate-memory", "--batch-size", "2", "--target-gpu", "h100", "--dist", "fsdp"])
    with pytest.raises(UsageError, match=f"^WORLD_SIZE must be a positive integer, got '{world_size}'$"):
        memory.memory_report(cfg)


def test_a_states_bytes_count_whole_tensors_of_a_nested_state():
    state = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
             "optimizer": {"state": {0: {"step": torch.tensor(1.0), "m": [torch.zeros(5)]}}, "lr": 0.1}}
    assert memory.state_bytes(state) == 4 * 12 + 2 * 2 + 4 + 4 * 5


def test_the_estimate_for_a_gpu_counts_the_bf16_stream_cuda_runs_by_default():
    """--activation-dtype auto is bf16 under a GPU's bf16 autocast: the header says so and the activations are
    what that stream saves, less than the float32 stream's; a run's own estimate reads its model's stream."""
    import config
    import headroom
    from distributed import DistInfo

    flags = ["--estimate-memory", "--batch-size", "4", "--target-gpu", "h100"]
    reports = {stream: memory.memory_report(config.parse_args([*flags, "--activation-dtype", stream]))
               for stream in ("auto", "fp32")}
    assert "bf16 autocast (auto, as on a GPU with bf16), bf16 activations" in reports["auto"]
    assert "bf16 activations" not in reports["fp32"]
    cfg = config.parse_args(["--act-ckpt", "full"])
    model = GPT(cfg.model)
    info = DistInfo(rank=0, local_rank=0, world_size=1, mode="none")
    extra = {}
    for stream in (None, torch.bfloat16):
        model.activation_dtype = stream
        extra[stream] = headroom.first_step_bytes(cfg, model, torch.device("cuda"), torch.bfloat16, info)(4, 128)
    held = 4 * 128 * cfg.model.n_embd * cfg.model.n_layer  # a checkpointed block's input, per element byte
    assert extra[None] - extra[torch.bfloat16] >= 2 * held
