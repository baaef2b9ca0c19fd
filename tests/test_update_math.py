"""Tests for update_math.py: Newton-Schulz's quintic band and Polar Express's polynomials (re-derived from the paper's
construction), which blocks share a Newton-Schulz call, NorMuon's rows and cautious decay."""

import math

import pytest
import torch

import update_math
from conftest import with_spectrum


def test_newton_schulz_singular_values_in_quintic_band():
    # Once a singular value is inside [0.68, 1.21] the quintic keeps it there: the polynomial's local
    # max on the band is p(0.5545) = 1.2023 and its local min is p(1.050) = 0.6818.
    torch.manual_seed(0)
    for rows, cols in [(32, 16), (16, 16), (8, 16)]:
        s = torch.linalg.svdvals(update_math.newton_schulz(with_spectrum(rows, cols, 3.0, 0.3), 5, torch.float32))
        assert s.min() > 0.68 and s.max() < 1.21, (rows, cols, s)


def minimax_odd_quintic(lo, hi):
    """The odd quintic closest to 1 in the max norm on [lo, hi], in float64, by the equioscillation theorem: the
    error alternates in sign at lo, the two interior extrema and hi; solve for (a, b, c, error) at those four
    points, move the interior ones to the new polynomial's extrema (p' = 0), repeat to convergence."""
    if lo / hi > 1 - 5e-6:  # the interval is a point: the degree-5 Newton-Schulz (Pade) polynomial, scaled
        return 15 / 8 / hi, -10 / 8 / hi**3, 3 / 8 / hi**5
    points, error = [lo, (3 * lo + hi) / 4, (lo + 3 * hi) / 4, hi], None
    for _ in range(200):
        system = torch.tensor([[x, x**3, x**5, (-1) ** i] for i, x in enumerate(points)], dtype=torch.float64)
        a, b, c, new_error = torch.linalg.solve(system, torch.ones(4, dtype=torch.float64)).tolist()
        root = math.sqrt(9 * b * b - 20 * a * c)
        points = [lo, *sorted(math.sqrt((-3 * b + sign * root) / (10 * c)) for sign in (-1, 1)), hi]
        if error is not None and abs(new_error - error) < 1e-16:
            break
        error = new_error
    return a, b, c


def polar_express_construction(lo, steps, cushion=0.02407327424182761):
    """Polar Express's offline stage as the paper describes it (Section 4 and Appendix G): from [lo, 1], each
    polynomial is minimax on [max(lo, cushion * hi), hi], rescaled so that p(lo) and p(hi) straddle 1
    symmetrically; the next interval is [p(lo), 2 - p(lo)]."""
    hi, table = 1.0, []
    for _ in range(steps):
        a, b, c = minimax_odd_quintic(max(lo, cushion * hi), hi)
        p = lambda x: a * x + b * x**3 + c * x**5  # noqa: E731
        k = 2 / (p(lo) + p(hi))
        a, b, c = a * k, b * k, c * k
        table.append((a, b, c))
        lo = a * lo + b * lo**3 + c * lo**5
        hi = 2 - lo
    return table


def test_polar_express_coefficients_are_the_papers_construction():
    derived = polar_express_construction(1e-3, len(update_math.POLAR_EXPRESS_COEFFICIENTS))
    for ours, theirs in zip(update_math.POLAR_EXPRESS_COEFFICIENTS, derived):
        assert ours == pytest.approx(theirs, rel=1e-8, abs=1e-12)
    schedule, safety = update_math.ns_coefficients("polar-express", 10)
    assert safety == 1.01 and len(schedule) == 10
    a, b, c = update_math.POLAR_EXPRESS_COEFFICIENTS[0]
    assert schedule[0] == (a / 1.01, b / 1.01**3, c / 1.01**5)
    assert schedule[7:] == [(1.875, -1.25, 0.375)] * 3  # the last, unscaled, repeats
    assert update_math.ns_coefficients("quintic", 3) == ([update_math.NS_COEFFICIENTS] * 3, 1.0)


@pytest.mark.parametrize("shape", [(32, 64), (64, 64), (96, 32)])
def test_polar_express_is_closer_to_the_polar_factor_than_the_quintic(shape):
    g = torch.Generator().manual_seed(0)
    m = torch.randn(shape, generator=g)
    u, _, vh = torch.linalg.svd(m.double(), full_matrices=False)
    polar = u @ vh
    errors = {(coeffs, steps): (update_math.newton_schulz(m, steps, torch.float32, coeffs).double() - polar).norm()
              / polar.norm() for coeffs in update_math.NS_COEFF_SCHEMES for steps in (5, 8)}
    # Closer at Muon's 5 steps; and it keeps converging, where the quintic stalls near 0.2 by design (a square
    # Gaussian matrix has singular values below the 1e-3 the polynomials were built for, so it is slower there).
    assert errors["polar-express", 5] < errors["quintic", 5], errors
    assert errors["polar-express", 8] < 0.5 * errors["quintic", 8] and errors["quintic", 8] > 0.1, errors


def test_normuon_evens_out_the_rows_and_keeps_the_rms():
    g = torch.Generator().manual_seed(0)
    ortho = torch.randn(6, 10, generator=g) * torch.tensor([0.1, 1, 2, 3, 4, 5])[:, None]
    state = torch.zeros(6)
    out = update_math.normuon_rows(ortho, state, beta=0.9)
    torch.testing.assert_close(state, 0.1 * ortho.square().mean(1))
    row_norms = out.norm(dim=1)
    torch.testing.assert_close(row_norms, row_norms.mean().expand(6), rtol=1e-5, atol=0)
    torch.testing.assert_close(out.norm(), ortho.norm())
    zeros = update_math.normuon_rows(torch.zeros(3, 4), torch.zeros(3), beta=0.9)  # no gradient yet: no NaN
    assert torch.equal(zeros, torch.zeros(3, 4))


def test_cautious_decay_only_where_update_and_parameter_agree():
    param = torch.tensor([1.0, -1.0, 2.0, -2.0, 0.0, 3.0])
    update = torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, 0.0])
    update_math.cautious_decay_(param, update, 0.1)
    assert param.tolist() == pytest.approx([0.9, -0.9, 2.0, -2.0, 0.0, 2.7])
    agree, plain = torch.tensor([1.0, -2.0]), torch.tensor([1.0, -2.0])
    update_math.cautious_decay_(agree, torch.tensor([3.0, -1.0]), 0.1)
    assert torch.equal(agree, plain.mul_(1 - 0.1))


def test_wide_batches_put_blocks_of_one_shape_once_turned_wide_in_one_call():
    shapes = [(1280, 768), (768, 768), (6144, 768), (768, 3072)]  # GPT-2 small's qkv, proj, fc1, fc2
    splits = [(768, 256, 256), (768,), (3072, 3072), (768,)]
    assert update_math.wide_batches(shapes, splits) == [[(0, 0), (1, 0)], [(0, 1), (0, 2)], [(2, 0), (2, 1), (3, 0)]]
    assert update_math.wide_batches([(4, 8), (16, 4)], [(4,), (8, 8)]) == [[(0, 0), (1, 0), (1, 1)]]


def test_newton_schulz_with_an_infinite_eps_gives_zeros():
    """A skipped step's eps: the division by norm + inf makes any finite input zeros, which the iteration keeps."""
    g = torch.randn(3, 4, 6)
    for dtype in (torch.bfloat16, torch.float32):
        out = update_math.newton_schulz(g, 5, dtype, eps=torch.tensor(math.inf))
        assert out.dtype == dtype and torch.equal(out, torch.zeros_like(out))
    assert torch.equal(update_math.newton_schulz(g, 5, torch.float32, eps=torch.tensor(update_math.NS_EPS)),
                       update_math.newton_schulz(g, 5, torch.float32))
