"""The pieces of one PPO batch: score a rollout, shape rewards, and run the clipped update.

Notation: B rollout batch, R response width, V vocabulary. `train/ppo.py` calls these in order;
each one is a function of tensors and models, so tests can run any of them alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tether import kl as kl_lib
from tether._checks import masked_mean
from tether.critic import policy_and_values
from tether.losses import assert_finite, ppo_policy_loss, value_loss
from tether.rollout import Rollout
from tether.trunk_head import score_responses


@dataclass
class Scored:
    """What the rollout-time models say about the sampled tokens; all [B, R], zero on padding."""

    logprobs: torch.Tensor  # log pi_old(y_t), at the sampling temperature
    ref_logprobs: torch.Tensor  # log ref(y_t), same temperature
    values: torch.Tensor  # V_old(s_t)
    entropy: torch.Tensor  # H(pi_old(. | s_t))

    def select(self, index) -> Scored:
        return Scored(*(t[index] for t in (self.logprobs, self.ref_logprobs, self.values,
                                           self.entropy)))


def chunks(n: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


@torch.no_grad()
def score_rollout(policy: nn.Module, reference: nn.Module, critic: nn.Module, rollout: Rollout,
                  temperature: float, chunk_size: int, chunked: bool = True) -> Scored:
    """Policy, reference and critic on the sampled tokens, in chunks of `chunk_size` rows.

    The chunks are the first epoch's minibatches, and the forward is `policy_and_values`, the one
    the update uses: same rows, same code, so the first epoch's ratio is exactly 1. `chunked`:
    log-probs and entropies through the LM head in chunks (tether.lm_head; no [B, R, V] logits).
    """
    parts = []
    context = rollout.context_length
    for rows in chunks(len(rollout), chunk_size):
        sub = rollout.select(rows)
        scores, values = policy_and_values(policy, critic, sub.input_ids, sub.attention_mask,
                                           context, temperature, chunked=chunked, entropy=True)
        ref = score_responses(reference, sub.input_ids, sub.attention_mask, context, temperature,
                              chunked=chunked)
        mask = sub.response_mask.float()
        parts.append(Scored(logprobs=scores.logprobs * mask, ref_logprobs=ref.logprobs * mask,
                            values=values.float() * mask, entropy=scores.entropy * mask))
    return Scored(*(torch.cat([getattr(p, name) for p in parts])
                    for name in ("logprobs", "ref_logprobs", "values", "entropy")))


def minibatch_loss(policy: nn.Module, critic: nn.Module, sub: Rollout, old: Scored,
                   advantages: torch.Tensor, returns: torch.Tensor, cfg, kl_loss_beta: float):
    """PPO loss on one minibatch: clipped surrogate + vf_coef * clipped value loss
    (Schulman et al. 2017, eq. 9, without the entropy bonus), plus beta * KL when the KL is a loss
    term (GRPO, Shao et al. 2024, eq. 3, with its k3 estimator by default).

    Returns (loss, stats) with detached float stats.
    """
    mask = sub.response_mask
    scores, values = policy_and_values(policy, critic, sub.input_ids, sub.attention_mask,
                                       sub.context_length, cfg.temperature,
                                       chunked=cfg.chunked_lm_head)
    logprobs = scores.logprobs * mask
    pg_loss, pg_stats = ppo_policy_loss(logprobs, old.logprobs, advantages, mask, cfg.clip_range)
    v_loss, v_stats = value_loss(values * mask, old.values, returns, mask, cfg.value_clip_range)
    loss = pg_loss + cfg.vf_coef * v_loss
    stats = {"policy/loss": pg_loss.item(), "policy/clip_frac": float(pg_stats["clip_frac"]),
             "policy/approx_kl": float(pg_stats["approx_kl"]),
             "policy/ratio_mean": float(pg_stats["ratio_mean"]),
             "value/loss": v_loss.item(), "value/clip_frac": float(v_stats["clip_frac"])}
    if kl_loss_beta > 0:
        kl_term = masked_mean(kl_lib.estimate(logprobs, old.ref_logprobs, cfg.resolved_estimator),
                              mask)
        loss = loss + kl_loss_beta * kl_term
        stats["objective/kl_loss"] = kl_term.item()
    assert_finite("PPO loss", loss)
    return loss, stats


def ppo_update(policy: nn.Module, critic: nn.Module, optimizer: torch.optim.Optimizer,
               rollout: Rollout, old: Scored, advantages: torch.Tensor, returns: torch.Tensor,
               cfg, kl_loss_beta: float, generator: torch.Generator) -> dict[str, float]:
    """`cfg.ppo_epochs` passes over `cfg.num_minibatches` minibatches of the rollout.

    The first epoch walks the minibatches in rollout order (the chunks `score_rollout` used, so
    the ratio starts at exactly 1); later epochs shuffle. Trust-region guard: when a minibatch's
    approx KL(pi_old || pi) already exceeds `cfg.target_kl` (> 0), that step is not taken and the
    batch's remaining epochs are skipped, a cheap stand-in for TRPO's hard KL constraint
    (Schulman et al. 2015, eq. 12).
    """
    batch = len(rollout)
    size = batch // cfg.num_minibatches
    params = [p for group in optimizer.param_groups for p in group["params"]]
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")  # 0: off
    history: list[dict[str, float]] = []
    stopped = False
    for epoch in range(cfg.ppo_epochs):
        order = (torch.arange(batch) if epoch == 0
                 else torch.randperm(batch, generator=generator))
        for rows in chunks(batch, size):
            index = order[rows].to(advantages.device)
            sub = rollout.select(index)
            loss, stats = minibatch_loss(policy, critic, sub, old.select(index),
                                         advantages[index], returns[index], cfg, kl_loss_beta)
            if cfg.target_kl > 0 and stats["policy/approx_kl"] > cfg.target_kl:
                stopped = True
                break
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            assert_finite("gradient norm", grad_norm)
            optimizer.step()
            stats["policy/grad_norm"] = float(grad_norm)
            history.append(stats)
        if stopped:
            break
    out = {key: sum(s[key] for s in history) / len(history) for key in history[0]}
    out["policy/updates"] = float(len(history))
    out["policy/early_stopped"] = float(stopped)
    return out


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over real tokens: 1 is a perfect critic, 0 one that
    predicts the mean, negative one that is worse than the mean."""
    mask = mask.bool()
    returns, values = returns[mask].float(), values[mask].float()
    var = returns.var(unbiased=False)
    if var <= 0:
        return float("nan")
    return float(1 - (returns - values).var(unbiased=False) / var)
