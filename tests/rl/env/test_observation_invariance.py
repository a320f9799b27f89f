"""An environment's tokens between two turns change nothing the update computes: with the same
log-probs, values and rewards on the policy's own tokens, inserting observation tokens between
the turns (holding anything, NaN and 1e30 included) leaves every advantage estimator's output
(gae included, whose return carries across them), the loss of every term, its gradient and the
token counts unchanged, and gives the observation tokens exactly zero gradient.

Independent truth: the same numbers laid out without the observations."""

from __future__ import annotations

import pytest
import torch

from tether.advantages import AdvantageSpec, estimate_advantages, kl_shaped_rewards
from tether.kl import KLPlacement
from tether.losses import PolicyLoss
from tether.rl.scoring import Forward
from tether.rl.update import Counts, LossBatch, UpdateSpec, counts_of, update_loss

TURNS = [(3, 2), (1, 4), (2, 2), (4, 1)]  # (first turn, second turn) tokens of each row
GAPS = [2, 5, 1, 3]  # observation tokens between the turns


def layout(gaps: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
    """[B, T] action mask with `gaps[i]` unsampled tokens between row i's turns, and each row's
    action positions in order."""
    width = max(a + b + g for (a, b), g in zip(TURNS, gaps)) + 1  # a padding column too
    mask = torch.zeros(len(TURNS), width, dtype=torch.bool)
    positions = []
    for i, ((a, b), g) in enumerate(zip(TURNS, gaps)):
        where = list(range(a)) + list(range(a + g, a + g + b))
        mask[i, where] = True
        positions.append(where)
    return mask, positions


def placed(values: list[list[float]], mask: torch.Tensor, positions, fill: float) -> torch.Tensor:
    out = torch.full(mask.shape, fill, dtype=torch.float64)
    for i, where in enumerate(positions):
        out[i, where] = torch.tensor(values[i], dtype=torch.float64)
    return out


def per_token(seed: int) -> list[list[float]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(a + b, generator=gen, dtype=torch.float64).tolist() for a, b in TURNS]


def both(fill: float):
    """The same per-token numbers laid out without (gaps 0) and with observations (`fill`)."""
    numbers = {name: per_token(seed) for seed, name in enumerate(
        ("logprobs", "old", "ref", "values", "old_values", "returns"))}
    out = []
    for gaps in ([0] * len(TURNS), GAPS):
        mask, positions = layout(gaps)
        tensors = {name: placed(v, mask, positions, fill if gaps != [0] * 4 else 0.0)
                   for name, v in numbers.items()}
        out.append((mask, positions, tensors))
    return out


def at_actions(x: torch.Tensor, positions) -> list[float]:
    return [v for i, where in enumerate(positions) for v in x[i, where].tolist()]


@pytest.mark.parametrize("estimator", ["gae", "rloo", "grpo", "reinforce++"])
@pytest.mark.parametrize("fill", [float("nan"), 1e30])
def test_advantages_do_not_see_observations(estimator, fill):
    spec = AdvantageSpec(estimator, gamma=0.9, lam=0.8, whiten_advantages=True,
                         samples_per_prompt=2, scale_rewards="group")
    scores = torch.tensor([1.0, -0.5, 2.0, 0.25], dtype=torch.float64)
    results = []
    for mask, positions, t in both(fill):
        rewards, kl = kl_shaped_rewards(scores, t["old"], t["ref"], mask, 0.1)
        advantages, returns = estimate_advantages(spec, rewards, t["values"], mask)
        assert bool((advantages[~mask] == 0).all()) and bool(torch.isfinite(advantages).all())
        results.append((at_actions(advantages, positions), at_actions(returns, positions),
                        at_actions(kl, positions)))
    (a0, r0, k0), (a1, r1, k1) = results
    assert k0 == k1  # the KL per token: exactly
    # The estimators compute in fp32; a whitening or group sum over a longer row adds its
    # zeros in another order, a last-bit difference (1e-7), nothing more.
    torch.testing.assert_close(torch.tensor(a1), torch.tensor(a0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.tensor(r1), torch.tensor(r0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("estimator", ["k3_ratio", "exact"])
@pytest.mark.parametrize("fill", [float("nan"), 1e30])
def test_the_loss_its_gradient_and_the_counts_do_not_see_observations(estimator, fill):
    spec = UpdateSpec(policy=PolicyLoss("ppo", "token", 0.2, 0.0, "sum"),
                      kl=KLPlacement("loss", estimator), value_clip_range=0.3, vf_coef=0.5)
    results = []
    for mask, positions, t in both(fill):
        logprobs = t["logprobs"].clone().requires_grad_(True)
        values = t["values"].clone().requires_grad_(True)
        exact = (t["ref"].abs().clone().requires_grad_(True) if estimator == "exact" else None)
        advantages = torch.where(mask, t["returns"] - t["old_values"], 0.0)
        batch = LossBatch(torch.where(mask, t["old"], 0.0), torch.where(mask, t["ref"], 0.0),
                          torch.where(mask, t["old_values"], 0.0), advantages,
                          torch.where(mask, t["returns"], 0.0), mask, mask)
        counts = counts_of(batch, mask_truncated=False)
        loss, stats = update_loss(Forward(logprobs, values, exact, None), batch, spec, 0.7, counts,
                                  with_critic=True)
        loss.backward()
        grads = [logprobs.grad, values.grad] + ([exact.grad] if exact is not None else [])
        for grad in grads:  # exactly zero on the observations, finite everywhere
            assert bool((grad[~mask] == 0).all()) and bool(torch.isfinite(grad).all())
        results.append((loss.item(), {k: v for k, v in stats.items()}, counts,
                        [at_actions(g, positions) for g in grads]))
    (l0, s0, c0, g0), (l1, s1, c1, g1) = results
    assert c0 == c1 == Counts(sum(a + b for a, b in TURNS), 4, sum(a + b for a, b in TURNS))
    assert l1 == pytest.approx(l0, rel=1e-12)
    for key in s0:
        assert s1[key] == pytest.approx(s0[key], rel=1e-12, abs=1e-15), key
    for a, b in zip(g0, g1):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-12, atol=1e-15)
