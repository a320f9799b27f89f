"""The online losses: the policy objectives (PPO's clipped surrogate and its variants) and their
reduction, the KL loss term, the value loss. The pairwise losses of the offline stages
(Bradley-Terry, DPO, IPO) are in `tether.preference`.

Notation: B batch, T response positions; `mask` [B, T] is true on the tokens that carry the loss
(the policy's own sampled tokens). Each loss returns the loss plus detached statistics and never
logs.

Three reductions over tokens (`reduce_tokens`, `--loss-aggregation`), chosen by one parameter,
`aggregation`, in every loss here: "token", the masked token mean over the batch,
sum_{i,t} m x / sum_{i,t} m; "sum", per-sequence sums averaged over sequences,
1/B sum_i sum_t m x; "sequence", each response's token mean averaged over responses. "token" and
"sum" differ by the factor L = sum m / B, the batch's mean response length; "sequence" weighs a
short response's tokens more than a long one's. When the KL is a loss term beside the policy
loss, both must use the same reduction, or beta is multiplied by L (or 1/L) relative to the
reward placement.

Policy losses are the objectives below (functions of one bundle of named inputs, `LossInputs`,
each returning the per-token loss and where its clip or cap acted, both [B, T]), each an entry of
`tether.choices.POLICY_LOSSES`, over the ratios of `IMPORTANCE_LEVELS`, reduced by `policy_loss`
with a `PolicyLoss` spec; a new objective is one function and one entry, whatever it reads.

Micro-batches: the reductions take an optional `denominator`, the real-token count (token mean)
or the sequence count (per-sequence) of the whole minibatch. Given it, the masked sum over this
micro-batch is divided by it instead of by its own count, so the losses of a minibatch's
micro-batches add up to the minibatch's loss (and their gradients to its gradient). Rows that
carry no loss at all (--mask-truncated) are left out of the count of sequences the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tether.choices import (
    IMPORTANCE_LEVELS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    KLEstimator,
    entry,
    masked_mean,
    non_negative,
    same_shape,
)
from tether.kl import LOG_RATIO_CLAMP, LOSS_ESTIMATORS


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


def reduce_tokens(x: torch.Tensor, mask: torch.Tensor, aggregation: str = "token",
                  denominator: float | None = None) -> torch.Tensor:
    """Scalar reduction of a [B, T] per-token quantity over the true tokens of `mask`.

    aggregation:
        "token":    sum_{i,t} m x / sum_{i,t} m            masked token mean over the batch
                    (DAPO, Yu et al. 2025, eq. 12; TRL's "dapo"/"bnpo")
        "sequence": 1/B sum_i (sum_t m x / sum_t m)         each response's token mean, then the
                    mean over responses (GRPO as written, Shao et al. 2024, eq. 3; TRL's "grpo")
        "sum":      1/B sum_i sum_t m x                     per-sequence sums, mean over sequences
                    (the units of the per-sequence KL)

    Args:
        x: [B, T] values. mask: [B, T] bool or 0/1.
        denominator: > 0 replaces sum(m) ("token") or B ("sequence", "sum"): the whole
            minibatch's count when this batch is one of its micro-batches (see the module
            docstring), or the rows that carry loss when some rows are masked out whole.
    """
    entry(("token", "sequence", "sum"), aggregation, "loss aggregation")
    m = mask.to(x.dtype)
    if aggregation == "sequence":  # each response's mean first; a row with no tokens adds 0
        x = x / m.sum(dim=1, keepdim=True).clamp(min=1.0)
    if denominator is None:
        if aggregation == "token":
            return masked_mean(x, mask)
        denominator = x.shape[0]
    non_negative("denominator", denominator)
    return (x * m).sum() / max(float(denominator), 1.0)


# ----------------------------------------------------------------------------- policy losses

@dataclass(frozen=True)
class PolicyLoss:
    """Which policy loss, named as the run's config names its fields (--policy-loss, ...)."""

    policy_loss: str = "ppo"  # a key of tether.choices.POLICY_LOSSES
    importance_level: str = "token"  # a key of tether.choices.IMPORTANCE_LEVELS
    clip_range: float = 0.2  # eps, the ratio's lower clip (and upper, without clip_high)
    # eps_high: DAPO's clip-higher (Yu et al. 2025, eq. 10, eps 0.2 and eps_high 0.28) lets a token
    # with A > 0 rise further before its gradient stops; CISPO's cap. 0: the same as clip_range.
    clip_high: float = 0.0
    loss_aggregation: str = "token"  # reduce_tokens's aggregation


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, spec: PolicyLoss = PolicyLoss(),
                denominator: float | None = None, **named: torch.Tensor | int | None
                ) -> tuple[torch.Tensor, dict]:
    """The policy loss `spec` names, on tokens sampled from pi_old:

        ratio_t = exp(IMPORTANCE_LEVELS[level](log pi(y_t) - log pi_old(y_t)))  (clamped +-20)
        L = reduce(POLICY_LOSSES[policy_loss](LossInputs(ratio, log pi, A, ..., **named)))

    Args:
        logprobs: [B, T] log-probs under the policy being updated (differentiable).
        old_logprobs: [B, T] log-probs at rollout time. advantages: [B, T].
        mask: [B, T] bool, the tokens that carry the loss.
        denominator: the whole minibatch's token (or sequence) count when this is one of its
            micro-batches; default: this batch's own.
        named: the optional inputs of `LossInputs` an objective may read, by name.

    Returns:
        (loss, stats): scalar loss; stats `clip_frac` (share of tokens where the clip or cap
        acted), `approx_kl` (mean of k3 for KL(pi_old || pi) per token, Schulman 2020),
        `ratio_mean` (of the ratio the loss used); the stats are means over `mask`, whatever
        `denominator`.
    """
    same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    objective = entry(POLICY_LOSSES, spec.policy_loss, "policy loss").fn
    level = entry(IMPORTANCE_LEVELS, spec.importance_level, "importance level")
    non_negative("clip", spec.clip_range)
    high = spec.clip_high or spec.clip_range
    non_negative("clip_high", high)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(level(log_ratio, mask)).expand_as(log_ratio)  # [B, T]
    per_token, clipped = objective(LossInputs(ratio, logprobs, old_logprobs, advantages, mask,
                                              spec.clip_range, high, **named))
    loss = reduce_tokens(per_token, mask, spec.loss_aggregation, denominator)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean(clipped.float(), mask),
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip: float = 0.2, *, clip_high: float | None = None,
                    level: str = "token", kind: str = "ppo", aggregation: str = "token",
                    denominator: float | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate objective (Schulman et al. 2017, "Proximal Policy Optimization
    Algorithms", eq. 7), negated to a loss, as a masked token mean: the public form of
    `policy_loss`, whose `PolicyLoss` fields these arguments name.

    ratio_t = exp(log pi(y_t) - log pi_old(y_t))
    L = mean_t max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps, 1 + eps_high))

    Args:
        logprobs: [B, T] under the policy being updated (differentiable). old_logprobs: [B, T] at
            rollout time. advantages: [B, T]. mask: [B, T] bool.
        clip: eps > 0. clip_high: eps_high (None or 0: `clip`).
        level: "token" or "sequence" (GSPO). kind: "ppo" or "cispo". aggregation: "token" (the
            default), "sequence" or "sum". denominator: as in `reduce_tokens`.

    Returns:
        (loss, stats) as `policy_loss`: `clip_frac`, `approx_kl`, `ratio_mean`.
    """
    spec = PolicyLoss(kind, level, clip, clip_high or 0.0, aggregation)
    return policy_loss(logprobs, old_logprobs, advantages, mask, spec, denominator)


def kl_penalty(logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
               mask: torch.Tensor, estimator: str = "k3_ratio", aggregation: str = "sum",
               denominator: float | None = None, weights: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, dict]:
    """The KL loss term (the KL-in-the-loss placement); the loop adds beta * penalty to the loss.

    On tokens y_t sampled from pi_old, with d_t = log pi(y_t) - log ref(y_t) and the importance
    ratio rho_t = pi(y_t) / pi_old(y_t) (pi_old detached; log-ratios clamped to +-20):

        k2:        c_t = d_t^2 / 2
        k3:        c_t = exp(-d_t) - 1 + d_t                 (GRPO's term, Shao et al. 2024)
        k3_ratio:  c_t = rho_t * (exp(-d_t) - 1 + d_t)       (both factors carry the gradient)

        penalty = 1/B sum_i sum_t m_{i,t} c_{i,t}            (aggregation "sum", the default)
                = sum_{i,t} m c / sum_{i,t} m                 ("token")

    Expected gradient at one position, y ~ pi_old (Schulman 2020's estimators; the sums are
    checked over a whole vocabulary in tests/test_kl_gradients.py):
        k2:       grad KL(pi || ref) where pi = pi_old (the first step on a batch), not after;
        k3:       grad KL(ref || pi), the forward KL, where pi = pi_old;
        k3_ratio: grad KL(pi || ref) for every pi, since E_{pi_old}[rho * k3] = E_pi[k3]
                  = KL(pi || ref) exactly; hence the default.
    With several tokens, each position's KL is differentiated at its sampled prefix: the effect
    of a token on the KL of later tokens is not in the gradient, as it is with the KL in the
    return. For the exact per-position KL use `exact_kl_penalty`. Beside a policy loss, pass its
    aggregation, or beta acts L = (real tokens / B) times stronger or weaker.

    Args:
        logprobs: [B, T] log pi(y_t) under the policy being updated (differentiable).
        old_logprobs: [B, T] log pi_old(y_t) at rollout time (detached here).
        ref_logprobs: [B, T] log ref(y_t).
        mask: [B, T] bool, true on the tokens that carry the loss; the rest may hold anything.
        estimator: a loss term of `tether.choices.KL_ESTIMATORS` but "exact".
        aggregation, denominator: the reduction, as in `reduce_tokens` ("sum", the default, is
            the per-sequence KL the controller and the reward placement use).
        weights: [B, T] detached per-token weights w_t >= 0 multiplying c_t, or None. Decoupled
            PPO's (Hilton et al. 2021): tokens sampled from a behaviour policy mu, not pi_old,
            weigh w_t = min(pi_old(y_t) / mu(y_t), C), so that E_mu[w c] = E_{pi_old}[c] (up to
            the truncation) and the term is the one above (`tether.rl.engines.mismatch`).

    Returns:
        (penalty, stats): scalar penalty, without beta; detached stats `kl_per_sequence` (mean
        over sequences of the summed c) and `kl_per_token` (masked token mean of c).
    """
    term = _loss_term(estimator)
    same_shape(logprobs=logprobs, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
               mask=mask)
    real = mask.bool()
    # Zero the padding before any exp, so neither its value nor its gradient can turn NaN.
    logprobs = torch.where(real, logprobs, 0.0)
    old_logprobs = torch.where(real, old_logprobs.detach(), 0.0)
    ref_logprobs = torch.where(real, ref_logprobs.detach(), 0.0)
    per_token = term.token(logprobs - ref_logprobs)
    if term.ratio:
        log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        per_token = torch.exp(log_ratio) * per_token
    if weights is not None:
        same_shape(logprobs=logprobs, weights=weights)
        per_token = per_token * torch.where(real, weights.detach(), 0.0)
    return _reduced_penalty(per_token, mask, aggregation, denominator)


def _loss_term(estimator: str) -> KLEstimator:
    """The per-token loss term `estimator` names, or why it cannot be one (its table's facts)."""
    term = entry(KL_ESTIMATORS, estimator, "KL loss estimator")
    if not term.in_loss:
        raise ValueError(f"KL estimator {estimator!r} cannot be a loss term: its expected "
                         f"gradient is {term.gradient}; use one of {', '.join(LOSS_ESTIMATORS)}")
    if term.token is None:
        raise ValueError("the exact KL needs the full logits: compute tether.kl.exact(logits, "
                         "ref_logits) per position and pass it to exact_kl_penalty")
    return term


def exact_kl_penalty(exact_kl: torch.Tensor, mask: torch.Tensor, aggregation: str = "sum",
                     denominator: float | None = None) -> tuple[torch.Tensor, dict]:
    """The exact KL as a loss term: KL(pi(.|prefix) || ref(.|prefix)) summed over the whole
    vocabulary at every sampled prefix, reduced as in `kl_penalty`.

    Its gradient is that of KL(pi || ref) at each position, for every pi, with no sampling noise
    over the vocabulary (the prefixes are still sampled, and held fixed).

    Args:
        exact_kl: [B, T] per-position exact KL, differentiable, e.g. `tether.kl.exact(logits,
            ref_logits, temperature)` at the response positions.
        mask: [B, T] bool, true on the tokens that carry the loss.
        aggregation, denominator: the reduction, as in `kl_penalty`.

    Returns:
        (penalty, stats), as `kl_penalty`.
    """
    same_shape(exact_kl=exact_kl, mask=mask)
    return _reduced_penalty(torch.where(mask.bool(), exact_kl, 0.0), mask, aggregation,
                            denominator)


def _reduced_penalty(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str,
                     denominator: float | None = None) -> tuple[torch.Tensor, dict]:
    penalty = reduce_tokens(per_token, mask, aggregation, denominator)
    with torch.no_grad():
        stats = {"kl_per_sequence": reduce_tokens(per_token, mask, "sum"),
                 "kl_per_token": reduce_tokens(per_token, mask, "token")}
    return penalty, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip: float = 0.2,
               denominator: float | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped value loss (the PPO baselines' variant, as in Ziegler et al. 2019's code release).

    V_clip = V_old + clip(V - V_old, -eps, eps)
    L = 0.5 * mean_t max((V - R)^2, (V_clip - R)^2)

    Args:
        values: [B, T] current value predictions (differentiable).
        old_values: [B, T] predictions at rollout time.
        returns: [B, T] GAE returns.
        mask: [B, T] bool.
        clip: eps >= 0, in the units of the value.
        denominator: the minibatch's real-token count for a micro-batch, as in `ppo_policy_loss`.

    Returns:
        (loss, stats): scalar loss; stats `clip_frac`, `value_mean` (means over `mask`).
    """
    same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    non_negative("clip", clip)
    values_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    vf_loss1 = (values - returns).square()
    vf_loss2 = (values_clipped - returns).square()
    loss = 0.5 * reduce_tokens(torch.maximum(vf_loss1, vf_loss2), mask, "token", denominator)
    with torch.no_grad():
        stats = {"clip_frac": masked_mean((vf_loss2 > vf_loss1).float(), mask),
                 "value_mean": masked_mean(values, mask)}
    return loss, stats
