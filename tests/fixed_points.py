"""Where the online loop should land on a one-token bandit, for each KL placement (a test helper).

The bandit: a prompt with outcomes y, reference probabilities ref(y) > 0 and rewards r(y); the
policy is a categorical pi over the outcomes. The maximisers below are the points the loop tests
compare against (docs/ppo.md, "Critic-free advantages and the KL placements"):

- KL(pi || ref) penalised (k1 in the reward; k2, k3_ratio or exact in the loss):
      pi*(y) = ref(y) exp(r(y) / beta) / Z.
- KL(ref || pi) penalised (plain k3 in the loss): stationarity of E_pi[r] - beta KL(ref || pi)
      on the simplex gives pi(y) = beta ref(y) / (lambda - r(y)), lambda > max r fixing sum = 1.
- The reward divided by its spread sigma_pi (GRPO's std scaling, or whitening) with the KL in
      the loss: pi = ref exp(r / (beta (sigma_pi + eps))) / Z, where sigma_pi is the std of r
      under that same pi (the many-samples limit of the group std).

Both KL-penalised objectives are concave in pi (a linear term minus a convex one), so the
stationary point on the simplex is the unique maximiser.
"""

from __future__ import annotations

import torch


def _check(ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float) -> None:
    if ref_probs.shape != rewards.shape or ref_probs.dim() != 1:
        raise ValueError("ref_probs and rewards must be 1-D tensors of one length")
    if not bool((ref_probs > 0).all()) or abs(float(ref_probs.sum()) - 1.0) > 1e-9:
        raise ValueError("ref_probs must be positive and sum to 1")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")


def fixed_point_reverse_kl(ref_probs: torch.Tensor, rewards: torch.Tensor,
                           beta: float) -> torch.Tensor:
    """argmax_pi E_pi[r] - beta KL(pi || ref) = ref exp(r / beta) / Z; [V] probabilities."""
    _check(ref_probs, rewards, beta)
    return torch.softmax(ref_probs.log() + rewards / beta, dim=-1)


def fixed_point_forward_kl(ref_probs: torch.Tensor, rewards: torch.Tensor,
                           beta: float) -> torch.Tensor:
    """argmax_pi E_pi[r] - beta KL(ref || pi); [V] probabilities.

    With softmax logits theta, d/dtheta [E_pi r - beta KL(ref || pi)] = pi (r - E_pi r) -
    beta (pi - ref) = 0 gives pi(y) = beta ref(y) / (lambda - r(y)) with lambda = E_pi r + beta.
    f(lambda) = sum_y beta ref(y) / (lambda - r(y)) falls from +inf at lambda = max r to at most
    1 at lambda = max r + beta (each term is <= ref(y) there), so bisection on that interval finds
    the lambda with f = 1.
    """
    _check(ref_probs, rewards, beta)
    ref_probs, rewards = ref_probs.double(), rewards.double()
    low, high = float(rewards.max()), float(rewards.max()) + beta
    for _ in range(200):  # 200 halvings reach the float64 resolution of any interval
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        if float((beta * ref_probs / (middle - rewards)).sum()) > 1.0:
            low = middle
        else:
            high = middle
    return beta * ref_probs / (high - rewards)


def fixed_point_grpo_std(ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float,
                         eps: float = 0.0, tol: float = 1e-13,
                         max_iter: int = 100_000) -> torch.Tensor:
    """The self-consistent point of std-scaled rewards with the KL in the loss; [V] probabilities.

    pi = ref exp(r / (beta (sigma + eps))) / Z with sigma = sqrt(Var_{y~pi} r(y)) (population std
    under pi itself), found by iterating sigma <- std under the pi that sigma gives, from the
    reference's std (where the loop starts). The iteration is damped (half steps), since the map
    can overshoot. A small beta can leave no point short of collapse: sigma then shrinks towards
    0 and this raises, unless eps > 0 keeps the temperature finite.
    """
    _check(ref_probs, rewards, beta)
    ref_probs, rewards = ref_probs.double(), rewards.double()

    def policy(sigma: float) -> torch.Tensor:
        return torch.softmax(ref_probs.log() + rewards / (beta * (sigma + eps)), dim=-1)

    def spread(probs: torch.Tensor) -> float:
        mean = float((probs * rewards).sum())
        return float((probs * (rewards - mean).square()).sum()) ** 0.5

    sigma = spread(ref_probs)
    for _ in range(max_iter):
        new_sigma = 0.5 * (sigma + spread(policy(sigma)))
        if new_sigma + eps < 1e-9:
            raise ValueError("std-scaled fixed point collapses to a deterministic policy "
                             f"(sigma -> 0) at beta={beta}; pass eps > 0 or a larger beta")
        if abs(new_sigma - sigma) <= tol * max(sigma, 1.0):
            return policy(new_sigma)
        sigma = new_sigma
    raise ValueError(f"fixed-point iteration for sigma did not converge in {max_iter} steps")
