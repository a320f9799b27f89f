"""The update's steps on hand-made inputs, as `tether.rl.update` runs them: the loss of some rows
(`loss_on`) and the epochs over a batch (`update_on`), for the tests of the loss, the guard and
the memory knobs."""

from __future__ import annotations

import torch

from tether.rl.update import Forwards, LossBatch, counts_of, loss_mask, ppo_update, update_loss


def loss_batch(rollout, old, advantages, returns, mask_truncated: bool) -> LossBatch:
    """The `LossBatch` `update_batch` builds of these rows and scores (no engine weights)."""
    return LossBatch(old.logprobs, old.ref_logprobs, old.values, advantages, returns,
                     rollout.action_mask, loss_mask(rollout, mask_truncated), None,
                     rollout.engine_logprobs)


def loss_on(setup, rollout, old, advantages, returns, kl_beta: float, spec=None):
    """(loss, stats) of one micro-batch holding every row of `rollout`, its forward run inside
    the roles' wrapper and the loss computed from its tensors."""
    spec = spec or setup.spec
    batch = loss_batch(rollout, old, advantages, returns, spec.mask_truncated)
    forwards = Forwards(setup.roles, setup.reference, rollout, spec, kl_beta)
    forward = forwards(torch.arange(len(rollout), device=advantages.device))
    return update_loss(forward, batch, spec, kl_beta, counts_of(batch, spec.mask_truncated),
                       setup.critic is not None)


def update_on(setup, rollout, old, advantages, returns, kl_beta: float,
              generator: torch.Generator, spec=None) -> dict[str, float]:
    """`ppo_update`'s stats after its epochs over `rollout` (the optimizer steps taken)."""
    spec = spec or setup.spec
    batch = loss_batch(rollout, old, advantages, returns, spec.mask_truncated)
    forwards = Forwards(setup.roles, setup.reference, rollout, spec, kl_beta)
    return ppo_update(setup.roles, setup.optimizer, forwards, batch, spec, kl_beta, generator)


def prompt_batch(setup, cfg, batch: int, round_: int = 0):
    """The prompt texts of batch `batch` and their ids and mask, left-padded on the device to
    the global batch's width: what the single-turn source samples from (tether.rl.sources)."""
    from tether.rl.rollout import left_pad
    from tether.train.ppo_setup import batch_rows

    rows = batch_rows(setup, cfg, batch, round_)
    ids, mask = left_pad([setup.source.prompt_ids[i] for i in rows], setup.tokenizer.pad_token_id,
                         setup.dist.device)
    return [setup.source.prompts[i] for i in rows], ids, mask
