"""Losses: PPO's clipped surrogate and value loss, Bradley-Terry, DPO and IPO.

Notation: B batch, T response positions; `mask` [B, T] is true on real response tokens. Token
means are masked means over the whole batch (every real token weighs the same). Each loss returns
the loss plus detached statistics and never logs.

Micro-batches: PPO's losses take an optional `n_tokens`, the real-token count of the whole
minibatch. Given it, the masked sum over this (micro-)batch is divided by `n_tokens` instead of by
its own count, so the losses of a minibatch's micro-batches add up to the minibatch's token mean
(and their gradients to its gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tether._checks import choice, masked_mean, non_negative, same_shape
from tether.kl import LOG_RATIO_CLAMP


def assert_finite(name: str, value: torch.Tensor) -> None:
    """Stop with a clear message rather than let a NaN or inf reach the optimiser."""
    if not bool(torch.isfinite(value).all()):
        raise FloatingPointError(
            f"{name} is not finite ({value.detach().flatten()[:4].tolist()}); the step was "
            "skipped. Lower the learning rate, check the rewards for NaN, or clip them")


def token_mean(x: torch.Tensor, mask: torch.Tensor, n_tokens: float | None = None) -> torch.Tensor:
    """sum(x * mask) / n_tokens; with `n_tokens` None, the masked mean (n_tokens = sum(mask)).

    Args:
        x: [B, T] values. mask: [B, T] bool or 0/1.
        n_tokens: >= 0, the count to divide by (clamped to at least 1, like the masked mean).
    """
    if n_tokens is None:
        return masked_mean(x, mask)
    non_negative("n_tokens", n_tokens)
    return (x * mask.to(x.dtype)).sum() / max(float(n_tokens), 1.0)


def ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip: float = 0.2,
                    n_tokens: float | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate objective (Schulman et al. 2017, "Proximal Policy Optimization
    Algorithms", eq. 7), negated to a loss.

    ratio_t = exp(log pi(y_t) - log pi_old(y_t))
    L = mean_t max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps, 1 + eps))

    Args:
        logprobs: [B, T] log-probs under the policy being updated (differentiable).
        old_logprobs: [B, T] log-probs at rollout time.
        advantages: [B, T] advantages (usually whitened).
        mask: [B, T] bool.
        clip: eps > 0.
        n_tokens: optional divisor of the masked sum (the minibatch's token count when this is
            one of its micro-batches); default: sum(mask), the token mean.

    Returns:
        (loss, stats): scalar loss; stats `clip_frac` (share of tokens where the clipped branch
        is taken), `approx_kl` (mean of k3 for KL(pi_old || pi), Schulman 2020), `ratio_mean`;
        the stats are always means over `mask`, whatever `n_tokens`.
    """
    same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    non_negative("clip", clip)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    loss = token_mean(torch.maximum(pg_loss1, pg_loss2), mask, n_tokens)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((pg_loss2 > pg_loss1).float(), mask),
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip: float = 0.2,
               n_tokens: float | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped value loss (the PPO baselines' variant, as in Ziegler et al. 2019's code release).

    V_clip = V_old + clip(V - V_old, -eps, eps)
    L = 0.5 * mean_t max((V - R)^2, (V_clip - R)^2)

    Args:
        values: [B, T] current value predictions (differentiable).
        old_values: [B, T] predictions at rollout time.
        returns: [B, T] GAE returns.
        mask: [B, T] bool.
        clip: eps >= 0, in the units of the value.
        n_tokens: optional divisor of the masked sum, as in `ppo_policy_loss`.

    Returns:
        (loss, stats): scalar loss; stats `clip_frac`, `value_mean` (means over `mask`).
    """
    same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    non_negative("clip", clip)
    values_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    vf_loss1 = (values - returns).square()
    vf_loss2 = (values_clipped - returns).square()
    loss = 0.5 * token_mean(torch.maximum(vf_loss1, vf_loss2), mask, n_tokens)
    with torch.no_grad():
        stats = {"clip_frac": masked_mean((vf_loss2 > vf_loss1).float(), mask),
                 "value_mean": masked_mean(values, mask)}
    return loss, stats


def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                       margin: torch.Tensor | None = None) -> torch.Tensor:
    """Pairwise reward-model loss under the Bradley-Terry model (Ouyang et al. 2022, eq. 1).

    P(chosen > rejected) = sigmoid(r_c - r_r - m);  L = -mean log sigmoid(r_c - r_r - m)

    The optional margin m (Touvron et al. 2023, Llama 2, eq. 2) asks for a larger gap on pairs
    whose preference is stronger.

    Args:
        chosen_rewards: [B] scores of the preferred responses.
        rejected_rewards: [B] scores of the others.
        margin: optional [B] non-negative margins.

    Returns:
        Scalar loss.
    """
    same_shape(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        same_shape(chosen_rewards=chosen_rewards, margin=margin)
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
             ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             chosen_lengths: torch.Tensor | None = None,
             rejected_lengths: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct preference losses, where the KL to the reference is implicit.

    h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r))

    sigmoid (DPO, Rafailov et al. 2023, eq. 7), with label smoothing eps (conservative DPO,
    Mitchell 2023): L = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
    ipo (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", eq. 17, tau = beta): L = (h - 1 / (2 beta))^2. If lengths are given, each
    log-ratio is first divided by its response length (a per-token average).

    Args:
        policy_chosen, policy_rejected, ref_chosen, ref_rejected: [B] per-sequence summed
            log-probs of the responses.
        beta: > 0; the KL strength (DPO) or tau (IPO).
        loss_type: "sigmoid" or "ipo".
        label_smoothing: in [0, 0.5), the assumed probability that a label is flipped (sigmoid).
        chosen_lengths, rejected_lengths: optional [B] response lengths (IPO only).

    Returns:
        (losses [B], chosen_rewards [B], rejected_rewards [B]); rewards are beta * (policy - ref),
        detached.
    """
    choice("loss_type", loss_type, ("sigmoid", "ipo"))
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing}")
    same_shape(policy_chosen=policy_chosen, policy_rejected=policy_rejected,
               ref_chosen=ref_chosen, ref_rejected=ref_rejected)
    chosen_logratio = policy_chosen - ref_chosen
    rejected_logratio = policy_rejected - ref_rejected
    if loss_type == "sigmoid":
        h = chosen_logratio - rejected_logratio
        losses = (-(1.0 - label_smoothing) * F.logsigmoid(beta * h)
                  - label_smoothing * F.logsigmoid(-beta * h))
    else:
        if (chosen_lengths is None) != (rejected_lengths is None):
            raise ValueError("pass both chosen_lengths and rejected_lengths, or neither")
        if chosen_lengths is not None:
            same_shape(policy_chosen=policy_chosen, chosen_lengths=chosen_lengths,
                       rejected_lengths=rejected_lengths)
            chosen_logratio = chosen_logratio / chosen_lengths.clamp(min=1)
            rejected_logratio = rejected_logratio / rejected_lengths.clamp(min=1)
        h = chosen_logratio - rejected_logratio
        losses = (h - 1.0 / (2.0 * beta)).square()
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards

