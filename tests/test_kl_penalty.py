"""tether.losses' KL loss terms (kl_penalty, exact_kl_penalty) and the two token reductions,
against hand-computed values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from tether import kl as kl_lib
from tether.losses import exact_kl_penalty, kl_penalty, ppo_policy_loss, reduce_tokens

LN2 = math.log(2.0)
MASK = torch.tensor([[True, True], [True, False]])  # lengths 2 and 1: 3 real tokens, B = 2


def test_k2_reductions_hand_computed():
    # d = logprobs - ref = (1, 2) and (-2); k2 = d^2/2 = (0.5, 2) and (2).
    # Per-sequence sums (2.5, 2), mean over the 2 sequences 2.25; token mean 4.5 / 3 = 1.5.
    logprobs = torch.tensor([[-1.0, -1.0], [-3.0, 7.0]])
    ref_logprobs = torch.tensor([[-2.0, -3.0], [-1.0, 0.0]])
    penalty, stats = kl_penalty(logprobs, logprobs, ref_logprobs, MASK, "k2")
    assert float(penalty) == pytest.approx(2.25)
    assert float(stats["kl_per_sequence"]) == pytest.approx(2.25)
    assert float(stats["kl_per_token"]) == pytest.approx(1.5)
    token_mean, _ = kl_penalty(logprobs, logprobs, ref_logprobs, MASK, "k2", aggregation="token")
    assert float(token_mean) == pytest.approx(1.5)
    # the two reductions differ by the mean length L = 3 / 2
    assert float(penalty) == pytest.approx(1.5 * float(token_mean))


def _one_token(estimator, d, log_ratio_to_old=0.0):
    """Penalty and its derivative in log pi(y) for one token with log pi - log ref = d."""
    logprobs = torch.tensor([[d]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[d - log_ratio_to_old]], dtype=torch.float64)
    penalty, _ = kl_penalty(logprobs, old, torch.zeros(1, 1, dtype=torch.float64),
                            torch.ones(1, 1, dtype=torch.bool), estimator)
    (grad,) = torch.autograd.grad(penalty, logprobs)
    return float(penalty.detach()), float(grad)


def test_k3_and_k3_ratio_values_and_gradients_by_hand():
    # d = ln 2: ref/pi = 1/2, k3 = 1/2 - 1 + ln 2 = ln 2 - 1/2, dk3/dlogpi = 1 - ref/pi = 1/2.
    assert _one_token("k3", LN2) == pytest.approx((LN2 - 0.5, 0.5))
    # On-policy rho = 1: same value; d(rho k3)/dlogpi = rho k3 + rho (1 - ref/pi) = ln 2.
    assert _one_token("k3_ratio", LN2) == pytest.approx((LN2 - 0.5, LN2))
    # pi = 2 pi_old: rho = 2 doubles both terms: value 2 ln 2 - 1, gradient 2 ln 2.
    assert _one_token("k3_ratio", LN2, log_ratio_to_old=LN2) == pytest.approx(
        (2 * LN2 - 1, 2 * LN2))
    # d = -ln 2: ref/pi = 2, k3 = 2 - 1 - ln 2 = 1 - ln 2, gradient 1 - 2 = -1.
    assert _one_token("k3", -LN2) == pytest.approx((1 - LN2, -1.0))
    # k2 = d^2/2, gradient d
    assert _one_token("k2", -LN2) == pytest.approx((LN2**2 / 2, -LN2))


def test_old_logprobs_carry_no_gradient():
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    old = logprobs.detach().clone().requires_grad_(True)
    penalty, _ = kl_penalty(logprobs, old, torch.full((2, 2), -1.5), MASK, "k3_ratio")
    penalty.backward()
    assert old.grad is None
    assert logprobs.grad is not None and float(logprobs.grad[1, 1]) == 0.0  # padding


def test_padding_garbage_never_reaches_value_or_gradient():
    # padding may hold -inf or NaN (a masked logit); nothing may leak into value or gradient
    clean = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    ref = torch.tensor([[-1.5, -1.0], [-2.0, 0.0]])
    dirty = clean.clone()
    dirty[1, 1] = float("-inf")
    dirty_ref = ref.clone()
    dirty_ref[1, 1] = float("nan")
    for estimator in ("k2", "k3", "k3_ratio"):
        want, _ = kl_penalty(clean, clean, ref, MASK, estimator)
        logprobs = dirty.clone().requires_grad_(True)
        got, _ = kl_penalty(logprobs, dirty, dirty_ref, MASK, estimator)
        got.backward()
        assert float(got.detach()) == pytest.approx(float(want))
        assert torch.isfinite(logprobs.grad).all()
    exact = torch.tensor([[0.2, 0.3], [0.5, float("nan")]])
    assert float(exact_kl_penalty(exact, MASK)[0]) == pytest.approx((0.5 + 0.5) / 2)


def test_exact_kl_penalty_sums_tether_kl_exact():
    # per-position exact KL from logits, summed over each row's real tokens, mean over rows
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 2, 5, generator=gen, dtype=torch.float64)
    ref_logits = torch.randn(2, 2, 5, generator=gen, dtype=torch.float64)
    per_position = kl_lib.exact(logits, ref_logits)  # fp32, as documented
    penalty, stats = exact_kl_penalty(per_position, MASK)
    by_hand = (float(per_position[0, 0] + per_position[0, 1]) + float(per_position[1, 0])) / 2
    assert float(penalty) == pytest.approx(by_hand, rel=1e-6)
    token_mean, _ = exact_kl_penalty(per_position, MASK, aggregation="token")
    assert float(token_mean) == pytest.approx(2 * by_hand / 3, rel=1e-6)


def test_policy_loss_per_sequence_reduction_hand_computed():
    # On-policy ratio 1, loss = -A. Sequence sums (1 - 2, 0.5) = (-1, 0.5); their mean -0.25, so
    # loss 0.25. The default token mean stays -(1 - 2 + 0.5) / 3 = 0.5 / 3.
    logprobs = torch.tensor([[-1.0, -2.0], [-0.3, -5.0]])
    advantages = torch.tensor([[1.0, -2.0], [0.5, 100.0]])
    per_sequence, _ = ppo_policy_loss(logprobs, logprobs, advantages, MASK, aggregation="sum")
    token_mean, _ = ppo_policy_loss(logprobs, logprobs, advantages, MASK)
    assert float(per_sequence) == pytest.approx(0.25)
    assert float(token_mean) == pytest.approx(0.5 / 3)
    assert float(reduce_tokens(advantages, MASK, "token")) == pytest.approx(-0.5 / 3)


def test_kl_penalty_rejects_bad_input():
    x = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="cannot be a loss term"):
        kl_penalty(x, x, x, MASK, "k1")
    with pytest.raises(ValueError, match="cannot be a loss term"):
        kl_penalty(x, x, x, MASK, "abs")
    with pytest.raises(ValueError, match="exact_kl_penalty"):
        kl_penalty(x, x, x, MASK, "exact")
    with pytest.raises(ValueError, match="unknown KL loss estimator"):
        kl_penalty(x, x, x, MASK, "k4")
    with pytest.raises(ValueError, match="shape mismatch"):
        kl_penalty(x, torch.zeros(2, 3), x, MASK, "k3")
    with pytest.raises(ValueError, match="shape mismatch"):
        exact_kl_penalty(torch.zeros(2, 3), MASK)


def test_loss_estimator_names():
    # one table (tether.choices.KL_ESTIMATORS): each placement's names follow from its facts
    import inspect

    from tether.choices import KL_DEFAULTS

    default = inspect.signature(kl_penalty).parameters["estimator"].default
    assert KL_DEFAULTS["loss"] == default == "k3_ratio" and default in kl_lib.LOSS_ESTIMATORS
    assert set(kl_lib.LOSS_ESTIMATORS) & set(kl_lib.ESTIMATORS) == {"k2", "k3"}
    assert set(kl_lib.ESTIMATORS) == {"k1", "k2", "k3", "abs"}
    assert set(kl_lib.LOSS_ESTIMATORS) == {"k2", "k3", "k3_ratio", "exact", "forward", "jsd"}


def test_a_name_the_table_lacks_is_an_error_at_the_table_never_another_entry(monkeypatch):
    # Before the table, kl.estimate and kl_penalty fell through to k3 for a name without its
    # own branch. An entry now carries its term: one added to the table is used as written.
    from tether import choices

    x, y = torch.tensor([[0.3, -0.2]]), torch.tensor([[0.1, 0.1]])
    monkeypatch.setitem(choices.KL_ESTIMATORS, "k4", choices.KLEstimator(
        "d^4", lambda d: d ** 4, in_reward=True, in_loss=True))
    monkeypatch.setattr(kl_lib, "ESTIMATORS", (*kl_lib.ESTIMATORS, "k4"))
    assert torch.equal(kl_lib.estimate(x, y, "k4"), (x - y) ** 4)
    penalty, _ = kl_penalty(x, x, y, torch.ones(1, 2, dtype=torch.bool), "k4")
    assert float(penalty) == pytest.approx(float(((x - y) ** 4).sum()))  # "sum": one row
    with pytest.raises(ValueError, match="unknown KL estimator 'k5'; choose one of"):
        kl_lib.estimate(x, y, "k5")
