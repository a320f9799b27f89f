"""Best-of-n from a pool and Gao et al.'s best-of-n form (tether.tools.frontier).

Independent truth: every size-n subset of small pools enumerated (exact rationals), every
ordered draw of n from a small discrete policy enumerated for the KL, the expected maximum of
two standard normals (1 / sqrt(pi)), the spread of many independent pools for the standard
error, and synthetic points drawn from known coefficients for the fit.
"""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest

from tether.tools.frontier import (
    best_of_n,
    best_of_n_kl,
    gao_fit,
    mean_and_stderr,
    one_curve_test,
)


def brute_force(proxy, values, n):
    """The mean over every size-n subset of the pool of the value the subset's best picks: the
    subset's responses at its highest proxy level, one of them at random (their mean)."""
    total, count = Fraction(0), 0
    for subset in itertools.combinations(range(len(proxy)), n):
        top = max(proxy[i] for i in subset)
        tied = [Fraction(values[i]) for i in subset if proxy[i] == top]
        total += sum(tied) / len(tied)
        count += 1
    return total / count


# Pools with ties of 1, 2 and 4 responses and integer values: every partial sum either side
# computes is a dyadic rational held exactly in float64, so the two agree bit for bit.
POOLS = [
    ([3, 1, 2], [5, -2, 7]),
    ([1, 1, 2, 0, 2], [4, 9, -3, 2, 6]),
    ([0, 0, 0, 0, 5, 1, 1], [1, 2, 3, 8, -1, 0, 5]),
    ([2, 2, 2, 2], [3, -5, 8, 1]),
]


@pytest.mark.parametrize("proxy, gold", POOLS)
def test_the_estimator_is_the_mean_over_every_subset(proxy, gold):
    for n in range(1, len(proxy) + 1):
        assert best_of_n(proxy, gold, n) == float(brute_force(proxy, gold, n)), n
        assert best_of_n(proxy, proxy, n) == float(brute_force(proxy, proxy, n)), n
    assert best_of_n(proxy, gold, 1) == sum(gold) / len(gold)  # n = 1: the pool's mean
    assert best_of_n(proxy, proxy, len(proxy)) == max(proxy)  # n = N: the pool's best


def test_the_estimator_on_real_valued_pools_and_its_bad_input():
    rng = random.Random(0)
    for _ in range(20):
        size = rng.randint(2, 8)
        proxy = [round(rng.gauss(0, 1), 1) for _ in range(size)]  # rounded: ties happen
        gold = [rng.gauss(0, 1) for _ in range(size)]
        for n in range(1, size + 1):
            assert best_of_n(proxy, gold, n) == pytest.approx(float(brute_force(proxy, gold, n)),
                                                              rel=1e-12, abs=1e-12)
    for n in (0, 4):
        with pytest.raises(ValueError, match="from a pool of 3"):
            best_of_n([1, 2, 3], [1, 2, 3], n)


def test_unbiased_for_the_expected_best_and_its_standard_error_is_the_spread_of_pools():
    # Proxy ~ N(0, 1): the best of 2 has mean 1 / sqrt(pi). Many independent "evaluations" of
    # 40 prompts with a pool of 8 each: the estimates' mean is the true value, and the standard
    # error each evaluation reports matches the spread of the estimates across evaluations.
    rng = random.Random(1)
    means, errors = [], []
    for _ in range(300):
        per_prompt = []
        for _ in range(40):
            pool = [rng.gauss(0, 1) for _ in range(8)]
            per_prompt.append(best_of_n(pool, pool, 2))
        mean, stderr = mean_and_stderr(per_prompt)
        means.append(mean)
        errors.append(stderr)
    grand, spread = mean_and_stderr(means)
    spread *= math.sqrt(len(means))  # the std of the evaluations' means
    assert abs(grand - 1 / math.sqrt(math.pi)) < 4 * spread / math.sqrt(len(means))
    assert sum(errors) / len(errors) == pytest.approx(spread, rel=0.15)


def bon_policy_kl(rewards, probs, n):
    """KL(pi_n || pi) by enumerating every ordered draw of n responses from pi (rewards may
    tie; a tie among the drawn best is broken uniformly), exact rationals until the log."""
    size = len(rewards)
    pi_n = [Fraction(0)] * size
    for draw in itertools.product(range(size), repeat=n):
        weight = math.prod((probs[i] for i in draw), start=Fraction(1))
        top = max(rewards[i] for i in draw)
        best = [i for i in draw if rewards[i] == top]
        for i in best:
            pi_n[i] += weight / len(best)
    return sum(float(q) * math.log(q / p) for q, p in zip(pi_n, probs) if q > 0)


def test_the_exact_kl_is_the_closed_form_and_the_usual_formula_only_bounds_it():
    # A pool of 6 (each response 1/6): responses 0 and 1 are the same text drawn twice; 2 and 3
    # are two texts with the same reward (a tie between distinct responses)
    proxy = [1.0, 1.0, 0.5, 0.5, 2.0, -1.0]
    probs = [Fraction(1, 6)] * 6
    for n in range(1, 5):
        exact = best_of_n_kl(proxy, n)
        assert exact == pytest.approx(bon_policy_kl(proxy, probs, n), rel=1e-12, abs=1e-15)
        assert exact <= math.log(n) - (n - 1) / n + 1e-15
    assert best_of_n_kl(proxy, 1) == 0.0
    # no ties: the bound's gap closes as the pool grows (the bound is the continuous limit)
    assert best_of_n_kl(list(range(1000)), 4) == pytest.approx(math.log(4) - 3 / 4, abs=2e-3)
    # a pool whose every response scores the same: best-of-n is the policy, KL 0
    assert best_of_n_kl([0.3] * 5, 3) == 0.0


def test_gao_s_best_of_n_form_is_recovered_from_noisy_points():
    rng = random.Random(2)
    alpha, beta = 0.8, 0.15
    kls = [0.05 * i for i in range(1, 61)]
    gains = [math.sqrt(k) * (alpha - beta * math.sqrt(k)) + rng.gauss(0, 0.005) for k in kls]
    fit = gao_fit(kls, gains, form="bon")
    assert fit.alpha == pytest.approx(alpha, rel=0.05) and fit.beta_rl == pytest.approx(beta, rel=0.05)
    d_star = alpha / (2 * beta)  # the peak of d (alpha - beta d)
    assert fit.peak()[0] == pytest.approx(d_star ** 2, rel=0.1)
    assert fit.peak()[1] == pytest.approx(alpha * d_star / 2, rel=0.1)
    # the RL form is a different curve: on these points it fits worse
    assert gao_fit(kls, gains).r2 < fit.r2


def test_the_one_curve_test_tells_early_stopping_from_different_curves():
    # Gao et al.'s claim, made true and made false by construction: three "betas" whose points
    # lie on one RL curve (each reaching its own KL range, as penalties do) plus noise, against
    # three whose curves differ (alpha 0.4, 0.8, 1.2).
    rng = random.Random(3)

    def points(alpha, kls):
        return [(k, math.sqrt(k) * (alpha - 0.3 * math.log(math.sqrt(k))) + rng.gauss(0, 0.02))
                for k in kls]
    ranges = [[0.2 * i for i in range(1, 9)], [0.5 * i for i in range(1, 9)],
              [1.0 * i for i in range(1, 9)]]
    # under the claim the p-value is uniform: about 5% of tasks fall below 0.05 (here at most
    # 6 of 40; binomial(40, 0.05) passes 6 with probability 0.014)
    null = [one_curve_test([points(0.8, kls) for kls in ranges], permutations=99, seed=s)[1]
            for s in range(40)]
    assert sum(p <= 0.05 for p in null) <= 6 and sum(null) / len(null) > 0.3
    for s in range(5):  # different curves: no reassignment of the points comes close
        share, p = one_curve_test([points(a, kls) for a, kls in zip((0.4, 0.8, 1.2), ranges)],
                                  permutations=99, seed=s)
        assert p == 1 / 100 and share > 0.5
    assert one_curve_test([points(0.8, ranges[0])]) is None  # one group: nothing to compare


def test_the_page_compares_rl_with_best_of_n_where_both_were_measured():
    from tether.tools.sweep_report import versus_best_of_n
    from tether.tools.sweep_results import Group

    # one PPO setting: gold gain 0.3 at KL 0.5, 0.9 at KL 3 (beyond best-of-4's reach)
    group = Group("ppo-beta0.1", "ppo", 0.1, "PPO beta 0.1", [0], [0, 10, 20],
                  {"kl": [0.0, 0.5, 3.0], "gold": [0.1, 0.4, 1.0]}, {}, [1.0])

    def curve(gold_at_4):
        return [{"n": 1, "gold": 0.1, "gold_se": 0.01, "kl_exact": 0.0, "kl_bound": 0.0},
                {"n": 4, "gold": 0.1 + gold_at_4, "gold_se": 0.02, "kl_exact": 0.6,
                 "kl_bound": math.log(4) - 0.75}]
    for bon_gain, says in ((0.2, "RL buys more gold than best-of-n"),
                           (0.5, "RL buys less gold than best-of-n"),
                           (0.31, "RL buys as much gold, within two standard errors, as best-of-n")):
        said = versus_best_of_n([group], curve(bon_gain))
        assert said.endswith(says + "."), said
        assert "gains +0.300 at 0.50 nats" in said  # the evaluation at KL 3 is beyond its reach
        assert f"Best-of-4: gold {bon_gain:+.3f} ± 0.020" in said
