"""The pieces of one PPO batch: score a rollout, shape rewards, and run the clipped update.

Notation: B rollout batch, R response width, V vocabulary. `train/ppo.py` calls these in order;
each one is a function of tensors and models, so tests can run any of them alone.

Memory knobs: a minibatch (one optimizer step) runs as micro-batches of `micro_batch_rows` rows,
forward and backward each, gradients summed; every loss term is divided by the minibatch's token
count, so the sum is the minibatch's gradient. With --mixed-precision bf16 the forwards run under
autocast; log-probs (`token_logprobs` upcasts), values, KL and the losses stay fp32.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tether.advantages import gae, grpo, reinforce_pp, rloo, whiten
from tether.errors import TetherError
from tether.losses import assert_finite, exact_kl_penalty, kl_penalty, ppo_policy_loss, value_loss
from tether.models.critic import policy_and_values
from tether.models.forward import autocast
from tether.models.trunk_head import exact_kl_at, score_responses
from tether.rl.roles import Roles, sum_stats
from tether.rl.rollout import Rollout
from tether.rl.scoring import Scored
from tether.run.distributed import Dist
from tether.run.slicing import chunks, micro_rows, rank_slice
from tether.train.ppo_config import PPOConfig

# minibatch_loss stats that are means over a batch's real tokens (the rest are loss values).
TOKEN_MEANS = ("policy/clip_frac", "policy/approx_kl", "policy/ratio_mean", "value/clip_frac")


def minibatch_loss(policy: nn.Module, critic: nn.Module | None, sub: Rollout, old: Scored,
                   advantages: torch.Tensor, returns: torch.Tensor, cfg: PPOConfig,
                   kl_loss_beta: float, denominators: tuple[int, int] | None = None,
                   reference: nn.Module | None = None, computed=None):
    """The loss on one minibatch: the clipped surrogate, plus vf_coef * the clipped value loss
    when there is a critic (Schulman et al. 2017, eq. 9, without the entropy bonus), plus beta *
    the KL penalty when the KL is a loss term (`tether.losses.kl_penalty`, k3 x ratio by default,
    whose gradient is that of KL(pi || ref); `exact` needs `reference`).

    Reductions: with the KL in the loss, the surrogate uses the KL term's units (per-sequence sums
    over sequences, or token means with --kl-per-token-mean), so beta means what it means in the
    reward; otherwise token means. `denominators` = (real tokens, rows) of the whole minibatch
    when `sub` is one of its micro-batches: every loss term is divided by the minibatch's count,
    so the micro-batches' losses add up to the minibatch's; the stats in `TOKEN_MEANS` are means
    over this micro-batch's tokens. `computed`: the (scores, values) of `policy_and_values` on
    `sub`, already run with gradients (train/onpolicy.py), instead of a forward here.

    Returns (loss, stats) with detached float stats.
    """
    mask = sub.response_mask
    per_token = cfg.policy_loss_per_token_mean
    n_tokens, n_rows = denominators if denominators is not None else (None, None)
    denominator = n_tokens if per_token else n_rows
    exact = cfg.kl_in == "loss" and cfg.resolved_estimator == "exact"
    scores, values = computed or policy_and_values(policy, critic, sub.input_ids,
                                                   sub.attention_mask, sub.context_length,
                                                   sub.temperature, chunked=cfg.chunked_lm_head,
                                                   hidden=exact)
    logprobs = scores.logprobs * mask
    pg_loss, pg_stats = ppo_policy_loss(logprobs, old.logprobs, advantages, mask, cfg.clip_range,
                                        per_token_mean=per_token, denominator=denominator)
    loss = pg_loss
    stats = {"policy/loss": pg_loss.item(), "policy/clip_frac": float(pg_stats["clip_frac"]),
             "policy/approx_kl": float(pg_stats["approx_kl"]),
             "policy/ratio_mean": float(pg_stats["ratio_mean"])}
    if critic is not None:
        v_loss, v_stats = value_loss(values * mask, old.values, returns, mask,
                                     cfg.value_clip_range, denominator=n_tokens)
        loss = loss + cfg.vf_coef * v_loss
        stats |= {"value/loss": v_loss.item(), "value/clip_frac": float(v_stats["clip_frac"])}
    if kl_loss_beta > 0:
        kl_denominator = n_tokens if cfg.kl_per_token_mean else n_rows
        if exact:
            with torch.no_grad():
                ref = score_responses(reference, sub.input_ids, sub.attention_mask,
                                      sub.context_length, sub.temperature,
                                      chunked=cfg.chunked_lm_head, hidden=True)
            per_position = exact_kl_at(policy, reference, scores.hidden, ref.hidden,
                                       sub.temperature)
            if per_position is None:
                raise TetherError("--kl-estimator exact needs the models' logits to be "
                                  "head(hidden); use k3_ratio for this model")
            kl_term, _ = exact_kl_penalty(per_position, mask, cfg.kl_per_token_mean,
                                          kl_denominator)
        else:
            kl_term, _ = kl_penalty(logprobs, old.logprobs, old.ref_logprobs, mask,
                                    cfg.resolved_estimator, cfg.kl_per_token_mean, kl_denominator)
        loss = loss + kl_loss_beta * kl_term
        stats["objective/kl_loss"] = kl_term.item()
    assert_finite("PPO loss", loss)
    return loss, stats


def accumulate_minibatch(roles: Roles, rollout: Rollout, old: Scored, advantages: torch.Tensor,
                         returns: torch.Tensor, index: torch.Tensor, cfg: PPOConfig,
                         kl_loss_beta: float, reference: nn.Module | None = None
                         ) -> dict[str, float]:
    """Forward and backward over this rank's share of the minibatch `index` (global rows; all of
    it with one process) in micro-batches of `micro_rows` rows, adding to the gradients; returns
    the stats the whole minibatch would give (loss shares summed over micro-batches and ranks,
    token means weighted by each micro-batch's tokens).

    Every loss is divided by the whole minibatch's counts and multiplied by `grad_scale` (the
    world size: DDP and FSDP2 average the ranks' gradients), so the reduced gradient is the
    one-process gradient; only the last micro-batch's backward reduces (`no_sync`). Each forward
    runs under bf16 autocast when `cfg.mixed_precision` asks; the backward outside it (as
    torch.autocast recommends).
    """
    d = roles.dist
    n_tokens = int(rollout.response_mask[index].sum())  # the minibatch's real tokens, all ranks
    device = rollout.input_ids.device
    mine = index[rank_slice(len(index), d)]
    parts = chunks(len(mine), micro_rows(cfg.micro_batch_size, cfg.minibatch_size, d))
    sums: dict[str, float] = {}
    for number, rows in enumerate(parts):
        micro = mine[rows]
        with roles.no_sync(skip=number < len(parts) - 1):
            with autocast(cfg.mixed_precision, device):
                loss, part = roles.call(minibatch_loss, rollout.select(micro), old.select(micro),
                                        advantages[micro], returns[micro], cfg, kl_loss_beta,
                                        (n_tokens, len(index)), reference)
            (loss * d.grad_scale if d.active else loss).backward()
        micro_tokens = int(rollout.response_mask[micro].sum())
        for key, value in part.items():  # losses are already shares; weight the token means
            sums[key] = sums.get(key, 0.0) + (value * micro_tokens if key in TOKEN_MEANS else value)
    sums = sum_stats(sums, d)
    return {key: value / n_tokens if key in TOKEN_MEANS else value for key, value in sums.items()}


@contextlib.contextmanager
def update_mode(cfg, *models: nn.Module):
    """Training mode for the update when gradient checkpointing is on, eval mode again after.

    transformers recomputes a layer's activations only while the module is in training mode, but
    PPO keeps its models in eval mode so that rollout and update forwards agree. Dropout is already
    zeroed everywhere (`disable_dropout`), so training mode computes exactly what eval mode does
    and the first epoch's ratio stays exactly 1.
    """
    trained = [m for m in models if m is not None] if cfg.gradient_checkpointing else ()
    for model in trained:
        model.train()
    try:
        yield
    finally:
        for model in trained:
            model.eval()


def ppo_update(policy: nn.Module, critic: nn.Module | None, optimizer: torch.optim.Optimizer,
               rollout: Rollout, old: Scored, advantages: torch.Tensor, returns: torch.Tensor,
               cfg: PPOConfig, kl_loss_beta: float, generator: torch.Generator,
               reference: nn.Module | None = None, roles: Roles | None = None
               ) -> dict[str, float]:
    """`cfg.ppo_epochs` passes over `cfg.num_minibatches` minibatches of the rollout.

    The first epoch walks the minibatches in rollout order (the chunks `score_rollout` used, so
    the ratio starts at exactly 1); later epochs shuffle. Trust-region guard: when a minibatch's
    approx KL(pi_old || pi) already exceeds `cfg.target_kl` (> 0), that step is not taken and the
    batch's remaining epochs are skipped, a cheap stand-in for TRPO's hard KL constraint
    (Schulman et al. 2015, eq. 12). The guard judges the whole minibatch, so it runs after the
    micro-batches' backward passes; a refused step's gradients are dropped.

    `rollout`, `old`, `advantages` and `returns` are the global batch; `roles` (the wrapped policy
    and critic, `ppo_dist.Roles`; default: these two in one process) says which rows are this
    rank's. The approx KL is global, so every rank stops at the same step.
    """
    roles = roles or Roles(policy, critic, Dist())
    batch = len(rollout)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")  # 0: off
    history: list[dict[str, float]] = []
    stopped = False
    with update_mode(cfg, policy, critic):
        for epoch in range(cfg.ppo_epochs):
            order = (torch.arange(batch) if epoch == 0
                     else torch.randperm(batch, generator=generator))
            for rows in chunks(batch, cfg.minibatch_size):
                index = order[rows].to(advantages.device)
                optimizer.zero_grad(set_to_none=True)
                stats = accumulate_minibatch(roles, rollout, old, advantages, returns, index,
                                             cfg, kl_loss_beta, reference)
                if cfg.target_kl > 0 and stats["policy/approx_kl"] > cfg.target_kl:
                    optimizer.zero_grad(set_to_none=True)
                    stopped = True
                    break
                grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor, reduced over ranks
                    grad_norm = grad_norm.full_tensor()
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


def estimate_advantages(cfg: PPOConfig, rewards: torch.Tensor, values: torch.Tensor,
                        mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, T] from the per-token rewards by the estimator `cfg.advantage`:
    GAE with the critic's values (whitened when `cfg.whitens`), or a critic-free estimator over
    the `cfg.samples_per_prompt` responses to each prompt (returns are then unused zeros)."""
    if cfg.advantage == "gae":
        advantages, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)
        return (whiten(advantages, mask) if cfg.whitens else advantages), returns
    k = cfg.samples_per_prompt
    critic_free = {
        "rloo": lambda: rloo(rewards, mask, k),  # Ahmadian et al. 2024
        "grpo": lambda: grpo(rewards, mask, k, cfg.scale_rewards),  # Shao et al. 2024; Liu et al. 2025
        "reinforce++": lambda: reinforce_pp(rewards, mask, cfg.gamma),  # Hu 2025
    }
    return critic_free[cfg.advantage](), torch.zeros_like(rewards)
