"""An update's arithmetic: Newton-Schulz, NorMuon's rows, the update's scale, cautious weight decay.

The arithmetic of an optimizer's update, as functions of tensors that know nothing of optimizers or ranks:
Muon's Newton-Schulz with its polynomials (the quintic, Polar Express) and which blocks share a batched call,
NorMuon's row normalisation and the update's scale; cautious weight decay, which AdamW uses too; the step's
scalars on the device. muon.py holds the optimizer: its state, the stacks it steps and the split of the work
across ranks; optim.py holds AdamW.
"""

import math

import torch

MUON_SCALES = ("original", "match_rms_adamw")
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_COEFF_SCHEMES = ("quintic", "polar-express")
# Polar Express (Amsel, Persson, Musco, Gower 2025, Algorithm 1): per iteration, the odd quintic a x + b x^3 +
# c x^5 that is the minimax (equioscillating) approximation of 1 on the interval the previous ones leave, from
# [1e-3, 1], cushioned at 0.0240733 x the upper end and recentred on 1; the 8th repeats from then on.
# tests/test_update_math.py re-derives them. Each but the last is applied as p(x / 1.01) against round-off growth.
POLAR_EXPRESS_COEFFICIENTS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS_SAFETY = 1.01
# NorMuon: added to the root of a row's second moment; orthogonalised rows have mean squares near 1/cols.
NORMUON_EPS = 1e-8

def scalar_dtype(device: torch.device) -> torch.dtype:
    """The dtype of a step's scalars computed on the device: float64, as Python computes them on the host, so
    that they round to what a host-computed scalar would; MPS has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def per_step(skip: torch.Tensor, value: float, skipped: float, dtype: torch.dtype) -> torch.Tensor:
    """`value`, or `skipped` where skip (a bool scalar): a scalar made on skip's device. A tensor made from a
    Python number there would be copied from the host, which waits for the GPU; a fill does not."""
    return torch.full((), value, dtype=dtype, device=skip.device).masked_fill_(skip, skipped)


def ns_coefficients(scheme: str, steps: int) -> tuple[list[tuple[float, float, float]], float]:
    """-> ((a, b, c) of each of `steps` iterations, the factor the input's norm is scaled by first).

    "quintic": the same polynomial every time (3.4445, -4.7750, 2.0315); it trades convergence for speed,
    leaving singular values roughly in [0.7, 1.2] rather than at 1. "polar-express": Polar Express's
    per-iteration polynomials with their safety factor: p(x / 1.01) instead of p(x), for all but the last of
    the table (the Newton-Schulz fixed point, repeated beyond it), and the input divided by 1.01 x its norm, so
    that round-off cannot push a singular value past the interval the next polynomial is built for.
    """
    if scheme == "quintic":
        return [NS_COEFFICIENTS] * steps, 1.0
    s = POLAR_EXPRESS_SAFETY
    table = [(a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS_COEFFICIENTS[:-1]]
    table.append(POLAR_EXPRESS_COEFFICIENTS[-1])
    return table[:steps] + [table[-1]] * (steps - len(table)), s


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype, coeffs: str = "quintic",
                  eps: float | torch.Tensor = NS_EPS) -> torch.Tensor:
    """Approximately orthogonalise g (push its singular values towards 1) with `steps` odd quintic iterations
    X <- a X + b (X X^T) X + c (X X^T)^2 X, their coefficients from ns_coefficients(coeffs); g is one matrix
    [rows, cols] or a stack of same-shape ones [n, rows, cols], each orthogonalised on its own. Wide
    orientation keeps X X^T small. eps keeps a zero matrix's first division finite (a scalar tensor of inf makes
    the result zeros for any finite g, as a skipped step wants).
    """
    schedule, safety = ns_coefficients(coeffs, steps)
    x = g.to(dtype)
    single = x.ndim == 2
    if single:
        x = x[None]
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    # The Frobenius norm bounds the spectral norm, so the iteration starts in range.
    norm = torch.linalg.matrix_norm(x, keepdim=True)
    x = x / ((norm * safety if safety != 1 else norm) + eps)
    for a, b, c in schedule:
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    x = x.mT if tall else x
    return x[0] if single else x


def newton_schulz_flops(rows: int, cols: int) -> int:
    """Multiply-adds of one Newton-Schulz iteration on a [rows, cols] block, in the wide orientation: the Gram
    matrix, its square, and the product with X."""
    short, long = min(rows, cols), max(rows, cols)
    return 2 * short * short * long + short**3


def wide_batches(shapes: list[tuple[int, int]], splits: list[tuple]) -> list[list[tuple[int, int]]]:
    """The Newton-Schulz calls of a group of stacks (stack s: matrices of shape shapes[s] cut into row blocks
    splits[s]): lists of (stack, block) whose blocks have one shape once turned wide (rows <= cols), in order of
    first appearance. Newton-Schulz works on the wide orientation, so a tall block shares a call with the wide
    blocks of its transposed shape: at GPT-2 small's shape, three calls (Q with O, K with V, the MLP's gate and
    up with its down projection) for seven kinds of block."""
    batches: dict[tuple, list] = {}
    for s, ((_, cols), split) in enumerate(zip(shapes, splits)):
        for k, rows in enumerate(split):
            batches.setdefault((min(rows, cols), max(rows, cols)), []).append((s, k))
    return list(batches.values())


def wide(block: torch.Tensor) -> torch.Tensor:
    """A stack of blocks [n, rows, cols] in wide orientation: transposed where rows > cols."""
    return block.mT if block.shape[-2] > block.shape[-1] else block


def normuon_rows(ortho: torch.Tensor, row_sq_avg: torch.Tensor, beta: float,
                 skip: torch.Tensor | None = None) -> torch.Tensor:
    """NorMuon (Li et al. 2025): one orthogonalised block [rows, cols] -> the block (in float32, or in row_sq_avg's
    dtype if wider) with each row divided by the root of row_sq_avg, the EMA of the row's mean square (updated
    in place, [rows]), then scaled back to the block's Frobenius norm.

    Orthogonalisation evens out the singular values but not the rows: some output neurons still get much larger
    updates than others, which the per-row second moment evens out; the rescale keeps the update's RMS, so
    muon_scale_factor and the LR mean what they meant. No bias correction: the rescale cancels any factor
    common to all rows. A zero block (no gradient yet, a skipped step) stays zero; where skip (a bool scalar),
    row_sq_avg stays as it was."""
    o = ortho.to(torch.promote_types(row_sq_avg.dtype, torch.float32))
    weight = 1 - beta if skip is None else per_step(skip, 1 - beta, 0.0, row_sq_avg.dtype)
    row_sq_avg.lerp_(o.square().mean(dim=1).to(row_sq_avg.dtype), weight)
    normed = o / (row_sq_avg.to(o.dtype).sqrt() + NORMUON_EPS)[:, None]
    return normed.mul_(torch.linalg.vector_norm(o) / torch.linalg.vector_norm(normed).clamp_min(1e-30))


def cautious_decay_(param: torch.Tensor, update: torch.Tensor, amount: float) -> None:
    """Cautious weight decay (Chen et al. 2025), in place: param *= 1 - amount where the update (the step
    subtracts lr x update) and param have the same sign or either is zero, so that the decay never pulls a
    coordinate against the direction its update moves it. Where every sign agrees this is plain decoupled
    decay, param *= 1 - amount."""
    param.mul_(((update * param) >= 0).to(param.dtype).mul_(-amount).add_(1))


def muon_scale_factor(rows: int, cols: int, mode: str) -> float:
    """LR multiplier for one orthogonalised block of shape [rows, cols]."""
    if mode == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))
