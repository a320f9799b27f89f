"""The bandit fixed points of tests/fixed_points.py against their defining equations: the
gradient of each regularised objective, taken by autograd in softmax logits, vanishes there."""

from __future__ import annotations

import itertools

import pytest
import torch
from fixed_points import (
    fixed_point_forward_kl,
    fixed_point_group,
    fixed_point_grpo_std,
    fixed_point_reverse_kl,
    group_expected_update,
)

from tether.advantages import grpo, kl_shaped_rewards, rloo
from tether.losses import kl_penalty, ppo_policy_loss

REF = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
REWARDS = torch.tensor([0.0, 1.0, 0.5, 2.0], dtype=torch.float64)


def reverse_kl(log_pi, log_ref):
    return (log_pi.exp() * (log_pi - log_ref)).sum()


def forward_kl(log_pi, log_ref):
    return (log_ref.exp() * (log_ref - log_pi)).sum()


def objective_gradient(probs, objective):
    """d/dtheta objective(log softmax(theta)) at theta = log probs."""
    theta = probs.log().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(objective(torch.log_softmax(theta, -1)), theta)
    return grad


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_reverse_kl_fixed_point_is_stationary(beta):
    pi = fixed_point_reverse_kl(REF, REWARDS, beta)
    grad = objective_gradient(
        pi, lambda log_pi: (log_pi.exp() * REWARDS).sum() - beta * reverse_kl(log_pi, REF.log()))
    assert float(grad.abs().max()) < 1e-12
    # the closed form, by hand for one ratio: pi(3)/pi(0) = (0.1/0.4) exp((2 - 0)/beta)
    assert float(pi[3] / pi[0]) == pytest.approx(0.25 * torch.e ** (2.0 / beta), rel=1e-12)


@pytest.mark.parametrize("beta", [0.05, 0.5, 2.0])
def test_forward_kl_fixed_point_is_stationary(beta):
    pi = fixed_point_forward_kl(REF, REWARDS, beta)
    assert float(pi.sum()) == pytest.approx(1.0, abs=1e-12)
    assert bool((pi > 0).all())
    grad = objective_gradient(
        pi, lambda log_pi: (log_pi.exp() * REWARDS).sum() - beta * forward_kl(log_pi, REF.log()))
    assert float(grad.abs().max()) < 1e-10
    # lambda = E_pi[r] + beta, read back from any outcome: pi(y) (lambda - r(y)) = beta ref(y)
    lam = float((pi * REWARDS).sum()) + beta
    torch.testing.assert_close(pi * (lam - REWARDS), beta * REF, rtol=1e-9, atol=1e-12)
    # and it is a different point from the reverse KL's (so the distinction is testable)
    assert float((pi - fixed_point_reverse_kl(REF, REWARDS, beta)).abs().max()) > 0.01


def test_forward_kl_covers_mass_reverse_kl_drops_it():
    # At small beta the reverse-KL optimum starves the worse outcomes exponentially
    # (ref exp(-(2 - r)/beta)), the forward one only linearly (beta ref / (lambda - r)).
    beta = 0.05
    forward = fixed_point_forward_kl(REF, REWARDS, beta)
    reverse = fixed_point_reverse_kl(REF, REWARDS, beta)
    assert float(forward[0]) == pytest.approx(beta * 0.4 / 2.0, rel=0.05)  # lambda ~ max r = 2
    assert float(reverse[0]) < 1e-15


@pytest.mark.parametrize("beta, eps", [(1.0, 0.0), (3.0, 0.0), (1.0, 1e-4)])
def test_grpo_std_fixed_point_is_self_consistent(beta, eps):
    pi = fixed_point_grpo_std(REF, REWARDS, beta, eps=eps)
    mean = float((pi * REWARDS).sum())
    sigma = float((pi * (REWARDS - mean).square()).sum()) ** 0.5
    # with sigma held at its value there, the gradient of E_pi[r] / (sigma + eps) - beta KL(pi||ref)
    # vanishes: the reverse-KL point with beta scaled by the spread
    grad = objective_gradient(
        pi, lambda log_pi: (log_pi.exp() * REWARDS).sum() / (sigma + eps)
        - beta * reverse_kl(log_pi, REF.log()))
    assert float(grad.abs().max()) < 1e-9
    torch.testing.assert_close(pi, fixed_point_reverse_kl(REF, REWARDS, beta * (sigma + eps)),
                               rtol=1e-9, atol=1e-12)
    assert float((pi - fixed_point_reverse_kl(REF, REWARDS, beta)).abs().max()) > 0.01


def test_grpo_std_small_beta_has_no_point_short_of_collapse():
    # Here the std under ref exp(r / (beta sigma)) / Z equals sigma somewhere only for beta above
    # about 0.77 (a scan over sigma in (0, 1.5)): below it, dividing the reward by its shrinking
    # spread outruns the KL's pull and the policy goes deterministic.
    with pytest.raises(ValueError, match="collapses"):
        fixed_point_grpo_std(REF, REWARDS, beta=0.5)


# A three-outcome bandit for the k-sample estimators (V^k groups are enumerated).
REF3 = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
REWARDS3 = torch.tensor([1.0, 0.0, -0.5], dtype=torch.float64)


def _tv(p, q):
    return float(0.5 * (p - q).abs().sum())


@pytest.mark.parametrize("k", [2, 3, 4])
def test_group_fixed_points_match_their_closed_forms(k):
    # RLOO's baseline excludes the sample: the update is exactly grad E[r] - beta grad KL.
    # Dr. GRPO's group mean includes it, so its advantage is (k-1)/k RLOO's and with the KL in
    # the loss beta acts as beta k/(k-1).
    beta = 1.0
    reverse = fixed_point_reverse_kl(REF3, REWARDS3, beta)
    assert _tv(fixed_point_group(REF3, REWARDS3, beta, k, "rloo"), reverse) < 1e-12
    assert _tv(fixed_point_group(REF3, REWARDS3, beta, k, "grpo_none"),
               fixed_point_reverse_kl(REF3, REWARDS3, beta * k / (k - 1))) < 1e-12
    assert _tv(fixed_point_group(REF3, REWARDS3, beta, k, "grpo_none"), reverse) > 0.01


def test_grpo_std_fixed_point_tends_to_the_many_samples_point():
    # Above the collapse threshold (beta ~ 1.55 for this bandit), the group's sample std makes
    # finite k land on the less greedy side of the sigma_pi point, well away at k = 2 (TV 0.18)
    # and closing in as k grows (0.10 at k = 4, 0.05 at k = 8, measured).
    beta = 2.0
    ideal = fixed_point_grpo_std(REF3, REWARDS3, beta, eps=1e-4)
    distances = []
    for k in (2, 3, 4, 6):
        landing = fixed_point_group(REF3, REWARDS3, beta, k, "grpo_group")
        assert float(group_expected_update(landing.log(), REF3, REWARDS3, beta, k,
                                           "grpo_group").abs().max()) < 1e-12
        assert float(landing[0]) < float(ideal[0])  # less mass on the best outcome
        distances.append(_tv(landing, ideal))
    assert distances == sorted(distances, reverse=True)
    assert distances[0] > 0.15 and distances[-1] < 0.08


def test_grpo_std_below_the_threshold_finite_k_drifts_towards_collapse():
    # At beta = 1 the many-samples limit has no point short of collapse (eps or not); finite k
    # stops short of it, with more mass on the best outcome as k grows.
    with pytest.raises(ValueError, match="collapses"):
        fixed_point_grpo_std(REF3, REWARDS3, 1.0, eps=1e-4)
    best = [float(fixed_point_group(REF3, REWARDS3, 1.0, k, "grpo_group")[0]) for k in (2, 4, 6)]
    assert best == sorted(best) and best[0] < 0.7 and best[-1] > 0.85


@pytest.mark.parametrize("advantage, estimator", [(rloo, None), (grpo, "group"),
                                                  (grpo, "none")])
def test_group_update_is_tethers_expected_update(advantage, estimator):
    # The helper's vectorised update against tether's own functions, enumerated group by group:
    # kl_shaped_rewards (beta 0) -> rloo / grpo -> ppo_policy_loss + beta * kl_penalty(k3_ratio).
    # Minimising the loss moves theta along minus its gradient, which must be the helper's update.
    k, beta = 3, 0.7
    theta = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64, requires_grad=True)
    log_pi, log_ref = torch.log_softmax(theta, -1), REF3.log()
    mask = torch.ones(k, 1, dtype=torch.bool)
    expected = torch.zeros((), dtype=torch.float64)
    for group in itertools.product(range(3), repeat=k):
        tokens = torch.tensor(group).view(k, 1)
        logprobs, old = log_pi[tokens], log_pi[tokens].detach()
        rewards, _ = kl_shaped_rewards(REWARDS3[tokens].view(k).float(), old, log_ref[tokens],
                                       mask, 0.0)
        if estimator is None:
            advantages = advantage(rewards, mask, k)
        else:
            advantages = advantage(rewards, mask, k, scale_rewards=estimator)
        loss, _ = ppo_policy_loss(logprobs, old, advantages.double(), mask)
        penalty, _ = kl_penalty(logprobs, old, log_ref[tokens], mask, "k3_ratio")
        expected = expected + old.sum().exp() * (loss + beta * penalty)
    (gradient,) = torch.autograd.grad(expected, theta)
    name = {None: "rloo", "group": "grpo_group", "none": "grpo_none"}[estimator]
    update = group_expected_update(theta.detach(), REF3, REWARDS3, beta, k, name)
    torch.testing.assert_close(-gradient, update, rtol=1e-5, atol=1e-7)


def test_helpers_reject_bad_input():
    with pytest.raises(ValueError, match="sum to 1"):
        fixed_point_reverse_kl(REF * 2, REWARDS, 1.0)
    with pytest.raises(ValueError, match="beta"):
        fixed_point_forward_kl(REF, REWARDS, 0.0)
    with pytest.raises(ValueError, match="one length"):
        fixed_point_grpo_std(REF, REWARDS[:3], 1.0)
    with pytest.raises(ValueError, match="k must be"):
        fixed_point_group(REF3, REWARDS3, 1.0, 1)
    with pytest.raises(ValueError, match="advantage"):
        fixed_point_group(REF3, REWARDS3, 1.0, 2, "ppo")
