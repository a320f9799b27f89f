"""Steps 2-4 of the online loop on one global rollout batch: score the sampled tokens, shape the
rewards, estimate the advantages, and update the policy (and critic) on the clipped losses.

Notation: B rollout batch, R response width; every mask is the rollout's `action_mask` (the
tokens the policy sampled), or the part of it that carries the policy's loss.

    old = log pi_old, log ref, V_old, entropy on the batch's tokens     tether.rl.scoring
    r_t = -beta_r kl_t (+ the score at the last sampled token)          advantages.kl_shaped_rewards
    A, G = the estimator on (r, V_old)                                  advantages.ESTIMATORS
    epochs x minibatches (one optimizer step each) x micro-batches:     ppo_update
        forward: the models on the micro-batch, inside the wrapper      scoring.update_forward
        loss = surrogate + vf_coef value loss + beta_l KL term          update_loss (tensors in)
        backward; clip the gradient norm; AdamW step                    tether.run.optim

The KL penalty acts in the reward (beta_r = beta, beta_l = 0) or as a loss term (beta_r = 0,
beta_l = beta), never both: `tether.kl.KLPlacement`, chosen once per run from the config.

One forward, two uses. When a batch gets exactly one optimizer step over all its rows in one
forward (one epoch, one minibatch, no micro-batches, one process: rloo's and grpo's defaults),
pi_old is the policy the update differentiates, on the same rows, so the update's own forward
scores it and the ratio is 1 by construction: one policy forward per batch instead of two (TRL's
GRPOTrainer skips the old-policy pass the same way when num_iterations = 1). `one_pass` decides
it; the forward is kept (`tether.rl.scoring.score_old`) and the update's first micro-batch takes
it instead of running the models again. The shaping, the advantages, the loss and the step are
the same code either way, because the loss reads tensors, not models.

Memory knobs: a minibatch runs as micro-batches of `micro_rows` rows (or of at most
`micro_batch_tokens` tokens), forward and backward each, gradients summed; every loss term is
divided by the minibatch's token (or row) count, never a micro-batch's, so the sum is the
minibatch's gradient however it is cut (the bug of prime-rl PR #583 and open-instruct PR #1137).
`pack` runs each forward on the micro-batch's real tokens in packed rows (tether.data.packing).
With --mixed-precision bf16 the forwards run under autocast; log-probs (`token_logprobs`
upcasts), values, KL and the losses stay fp32.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import nn

from tether.advantages import AdvantageSpec, estimate_advantages, kl_shaped_rewards
from tether.kl import KLPlacement
from tether.losses import PolicyLoss, exact_kl_penalty, kl_penalty, policy_loss, value_loss
from tether.models.forward import autocast
from tether.rl.engines.mismatch import Correction, engine_mismatch
from tether.rl.roles import Roles, sum_stats
from tether.rl.rollout import Rollout
from tether.rl.scoring import (
    Forward,
    Forwards,
    Scored,
    micro_batches_of,
    score_old,
    update_mode,
)
from tether.run.distributed import Dist, no_sync
from tether.run.optim import backward, clip_and_step
from tether.run.slicing import chunks, micro_rows


@dataclass(frozen=True)
class UpdateSpec:
    """Everything steps 2-4 read besides tensors and models, taken once from the run's config
    (`tether.train.ppo_setup.update_spec`): each field, and each field of its sections, is named
    as the config names it, so the config's values reach it by name (`tether.run.config.section`)
    with no hand-copied hop."""

    ppo_epochs: int = 1  # passes over each rollout batch
    num_minibatches: int = 1  # optimizer steps per epoch
    minibatch_size: int = 1  # global rows per optimizer step (of a batch of the configured size)
    micro_batch_size: int = 0  # rows per forward on a rank (0: its share of a minibatch)
    micro_rows: int = 1  # derived: rows per forward and backward on this rank
    micro_batch_tokens: int = 0  # tokens per forward and backward (0: micro_rows rows)
    pack: bool = False  # forwards on packed rows: real tokens only, positions restarting
    value_clip_range: float = 0.2
    vf_coef: float = 0.1
    max_grad_norm: float = 1.0  # 0: no clipping
    target_kl: float = 0.0  # stop a batch's epochs past this approx KL (0: off)
    mask_truncated: bool = False  # responses that never ended carry no policy loss (DAPO)
    mixed_precision: str = "no"  # "bf16": forwards under autocast
    chunked_lm_head: bool = True
    gradient_checkpointing: bool = False
    policy: PolicyLoss = PolicyLoss()  # the surrogate: objective, ratio, clips, reduction
    kl: KLPlacement = KLPlacement()  # where the KL penalty acts
    advantage: AdvantageSpec = AdvantageSpec()  # the estimator
    correction: Correction = Correction()  # engine-mismatch corrections (off: the default)
    max_staleness: int = 0  # > 0: rows sampled ahead, the decoupled loss (its KL term weighted)

    def for_batch(self, rows: int, d: Dist) -> UpdateSpec:
        """The sizes for a batch of `rows` rows: as configured, unless a chat template split
        episodes into segments and the batch holds more rows; it then keeps --num-minibatches,
        each minibatch a little longer (under torchrun the ranks' shares of it may differ by a
        row: `micro_batches_of` gives each as many micro-batches)."""
        if rows == self.minibatch_size * self.num_minibatches:
            return self
        minibatch = -(-rows // self.num_minibatches)
        return replace(self, minibatch_size=minibatch,
                       micro_rows=micro_rows(self.micro_batch_size, minibatch, d))


# ----------------------------------------------------------------------------- the loss

class LossBatch(NamedTuple):
    """What the loss reads besides the forward, for some rows of the batch; all [b, R]."""

    old_logprobs: torch.Tensor  # log pi_old(y_t)
    ref_logprobs: torch.Tensor  # log ref(y_t)
    old_values: torch.Tensor  # V_old(s_t)
    advantages: torch.Tensor
    returns: torch.Tensor  # the critic's targets
    action_mask: torch.Tensor  # bool: the tokens the policy sampled (the value loss's)
    loss_mask: torch.Tensor  # bool: the sampled tokens that carry the policy's loss
    # decoupled PPO's min(pi_old / mu, C) on rows sampled by an older policy mu (--max-staleness)
    weights: torch.Tensor | None = None
    engine_logprobs: torch.Tensor | None = None  # the sampling engine's log-probs, when its own

    def select(self, index: torch.Tensor) -> LossBatch:
        return LossBatch(*(t[index] if t is not None else None for t in self))


class Counts(NamedTuple):
    """A minibatch's denominators (all ranks' rows): the tokens and the rows that carry the
    policy's loss, and the sampled tokens the value loss averages over."""

    tokens: int
    rows: int
    value_tokens: int


def loss_mask(rollout: Rollout, mask_truncated: bool) -> torch.Tensor:
    """[B, R] the tokens that carry the policy's loss (the surrogate and the KL term): every
    sampled token, or with `mask_truncated` only those of responses that ended (EOS or a stop
    string). A response cut at --max-new-tokens was not finished, so its score does not judge
    it: DAPO's overlong filtering (Yu et al. 2025, sec. 3.4) drops it from the loss, and from
    every denominator, as if it had not been sampled. The critic still learns from it."""
    mask = rollout.action_mask
    return mask & rollout.ended[:, None] if mask_truncated else mask


def counts_of(batch: LossBatch, mask_truncated: bool) -> Counts:
    """The `Counts` of the rows of `batch`."""
    carrying, sampled = batch.loss_mask, batch.action_mask
    rows = int(carrying.any(dim=1).sum()) if mask_truncated else sampled.shape[0]
    return Counts(int(carrying.sum()), rows, int(sampled.sum()))


def update_loss(forward: Forward, batch: LossBatch, spec: UpdateSpec, kl_beta: float,
                counts: Counts, with_critic: bool) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch, from tensors: the policy loss (`spec.policy`: the clipped
    surrogate, CISPO, GSPO's ratio), plus vf_coef * the clipped value loss when there is a
    critic (Schulman et al. 2017, eq. 9, without the entropy bonus), plus beta * the KL penalty
    when the KL is a loss term (`tether.losses.kl_penalty`, k3 x ratio by default, whose gradient
    is that of KL(pi || ref); or the exact KL the forward computed).

    Reductions: the policy loss and the KL term reduce by `spec.policy.loss_aggregation` over
    `batch.loss_mask`, the value loss is a token mean over `batch.action_mask`. Every term is
    divided by the whole minibatch's `counts`, so the micro-batches' losses add up to the
    minibatch's; the stats in `POLICY_MEANS` and `VALUE_MEANS` are means over this micro-batch's tokens.

    Returns (loss, stats) with detached float stats.
    """
    mask, carrying = batch.action_mask, batch.loss_mask
    # "token" divides by the tokens that carry loss, "sequence" and "sum" by their rows.
    aggregation = spec.policy.loss_aggregation
    policy_denominator = counts.tokens if aggregation == "token" else counts.rows
    logprobs = torch.where(mask, forward.logprobs, 0.0)  # selected: 0 x NaN would be NaN
    # every input an objective may read, by name (tether.losses.LossInputs)
    pg_loss, pg_stats = policy_loss(logprobs, batch.old_logprobs, batch.advantages, carrying,
                                    spec.policy, denominator=policy_denominator,
                                    ref_logprobs=batch.ref_logprobs,
                                    engine_logprobs=batch.engine_logprobs,
                                    group_size=spec.advantage.samples_per_prompt)
    loss = pg_loss
    stats = {"policy/loss": pg_loss.item(), "policy/clip_frac": float(pg_stats["clip_frac"]),
             "policy/approx_kl": float(pg_stats["approx_kl"]),
             "policy/ratio_mean": float(pg_stats["ratio_mean"])}
    if with_critic:
        v_loss, v_stats = value_loss(torch.where(mask, forward.values, 0.0), batch.old_values,
                                     batch.returns, mask, spec.value_clip_range,
                                     denominator=counts.value_tokens)
        loss = loss + spec.vf_coef * v_loss
        stats |= {"value/loss": v_loss.item(), "value/clip_frac": float(v_stats["clip_frac"])}
    if kl_beta > 0:
        if forward.exact_kl is not None:
            kl_term, _ = exact_kl_penalty(forward.exact_kl, carrying, aggregation,
                                          denominator=policy_denominator)
        else:  # tokens sampled ahead by a stale copy weigh as the surrogate's do (decoupled)
            kl_term, _ = kl_penalty(logprobs, batch.old_logprobs, batch.ref_logprobs, carrying,
                                    spec.kl.kl_estimator, aggregation,
                                    denominator=policy_denominator,
                                    weights=batch.weights if spec.max_staleness else None)
        loss = loss + kl_beta * kl_term
        stats["objective/kl_loss"] = kl_term.item()
    return loss, stats


# update_loss stats that are means over tokens (the rest are loss values): the policy's over
# the tokens that carry its loss, the critic's over every sampled token.
POLICY_MEANS = ("policy/clip_frac", "policy/approx_kl", "policy/ratio_mean")
VALUE_MEANS = ("value/clip_frac",)


# ----------------------------------------------------------------------------- the forwards

def one_pass(spec: UpdateSpec, rows: int, d: Dist) -> bool:
    """Whether the batch of `rows` rows gets one optimizer step over all its rows in one forward
    on one process, so that the update's forward also scores pi_old. Under torchrun each rank
    scores its rows and all are gathered before the shaping, so the two passes stay."""
    return (spec.ppo_epochs == 1 and spec.minibatch_size == rows and spec.micro_rows == rows
            and not spec.micro_batch_tokens and not d.active)


# ----------------------------------------------------------------------------- steps 2-4

@dataclass
class BatchUpdate:
    """What one batch's steps 2-4 produced: all [B, R] but the stats."""

    old: Scored  # pi_old, ref, V_old, entropy and exact KL on the sampled tokens
    kl: torch.Tensor  # the per-token KL the reward was shaped with (k1 with the KL in the loss)
    advantages: torch.Tensor
    returns: torch.Tensor  # the critic's targets (zeros without a critic)
    stats: dict[str, float]  # the update's: losses, clip fractions, grad norm, engine mismatch
    update_s: float  # seconds from the first forward with gradients to the last step
    loss_rows: int = 0  # rows with a token that carries the policy's loss (0: it learned nothing)
    zero_advantages: bool = False  # every advantage on those tokens is exactly 0 (no reward signal)
    # [B, R] decoupled PPO's weights, with which the controller reads the KL (None: sampled by
    # pi_old, or a vLLM correction the controller does not read)
    kl_weights: torch.Tensor | None = None


def update_batch(roles: Roles, reference: nn.Module, optimizer: torch.optim.Optimizer,
                 rollout: Rollout, scores: torch.Tensor, beta: float, spec: UpdateSpec,
                 generator: torch.Generator, placed: torch.Tensor | None = None,
                 version: int = 0) -> BatchUpdate:
    """Steps 2-4 on the global rollout batch (every rank holds all of it).

    Args:
        rollout: B rows. scores: [B] sequence scores (penalised, normalised, clipped).
        beta: the controller's coefficient for this batch. generator: later epochs' shuffles.
        placed: [B, R] rewards already on their tokens (--reward-per-turn), or None.
        version: the optimizer steps taken before this update: what `rollout.versions` (rows
            sampled ahead, --max-staleness) are measured against.
    """
    spec = spec.for_batch(len(rollout), roles.dist)
    mask = rollout.action_mask
    reward_beta, loss_beta = spec.kl.betas(beta)
    forwards = Forwards(roles, reference, rollout, spec, loss_beta)
    # 2. pi_old, the reference and V_old on the sampled tokens (one pass or two).
    old, started = score_old(roles, reference, rollout, spec, forwards,
                             one_pass(spec, len(rollout), roles.dist))
    # 3. Per-token rewards: -beta * kl_t, the score on the last sampled token; the advantages.
    rewards, kl = kl_shaped_rewards(scores, old.logprobs, old.ref_logprobs, mask, reward_beta,
                                    spec.kl.reward_estimator, placed)
    advantages, returns = estimate_advantages(spec.advantage, rewards, old.values, mask,
                                              rollout.episode)
    carrying = loss_mask(rollout, spec.mask_truncated)
    unsignalled = not bool(torch.any((advantages != 0) & carrying))  # before engine weights
    engine_stats, weights = {}, None
    if rollout.engine_logprobs is not None:
        # The engine sampled from pi_engine, the loss's ratio is against the trainer's pi_old:
        # the gap, and (when asked) weights min(pi_old / pi_engine, C) on the policy gradient or
        # far-off rows dropped (w >= 0, so weighting A is weighting the clipped surrogate).
        # Sampled ahead (--max-staleness), pi_engine is the stale behaviour policy: decoupled
        # PPO, the weight always on, the staleness measured apart from the kernels' mismatch.
        weights, engine_stats = engine_mismatch(old.logprobs, rollout.engine_logprobs, mask,
                                                spec.correction, rollout.versions, version,
                                                spec.max_staleness)
        advantages = advantages * weights if weights is not None else advantages
    # 4. PPO epochs over minibatches (each rank: its share of every minibatch).
    batch = LossBatch(old.logprobs, old.ref_logprobs, old.values, advantages, returns, mask,
                      carrying, weights, rollout.engine_logprobs)
    started = started or time.perf_counter()
    stats = ppo_update(roles, optimizer, forwards, batch, spec, loss_beta, generator)
    return BatchUpdate(old, kl, advantages, returns, stats | engine_stats,
                       time.perf_counter() - started, int(carrying.any(dim=1).sum()), unsignalled,
                       weights if spec.max_staleness else None)


def ppo_update(roles: Roles, optimizer: torch.optim.Optimizer, forwards: Forwards,
               batch: LossBatch, spec: UpdateSpec, kl_beta: float,
               generator: torch.Generator) -> dict[str, float]:
    """`spec.ppo_epochs` passes over minibatches of `spec.minibatch_size` rows of the batch.

    The first epoch walks the minibatches in rollout order (the chunks `score_batch` used, so the
    ratio starts at exactly 1); later epochs shuffle. Trust-region guard: when a minibatch's
    approx KL(pi_old || pi) already exceeds `spec.target_kl` (> 0), that step is not taken and the
    batch's remaining epochs are skipped, a cheap stand-in for TRPO's hard KL constraint
    (Schulman et al. 2015, eq. 12). The guard judges the whole minibatch, so it runs after the
    micro-batches' backward passes; a refused step's gradients are dropped. On-policy (the first
    minibatch of the first epoch) approx KL is exactly 0, so the guard never refuses it.

    `batch` is the global batch; `roles` says which rows are this rank's. The approx KL is
    global, so every rank stops at the same step.
    """
    rows_in_batch = len(batch.advantages)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    history: list[dict[str, float]] = []
    stopped, skipped = False, 0
    with update_mode(spec.gradient_checkpointing, roles.policy, roles.critic):
        for epoch in range(spec.ppo_epochs):
            order = (torch.arange(rows_in_batch) if epoch == 0
                     else torch.randperm(rows_in_batch, generator=generator))
            for rows in chunks(rows_in_batch, spec.minibatch_size):
                index = order[rows].to(batch.advantages.device)
                counts = counts_of(batch.select(index), spec.mask_truncated)
                if spec.mask_truncated and roles.critic is None and counts.tokens == 0:
                    # Every response of it was truncated (--mask-truncated): no loss, and an
                    # AdamW step on a zero gradient would still move the weights (momentum).
                    skipped += 1
                    continue
                optimizer.zero_grad(set_to_none=True)
                stats = accumulate_minibatch(roles, forwards, batch, index, counts, spec, kl_beta)
                if spec.target_kl > 0 and stats["policy/approx_kl"] > spec.target_kl:
                    optimizer.zero_grad(set_to_none=True)
                    stopped = True
                    break
                stats["policy/grad_norm"] = clip_and_step(params, optimizer, spec.max_grad_norm)
                history.append(stats)
            if stopped:
                break
    out = {key: sum(s[key] for s in history) / len(history) for key in history[0]} if history else {}
    out["policy/updates"] = float(len(history))
    out["policy/early_stopped"] = float(stopped)
    if spec.mask_truncated:
        out["policy/skipped_minibatches"] = float(skipped)
    return out


def accumulate_minibatch(roles: Roles, forwards: Forwards, batch: LossBatch, index: torch.Tensor,
                         counts: Counts, spec: UpdateSpec, kl_beta: float) -> dict[str, float]:
    """Forward and backward over this rank's share of the minibatch `index` (global rows; all of
    it with one process) in micro-batches of `spec.micro_rows` rows, or of at most
    `spec.micro_batch_tokens` tokens (`micro_batches_of`), adding to the gradients;
    returns the stats the whole minibatch would give (loss shares summed over micro-batches and
    ranks, token means weighted by each micro-batch's tokens).

    Every loss is divided by the whole minibatch's `counts` and multiplied by `grad_scale` (the
    world size: DDP and FSDP2 average the ranks' gradients), so the reduced gradient is the
    one-process gradient, however the minibatch is cut. Only the last micro-batch's backward
    reduces (`no_sync`). Each forward runs under bf16 autocast when `spec.mixed_precision` asks; the backward outside it (as
    torch.autocast recommends). A NaN or inf loss on any rank stops every rank before its
    backward (`tether.run.optim.backward`).
    """
    d = roles.dist
    sums: dict[str, float] = {}
    parts = micro_batches_of(forwards.rollout, index, spec, d)
    for number, (micro, real) in enumerate(parts):
        part = batch.select(micro)
        with no_sync(roles.wrapped, skip=number < len(parts) - 1):
            with autocast(spec.mixed_precision, micro.device):
                loss, stats = update_loss(forwards(micro), part, spec, kl_beta, counts,
                                          roles.critic is not None)
            loss = loss if real else loss * 0.0  # a borrowed row: the call, not the gradient
            backward(loss * d.grad_scale if d.active else loss, d)
        if not real:  # its stats count 0, but every rank sums the same keys (`sum_stats`)
            sums |= {key: sums.get(key, 0.0) for key in stats}
            continue
        weights = {key: int(part.loss_mask.sum()) for key in POLICY_MEANS}
        weights |= {key: int(part.action_mask.sum()) for key in VALUE_MEANS}
        for key, value in stats.items():  # losses are already shares; weight the token means
            sums[key] = sums.get(key, 0.0) + value * weights.get(key, 1)
    sums = sum_stats(sums, d)
    totals = {key: counts.tokens for key in POLICY_MEANS} | {key: counts.value_tokens
                                                              for key in VALUE_MEANS}
    return {key: value / max(totals.get(key, 1), 1) for key, value in sums.items()}
