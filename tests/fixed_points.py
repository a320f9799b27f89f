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
    0 and this raises (with eps > 0 too, where the "point" would be a near-deterministic policy at
    temperature beta * eps).
    """
    _check(ref_probs, rewards, beta)
    ref_probs, rewards = ref_probs.double(), rewards.double()

    def policy(sigma: float) -> torch.Tensor:
        return torch.softmax(ref_probs.log() + rewards / (beta * (sigma + eps)), dim=-1)

    def spread(probs: torch.Tensor) -> float:
        mean = float((probs * rewards).sum())
        return float((probs * (rewards - mean).square()).sum()) ** 0.5

    sigma = start = spread(ref_probs)
    for _ in range(max_iter):
        new_sigma = 0.5 * (sigma + spread(policy(sigma)))
        if new_sigma < 1e-6 * start:
            raise ValueError("std-scaled fixed point collapses to a deterministic policy "
                             f"(sigma -> 0) at beta={beta}; a larger beta has a point")
        if abs(new_sigma - sigma) <= tol * max(sigma, 1.0):
            return policy(new_sigma)
        sigma = new_sigma
    raise ValueError(f"fixed-point iteration for sigma did not converge in {max_iter} steps")


GROUP_ADVANTAGES = ("rloo", "grpo_none", "grpo_group")


def group_expected_update(theta: torch.Tensor, ref_probs: torch.Tensor, rewards: torch.Tensor,
                          beta: float, k: int, advantage: str, eps: float = 1e-4) -> torch.Tensor:
    """The exact expected on-policy update direction in softmax logits, [V], for k samples per
    prompt with outcome advantages and the KL(pi || ref) gradient as a loss term:

        E_{y_1..k ~ pi}[ 1/k sum_i A_i grad log pi(y_i) ] - beta grad KL(pi || ref)

    summed over all V^k groups (no sampling). A_i: "rloo" R_i - mean of the others; "grpo_none"
    R_i - group mean; "grpo_group" (R_i - group mean) / (sample std + eps).
    """
    if advantage not in GROUP_ADVANTAGES:
        raise ValueError(f"advantage must be one of {GROUP_ADVANTAGES}, got {advantage!r}")
    vocab = ref_probs.numel()
    if vocab**k > 1_000_000:
        raise ValueError(f"{vocab}^{k} groups are too many to enumerate; use a smaller k or V")
    pi = torch.softmax(theta, dim=-1)
    groups = torch.cartesian_prod(*[torch.arange(vocab)] * k).view(-1, k)  # [V^k, k]
    probability = pi[groups].prod(dim=-1)  # [V^k]
    group_rewards = rewards[groups]  # [V^k, k]
    centred = group_rewards - group_rewards.mean(dim=-1, keepdim=True)
    if advantage == "rloo":
        advantages = centred * k / (k - 1)
    elif advantage == "grpo_none":
        advantages = centred
    else:
        advantages = centred / (group_rewards.std(dim=-1, keepdim=True) + eps)
    score = torch.nn.functional.one_hot(groups, vocab).to(pi.dtype) - pi  # grad log pi(y_i)
    policy_gradient = (probability[:, None] * (advantages[..., None] * score).mean(1)).sum(0)
    log_ratio = pi.log() - ref_probs.log()
    kl_gradient = pi * (log_ratio - (pi * log_ratio).sum())
    return policy_gradient - beta * kl_gradient


def fixed_point_group(ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float, k: int,
                      advantage: str = "grpo_group", eps: float = 1e-4,
                      max_iter: int = 20_000) -> torch.Tensor:
    """Where the exact expected update of `group_expected_update` vanishes; [V] probabilities.

    Natural-gradient iteration in the logits from the reference, theta += 0.5 * update / pi (the
    expected update divided by the softmax's diagonal Fisher), until the update is below 1e-13.
    (Newton's method from the reference can run to a vertex of the simplex, where the update also
    vanishes, on bandits with one dominant outcome.) Closed forms it must agree with: rloo ->
    fixed_point_reverse_kl(beta); grpo_none -> fixed_point_reverse_kl(beta k / (k - 1)), since
    its group mean includes the sample and shrinks the reward by (k - 1) / k. grpo_group has
    none; it tends to `fixed_point_grpo_std` as k grows.
    """
    _check(ref_probs, rewards, beta)
    if k < 2:
        raise ValueError(f"k must be >= 2, got {k}")
    ref_probs, rewards = ref_probs.double(), rewards.double()
    theta = ref_probs.log().clone()
    for _ in range(max_iter):
        pi = torch.softmax(theta, dim=-1)
        update = group_expected_update(theta, ref_probs, rewards, beta, k, advantage, eps)
        if float(update.abs().max()) < 1e-13:
            return pi
        theta = theta + 0.5 * update / pi
    raise ValueError("the natural-gradient iteration did not find where the expected update "
                     "vanishes")
