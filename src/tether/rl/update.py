"""Steps 2-4 of the online loop on one global rollout batch: score the sampled tokens, shape the
rewards, estimate the advantages, and update the policy (and critic) on the clipped losses.

Notation: B rollout batch, R response width.

    old = log pi_old, log ref, V_old, entropy on the batch's tokens     tether.rl.scoring
    r_t = -beta_r kl_t (+ the score at the last real token)             advantages.kl_shaped_rewards
    A, G = the estimator on (r, V_old)                                  estimate_advantages
    epochs x minibatches (one optimizer step each) x micro-batches:     ppo_update
        loss = surrogate + vf_coef value loss + beta_l KL term          minibatch_loss
        backward; clip the gradient norm; AdamW step                    tether.run.optim

The KL penalty acts in the reward (beta_r = beta, beta_l = 0) or as a loss term (beta_r = 0,
beta_l = beta), never both: `KLPlacement`, chosen once per run from the config.

One path. When a batch gets exactly one optimizer step over all its rows in one forward (one
epoch, one minibatch, no micro-batches, one process: rloo's and grpo's defaults), pi_old is the
policy the update differentiates, on the same rows, so the update's own forward scores it and the
ratio is 1 by construction: one policy forward per batch instead of two (TRL's GRPOTrainer skips
the old-policy pass the same way when num_iterations = 1). `one_pass` decides it, here and
nowhere else; the shaping, the advantages and the step are the same code either way.

Memory knobs: a minibatch runs as micro-batches of `micro_rows` rows, forward and backward each,
gradients summed; every loss term is divided by the minibatch's token (or row) count, so the sum
is the minibatch's gradient. With --mixed-precision bf16 the forwards run under autocast;
log-probs (`token_logprobs` upcasts), values, KL and the losses stay fp32.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from tether.advantages import gae, grpo, kl_shaped_rewards, reinforce_pp, rloo, whiten
from tether.errors import TetherError
from tether.losses import exact_kl_penalty, kl_penalty, ppo_policy_loss, value_loss
from tether.models.critic import policy_and_values
from tether.models.forward import autocast
from tether.models.trunk_head import ResponseScores, exact_kl_at, score_responses
from tether.rl.engines.mismatch import Correction, correction_weights
from tether.rl.roles import Roles, sum_stats
from tether.rl.rollout import Rollout
from tether.rl.scoring import Scored, score_batch, score_reference, scored_from_forward
from tether.run.distributed import Dist
from tether.run.optim import backward, clip_and_step
from tether.run.slicing import chunks, rank_slice


@dataclass(frozen=True)
class KLPlacement:
    """Where the KL penalty acts (--kl-in, --kl-estimator resolved). As a loss term it takes the
    surrogate's reduction (`UpdateSpec.aggregation`), so beta means what it means in the reward
    when both are per-sequence sums (DESIGN.md)."""

    in_reward: bool  # per token, -beta * kl in the reward (PPO); else a loss term (GRPO)
    estimator: str  # k1, k2, k3 or abs in the reward; k3_ratio, k2, k3 or exact in the loss

    def betas(self, beta: float) -> tuple[float, float]:
        """(beta in the reward, beta on the loss term)."""
        return (beta, 0.0) if self.in_reward else (0.0, beta)

    @property
    def reward_estimator(self) -> str:
        # With the KL in the loss the reward is the score alone and the controller is fed the
        # rollout's k1, unbiased for the per-sequence KL.
        return self.estimator if self.in_reward else "k1"


@dataclass(frozen=True)
class AdvantageSpec:
    """The advantage estimator and its settings (--advantage, --gamma, --lam, ...)."""

    name: str  # gae (needs a critic), rloo, grpo or reinforce++
    gamma: float
    lam: float
    whiten: bool  # gae only: standardise the advantages over the batch's real tokens
    samples_per_prompt: int  # k: the group rloo and grpo compare
    scale_rewards: str  # grpo: "group" or "batch" (divide by that std) or "none" (Dr. GRPO)


@dataclass(frozen=True)
class UpdateSpec:
    """Everything steps 2-4 read besides tensors and models, derived once from the run's config
    (`tether.train.ppo_setup.update_spec`)."""

    epochs: int  # passes over each rollout batch
    minibatch_size: int  # global rows per optimizer step
    micro_rows: int  # rows per forward and backward on this rank
    clip_range: float  # PPO's ratio clip epsilon
    clip_high: float  # the upper bound's epsilon (DAPO's clip-higher); 0: clip_range
    importance_level: str  # "token" (PPO) or "sequence" (GSPO: one ratio per response)
    policy_loss: str  # "ppo" (the clipped surrogate) or "cispo" (capped, detached IS weights)
    value_clip_range: float
    vf_coef: float
    max_grad_norm: float  # 0: no clipping
    target_kl: float  # stop a batch's epochs past this approx KL (0: off)
    kl: KLPlacement
    advantage: AdvantageSpec
    mixed_precision: str  # "bf16": forwards under autocast
    chunked_lm_head: bool
    gradient_checkpointing: bool
    correction: Correction = Correction()  # engine-mismatch corrections (off: the default)
    # The surrogate's reduction over tokens, and the KL term's with the KL in the loss: "token",
    # "sequence" or "sum" (tether.losses.reduce_tokens, --loss-aggregation resolved).
    aggregation: str = "token"
    mask_truncated: bool = False  # responses that never ended carry no policy loss (DAPO)


class Counts(NamedTuple):
    """A minibatch's denominators (all ranks' rows): the tokens and the rows that carry the
    policy's loss, and the real tokens the value loss averages over."""

    tokens: int
    rows: int
    value_tokens: int


def policy_mask(rollout: Rollout, spec: UpdateSpec) -> torch.Tensor:
    """[B, R] the tokens that carry the policy's loss (the surrogate and the KL term): every real
    response token, or with `spec.mask_truncated` only those of responses that ended (EOS or a
    stop string). A response cut at --max-new-tokens was not finished, so its score does not
    judge it: DAPO's overlong filtering (Yu et al. 2025, sec. 3.4) drops it from the loss, and
    from every denominator, as if it had not been sampled. The critic still learns from it."""
    mask = rollout.response_mask
    return mask & rollout.ended[:, None] if spec.mask_truncated else mask


def counts_of(rollout: Rollout, spec: UpdateSpec, index: torch.Tensor | None = None) -> Counts:
    """The `Counts` of the rows `index` of `rollout` (default: all of them)."""
    carrying, real = policy_mask(rollout, spec), rollout.response_mask
    if index is not None:
        carrying, real = carrying[index], real[index]
    rows = int(carrying.any(dim=1).sum()) if spec.mask_truncated else real.shape[0]
    return Counts(int(carrying.sum()), rows, int(real.sum()))


@dataclass
class BatchUpdate:
    """What one batch's steps 2-4 produced: all [B, R] but the stats."""

    old: Scored  # pi_old, ref, V_old, entropy and exact KL on the sampled tokens
    kl: torch.Tensor  # the per-token KL the reward was shaped with (k1 with the KL in the loss)
    advantages: torch.Tensor
    returns: torch.Tensor  # the critic's targets (zeros without a critic)
    stats: dict[str, float]  # the update's: losses, clip fractions, grad norm, updates
    update_s: float  # seconds from the first forward with gradients to the last step


# minibatch_loss stats that are means over tokens (the rest are loss values): the policy's over
# the tokens that carry its loss, the critic's over every real token.
POLICY_MEANS = ("policy/clip_frac", "policy/approx_kl", "policy/ratio_mean")
VALUE_MEANS = ("value/clip_frac",)
TOKEN_MEANS = POLICY_MEANS + VALUE_MEANS


def estimate_advantages(spec: AdvantageSpec, rewards: torch.Tensor, values: torch.Tensor,
                        mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, R] from the per-token rewards by the estimator `spec.name`: GAE
    with the critic's values (whitened when `spec.whiten`), or a critic-free estimator over the
    `spec.samples_per_prompt` responses to each prompt (returns are then unused zeros)."""
    if spec.name == "gae":
        advantages, returns = gae(rewards, values, mask, spec.gamma, spec.lam)
        return (whiten(advantages, mask) if spec.whiten else advantages), returns
    k = spec.samples_per_prompt
    critic_free = {
        "rloo": lambda: rloo(rewards, mask, k),  # Ahmadian et al. 2024
        # Shao et al. 2024; Liu et al. 2025 (scale_rewards "none": Dr. GRPO)
        "grpo": lambda: grpo(rewards, mask, k, spec.scale_rewards),
        "reinforce++": lambda: reinforce_pp(rewards, mask, spec.gamma),  # Hu 2025
    }
    return critic_free[spec.name](), torch.zeros_like(rewards)


def one_pass(spec: UpdateSpec, rows: int, d: Dist) -> bool:
    """Whether the batch of `rows` rows gets one optimizer step over all its rows in one forward
    on one process, so that the update's forward also scores pi_old. Under torchrun each rank
    scores its rows and all are gathered before the shaping, so the two passes stay."""
    return (spec.epochs == 1 and spec.minibatch_size == rows and spec.micro_rows == rows
            and not d.active)


def update_batch(roles: Roles, reference: nn.Module, optimizer: torch.optim.Optimizer,
                 rollout: Rollout, scores: torch.Tensor, beta: float, spec: UpdateSpec,
                 generator: torch.Generator, fuse: bool | None = None) -> BatchUpdate:
    """Steps 2-4 on the global rollout batch (every rank holds all of it).

    Args:
        rollout: B rows. scores: [B] sequence scores (penalised, normalised, clipped).
        beta: the controller's coefficient for this batch. generator: later epochs' shuffles.
        fuse: score pi_old in the update's own forward; None: when `one_pass` holds (a test may
            ask for either path on a batch that allows both).
    """
    fuse = one_pass(spec, len(rollout), roles.dist) if fuse is None else fuse
    mask = rollout.response_mask
    device = rollout.input_ids.device
    reward_beta, loss_beta = spec.kl.betas(beta)
    forward = None
    if fuse:
        with autocast(spec.mixed_precision, device):
            ref = score_reference(reference, rollout, spec.chunked_lm_head)
        started = time.perf_counter()  # the update's forward is this batch's scoring pass too
        forward, old = _update_forward(roles, reference, rollout, ref, spec)
    else:
        with autocast(spec.mixed_precision, device):
            old = score_batch(roles, reference, rollout, spec.minibatch_size, spec.micro_rows,
                              spec.chunked_lm_head)
    # 3. Per-token rewards: -beta * kl_t, the score on the last real token.
    rewards, kl = kl_shaped_rewards(scores, old.logprobs, old.ref_logprobs, mask, reward_beta,
                                    spec.kl.reward_estimator)
    advantages, returns = estimate_advantages(spec.advantage, rewards, old.values, mask)
    corrected = {}
    if spec.correction.active and rollout.engine_logprobs is not None:
        # The engine sampled from pi_engine, the loss's ratio is against the trainer's pi_old:
        # weight the policy gradient by min(pi_old / pi_engine, C), or drop far-off rows (w >= 0,
        # so weighting A is weighting the clipped surrogate).
        weights, corrected = correction_weights(old.logprobs, rollout.engine_logprobs, mask,
                                                spec.correction)
        advantages = advantages * weights
    if not fuse:
        started = time.perf_counter()
    # 4. PPO epochs over minibatches (each rank: its share of every minibatch).
    stats = ppo_update(roles, optimizer, rollout, old, advantages, returns, spec, loss_beta,
                       generator, reference, forward) | corrected
    return BatchUpdate(old, kl, advantages, returns, stats, time.perf_counter() - started)


def _update_forward(roles: Roles, reference: nn.Module, rollout: Rollout, ref: ResponseScores,
                    spec: UpdateSpec) -> tuple[tuple[ResponseScores, torch.Tensor], Scored]:
    """The update's forward of policy and critic on the whole batch, with its graph kept for
    the one micro-batch, and pi_old's scores read off it, detached."""
    with update_mode(spec.gradient_checkpointing, roles.policy, roles.critic):
        with autocast(spec.mixed_precision, rollout.input_ids.device):
            forward = policy_and_values(roles.policy, roles.critic, rollout.input_ids,
                                        rollout.attention_mask, rollout.context_length,
                                        rollout.temperature, chunked=spec.chunked_lm_head,
                                        hidden=True)
            old = scored_from_forward(roles.policy, reference, rollout, forward, ref,
                                      spec.chunked_lm_head)
    return forward, old


def ppo_update(roles: Roles, optimizer: torch.optim.Optimizer, rollout: Rollout, old: Scored,
               advantages: torch.Tensor, returns: torch.Tensor, spec: UpdateSpec,
               kl_loss_beta: float, generator: torch.Generator,
               reference: nn.Module | None = None, forward=None) -> dict[str, float]:
    """`spec.epochs` passes over minibatches of `spec.minibatch_size` rows of the rollout.

    The first epoch walks the minibatches in rollout order (the chunks `score_rollout` used, so
    the ratio starts at exactly 1); later epochs shuffle. Trust-region guard: when a minibatch's
    approx KL(pi_old || pi) already exceeds `spec.target_kl` (> 0), that step is not taken and the
    batch's remaining epochs are skipped, a cheap stand-in for TRPO's hard KL constraint
    (Schulman et al. 2015, eq. 12). The guard judges the whole minibatch, so it runs after the
    micro-batches' backward passes; a refused step's gradients are dropped. On-policy (the first
    minibatch of the first epoch) approx KL is exactly 0, so the guard never refuses it.

    `rollout`, `old`, `advantages` and `returns` are the global batch; `roles` says which rows are
    this rank's. The approx KL is global, so every rank stops at the same step. `forward`: the
    (scores, values) the batch's one micro-batch already computed with gradients (`one_pass`).
    """
    batch = len(rollout)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    history: list[dict[str, float]] = []
    stopped, skipped = False, 0
    with update_mode(spec.gradient_checkpointing, roles.policy, roles.critic):
        for epoch in range(spec.epochs):
            order = (torch.arange(batch) if epoch == 0
                     else torch.randperm(batch, generator=generator))
            for rows in chunks(batch, spec.minibatch_size):
                index = order[rows].to(advantages.device)
                if (spec.mask_truncated and roles.critic is None
                        and counts_of(rollout, spec, index).tokens == 0):
                    # Every response of it was truncated (--mask-truncated): no loss, and an
                    # AdamW step on a zero gradient would still move the weights (momentum).
                    skipped += 1
                    forward = None
                    continue
                optimizer.zero_grad(set_to_none=True)
                stats = accumulate_minibatch(roles, rollout, old, advantages, returns, index,
                                             spec, kl_loss_beta, reference, forward)
                forward = None  # it was the first micro-batch's
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


def accumulate_minibatch(roles: Roles, rollout: Rollout, old: Scored, advantages: torch.Tensor,
                         returns: torch.Tensor, index: torch.Tensor, spec: UpdateSpec,
                         kl_loss_beta: float, reference: nn.Module | None = None,
                         forward=None) -> dict[str, float]:
    """Forward and backward over this rank's share of the minibatch `index` (global rows; all of
    it with one process) in micro-batches of `spec.micro_rows` rows, adding to the gradients;
    returns the stats the whole minibatch would give (loss shares summed over micro-batches and
    ranks, token means weighted by each micro-batch's tokens).

    Every loss is divided by the whole minibatch's counts and multiplied by `grad_scale` (the
    world size: DDP and FSDP2 average the ranks' gradients), so the reduced gradient is the
    one-process gradient; only the last micro-batch's backward reduces (`no_sync`). Each forward
    runs under bf16 autocast when `spec.mixed_precision` asks; the backward outside it (as
    torch.autocast recommends). A NaN or inf loss on any rank stops every rank before its
    backward (`tether.run.optim.backward`).
    """
    d = roles.dist
    counts = counts_of(rollout, spec, index)  # the whole minibatch's, all ranks
    carrying = policy_mask(rollout, spec)
    device = rollout.input_ids.device
    mine = index[rank_slice(len(index), d)]
    parts = chunks(len(mine), spec.micro_rows)
    if forward is not None and len(parts) != 1:
        raise ValueError("a precomputed forward needs the minibatch in one micro-batch")
    sums: dict[str, float] = {}
    for number, rows in enumerate(parts):
        micro = mine[rows]
        with roles.no_sync(skip=number < len(parts) - 1):
            with autocast(spec.mixed_precision, device):
                loss, part = roles.call(minibatch_loss, rollout.select(micro), old.select(micro),
                                        advantages[micro], returns[micro], spec, kl_loss_beta,
                                        counts, reference, forward)
            backward(loss * d.grad_scale if d.active else loss, d)
        weights = {key: int(carrying[micro].sum()) for key in POLICY_MEANS}
        weights |= {key: int(rollout.response_mask[micro].sum()) for key in VALUE_MEANS}
        for key, value in part.items():  # losses are already shares; weight the token means
            sums[key] = sums.get(key, 0.0) + value * weights.get(key, 1)
    sums = sum_stats(sums, d)
    totals = {key: counts.tokens for key in POLICY_MEANS} | {key: counts.value_tokens
                                                              for key in VALUE_MEANS}
    return {key: value / max(totals.get(key, 1), 1) for key, value in sums.items()}


def minibatch_loss(policy: nn.Module, critic: nn.Module | None, sub: Rollout, old: Scored,
                   advantages: torch.Tensor, returns: torch.Tensor, spec: UpdateSpec,
                   kl_loss_beta: float, denominators: Counts | None = None,
                   reference: nn.Module | None = None, computed=None):
    """The loss on one minibatch: the clipped surrogate, plus vf_coef * the clipped value loss
    when there is a critic (Schulman et al. 2017, eq. 9, without the entropy bonus), plus beta *
    the KL penalty when the KL is a loss term (`tether.losses.kl_penalty`, k3 x ratio by default,
    whose gradient is that of KL(pi || ref); `exact` needs `reference`).

    Reductions: the surrogate and the KL term reduce by `spec.aggregation` over the tokens that
    carry the policy's loss (`policy_mask`), the value loss is a token mean over every real
    token. `denominators`: the whole minibatch's `Counts` when `sub` is one of its micro-batches
    (default: `sub`'s own): every loss term is divided by the minibatch's count, so the
    micro-batches' losses add up to the minibatch's; the stats in `TOKEN_MEANS` are means over
    this micro-batch's tokens. `computed`: the (scores, values) of
    `policy_and_values` on `sub`, already run with gradients (`one_pass`), instead of a forward.

    Returns (loss, stats) with detached float stats.
    """
    mask, carrying = sub.response_mask, policy_mask(sub, spec)
    counts = denominators if denominators is not None else counts_of(sub, spec)
    aggregation = spec.aggregation
    # "token" divides by the tokens that carry loss, "sequence" and "sum" by their rows.
    policy_denominator = counts.tokens if aggregation == "token" else counts.rows
    exact = kl_loss_beta > 0 and spec.kl.estimator == "exact"
    scores, values = computed or policy_and_values(policy, critic, sub.input_ids,
                                                   sub.attention_mask, sub.context_length,
                                                   sub.temperature, chunked=spec.chunked_lm_head,
                                                   hidden=exact)
    logprobs = scores.logprobs * mask
    pg_loss, pg_stats = ppo_policy_loss(logprobs, old.logprobs, advantages, carrying,
                                        spec.clip_range, denominator=policy_denominator,
                                        clip_high=spec.clip_high or None,
                                        level=spec.importance_level, kind=spec.policy_loss,
                                        aggregation=aggregation)
    loss = pg_loss
    stats = {"policy/loss": pg_loss.item(), "policy/clip_frac": float(pg_stats["clip_frac"]),
             "policy/approx_kl": float(pg_stats["approx_kl"]),
             "policy/ratio_mean": float(pg_stats["ratio_mean"])}
    if critic is not None:
        v_loss, v_stats = value_loss(values * mask, old.values, returns, mask,
                                     spec.value_clip_range, denominator=counts.value_tokens)
        loss = loss + spec.vf_coef * v_loss
        stats |= {"value/loss": v_loss.item(), "value/clip_frac": float(v_stats["clip_frac"])}
    if kl_loss_beta > 0:
        if exact:
            per_position = _exact_kl(policy, reference, sub, scores.hidden, spec.chunked_lm_head)
            kl_term, _ = exact_kl_penalty(per_position, carrying, denominator=policy_denominator,
                                          aggregation=aggregation)
        else:
            kl_term, _ = kl_penalty(logprobs, old.logprobs, old.ref_logprobs, carrying,
                                    spec.kl.estimator, denominator=policy_denominator,
                                    aggregation=aggregation)
        loss = loss + kl_loss_beta * kl_term
        stats["objective/kl_loss"] = kl_term.item()
    return loss, stats


def _exact_kl(policy: nn.Module, reference: nn.Module, sub: Rollout, hidden: torch.Tensor,
              chunked: bool) -> torch.Tensor:
    """KL(pi || ref) over the vocabulary at each response position [B, R], differentiable in the
    policy's `hidden` states; the reference is scored here, without a gradient."""
    with torch.no_grad():
        ref = score_responses(reference, sub.input_ids, sub.attention_mask, sub.context_length,
                              sub.temperature, chunked=chunked, hidden=True)
    per_position = exact_kl_at(policy, reference, hidden, ref.hidden, sub.temperature)
    if per_position is None:
        raise TetherError("--kl-estimator exact needs the models' logits to be head(hidden); use "
                          "k3_ratio for this model")
    return per_position


@contextlib.contextmanager
def update_mode(gradient_checkpointing: bool, *models: nn.Module | None):
    """Training mode for the update when gradient checkpointing is on, eval mode again after.

    transformers recomputes a layer's activations only while the module is in training mode, but
    PPO keeps its models in eval mode so that rollout and update forwards agree. Dropout is already
    zeroed everywhere (`disable_dropout`), so training mode computes exactly what eval mode does
    and the first epoch's ratio stays exactly 1.
    """
    trained = [m for m in models if m is not None] if gradient_checkpointing else ()
    for model in trained:
        model.train()
    try:
        yield
    finally:
        for model in trained:
            model.eval()
