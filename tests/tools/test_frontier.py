"""The frontier maths: Gao et al.'s fit recovers known coefficients, least squares by its own
definition, the frontier and the recommendation on hand-worked numbers."""

from __future__ import annotations

import math

import pytest

from tether.tools.frontier import (
    frontier,
    gao_fit,
    mean_and_stderr,
    peak_then_fall,
)

KLS = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]


def gao(kl, alpha, beta_rl):
    d = math.sqrt(kl)
    return d * (alpha - beta_rl * math.log(d))


def test_fit_recovers_exact_coefficients_and_the_peak():
    gains = [gao(k, 1.0, 0.3) for k in KLS]
    fit = gao_fit(KLS, gains)
    assert fit.alpha == pytest.approx(1.0, abs=1e-9) and fit.beta_rl == pytest.approx(0.3, abs=1e-9)
    assert fit.r2 == pytest.approx(1.0)
    # By hand: d* = exp(1 / 0.3 - 1) = exp(2.3333) = 10.3123, KL* = d*^2 = 106.34, R* = 0.3 d*.
    kl_peak, gold_peak = fit.peak()
    assert kl_peak == pytest.approx(106.34, rel=1e-3) and gold_peak == pytest.approx(3.0937, rel=1e-3)


def test_fit_is_least_squares_residuals_orthogonal_to_both_features():
    # Noisy gains: whatever the fit, least squares means the residuals are orthogonal to the
    # features d and -d log d (the normal equations), checked here from the definition.
    noise = [0.3, -0.2, 0.25, -0.4, 0.1, 0.35, -0.3, 0.05]
    gains = [gao(k, 0.8, 0.2) + e for k, e in zip(KLS, noise)]
    fit = gao_fit(KLS, gains)
    residuals = [y - fit.predict(k) for k, y in zip(KLS, gains)]
    d = [math.sqrt(k) for k in KLS]
    assert abs(sum(r * x for r, x in zip(residuals, d))) < 1e-9
    assert abs(sum(r * -x * math.log(x) for r, x in zip(residuals, d))) < 1e-9
    assert 0.5 < fit.r2 < 1.0


def test_fit_refuses_too_few_or_collinear_points_and_rising_fits_have_no_peak():
    assert gao_fit([1.0, 2.0], [0.1, 0.2]) is None
    assert gao_fit([4.0, 4.0, 4.0], [0.1, 0.2, 0.3]) is None  # one KL: features collinear
    rising = gao_fit(KLS, [gao(k, 0.5, -0.1) for k in KLS])
    assert rising.beta_rl < 0 and rising.peak() is None


def test_frontier_keeps_the_best_gold_within_each_kl_budget():
    points = [(3.0, 0.2), (1.0, 0.5), (0.0, 0.0), (2.0, 0.4), (5.0, 0.9), (4.0, 0.1)]
    assert frontier(points) == [(0.0, 0.0), (1.0, 0.5), (5.0, 0.9)]


def test_mean_and_stderr_by_hand():
    # mean 2, sample variance ((1 + 0 + 1) / 2) = 1, stderr 1 / sqrt(3)
    assert mean_and_stderr([1.0, 2.0, 3.0]) == pytest.approx((2.0, 1 / math.sqrt(3)))
    assert mean_and_stderr([0.7]) == (0.7, 0.0)


def test_peak_needs_a_rise_and_a_fall_beyond_twice_their_error():
    start = [0.0, 0.2, -0.2, 0.1]
    # Every prompt gains 0.5 then loses 0.4 (+-0.1): rise 0.5 with a small paired error.
    peak = [s + 0.5 + e for s, e in zip(start, [0.1, -0.1, 0.05, -0.05])]
    final = [p - 0.4 + e for p, e in zip(peak, [-0.1, 0.1, 0.0, 0.0])]
    found = peak_then_fall(start, peak, final, 3.0)
    assert found.holds and "rise +0.500" in found.evidence and "at KL 3.00" in found.evidence
    # The case: a rise of +0.002 against per-prompt differences of +-0.08 is noise.
    noisy_peak = [s + 0.002 + e for s, e in zip(start, [0.08, -0.08, 0.08, -0.08])]
    assert not peak_then_fall(start, noisy_peak, [p - 0.5 for p in noisy_peak], 1.0).holds


def test_peak_verdict_tells_rise_and_fall_apart():
    start = [0.0, 0.2, -0.2, 0.1]
    risen = [s + 0.4 for s in start]
    held = peak_then_fall(start, risen, risen, 2.0)  # rose, never fell
    assert held.rose and held.fall == (0.0, 0.0) and not held.holds
