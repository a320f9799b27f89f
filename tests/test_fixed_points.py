"""The bandit fixed points of tests/fixed_points.py against their defining equations: the
gradient of each regularised objective, taken by autograd in softmax logits, vanishes there."""

from __future__ import annotations

import pytest
import torch
from fixed_points import fixed_point_forward_kl, fixed_point_grpo_std, fixed_point_reverse_kl

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


def test_helpers_reject_bad_input():
    with pytest.raises(ValueError, match="sum to 1"):
        fixed_point_reverse_kl(REF * 2, REWARDS, 1.0)
    with pytest.raises(ValueError, match="beta"):
        fixed_point_forward_kl(REF, REWARDS, 0.0)
    with pytest.raises(ValueError, match="one length"):
        fixed_point_grpo_std(REF, REWARDS[:3], 1.0)
