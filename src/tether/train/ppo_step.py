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
from dataclasses import dataclass

import torch
from torch import nn

from tether import kl as kl_lib
from tether.advantages import gae, grpo, reinforce_pp, rloo, whiten
from tether.critic import policy_and_values
from tether.distributed import Dist, rank_slice
from tether.errors import TetherError
from tether.losses import (
    assert_finite,
    exact_kl_penalty,
    kl_penalty,
    ppo_policy_loss,
    value_loss,
)
from tether.rollout import Rollout
from tether.train.common import autocast
from tether.train.ppo_config import PPOConfig
from tether.train.ppo_dist import Roles, micro_rows, sum_stats
from tether.trunk_head import exact_kl_at, score_responses

SCORED = ("logprobs", "ref_logprobs", "values", "entropy", "exact_kl")


@dataclass
class Scored:
    """What the rollout-time models say about the sampled tokens; all [B, R], zero on padding."""

    logprobs: torch.Tensor  # log pi_old(y_t), at the sampling temperature
    ref_logprobs: torch.Tensor  # log ref(y_t), same temperature
    values: torch.Tensor  # V_old(s_t) (zero without a critic)
    entropy: torch.Tensor  # H(pi_old(. | s_t))
    exact_kl: torch.Tensor  # KL(pi_old(. | s_t) || ref(. | s_t)) over the whole vocabulary (NaN: n/a)

    def select(self, index) -> Scored:
        return Scored(*(getattr(self, name)[index] for name in SCORED))


def sampling_temperature(rollout: Rollout, temperature: float | None = None) -> float:
    """The rollout's own sampling temperature; a different `temperature` is refused (log-probs
    at another temperature than the sampling one make the ratio and the KL wrong)."""
    if temperature is not None and temperature != rollout.temperature:
        raise ValueError(f"log-probs asked at temperature {temperature} for responses sampled at "
                         f"{rollout.temperature}")
    return rollout.temperature


# minibatch_loss stats that are means over a batch's real tokens (the rest are loss values).
TOKEN_MEANS = ("policy/clip_frac", "policy/approx_kl", "policy/ratio_mean", "value/clip_frac")


def chunks(n: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


@torch.no_grad()
def score_rollout(policy: nn.Module, reference: nn.Module, critic: nn.Module, rollout: Rollout,
                  temperature: float | None, chunk_size: int, chunked: bool = True) -> Scored:
    """Policy, reference and critic on the sampled tokens, in chunks of `chunk_size` rows.

    The chunks are the first epoch's micro-batches (`cfg.micro_batch_rows`), and the forward is
    `policy_and_values`, the one the update uses: same rows, same code, so the first epoch's ratio
    is exactly 1. `chunked`: log-probs and entropies through the LM head in chunks
    (tether.lm_head; no [B, R, V] logits).
    """
    temperature = sampling_temperature(rollout, temperature)
    parts = []
    context = rollout.context_length
    for rows in chunks(len(rollout), chunk_size):
        sub = rollout.select(rows)
        scores, values = policy_and_values(policy, critic, sub.input_ids, sub.attention_mask,
                                           context, temperature, chunked=chunked, entropy=True,
                                           hidden=True)
        ref = score_responses(reference, sub.input_ids, sub.attention_mask, context, temperature,
                              chunked=chunked, hidden=True)
        exact = exact_kl_at(policy, reference, scores.hidden, ref.hidden, temperature)
        mask = sub.response_mask.float()
        parts.append(Scored(logprobs=scores.logprobs * mask, ref_logprobs=ref.logprobs * mask,
                            values=values.float() * mask, entropy=scores.entropy * mask,
                            exact_kl=(exact.float() * mask if exact is not None
                                      else torch.full_like(mask, float("nan")))))
    return Scored(*(torch.cat([getattr(p, name) for p in parts]) for name in SCORED))


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
    parts = chunks(len(mine), micro_rows(cfg, d))
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


def kl_sums(old: Scored, mask: torch.Tensor) -> dict[str, float]:
    """The batch mean of per-sequence summed KL(pi_old || ref) by each estimator (k1, k2, k3)
    and exactly (over the whole vocabulary at each sampled prefix): their bias and spread side by
    side. `objective/kl_exact` is missing when the exact KL could not be computed."""
    real = mask.bool()
    out = {f"objective/kl_{name}": float(torch.where(real, kl_lib.estimate(
        old.logprobs, old.ref_logprobs, name), 0.0).sum(1).mean()) for name in ("k1", "k2", "k3")}
    exact = torch.where(real, old.exact_kl, 0.0).sum(1).mean()
    if torch.isfinite(exact):
        out["objective/kl_exact"] = float(exact)
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
