"""How far the rollout engine's sampling distribution is from the trainer's, and the two
corrections for it (both off by default).

Notation: B rows, R response width; at each sampled token y_t (drawn from the engine),
e_t = log pi_engine(y_t) as the engine reported it, l_t = log pi_old(y_t) as the trainer
recomputes it (the same weights, at the same temperature), d_t = l_t - e_t.

An inference engine computes the same function with other kernels (fused attention, another
matmul order, bf16 on a GPU), so pi_engine != pi_old in the last digits at best. PPO's ratio
pi / pi_old is taken against the trainer's pi_old, so the tokens are off-policy for the loss by
the ratio pi_old / pi_engine, which is what these measure and correct.

    engine_kl   = mean_b sum_t [(exp(d_t) - 1) - d_t]      k3 estimate of KL(pi_engine || pi_old)
                                                           per sequence (Schulman 2020), samples
                                                           from the engine, batch mean
    max_diff    = max_{b,t} |d_t|                          over real tokens

Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings
you off-policy RL training"; Ionides 2008 for truncation): weight each token's policy-gradient
term by w_t = min(exp(d_t), C), detached. Because w_t >= 0 it can multiply the advantage: PPO's
max(-A r, -A clip(r)) times w equals the same with A replaced by w A.

Sequence masking: rows whose summed k3 (the per-sequence term of engine_kl) passes a threshold
get no policy gradient at all (w = 0 on the row), for rows the engine sampled from a distribution
too far from the trainer's to correct.

Staleness (--max-staleness, `tether.rl.engines.ahead`): the engine is then a copy of the policy
some optimizer steps old, so pi_engine is the behaviour policy mu of decoupled PPO (Hilton et
al. 2021, as AReaL uses it): the loss clips pi / pi_old, where pi_old (the proximal policy) is
the trainer's recomputation at the start of the update, and the truncated weight
w_t = min(pi_old(y_t) / mu(y_t), C) corrects the rest (the same weight as above: d_t now holds
the versions' gap and the kernels' alike). `staleness_metrics` keeps the two apart: the
mismatch on rows sampled by the trainer's current version, the KL between versions on the
others.

Every mean here is over real tokens (or rows), never over the padded [B, R] tensor: averaging
padding in as zeros makes a ratio of 0.99 read as 0.57 on short responses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tether.choices import same_shape


@dataclass(frozen=True)
class Correction:
    """The engine-mismatch corrections of a run, named as the config names them."""

    engine_is_cap: float = 0.0  # C of the truncated importance weight (0: off)
    engine_mask_kl: float = 0.0  # drop rows whose summed k3 passes this many nats (0: off)

    @property
    def active(self) -> bool:
        return self.engine_is_cap > 0 or self.engine_mask_kl > 0


def sequence_k3(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
    """[B] sum over real tokens of (exp(d) - 1) - d, d = trainer - engine log-prob: the k3
    estimate of each sequence's KL(pi_engine || pi_trainer), >= 0 term by term."""
    same_shape(trainer_logprobs=trainer_logprobs, engine_logprobs=engine_logprobs, mask=mask)
    d = (trainer_logprobs - engine_logprobs).double()
    return ((torch.expm1(d) - d) * mask).sum(dim=1).float()


def mismatch_metrics(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """`rollout/engine_kl` (batch mean of `sequence_k3`) and `rollout/engine_max_logprob_diff`
    (max |d| over real tokens)."""
    mask = mask.bool()
    diff = (trainer_logprobs - engine_logprobs).abs()
    return {"rollout/engine_kl": sequence_k3(trainer_logprobs, engine_logprobs, mask).mean().item(),
            "rollout/engine_max_logprob_diff":
                diff[mask].max().item() if bool(mask.any()) else 0.0}


def correction_weights(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                       mask: torch.Tensor, correction: Correction
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """([B, R] detached weights for the advantages, their stats). Without a cap the token weight
    is 1; rows past `mask_kl` weigh 0. Stats: `rollout/engine_is_weight` (mean weight over real
    tokens, after truncation and masking), `rollout/engine_is_truncated` (share of real tokens
    whose ratio passed the cap), `rollout/engine_masked_rows` (share of rows masked)."""
    same_shape(trainer_logprobs=trainer_logprobs, engine_logprobs=engine_logprobs, mask=mask)
    mask = mask.bool()
    ratio = torch.exp((trainer_logprobs - engine_logprobs).detach().double())
    cap, mask_kl = correction.engine_is_cap, correction.engine_mask_kl
    weights = ratio.clamp(max=cap) if cap > 0 else torch.ones_like(ratio)
    truncated = (ratio > cap) & mask if cap > 0 else torch.zeros_like(mask)
    keep = (sequence_k3(trainer_logprobs.detach(), engine_logprobs, mask) <= mask_kl
            if mask_kl > 0 else torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device))
    weights = (weights * keep[:, None] * mask).float()
    n_tokens = int(mask.sum())
    stats = {"rollout/engine_is_weight": weights[mask].mean().item() if n_tokens else 1.0,
             "rollout/engine_is_ess": effective_sample_size(weights, mask),
             "rollout/engine_is_truncated": truncated.sum().item() / max(n_tokens, 1),
             "rollout/engine_masked_rows": (~keep).float().mean().item()}
    return weights, stats


def engine_mismatch(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                    mask: torch.Tensor, correction: Correction,
                    versions: torch.Tensor | None = None, current: int = 0,
                    max_staleness: int = 0) -> tuple[torch.Tensor | None, dict[str, float]]:
    """What the loop does with an engine's own log-probs: ([B, R] weights for the advantages,
    or None when `correction` is off; the stats of `mismatch_metrics`, and of
    `correction_weights` when it is on). With `versions` (rows sampled ahead: the arguments of
    `staleness_metrics`), the staleness too, and `rollout/engine_kl` on the rows of the current
    version alone."""
    stats = mismatch_metrics(trainer_logprobs, engine_logprobs, mask)
    weights = None
    if correction.active:
        weights, corrected = correction_weights(trainer_logprobs, engine_logprobs, mask,
                                                correction)
        stats |= corrected
    if versions is not None:  # engine_kl again, on the current version's rows only
        stats = {k: v for k, v in stats.items() if k != "rollout/engine_kl"}
        stats |= staleness_metrics(trainer_logprobs, engine_logprobs, versions, mask, current,
                                   max_staleness)
    return weights, stats


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> float:
    """Kish's effective sample size of importance weights over the real tokens, as a share of
    them: (sum w)^2 / (n sum w^2), 1 when every weight is equal, 1/n when one token holds all
    the weight (1.0 without tokens or weight)."""
    w = weights[mask.bool()].double()
    total = float((w * w).sum())
    return float(w.sum() ** 2 / (len(w) * total)) if total > 0 else 1.0


def staleness_metrics(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                      versions: torch.Tensor, mask: torch.Tensor, current: int,
                      max_staleness: int) -> dict[str, float]:
    """A batch sampled ahead of the trainer, measured apart (g = current - version of a token,
    in optimizer steps; `current`: the version the update starts from):

        async/staleness_mean, _max        g over the sampled tokens
        async/staleness_<g>               share of the sampled tokens at each g in 0..S
        async/overrun_tokens              share past S (trained, never dropped: flagged here)
        rollout/engine_kl                 `sequence_k3`'s batch mean on rows sampled by the
                                          current version: the engines' mismatch alone
        async/version_kl                  the same on the other rows: KL(mu || pi_old) between
                                          versions (with the mismatch in it)

    A mean over no rows is left out."""
    same_shape(trainer_logprobs=trainer_logprobs, engine_logprobs=engine_logprobs,
               versions=versions, mask=mask)
    mask = mask.bool()
    gaps = current - versions[mask]
    n = max(len(gaps), 1)
    out = {"async/staleness_mean": float(gaps.double().mean()) if len(gaps) else 0.0,
           "async/staleness_max": float(gaps.max()) if len(gaps) else 0.0,
           "async/overrun_tokens": float((gaps > max_staleness).sum()) / n}
    out |= {f"async/staleness_{g}": float((gaps == g).sum()) / n for g in range(max_staleness + 1)}
    row_gap = (current - torch.where(mask, versions, current).min(dim=1).values)  # [B]
    sampled = mask.any(dim=1)
    k3 = sequence_k3(trainer_logprobs, engine_logprobs, mask)
    for name, rows in (("rollout/engine_kl", sampled & (row_gap == 0)),
                       ("async/version_kl", sampled & (row_gap > 0))):
        if bool(rows.any()):
            out[name] = float(k3[rows].mean())
    return out
