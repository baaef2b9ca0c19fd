"""loss.linear_cross_entropy against F.cross_entropy over the full logits: the loss, both gradients, the chunks
it cuts and the gradient of one chunk. tests/test_model.py checks the model's loss, which calls it."""

import pytest
import torch
import torch.nn.functional as F

import loss as loss_module
from conftest import targets_with_ignored
from loss import linear_cross_entropy


@pytest.mark.parametrize("chunk", [1, 7, 100])  # one token, a non-divisor of the 33 tokens, all in one chunk
def test_linear_cross_entropy_matches_f_cross_entropy(chunk):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 11, 16, generator=g).requires_grad_()
    weight = (0.5 * torch.randn(64, 16, generator=g)).requires_grad_()
    targets = targets_with_ignored((3, 11), vocab=64)
    loss = linear_cross_entropy(x, weight, targets, chunk)
    (2.5 * loss).backward()  # a grad_output other than 1
    grads = x.grad, weight.grad
    x.grad = weight.grad = None
    expected = F.cross_entropy(F.linear(x, weight).float().flatten(0, 1), targets.flatten(), ignore_index=-100)
    (2.5 * expected).backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grads[0], x.grad)
    torch.testing.assert_close(grads[1], weight.grad)


def test_linear_cross_entropy_backward_can_run_twice():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 8, generator=g).requires_grad_()
    weight = torch.randn(32, 8, generator=g).requires_grad_()
    loss = linear_cross_entropy(x, weight, torch.randint(0, 32, (9,), generator=g), chunk=4)
    loss.backward(retain_graph=True)
    first = x.grad.clone(), weight.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * first[0])
    torch.testing.assert_close(weight.grad, 2 * first[1])


def test_loss_chunks_are_near_equal_and_at_most_max_loss_chunks():
    assert loss_module.loss_chunks(2048, 1024) == 2  # train.py's default micro-batch, 16 x 128
    assert loss_module.loss_chunks(16 * 1024, 1024) == loss_module.MAX_LOSS_CHUNKS == 16  # GPT-2's 16 x 1024
    assert loss_module.loss_chunks(128 * 1024, 1024) == 16  # a larger micro-batch: larger chunks, not more
    assert loss_module.loss_chunks(1, 1024) == loss_module.loss_chunks(0, 1024) == 1
    for n in (1, 64, 1000, 16 * 1024 + 3, 128 * 1024):
        rows = loss_module._row_chunks(n, 1024)
        sizes = [r.stop - r.start for r in rows]
        assert rows[0].start == 0 and rows[-1].stop == n and max(sizes) - min(sizes) <= 1
        assert all(a.stop == b.start for a, b in zip(rows, rows[1:]))
        aligned = loss_module._row_chunks(n, 1024, multiple=16)  # fp8's: each chunk starts at a multiple of 16
        assert aligned[-1].stop == n and len(aligned) == len(rows) and all(r.start % 16 == 0 for r in aligned)
        assert all(a.stop == b.start for a, b in zip(aligned, aligned[1:]))
        if n % 16 == 0:
            assert all((r.stop - r.start) % 16 == 0 for r in aligned)


def test_fp16_loss_chunks_keep_their_size_so_the_weight_gradient_sums_stay_in_range(monkeypatch):
    calls = []
    chunk_loss = loss_module._chunk_loss_and_grad
    spy = lambda *a: calls.append(a[0][0].shape[0]) or chunk_loss(*a)  # noqa: E731  a[0]: (logits, tanh)
    monkeypatch.setattr(loss_module, "_chunk_loss_and_grad", spy)
    monkeypatch.setattr(loss_module, "MAX_LOSS_CHUNKS", 2)
    for dtype, rows in ((torch.float32, [32, 32]), (torch.float16, [8] * 8)):
        calls.clear()
        x = torch.randn(64, 8, dtype=dtype, requires_grad=True)
        weight = torch.randn(32, 8, dtype=dtype, requires_grad=True)
        linear_cross_entropy(x, weight, torch.randint(0, 32, (64,)), chunk=8).backward()
        assert calls == rows, dtype


def test_the_chunk_gradient_is_softmax_minus_one_hot_bit_for_bit_and_zero_on_ignored_rows():
    torch.manual_seed(0)
    x, w = torch.randn(6, 8), torch.randn(11, 8)
    targets = torch.tensor([3, 0, 10, loss_module.IGNORE_INDEX, 7, 3])
    _, grad = loss_module._chunk_loss_and_grad(loss_module._chunk_logits(x @ w.t(), 0.0), targets, True, torch.float32)
    expected = (x @ w.t()).sub(torch.logsumexp(x @ w.t(), dim=-1, keepdim=True)).exp()
    expected.scatter_add_(1, targets.clamp(min=0)[:, None], torch.full((6, 1), -1.0))
    expected[3] = 0.0
    assert torch.equal(grad, expected)


def dequantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as float8 `dtype` holds it (loss.to_float8), back in float32: the operand a float8 GEMM multiplies."""
    t8, scale = loss_module.to_float8(t, dtype)
    return t8.float() * scale


def test_float8_head_is_the_loss_of_its_float8_operands():
    """--fp8-head's GEMMs against float32 math on the dequantized float8 operands: e4m3 x and weight for the
    logits, each chunk's e5m2 softmax gradient for both gradients; only bf16 rounding of the products apart."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 32, generator=g).requires_grad_()
    weight = (0.5 * torch.randn(128, 32, generator=g)).requires_grad_()
    targets = targets_with_ignored((3, 16), vocab=128).flatten()
    loss = linear_cross_entropy(x, weight, targets, chunk=16, fp8=True)
    loss.backward()
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    xq, wq = dequantized(x.detach(), e4m3), dequantized(weight.detach(), e4m3)
    logits = (xq @ wq.t()).bfloat16().float()
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets), rtol=1e-5, atol=1e-5)
    grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(weight)
    valid = (targets != loss_module.IGNORE_INDEX).sum()
    for rows in loss_module._row_chunks(48, 16, multiple=16):
        kept = (targets[rows] >= 0)[:, None]
        gq = dequantized((logits[rows].softmax(-1) - F.one_hot(targets[rows].clamp(min=0), 128)) * kept, e5m2)
        grad_x[rows] = (gq @ wq).bfloat16().float()
        grad_w += (gq.t() @ xq[rows]).bfloat16().float()
    torch.testing.assert_close(x.grad, grad_x / valid, rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(weight.grad, grad_w / valid, rtol=1e-2, atol=1e-5)


def test_float8_head_is_near_the_full_precision_loss_and_its_evaluation_agrees():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, 64, generator=g)
    weight = 0.2 * torch.randn(256, 64, generator=g)
    targets = targets_with_ignored((4, 64), vocab=256)
    exact = linear_cross_entropy(x, weight, targets)
    fp8 = linear_cross_entropy(x, weight, targets, chunk=48, fp8=True)
    assert abs(fp8 - exact) / exact < 0.01 and fp8 != exact  # e4m3's 3 mantissa bits, averaged over 64 products
    with torch.no_grad():
        per_token = linear_cross_entropy(x, weight, targets, chunk=48, reduction="none", fp8=True)
    torch.testing.assert_close(per_token.sum() / (targets != -100).sum(), fp8)


@pytest.mark.parametrize("n, ok", [(4096, True), (16 * 37, True), (1000, False)])
def test_float8_head_keeps_cudas_float8_gemm_rules(n, ok):
    """On the meta device torch._scaled_mm checks what CUDA's kernel needs (the CPU's does not): the second
    operand column-major, every inner dimension a multiple of 16 (a chunk's rows, in the weight gradient), no
    e5m2 x e5m2. A token count that is not a multiple of 16 (start-up refuses it) is the one that fails."""
    x = torch.empty(n, 64, device="meta", requires_grad=True)
    weight = torch.empty(256, 64, device="meta", requires_grad=True)
    targets = torch.zeros(n, dtype=torch.long, device="meta")
    if not ok:
        with pytest.raises(RuntimeError, match="divisible by 16"):
            loss_module._chunked_loss_and_grads(x, weight, targets, 300, True, fp8=True)
        return
    loss, grad_x, grad_w = loss_module._chunked_loss_and_grads(x, weight, targets, 300, True, fp8=True)
    assert grad_x.shape == x.shape and grad_w.shape == weight.shape
    assert loss_module._chunked_token_losses(x, weight, targets, 300, fp8=True).shape == (n,)


def test_float8_chunks_are_never_empty():
    assert [(r.start, r.stop) for r in loss_module._row_chunks(32, 8, True, 16)] == [(0, 16), (16, 32)]
