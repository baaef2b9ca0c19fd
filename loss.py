"""The lm_head and the cross-entropy fused, chunk by chunk: no step ever holds the [tokens, vocabulary] logits.

linear_cross_entropy(x, weight, targets) is F.cross_entropy(F.linear(x, weight).float(), targets): the same mean
float32 loss and the same gradients, computed a chunk of rows at a time. With autograd on, the forward computes
both gradients as it goes (_LinearCrossEntropy: the head keeps its three GEMMs, and nothing [N, V] is saved for
backward); reduction "none" gives each token's loss for evaluation. model.GPT calls it for its loss; memory.py
prices its chunks.
"""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # F.cross_entropy's default: targets equal to it add nothing to the loss or its count
# Tokens per chunk of the fused lm_head + cross-entropy where no memory budget sets it (training's comes from the
# device: memory.loss_chunk_tokens). At GPT-2's loss shape (16 x 1024 tokens, d=768, V=50,304, bf16) the unfused
# loss holds bf16 logits (1.5 GiB), their fp32 copy (3.1 GiB), the saved fp32 log-softmax (3.1 GiB) and as much
# again for the gradients; a chunk of 1024 tokens holds its bf16 logits or gradient (98 MiB) beside their fp32
# copy (196 MiB), plus the bf16 weight (74 MiB), one chunk's weight gradient (74 MiB) and the fp32 gradients kept
# for backward (147 + 48 MiB): about 0.62 GiB, under 1/8 of the unfused forward's 7.7 GiB.
LOSS_CHUNK_TOKENS = 1024
# At most this many chunks per call: a larger micro-batch gets larger chunks instead of more of them, so the
# loss path stays within 1/MAX_LOSS_CHUNKS of the unfused one at any micro-batch, torch.compile traces at
# most this many copies of the chunk body, and each chunk's read-modify-write of the float32 [V, d] weight
# gradient happens at most this many times per micro-batch.
MAX_LOSS_CHUNKS = 16
# Under fp8 every chunk starts at a multiple of this many rows: the chunk's rows are the inner dimension of the
# weight-gradient GEMM, which CUDA's float8 GEMM wants a multiple of 16 (the blocks' GEMMs ask the same of the
# micro-batch's tokens: fp8.FP8_TOKEN_MULTIPLE).
FLOAT8_ROWS = 16


def _gemm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear's matmul would run in on x: autocast's where it is on for x's device, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _token_losses(logits: torch.Tensor, targets: torch.Tensor):
    """float32 logits [C, V], targets [C] -> (each token's cross-entropy [C], 0 on ignored rows; the logsumexp
    [C]; the not-ignored mask [C]; the targets [C, 1] with ignored rows pointing at column 0). The training
    loss sums the first; evaluation (reduction "none") keeps it per token, so both share these numerics."""
    lse = logits.logsumexp(dim=-1)
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)[:, None]  # ignored rows gather column 0, then count for nothing
    return torch.where(valid, lse - logits.gather(1, safe).squeeze(1), 0.0), lse, valid, safe


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap): every logit inside (-cap, cap), near-identity well inside; cap 0: logits."""
    return cap * torch.tanh(logits / cap) if cap else logits


def _chunk_logits(raw: torch.Tensor, softcap: float):
    """A chunk's GEMM output -> (its float32 logits, soft-capped when softcap; with a cap also tanh(z / cap) of
    the raw logits z, which the backward needs (d capped / dz = 1 - tanh^2), else None)."""
    logits = raw.float()
    if not softcap:
        return logits, None
    tanh = logits.div_(softcap).tanh_()  # in the raw logits' storage
    return tanh * softcap, tanh


def to_float8(t: torch.Tensor, dtype: torch.dtype, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """t in float8 `dtype` with one scale for the whole tensor (current scaling: its amax now maps to the
    format's largest value) -> (the float8 tensor, the float32 scale that undoes it, as torch._scaled_mm
    takes it). in_place: t (float32, not needed after) is divided in its own storage, with no copy."""
    scale = t.detach().abs().amax().float().clamp(min=1e-12) / torch.finfo(dtype).max
    return (t.div_(scale) if in_place else t.float() / scale).to(dtype), scale


def _float8_mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) in bf16 from float8 a (row-major) and b (column-major)."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


class _Gemms:
    """The head's three GEMMs for one call, in the dtype nn.Linear's would run in (autocast's, when on)."""

    row_multiple = 1  # each chunk starts at a multiple of this many rows (_row_chunks)

    def __init__(self, x: torch.Tensor, weight: torch.Tensor):
        self.grad_dtype = _gemm_dtype(x)  # the logits' gradient is rounded to it: the GEMMs' input dtype
        self.x, self.w = x, weight.to(self.grad_dtype)

    def logits(self, rows: slice) -> torch.Tensor:
        self.rows, self.x_chunk = rows, self.x[rows].to(self.grad_dtype)  # cast once: grads reuses it
        return F.linear(self.x_chunk, self.w)

    def grads(self, rows: slice, grad_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the chunk's gradient w.r.t. x, its part of the gradient w.r.t. the weight), right after
        logits(rows)."""
        assert rows == self.rows, "grads follows logits of the same rows"
        return grad_logits @ self.w, grad_logits.t() @ self.x_chunk


class _Float8Gemms(_Gemms):
    """The same GEMMs in float8 (--fp8-head): x and the weight in e4m3 with one scale each per call, each
    chunk's logit gradient (softmax minus one-hot, from float32) in e5m2 with one scale per chunk, every
    product in bf16. torch._scaled_mm wants its second operand column-major: the weight's transposed view is,
    for the logits; the gradients' GEMMs take column-major copies."""

    row_multiple = FLOAT8_ROWS

    def __init__(self, x: torch.Tensor, weight: torch.Tensor):
        self.grad_dtype = torch.float32
        self.x, self.sx = to_float8(x, torch.float8_e4m3fn)
        self.w, self.sw = to_float8(weight, torch.float8_e4m3fn)
        self.w_columns = None  # made on the first gradient: evaluation never needs it

    def logits(self, rows: slice) -> torch.Tensor:
        return _float8_mm(self.x[rows], self.sx, self.w.t(), self.sw)

    def grads(self, rows: slice, grad_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.w_columns is None:
            self.w_columns = self.w.t().contiguous().t()
        g, sg = to_float8(grad_logits, torch.float8_e5m2, in_place=True)  # float32, of no use after
        x_columns = self.x[rows].t().contiguous().t()
        return _float8_mm(g, sg, self.w_columns, self.sw), _float8_mm(g.t().contiguous(), sg, x_columns, self.sx)


def _chunk_loss_and_grad(capped: tuple[torch.Tensor, torch.Tensor | None], targets: torch.Tensor, with_grad: bool,
                         grad_dtype: torch.dtype):
    """One chunk: _chunk_logits' (float32 logits [C, V], tanh or None), targets [C]. The caller makes them in
    the call's argument, so the GEMM's own output (bf16 under autocast) is freed before the softmax.

    -> (the summed float32 cross-entropy of its non-ignored tokens, and with_grad, the gradient of that sum
    w.r.t. the logits, softmax minus one-hot, zero on ignored rows, in grad_dtype; else None).
    The softmax is computed in the float32 logits' own storage: one [C, V] float32 buffer serves both (two
    with a soft cap, whose tanh the gradient is then multiplied through).
    """
    logits, tanh = capped
    losses, lse, valid, safe = _token_losses(logits, targets)
    loss = losses.sum()
    if not with_grad:
        return loss, None
    # An ignored row's softmax is exp(z - inf) = 0: its zero gradient costs no pass of its own over [C, V].
    grad = logits.sub_(torch.where(valid, lse, torch.inf)[:, None]).exp_()
    if torch.compiler.is_compiling():  # minus one-hot pointwise, which compile fuses into the softmax's kernel
        grad.add_((torch.arange(grad.shape[1], device=grad.device) == safe) & valid[:, None], alpha=-1)
    else:  # eager: the C target entries alone, bit for bit the pointwise form's x - 1
        grad.scatter_add_(1, safe, -valid[:, None].to(grad.dtype))
    if tanh is not None:
        grad.mul_(tanh.square_().neg_().add_(1.0))
    return loss, grad.to(grad_dtype)


def loss_chunks(n_tokens: int, chunk_tokens: int, capped: bool = True) -> int:
    """How many near-equal chunks linear_cross_entropy cuts n_tokens rows into: chunks of about chunk_tokens,
    at most MAX_LOSS_CHUNKS of them (then larger) when capped."""
    count = -(-n_tokens // chunk_tokens)
    return max(1, min(MAX_LOSS_CHUNKS, count) if capped else count)


def _row_chunks(n_tokens: int, chunk_tokens: int, capped: bool = True, multiple: int = 1) -> list[slice]:
    """The row ranges of loss_chunks(n_tokens, chunk_tokens, capped) near-equal chunks, each starting at a
    multiple of `multiple` (sizes differ by at most one multiple; the last takes any remainder).

    Under torch.compile n_tokens may be symbolic: the chunk count is the only thing the trace fixes, so
    micro-batches with the same count share one graph."""
    count = min(loss_chunks(n_tokens, chunk_tokens, capped), max(1, n_tokens // multiple))  # none left empty
    bounds = [multiple * (n_tokens // multiple * i // count) for i in range(count)] + [n_tokens]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def _chunked_loss_and_grads(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                            with_grad: bool, softcap: float = 0.0, fp8: bool = False):
    """x [N, D], weight [V, D], targets [N] -> (mean cross-entropy of F.linear(x, weight), and with_grad
    its float32 gradients w.r.t. x and weight; else None, None), in the chunks of _row_chunks(N, chunk), with
    the GEMMs of _Float8Gemms when fp8, else of _Gemms.

    Each chunk's gradient is its softmax minus one-hot, entries in [-1, 1], rounded to the GEMM dtype before
    any scaling: under fp16 that is as safe as the reference's loss-scaled gradient, and one chunk's fp16 weight
    GEMM output sums only that chunk's rows, so under fp16 the chunks keep about `chunk` rows, however many
    (a sum over N/16 rows of a frequent target could pass fp16's 65,504). The 1/count of the mean is applied in
    float32 at the end.
    """
    gemms = _Float8Gemms(x, weight) if fp8 else _Gemms(x, weight)
    count = (targets != IGNORE_INDEX).sum()
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    grad_w, grad_x = None, torch.empty(x.shape, dtype=torch.float32, device=x.device) if with_grad else None
    for rows in _row_chunks(x.shape[0], chunk, gemms.grad_dtype != torch.float16, gemms.row_multiple):
        chunk_loss, grad_logits = _chunk_loss_and_grad(_chunk_logits(gemms.logits(rows), softcap), targets[rows],
                                                       with_grad, gemms.grad_dtype)
        loss = loss + chunk_loss
        if with_grad:
            grad_x[rows], part = gemms.grads(rows, grad_logits)
            grad_w = part.float() if grad_w is None else grad_w.add_(part)  # the first part starts the float32 sum
    if not with_grad:
        return loss / count, None, None
    return loss / count, grad_x.div_(count), grad_w.div_(count)


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of F.linear(x, weight) whose backward needs neither x nor weight: the forward
    computes both gradients as it goes, and the backward scales them by grad_output.

    Why this design rather than recomputing each chunk's logits in backward: the head keeps its three
    GEMMs (logits, grad x, grad weight), where recomputing would add a fourth, a third more of the head's
    FLOPs (about 10% of a GPT-2-small step); what it keeps for backward, the float32 gradients ([N, D] and
    [V, D]), is small next to [N, V]; and the backward has no GEMM to run, so no autocast state to restore
    and no weight to hold or re-gather. The price: the gradient work is done even if no backward follows,
    which is why linear_cross_entropy only calls this when autograd will want it.
    """

    @staticmethod
    def forward(ctx, x, weight, targets, chunk, softcap, fp8):
        loss, grad_x, grad_w = _chunked_loss_and_grads(x, weight, targets, chunk, True, softcap, fp8)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.dtypes = x.dtype, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        # Out of place: the saved gradients must survive a backward with retain_graph=True.
        return (grad_x * grad_loss).to(x_dtype), (grad_w * grad_loss).to(w_dtype), None, None, None, None


def _chunked_token_losses(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                          softcap: float = 0.0, fp8: bool = False) -> torch.Tensor:
    """x [N, D], weight [V, D], targets [N] -> each token's float32 cross-entropy [N] (0 where ignored),
    in the chunks of _row_chunks(N, chunk), with no gradient work."""
    gemms = _Float8Gemms(x, weight) if fp8 else _Gemms(x, weight)
    losses = torch.empty(targets.shape, dtype=torch.float32, device=x.device)
    for rows in _row_chunks(x.shape[0], chunk, multiple=gemms.row_multiple):
        losses[rows] = _token_losses(_chunk_logits(gemms.logits(rows), softcap)[0], targets[rows])[0]
    return losses


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int = LOSS_CHUNK_TOKENS, reduction: str = "mean", softcap: float = 0.0,
                         fp8: bool = False) -> torch.Tensor:
    """F.cross_entropy(soft_cap(F.linear(x, weight).float(), softcap), targets, reduction=reduction) without
    ever holding all the logits.

    x [..., D], weight [V, D], targets [...] (x's leading dims). The same mean float32 cross-entropy
    (log-softmax over all V columns; targets equal to IGNORE_INDEX left out of the sum and the count) and the
    same gradients w.r.t. x and weight, computed a chunk of rows at a time (about `chunk` tokens, at most
    MAX_LOSS_CHUNKS chunks), so the [N, V] logits, their float32 copy and their gradient never exist at
    once. The GEMMs run in the dtype nn.Linear's would (autocast's, when on). Without autograd (torch.no_grad,
    or nothing requiring grad) no gradient is computed. reduction "none" gives each token's loss, shaped like
    targets (0 where ignored), for evaluation (bits per byte, multiple-choice scoring): it has no backward, so
    it refuses to run where autograd would want one. fp8: the three GEMMs in float8 (_Float8Gemms), each
    chunk starting at a multiple of FLOAT8_ROWS rows.
    """
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    shape = targets.shape
    x, targets = x.flatten(0, -2), targets.flatten()
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if reduction == "none":
        if wants_grad:
            raise ValueError("reduction='none' has no backward: call it under torch.no_grad()")
        return _chunked_token_losses(x, weight, targets, chunk, softcap, fp8).view(shape)
    if wants_grad:
        return _LinearCrossEntropy.apply(x, weight, targets, chunk, softcap, fp8)
    return _chunked_loss_and_grads(x, weight, targets, chunk, False, softcap, fp8)[0]
