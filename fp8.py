"""FP8 training, two ways: NVIDIA Transformer Engine (TE) modules, or torchao's float8 linears.

    --fp8 te       GPT(config, block=TEBlock): blocks of Transformer Engine modules; each micro-batch's
                   forward runs inside autocast(recipe), its backward outside, and both inside
                   micro_step(model, micro, grad_accum); recipe "current" or "delayed"
    --fp8 torchao  convert_to_torchao_float8(model) on the plain blocks: dynamic scaling, one scale per tensor
                   (recipe "current") or per row (recipe "rowwise")

    recipe = prepare(cfg.fp8, model_cfg, micro_batch, device, autocast_dtype)   # checks, then TE's recipe
    model = build_model(model_cfg, cfg.fp8, device, init_state)               # the blocks these flags want

This is the only file that reads the FP8 settings (FP8Config) and the only one that knows Transformer
Engine: model.py stays plain PyTorch and takes its block class as a parameter. Either way only the block
GEMMs run in FP8; the embedding, the final norm and the lm_head stay in the autocast dtype (bf16).
Parameter names never change, so a checkpoint moves between the paths: torchao and plain share state
dicts; te <-> plain go through te_to_plain_state_dict / plain_to_te_state_dict.

TE needs CUDA even to import, so every TE import here is lazy, and check_fp8_config() refuses an impossible
combination (no GPU, no TE, shapes the FP8 GEMMs or FP8 attention cannot take) with a one-line error before
anything is built.
"""

import importlib.metadata
import importlib.util
import math
import os
import re
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from cli import UsageError
from model import GPT, Block, LayerNormMLP, ModelConfig, RMSNorm, apply_rope, gate_heads
from option import option

FP8_MODES = ("off", "te", "torchao")
FP8_RECIPES = ("current", "delayed", "rowwise")
# Which recipes each path has: TE's current and delayed scaling; torchao's dynamic scaling, one scale per tensor
# ("current", torchao's tensorwise) or per row of each operand (torchao's rowwise).
RECIPES_OF = {"te": ("current", "delayed"), "torchao": ("current", "rowwise")}
# TE reads this at import time (attention/dot_product_attention/dot_product_attention.py). On H100, FP8
# attention trains only with delayed scaling, so with the current-scaling recipe the attention gets its own.
DPA_RECIPE_ENV = "NVTE_DPA_FP8_RECIPE"
FP8_ATTN_HEAD_DIM = 128
# transformer-engine-torch is source-only: with build isolation pip would build it against a fresh torch from
# the index instead of the installed one (TE's own error message gives the same command).
TE_INSTALL_HINT = "pip install --no-build-isolation transformer-engine[pytorch] on a CUDA machine"
# 2.4 is the first release whose modules accept the empty _extra_state that plain_to_te_state_dict supplies.
TE_MIN_VERSION = (2, 4)
# FP8 attention with the current-scaling recipe: before 2.8 Float8CurrentScaling asserts fp8_dpa is off and
# NVTE_DPA_FP8_RECIPE does not exist. The ladder pairs exactly these two, so 2.8 is the floor for --fp8-attn.
TE_FP8_ATTN_MIN_VERSION = (2, 8)
# On Hopper the weight-gradient GEMM of an FP8 linear ("NT" layout) has the token count as its inner
# dimension, and cuBLASLt wants FP8 leading dimensions in multiples of 16 (TE common/gemm/cublaslt_gemm.cu:
# "Leading dimension requirement on A for FP8 GEMM. Caller must pad."). The forward alone only needs 8, so a
# count of 8 passes the forward and crashes at the first backward. torchao's torch._scaled_mm wants the same.
FP8_TOKEN_MULTIPLE = 16
FLOAT8_CAPABILITY = (8, 9)  # the first CUDA compute capability with float8 GEMMs (Ada, then Hopper)
# Inductor's CPU kernels for torchao's float8 training, in 256-bit vectors: torch 2.13's 512-bit ones
# (VecAVX512VNNI, picked on an Intel Xeon with AVX512-FP16) gave NaN in the QKV weights' gradients, where eager
# and the 256-bit ones give none (tests/test_fp8.py). A CPU's FP8 run is a check of the path, not a speed.
CPU_FLOAT8_SIMDLEN = 256
# The TE modules of a block, by name; each adds a `<name>._extra_state` entry to the state dict.
TE_MODULES = ("attn.qkv", "attn.core_attention", "attn.proj", "mlp")
# The fp8_meta entry a TE module gets when TE's activation recompute first stashes its delayed-scaling state:
# its place in a global buffer (quantization.py, copy_forward_fp8_meta_tensors_for_recompute; TE 2.4 to 2.20).
TE_RECOMPUTE_POSITION = "global_fp8_buffer_pos_fwd_recompute"


@dataclass
class FP8Config:
    mode: str = option("off", "FP8 block GEMMs: Transformer Engine modules, or torchao float8 linears",
                       flag="--fp8", choices=FP8_MODES)
    recipe: str = option("current", "FP8 scaling: current (one scale per tensor, from its amax now; te and torchao), "
                                    "delayed (te: from an amax history) or rowwise (torchao: one scale per row)",
                         flag="--fp8-recipe", choices=FP8_RECIPES)
    attn: bool = option(False, "--fp8 te: FP8 attention too (needs head_dim 128)", flag="--fp8-attn")
    head: bool = option(False, "the lm_head's three GEMMs in float8 inside the fused loss (current scaling: e4m3 "
                               "activations and weight, e5m2 logit gradients), with or without --fp8",
                        flag="--fp8-head")
    fused_wgrad: bool = option(False, "--fp8 te in one process (--dist none): each block GEMM's weight gradient is "
                                      "written in float32 into a buffer the weight keeps (TE's "
                                      "fuse_wgrad_accumulation), not in bf16 for autograd to cast and add",
                               flag="--fp8-fused-wgrad")


def check_fp8_flags(mode: str, recipe: str, fp8_attn: bool, fused_wgrad: bool) -> None:
    """ValueError (one line) for FP8 flags that contradict each other; needs nothing but the flags."""
    if mode not in FP8_MODES:
        raise ValueError(f"unknown fp8 mode {mode!r}; choose one of {', '.join(FP8_MODES)}")
    if recipe not in FP8_RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; choose one of {', '.join(FP8_RECIPES)}")
    if mode != "te" and fp8_attn:
        raise ValueError("--fp8-attn needs --fp8 te: FP8 attention is Transformer Engine's")
    if mode != "te" and fused_wgrad:
        raise ValueError("--fp8-fused-wgrad needs --fp8 te: the fused weight-gradient GEMMs are Transformer Engine's")
    if recipe not in RECIPES_OF.get(mode, (FP8Config.recipe,)):
        paths = " or ".join(f"--fp8 {m}" for m, recipes in RECIPES_OF.items() if recipe in recipes)
        raise ValueError(f"--fp8-recipe {recipe} needs {paths}" + (f", not --fp8 {mode}" if mode != "off" else ""))


def te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def te_compile_problem() -> str | None:
    """Why Transformer Engine's compiled path is off here, or None. Without it every TE module is a graph break
    that runs eagerly, launched from Python (on an H200 with torch 2.11: the GPU idle 14 to 33 ms of a step at
    about 1B, bench/results/gpu_check_20261130); with it, TE 2.20 compiles te.Linear (the attention's output
    projection) and its attention, while LayerNormLinear and LayerNormMLP (the QKV and the MLP) stay eager
    whatever the torch (no_torch_dynamo). Once TE is imported, its own record of why it switched the path off
    (TE 2.20 keeps one); before, whether torch has the opaque-type API under the names torch 2.14 gives it,
    which TE 2.20 registers its compiled path's custom ops through."""
    utils = sys.modules.get("transformer_engine.pytorch.utils")
    if utils is not None:
        return getattr(utils, "_compile_disabled_reason", None)
    from torch._library import opaque_object
    if all(hasattr(opaque_object, name) for name in ("register_custom_class", "is_opaque_constant_type")):
        return None
    return "this torch lacks the opaque-type API of torch 2.14 that TE's compiled path needs"


def te_version() -> tuple[int, int] | None:
    """(major, minor) of the installed Transformer Engine from its package metadata, as TE itself reads it,
    so without importing TE (which needs CUDA); None when it is not installed."""
    try:
        return parse_version(importlib.metadata.version("transformer_engine"))
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_version(text: str) -> tuple[int, int]:
    """"2.20.2+cu13" -> (2, 20); "3.0rc1" -> (3, 0)."""
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


def format_version(version: tuple[int, int]) -> str:
    return ".".join(map(str, version))


def batch_multiple(cfg: FP8Config, seq_len: int) -> int:
    """The micro-batch sizes FP8 allows are the multiples of this: the smallest b with b * seq_len a multiple
    of FP8_TOKEN_MULTIPLE (1 without FP8 blocks or head). --batch-size auto searches only these."""
    if cfg.mode == "off" and not cfg.head:
        return 1
    return FP8_TOKEN_MULTIPLE // math.gcd(seq_len, FP8_TOKEN_MULTIPLE)


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def gemm_dims(cfg: ModelConfig) -> dict[str, int]:
    """The in/out sizes of every block GEMM (the ones that run in FP8)."""
    hd, ffn = cfg.resolved_head_dim, cfg.resolved_ffn_dim
    return {"n_embd": cfg.n_embd, "n_head * head_dim": cfg.n_head * hd,
            "(n_head + 2 * n_kv_head) * head_dim": (cfg.n_head + 2 * cfg.n_kv_head) * hd,
            "ffn_dim": ffn, "2 * ffn_dim": 2 * ffn}


def check_fp8_config(mode: str, recipe: str, fp8_attn: bool, cfg: ModelConfig, batch_size: int, seq_len: int,
                     *, cuda: bool, te: tuple[int, int] | None, have_torchao: bool, head: bool = False,
                     capability: tuple[int, int] | None = None, fused_wgrad: bool = False) -> None:
    """Raise ValueError (one line) when the FP8 flags cannot work on this model, batch and machine.

    Pure: the machine's facts come in as arguments (prepare() passes CUDA's presence, te_version() and
    torchao_installed()). te: the installed Transformer Engine's (major, minor), or None. The rules: TE
    asserts that an FP8 GEMM input has its last dim divisible by 16 (transformer_engine/pytorch/utils.py,
    assert_dim_for_fp8_exec), so every block GEMM dim must be a multiple of 16; the tokens of a micro-batch
    are the inner dim of the weight-gradient GEMM, so batch * seq must be a multiple of FP8_TOKEN_MULTIPLE
    (16) on either path. FP8 attention (TE's cuDNN kernel on H100) needs head_dim 128 and TE >= 2.8.
    head (--fp8-head): torch._scaled_mm, which CUDA runs from compute capability (8, 9) (capability: the GPU's)
    and the CPU runs anywhere, with the micro-batch's tokens a multiple of 16 as above. fused_wgrad
    (--fp8-fused-wgrad): TE's, so --fp8 te (check_fp8_flags; its --dist none is checks.py's, with the other flags).
    """
    check_fp8_flags(mode, recipe, fp8_attn, fused_wgrad)
    if head and cuda and capability is not None and capability < FLOAT8_CAPABILITY:
        raise ValueError(f"--fp8-head needs a GPU with float8 GEMMs (compute capability "
                         f"{'.'.join(map(str, FLOAT8_CAPABILITY))}+: L4, H100, ...), this one is "
                         f"{'.'.join(map(str, capability))}")
    if head and cfg.n_embd % 16:
        raise ValueError(f"--fp8-head needs n_embd to be a multiple of 16 (the lm_head's float8 GEMMs), "
                         f"got {cfg.n_embd}")
    if head and (batch_size * seq_len) % FP8_TOKEN_MULTIPLE:
        raise ValueError(f"--fp8-head needs batch_size * seq_len to be a multiple of {FP8_TOKEN_MULTIPLE} (the "
                         f"lm_head's float8 weight-gradient GEMM), got {batch_size} * {seq_len} = "
                         f"{batch_size * seq_len}")
    if mode == "off":
        return
    if mode == "te" and not cuda:
        raise ValueError(f"--fp8 te needs a CUDA GPU: {TE_INSTALL_HINT}")
    if mode == "te" and te is None:
        raise ValueError(f"--fp8 te: transformer_engine is not installed: {TE_INSTALL_HINT}")
    if mode == "te" and te < TE_MIN_VERSION:
        raise ValueError(f"--fp8 te: transformer_engine {format_version(te)} is too old (need >= "
                         f"{format_version(TE_MIN_VERSION)}): {TE_INSTALL_HINT}")
    if fp8_attn and te < TE_FP8_ATTN_MIN_VERSION:
        raise ValueError(f"--fp8-attn needs transformer_engine >= {format_version(TE_FP8_ATTN_MIN_VERSION)} "
                         f"(FP8 attention with current scaling), found {format_version(te)}")
    if mode == "torchao" and not have_torchao:
        raise ValueError("--fp8 torchao: torchao is not installed: pip install torchao")
    for name, value in gemm_dims(cfg).items():
        if value % 16:
            raise ValueError(f"FP8 GEMMs need every block matrix dim to be a multiple of 16; {name} is {value}")
    if (batch_size * seq_len) % FP8_TOKEN_MULTIPLE:
        raise ValueError(f"--fp8 {mode} needs batch_size * seq_len to be a multiple of {FP8_TOKEN_MULTIPLE} "
                         f"(the FP8 weight-gradient GEMM), got {batch_size} * {seq_len} = {batch_size * seq_len}")
    if fp8_attn and cfg.resolved_head_dim != FP8_ATTN_HEAD_DIM:
        raise ValueError(f"--fp8-attn needs head_dim {FP8_ATTN_HEAD_DIM} (TE's FP8 attention on H100), "
                         f"got {cfg.resolved_head_dim}")


# ----------------------------------------------------------------------------- Transformer Engine



def import_te():
    """transformer_engine.pytorch, imported on first use: it needs CUDA even to import."""
    if not torch.cuda.is_available():
        raise ValueError(f"the Transformer Engine backend needs a CUDA GPU: {TE_INSTALL_HINT}")
    try:
        import transformer_engine
        import transformer_engine.pytorch as te
    except Exception as e:  # ImportError, or OSError / RuntimeError when libcuda or cuDNN is missing
        raise ValueError(f"cannot import transformer_engine ({type(e).__name__}): {TE_INSTALL_HINT}") from None
    if parse_version(transformer_engine.__version__) < TE_MIN_VERSION:
        raise ValueError(f"transformer_engine {transformer_engine.__version__} is too old (need >= "
                         f"{format_version(TE_MIN_VERSION)}): {TE_INSTALL_HINT}")
    return te


def _te_device() -> str:
    # TE modules allocate on CUDA at construction; under `with torch.device("meta")` (FSDP2) they must not.
    return "meta" if torch.get_default_device().type == "meta" else "cuda"


class TEAttention(nn.Module):
    """Attention on Transformer Engine modules: Attention's parameters and numerics, FP8-capable GEMMs.

    QK-norm and the rotation run in plain PyTorch between TE's fused norm+QKV GEMM and its attention
    kernel, exactly as in Attention; TE works in [batch, seq, heads, head_dim] ("bshd") layout. With attention
    gates the fused module also returns its normed input (return_layernorm_output, which keeps that output in
    the activation dtype: TE then skips the norm kernel that quantizes as it normalizes), and the gates
    (model.gate_heads, a bf16 GEMM of H rows, outside FP8) scale each head's output before the projection.
    """

    def __init__(self, config: ModelConfig, fuse_wgrad: bool = False):
        super().__init__()
        te, device = import_te(), _te_device()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = hd = config.resolved_head_dim
        qkv_rows = (config.n_head + 2 * config.n_kv_head) * hd
        self.qkv = te.LayerNormLinear(config.n_embd, qkv_rows, eps=config.norm_eps, bias=False,
                                      normalization="RMSNorm", return_layernorm_output=config.attn_gate,
                                      fuse_wgrad_accumulation=fuse_wgrad, device=device)
        self.q_norm = RMSNorm(hd, eps=config.norm_eps, device=device)
        self.k_norm = RMSNorm(hd, eps=config.norm_eps, device=device)
        self.core_attention = te.DotProductAttention(
            num_attention_heads=config.n_head, kv_channels=hd, num_gqa_groups=config.n_kv_head,
            attention_dropout=0.0, qkv_format="bshd", attn_mask_type="causal",
        )
        self.proj = te.Linear(config.n_head * hd, config.n_embd, bias=False, fuse_wgrad_accumulation=fuse_wgrad,
                              device=device)
        # As in Attention: a plain parameter (the module's own, so listed before the children's, as there).
        self.gate_weight = (nn.Parameter(torch.empty(config.n_head, config.n_embd, device=device))
                            if config.attn_gate else None)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None, start: int = 0,
    ) -> torch.Tensor:
        if kv is not None:
            raise ValueError("KV-cache decoding runs on the plain backend: load te_to_plain_state_dict(...) into GPT")
        first = MICRO_STEP.first
        out = self.qkv(x, is_first_microbatch=first)
        qkv, normed = out if self.gate_weight is not None else (out, None)
        q, k, v = bshd_heads(qkv, self.q_norm, self.k_norm, cos, sin, self.n_head, self.n_kv_head)
        y = self.core_attention(q, k, v)  # [B, T, H * hd]
        if self.gate_weight is not None:
            B, T, _ = y.shape
            y = gate_heads(y.reshape(B, T, self.n_head, self.head_dim), normed, self.gate_weight).reshape(B, T, -1)
        return self.proj(y, is_first_microbatch=first)  # [B, T, n_embd]


def bshd_heads(qkv: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module, cos: torch.Tensor, sin: torch.Tensor,
               n_head: int, n_kv_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused QKV GEMM's output [B, T, (H + 2K) * hd] -> q, k, v as [B, T, heads, hd] ("bshd"), each
    contiguous, with QK-norm and the rotation applied exactly as in Attention.

    The three are column slices of one tensor, so as views they are strided. TE's attention copies a strided
    input in eager mode, and under torch.compile its guard sends the call back to eager (TE 2.20), so each is
    made contiguous here, once (q and k already are: the norm writes new tensors)."""
    B, T, width = qkv.shape
    hd = width // (n_head + 2 * n_kv_head)
    q, k, v = qkv.split([n_head * hd, n_kv_head * hd, n_kv_head * hd], dim=-1)
    cos, sin = cos[:, None], sin[:, None]  # [T, 1, hd]: broadcast over the heads of bshd
    q = apply_rope(q_norm(q.view(B, T, n_head, hd).float()), cos, sin).to(v.dtype)
    k = apply_rope(k_norm(k.view(B, T, n_kv_head, hd).float()), cos, sin).to(v.dtype)
    return q.contiguous(), k.contiguous(), v.contiguous().view(B, T, n_kv_head, hd)


# Our MLP kinds as LayerNormMLP's activations: swiglu gates with the first half of fc1, as ours; srelu is
# relu(x)^2 (Primer's squared ReLU) on an fc1 of ffn_dim rows.
TE_ACTIVATIONS = {"swiglu": "swiglu", "relu2": "srelu"}


class TEBlock(Block):
    """Block on Transformer Engine modules: Block's residual wiring and parameter names, so Block's constructor
    is skipped; its forward only adds what TE's modules take besides the input (MICRO_STEP.first)."""

    backend = "te"
    fuse_wgrad = False  # a class attribute: GPT builds each block from its class and the model config alone

    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)
        te = import_te()
        self.attn = TEAttention(config, self.fuse_wgrad)
        self.mlp = te.LayerNormMLP(config.n_embd, config.resolved_ffn_dim, eps=config.norm_eps, bias=False,
                                   normalization="RMSNorm", activation=TE_ACTIVATIONS[config.mlp],
                                   fuse_wgrad_accumulation=self.fuse_wgrad, device=_te_device())

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, start: int = 0) -> torch.Tensor:
        x = x + self.attn(x, cos, sin, kv, start)
        return x + self.mlp(x, is_first_microbatch=MICRO_STEP.first)

    @staticmethod
    def checkpoint_fn(*args, **kwargs):
        """memory.py's activation checkpointing of this block: TE's own checkpoint, which recomputes under
        the same FP8 autocast as the forward."""
        return import_te().checkpoint(*args, **kwargs)


class TEBlockFusedWgrad(TEBlock):
    """--fp8-fused-wgrad: each GEMM weight keeps a float32 `main_grad`, and TE's weight-gradient GEMMs write into
    it (fuse_wgrad_accumulation: TE then returns no gradient for the weight to autograd). Without it they write
    bf16, which autograd casts to the float32 parameter's dtype (a kernel a weight) and, past a step's first
    micro-batch, adds to .grad (another), each reading and writing the whole gradient. keep_main_grads gives the
    buffers; micro_step zeroes them at a step's first micro-batch and makes them the weights' .grad."""

    fuse_wgrad = True


# The GEMM weights of a TE block: what fuse_wgrad_accumulation writes into `main_grad`; the norm weights and the
# attention gates are plain parameters, whose gradients autograd accumulates as usual.
TE_GEMM_WEIGHTS = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc1_weight", "mlp.fc2_weight")


def fused_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weights whose gradients TE writes into their main_grad (TEBlockFusedWgrad's GEMM weights)."""
    # By class, not by the fuse_wgrad attribute: a checkpoint wrapper answers for its block's attributes, which
    # would count a wrapped block twice.
    return [block.get_parameter(name) for block in model.modules() if isinstance(block, TEBlockFusedWgrad)
            for name in TE_GEMM_WEIGHTS]


def keep_main_grads(model: nn.Module) -> None:
    """A float32 `main_grad` buffer beside each fused weight, for the run: its gradient, which TE's modules look
    up as `weight.main_grad` in their backward. It lives between steps, where autograd frees .grad: with one
    micro-batch a step that is 4 bytes a block GEMM weight more at the activations' peak, where autograd's
    gradients do not exist yet (with more, they do from the second on). memory.py's estimate counts every
    gradient beside the activations, so it holds either way. The weights are listed on the model
    (main_grad_weights) for micro_step, which would otherwise walk every module of every model each step."""
    model.main_grad_weights = fused_weights(model)
    for weight in model.main_grad_weights:
        weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)


class MicroStepState:
    """Which micro-batch of a step of several runs now: its first (True), a later one (False), or None (a step of one
    micro-batch, an evaluation; --batch-size auto's probes run as a first: probing). TE's modules take it as
    is_first_microbatch: at the first they quantize each weight and keep the FP8 copy, for the step's later
    micro-batches, whose weights are the same, to reuse (under FSDP2 TE ignores it). None keeps nothing: a step
    of one has nothing to reuse, and on a torch whose TE compiles te.Linear a flag sends it back to eager (TE
    2.20 linear.py, "FP8 weight caching"). Process-wide, as TE's own FP8 state is; micro_step sets it."""

    first: bool | None = None


MICRO_STEP = MicroStepState()


@contextmanager
def micro_step(model: nn.Module, micro: int, grad_accum: int):
    """Around micro-batch `micro` (from 0) of grad_accum's forward and backward: a checkpointed block recomputes
    its forward in the backward, and must see the same MICRO_STEP. At a step's first micro-batch each fused
    weight's main_grad is zeroed and becomes its .grad (zero_grad(set_to_none=True) dropped the last one), so
    the step's gradients sum in it and the optimizer, clipping and the GradScaler read them as any other. TE
    overwrites main_grad at is_first_microbatch=True anyway; the zeroing keeps a step clean without it (a step
    of one micro-batch passes None, and TE then adds)."""
    if micro == 0 and (weights := getattr(model, "main_grad_weights", ())):
        torch._foreach_zero_([w.main_grad for w in weights])
        for w in weights:
            w.grad = w.main_grad
    first = micro == 0 if grad_accum > 1 else None
    previous, MICRO_STEP.first = MICRO_STEP.first, first
    try:
        yield
    finally:
        MICRO_STEP.first = previous


def te_to_plain_state_dict(state_dict: dict) -> dict:
    """A TE-backend state dict -> one the plain backend loads strictly: drop TE's `*._extra_state` entries
    (FP8 scaling metadata; empty for stateless recipes). Parameter names are the same on both sides."""
    return {k: v for k, v in state_dict.items() if not k.endswith("._extra_state")}


def plain_to_te_state_dict(state_dict: dict) -> dict:
    """A plain-backend state dict -> one the TE backend loads strictly: add an empty `_extra_state` for
    every TE module of every block found (TE reads an empty one as "no FP8 metadata yet")."""
    out = dict(state_dict)
    for key in state_dict:
        parts = key.split(".")
        if len(parts) == 5 and parts[0] == "blocks" and parts[2:] == ["attn", "qkv", "weight"]:
            for module in TE_MODULES:
                out.setdefault(f"blocks.{parts[1]}.{module}._extra_state", torch.empty(0, dtype=torch.uint8))
    return out



def set_te_attention_env(recipe: str, fp8_attn: bool) -> None:
    """Point TE's FP8 attention at delayed scaling when the GEMMs use current scaling. TE reads the variable
    when it is imported, so call this before the first TE import (GPT(..., backend="te") imports it)."""
    if not (fp8_attn and recipe == "current"):
        return
    current = os.environ.get(DPA_RECIPE_ENV)
    if current not in (None, "DelayedScaling"):
        raise ValueError(f"--fp8-attn with --fp8-recipe current needs {DPA_RECIPE_ENV}=DelayedScaling, "
                         f"but it is set to {current!r}")
    if current is None and "transformer_engine" in sys.modules:
        raise ValueError(f"transformer_engine was imported before {DPA_RECIPE_ENV} could be set; "
                         f"export {DPA_RECIPE_ENV}=DelayedScaling")
    os.environ[DPA_RECIPE_ENV] = "DelayedScaling"


def te_recipe(recipe: str, fp8_attn: bool):
    """current -> Float8CurrentScaling (stateless, compile-friendly); delayed -> DelayedScaling(HYBRID).
    HYBRID: E4M3 in the forward pass, E5M2 (more range) for gradients. fp8_attn sets the recipe's fp8_dpa."""
    import_te()
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format

    if recipe == "current":
        return Float8CurrentScaling(fp8_format=Format.HYBRID, fp8_dpa=fp8_attn)
    if recipe == "delayed":
        return DelayedScaling(fp8_format=Format.HYBRID, fp8_dpa=fp8_attn)
    raise ValueError(f"unknown Transformer Engine recipe {recipe!r}; choose one of {', '.join(RECIPES_OF['te'])}")


def te_autocast(fp8_recipe):
    """TE's FP8 context for one micro-batch's forward: te.autocast(recipe=) from TE 2.9, te.fp8_autocast
    (fp8_recipe=) before (transformer_engine/pytorch/quantization.py; the old name still works but warns)."""
    te = import_te()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=fp8_recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe)


def fp8_context(fp8_recipe):
    """te_autocast(fp8_recipe), or a no-op when there is no TE recipe (fp8 off or torchao)."""
    return nullcontext() if fp8_recipe is None else te_autocast(fp8_recipe)


# ----------------------------------------------------------------------------- --batch-size auto's probes


def is_delayed(fp8_recipe) -> bool:
    """Delayed scaling: the recipe that keeps per-module state (scales, an amax history) between forwards."""
    return fp8_recipe is not None and fp8_recipe.delayed()


def probe_recipe(fp8_recipe):
    """The recipe --batch-size auto's probes run under: delayed scaling's copy with reduce_amax off.

    Leaving a delayed-scaling autocast all-reduces the amaxes over every rank when reduce_amax is set (TE's
    default; quantization.py, reduce_and_update_fp8_tensors), so each probe would be a collective; ranks
    probe on their own and run out of memory at different sizes, which would leave those collectives out
    of step. Current scaling reduces nothing outside tensor or sequence parallelism: it stays as it is."""
    return replace(fp8_recipe, reduce_amax=False) if is_delayed(fp8_recipe) else fp8_recipe


def fp8_state_manager():
    """TE's FP8GlobalStateManager: in quantization.py from TE 2.9, in fp8.py before (later a deprecated alias)."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager


def reset_delayed_scaling(model: nn.Module) -> None:
    """Every TE module of `model` back to a new module's delayed-scaling state: scales 1 and an amax history
    of zeros (TransformerEngineBaseModule.reset_fp8_meta_tensors), and no place yet in TE's global amax and
    recompute buffers, which are emptied (FP8GlobalStateManager.reset).

    A module takes its place in the amax buffers once, under the key of its first autocast's recipe
    (add_fp8_tensors_to_global_buffer); from TE 2.8 that key spells out reduce_amax, so a model that ran
    under probe_recipe would otherwise go on reducing its amaxes under it, on each rank alone. Run it
    outside any autocast, between forwards."""
    modules = [m for m in model.modules() if hasattr(m, "reset_fp8_meta_tensors")]
    if not modules:
        return
    manager = fp8_state_manager()
    for module in modules:
        module.reset_fp8_meta_tensors()
        for key in (manager.get_buffer_info(), TE_RECOMPUTE_POSITION):
            module.fp8_meta.pop(key, None)
    manager.reset()


@contextmanager
def probing(model: nn.Module, fp8_recipe):
    """Around --batch-size auto's probes of `model`: -> the recipe they run under (probe_recipe). They run as a
    step's first micro-batch of several (micro_step): TE then keeps its FP8 copy of every block weight, as
    training holds it from the first step of more than one micro-batch on, for the run (a byte or two a block
    parameter; with activation checkpointing memory the peak would not otherwise hold). Afterwards a
    delayed-scaling model starts training as a new one would (reset_delayed_scaling): the probes' amaxes, of
    all-zero batches at sizes that may not fit, leave nothing in its 1,024-step history."""
    try:
        with micro_step(model, 0, 2):
            yield probe_recipe(fp8_recipe)
    finally:
        if is_delayed(fp8_recipe):
            reset_delayed_scaling(model)


# ----------------------------------------------------------------------------- torchao


class Float8Matmul(nn.Module):
    """torchao's float8 GEMM (input @ weight.T) for a weight that lives elsewhere.

    Our fused modules (LayerNormLinear, LayerNormMLP) own raw weights named as TE names them, not nn.Linear
    children, so torchao's module swap cannot reach them. This module owns no tensors: it takes its
    settings from a Float8Linear that torchao's own convert_to_float8_training makes, and runs the autograd
    function that Float8Linear.forward runs, on the owner's weight. The parameter keeps its name and place
    (state dicts, optimizer, FSDP2 see the same tensor). matmul_with_hp_or_float8_args is torchao-internal
    (torchao/float8/float8_linear.py, the same in 0.14 and 0.18); torch.func.functional_call on a weightless
    Float8Linear would use public API only, but dynamo cannot compile it (guard failure, torch 2.13).
    """

    def __init__(self, config):
        super().__init__()
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        template = convert_to_float8_training(nn.Linear(16, 16, bias=False, device="meta"), config=config)
        self.config, self.mm_config = template.config, template.linear_mm_config
        self.function = matmul_with_hp_or_float8_args

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):  # as Float8Linear: the output takes the autocast dtype
            x = x.to(torch.get_autocast_dtype(device))
        return self.function.apply(x, weight.t(), self.mm_config, self.config)


def is_block_linear(module: nn.Module, fqn: str) -> bool:
    """module_filter_fn for torchao: the nn.Linear layers inside the blocks, never the lm_head."""
    return isinstance(module, nn.Linear) and (fqn.startswith("blocks.") or ".blocks." in fqn)


def convert_to_torchao_float8(model: nn.Module, recipe: str = "current") -> nn.Module:
    """Run every block GEMM through torchao's float8 training, in place: dynamic scaling, one scale per
    tensor (recipe "current", torchao's tensorwise) or per row (recipe "rowwise", finer, so less error from
    an outlier row, at the cost of a cast that reads each operand along its rows).

    The block nn.Linear layers (attn.proj) go through torchao's convert_to_float8_training; the fused
    qkv / fc1 / fc2 weights get a Float8Matmul. Parameter names and tensors are unchanged. Call it before
    activation checkpointing, torch.compile and FSDP2 wrap the model (torchtitan's order).
    """
    if getattr(model, "backend", "plain") != "plain":
        raise ValueError("--fp8 torchao converts the plain backend; it does not combine with --fp8 te")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ValueError("--fp8 torchao: torchao is not installed: pip install torchao") from None
    config = Float8LinearConfig.from_recipe_name("rowwise") if recipe == "rowwise" else Float8LinearConfig()
    convert_to_float8_training(model, module_filter_fn=is_block_linear, config=config)
    for block in model.blocks:
        block.attn.qkv.matmul = Float8Matmul(config)
        block.mlp.matmul = Float8Matmul(config)
    return model


# ----------------------------------------------------------------------------- reporting


def describe_fp8(model: nn.Module, fp8_recipe=None) -> str:
    """The startup-log line, from what the model contains and the recipe in use (not from the flags)."""
    te_blocks = sum(isinstance(m, TEBlock) for m in model.modules())
    float8_blocks = sum(isinstance(m, LayerNormMLP) and isinstance(m.matmul, Float8Matmul) for m in model.modules())
    fp8_head = any(isinstance(m, GPT) and m.fp8_head for m in model.modules())
    head = ("lm_head float8 (dynamic tensorwise, in the fused loss); embedding not FP8" if fp8_head else
            "embedding, lm_head not FP8")
    if te_blocks and fp8_recipe is not None:
        attn = ", FP8 attention (fp8_dpa)" if getattr(fp8_recipe, "fp8_dpa", False) else ", attention not FP8"
        wgrad = ", weight gradients fused into float32 main_grad" if fused_weights(model) else ""
        return f"Transformer Engine, {type(fp8_recipe).__name__}: {te_blocks} TE blocks{attn}{wgrad}; {head}"
    if te_blocks:
        return f"off ({te_blocks} Transformer Engine blocks, no FP8 recipe)" + (f"; {head}" if fp8_head else "")
    if float8_blocks:
        config = next(m.matmul.config for m in model.modules() if isinstance(m, LayerNormMLP))
        scaling = "rowwise" if config.cast_config_input.scaling_granularity.name == "AXISWISE" else "tensorwise"
        return f"torchao float8, dynamic {scaling}: qkv, proj, fc1, fc2 of {float8_blocks} blocks; {head}"
    return f"blocks not FP8; {head}" if fp8_head else "off"


# ----------------------------------------------------------------------------- set-up (what train.py calls)


def prepare(cfg: FP8Config, model_cfg: ModelConfig, micro_batch: int | None, device: torch.device,
            autocast_dtype: torch.dtype | None):
    """Check the FP8 flags against the model, the batch and this machine, before anything is built; under
    --fp8 te also point TE's attention at its recipe (before TE's import), and under --fp8 torchao on a CPU set
    Inductor's vectors (CPU_FLOAT8_SIMDLEN) -> TE's recipe, or None.

    micro_batch None: chosen later by --batch-size auto, which searches only multiples of batch_multiple(),
    so the smallest of them is the one checked here."""
    batch = micro_batch or batch_multiple(cfg, model_cfg.max_seq_len)
    try:
        cuda = device.type == "cuda"
        check_fp8_config(cfg.mode, cfg.recipe, cfg.attn, model_cfg, batch, model_cfg.max_seq_len, cuda=cuda,
                         te=te_version(), have_torchao=torchao_installed(), head=cfg.head, fused_wgrad=cfg.fused_wgrad,
                         capability=torch.cuda.get_device_capability(device) if cuda and cfg.head else None)
        if cfg.mode == "torchao" and device.type == "cpu":
            import torch._inductor.config as inductor_config
            inductor_config.cpp.simdlen = CPU_FLOAT8_SIMDLEN
        if cfg.recipe == "rowwise" and device.type == "cuda" and autocast_dtype != torch.bfloat16:
            raise ValueError("--fp8-recipe rowwise on CUDA needs --dtype bf16: torch._scaled_mm's row-wise FP8 "
                             "kernel writes bf16")
        if cfg.mode != "te":
            return None
        if autocast_dtype is None:
            raise ValueError("--fp8 te runs its non-FP8 parts (TE's fused attention) in 16 bits: use --dtype bf16")
        set_te_attention_env(cfg.recipe, cfg.attn)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return te_recipe(cfg.recipe, cfg.attn)


def block_class(cfg: FP8Config) -> type[Block]:
    """The block a model is built of under these FP8 settings: Transformer Engine's modules under --fp8 te (with
    fused weight gradients under --fp8-fused-wgrad), the plain one otherwise (torchao swaps its GEMMs into a
    plain model afterwards: convert)."""
    if cfg.mode != "te":
        return Block
    return TEBlockFusedWgrad if cfg.fused_wgrad else TEBlock


def block_state_dict(state: dict, mode: str) -> dict:
    """A plain state dict (a checkpoint's, --from-hf's) under the names of the blocks --fp8 `mode` builds."""
    return plain_to_te_state_dict(state) if mode == "te" else state


def convert(model: GPT, cfg: FP8Config) -> None:
    """Under --fp8 torchao, torchao's float8 GEMMs swapped into model's blocks, after any weights are loaded
    (while the parameters are plain tensors); under --fp8-head, the head's GEMMs in float8."""
    if cfg.mode == "torchao":
        convert_to_torchao_float8(model, cfg.recipe)
    keep_main_grads(model)
    model.fp8_head = cfg.head
