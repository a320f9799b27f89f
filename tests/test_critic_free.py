"""tether.advantages' critic-free estimators (rloo, grpo, reinforce_pp) against hand-computed
numbers, their defining properties, and bad input."""

from __future__ import annotations

import pytest
import torch

from tether.advantages import grpo, kl_shaped_rewards, overlong_penalty, reinforce_pp, rloo

# Two prompts, k = 3 samples each (rows 0-2 and 3-5), T = 3, ragged lengths. Each row's rewards
# sum to its return R over the real tokens; padding holds garbage that must not count.
LENGTHS = [1, 3, 2, 3, 1, 2]
RETURNS = [1.0, 2.0, 6.0, 0.0, 0.0, 3.0]


def ragged_mask(lengths=LENGTHS, width=3):
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # [B, T] bool


def group_rewards():
    """[6, 3] per-token rewards whose real tokens sum to RETURNS; NaN and 100 on padding."""
    mask = ragged_mask()
    rewards = torch.full((6, 3), 100.0)
    rewards[0, 2] = float("nan")
    for row, (length, total) in enumerate(zip(LENGTHS, RETURNS)):
        rewards[row, :length] = 0.5  # spread a little over the tokens ...
        rewards[row, length - 1] = total - 0.5 * (length - 1)  # ... the rest on the last one
    return rewards, mask


def on_tokens(per_row, mask):
    return torch.tensor(per_row)[:, None] * mask


def test_rloo_hand_computed():
    # Group 0, R = (1, 2, 6), sum 9: A_i = R_i - (9 - R_i)/2 = (1 - 4, 2 - 3.5, 6 - 1.5)
    #   = (-3, -1.5, 4.5), which is also k/(k-1) (R - mean) = 1.5 * (-2, -1, 3).
    # Group 1, R = (0, 0, 3), sum 3: A = (0 - 1.5, 0 - 1.5, 3 - 0) = (-1.5, -1.5, 3).
    rewards, mask = group_rewards()
    advantages = rloo(rewards, mask, k=3)
    torch.testing.assert_close(advantages, on_tokens([-3.0, -1.5, 4.5, -1.5, -1.5, 3.0], mask))


def test_grpo_group_std_hand_computed():
    # Group 0, R = (1, 2, 6): mean 3, deviations (-2, -1, 3); the sample variance is
    # (4 + 1 + 9) / 2 = 7 (the population one would be 14/3), so A = (-2, -1, 3) / (sqrt 7 + 1e-4).
    # Group 1, R = (0, 0, 3): mean 1, deviations (-1, -1, 2), sample variance 6 / 2 = 3.
    rewards, mask = group_rewards()
    advantages = grpo(rewards, mask, k=3)
    s0, s1 = 7**0.5 + 1e-4, 3**0.5 + 1e-4
    expected = on_tokens([-2 / s0, -1 / s0, 3 / s0, -1 / s1, -1 / s1, 2 / s1], mask)
    torch.testing.assert_close(advantages, expected)


def test_grpo_without_scaling_hand_computed():
    # Dr. GRPO: the deviations from the group mean, unscaled.
    rewards, mask = group_rewards()
    advantages = grpo(rewards, mask, k=3, scale_rewards="none")
    torch.testing.assert_close(advantages, on_tokens([-2.0, -1.0, 3.0, -1.0, -1.0, 2.0], mask))


def test_grpo_batch_std_hand_computed():
    # scale_rewards="batch": the group's deviations over the std of all six rewards
    # R = (1, 2, 6, 0, 0, 3): mean 2, squared deviations 1 + 0 + 16 + 4 + 4 + 1 = 26, sample
    # variance 26 / 5 = 5.2. Group 1's deviations are no longer scaled up by its smaller std.
    rewards, mask = group_rewards()
    advantages = grpo(rewards, mask, k=3, scale_rewards="batch")
    s = 5.2**0.5 + 1e-4
    expected = on_tokens([-2 / s, -1 / s, 3 / s, -1 / s, -1 / s, 2 / s], mask)
    torch.testing.assert_close(advantages, expected)


def test_grpo_batch_scaling_equals_trls_documented_formula():
    # TRL 1.16, scale_rewards="batch": advantages = (r - mean of its group) / (r.std() + 1e-4),
    # the std over the whole batch's rewards (sample std, torch's default).
    gen = torch.Generator().manual_seed(5)
    k, n_prompts = 4, 6
    lengths = torch.randint(1, 5, (n_prompts * k,), generator=gen)
    mask = torch.arange(5)[None, :] < lengths[:, None]
    scores = torch.randn(n_prompts * k, generator=gen, dtype=torch.float64)
    rewards = torch.zeros(n_prompts * k, 5, dtype=torch.float64)
    rewards[torch.arange(n_prompts * k), lengths - 1] = scores  # the score on the last token
    mean_grouped = scores.view(-1, k).mean(dim=1).repeat_interleave(k)
    theirs = (scores - mean_grouped) / (scores.std() + 1e-4)
    ours = grpo(rewards, mask, k, scale_rewards="batch")
    torch.testing.assert_close(ours, (theirs[:, None] * mask).float())  # grpo returns fp32


@pytest.mark.parametrize("k", [2, 3, 4])
def test_rloo_and_grpo_properties(k):
    gen = torch.Generator().manual_seed(k)
    n_prompts, width = 5, 6
    lengths = torch.randint(1, width + 1, (n_prompts * k,), generator=gen)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    rewards = torch.randn(n_prompts * k, width, generator=gen, dtype=torch.float64)
    returns = (rewards * mask).sum(-1).view(n_prompts, k)
    advantages = rloo(rewards, mask, k)
    per_row = advantages[torch.arange(n_prompts * k), lengths - 1].view(n_prompts, k)
    # one value per row, on every real token, zero on padding
    torch.testing.assert_close(advantages, per_row.reshape(-1, 1).float() * mask)
    # each group's advantages sum to 0, and equal k/(k-1) (R_i - group mean)
    torch.testing.assert_close(per_row.sum(1), torch.zeros(n_prompts), atol=1e-5, rtol=0)
    centred = returns - returns.mean(1, keepdim=True)
    torch.testing.assert_close(per_row.double(), k / (k - 1) * centred, rtol=1e-5, atol=1e-5)
    # Dr. GRPO is RLOO times (k-1)/k
    torch.testing.assert_close(grpo(rewards, mask, k, scale_rewards="none"),
                               advantages * (k - 1) / k, rtol=1e-5, atol=1e-6)
    # GRPO's group-scaled advantages have group sample std 1 (up to eps)
    scaled = grpo(rewards, mask, k)[torch.arange(n_prompts * k), lengths - 1].view(n_prompts, k)
    torch.testing.assert_close(scaled.double().std(1), torch.ones(n_prompts, dtype=torch.float64),
                               rtol=1e-3, atol=0)


def test_constant_rewards_give_zero_advantages():
    # Every sample of a group scored alike (a prompt all answers solve, or all fail): no signal,
    # and std scaling must give 0 / (0 + eps) = 0, not NaN.
    mask = ragged_mask()
    rewards = torch.zeros(6, 3)
    rewards[torch.arange(6), torch.tensor(LENGTHS) - 1] = 0.7
    for advantages in (rloo(rewards, mask, 3), grpo(rewards, mask, 3),
                       grpo(rewards, mask, 3, scale_rewards="none"), reinforce_pp(rewards, mask)):
        assert torch.isfinite(advantages).all()
        assert float(advantages.abs().max()) < 1e-3


def test_reinforce_pp_hand_computed():
    # gamma = 1, returns-to-go G_t = sum_{s>=t} r_s on real tokens:
    #   row 0, length 2, r = (-2, 3):     G = (1, 3)
    #   row 1, length 3, r = (2, -1, 2):  G = (3, 1, 2)
    # over the five real tokens: mean 2, population variance (1+1+1+1+0)/5 = 0.8, so
    # A = (G - 2) / sqrt(0.8) = (-1, 1) / sqrt(0.8) and (1, -1, 0) / sqrt(0.8).
    rewards = torch.tensor([[-2.0, 3.0, 50.0], [2.0, -1.0, 2.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    advantages = reinforce_pp(rewards, mask)
    expected = torch.tensor([[-1.0, 1.0, 0.0], [1.0, -1.0, 0.0]]) / 0.8**0.5
    torch.testing.assert_close(advantages, expected)


def test_reinforce_pp_discounted_matches_python_loop():
    gen = torch.Generator().manual_seed(7)
    mask = ragged_mask()
    rewards = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    gamma = 0.9
    returns = []
    for row, length in enumerate(LENGTHS):
        running, row_returns = 0.0, [0.0] * length
        for t in reversed(range(length)):
            running = float(rewards[row, t]) + gamma * running
            row_returns[t] = running
        returns += row_returns
    returns = torch.tensor(returns, dtype=torch.float64)
    expected = (returns - returns.mean()) / returns.std(unbiased=False)
    advantages = reinforce_pp(rewards, mask, gamma=gamma)
    torch.testing.assert_close(advantages[mask].double(), expected, rtol=1e-5, atol=1e-6)
    assert (advantages[~mask] == 0).all()


def test_kl_shaped_rewards_feed_the_estimators():
    # With the KL in the reward, R_i = score_i - beta * sum_t kl_t. Two samples of one prompt,
    # k1, beta = 0.5: row 0 d = (1, -1) -> KL 0, R = 2; row 1 d = (2) -> KL 2, R = 3 - 1 = 2.
    # Equal total rewards: RLOO sees no difference, though the scores differ.
    logprobs = torch.tensor([[-1.0, -2.0], [-1.0, 0.0]])
    ref_logprobs = torch.tensor([[-2.0, -1.0], [-3.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    rewards, _ = kl_shaped_rewards(torch.tensor([2.0, 3.0]), logprobs, ref_logprobs, mask, 0.5)
    torch.testing.assert_close(rloo(rewards, mask, 2), torch.zeros(2, 2))
    # beta = 0 (the KL-in-the-loss runs): the scores alone, A = (2 - 3, 3 - 2)
    rewards, _ = kl_shaped_rewards(torch.tensor([2.0, 3.0]), logprobs, ref_logprobs, mask, 0.0)
    torch.testing.assert_close(rloo(rewards, mask, 2), torch.tensor([[-1.0, -1.0], [1.0, 0.0]]))


def test_estimators_reject_bad_input():
    rewards, mask = group_rewards()
    with pytest.raises(ValueError, match="whole number of groups"):
        rloo(rewards, mask, k=4)
    with pytest.raises(ValueError, match="k >= 2"):
        rloo(rewards, mask, k=1)
    with pytest.raises(ValueError, match="k >= 2"):
        grpo(rewards, mask, k=1)
    with pytest.raises(ValueError, match="scale_rewards"):
        grpo(rewards, mask, k=3, scale_rewards="global")
    with pytest.raises(ValueError, match="shape mismatch"):
        grpo(rewards, mask[:, :2], k=3)
    empty = mask.clone()
    empty[4] = False
    with pytest.raises(ValueError, match="no real tokens"):
        rloo(rewards, empty, k=3)
    with pytest.raises(ValueError, match="gamma"):
        reinforce_pp(rewards, mask, gamma=1.5)


def test_overlong_penalty_hand_computed_and_trls_example():
    # DAPO eq. 13 with L_max 100, L_cache 20: 0 up to 80 tokens, then linear to -1 at 100.
    # TRL's docstring example of get_soft_overlong_punishment: 90 tokens -> -0.5.
    lengths = torch.tensor([50, 80, 81, 90, 100, 101])
    got = overlong_penalty(lengths, 100, 20)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.05, -0.5, -1.0, -1.0]))
    with pytest.raises(ValueError, match="cache must be > 0"):
        overlong_penalty(lengths, 100, 0)


def test_varied_groups_hand_computed():
    from tether.advantages import varied_groups

    # groups of 3: all equal (1, 1, 1), varied (0, 1, 0), all equal (0, 0, 0), varied (2, 2, 2.5)
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.5])
    assert varied_groups(scores, 3).tolist() == [False, True, False, True]
    with pytest.raises(ValueError, match="do not split into groups of 5"):
        varied_groups(scores, 5)
