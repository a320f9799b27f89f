"""What the rollout-time models say about the sampled tokens: pi_old's log-probs and entropy,
the reference's log-probs, the critic's values and the exact KL, all [B, R] and zero on padding.

Notation: B rollout batch, R response width, V vocabulary.

Every log-prob is taken at the rollout's own sampling temperature, and pi_old is scored by
`tether.models.critic.policy_and_values`, the forward the update runs, in the rows of the first
epoch's micro-batches: same rows, same code, so the first epoch's ratio is exactly 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tether import kl as kl_lib
from tether.lm_head import head_entropy
from tether.models.critic import policy_and_values
from tether.models.trunk_head import ResponseScores, exact_kl_at, score_responses, trunk_and_head
from tether.rl.roles import Roles, gather_in_order
from tether.rl.rollout import Rollout
from tether.run.slicing import chunks, epoch0_rows

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


@torch.no_grad()
def score_reference(reference: nn.Module, rollout: Rollout, chunked: bool) -> ResponseScores:
    """log ref(y_t) [B, R] and the reference's hidden states [B, R, d] (for the exact KL)."""
    return score_responses(reference, rollout.input_ids, rollout.attention_mask,
                           rollout.context_length, rollout.temperature, chunked=chunked,
                           hidden=True)


def score_batch(roles: Roles, reference: nn.Module, rollout: Rollout, minibatch_size: int,
                micro_rows: int, chunked: bool) -> Scored:
    """pi_old, the reference and the critic on the global rollout's tokens: each rank scores the
    rows it updates in the first epoch, in its micro-batches of `micro_rows` rows (so that
    epoch's ratio is exactly 1), and every rank gets all rows back in order."""
    d = roles.dist
    rows = epoch0_rows(len(rollout), minibatch_size, d).to(rollout.input_ids.device)
    mine = roles.peek(lambda policy, critic: score_rollout(
        policy, reference, critic, rollout.select(rows), None, micro_rows, chunked))
    return Scored(*(gather_in_order(getattr(mine, name), len(rollout), minibatch_size, d)
                    for name in SCORED))


@torch.no_grad()
def scored_from_forward(policy: nn.Module, reference: nn.Module, rollout: Rollout,
                        forward: tuple[ResponseScores, torch.Tensor], ref: ResponseScores,
                        chunked: bool) -> Scored:
    """pi_old's scores read off the update's own forward on the whole batch (`forward`, from
    `policy_and_values` with its hidden states; `tether.rl.update.one_pass`), detached: its
    log-probs and values, the entropy and the exact KL from its hidden states through the LM
    head; `ref`: `score_reference` of the batch."""
    current, values = forward
    real = rollout.response_mask.float()
    exact = exact_kl_at(policy, reference, current.hidden.detach(), ref.hidden,
                        rollout.temperature)
    return Scored(logprobs=current.logprobs.detach() * real, ref_logprobs=ref.logprobs * real,
                  values=values.detach().float() * real,
                  entropy=_entropy(policy, rollout, current.hidden, chunked) * real,
                  exact_kl=(exact.float() * real if exact is not None
                            else torch.full_like(real, float("nan"))))


def _entropy(policy: nn.Module, rollout: Rollout, hidden: torch.Tensor, chunked: bool):
    """H(pi(. | s_t)) [B, R] from the update's hidden states through the LM head; a model whose
    logits are not head(hidden) gets one more forward (tether.models.trunk_head.trunk_and_head)."""
    try:
        _, head = trunk_and_head(policy)
    except ValueError:
        return score_responses(policy, rollout.input_ids, rollout.attention_mask,
                               rollout.context_length, rollout.temperature, chunked=chunked,
                               entropy=True).entropy
    return head_entropy(hidden.detach(), head, rollout.temperature)
