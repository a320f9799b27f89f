"""tether.losses against hand-derived numbers (reasoning in the comments) and a known optimum:
the three-action bandit of Azar et al. (2023), where IPO stops at a finite policy and DPO runs to
a deterministic one."""

from __future__ import annotations

import math

import pytest
import torch

from tether.losses import ppo_policy_loss, reduce_tokens, value_loss
from tether.preference import bradley_terry_loss, dpo_loss

LN2 = math.log(2.0)


# ---------------------------------------------------------------- PPO policy loss


def test_ppo_on_policy_equals_minus_mean_advantage():
    # ratio = exp(0) = 1 exactly, so both branches equal -A: loss = -mean(A) over real tokens
    # = -(1 - 2 + 0.5) / 3 = 0.5 / 3; the padding advantage 100 must not count.
    logprobs = torch.tensor([[-1.0, -2.0, -0.3, -5.0]])
    advantages = torch.tensor([[1.0, -2.0, 0.5, 100.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, stats = ppo_policy_loss(logprobs, logprobs.clone(), advantages, mask)
    assert float(loss) == pytest.approx(0.5 / 3, rel=1e-6)
    assert float(stats["clip_frac"]) == 0.0
    assert float(stats["approx_kl"]) == 0.0  # exactly: expm1(0) - 0
    assert float(stats["ratio_mean"]) == 1.0


def _ppo_one_token(ratio, advantage, clip=0.2, clip_high=None):
    logprobs = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, stats = ppo_policy_loss(logprobs, old, torch.tensor([[advantage]], dtype=torch.float64),
                                  torch.ones(1, 1, dtype=torch.bool), clip, clip_high=clip_high)
    loss.backward()
    return float(loss.detach()), float(logprobs.grad), float(stats["clip_frac"])


@pytest.mark.parametrize("ratio, advantage, clipped_value", [
    # A > 0: the objective stops rewarding a ratio above 1 + eps = 1.2 (loss -1.2 flat there);
    # below 1 - eps nothing is clipped, because min(r A, clip(r) A) then takes r A.
    (1.21, 1.0, -1.2), (1.19, 1.0, None), (0.79, 1.0, None), (1.0, 1.0, None),
    # A < 0: mirrored, clipped below 0.8 (loss +0.8 flat there), never above.
    (0.79, -1.0, 0.8), (0.81, -1.0, None), (1.21, -1.0, None), (3.0, -1.0, None),
])
def test_ppo_clipping_engages_exactly_beyond_the_band(ratio, advantage, clipped_value):
    _check_one_token(_ppo_one_token(ratio, advantage), ratio, advantage, clipped_value)


def _check_one_token(result, ratio, advantage, clipped_value):
    """Clipped: the loss sits at the bound, flat (no gradient); unclipped: L = -A r and
    dL/dlogprob = -A r (since dr/dlogprob = r)."""
    loss, grad, clip_frac = result
    if clipped_value is not None:
        assert loss == pytest.approx(clipped_value, rel=1e-12)
        assert grad == 0.0 and clip_frac == 1.0
    else:
        assert loss == pytest.approx(-advantage * ratio, rel=1e-12)
        assert grad == pytest.approx(-advantage * ratio, rel=1e-12)
        assert clip_frac == 0.0


@pytest.mark.parametrize("ratio, advantage, clipped_value", [
    # clip-higher (DAPO, Yu et al. 2025, eq. 10): eps 0.2 below, eps_high 0.28 above. A ratio of
    # 1.25 with A > 0 keeps its gradient (the symmetric band would have stopped it at 1.2) ...
    (1.25, 1.0, None), (1.29, 1.0, -1.28),
    # ... and the lower side is unchanged: A < 0 is still clipped below 0.8, never above 1.28.
    (0.79, -1.0, 0.8), (1.25, -1.0, None),
])
def test_clip_higher_moves_only_the_upper_bound(ratio, advantage, clipped_value):
    _check_one_token(_ppo_one_token(ratio, advantage, clip=0.2, clip_high=0.28), ratio, advantage,
                     clipped_value)
    # the same token under the symmetric band, for contrast
    if (ratio, advantage) == (1.25, 1.0):
        assert _ppo_one_token(ratio, advantage, clip=0.2)[1] == 0.0


def test_clip_higher_equals_trls_documented_formula():
    # TRL 1.16's GRPO loss with epsilon (low) and epsilon_high, as its docs write it:
    #   coef_1 = exp(logp - old_logp); coef_2 = clamp(coef_1, 1 - eps_low, 1 + eps_high)
    #   per_token_loss = -min(coef_1 * A, coef_2 * A); loss = sum(per_token_loss * mask) / sum(mask)
    gen = torch.Generator().manual_seed(3)
    logprobs = (-torch.rand(3, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    adv = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=gen) > 0.3
    ours, _ = ppo_policy_loss(logprobs, old, adv, mask, 0.2, clip_high=0.28)
    (grad_ours,) = torch.autograd.grad(ours, logprobs)
    coef_1 = torch.exp(logprobs - old)
    coef_2 = coef_1.clamp(1 - 0.2, 1 + 0.28)
    per_token = -torch.minimum(coef_1 * adv, coef_2 * adv)
    theirs = (per_token * mask).sum() / mask.sum()
    (grad_theirs,) = torch.autograd.grad(theirs, logprobs)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-12, atol=1e-15)


def _trl_inputs(seed=4):
    gen = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(3, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    adv = torch.randn(3, 1, generator=gen, dtype=torch.float64).expand(3, 5).clone()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    return logprobs, old, adv, mask


def test_gspo_sequence_ratio_hand_computed():
    # One response of two tokens, log ratios 0.1 and 0.3: s = exp(0.2) = 1.2214 for both tokens.
    # With A = +1 and eps 0.2 the sequence is past 1.2: clipped whole, no gradient to either
    # token, although the first token's own ratio (1.105) is inside the band.
    logprobs = torch.tensor([[0.1, 0.3]], dtype=torch.float64, requires_grad=True)
    old, mask = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    adv = torch.ones(1, 2, dtype=torch.float64)
    loss, stats = ppo_policy_loss(logprobs, old, adv, mask, 0.2, level="sequence")
    loss.backward()
    assert loss.item() == pytest.approx(-1.2, rel=1e-12)
    assert logprobs.grad.tolist() == [[0.0, 0.0]] and float(stats["clip_frac"]) == 1.0
    assert float(stats["ratio_mean"]) == pytest.approx(math.exp(0.2), rel=1e-12)
    # inside the band (eps 0.3): L = -s, dL/dlogp_t = -s / 2 for each of the 2 tokens
    logprobs.grad = None
    loss, _ = ppo_policy_loss(logprobs, old, adv, mask, 0.3, level="sequence")
    loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-math.exp(0.2) / 2] * 2, rel=1e-12)


def test_gspo_equals_trls_documented_formula():
    # TRL 1.16, importance_sampling_level="sequence" (GSPO):
    #   log_w = sum_t(log_ratio * mask) / sum_t(mask); coef_1 = exp(log_w) [B, 1]
    #   coef_2 = clamp(coef_1, 1 - eps, 1 + eps_high); per_token = -min(coef_1 A, coef_2 A)
    #   loss = sum(per_token * mask) / sum(mask)
    logprobs, old, adv, mask = _trl_inputs()
    ours, _ = ppo_policy_loss(logprobs, old, adv, mask, 3e-2, clip_high=4e-2, level="sequence")
    (grad_ours,) = torch.autograd.grad(ours, logprobs)
    log_w = ((logprobs - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    coef_1 = torch.exp(log_w)[:, None]
    coef_2 = coef_1.clamp(1 - 3e-2, 1 + 4e-2)
    theirs = (-torch.minimum(coef_1 * adv, coef_2 * adv) * mask).sum() / mask.sum()
    (grad_theirs,) = torch.autograd.grad(theirs, logprobs)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-12, atol=1e-15)


def test_cispo_keeps_a_bounded_gradient_where_ppo_drops_it():
    # ratio 1.5, A = +1, log pi = log 1.5 = 0.405: PPO's clipped branch has no gradient; CISPO's
    # weight is capped at 1 + 0.28 and detached, so dL/dlogp = -1.28 * A.
    logprobs = torch.tensor([[math.log(1.5)]], dtype=torch.float64, requires_grad=True)
    old, mask = torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool)
    adv = torch.ones(1, 1, dtype=torch.float64)
    loss, stats = ppo_policy_loss(logprobs, old, adv, mask, 0.2, clip_high=0.28, kind="cispo")
    loss.backward()
    assert loss.item() == pytest.approx(-1.28 * math.log(1.5), rel=1e-12)
    assert logprobs.grad.item() == pytest.approx(-1.28, rel=1e-12)
    assert float(stats["clip_frac"]) == 1.0
    assert _ppo_one_token(1.5, 1.0, clip=0.2, clip_high=0.28)[1] == 0.0


def test_cispo_equals_trls_documented_formula():
    # TRL 1.16, loss_type="cispo": w = clamp(coef_1, max=epsilon_high).detach() (a cap on the
    # ratio itself: TRL's epsilon_high C is tether's --clip-high C - 1);
    #   per_token = -w * A * logp; loss = sum(per_token * mask) / sum(mask)  (token level)
    logprobs, old, adv, mask = _trl_inputs(seed=6)
    ours, _ = ppo_policy_loss(logprobs, old, adv, mask, 0.2, clip_high=0.3, kind="cispo")
    (grad_ours,) = torch.autograd.grad(ours, logprobs)
    w = torch.exp(logprobs - old).clamp(max=1.3).detach()
    theirs = (-w * adv * logprobs * mask).sum() / mask.sum()
    (grad_theirs,) = torch.autograd.grad(theirs, logprobs)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-12, atol=1e-15)


def test_ppo_policy_loss_names_a_wrong_level_or_kind():
    logprobs, old, adv, mask = _trl_inputs()
    with pytest.raises(ValueError, match="unknown importance level 'seq'"):
        ppo_policy_loss(logprobs, old, adv, mask, level="seq")
    with pytest.raises(ValueError, match="unknown policy loss 'gspo'"):
        ppo_policy_loss(logprobs, old, adv, mask, kind="gspo")


def test_ppo_approx_kl_hand_computed():
    # r = 1.21: k3 for KL(pi_old || pi) is r - 1 - ln r = 0.21 - 0.190620360 = 0.019379640
    _, stats = ppo_policy_loss(torch.tensor([[math.log(1.21)]]), torch.zeros(1, 1),
                               torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool))
    assert float(stats["approx_kl"]) == pytest.approx(0.019379640, rel=1e-5)


def test_ppo_masked_positions_do_not_matter():
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[True, True, False, False], [True, True, True, False]])
    logprobs = -torch.rand(2, 4, generator=gen)
    old = -torch.rand(2, 4, generator=gen)
    advantages = torch.randn(2, 4, generator=gen)
    losses, grads = [], []
    for garbage in (0.0, 50.0):
        lp = logprobs.clone()
        lp[~mask] += garbage
        adv = advantages.clone()
        adv[~mask] -= garbage
        lp.requires_grad_()
        loss, _ = ppo_policy_loss(lp, old, adv, mask)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(lp.grad)
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    torch.testing.assert_close(grads[0], grads[1])
    assert (grads[0][~mask] == 0).all()


# ---------------------------------------------------------------- value loss


def test_value_loss_hand_computed():
    # clip eps = 0.2; per real token, V_clip = V_old + clip(V - V_old, -0.2, 0.2):
    #  1: V 1.5, V_old 1.0, R 2.0 -> V_clip 1.2; (V-R)^2 = 0.25, (V_clip-R)^2 = 0.64 -> 0.64, clipped
    #  2: V 1.1, V_old 1.0, R 0.0 -> V_clip 1.1; both 1.21 -> 1.21, not clipped
    #  3: V 0.0, V_old 1.0, R 0.5 -> V_clip 0.8; 0.25 vs 0.09 -> 0.25, not clipped
    # loss = 0.5 * (0.64 + 1.21 + 0.25) / 3 = 0.35; clip_frac = 1/3. The fourth token is padding.
    values = torch.tensor([[1.5, 1.1, 0.0, 9.0]], requires_grad=True)
    old_values = torch.tensor([[1.0, 1.0, 1.0, -9.0]])
    returns = torch.tensor([[2.0, 0.0, 0.5, 30.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, stats = value_loss(values, old_values, returns, mask, clip=0.2)
    assert float(loss.detach()) == pytest.approx(0.35, rel=1e-6)
    assert float(stats["clip_frac"]) == pytest.approx(1 / 3, rel=1e-6)
    assert float(stats["value_mean"]) == pytest.approx((1.5 + 1.1 + 0.0) / 3, rel=1e-6)
    loss.backward()
    # token 1 takes the clipped branch, whose V_clip is constant in V: zero gradient;
    # token 2: d/dV 0.5 (V-R)^2 / 3 = (1.1 - 0) / 3 (both branches share it, max picks one);
    # token 3: (0 - 0.5) / 3; padding: 0.
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1.1 / 3, -0.5 / 3, 0.0]]))


# ---------------------------------------------------------------- Bradley-Terry


# ---------------------------------------------------------------- micro-batch token counts


def test_token_count_replaces_the_masked_mean_denominator():
    # One real token with squared error (2 - 0)^2 = 4 and no clipping effect (values = old):
    # 0.5 * 4 / 1 = 2 as a token mean; divided by a minibatch count of 4 it is 0.5.
    values, returns = torch.tensor([[2.0, 5.0]]), torch.zeros(1, 2)
    mask = torch.tensor([[True, False]])
    assert float(value_loss(values, values, returns, mask)[0]) == pytest.approx(2.0)
    assert float(value_loss(values, values, returns, mask, denominator=4)[0]) == pytest.approx(0.5)
    # Policy: on-policy, A = 3 on the one real token: -3 / 1 as a mean, -3 / 4 with denominator 4;
    # the stats stay means over the mask (ratio 1, no clipping).
    logprobs, advantages = torch.tensor([[-1.0, -2.0]]), torch.tensor([[3.0, 9.0]])
    loss, stats = ppo_policy_loss(logprobs, logprobs, advantages, mask, denominator=4)
    assert float(loss) == pytest.approx(-0.75)
    assert float(stats["ratio_mean"]) == 1.0
    # An empty mask divides by max(denominator, 1), like the masked mean.
    assert float(reduce_tokens(torch.ones(1, 2), torch.zeros(1, 2), denominator=0)) == 0.0
    with pytest.raises(ValueError, match="denominator must be >= 0"):
        reduce_tokens(torch.ones(1, 2), mask, denominator=-1)
    # Per-sequence sums: one row whose real tokens sum to 4, divided by a minibatch of 2 rows.
    assert float(reduce_tokens(torch.tensor([[4.0, 9.0]]), mask, "sum", denominator=2)) == 2.0


def test_micro_batch_losses_add_up_to_the_minibatch_loss_and_gradient():
    # Rows split 1 + 3 with the minibatch's token count: the losses and their gradients sum to the
    # whole minibatch's masked means (a second implementation: the loss on all rows at once).
    torch.manual_seed(0)
    old = torch.randn(4, 6)
    logprobs = (old + 0.3 * torch.randn(4, 6)).requires_grad_()
    values = torch.randn(4, 6, requires_grad=True)
    advantages, returns, old_values = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 6)
    mask = torch.rand(4, 6) > 0.3
    n_tokens = int(mask.sum())

    def total(rows, n=None):
        pg, _ = ppo_policy_loss(logprobs[rows], old[rows], advantages[rows], mask[rows], 0.2,
                                denominator=n)
        v, _ = value_loss(values[rows], old_values[rows], returns[rows], mask[rows], 0.2,
                          denominator=n)
        return pg + 0.1 * v

    full = total(slice(None))
    full_grads = torch.autograd.grad(full, (logprobs, values))
    parts = total(slice(0, 1), n_tokens) + total(slice(1, 4), n_tokens)
    part_grads = torch.autograd.grad(parts, (logprobs, values))
    torch.testing.assert_close(parts, full)
    for a, b in zip(part_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b)
    # Without the count each part is its own mean: the sum is a different (wrong) number.
    assert float(total(slice(0, 1)) + total(slice(1, 4))) != pytest.approx(float(full))


def test_bradley_terry_hand_computed():
    # equal rewards: -log sigmoid(0) = ln 2
    assert float(bradley_terry_loss(torch.tensor([1.0, -3.0]), torch.tensor([1.0, -3.0]))) == \
        pytest.approx(LN2, rel=1e-6)
    # diff 2: log(1 + e^-2) = 0.126928011
    assert float(bradley_terry_loss(torch.tensor([2.0]), torch.tensor([0.0]))) == \
        pytest.approx(0.126928011, rel=1e-6)
    # margin 1 on diff 0 asks for a gap of 1: -log sigmoid(-1) = log(1 + e) = 1.313261687
    assert float(bradley_terry_loss(torch.tensor([0.0]), torch.tensor([0.0]),
                                    margin=torch.tensor([1.0]))) == pytest.approx(1.313261687)
    # and a margin equal to the gap brings it back to ln 2
    assert float(bradley_terry_loss(torch.tensor([2.0]), torch.tensor([0.5]),
                                    margin=torch.tensor([1.5]))) == pytest.approx(LN2, rel=1e-6)


def test_bradley_terry_gradient_sign():
    chosen = torch.tensor([0.0, 1.0], requires_grad=True)
    rejected = torch.tensor([0.0, 2.0], requires_grad=True)
    bradley_terry_loss(chosen, rejected).backward()
    # dL/dr_c = -sigmoid(-(r_c - r_r)) / B: pair 1 -> -0.5 / 2 = -0.25
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()
    assert float(chosen.grad[0]) == pytest.approx(-0.25)
    torch.testing.assert_close(chosen.grad, -rejected.grad)


# ---------------------------------------------------------------- DPO and IPO


def _pair():
    # log-ratios: chosen -10 - (-12) = 2, rejected -15 - (-14) = -1, so h = 3
    return (torch.tensor([-10.0]), torch.tensor([-15.0]), torch.tensor([-12.0]),
            torch.tensor([-14.0]))


def test_dpo_policy_equal_to_reference_gives_ln2():
    logps = torch.tensor([-3.0, -40.0, -7.5])
    losses, chosen, rejected = dpo_loss(logps, logps - 2, logps.clone(), logps - 2, beta=0.3)
    torch.testing.assert_close(losses, torch.full((3,), LN2))
    assert (chosen == 0).all() and (rejected == 0).all()


def test_dpo_sigmoid_hand_computed():
    # beta h = 0.1 * 3 = 0.3: -log sigmoid(0.3) = log(1 + e^-0.3) = log(1.740818221) = 0.554355244
    losses, chosen, rejected = dpo_loss(*_pair(), beta=0.1)
    assert float(losses[0]) == pytest.approx(0.554355244, rel=1e-6)
    # rewards are beta * (policy - ref): 0.1 * 2 and 0.1 * -1
    assert float(chosen[0]) == pytest.approx(0.2) and float(rejected[0]) == pytest.approx(-0.1)
    # label smoothing 0.1: 0.9 * log(1 + e^-0.3) + 0.1 * log(1 + e^0.3), and
    # log(1 + e^0.3) = 0.3 + log(1 + e^-0.3), so the loss is 0.554355244 + 0.1 * 0.3
    smoothed, _, _ = dpo_loss(*_pair(), beta=0.1, label_smoothing=0.1)
    assert float(smoothed[0]) == pytest.approx(0.584355244, rel=1e-6)


def test_ipo_hand_computed():
    # h = 3, beta (tau) = 0.1: (3 - 1/(2 * 0.1))^2 = (3 - 5)^2 = 4
    losses, chosen, _ = dpo_loss(*_pair(), beta=0.1, loss_type="ipo")
    assert float(losses[0]) == pytest.approx(4.0, rel=1e-6)
    assert float(chosen[0]) == pytest.approx(0.2)
    # per-token: chosen 2 / 4 tokens = 0.5, rejected -1 / 2 tokens = -0.5, h = 1;
    # beta 0.25 -> target 1/(2 * 0.25) = 2 -> (1 - 2)^2 = 1. Rewards are not length-normalised.
    losses, chosen, rejected = dpo_loss(*_pair(), beta=0.25, loss_type="ipo",
                                        chosen_lengths=torch.tensor([4]),
                                        rejected_lengths=torch.tensor([2]))
    assert float(losses[0]) == pytest.approx(1.0, rel=1e-6)
    assert float(chosen[0]) == pytest.approx(0.5) and float(rejected[0]) == pytest.approx(-0.25)


def test_dpo_rejects_bad_arguments():
    pair = _pair()
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(*pair, loss_type="hinge2")
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(*pair, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*pair, label_smoothing=0.5)
    with pytest.raises(ValueError, match="lengths"):
        dpo_loss(*pair, loss_type="ipo", chosen_lengths=torch.tensor([3]))


# The bandit of Azar et al. (2023), section 5: actions a, b, c, preferences a > b, b > c, a > c,
# a uniform reference and tau = beta = 1. With logits theta, log pi(y) - log ref(y) differ between
# actions by theta differences (the uniform reference and the normaliser cancel in h).
CHOSEN, REJECTED = torch.tensor([0, 1, 0]), torch.tensor([1, 2, 2])


def _bandit_losses(theta, loss_type):
    log_pi = torch.log_softmax(theta, -1)
    log_ref = torch.full((3,), -math.log(3.0), dtype=theta.dtype)
    losses, _, _ = dpo_loss(log_pi[CHOSEN], log_pi[REJECTED], log_ref[CHOSEN], log_ref[REJECTED],
                            beta=1.0, loss_type=loss_type)
    return losses.mean()


def test_ipo_bandit_converges_to_the_closed_form_optimum():
    # With x = theta_a - theta_b and y = theta_b - theta_c the IPO objective is
    # (x - 1/2)^2 + (y - 1/2)^2 + (x + y - 1/2)^2; setting both partial derivatives to zero gives
    # x - 1/2 + x + y - 1/2 = 0 = y - 1/2 + x + y - 1/2, so x = y and 3x = 1: x = y = 1/3.
    # The optimal policy is softmax(2/3, 1/3, 0) = (0.4692, 0.3362, 0.1947): it keeps mass on c.
    theta = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = _bandit_losses(theta, "ipo")
        loss.backward()
        return loss

    opt.step(closure)
    policy = torch.softmax(theta.detach(), -1)
    optimum = torch.softmax(torch.tensor([2 / 3, 1 / 3, 0.0], dtype=torch.float64), -1)
    assert (policy - optimum).abs().max() < 0.01
    assert (policy - optimum).abs().max() < 1e-6  # LBFGS on a quadratic: in fact exact


def test_dpo_bandit_runs_to_the_deterministic_corner():
    # DPO on the same data: every pair's loss -log sigmoid(h) falls as h grows without bound, so
    # pi(a) -> 1 and pi(c) -> 0 (the overfitting Azar et al. built IPO to avoid).
    theta = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([theta], lr=0.1)
    pi_a = []
    for step in range(1500):
        opt.zero_grad()
        _bandit_losses(theta, "sigmoid").backward()
        opt.step()
        if step in (749, 1499):
            pi_a.append(float(torch.softmax(theta.detach(), -1)[0]))
    assert pi_a[1] > 0.99
    assert pi_a[1] > pi_a[0]  # still increasing: there is no finite optimum
    assert float(torch.softmax(theta.detach(), -1)[2]) < 1e-3


# ---------------------------------------------------------------- --loss-aggregation


def test_loss_aggregations_hand_computed():
    # Row 0: 2 real tokens of values 1 and 3; row 1: 1 real token of value 6 (its 9 is padding).
    x = torch.tensor([[1.0, 3.0], [6.0, 9.0]])
    mask = torch.tensor([[True, True], [True, False]])
    assert float(reduce_tokens(x, mask, aggregation="token")) == pytest.approx(10 / 3)
    assert float(reduce_tokens(x, mask, aggregation="sum")) == pytest.approx((4 + 6) / 2)
    assert float(reduce_tokens(x, mask, aggregation="sequence")) == pytest.approx((2 + 6) / 2)
    # "token" is the default reduction
    assert float(reduce_tokens(x, mask)) == float(reduce_tokens(x, mask, aggregation="token"))
    # a micro-batch of the first row in a minibatch of 2 rows: (4 / 2) / 2
    assert float(reduce_tokens(x[:1], mask[:1], aggregation="sequence", denominator=2)) == 1.0
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        reduce_tokens(x, mask, aggregation="mean")


@pytest.mark.parametrize("aggregation", ["token", "sequence", "sum"])
def test_loss_aggregations_equal_trls_documented_formulas(aggregation):
    # TRL 1.16 GRPOTrainer, per_token_loss = -min(coef_1 A, coef_2 A) (+ beta * per_token_kl):
    #   loss_type="dapo" (and "bnpo" on one process): sum(per_token_loss * mask) / sum(mask)
    #   loss_type="grpo": mean_i( sum_t(per_token_loss * mask)_i / clamp(sum_t mask_i, min=1) )
    #   loss_type="dr_grpo": sum(per_token_loss * mask) / (B * max_completion_length), which is
    #   tether's "sum" divided by max_completion_length (5 here).
    logprobs, old, adv, mask = _trl_inputs()
    ours, _ = ppo_policy_loss(logprobs, old, adv, mask, 0.2, aggregation=aggregation)
    (grad_ours,) = torch.autograd.grad(ours, logprobs)
    ratio = torch.exp(logprobs - old)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    if aggregation == "token":
        theirs = (per_token * mask).sum() / mask.sum()
    elif aggregation == "sequence":
        theirs = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    else:
        theirs = (per_token * mask).sum() / (mask.shape[0] * 5) * 5  # dr_grpo times L_max
    (grad_theirs,) = torch.autograd.grad(theirs, logprobs)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-12, atol=1e-15)


def test_sequence_aggregation_micro_batches_add_up():
    # Each row's mean is its own, so split rows divided by the minibatch's row count add up.
    logprobs, old, adv, mask = _trl_inputs()
    full, _ = ppo_policy_loss(logprobs, old, adv, mask, aggregation="sequence")
    parts = sum(ppo_policy_loss(logprobs[rows], old[rows], adv[rows], mask[rows],
                                aggregation="sequence", denominator=3)[0]
                for rows in (slice(0, 1), slice(1, 3)))
    torch.testing.assert_close(parts, full, rtol=1e-12, atol=1e-15)


def test_label_smoothing_is_conservative_dpo_where_trls_sigmoid_ignores_it():
    # docs/from_trl.md: beta * h = 0.5 and e = 0.1. Conservative DPO (Mitchell 2023):
    # 0.9 * log(1 + e^-0.5) + 0.1 * log(1 + e^0.5) = 0.9 * 0.474077 + 0.1 * 0.974077 = 0.524077;
    # TRL 1.16's loss_type="sigmoid" reads no label_smoothing: -log sigmoid(0.5) = 0.474077.
    h = torch.tensor([5.0])  # chosen log-ratio 5, rejected 0: beta * h = 0.5 at beta 0.1
    zero = torch.zeros(1)
    smoothed, _, _ = dpo_loss(h, zero, zero, zero, beta=0.1, label_smoothing=0.1)
    plain, _, _ = dpo_loss(h, zero, zero, zero, beta=0.1)
    assert float(smoothed) == pytest.approx(0.524077, abs=1e-6)
    assert float(plain) == pytest.approx(0.474077, abs=1e-6)


def test_a_new_objective_reads_its_inputs_by_name_through_the_update(monkeypatch):
    # A policy loss that needs another input (here the reference's log-probs and the group) is
    # its function and one table entry (tether.choices.POLICY_LOSSES): update_loss hands every
    # input it has to the objective by name, and the loss is the objective's, reduced.
    from tether import choices
    from tether.losses import LossInputs, PolicyLoss
    from tether.rl.scoring import Forward
    from tether.rl.update import Counts, LossBatch, UpdateSpec, update_loss

    seen: list[LossInputs] = []

    def ref_anchored(x: LossInputs):  # -A * ratio + (log pi - log ref), per token
        seen.append(x)
        return -x.advantages * x.ratio + (x.logprobs - x.ref_logprobs), x.mask & False
    monkeypatch.setitem(choices.POLICY_LOSSES, "ref_anchored",
                        choices.Objective("a test objective", ref_anchored))
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0], [-1.0, -1.0]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.tensor([[True, True], [True, False]])
    batch = LossBatch(logprobs.detach(), ref, torch.zeros(2, 2), adv, torch.zeros(2, 2), mask, mask)
    spec = UpdateSpec(policy=PolicyLoss(policy_loss="ref_anchored"))
    loss, stats = update_loss(Forward(logprobs, torch.zeros(2, 2), None, None), batch, spec, 0.0,
                              Counts(3, 2, 3), with_critic=False)
    # on-policy, ratio 1 on every token: per token -A + (log pi - log ref) = [[-0.5, -1], [2.5, .]];
    # the token mean over the 3 tokens that carry loss: (-0.5 - 1 + 2.5) / 3 = 1/3
    assert float(loss) == pytest.approx(1 / 3)
    assert seen[0].ref_logprobs is ref and seen[0].group_size == spec.advantage.samples_per_prompt
    assert stats["policy/clip_frac"] == 0.0
