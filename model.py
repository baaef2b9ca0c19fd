"""The plain-PyTorch Qwen3 GPT and ModelConfig; its loss never materialises the logits (loss.py).

Pre-norm RMSNorm, grouped-query attention with a fused QKV projection, per-head RMSNorm on q and k (QK-norm)
before rotary embeddings (rotate-half convention), causal SDPA, a SwiGLU MLP with a fused [gate; up]
projection, a final RMSNorm and an lm_head that may share the embedding matrix. No biases anywhere. Given
targets, the lm_head and the cross-entropy run fused, chunk by chunk (loss.linear_cross_entropy), so training
never holds the full logits.

The numerics match Hugging Face transformers' Qwen3ForCausalLM (tests/test_model.py checks the logits).
The recipe toggles (QWEN3_VALUES: a ReLU^2 MLP, logit soft-capping, value embeddings, U-net skips,
attention output gates, the smear, a bigram hash embedding, embedding skips; docs/recipe.md) leave that
architecture. Three are on by default: the gates, which transformers holds too (Qwen3NextForCausalLM's
output gate, as hf_layout.py writes it), and the smear and the bigram table, which an export carries as
code of its own (hf_look_back.py).

Module and parameter names mirror Transformer Engine's LayerNormLinear / LayerNormMLP / Linear, so that a
TE-backed block can load the same state dict: the pre-attention norm lives on the qkv projection and the
pre-MLP norm on the MLP, each as `layer_norm_weight`.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from loss import LOSS_CHUNK_TOKENS, linear_cross_entropy, soft_cap
from option import option

VOCAB_MULTIPLE = 128
FFN_MULTIPLE = 128
INIT_STD = 0.02


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ModelConfig fields that only affect initialisation: a resume may change them (checkpoint.py).
INIT_ONLY_FIELDS = ("zero_init_proj", "head_init")
HEAD_INITS = ("normal", "zero")
MLP_KINDS = ("swiglu", "relu2")
# The ModelConfig fields that leave the Qwen3 architecture, at Qwen3's values: away from these (but for
# attn_gate, which Qwen3-Next holds) hf.py cannot export the model; a record that lacks one was trained at
# Qwen3's value.
QWEN3_VALUES = {"mlp": "swiglu", "logit_softcap": 0.0, "value_embeds": 0, "unet_skips": False, "attn_gate": False,
                "smear": False, "bigram_embed": 0, "embed_skips": False}
ARCHITECTURE_TOGGLES = tuple(QWEN3_VALUES)
# Those of them the Transformer Engine blocks (fp8.TEBlock) do not implement.
PLAIN_BACKEND_TOGGLES = ("value_embeds",)
ZERO_INIT = ("attn.gate_weight", "smear_weight", "bigram_embed.weight")  # parameters that start at 0 (init_weights)
NO_TOKEN = -1  # previous_tokens' id for "no token before this position": a sequence's first
# The bigram hash's multiplier: a prime, so that (previous, token) pairs a bucket count apart do not collide.
BIGRAM_HASH_MULTIPLIER = 1_000_003


def with_qwen3_toggles(record: dict) -> dict:
    """A recorded ModelConfig (dataclasses.asdict's), with Qwen3's value for each toggle it lacks: a
    record without a toggle was trained at Qwen3's value, whatever today's default."""
    return {**QWEN3_VALUES, **record}


def qwen3_flag(name: str) -> str:
    """The flag that sets toggle `name` to Qwen3's value: --mlp swiglu, --logit-softcap 0, --no-attn-gate."""
    value, dashed = QWEN3_VALUES[name], name.replace("_", "-")
    if isinstance(value, bool):
        return f"--{dashed}" if value else f"--no-{dashed}"
    return f"--{dashed} {value:g}" if isinstance(value, float) else f"--{dashed} {value}"


@dataclass
class ModelConfig:
    """Model shape. `head_dim` and `ffn_dim` may be None: read `resolved_head_dim` / `resolved_ffn_dim`
    (properties rather than values filled in at construction, so `dataclasses.replace(c, n_embd=...)` cannot
    keep a default derived from the old width).

    Defaults: head_dim = n_embd // n_head; ffn_dim = 8/3 * n_embd rounded up to a multiple of 128. The 8/3
    keeps SwiGLU's three matrices at the parameter count of a 4x GELU MLP's two; the rounding keeps the GEMMs
    tensor-core and FP8 friendly (768 -> 2048, 1024 -> 2816). With mlp "relu2" the default hidden width is 3/2
    of SwiGLU's (a multiple of 64): two matrices of 3F/2 rows hold exactly the parameters of SwiGLU's three
    of F (768 -> 3072).

    The shape defaults are train.py's small model (20.11M parameters, minutes on a laptop CPU). Each field's
    option() gives each its help text: config.py generates train.py's flags from these fields.
    """

    vocab_size: int = option(50257, "tokenizer vocabulary size (GPT-2: 50257); padded to a multiple of 128 in "
                                    "the model")
    n_layer: int = option(4, "transformer blocks")
    n_head: int = option(4, "query heads")
    n_kv_head: int = option(2, "key/value heads (GQA); must divide --n-head")
    n_embd: int = option(128, "model width")
    head_dim: int | None = option(None, "per-head width (default: n_embd / n_head)")
    ffn_dim: int | None = option(None, "MLP hidden size (default: SwiGLU's 8/3 n_embd rounded up to a multiple of 128; "
                                       "relu2's 3/2 of that, the same parameter count)")
    max_seq_len: int = option(128, "tokens per training sequence", flag="--seq-len")
    rope_theta: float = option(10000.0, "RoPE base frequency")
    norm_eps: float = option(1e-6, "RMSNorm epsilon")
    tie_embeddings: bool = option(False, "one matrix for the embedding and the lm_head, as in GPT-2 (the gpt2-* "
                                         "presets set it); off, the lm_head is its own matrix with its own LR, which "
                                         "trains faster (docs/recipe.md)")
    # Initialisation, not shape: hf_layout.hf_config leaves it out, so Hugging Face exports stay exact.
    zero_init_proj: bool = option(True, "initialise attn.proj and mlp.fc2, the projections into the residual stream, "
                                        "to zero: every block starts as the identity (init only; not part of the "
                                        "exported architecture; docs/recipe.md)")
    head_init: str = option("normal", "init of an untied lm_head (not with --tie-embeddings): normal(0, 0.02) like the "
                                      "embedding, or zero, so every logit starts at 0 (init only)", choices=HEAD_INITS)
    # Recipe toggles (QWEN3_VALUES), each on by default only once the recipe sweep showed it wins on both tuning
    # corpora (docs/recipe.md): attn_gate, smear, bigram_embed.
    mlp: str = option("swiglu", "MLP: SwiGLU (3 matrices) or ReLU^2, relu(x W1)^2 W2 (2 matrices, hidden 3/2 of "
                                "SwiGLU's default: the same parameters)", choices=MLP_KINDS)
    logit_softcap: float = option(0.0, "soft-cap the logits to (-C, C) with C tanh(logits / C), in training, "
                                       "evaluation and sampling (0: off)")
    value_embeds: int = option(0, "value-embedding tables: table i, a token embedding of the value width, is added "
                                  "(times a learned per-layer scalar, init 1) to the attention values of layers i and "
                                  "n_layer-1-i (0: off)")
    unet_skips: bool = option(False, "U-net skips: the output of block i of the first half is added (times a learned "
                                     "scalar, init 1) to the input of block n_layer-1-i")
    attn_gate: bool = option(True, "per-head output gates in attention: each head's output times sigmoid(x W_g), x the "
                                   "normed attention input, W_g [n_head, n_embd] zero-initialised (every gate starts "
                                   "at 1/2)")
    smear: bool = option(True, "smear: each position's token embedding plus the previous token's, times the gate "
                                "sigmoid(e w), e the normed embedding, w [1, n_embd] zero-initialised (every gate "
                                "starts at 1/2): a one-token look-back before the first block")
    bigram_embed: int = option(50304, "bigram hash embedding: a table of this many rows (zero-initialised, trained "
                                      "as the embedding), indexed by a hash of (previous token, token), added to the "
                                      "token embedding (0: off; the default is GPT-2's padded vocabulary, whatever "
                                      "the tokenizer's)")
    embed_skips: bool = option(False, "embedding skips: the embedding is added (times a learned per-block scalar, init "
                                      "1) to the input of every block after the first")

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
        self._validate_toggles()

    def _validate_toggles(self) -> None:
        if self.head_init not in HEAD_INITS:
            raise ValueError(f"unknown head_init {self.head_init!r}; choose one of {', '.join(HEAD_INITS)}")
        if self.head_init != "normal" and self.tie_embeddings:
            raise ValueError("--head-init zero needs an untied lm_head: a tied one (--tie-embeddings) is the "
                             "embedding, which it would zero")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"unknown mlp {self.mlp!r}; choose one of {', '.join(MLP_KINDS)}")
        if not 0 <= self.logit_softcap < math.inf:
            raise ValueError(f"logit_softcap must be >= 0 and finite (0: off), got {self.logit_softcap}")
        most = (self.n_layer + 1) // 2
        if not 0 <= self.value_embeds <= most:
            raise ValueError(f"value_embeds must be in 0..{most} (each table feeds a layer of each half of the "
                             f"{self.n_layer}), got {self.value_embeds}")
        for name in ("unet_skips", "embed_skips"):
            if getattr(self, name) and self.n_layer < 2:
                raise ValueError(f"{name} needs at least 2 layers, got n_layer {self.n_layer}")
        if self.bigram_embed < 0 or self.bigram_embed == 1:
            raise ValueError(f"bigram_embed must be 0 (off) or at least 2 rows (the last is the first position's, "
                             f"which has no previous token), got {self.bigram_embed}")

    def toggles_on(self, names: tuple[str, ...] = ARCHITECTURE_TOGGLES) -> list[str]:
        """Each of `names` that is not at Qwen3's value, as its flag and value ("--mlp relu2")."""
        return [f"--{n.replace('_', '-')} {getattr(self, n)}".removesuffix(" True")
                for n in names if getattr(self, n) != QWEN3_VALUES[n]]

    def qwen3_flags(self, names: tuple[str, ...] = ARCHITECTURE_TOGGLES) -> str:
        """The flags that put `names` back at Qwen3's values ("--mlp swiglu --no-attn-gate"), for a refusal to
        say how to train a model it accepts."""
        return " ".join(qwen3_flag(n) for n in names if getattr(self, n) != QWEN3_VALUES[n])

    @classmethod
    def from_record(cls, record: dict) -> "ModelConfig":
        """The config a checkpoint recorded (with_qwen3_toggles)."""
        return cls(**with_qwen3_toggles(record))

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def resolved_ffn_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        swiglu = _round_up(math.ceil(8 * self.n_embd / 3), FFN_MULTIPLE)
        return swiglu if self.mlp == "swiglu" else 3 * swiglu // 2

    @property
    def fc1_rows(self) -> int:
        """Rows of the MLP's first matrix: SwiGLU's fused [gate; up], or ReLU^2's one."""
        return (2 if self.mlp == "swiglu" else 1) * self.resolved_ffn_dim

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


class KVCache:
    """Keys and values of the positions seen so far, for incremental decoding.

    One pair of [B, n_kv_head, max_len, head_dim] buffers per layer, and `pos`, the number of positions
    filled. `GPT.forward(idx, cache=cache)` writes the keys and values of idx at pos.. and advances pos; the
    rotation uses absolute positions, so a sequence fed in pieces gets the logits of one full pass. Setting
    pos back rewinds the cache. `dtype` must be the dtype the attention runs in (the model's, or autocast's).
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        self.max_len = config.max_seq_len if max_len is None else max_len
        shape = (batch_size, config.n_kv_head, self.max_len, config.resolved_head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.pos = 0
        self.last = None  # [B, 1]: the token at pos - 1, which smear and the bigram embedding read at pos


def _cache_write(kv: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor, start: int):
    """Store k, v [B, K, T, hd] at positions start..start+T of one layer's buffers; -> keys, values of 0..start+T."""
    k_buf, v_buf = kv
    end = start + k.shape[2]
    k_buf[:, :, start:end] = k
    v_buf[:, :, start:end] = v
    return k_buf[:, :, :end], v_buf[:, :, :end]


def _offset_causal_mask(T: int, start: int, device: torch.device) -> torch.Tensor:
    """[T, start+T] bool: query i sits at position start+i and sees keys 0..start+i. SDPA's is_causal aligns
    its mask to the top-left corner, which is wrong as soon as there are more keys than queries."""
    keys = torch.arange(start + T, device=device)
    return keys <= torch.arange(start, start + T, device=device)[:, None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in x's dtype (its kernels accumulate in float32 for bf16). CUDA's autocast would run it
    in float32 and return float32 for a bf16 x (the QK-norm's, or a bf16 residual stream's), so it is left out
    of autocast. Under FSDP2's mixed precision a block's weights arrive in bf16 while the residual stream stays
    float32 (as under DDP); with mixed dtypes PyTorch falls back from its fused kernel, so the weight is cast to
    x's dtype instead."""
    if x.dtype == torch.float32 or not torch.is_autocast_enabled(x.device.type):
        return F.rms_norm(x, weight.shape, weight.to(x.dtype), eps)
    with torch.autocast(x.device.type, enabled=False):
        return F.rms_norm(x, weight.shape, weight.to(x.dtype), eps)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameter, same state dict) through rms_norm()."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class LayerNormLinear(nn.Module):
    """RMSNorm followed by a bias-free linear layer (Transformer Engine's LayerNormLinear, plain). With
    return_layernorm_output, forward returns (output, the normed input), as TE's does."""

    def __init__(self, in_features: int, out_features: int, eps: float, return_layernorm_output: bool = False):
        super().__init__()
        self.eps = eps
        self.return_layernorm_output = return_layernorm_output
        self.layer_norm_weight = nn.Parameter(torch.empty(in_features))
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        # The GEMM as an attribute: torchao FP8 training swaps in a float8 one (fp8.py); the weight stays here.
        self.matmul = F.linear

    def forward(self, x: torch.Tensor):
        normed = rms_norm(x, self.layer_norm_weight, self.eps)
        out = self.matmul(normed, self.weight)
        return (out, normed) if self.return_layernorm_output else out


class LayerNormMLP(nn.Module):
    """RMSNorm then SwiGLU: fc2(silu(gate) * up), with fc1's rows [gate; up] (TE's LayerNormMLP, plain); or
    with kind "relu2", fc2(relu(fc1 x)^2), fc1 of ffn_dim rows."""

    def __init__(self, n_embd: int, ffn_dim: int, eps: float, kind: str = "swiglu"):
        super().__init__()
        self.eps = eps
        self.kind = kind
        self.layer_norm_weight = nn.Parameter(torch.empty(n_embd))
        self.fc1_weight = nn.Parameter(torch.empty((2 if kind == "swiglu" else 1) * ffn_dim, n_embd))
        self.fc2_weight = nn.Parameter(torch.empty(n_embd, ffn_dim))
        self.matmul = F.linear  # as in LayerNormLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.matmul(rms_norm(x, self.layer_norm_weight, self.eps), self.fc1_weight)
        if self.kind == "relu2":
            return self.matmul(F.relu(h).square(), self.fc2_weight)
        gate, up = h.chunk(2, dim=-1)
        return self.matmul(F.silu(gate) * up, self.fc2_weight)


def gate_heads(y: torch.Tensor, normed: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """Attention's output y [B, T, H, hd] times each head's gate sigmoid(x W_g^T) [B, T, H, 1], x the normed
    attention input [B, T, D]: the plain and the Transformer Engine attention both gate through this."""
    return y * torch.sigmoid(F.linear(normed, gate_weight))[..., None].to(y.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.resolved_head_dim
        qkv_rows = (config.n_head + 2 * config.n_kv_head) * self.head_dim
        # The gate reads the normed input the QKV GEMM reads: the fused module hands it over rather than the
        # norm running twice.
        self.qkv = LayerNormLinear(config.n_embd, qkv_rows, config.norm_eps, return_layernorm_output=config.attn_gate)
        self.q_norm = RMSNorm(self.head_dim, eps=config.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.norm_eps)
        self.proj = nn.Linear(config.n_head * self.head_dim, config.n_embd, bias=False)
        # A plain parameter, not an nn.Linear: it stays out of torchao's float8 conversion (a 4-row GEMM).
        self.gate_weight = nn.Parameter(torch.empty(config.n_head, config.n_embd)) if config.attn_gate else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None, start: int = 0, value_embed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """kv: this layer's KVCache buffers (None in training); x holds positions start..start+T. value_embed
        [B, T, n_kv_head * head_dim]: added to the values (GPT.forward has scaled it by the layer's scalar)."""
        B, T, _ = x.shape
        qkv, normed = self.qkv(x) if self.gate_weight is not None else (self.qkv(x), None)
        q, k, v = qkv.split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1
        )
        if value_embed is not None:
            v = v + value_embed.to(v.dtype)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        # Norm and rotate in float32: under autocast q and k arrive in bf16, while the norm weights and the
        # rotation tables are float32; the result goes back to v's dtype for the attention kernel.
        q = apply_rope(self.q_norm(q.float()), cos, sin).to(v.dtype)
        k = apply_rope(self.k_norm(k.float()), cos, sin).to(v.dtype)
        if kv is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k, v = _cache_write(kv, k, v, start)
            mask = _offset_causal_mask(T, start, x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        y = y.transpose(1, 2)  # [B, T, H, hd]
        if self.gate_weight is not None:
            y = gate_heads(y, normed, self.gate_weight)
        return self.proj(y.reshape(B, T, self.n_head * self.head_dim))


class Block(nn.Module):
    """One pre-norm transformer block. Another implementation of the same block (fp8.py's Transformer Engine
    one) subclasses it, keeps the parameter names, repeats this residual wiring in a forward that also hands
    TE's modules their micro-step, and sets its own `backend` name."""

    backend = "plain"

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn = Attention(config)
        self.mlp = LayerNormMLP(config.n_embd, config.resolved_ffn_dim, config.norm_eps, config.mlp)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None, start: int = 0, value_embed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(x, cos, sin, kv, start, value_embed)
        return x + self.mlp(x)


def value_embed_layers(config: ModelConfig) -> dict[int, int]:
    """Layer -> the value-embedding table it adds, for config.value_embeds tables: table i feeds layer i and
    its mirror n_layer-1-i (one layer when they coincide), so the first and last layers share tables."""
    layers = {}
    for table in range(config.value_embeds):
        layers[table] = layers[config.n_layer - 1 - table] = table
    return dict(sorted(layers.items()))


def previous_tokens(idx: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor:
    """The id of the token before each position of idx [B, T]: `before` [B, 1] (the token ahead of idx, a
    KV cache's last) at the first position, or NO_TOKEN there when None (a sequence's first token)."""
    first = torch.full_like(idx[:, :1], NO_TOKEN) if before is None else before
    return torch.cat([first, idx[:, :-1]], dim=1)


def bigram_rows(previous: torch.Tensor, idx: torch.Tensor, rows: int) -> torch.Tensor:
    """The bigram table's row of each (previous token, token) pair: a hash into the first rows - 1 rows, and
    the last row for a token with no previous one."""
    hashed = (previous * BIGRAM_HASH_MULTIPLIER + idx) % (rows - 1)
    return torch.where(previous == NO_TOKEN, rows - 1, hashed)


def smear(e: torch.Tensor, e_before: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Token embeddings e [B, T, D] plus each one's predecessor times sigmoid(ê w), ê the normed e: e_before
    [B, 1, D] is the embedding ahead of the first position (a KV cache's), or None where there is none."""
    first = torch.zeros_like(e[:, :1]) if e_before is None else e_before.to(e.dtype)
    gate = torch.sigmoid(F.linear(F.rms_norm(e, (e.shape[-1],), eps=eps), weight.to(e.dtype)))
    return e + gate * torch.cat([first, e[:, :-1]], dim=1)


class GPT(nn.Module):
    loss_chunk_tokens = LOSS_CHUNK_TOKENS  # tokens per chunk of the fused lm_head + loss (linear_cross_entropy)
    # The residual stream's dtype, or None for the embedding's (float32): under bf16 autocast the GEMMs run in
    # bf16 either way, and bf16 here halves the bytes of every norm, gate and residual add between them.
    activation_dtype: torch.dtype | None = None
    fp8_head = False  # the fused head's GEMMs in float8 (linear_cross_entropy's fp8; --fp8-head sets it)

    def __init__(self, config: ModelConfig, block: type[Block] = Block):
        """block: the class of every transformer block; a subclass of Block with the same parameter names
        (fp8.TEBlock builds them from Transformer Engine modules). The embedding, final norm and lm_head are
        plain PyTorch whatever the block."""
        super().__init__()
        config.validate()
        unsupported = config.toggles_on(PLAIN_BACKEND_TOGGLES) if block.backend != "plain" else []
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)}: not implemented for the {block.backend} backend "
                             f"(--fp8 te); add {config.qwen3_flags(PLAIN_BACKEND_TOGGLES)}, or use the plain blocks "
                             "(--fp8 off or torchao)")
        self.config = config
        self.backend = block.backend
        vocab, dim = config.padded_vocab_size, config.n_embd
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        # Recipe toggles' parameters, registered only when on, so that a model without them keeps its state dict.
        self.ve_layers = value_embed_layers(config)
        if config.value_embeds:
            ve_dim = config.n_kv_head * config.resolved_head_dim
            self.value_embeds = nn.ModuleList(nn.Embedding(vocab, ve_dim) for _ in range(config.value_embeds))
            self.value_embed_lambdas = nn.Parameter(torch.empty(len(self.ve_layers)))  # one per layer fed
        if config.unet_skips:
            self.unet_weights = nn.Parameter(torch.empty(config.n_layer // 2))  # one per skip
        if config.smear:
            self.smear_weight = nn.Parameter(torch.empty(1, dim))
        if config.bigram_embed:
            self.bigram_embed = nn.Embedding(config.bigram_embed, dim)
        if config.embed_skips:
            self.embed_skip_weights = nn.Parameter(torch.empty(config.n_layer - 1))  # blocks 1.. take the embedding
        # Non-persistent: derived from the config, so checkpoints stay exactly the parameter contract.
        self.register_buffer("rope_cos", torch.empty(config.max_seq_len, config.resolved_head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(config.max_seq_len, config.resolved_head_dim), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and the rotary tables; deterministic under torch.manual_seed.

        Matrices and the embeddings (value embeddings too): normal(0, 0.02). The two projections that write
        into the residual stream (attn.proj, mlp.fc2) are scaled by 1/sqrt(2 * n_layer) so the stream's variance
        does not grow with depth, or with config.zero_init_proj are zero, so that every block starts as the
        identity and the gradient first reaches them alone (modded-nanogpt's recipe; they still draw from the
        generator, so the other weights are the same either way). Norm weights and the toggles' scalars
        (value_embed_lambdas, unet_weights, embed_skip_weights): 1. Attention and smear gate weights: 0, every
        gate 1/2 and alike at the start (a random W_g would gate heads by noise). The bigram table: 0, so that it
        starts as no change to the embedding; at the embedding's LR its rows move fast. An untied lm_head:
        normal(0, 0.02), or 0 with config.head_init "zero" (modded-nanogpt's: the first logits are uniform).
        Safe to call on a model materialised from the meta device (`to_empty`), which also breaks the embedding
        tie, so the tie is restored here.
        """
        if self.config.tie_embeddings and self.lm_head.weight is not self.embed.weight:
            self.lm_head.weight = self.embed.weight
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        for name, param in self.named_parameters():
            if param.ndim == 1:
                nn.init.ones_(param)
            elif name.endswith(("attn.proj.weight", "mlp.fc2_weight")):
                nn.init.normal_(param, std=residual_std)
                if self.config.zero_init_proj:
                    nn.init.zeros_(param)
            elif name.endswith(ZERO_INIT) or (name == "lm_head.weight" and self.config.head_init == "zero"):
                nn.init.zeros_(param)
            else:
                nn.init.normal_(param, std=INIT_STD)
        cos, sin = rope_cos_sin(self.config.resolved_head_dim, self.config.max_seq_len, self.config.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None,
        reduction: str = "mean",
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx [B, T] -> (logits [B, T, padded_vocab_size], None), or with targets [B, T] (None, the mean
        float32 cross-entropy; with reduction "none", under torch.no_grad, each token's loss [B, T]).

        With targets the logits are never materialised: linear_cross_entropy fuses the lm_head with the loss,
        chunk by chunk, so at GPT-2's vocabulary the step does not hold gigabytes of logits. Call without
        targets for logits. The padding columns are ordinary logits. No target ever names them, so training
        only pushes them down and they take a vanishing share of the softmax; samplers should still slice to
        vocab_size. Targets equal to -100 are ignored (F.cross_entropy's default).
        With a cache (inference), idx holds the positions cache.pos.. and the cache advances past them.
        """
        T = idx.shape[1]
        start = 0 if cache is None else cache.pos
        if start + T > self.config.max_seq_len:
            raise ValueError(f"sequence length {start + T} exceeds max_seq_len {self.config.max_seq_len}")
        if cache is not None and start + T > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} positions, {start + T} needed")
        cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        x = x0 = self.embed_inputs(idx, None if cache is None or start == 0 else cache.last)
        tables = [table(idx).to(x.dtype) for table in self.value_embeds] if self.config.value_embeds else []
        n_skips = self.config.n_layer // 2 if self.config.unet_skips else 0
        skips = []  # outputs of the first n_skips blocks; block n_layer-1-i takes skips[i]
        ve_slots = {layer: slot for slot, layer in enumerate(self.ve_layers)}  # value_embed_lambdas' index
        for i, block in enumerate(self.blocks):
            mirror = self.config.n_layer - 1 - i
            if mirror < n_skips:
                x = x + self.unet_weights[mirror] * skips[mirror]
            if i and self.config.embed_skips:
                x = x + self.embed_skip_weights[i - 1] * x0
            extra = {} if cache is None else {"kv": (cache.k[i], cache.v[i]), "start": start}
            if i in ve_slots:
                extra["value_embed"] = self.value_embed_lambdas[ve_slots[i]] * tables[self.ve_layers[i]]
            x = block(x, cos, sin, **extra)  # tensors alone positional: what FSDP2's hooks and checkpointing see
            if i < n_skips:
                skips.append(x)
        if cache is not None:
            cache.pos, cache.last = start + T, idx[:, -1:]
        x = self.norm(x)
        cap = self.config.logit_softcap
        if targets is None:
            return soft_cap(self.lm_head(x), cap), None
        return None, linear_cross_entropy(x, self.lm_head.weight, targets, self.loss_chunk_tokens, reduction,
                                          softcap=cap, fp8=self.fp8_head)

    def embed_inputs(self, idx: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor:
        """The first block's input, in the residual stream's dtype: the token embedding of idx [B, T], with
        the smear and the bigram embedding when on. before [B, 1]: the token ahead of idx (a KV cache's last),
        which the first position looks back at; None at a sequence's start."""
        c = self.config
        x = self.embed(idx)
        if c.smear:
            x = smear(x, None if before is None else self.embed(before), self.smear_weight, c.norm_eps)
        if c.bigram_embed:
            x = x + self.bigram_embed(bigram_rows(previous_tokens(idx, before), idx, c.bigram_embed))
        return x.to(self.activation_dtype or self.embed.weight.dtype)

    def row_blocks(self) -> dict[str, list[int]]:
        """Row split of each fused weight, by parameter name: qkv into [Q, K, V], fc1 into [gate, up]."""
        c = self.config
        hd, ffn = c.resolved_head_dim, c.resolved_ffn_dim
        blocks = {}
        for i in range(c.n_layer):
            blocks[f"blocks.{i}.attn.qkv.weight"] = [c.n_head * hd, c.n_kv_head * hd, c.n_kv_head * hd]
            blocks[f"blocks.{i}.mlp.fc1_weight"] = [ffn, ffn] if c.mlp == "swiglu" else [ffn]
        return blocks

    def num_params(self) -> int:
        """Unique parameters: a tied embedding / lm_head matrix counts once."""
        return sum(p.numel() for p in self.parameters())
