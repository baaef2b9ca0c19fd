"""A decoder-only transformer in the Qwen3 style, in plain PyTorch.

Pre-norm RMSNorm, grouped-query attention with a fused QKV projection, per-head RMSNorm on q and k (QK-norm)
before rotary embeddings (rotate-half convention), causal SDPA, a SwiGLU MLP with a fused [gate; up]
projection, a final RMSNorm and an lm_head that may share the embedding matrix. No biases anywhere.

The numerics match Hugging Face transformers' Qwen3ForCausalLM (tests/test_model.py checks the logits).

Module and parameter names mirror Transformer Engine's LayerNormLinear / LayerNormMLP / Linear, so that a
TE-backed block can load the same state dict: the pre-attention norm lives on the qkv projection and the
pre-MLP norm on the MLP, each as `layer_norm_weight`.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB_MULTIPLE = 128
FFN_MULTIPLE = 128
INIT_STD = 0.02


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class ModelConfig:
    """Model shape. `head_dim` and `ffn_dim` may be None: read `resolved_head_dim` / `resolved_ffn_dim`
    (properties rather than values filled in at construction, so `dataclasses.replace(c, n_embd=...)` cannot
    keep a default derived from the old width).

    Defaults: head_dim = n_embd // n_head; ffn_dim = 8/3 * n_embd rounded up to a multiple of 128. The 8/3
    keeps SwiGLU's three matrices at the parameter count of a 4x GELU MLP's two; the rounding keeps the GEMMs
    tensor-core and FP8 friendly (768 -> 2048, 1024 -> 2816).
    """

    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int = 4
    n_embd: int = 768
    head_dim: int | None = None
    ffn_dim: int | None = None
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True

    def validate(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("head_dim", "ffn_dim"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive (or unset), got {value}")
        for name in ("rope_theta", "norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if self.head_dim is None and self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}) unless head_dim is set"
            )
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.resolved_head_dim}")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def resolved_ffn_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        return _round_up(math.ceil(8 * self.n_embd / 3), FFN_MULTIPLE)

    @property
    def padded_vocab_size(self) -> int:
        return _round_up(self.vocab_size, VOCAB_MULTIPLE)


def rope_cos_sin(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq_len, head_dim] (float32, CPU) for the rotate-half convention.

    Computed in float64 because position * frequency loses most of its fractional part in float32 at long
    context, and the angle is what matters.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device="cpu"), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, hd] by position: pairs are (i, i + hd/2), not adjacent channels."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class LayerNormLinear(nn.Module):
    """RMSNorm followed by a bias-free linear layer (Transformer Engine's LayerNormLinear, plain)."""

    def __init__(self, in_features: int, out_features: int, eps: float):
        super().__init__()
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.empty(in_features))
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.rms_norm(x, self.layer_norm_weight.shape, self.layer_norm_weight, self.eps)
        return F.linear(x, self.weight)


class LayerNormMLP(nn.Module):
    """RMSNorm then SwiGLU: fc2(silu(gate) * up), with fc1's rows [gate; up] (TE's LayerNormMLP, plain)."""

    def __init__(self, n_embd: int, ffn_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.empty(n_embd))
        self.fc1_weight = nn.Parameter(torch.empty(2 * ffn_dim, n_embd))
        self.fc2_weight = nn.Parameter(torch.empty(n_embd, ffn_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.rms_norm(x, self.layer_norm_weight.shape, self.layer_norm_weight, self.eps)
        gate, up = F.linear(x, self.fc1_weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.fc2_weight)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.resolved_head_dim
        qkv_rows = (config.n_head + 2 * config.n_kv_head) * self.head_dim
        self.qkv = LayerNormLinear(config.n_embd, qkv_rows, config.norm_eps)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
        self.proj = nn.Linear(config.n_head * self.head_dim, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1
        )
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        # Norm and rotate in float32: under autocast q and k arrive in bf16, while the norm weights and the
        # rotation tables are float32; the result goes back to v's dtype for the attention kernel.
        q = apply_rope(self.q_norm(q.float()), cos, sin).to(v.dtype)
        k = apply_rope(self.k_norm(k.float()), cos, sin).to(v.dtype)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn = Attention(config)
        self.mlp = LayerNormMLP(config.n_embd, config.resolved_ffn_dim, config.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, cos, sin)
        return x + self.mlp(x)


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        self.config = config
        vocab, dim = config.padded_vocab_size, config.n_embd
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.RMSNorm(dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        # Non-persistent: derived from the config, so checkpoints stay exactly the parameter contract.
        self.register_buffer("rope_cos", torch.empty(config.max_seq_len, config.resolved_head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(config.max_seq_len, config.resolved_head_dim), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and the rotary tables; deterministic under torch.manual_seed.

        Matrices and the embedding: normal(0, 0.02). The two projections that write into the residual stream
        (attn.proj, mlp.fc2) are scaled by 1/sqrt(2 * n_layer) so the stream's variance does not grow with
        depth. Norm weights: 1. Safe to call on a model materialised from the meta device (`to_empty`), which
        also breaks the embedding tie, so the tie is restored here.
        """
        if self.config.tie_embeddings and self.lm_head.weight is not self.embed.weight:
            self.lm_head.weight = self.embed.weight
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        for name, param in self.named_parameters():
            if param.ndim == 1:
                nn.init.ones_(param)
            elif name.endswith(("attn.proj.weight", "mlp.fc2_weight")):
                nn.init.normal_(param, std=residual_std)
            else:
                nn.init.normal_(param, std=INIT_STD)
        cos, sin = rope_cos_sin(self.config.resolved_head_dim, self.config.max_seq_len, self.config.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx [B, T] -> logits [B, T, padded_vocab_size], and the mean float32 cross-entropy if targets given.

        The padding columns are ordinary logits. No target ever names them, so training only pushes them
        down and they take a vanishing share of the softmax; samplers should still slice to vocab_size.
        Targets equal to -100 are ignored (F.cross_entropy's default).
        """
        T = idx.shape[1]
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss

    def row_blocks(self) -> dict[str, list[int]]:
        """Row split of each fused weight, by parameter name: qkv into [Q, K, V], fc1 into [gate, up]."""
        c = self.config
        hd, ffn = c.resolved_head_dim, c.resolved_ffn_dim
        blocks = {}
        for i in range(c.n_layer):
            blocks[f"blocks.{i}.attn.qkv.weight"] = [c.n_head * hd, c.n_kv_head * hd, c.n_kv_head * hd]
            blocks[f"blocks.{i}.mlp.fc1_weight"] = [ffn, ffn]
        return blocks

    def num_params(self) -> int:
        """Unique parameters: a tied embedding / lm_head matrix counts once."""
        return sum(p.numel() for p in self.parameters())


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the convention of the PaLM paper and nanoGPT's MFU.

    6 * N, where N counts the weights of every matrix multiply: qkv, proj, fc1, fc2 in each block plus the
    lm_head over the padded vocabulary (the embedding lookup and norm weights are not matmuls; a tied matrix
    counts once, as the lm_head). Plus attention scores and the weighted sum, 2 matmuls * 2 FLOPs * seq_len *
    n_head * head_dim per layer forward, times 3 for forward + backward: 12 * n_layer * n_head * head_dim *
    seq_len. The attention term counts the full T x T square even though causal kernels skip half of it.
    """
    hd, ffn, dim = config.resolved_head_dim, config.resolved_ffn_dim, config.n_embd
    per_layer = (
        dim * (config.n_head + 2 * config.n_kv_head) * hd
        + config.n_head * hd * dim
        + dim * 2 * ffn
        + ffn * dim
    )
    matmul_params = config.n_layer * per_layer + config.padded_vocab_size * dim
    attention = 12 * config.n_layer * config.n_head * hd * seq_len
    return float(6 * matmul_params + attention)
