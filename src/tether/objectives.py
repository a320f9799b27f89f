"""Policy objectives: what a policy loss is per token, before `tether.losses.policy_loss` reduces
it. Each is one entry of `tether.choices.POLICY_LOSSES` (the objectives) or `IMPORTANCE_LEVELS`
(the ratios they read), and takes one bundle of named inputs (`LossInputs`), so an objective that
needs another input is its function and its entry, nothing else.

Notation: B batch, T response positions; every tensor [B, T] unless said, `mask` true on the
tokens that carry the loss. An objective returns (the per-token loss, where its clip or cap
acted), both [B, T].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossInputs:
    """What a policy objective reads, by name: all [B, T] but the clips and the group. An
    objective takes the bundle and reads what it needs, so one that needs another input (the
    reference's log-probs, the engine's, its group) is its function and one entry
    of `tether.choices.POLICY_LOSSES`, nothing else (`tether.rl.update.update_loss` passes every
    input it has)."""

    ratio: torch.Tensor  # the importance ratio (--importance-level), from the clamped log-ratio
    logprobs: torch.Tensor  # log pi(y_t) under the policy being updated, differentiable
    old_logprobs: torch.Tensor  # log pi_old(y_t), at rollout time
    advantages: torch.Tensor
    mask: torch.Tensor  # bool: the tokens that carry the loss
    clip: float  # eps, the ratio's lower clip
    clip_high: float  # eps_high (eps when not given)
    ref_logprobs: torch.Tensor | None = None  # log ref(y_t)
    engine_logprobs: torch.Tensor | None = None  # the sampling engine's log-probs (behaviour)
    group_size: int = 1  # k: the samples of one prompt, in consecutive rows


def clipped_surrogate(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO (Schulman et al. 2017, eq. 7), negated: max(-A r, -A clip(r, 1 - eps, 1 + eps_high)).
    Clipped where the clipped branch is the larger loss; the ratio carries the gradient."""
    pg_loss1 = -x.advantages * x.ratio
    pg_loss2 = -x.advantages * torch.clamp(x.ratio, 1.0 - x.clip, 1.0 + x.clip_high)
    return torch.maximum(pg_loss1, pg_loss2), pg_loss2 > pg_loss1


def cispo(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, 2025, eq. 4-5): -sg(min(r, 1 + eps_high)) A log pi, REINFORCE on log pi
    with a capped, detached importance weight, so no token's gradient is dropped, only bounded.
    Capped where r > 1 + eps_high; the lower clip is unused."""
    weight = x.ratio.clamp(max=1.0 + x.clip_high).detach()
    return -weight * x.advantages * x.logprobs, x.ratio > 1.0 + x.clip_high


def token_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each token's own log-ratio [B, T] (PPO)."""
    return log_ratio


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each response's mean log-ratio over its true tokens [B, 1], shared by its tokens (GSPO,
    Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 7: s_i = exp(mean_t log r_t), a
    length-normalised sequence ratio, differentiable through the mean, so a response is clipped or
    kept whole; its clip range is ~1e-3, not 0.2)."""
    m = mask.to(log_ratio.dtype)
    return ((log_ratio * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0))[:, None]
