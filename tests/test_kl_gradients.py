"""Which KL's gradient each (estimator, placement) follows, against analytic truth.

A categorical policy pi = softmax(theta) over V outcomes, a fixed reference, and pi_old = pi
detached (the on-policy first epoch) unless a test says otherwise. The expected gradient of a
term is summed over the whole vocabulary, sum_y pi_old(y) d/dtheta term(y), with no sampling,
and compared with autograd of the closed forms

    reverse KL(pi || ref) = sum_y pi (log pi - log ref)   (the one the RLHF objective penalises)
    forward KL(ref || pi) = sum_y ref (log ref - log pi)

The terms are tether's own functions: kl_shaped_rewards + ppo_policy_loss for the reward
placement, kl_penalty / exact_kl_penalty for the loss placement.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from fixed_points import fixed_point_forward_kl, fixed_point_reverse_kl

from tether import kl as kl_lib
from tether.advantages import gae, kl_shaped_rewards, rloo
from tether.choices import KL_ESTIMATORS
from tether.kl import KLPlacement
from tether.losses import exact_kl_penalty, kl_penalty, ppo_policy_loss

V = 8
ONE = torch.ones(1, 1, dtype=torch.bool)


def categorical(seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    theta = scale * torch.randn(V, generator=gen, dtype=torch.float64)
    ref_logits = scale * torch.randn(V, generator=gen, dtype=torch.float64)
    return theta, ref_logits


def closed_form_gradient(theta, ref_logits, which):
    theta = theta.clone().requires_grad_(True)
    log_pi, log_ref = torch.log_softmax(theta, -1), torch.log_softmax(ref_logits, -1)
    if which == "reverse":
        divergence = (log_pi.exp() * (log_pi - log_ref)).sum()
    else:
        divergence = (log_ref.exp() * (log_ref - log_pi)).sum()
    return torch.autograd.grad(divergence, theta)[0]


def expected_loss_gradient(estimator, theta, ref_logits, old_theta=None, aggregation="sum"):
    """sum_y pi_old(y) d/dtheta penalty(y): the KL-in-the-loss term, one token per sequence."""
    theta = theta.clone().requires_grad_(True)
    old_theta = theta.detach() if old_theta is None else old_theta
    log_pi, log_old = torch.log_softmax(theta, -1), torch.log_softmax(old_theta, -1)
    log_ref = torch.log_softmax(ref_logits, -1)
    expected = torch.zeros((), dtype=torch.float64)
    for y in range(V):
        if KL_ESTIMATORS[estimator].rows is not None:  # exact, forward, jsd
            # the whole vocabulary at the (one) sampled prefix; the same for every y
            exact = kl_lib.exact(theta.view(1, 1, V), ref_logits.view(1, 1, V),
                                 rows=KLPlacement("loss", estimator).divergence)
            penalty, _ = exact_kl_penalty(exact, ONE, aggregation)
        else:
            penalty, _ = kl_penalty(log_pi[y].view(1, 1), log_old[y].view(1, 1),
                                    log_ref[y].view(1, 1), ONE, estimator, aggregation)
        expected = expected + log_old[y].exp() * penalty
    return torch.autograd.grad(expected, theta)[0]


def expected_reward_gradient(estimator, theta, ref_logits):
    """sum_y pi(y) d/dtheta policy_loss(y), the KL in the reward: r = -k(y) (score 0, beta 1),
    the advantage is that one-token return, the loss PPO's surrogate at ratio 1."""
    theta = theta.clone().requires_grad_(True)
    log_pi = torch.log_softmax(theta, -1)
    log_old, log_ref = log_pi.detach(), torch.log_softmax(ref_logits, -1)
    expected = torch.zeros((), dtype=torch.float64)
    for y in range(V):
        rewards, _ = kl_shaped_rewards(torch.zeros(1), log_old[y].view(1, 1),
                                       log_ref[y].view(1, 1), ONE, 1.0, estimator)
        loss, _ = ppo_policy_loss(log_pi[y].view(1, 1), log_old[y].view(1, 1),
                                  rewards.double(), ONE)
        expected = expected + log_old[y].exp() * loss
    return torch.autograd.grad(expected, theta)[0]


# kl_shaped_rewards and tether.kl.exact compute in fp32 by design; everything else is fp64.
FP32_RTOL = 1e-5


def test_k1_in_the_reward_follows_the_reverse_kl():
    theta, ref_logits = categorical()
    torch.testing.assert_close(expected_reward_gradient("k1", theta, ref_logits),
                               closed_form_gradient(theta, ref_logits, "reverse"),
                               rtol=FP32_RTOL, atol=1e-7)


@pytest.mark.parametrize("aggregation", ["sum", "token"])
@pytest.mark.parametrize("estimator, divergence, rtol", [
    ("k2", "reverse", 1e-10), ("k3_ratio", "reverse", 1e-10), ("exact", "reverse", FP32_RTOL),
    ("k3", "forward", 1e-10), ("forward", "forward", FP32_RTOL)])
def test_loss_terms_follow_the_kl_the_docs_name(estimator, divergence, rtol, aggregation):
    theta, ref_logits = categorical(seed=1)
    torch.testing.assert_close(
        expected_loss_gradient(estimator, theta, ref_logits, aggregation=aggregation),
        closed_form_gradient(theta, ref_logits, divergence), rtol=rtol, atol=1e-7)


def _relative_gap(a, b):
    return float((a - b).norm() / b.norm())


def test_plain_k3_in_the_loss_is_not_the_reverse_kl():
    # The distinction is real: away from the reference the two gradients differ by a large
    # fraction (they agree to first order as pi -> ref, where both KLs are chi^2 / 2).
    theta, ref_logits = categorical(seed=2)
    k3 = expected_loss_gradient("k3", theta, ref_logits)
    assert _relative_gap(k3, closed_form_gradient(theta, ref_logits, "reverse")) > 0.2
    k2 = expected_loss_gradient("k2", theta, ref_logits)
    assert _relative_gap(k2, closed_form_gradient(theta, ref_logits, "forward")) > 0.2
    near_theta, near_ref = categorical(seed=2, scale=0.01)
    near_k3 = expected_loss_gradient("k3", near_theta, near_ref)
    assert _relative_gap(near_k3, closed_form_gradient(near_theta, near_ref, "reverse")) < 0.05


def test_off_policy_only_the_ratio_and_exact_terms_keep_the_reverse_kl():
    # In later PPO epochs pi != pi_old. E_{pi_old}[rho k3] = E_pi[k3] = KL(pi || ref) exactly,
    # and the exact term does not sample y at all, so both keep the gradient; k2's expected
    # gradient is sum_y pi_old d grad log pi, which is the reverse KL's only at pi = pi_old.
    theta, ref_logits = categorical(seed=3)
    old_theta = theta + 0.5 * torch.randn(V, generator=torch.Generator().manual_seed(9),
                                          dtype=torch.float64)
    reverse = closed_form_gradient(theta, ref_logits, "reverse")
    for estimator, rtol in (("k3_ratio", 1e-10), ("exact", FP32_RTOL)):
        torch.testing.assert_close(
            expected_loss_gradient(estimator, theta, ref_logits, old_theta), reverse,
            rtol=rtol, atol=1e-7)
    assert _relative_gap(expected_loss_gradient("k2", theta, ref_logits, old_theta),
                         reverse) > 0.05


def test_k3_in_the_reward_follows_neither_kl():
    # sum_y pi k3 grad log pi = grad KL(pi||ref) - grad KL(ref||pi): near the reference the two
    # cancel to second order, so k3 in the reward barely regularises; and -beta times this
    # difference grows without bound as pi drops an outcome (KL(ref||pi) -> inf), a pull towards
    # collapse. k2 and abs in the reward are no KL's gradient either.
    theta, ref_logits = categorical(seed=4)
    reverse = closed_form_gradient(theta, ref_logits, "reverse")
    forward = closed_form_gradient(theta, ref_logits, "forward")
    torch.testing.assert_close(expected_reward_gradient("k3", theta, ref_logits),
                               reverse - forward, rtol=FP32_RTOL, atol=1e-7)
    for estimator in ("k2", "abs"):
        assert _relative_gap(expected_reward_gradient(estimator, theta, ref_logits),
                             reverse) > 0.2


# ------------------------------------------------ one unit for beta: the token reduction

# A stateless bandit repeated along the response: every token is an independent draw from
# pi = softmax(theta) over 3 outcomes with reward r(y); a response's score is the sum of its
# tokens' rewards. Two samples of one prompt with lengths 1 and 2 (mean length L = 1.5). Per
# sequence the objective is L_i (E_pi[r] - beta KL(pi || ref)), so every reduction that keeps
# beta's unit is stationary at pi* = ref exp(r / beta) / Z.
BANDIT_REF = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
BANDIT_R = torch.tensor([1.0, 0.0, -0.5], dtype=torch.float64)
BANDIT_MASK = torch.tensor([[True, False], [True, True]])
BETA = 0.5


def bandit_gradient(probs, placement, pg_token_mean, kl_token_mean=False, estimator="k3_ratio"):
    """Expected gradient of the whole loss at pi = probs (on-policy), summed exactly over the
    3^3 joint outcomes of the three real tokens; advantages from rloo with k = 2."""
    theta = probs.log().clone().requires_grad_(True)
    log_pi, log_ref = torch.log_softmax(theta, -1), BANDIT_REF.log()
    expected = torch.zeros((), dtype=torch.float64)
    for first, second, third in itertools.product(range(3), repeat=3):
        tokens = torch.tensor([[first, 0], [second, third]])  # [B, T]; [0, 1] is padding
        logprobs, ref_logprobs = log_pi[tokens], log_ref[tokens]
        old = logprobs.detach()
        scores = (BANDIT_R[tokens] * BANDIT_MASK).sum(-1).float()
        beta_in_reward = BETA if placement == "reward" else 0.0
        rewards, _ = kl_shaped_rewards(scores, old, ref_logprobs, BANDIT_MASK, beta_in_reward)
        advantages = rloo(rewards, BANDIT_MASK, k=2).double()
        loss, _ = ppo_policy_loss(logprobs, old, advantages, BANDIT_MASK,
                                  aggregation="token" if pg_token_mean else "sum")
        if placement == "loss":
            penalty, _ = kl_penalty(logprobs, old, ref_logprobs, BANDIT_MASK, estimator,
                                    aggregation="token" if kl_token_mean else "sum")
            loss = loss + BETA * penalty
        probability = old[BANDIT_MASK].exp().prod()
        expected = expected + probability * loss
    return torch.autograd.grad(expected, theta)[0]


def pi_star(beta):
    return fixed_point_reverse_kl(BANDIT_REF, BANDIT_R, beta)


@pytest.mark.parametrize("pg_token_mean", [True, False])
def test_kl_in_the_reward_keeps_beta_whatever_the_reduction(pg_token_mean):
    # the KL rides inside the advantage, so the policy loss's reduction only scales the step
    grad = bandit_gradient(pi_star(BETA), "reward", pg_token_mean)
    assert float(grad.abs().max()) < 1e-6
    assert float(bandit_gradient(pi_star(2 * BETA), "reward", pg_token_mean).abs().max()) > 1e-2


@pytest.mark.parametrize("token_mean", [True, False])
def test_kl_in_the_loss_keeps_beta_when_the_reductions_match(token_mean):
    grad = bandit_gradient(pi_star(BETA), "loss", token_mean, kl_token_mean=token_mean)
    assert float(grad.abs().max()) < 1e-6


@pytest.mark.parametrize("token_mean", [True, False])
def test_plain_k3_in_the_loss_lands_on_the_forward_kl_point(token_mean):
    # the same composition with GRPO's k3: matched reductions stop at the forward KL's point,
    # not at the reverse one; mismatched, at the forward point for beta scaled by L
    forward = fixed_point_forward_kl(BANDIT_REF, BANDIT_R, BETA)
    grad = bandit_gradient(forward, "loss", token_mean, token_mean, estimator="k3")
    assert float(grad.abs().max()) < 1e-6
    grad = bandit_gradient(pi_star(BETA), "loss", token_mean, token_mean, estimator="k3")
    assert float(grad.abs().max()) > 1e-2
    scale = 1.5 if token_mean else 1 / 1.5
    shifted = fixed_point_forward_kl(BANDIT_REF, BANDIT_R, BETA * scale)
    grad = bandit_gradient(shifted, "loss", token_mean, not token_mean, estimator="k3")
    assert float(grad.abs().max()) < 1e-6


def test_mismatched_reductions_scale_beta_by_the_mean_length():
    # Token-mean policy loss (1 / 3 real tokens) beside a per-sequence penalty (1 / 2 sequences):
    # beta acts L = 3/2 times stronger, so the stationary point is pi* at beta * 1.5; the other
    # mismatch divides beta by L.
    mean_length = 1.5
    wrong = bandit_gradient(pi_star(BETA), "loss", pg_token_mean=True, kl_token_mean=False)
    assert float(wrong.abs().max()) > 1e-2
    stronger = bandit_gradient(pi_star(BETA * mean_length), "loss", True, kl_token_mean=False)
    assert float(stronger.abs().max()) < 1e-6
    weaker = bandit_gradient(pi_star(BETA / mean_length), "loss", False, kl_token_mean=True)
    assert float(weaker.abs().max()) < 1e-6


# ------------------------------------------------ several tokens: local vs sequence KL

def two_token_policy(seed):
    """Autoregressive pi(a) pi(b | a) and ref(a) ref(b | a) over 4 x 4 outcomes."""
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(4 + 16, generator=gen, dtype=torch.float64)
    ref = torch.randn(4 + 16, generator=gen, dtype=torch.float64)

    def log_probs(params):  # ([4] log p(a), [4, 4] log p(b | a))
        return torch.log_softmax(params[:4], -1), torch.log_softmax(params[4:].view(4, 4), -1)

    return theta, log_probs(ref), log_probs


def expected_two_token_gradient(theta, ref, log_probs, placement):
    theta = theta.clone().requires_grad_(True)
    first, second = log_probs(theta)
    mask = torch.ones(1, 2, dtype=torch.bool)
    expected = torch.zeros((), dtype=torch.float64)
    for a, b in itertools.product(range(4), range(4)):
        logprobs = torch.stack([first[a], second[a, b]]).view(1, 2)
        ref_logprobs = torch.stack([ref[0][a], ref[1][a, b]]).view(1, 2)
        old = logprobs.detach()
        if placement == "reward":  # k1 in the reward, advantage = the return-to-go
            rewards, _ = kl_shaped_rewards(torch.zeros(1), old, ref_logprobs, mask, 1.0)
            returns, _ = gae(rewards, torch.zeros(1, 2), mask, gamma=1.0, lam=1.0)
            loss, _ = ppo_policy_loss(logprobs, old, returns.double(), mask, aggregation="sum")
        else:
            loss, _ = kl_penalty(logprobs, old, ref_logprobs, mask, "k3_ratio")
        expected = expected + old.sum().exp() * loss
    return torch.autograd.grad(expected, theta)[0]


def test_with_several_tokens_the_loss_term_is_the_local_kl():
    # Sequence KL(pi || ref) = sum_a pi(a) [log pi(a)/ref(a) + KL_2(a)], KL_2(a) the second
    # token's KL after a. The reward placement follows its gradient. The loss placement
    # differentiates each position's KL at its sampled prefix: the first-token weights pi(a)
    # multiplying KL_2(a) are held at pi_old, so it follows the gradient of
    # KL(pi_1 || ref_1) + sum_a pi_old(a) KL_2(a), and misses sum_a KL_2(a) grad pi(a).
    theta, ref, log_probs = two_token_policy(seed=5)

    def sequence_kl(params, freeze_first_weights):
        first, second = log_probs(params)
        second_kl = (second.exp() * (second - ref[1])).sum(-1)  # [4] KL_2(a)
        weights = first.exp().detach() if freeze_first_weights else first.exp()
        return (first.exp() * (first - ref[0])).sum() + (weights * second_kl).sum()

    def gradient(freeze):
        params = theta.clone().requires_grad_(True)
        return torch.autograd.grad(sequence_kl(params, freeze), params)[0]

    full, local = gradient(False), gradient(True)
    torch.testing.assert_close(expected_two_token_gradient(theta, ref, log_probs, "reward"),
                               full, rtol=FP32_RTOL, atol=1e-6)
    torch.testing.assert_close(expected_two_token_gradient(theta, ref, log_probs, "loss"),
                               local, rtol=1e-10, atol=1e-10)
    assert _relative_gap(local, full) > 0.05
