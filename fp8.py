"""FP8 training, two ways: NVIDIA Transformer Engine (TE) modules, or torchao's float8 linears.

    --fp8 te       GPT(config, backend="te") (model.py); each micro-batch's forward runs inside
                   te_autocast(te_recipe(...)), its backward outside; recipe "current" (default) or "delayed"
    --fp8 torchao  convert_to_torchao_float8(model) on the plain backend: dynamic tensorwise scaling

Either way only the block GEMMs run in FP8; the embedding, the final norm and the lm_head stay in the
autocast dtype (bf16). Parameter names never change, so a checkpoint moves between the paths: torchao and
plain share state dicts; te <-> plain go through model.te_to_plain_state_dict / plain_to_te_state_dict.

TE needs CUDA even to import, so every TE import here is lazy, and check_fp8_config() refuses an impossible
combination (no GPU, no TE, shapes the FP8 GEMMs or FP8 attention cannot take) with a one-line error before
anything is built.
"""

import importlib.util
import os
import sys
from contextlib import nullcontext

import torch
import torch.nn as nn

from model import TE_INSTALL_HINT, LayerNormMLP, ModelConfig, TEBlock, import_te

FP8_MODES = ("off", "te", "torchao")
FP8_RECIPES = ("current", "delayed")
# TE reads this at import time (attention/dot_product_attention/dot_product_attention.py). On H100, FP8
# attention trains only with delayed scaling, so with the current-scaling recipe the attention gets its own.
DPA_RECIPE_ENV = "NVTE_DPA_FP8_RECIPE"
FP8_ATTN_HEAD_DIM = 128


def te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def gemm_dims(cfg: ModelConfig) -> dict[str, int]:
    """The in/out sizes of every block GEMM (the ones that run in FP8)."""
    hd, ffn = cfg.resolved_head_dim, cfg.resolved_ffn_dim
    return {"n_embd": cfg.n_embd, "n_head * head_dim": cfg.n_head * hd,
            "(n_head + 2 * n_kv_head) * head_dim": (cfg.n_head + 2 * cfg.n_kv_head) * hd,
            "ffn_dim": ffn, "2 * ffn_dim": 2 * ffn}


def check_fp8_config(mode: str, recipe: str, fp8_attn: bool, cfg: ModelConfig, batch_size: int, seq_len: int,
                     *, cuda: bool, have_te: bool, have_torchao: bool) -> None:
    """Raise ValueError (one line) when the FP8 flags cannot work on this model, batch and machine.

    Pure: the machine's facts come in as arguments (train.py passes torch.cuda.is_available(), te_installed(),
    torchao_installed()). The rules: TE asserts that an FP8 GEMM input has its last dim divisible by 16 and
    the product of the others by 8 (transformer_engine/pytorch/utils.py, assert_dim_for_fp8_exec), so every
    GEMM dim must be a multiple of 16 and batch * seq a multiple of 8. torchao's float8 GEMMs
    (torch._scaled_mm) want multiples of 16 too, and the tokens are the inner dim of the weight-gradient
    GEMM, so batch * seq must be a multiple of 16 there (our reading, not yet checked on a GPU). FP8
    attention (TE's cuDNN kernel on H100) needs head_dim 128.
    """
    if mode not in FP8_MODES:
        raise ValueError(f"unknown fp8 mode {mode!r}; choose one of {', '.join(FP8_MODES)}")
    if recipe not in FP8_RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; choose one of {', '.join(FP8_RECIPES)}")
    if fp8_attn and mode != "te":
        raise ValueError("--fp8-attn needs --fp8 te (FP8 attention is Transformer Engine's)")
    if mode == "off":
        return
    if mode == "te" and not cuda:
        raise ValueError(f"--fp8 te needs a CUDA GPU: {TE_INSTALL_HINT}")
    if mode == "te" and not have_te:
        raise ValueError(f"--fp8 te: transformer_engine is not installed: {TE_INSTALL_HINT}")
    if mode == "torchao" and not have_torchao:
        raise ValueError("--fp8 torchao: torchao is not installed: pip install torchao")
    for name, value in gemm_dims(cfg).items():
        if value % 16:
            raise ValueError(f"FP8 GEMMs need every block matrix dim to be a multiple of 16; {name} is {value}")
    multiple = 8 if mode == "te" else 16
    if (batch_size * seq_len) % multiple:
        raise ValueError(f"--fp8 {mode} needs batch_size * seq_len to be a multiple of {multiple}, got "
                         f"{batch_size} * {seq_len} = {batch_size * seq_len}")
    if fp8_attn and cfg.resolved_head_dim != FP8_ATTN_HEAD_DIM:
        raise ValueError(f"--fp8-attn needs head_dim {FP8_ATTN_HEAD_DIM} (TE's FP8 attention on H100), "
                         f"got {cfg.resolved_head_dim}")


# ----------------------------------------------------------------------------- Transformer Engine


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
    raise ValueError(f"unknown fp8 recipe {recipe!r}; choose one of {', '.join(FP8_RECIPES)}")


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


def convert_to_torchao_float8(model: nn.Module) -> nn.Module:
    """Run every block GEMM through torchao's float8 training (dynamic tensorwise scaling), in place.

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
    config = Float8LinearConfig()
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
    if te_blocks and fp8_recipe is not None:
        attn = ", FP8 attention (fp8_dpa)" if getattr(fp8_recipe, "fp8_dpa", False) else ", attention not FP8"
        return (f"Transformer Engine, {type(fp8_recipe).__name__}: {te_blocks} TE blocks{attn}; "
                "embedding, lm_head not FP8")
    if te_blocks:
        return f"off ({te_blocks} Transformer Engine blocks, no FP8 recipe)"
    if float8_blocks:
        return (f"torchao float8, dynamic tensorwise: qkv, proj, fc1, fc2 of {float8_blocks} blocks; "
                "embedding, lm_head not FP8")
    return "off"
