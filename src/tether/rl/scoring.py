"""Every forward of the online loop's models on a rollout's tokens, and the tensors it returns.

Notation: B rollout batch, b a micro-batch's rows, R response width, d hidden size, V vocabulary.

    policy_and_values    the policy's log-probs (entropies, hidden states) and the critic's values:
                         the one forward both passes below run, so the first epoch's ratio is 1
    score_batch          no gradient: pi_old, the reference, V_old, the entropy and the exact KL of
                         the global batch (`Scored`), each rank its first-epoch rows in the cuts
                         of `micro_batches_of` (the update's micro-batches)
    update_forward       with gradients: what the loss reads of the current policy and critic on a
                         micro-batch (`Forward`), run inside the DDP/FSDP2 wrapper by the update
    scored_from_forward  pi_old read off the update's own forward, when one forward is both
                         (tether.rl.update.one_pass)
    Forwards             the update's forwards, one of which `score_old` may have run already
    score_old            step 2 of the update: pi_old by `score_batch`, or off the update's own
                         first forward (`scored_from_forward`), whichever `one_pass` says
    update_mode          the models' mode while the update runs (gradient checkpointing)

Every log-prob is taken at the rollout's own sampling temperature; everything the tokens the
policy did not sample could hold is zeroed (`action_mask`). The loss itself is computed from these
tensors, outside any model call (tether.rl.update.update_loss).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from tether import kl as kl_lib
from tether.errors import TetherError
from tether.lm_head import head_entropy
from tether.models.critic import ValueHead
from tether.models.forward import autocast
from tether.models.trunk_head import (
    ResponseScores,
    exact_kl_at,
    placed_at,
    score_responses,
    trunk_and_head,
)
from tether.rl.roles import Roles
from tether.rl.rollout import Rollout
from tether.run import distributed
from tether.run.distributed import Dist
from tether.run.slicing import chunks, rank_chunks, token_parts


class Scored(NamedTuple):
    """What the rollout-time models say about the sampled tokens; all [B, R], zero on the tokens
    the policy did not sample."""

    logprobs: torch.Tensor  # log pi_old(y_t), at the sampling temperature
    ref_logprobs: torch.Tensor  # log ref(y_t), same temperature
    values: torch.Tensor  # V_old(s_t) (zero without a critic)
    entropy: torch.Tensor  # H(pi_old(. | s_t))
    exact_kl: torch.Tensor  # KL(pi_old(. | s_t) || ref(. | s_t)) over the whole vocabulary (NaN: n/a)


class Forward(NamedTuple):
    """What the update's forward says about a micro-batch, with gradients; all [b, R]. A named
    tuple, so the wrappers see its tensors (FSDP2 hooks its backward on them)."""

    logprobs: torch.Tensor  # log pi(y_t) at the sampling temperature
    values: torch.Tensor  # V(s_t) (zeros without a critic)
    exact_kl: torch.Tensor | None  # KL(pi(. | s_t) || ref(. | s_t)), when the KL term is exact
    hidden: torch.Tensor | None  # [b, R, d] the policy's final hidden states, when kept


def policy_and_values(policy: nn.Module, critic: nn.Module | None, rollout: Rollout, *,
                      chunked: bool = True, entropy: bool = False, hidden: bool = False,
                      packed: bool = False):
    """Response scores of the policy (log-probs [B, R], entropies when asked) and values [B, R]
    of the critic on the tokens the policy sampled in `rollout`, in one call.

    `critic` None (the critic-free estimators) gives zero values. The rollout scoring and the
    PPO update both go through this function, so the "old" log-probs and values are computed by
    the very code that computes the new ones, and the first epoch's probability ratio is exactly
    1. `chunked`: log-probs through the LM head in chunks (tether.lm_head, no [B, R, V] logits);
    the shared critic reads the same hidden states. `packed`: the policy's forward on the rows'
    real tokens in packed rows (tether.models.packed); a separate critic keeps the padded forward.
    """
    shared, mask = isinstance(critic, ValueHead), rollout.action_mask
    scores = scores_of(policy, rollout, chunked, entropy=entropy, hidden=shared or hidden,
                       packed=packed)
    if critic is None:  # critic-free advantages (rloo, grpo, reinforce++): no values
        values = torch.zeros_like(scores.logprobs)
    elif shared:  # the head reads the positions scored, as the LM head does
        values = placed_at(critic(scores.hidden[mask.bool()]), mask)
    else:
        values = critic(rollout.input_ids, rollout.attention_mask, rollout.context_length, mask)
    return scores, values


def scores_of(model: nn.Module, rollout: Rollout, chunked: bool, **asked) -> ResponseScores:
    """`score_responses` of `model` on the tokens the policy sampled in `rollout`, at its
    sampling temperature; `asked`: entropy, hidden, packed."""
    return score_responses(model, rollout.input_ids, rollout.attention_mask,
                           rollout.context_length, rollout.temperature, chunked=chunked,
                           mask=rollout.action_mask, **asked)


@torch.no_grad()
def score_rollout(policy: nn.Module, reference: nn.Module, critic: nn.Module, rollout: Rollout,
                  temperature: float | None, chunk_size: int, chunked: bool = True,
                  packed: bool = False) -> Scored:
    """Policy, reference and critic on the sampled tokens, in chunks of `chunk_size` rows.

    The chunks are the first epoch's micro-batches (`cfg.micro_batch_rows`), and the forward is
    `policy_and_values`, the one the update uses: same rows, same code, so the first epoch's ratio
    is exactly 1. `chunked`: log-probs and entropies through the LM head in chunks
    (tether.lm_head; no [B, R, V] logits). `packed`: each chunk's forwards on packed rows.
    `temperature`: None, or the rollout's own; another is refused (log-probs at another
    temperature than the sampling one make the ratio and the KL wrong).
    """
    if temperature is not None and temperature != rollout.temperature:
        raise ValueError(f"log-probs asked at temperature {temperature} for responses sampled at "
                         f"{rollout.temperature}")
    parts = []
    for rows in chunks(len(rollout), chunk_size):
        sub = rollout.select(rows)
        mask = sub.action_mask
        scores, values = policy_and_values(policy, critic, sub, chunked=chunked, entropy=True,
                                           hidden=True, packed=packed)
        ref = score_reference(reference, sub, chunked, packed)
        exact = exact_kl_at(policy, reference, scores.hidden, ref.hidden, sub.temperature, mask)
        parts.append(_scored(scores.logprobs, ref.logprobs, values, scores.entropy, exact, mask))
    return Scored(*map(torch.cat, zip(*parts, strict=True)))


def score_batch(roles: Roles, reference: nn.Module, rollout: Rollout, spec) -> Scored:
    """pi_old, the reference and the critic on the global rollout's tokens: each rank scores the
    rows it updates in the first epoch, in that epoch's micro-batches (`micro_batches_of`: of
    `spec.micro_rows` rows or `spec.micro_batch_tokens` tokens; `spec`: the update's
    `tether.rl.update.UpdateSpec`), so that epoch's ratio is exactly 1, and every rank gets all
    rows back in order."""
    d, device = roles.dist, rollout.input_ids.device

    def scored(policy: nn.Module, critic: nn.Module | None) -> Scored:
        rows, parts = [], []  # this rank's rows, in turn, and their scores
        for minibatch in chunks(len(rollout), spec.minibatch_size):
            index = torch.arange(len(rollout), device=device)[minibatch]
            for micro, real in micro_batches_of(rollout, index, spec, d):
                part = score_rollout(policy, reference, critic, rollout.select(micro), None,
                                     len(micro), spec.chunked_lm_head, spec.pack)
                if real:
                    rows.append(micro)
                    parts.append(part)
        back = torch.argsort(distributed.all_gather_rows(torch.cat(rows), d))  # row i's place
        return Scored(*(distributed.all_gather_rows(torch.cat(tensors), d)[back]
                        for tensors in zip(*parts, strict=True)))
    return roles.peek(scored)


def micro_batches_of(rollout: Rollout, index: torch.Tensor, spec, d: Dist
                     ) -> list[tuple[torch.Tensor, bool]]:
    """This rank's micro-batches of the minibatch `index` (global rows), as (rows, real): its
    contiguous share in runs of `spec.micro_rows` rows, as many on every rank (a rank whose
    share is a row short, in a batch of episodes split into segments, runs a borrowed row that
    is not real: its loss counts 0); or with `spec.micro_batch_tokens` the token-budget cut,
    rows dealt to the ranks for even token sums (`token_parts`), where a rank's empty turn runs
    a borrowed row too. `score_batch` scores the first epoch in these cuts."""
    if spec.micro_batch_tokens:
        lengths = rollout.attention_mask.sum(dim=1)[index].tolist()
        cut = [(rows or [0], bool(rows))
               for rows in token_parts(lengths, spec.micro_batch_tokens, d)[d.rank]]
    else:  # positions into `index`, as many runs on every rank as the largest share's
        cut = rank_chunks(len(index), spec.micro_rows, d)
    return [(index[torch.tensor(rows, device=index.device)], real) for rows, real in cut]


def update_forward(policy: nn.Module, critic: nn.Module | None, reference: nn.Module,
                   sub: Rollout, chunked: bool, exact: Callable | None, keep_hidden: bool,
                   packed: bool = False) -> Forward:
    """The current policy and critic on the micro-batch `sub`, with gradients (`Forward`).
    `exact`: a divergence over the vocabulary (`tether.kl.KLPlacement.divergence`: the KL term's
    when it is one, else None), also computed at each position, differentiable in the policy (the
    reference scored here, without a gradient). `keep_hidden`: return the policy's
    hidden states, to read pi_old's entropy and exact KL off this forward. `packed`: the forwards
    on the micro-batch's real tokens in packed rows (tether.models.packed)."""
    scores, values = policy_and_values(policy, critic, sub, chunked=chunked,
                                       hidden=exact or keep_hidden, packed=packed)
    exact_kl = None
    if exact:  # [b, R] the divergence (KL(pi || ref), the forward KL or the JSD) at each position
        ref = score_reference(reference, sub, chunked, packed)  # without a gradient
        exact_kl = exact_kl_at(policy, reference, scores.hidden, ref.hidden, sub.temperature,
                               sub.action_mask, exact)
        if exact_kl is None:
            raise TetherError("--kl-estimator exact (and forward, jsd) needs the models' logits "
                              "to be head(hidden); use k3_ratio for this model")
    return Forward(scores.logprobs, values, exact_kl, scores.hidden if keep_hidden else None)


@torch.no_grad()
def score_reference(reference: nn.Module, rollout: Rollout, chunked: bool,
                    packed: bool = False) -> ResponseScores:
    """log ref(y_t) [B, R] and the reference's hidden states [B, R, d] (for the exact KL)."""
    return scores_of(reference, rollout, chunked, hidden=True, packed=packed)


@torch.no_grad()
def scored_from_forward(policy: nn.Module, reference: nn.Module, rollout: Rollout,
                        forward: Forward, ref: ResponseScores, chunked: bool) -> Scored:
    """pi_old's scores read off the update's own forward on the whole batch (`forward`, with its
    hidden states kept; `tether.rl.update.one_pass`), detached: its log-probs and values, the
    entropy and the exact KL from its hidden states through the LM head; `ref`:
    `score_reference` of the batch."""
    mask = rollout.action_mask
    exact = exact_kl_at(policy, reference, forward.hidden.detach(), ref.hidden,
                        rollout.temperature, mask)
    return _scored(forward.logprobs.detach(), ref.logprobs, forward.values.detach(),
                   _entropy(policy, rollout, forward.hidden, chunked), exact, mask)


def _scored(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, values: torch.Tensor,
            entropy: torch.Tensor, exact: torch.Tensor | None, mask: torch.Tensor) -> Scored:
    """The `Scored` of a forward's tensors: the values (fp32) where `mask` is true, 0 elsewhere
    (selected: 0 x NaN would be NaN); the exact KL (fp32) NaN where it could not be computed."""
    return Scored(logprobs, ref_logprobs, torch.where(mask.bool(), values.float(), 0.0), entropy,
                  exact.float() if exact is not None
                  else torch.full(mask.shape, float("nan"), device=mask.device))


def _entropy(policy: nn.Module, rollout: Rollout, hidden: torch.Tensor, chunked: bool):
    """H(pi(. | s_t)) [B, R] at the sampled tokens from the update's hidden states through the
    LM head, 0 elsewhere; a model whose logits are not head(hidden) gets one more forward
    (tether.models.trunk_head.trunk_and_head)."""
    mask = rollout.action_mask
    try:
        _, head = trunk_and_head(policy)
    except ValueError:
        return scores_of(policy, rollout, chunked, entropy=True).entropy
    picked = head_entropy(hidden.detach()[mask.bool()], head, rollout.temperature)
    return torch.zeros(mask.shape, dtype=picked.dtype, device=picked.device).index_put(
        (mask.bool(),), picked)


class Forwards:
    """The update's forwards: `self(rows)` runs the policy and critic (and, for an exact KL term,
    the reference) on those rows of the rollout, inside the wrapper (`Roles.call`), and returns
    tensors. One forward may be kept (`kept`, by `score_old`): the next call for the same rows
    takes it. `spec`: the update's (`tether.rl.update.UpdateSpec`: its LM-head chunking, packing
    and KL estimator); `kl_beta`: the KL term's coefficient in the loss."""

    def __init__(self, roles: Roles, reference: nn.Module, rollout: Rollout, spec,
                 kl_beta: float):
        self.roles, self.reference, self.rollout, self.spec = roles, reference, rollout, spec
        self.exact = spec.kl.divergence if kl_beta > 0 else None  # a KL term over the vocabulary
        self.kept: tuple[torch.Tensor, Forward] | None = None

    def run(self, rows: torch.Tensor, keep_hidden: bool = False) -> Forward:
        return self.roles.call(update_forward, self.reference, self.rollout.select(rows),
                               self.spec.chunked_lm_head, self.exact, keep_hidden, self.spec.pack)

    def __call__(self, rows: torch.Tensor) -> Forward:
        if self.kept is not None:
            kept_rows, forward = self.kept
            self.kept = None
            if not torch.equal(kept_rows, rows):
                raise RuntimeError("the kept forward is for other rows (a bug: please report it)")
            return forward
        return self.run(rows)


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


def score_old(roles: Roles, reference: nn.Module, rollout: Rollout, spec, forwards: Forwards,
              one_pass: bool) -> tuple[Scored, float | None]:
    """Step 2 of the update: pi_old, the reference and V_old on the batch's sampled tokens
    (`spec`: the update's `tether.rl.update.UpdateSpec`). Two passes: `score_batch`, without
    gradients, before the update's own forwards. One pass (`one_pass`, tether.rl.update): the
    update's forward on the whole batch, kept in `forwards` for its first micro-batch, and pi_old
    read off it (`scored_from_forward`); the time it started is returned too, where the update's
    clock starts (None with two passes)."""
    device = rollout.input_ids.device
    with autocast(spec.mixed_precision, device):
        if not one_pass:
            return score_batch(roles, reference, rollout, spec), None
        ref = score_reference(reference, rollout, spec.chunked_lm_head, spec.pack)
    started = time.perf_counter()  # the update's forward is this batch's scoring pass too
    everything = torch.arange(len(rollout), device=device)
    with update_mode(spec.gradient_checkpointing, roles.policy, roles.critic):
        with autocast(spec.mixed_precision, device):
            forward = forwards.run(everything, keep_hidden=True)
            old = scored_from_forward(roles.policy, reference, rollout, forward, ref,
                                      spec.chunked_lm_head)
    forwards.kept = (everything, forward)
    return old, started


def kl_sums(old: Scored, mask: torch.Tensor) -> dict[str, float]:
    """The batch mean of per-sequence summed KL(pi_old || ref) by each estimator (k1, k2, k3)
    and exactly (over the whole vocabulary at each sampled prefix): their bias and spread side by
    side. `objective/kl_exact` is missing when the exact KL could not be computed. `mask`: the
    tokens the policy sampled."""
    real = mask.bool()
    out = {f"objective/kl_{name}": float(torch.where(real, kl_lib.estimate(
        old.logprobs, old.ref_logprobs, name), 0.0).sum(1).mean()) for name in ("k1", "k2", "k3")}
    exact = torch.where(real, old.exact_kl, 0.0).sum(1).mean()
    if torch.isfinite(exact):
        out["objective/kl_exact"] = float(exact)
    return out


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the tokens of `mask`: 1 is a perfect critic,
    0 one that predicts the mean, negative one that is worse than the mean."""
    mask = mask.bool()
    returns, values = returns[mask].float(), values[mask].float()
    var = returns.var(unbiased=False)
    if var <= 0:
        return float("nan")
    return float(1 - (returns - values).var(unbiased=False) / var)
