"""tether.advantages against hand-computed rewards, a plain-Python GAE loop, and the whitening
invariants, on ragged masks (EOS mid-sequence, truncated, one-token responses)."""

from __future__ import annotations

import pytest
import torch

from tether import kl as kl_lib
from tether.advantages import gae, kl_shaped_rewards, whiten

# Ragged right-padded masks, T = 6: EOS mid-sequence (length 3), truncated (all 6 real),
# a one-token response, and length 5.
LENGTHS = [3, 6, 1, 5]


def ragged_mask(lengths=LENGTHS, width=6):
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # [B, T] bool


def test_shaped_rewards_hand_computed():
    # Row 0: length 3 (EOS at index 2); row 1: a one-token response. beta = 0.1, k1, so
    # kl_t = logprobs - ref_logprobs on real tokens and 0 on padding (whatever its log-probs):
    #   row 0: d = [-1 - (-1.5), -2 - (-1), -0.5 - (-0.5)] = [0.5, -1, 0]
    #          r = [-0.05, +0.1, 0 + score 1.0] = [-0.05, 0.1, 1.0], padding 0
    #   row 1: d = [-2 - (-1)] = [-1]; r = [0.1 + score (-2.0)] = [-1.9], padding 0
    scores = torch.tensor([1.0, -2.0])
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-2.0, -9.0, -9.0, -9.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-1.0, -1.0, 0.0, -4.0]])
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    rewards, kl = kl_shaped_rewards(scores, logprobs, ref_logprobs, mask, beta=0.1)
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1, 1.0, 0.0],
                                                      [-1.9, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_shaped_rewards_ragged(estimator):
    gen = torch.Generator().manual_seed(0)
    mask = ragged_mask()
    logprobs = -3 * torch.rand(4, 6, generator=gen)
    ref_logprobs = -3 * torch.rand(4, 6, generator=gen)
    scores = torch.tensor([0.7, -1.2, 2.5, 0.0])
    beta = 0.05
    rewards, kl = kl_shaped_rewards(scores, logprobs, ref_logprobs, mask, beta, estimator)
    expected_kl = kl_lib.estimate(logprobs, ref_logprobs, estimator) * mask
    torch.testing.assert_close(kl, expected_kl)
    # Removing the KL part leaves the score exactly at index length-1 of each row, else zero:
    # for the truncated row (length 6) that is the final position, not one past it.
    score_part = rewards + beta * kl
    expected = torch.zeros(4, 6)
    for row, length in enumerate(LENGTHS):
        expected[row, length - 1] = scores[row]
    torch.testing.assert_close(score_part, expected)
    assert (rewards[~mask] == 0).all() and (kl[~mask] == 0).all()


def test_shaped_rewards_rejects_bad_input():
    mask = ragged_mask()
    lp = torch.zeros(4, 6)
    scores = torch.zeros(4)
    empty_row = mask.clone()
    empty_row[2] = False
    with pytest.raises(ValueError, match="no real tokens"):
        kl_shaped_rewards(scores, lp, lp, empty_row, 0.1)
    with pytest.raises(ValueError, match="shape mismatch"):
        kl_shaped_rewards(scores, lp, torch.zeros(4, 5), mask, 0.1)
    with pytest.raises(ValueError, match="shape mismatch"):
        kl_shaped_rewards(torch.zeros(3), lp, lp, mask, 0.1)
    with pytest.raises(ValueError, match="beta"):
        kl_shaped_rewards(scores, lp, lp, mask, -0.1)
    with pytest.raises(ValueError, match="estimator"):
        kl_shaped_rewards(scores, lp, lp, mask, 0.1, estimator="k5")


def python_gae(rewards, values, lengths, gamma, lam):
    """Textbook GAE, one row and one position at a time; V past the last real token is 0."""
    batch, width = rewards.shape
    advantages = [[0.0] * width for _ in range(batch)]
    for b in range(batch):
        next_advantage = 0.0
        for t in reversed(range(lengths[b])):
            next_value = float(values[b, t + 1]) if t + 1 < lengths[b] else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            next_advantage = delta + gamma * lam * next_advantage
            advantages[b][t] = next_advantage
    advantages = torch.tensor(advantages, dtype=torch.float64)
    returns = [[float(advantages[b, t] + values[b, t]) if t < lengths[b] else 0.0
                for t in range(width)] for b in range(batch)]
    return advantages, torch.tensor(returns, dtype=torch.float64)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.95), (0.9, 0.5), (1.0, 0.0),
                                        (0.0, 1.0), (1.0, 1.0)])
def test_gae_matches_python_loop(gamma, lam):
    gen = torch.Generator().manual_seed(1)
    mask = ragged_mask()
    # padding holds garbage on purpose: it must not leak into real positions
    rewards = torch.randn(4, 6, generator=gen)
    values = torch.randn(4, 6, generator=gen)
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    want_adv, want_ret = python_gae(rewards, values, LENGTHS, gamma, lam)
    torch.testing.assert_close(advantages.double(), want_adv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(returns.double(), want_ret, rtol=1e-5, atol=1e-6)
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()


def test_gae_lambda_one_gamma_one_gives_reward_to_go():
    # With gamma = lam = 1 the value terms telescope: A_t = sum_{s>=t} r_s - V_t, so the
    # returns are the plain reward-to-go. Row 0 by hand: r = [1, 2, 3], returns = [6, 5, 3].
    rewards = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, -1.0, 0.5, 2.0]])
    values = torch.tensor([[0.3, -0.2, 7.0, 5.0], [1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    _, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, torch.tensor([[6.0, 5.0, 3.0, 0.0],
                                                      [5.5, 1.5, 2.5, 2.0]]))


def test_gae_rejects_bad_input():
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="gamma"):
        gae(x, x, mask, gamma=1.1)
    with pytest.raises(ValueError, match="lam"):
        gae(x, x, mask, lam=-0.1)
    with pytest.raises(ValueError, match="shape mismatch"):
        gae(x, torch.zeros(2, 4), mask)


def _masked_stats(x, mask):
    values = x[mask].double()
    return float(values.mean()), float(values.std(unbiased=False))


def test_whiten_masked_mean_zero_std_one():
    gen = torch.Generator().manual_seed(2)
    mask = ragged_mask()
    x = 3.0 + 5.0 * torch.randn(4, 6, generator=gen)
    x[~mask] = 1e4  # huge padding values must not move the statistics
    out = whiten(x, mask)
    mean, std = _masked_stats(out, mask)
    assert mean == pytest.approx(0.0, abs=1e-6)
    assert std == pytest.approx(1.0, rel=1e-5)  # population std, as documented
    assert (out[~mask] == 0).all()
    # order is kept: whitening is an increasing affine map on the real positions
    assert torch.equal(out[mask].argsort(), x[mask].argsort())


def test_whiten_without_shift_keeps_the_mean():
    gen = torch.Generator().manual_seed(3)
    mask = ragged_mask()
    x = 2.0 + 4.0 * torch.randn(4, 6, generator=gen)
    original_mean, _ = _masked_stats(x, mask)
    out = whiten(x, mask, shift_mean=False)
    mean, std = _masked_stats(out, mask)
    assert mean == pytest.approx(original_mean, rel=1e-5)
    assert std == pytest.approx(1.0, rel=1e-5)
    assert (out[~mask] == 0).all()


def test_whiten_rejects_empty_mask():
    with pytest.raises(ValueError, match="at least one"):
        whiten(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool))


def test_padding_contents_never_leak():
    # A padded position may hold anything, inf or NaN included (a masked-out logit, a value head
    # reading a pad token). Rewards, KL, advantages and returns on real tokens must not change.
    mask = torch.tensor([[True, True, False]])
    lp, ref_lp = torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-1.5, -1.0, 0.0]])
    clean_rewards, clean_kl = kl_shaped_rewards(torch.tensor([1.0]), lp, ref_lp, mask, 0.1)
    lp_bad, ref_bad = lp.clone(), ref_lp.clone()
    lp_bad[0, 2], ref_bad[0, 2] = float("nan"), float("-inf")
    rewards, kl = kl_shaped_rewards(torch.tensor([1.0]), lp_bad, ref_bad, mask, 0.1)
    torch.testing.assert_close(rewards, clean_rewards)
    torch.testing.assert_close(kl, clean_kl)
    values = torch.tensor([[0.5, 0.25, float("nan")]])
    advantages, returns = gae(rewards, values, mask)
    assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()
    clean_adv, _ = gae(clean_rewards, torch.tensor([[0.5, 0.25, 0.0]]), mask)
    torch.testing.assert_close(advantages, clean_adv)
