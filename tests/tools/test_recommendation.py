"""Which beta? The recommendation rule (frontier.recommend_beta), the end-of-training measure and
the honest wording of one-seed numbers and of Gao et al.'s fit, on hand-worked numbers."""

from __future__ import annotations

import math

import pytest

from tether.tools.frontier import GaoFit, end_of_training, error_text, recommend_beta

BETAS = {"b0": 0.0, "b0.3": 0.3, "b1": 1.0}
ONE_SEED = {"b0": 1, "b0.3": 1, "b1": 1}


def test_end_of_training_is_the_mean_of_the_last_evaluations_per_prompt():
    # Prompt 0: 0.4, 0.4, 0.1 (a dip at the end) -> 0.3; prompt 1: 0.0, 0.3, 0.6 -> 0.3.
    # The first evaluation (0.9, 0.9) is left out: only the last three count.
    per_eval = [[0.9, 0.9], [0.4, 0.0], [0.4, 0.3], [0.1, 0.6]]
    assert end_of_training(per_eval, 3) == pytest.approx([0.3, 0.3])
    assert end_of_training(per_eval[:2], 3) == pytest.approx([0.65, 0.45])  # fewer: all


def test_a_clear_winner_is_recommended():
    # b0.3 beats b1 on every prompt: differences 0.10, 0.14, 0.12, 0.12 -> mean 0.12,
    # sample sd 0.01633, se 0.008165; b0 is far below both.
    end = {"b0.3": [0.5, 0.3, 0.1, 0.06], "b1": [0.4, 0.16, -0.02, -0.06], "b0": [-1.0] * 4}
    rec = recommend_beta(end, BETAS, ONE_SEED)
    assert rec.beta == 0.3 and rec.best == "b0.3" and rec.tied == ["b0.3"]
    assert "+0.120 ± 0.008" in rec.evidence and "more than twice" in rec.evidence
    assert "one seed" in rec.evidence  # the error bar's reach is said


def test_no_clear_winner_takes_the_largest_beta_and_says_so_first():
    # b0.3 ends at 0.3 + (0.1, -0.1, 0.1, -0.1), b1 at 0.25 + (-0.1, 0.1, -0.1, 0.1):
    # differences 0.25, -0.15, 0.25, -0.15 -> gap 0.05, sd sqrt(4 * 0.04 / 3) = 0.2309,
    # se 0.1155 (gap < 2 se: within noise). b0 at -0.5 is 0.8 behind with se 0.0577: beyond noise.
    end = {"b0": [-0.5] * 4, "b0.3": [0.4, 0.2, 0.4, 0.2], "b1": [0.15, 0.35, 0.15, 0.35]}
    rec = recommend_beta(end, BETAS, ONE_SEED)
    assert rec.best == "b0.3" and rec.beta == 1.0
    assert sorted(rec.tied) == ["b0.3", "b1"]
    assert rec.gaps["b1"] == pytest.approx((0.05, math.sqrt(0.16 / 3 / 4)))
    assert rec.evidence.startswith("No clear winner: b0.3 measured best (end gold +0.300)")
    assert "+0.050 ± 0.115 behind" in rec.evidence and "largest beta, beta 1" in rec.evidence
    # Seeds to separate them if the gap held: 1 * (2 * 0.11547 / 0.05)^2 = 21.3 -> 22.
    assert "About 22 seeds instead of 1 would separate b0.3 from b1" in rec.evidence


def test_the_best_with_the_largest_beta_is_not_called_a_tie_break():
    end = {"b0.3": [0.15, 0.35, 0.15, 0.35], "b1": [0.4, 0.2, 0.4, 0.2]}
    rec = recommend_beta(end, BETAS, {"b0.3": 2, "b1": 2})
    assert rec.beta == 1.0 and rec.best == "b1" and "also has the largest beta" in rec.evidence
    assert "one seed" not in rec.evidence


def test_one_seed_prints_no_error_bar():
    assert error_text(0.1234, 0.0, 1) == "+0.123 (one seed, no error bar)"
    assert error_text(0.1234, 0.05, 3) == "+0.123 ± 0.050"


def test_gao_fit_says_when_its_peak_is_an_extrapolation_and_when_it_has_too_few_points():
    # d* = exp(alpha / beta_RL - 1) = exp(0.25 / 0.12 - 1) = exp(1.0833) = 2.9545, KL* = 8.73 > 1.64.
    far = GaoFit(0.25, 0.12, 0.98, 5)
    assert far.describe(1.64) == ("R² 0.98 from 5 points; fitted peak beyond the data, an "
                                  "extrapolation (at KL 8.73; the runs reached 1.64)")
    # d* = exp(0.10 / 0.30 - 1) = 0.5134, KL* = 0.264 within 0.77; R* = 0.3 * 0.5134 = 0.154.
    near = GaoFit(0.10, 0.30, 1.0, 3)
    text = near.describe(0.77)
    assert text.startswith("R² 1.00 from 3 points: too few to test the curve")
    assert text.endswith("fitted peak gold +0.154 at KL 0.26")
    assert GaoFit(0.3, -0.1, 0.5, 9).describe(1.0).endswith("no fitted peak (still rising)")
