"""Activation checkpointing, the loss path's chunk size, the memory estimate, --batch-size auto on CUDA.

    apply_activation_checkpointing(model, "selective")        # none | full | selective | alternate
    saved_tensor_bytes(model, idx, targets, torch.bfloat16)   # measured: bytes held for backward
    estimate_memory(cfg, batch_size, seq_len, "adamw", "full", torch.bfloat16, "cuda")  # before allocating
    auto_batch_size(model, ...)                                # --batch-size auto on CUDA: probe the GPU
    memory_report(cfg)                                         # --estimate-memory [--target-gpu h100]

The estimate counts, tensor by tensor, what the plain backend's eager forward saves for backward (the same
tensors saved_tensor_bytes measures; tests/test_memory.py holds the two within 10% of each other). It does
not model torch.compile (whose partitioner chooses what to save, usually less), the TE backend, or FP8
(which saves some GEMM inputs in one byte): read it as the eager bf16 upper bound for those. With
--target-gpu it needs no GPU: a run for an H100 is planned on a laptop, the fit judged against the memory
the driver exposes less a margin (CUDA_CONTEXT_BYTES, ALLOCATOR_MARGIN). On the CPU the device's memory is the
process's resident set, which also holds the process itself (the interpreter, torch and the libraries, measured
by runtime_bytes) and the freed memory the C allocator keeps (CPU_ALLOCATOR_SHARE): the estimate counts both, and
tests/test_memory.py holds a small run's peak resident set within 1.3x of it.
"""

import itertools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

import distributed
import fp8
import hardware
from cli import UsageError, plural
from config import ACT_CKPT_MODES
from loss import LOSS_CHUNK_TOKENS, loss_chunks
from model import ModelConfig
from optim import OPTIMIZERS
from sizing import block_shapes, outer_shapes, param_count

FP32 = 4
INDEX = 8  # int64 token ids and targets
# On CUDA one chunk of the fused loss may take this share of the device's memory (loss_chunk_tokens): gpt2-124m's
# 16 x 1,024 tokens then fit one chunk on an 80 GB card (4.6 GiB of 4.98) and four on a 24 GB one.
LOSS_CHUNK_SHARE = 16
# On the CPU, memory freed during a step stays in the process: train.py keeps freed blocks in glibc's heap for the
# next micro-step (hardware.keep_freed_memory), and the heap fragments, so the resident set peaks above the live
# tensors by about this share of them. Measured as (peak_mem_gib - runtime - tensors) / tensors over 3 steps of
# eager fp32 on an Intel Xeon (2 cores, avx512_bf16), torch 2.13, glibc 2.36: 0.5 to 1.1 for the default run
# (`python train.py --max-steps 3`, repeated), 0.9 to 1.05 for --vocab-size 256 --n-embd 256 --seq-len 256, and
# 0.75 to 0.85 for --vocab-size 8192 --n-embd 128 (both --n-layer 2 --batch-size 16); with 0.8 those runs peaked
# at 0.88x to 1.14x the estimate. Measured on Linux only (elsewhere nothing keeps freed blocks on purpose).
CPU_ALLOCATOR_SHARE = 0.8


# ----------------------------------------------------------------------------- activation checkpointing


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Recompute activations in backward instead of keeping them, in place; non-reentrant.

    full       every block keeps only its input; backward re-runs its forward (about +1/3 step FLOPs).
    alternate  the even-numbered blocks (0, 2, ...) as in full, the others keep everything: about half
               the saving for half the recompute.
    selective  the MLP of every block (norm, fc1, SwiGLU, fc2): it holds over half of a block's saved
               bytes (fc1's output alone is 2 * ffn_dim per token), while attention keeps its tensors; its
               flash kernel saves only q, k, v, the output and the log-sum-exp, so recomputing the attention
               core would free little. Costs one MLP forward per block in backward.

    Blocks (or MLPs) are wrapped in torch's checkpoint_wrapper. State-dict keys do not change: the wrapper
    drops its `_checkpoint_wrapped_module.` prefix on save and restores it on load; named_parameters() of
    the whole model does show it, and optim.canonical_name strips it. TE blocks use TE's checkpoint, which
    recomputes under the same FP8 autocast as the forward (a block's `checkpoint_fn`). Apply after FP8
    conversion and before torch.compile / FSDP2 (torchtitan's order).
    """
    if mode not in ACT_CKPT_MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose one of {', '.join(ACT_CKPT_MODES)}")
    for i, block in enumerate(model.blocks):
        checkpoint_fn = getattr(block, "checkpoint_fn", None)  # a block that needs its own (fp8.TEBlock)
        if mode == "full" or (mode == "alternate" and i % 2 == 0):
            model.blocks[i] = _checkpoint_wrapper(block, checkpoint_fn)
        elif mode == "selective":
            block.mlp = _checkpoint_wrapper(block.mlp, checkpoint_fn)
    return model


def configure(model: nn.Module, speed, device: torch.device, autocast_dtype: torch.dtype | None) -> None:
    """The model's two memory settings (a config.SpeedConfig's): --act-ckpt, and the loss path's tokens per
    chunk (--loss-chunk-tokens, else loss_chunk_tokens from the device's memory)."""
    apply_activation_checkpointing(model, speed.act_ckpt)
    model.loss_chunk_tokens = loss_chunk_tokens(model.config, autocast_dtype, device_capacity_bytes(device),
                                                speed.loss_chunk_tokens)


def _checkpoint_wrapper(module: nn.Module, checkpoint_fn) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    if checkpoint_fn is not None:
        return checkpoint_wrapper(module, checkpoint_fn=checkpoint_fn, use_reentrant=False)
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def describe_activation_checkpointing(model: nn.Module) -> str:
    """The startup-log line, from the wrappers actually in the model."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    blocks = list(model.blocks)
    whole = [i for i, b in enumerate(blocks) if isinstance(b, CheckpointWrapper)]
    mlps = [i for i, b in enumerate(blocks) if isinstance(getattr(b, "mlp", None), CheckpointWrapper)]
    if whole:
        which = "every block" if len(whole) == len(blocks) else "blocks " + ", ".join(map(str, whole))
        return f"on, non-reentrant: {which} of {len(blocks)} recomputed in backward"
    if mlps:
        return f"on, non-reentrant: the MLP of {len(mlps)} of {plural(len(blocks), 'block')} recomputed in backward"
    return "off"


# ----------------------------------------------------------------------------- measurement


def saved_tensor_bytes(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor,
                       autocast_dtype: torch.dtype | None = None) -> int:
    """Bytes autograd holds for backward after one forward of (idx, targets): the distinct storages of every
    tensor saved for backward, except the model's own parameters and buffers (they exist anyway).

    A storage counts once however many views of it are saved. This includes checkpointed blocks' inputs
    (non-reentrant checkpointing saves them through autograd) and, under autocast, the 16-bit weight copies
    the GEMMs save. The graph is freed before returning.
    """
    own = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), hardware.autocast(idx.device, autocast_dtype):
        _, loss = model(idx, targets)
    del loss
    return sum(storages.values())


# ----------------------------------------------------------------------------- estimate


@dataclass
class MemoryEstimate:
    """Bytes per device. activations: held from forward to backward for one micro-batch; transient: the
    larger of the extra bytes of re-running one checkpointed block (or MLP) during backward and those of one
    chunk of the fused loss (loss_chunk_bytes). On the CPU, whose memory is the process's resident set, also
    runtime: what the process holds before the run allocates anything (runtime_bytes), and allocator: the freed
    tensor memory the C allocator keeps rather than returning it (CPU_ALLOCATOR_SHARE of the tensors); both 0
    on a GPU, where fit_report leaves its own margins."""

    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    runtime: int = 0
    allocator: int = 0

    @property
    def tensors(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    @property
    def total(self) -> int:
        return self.tensors + self.runtime + self.allocator


def optimizer_state_bytes_estimate(cfg: ModelConfig, optimizer: str, one_process: bool = True) -> int:
    """Optimizer state of the whole model, as optim.optimizer_state_bytes measures it (step counters aside).
    one_process: a single process's step (not DDP's or FSDP2's split of Muon's work across ranks)."""
    entry = OPTIMIZERS[optimizer]

    def total(shapes):
        return sum(entry.state_bytes(name, math.prod(shape), one_process) for name, shape in shapes.items())

    return entry.shared_state_bytes + total(outer_shapes(cfg)) + cfg.n_layer * total(block_shapes(cfg))


def state_bytes(tree) -> int:
    """Bytes of every tensor in a nested state dict at its full size (a DTensor's whole tensor, not this rank's
    shard): what its checkpoint needs on disk, give or take the files' headers."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(state_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(state_bytes(value) for value in tree)
    return 0


def _norm_bytes(width: int, fused: bool, stream: int = FP32) -> int:
    """An RMSNorm over `width` of the residual stream (`stream` bytes an element): its input and a float32 1/rms;
    unfused (ATen's CPU path decomposes rms_norm, taking a bf16 input to float32 first), the float32 input and
    the normalized input before the weight multiply; fused (CUDA's kernel), the input as it came."""
    return FP32 + (stream * width if fused else 2 * FP32 * width)


def attention_bytes_per_token(cfg: ModelConfig, act: int, fused_norm: bool, stream: int = FP32) -> int:
    """Saved bytes per token of one block's attention half; act is the GEMM dtype's size (2 under 16-bit
    autocast, 4 in fp32), stream the residual stream's (2 under --activation-dtype bf16). Flash-style SDPA: q,
    k, v, the output and a float32 log-sum-exp per head."""
    D, hd, H, K = cfg.n_embd, cfg.resolved_head_dim, cfg.n_head, cfg.n_kv_head
    half_precision_copies = FP32 * (H + K) * hd if act != FP32 else 0  # q.float(), k.float() for QK-norm
    return (_norm_bytes(D, fused_norm, stream)
            + act * D  # qkv GEMM input
            + act * (H + 2 * K) * hd  # qkv output: v, and in fp32 also q and k, are views of it
            + half_precision_copies
            + FP32 * (H + K) + (0 if fused_norm else FP32 * (H + K) * hd)  # QK-norm over head_dim
            + act * (H + K) * hd  # rotated q, k
            + act * H * hd + FP32 * H  # attention output, log-sum-exp
            + act * H * hd  # proj GEMM input
            + (attention_gate_bytes_per_token(cfg, act, stream) if cfg.attn_gate else 0))


def attention_gate_bytes_per_token(cfg: ModelConfig, act: int, stream: int = FP32) -> int:
    """Saved bytes per token of one block's attention gates: the gate GEMM's input, which is the normed input
    the qkv GEMM reads (the same tensor in float32 or a 16-bit stream; from a float32 stream under 16-bit
    autocast each GEMM casts its own copy), and the per-head sigmoid."""
    return (act * cfg.n_embd if act != stream else 0) + act * cfg.n_head


def mlp_bytes_per_token(cfg: ModelConfig, act: int, fused_norm: bool, stream: int = FP32) -> int:
    """Saved bytes per token of one block's MLP: norm, fc1 input, then SwiGLU's fc1 output [gate; up],
    silu(gate) and fc2 input, or ReLU^2's relu(h) and fc2 input (relu keeps its output, not h)."""
    D, F = cfg.n_embd, cfg.resolved_ffn_dim
    fc1_output = act * cfg.fc1_rows if cfg.mlp == "swiglu" else 0
    return _norm_bytes(D, fused_norm, stream) + act * D + fc1_output + act * F + act * F


def head_bytes_per_token(cfg: ModelConfig, act: int, fused_norm: bool, stream: int = FP32) -> int:
    """Token ids, final norm, and the float32 gradient of the lm_head input that loss.linear_cross_entropy
    computes in its forward and keeps (the logits themselves are never kept: see loss_head_bytes); with value
    embeddings, each table's lookup in the stream's dtype, which its layers' scalars keep; with the smear, the float32
    embedding its norm keeps, the gate GEMM's input and the shifted embedding the gate multiplies; with the
    bigram embedding, its rows' indices. Embedding skips keep the first block's input, kept anyway (a CPU's
    unfused norm keeps a float32 copy of a bf16 stream's instead: slightly more)."""
    ve = stream * cfg.value_embeds * cfg.n_kv_head * cfg.resolved_head_dim
    smear = (2 * FP32 + act) * cfg.n_embd if cfg.smear else 0
    bigram = INDEX if cfg.bigram_embed else 0
    return INDEX + _norm_bytes(cfg.n_embd, fused_norm, stream) + FP32 * cfg.n_embd + ve + smear + bigram


def loss_head_bytes(cfg: ModelConfig) -> int:
    """Per micro-batch, whatever its size: the float32 lm_head weight gradient the fused loss keeps."""
    return FP32 * cfg.padded_vocab_size * cfg.n_embd


def act_bytes(autocast_dtype: torch.dtype | None) -> int:
    """Bytes of an activation element: the autocast dtype's, or float32's without autocast."""
    return torch.finfo(autocast_dtype).bits // 8 if autocast_dtype is not None else FP32


def loss_bytes_per_token(cfg: ModelConfig, act: int) -> int:
    """One token's row of a loss chunk: its logits in the GEMM dtype and in float32 (twice in float32 under a
    logit soft-cap: the capped logits and the tanh)."""
    return cfg.padded_vocab_size * (act + (2 if cfg.logit_softcap else 1) * FP32)


def loss_chunk_bytes(cfg: ModelConfig, tokens: int, act: int, chunk_tokens: int = LOSS_CHUNK_TOKENS) -> int:
    """The transient peak of loss.linear_cross_entropy: one chunk's rows (loss_bytes_per_token) and its
    [V, d] weight-gradient GEMM output. Chunks grow with the micro-batch beyond MAX_LOSS_CHUNKS x chunk_tokens
    tokens, so this does too."""
    rows = -(-tokens // loss_chunks(tokens, chunk_tokens))
    return rows * loss_bytes_per_token(cfg, act) + act * cfg.padded_vocab_size * cfg.n_embd


def loss_chunk_tokens(cfg: ModelConfig, autocast_dtype: torch.dtype | None, capacity: int | None,
                      requested: int = 0) -> int:
    """Tokens per chunk of loss.linear_cross_entropy (GPT.loss_chunk_tokens): `requested`
    (--loss-chunk-tokens) when given; else as many as 1/LOSS_CHUNK_SHARE of the device's memory holds (a GPU's,
    or a CPU's RAM), never fewer than LOSS_CHUNK_TOKENS; LOSS_CHUNK_TOKENS where the memory is unknown, or under
    fp16 (each chunk's weight-gradient GEMM sums its rows in fp16, which must stay in range). Few large chunks
    cost less: each chunk reads and writes the float32 [V, d] weight gradient once and launches its own
    kernels, while the memory they take is transient (the forward's end)."""
    if requested:
        return requested
    if capacity is None or autocast_dtype == torch.float16:
        return LOSS_CHUNK_TOKENS
    act = act_bytes(autocast_dtype)
    return max(LOSS_CHUNK_TOKENS, capacity // LOSS_CHUNK_SHARE // loss_bytes_per_token(cfg, act))


def _weight_copies(cfg: ModelConfig, act: int) -> tuple[int, int]:
    """Bytes of the 16-bit weight copies autocast makes and the block GEMMs save: (attention, MLP)."""
    if act == FP32:
        return 0, 0
    D, hd, F = cfg.n_embd, cfg.resolved_head_dim, cfg.resolved_ffn_dim
    attn = act * ((cfg.n_head + 2 * cfg.n_kv_head) * hd * D + cfg.n_head * hd * D
                  + (cfg.n_head * D if cfg.attn_gate else 0))
    return attn, act * (cfg.fc1_rows + F) * D


def activation_bytes(cfg: ModelConfig, batch_size: int, seq_len: int, act_ckpt: str,
                     autocast_dtype: torch.dtype | None, device_type: str,
                     stream_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(bytes saved for backward by one micro-batch's forward, transient bytes of one recomputed region);
    stream_dtype: the residual stream's (model.GPT.activation_dtype), None for float32."""
    if act_ckpt not in ACT_CKPT_MODES:
        raise ValueError(f"unknown activation checkpointing mode {act_ckpt!r}; choose one of {', '.join(ACT_CKPT_MODES)}")
    act, stream = act_bytes(autocast_dtype), act_bytes(stream_dtype)
    fused = device_type == "cuda"
    tokens, L = batch_size * seq_len, cfg.n_layer
    attn = tokens * attention_bytes_per_token(cfg, act, fused, stream)
    mlp = tokens * mlp_bytes_per_token(cfg, act, fused, stream)
    block_input = tokens * stream * cfg.n_embd  # what a checkpointed region keeps: its input
    w_attn, w_mlp = _weight_copies(cfg, act)
    head = tokens * head_bytes_per_token(cfg, act, fused, stream) + loss_head_bytes(cfg)
    full_block = attn + mlp + w_attn + w_mlp
    if act_ckpt == "none":
        return L * full_block + head, 0
    if act_ckpt == "full":
        return L * block_input + head, full_block
    if act_ckpt == "alternate":
        wrapped = math.ceil(L / 2)
        return wrapped * block_input + (L - wrapped) * full_block + head, full_block
    return L * (attn + w_attn + block_input) + head, mlp + w_mlp


def describe_loss_path(model: nn.Module, tokens: int, autocast_dtype: torch.dtype | None = None) -> str:
    """The start-up table's row: the fused lm_head + cross-entropy's chunks for a micro-batch of `tokens` (under
    fp16 their count has no cap: loss._chunked_loss_and_grads)."""
    chunk = model.loss_chunk_tokens
    count = loss_chunks(tokens, chunk, capped=autocast_dtype != torch.float16)
    return (f"fused lm_head + cross-entropy in {count} chunk{'s' if count > 1 else ''} of about "
            f"{-(-tokens // count):,} tokens per micro-batch (--loss-chunk-tokens: {chunk:,} a chunk)")


def estimate_memory(cfg: ModelConfig, batch_size: int, seq_len: int, optimizer: str, act_ckpt: str,
                    autocast_dtype: torch.dtype | None, device_type: str, shards: int = 1,
                    runtime: int = 0, loss_chunk: int = LOSS_CHUNK_TOKENS,
                    stream_dtype: torch.dtype | None = None) -> MemoryEstimate:
    """Training memory per device before anything is allocated: float32 parameters and gradients, the
    optimizer's state, and the activations of one micro-batch; on the CPU also `runtime` (runtime_bytes) and
    the allocator's share. shards: FSDP2 world size (parameters, gradients and optimizer state are split
    across it; activations are not). loss_chunk: the loss path's tokens per chunk (loss_chunk_tokens).
    stream_dtype: the residual stream's (activation_bytes)."""
    n_params = param_count(cfg)
    activations, recompute = activation_bytes(cfg, batch_size, seq_len, act_ckpt, autocast_dtype, device_type,
                                              stream_dtype)
    act = act_bytes(autocast_dtype)
    # Neither outlives its moment (a recomputed region in backward, a loss chunk at the forward's end).
    transient = max(recompute, loss_chunk_bytes(cfg, batch_size * seq_len, act, loss_chunk))
    e = MemoryEstimate(params=FP32 * n_params // shards, grads=FP32 * n_params // shards,
                       optimizer=optimizer_state_bytes_estimate(cfg, optimizer, shards == 1) // shards,
                       activations=activations, transient=transient)
    if device_type == "cpu":
        e.runtime, e.allocator = runtime, int(CPU_ALLOCATOR_SHARE * e.tensors)
    return e


def runtime_bytes() -> int:
    """What this process holds before a run allocates anything, when called then (as --estimate-memory is): the
    interpreter, torch's runtime and the libraries train.py imports. Its resident set now (Linux's
    /proc/self/statm), not its peak so far, which whatever ran before in the process may have raised; the peak
    (hardware.peak_memory_gib) where there is no /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return int(hardware.peak_memory_gib(torch.device("cpu")) * GIB)


def format_memory_estimates(estimates: dict[str, MemoryEstimate], selected: str) -> str:
    """A markdown table: one row per activation-checkpointing mode, the selected one marked; the runtime and
    allocator columns where they count (the CPU)."""
    gib = 2**30
    process = any(e.runtime or e.allocator for e in estimates.values())
    names = ["params", "grads", "optimizer", "activations", "transient", *(["runtime", "allocator"] if process else []),
             "total"]
    lines = ["| act-ckpt | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for mode, e in estimates.items():
        mark = " (selected)" if mode == selected else ""
        cells = [getattr(e, name) for name in names]
        lines.append(f"| {mode}{mark} | " + " | ".join(f"{c / gib:.3f} GiB" for c in cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- --estimate-memory


# --target-gpu names -> (bytes, what they are). The memory the driver exposes (nvidia-smi's total, torch's
# get_device_properties().total_memory), in MiB as nvidia-smi prints it: a little under the datasheet's
# figure, whose "80GB" is 80 GiB of HBM chips (ECC and firmware take their share; GDDR cards with ECC on
# lose more). Where two variants of a card differ, the smaller figure.
MIB, GIB = 2**20, 2**30
TARGET_GPUS = {
    "h100": (81559 * MIB, "H100 80GB, SXM or PCIe: 79.6 of its 80 GiB visible"),
    "h200": (143771 * MIB, "H200 141GB: 140.4 GiB visible"),
    "a100-80gb": (81251 * MIB, "A100 80GB: 79.3 GiB visible (PCIe; SXM4: 80)"),
    "a100-40gb": (40536 * MIB, "A100 40GB: 39.6 GiB visible (PCIe; SXM4: 40)"),
    "l40s": (46068 * MIB, "L40S 48GB: 45.0 GiB visible with ECC on"),
    "l4": (23034 * MIB, "L4 24GB: 22.5 GiB visible"),
    "a10g": (23028 * MIB, "A10G 24GB: 22.5 GiB visible"),
    "rtx4090": (24564 * MIB, "RTX 4090 24GB: 24.0 GiB visible"),
    "rtx3090": (24576 * MIB, "RTX 3090 24GB: 24.0 GiB visible"),
}
# A memory size: a number and a unit. KiB/MiB/GiB/TiB (and a bare K/M/G/T, as Slurm and Docker read them)
# are powers of 1024; kB/MB/GB/TB powers of 1000. Case does not matter.
SIZE_UNITS = {prefix + suffix: base ** power
              for power, prefix in enumerate("kmgt", 1)
              for suffix, base in (("ib", 1024), ("i", 1024), ("", 1024), ("b", 1000))}
# What a fit leaves aside of the GPU's memory: the CUDA context with cuBLAS's workspaces (about 0.5 GiB on an
# H100; NCCL's buffers add to it under DDP and FSDP2), then a share of the rest for the caching allocator's
# fragmentation and the transient tensors (logit chunks, all-gathered FSDP2 parameters) the estimate leaves out.
CUDA_CONTEXT_BYTES = 1 * GIB
ALLOCATOR_MARGIN = 0.10


def parse_target_gpu(text: str) -> tuple[int, str]:
    """--target-gpu: a name of TARGET_GPUS or a memory size ("80GiB", "80GB", "24G") -> (bytes, description).
    UsageError (one line) for anything else."""
    key = text.strip().lower()
    if key in TARGET_GPUS:
        return TARGET_GPUS[key]
    number, unit = key.rstrip("kmgtib"), key[len(key.rstrip("kmgtib")):]
    try:
        size = float(number)
    except ValueError:
        size = math.nan
    if unit in SIZE_UNITS and math.isfinite(size) and size > 0:
        return int(size * SIZE_UNITS[unit]), f"{text.strip()} of GPU memory"
    raise UsageError(f"--target-gpu {text!r}: not a GPU name ({', '.join(TARGET_GPUS)}) or a memory size with "
                     "its unit (80GiB, 80GB, 24G)")


def usable_bytes(capacity: int) -> int:
    """What a training run can hope to allocate on a GPU of this capacity (CUDA_CONTEXT_BYTES, ALLOCATOR_MARGIN)."""
    return int((capacity - CUDA_CONTEXT_BYTES) * (1 - ALLOCATOR_MARGIN))


def fit_line(mode: str, total: int, usable: int) -> str:
    """One --act-ckpt mode's verdict: whether `total` bytes fit in `usable`, and by how much."""
    gap = (usable - total) / GIB
    verdict = f"fits, {gap:.1f} GiB headroom" if gap >= 0 else f"does not fit: {-gap:.1f} GiB over"
    return f"  {mode:<10} {total / GIB:7.2f} GiB  {verdict}"


def fit_report(estimates: dict[str, MemoryEstimate], capacity: int, name: str, description: str) -> list[str]:
    """The lines that say, for each --act-ckpt mode, whether the estimate fits on the target GPU."""
    usable = usable_bytes(capacity)
    return [f"fit on {name} ({description}): {usable / GIB:.1f} GiB for training, after "
            f"{CUDA_CONTEXT_BYTES / GIB:g} GiB for the CUDA context and {ALLOCATOR_MARGIN:.0%} for the allocator",
            *(fit_line(mode, e.total, usable) for mode, e in estimates.items())]


def target_dtype(requested: str) -> tuple[torch.dtype | None, str]:
    """hardware.resolve_dtype for a GPU that is not here: auto is bf16 autocast, as on every GPU of
    TARGET_GPUS; a dtype asked for is taken as it is."""
    if requested in ("auto", "bf16"):
        why = "auto, as on a GPU with bf16" if requested == "auto" else "requested"
        return torch.bfloat16, f"bf16 autocast ({why})"
    if requested == "fp16":
        return torch.float16, "fp16 autocast (requested)"
    return None, "fp32 (requested)"


def report_device(speed) -> tuple[str, torch.dtype | None, str, str]:
    """(device type, autocast dtype, dtype reason, a note) for --estimate-memory: the target GPU's
    (speed.target_gpu, no device check) or this machine's."""
    if speed.target_gpu is not None:
        if speed.device in ("cpu", "mps"):
            raise UsageError(f"--target-gpu plans a CUDA run; leave out --device {speed.device}")
        return ("cuda", *target_dtype(speed.dtype), "")
    hint = "pass --target-gpu (a name such as h100, or a size such as 80GiB) to plan for a GPU this machine lacks"
    try:
        device, _ = hardware.resolve_device(speed.device)
        autocast_dtype, reason = hardware.resolve_dtype(speed.dtype, device)
    except UsageError as e:
        raise UsageError(f"{e}; {hint}") from None
    note = f"No GPU here: {hint}." if speed.device == "auto" and device.type != "cuda" else ""
    return device.type, autocast_dtype, reason, note


CPU_NOTE = [
    "On the CPU the total is the process's peak resident set, which the run reports as peak_mem_gib: the tensors,",
    "runtime (this process's resident set now: Python, torch and the libraries) and allocator (freed memory the",
    f"C allocator keeps for reuse, taken as {CPU_ALLOCATOR_SHARE:.0%} of the tensors, as measured in memory.py).",
]


def memory_report(cfg) -> str:
    """--estimate-memory: the estimate for these flags (a config.Config) under every --act-ckpt mode, and with
    --target-gpu whether each fits on that GPU; builds and allocates nothing, and needs no GPU."""
    if cfg.data.batch_size == "auto":
        raise UsageError("--estimate-memory needs a number for --batch-size (auto is found on the GPU itself); "
                         "try the micro-batch you expect, e.g. --batch-size 16")
    target = parse_target_gpu(cfg.speed.target_gpu) if cfg.speed.target_gpu is not None else None
    device_type, autocast_dtype, dtype_reason, note = report_device(cfg.speed)
    stream = hardware.activation_dtype(cfg.speed.activation_dtype, autocast_dtype, torch.device(device_type))
    model_cfg, batch_size = cfg.model, cfg.data.batch_size
    shards = distributed.world_size() if cfg.dist.dist == "fsdp" else 1
    runtime = runtime_bytes() if device_type == "cpu" else 0
    capacity = target[0] if target else device_capacity_bytes(torch.device(device_type))
    loss_chunk = loss_chunk_tokens(model_cfg, autocast_dtype, capacity, cfg.speed.loss_chunk_tokens)
    estimates = {mode: estimate_memory(model_cfg, batch_size, model_cfg.max_seq_len, cfg.optim.name, mode,
                                       autocast_dtype, device_type, shards, runtime, loss_chunk, stream)
                 for mode in ACT_CKPT_MODES}
    n_params = param_count(model_cfg)
    sharding = f", FSDP2 over {shards} ranks" if shards > 1 else ""
    where = f"cuda ({cfg.speed.target_gpu.strip()}, not this machine)" if target else device_type
    lines = [
        f"memory estimate per device: {n_params / 1e6:.2f}M params, optimizer {cfg.optim.name}, "
        f"micro-batch {batch_size} x {model_cfg.max_seq_len} tokens, {where}, {dtype_reason}"
        f"{', bf16 activations' if stream == torch.bfloat16 else ''}{sharding}",
        "",
        format_memory_estimates(estimates, cfg.speed.act_ckpt),
        "",
        "Activations: what the plain backend's eager forward saves for backward (memory.py); torch.compile and",
        "FP8 usually save less.",
        *(CPU_NOTE if device_type == "cpu" else ["Not counted: the CUDA context, allocator fragmentation, "
                                                 "temporaries."]),
    ]
    if target is not None:
        capacity, description = target
        lines += ["", *fit_report(estimates, capacity, cfg.speed.target_gpu.strip(), description)]
    return "\n".join(lines + (["", note] if note else []))


# ----------------------------------------------------------------------------- the largest batch that fits


def fits_by_trying(attempt, out_of_memory: tuple[type[BaseException], ...]):
    """A "does it fit" callable from an attempt that raises one of `out_of_memory` when it does not."""

    def fits(size: int) -> bool:
        try:
            attempt(size)
            return True
        except out_of_memory:
            return False

    return fits


def largest_fitting_batch(fits, limit: int) -> int:
    """The largest micro-batch size in [1, limit] for which fits(size) is True, assuming fitting is monotone.

    Doubles from 1 until a size fails, then bisects between the last success and that failure, so it asks
    about O(log limit) sizes. Returns 0 when not even 1 fits.
    """
    if limit < 1 or not fits(1):
        return 0
    good, bad = 1, None
    while bad is None and good < limit:
        trial = min(2 * good, limit)
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def micro_batch_for(per_rank: int, fitting: int, multiple: int = 1) -> int:
    """The largest micro-batch that fits, divides the per-rank sequences per step (so the global batch stays
    exact) and is a multiple of `multiple` (fp8.batch_multiple: FP8's token rule); 0 when there is none."""
    return max((b for b in range(multiple, min(fitting, per_rank) + 1, multiple) if per_rank % b == 0), default=0)


def retry_micro_batch(layout, fp8_cfg) -> int:
    """The micro-batch to redo an out-of-memory step with (a batch.BatchLayout's): at most half, FP8-legal,
    dividing the global batch; 0 for none, or with several ranks (one cannot change the layout alone)."""
    multiple = fp8.batch_multiple(fp8_cfg, layout.seq_len)
    smaller = micro_batch_for(layout.sequences_per_rank, layout.micro_batch // 2, multiple)
    return smaller if layout.world_size == 1 else 0


def device_capacity_bytes(device: torch.device) -> int | None:
    """The device's memory: the GPU's, or the machine's RAM for the CPU; None where unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows)
        return None


def check_fits(cfg: ModelConfig, optimizer: str, device: torch.device, shards: int = 1) -> None:
    """UsageError when parameters, gradients, optimizer state and the rotary tables alone exceed the device's
    memory: refused at start-up, not by the allocator halfway through building the model."""
    capacity = device_capacity_bytes(device)
    e = estimate_memory(cfg, 1, cfg.max_seq_len, optimizer, "full", None, device.type, shards)
    fixed = e.params + e.grads + e.optimizer + 2 * FP32 * cfg.max_seq_len * cfg.resolved_head_dim
    if capacity is not None and fixed > capacity:
        raise UsageError(f"this model needs {fixed / 2**30:,.1f} GiB for its parameters, gradients and optimizer "
                         f"state alone; the {device.type} device has {capacity / 2**30:,.1f} GiB "
                         "(--estimate-memory shows the parts)")


def probe_reserve_bytes(cfg: ModelConfig, optimizer: str, dist_mode: str, world_size: int = 1) -> int:
    """Memory a batch-size probe must leave free for what exists only once training runs: the optimizer
    state (allocated at the first step), and under DDP its gradient buckets, a float32 copy of every gradient
    (gradient_as_bucket_view is off) that the probe of the bare model does not allocate. This is the safety
    margin: with more than one rank there is no out-of-memory retry, so a tight fit must be right."""
    buckets = FP32 * param_count(cfg) if dist_mode == "ddp" else 0
    return optimizer_state_bytes_estimate(cfg, optimizer, world_size == 1) + buckets


def auto_batch_size(model: nn.Module, per_rank: int, multiple: int, reserve: int, forward_context,
                    device: torch.device, info: "distributed.DistInfo") -> int:
    """The largest micro-batch that fits in GPU memory, divides `per_rank` (the sequences each rank trains on
    per step) and is a multiple of `multiple` (FP8's token rule).

    Each probe runs a forward (inside forward_context(): the training step's autocast, TE's FP8 one
    included, with fp8.probing's recipe: no collective inside) and a backward at that size while a
    placeholder holds `reserve` bytes (probe_reserve_bytes).
    Probe the bare model (activation checkpointing applied, not yet wrapped): a DDP backward would wait on
    the other ranks. Ranks agree on the smallest answer.
    """
    seq_len = model.config.max_seq_len
    if per_rank < multiple:
        raise UsageError(f"--batch-size auto: FP8 needs micro-batches of a multiple of {multiple} sequences of "
                         f"{seq_len} tokens, more than the {per_rank} each rank trains on per step; raise "
                         "--total-batch-tokens")

    def probe(size):
        placeholder = torch.empty(reserve, dtype=torch.uint8, device=device)
        try:
            x = torch.zeros((size, seq_len), dtype=torch.long, device=device)
            with forward_context():
                _, loss = model(x, x)
            loss.backward()
        finally:
            del placeholder
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    fits = fits_by_trying(probe, (torch.cuda.OutOfMemoryError,))
    fitting = multiple * largest_fitting_batch(lambda units: fits(units * multiple), limit=per_rank // multiple)
    fitting = int(distributed.min_across_ranks(torch.tensor(fitting, device=device), info).item())
    if fitting == 0:
        raise UsageError(f"--batch-size auto: GPU memory holds not even {plural(multiple, 'sequence')} of "
                         f"{seq_len:,} tokens")
    micro = micro_batch_for(per_rank, fitting, multiple)
    if micro == 0:
        raise UsageError(f"--batch-size auto: no micro-batch up to {fitting} that FP8 allows (a multiple of "
                         f"{multiple}) divides the {plural(per_rank, 'sequence')} per rank per step; change "
                         "--total-batch-tokens")
    return micro
