"""The update's steps on hand-made inputs, as `tether.rl.update` runs them: the loss of some rows
(`loss_on`) and the epochs over a batch (`update_on`), for the tests of the loss, the guard and
the memory knobs."""

from __future__ import annotations

import torch

from tether.rl.update import Forwards, LossBatch, counts_of, ppo_update, update_loss


def loss_on(setup, rollout, old, advantages, returns, kl_beta: float, spec=None):
    """(loss, stats) of one micro-batch holding every row of `rollout`, its forward run inside
    the roles' wrapper and the loss computed from its tensors."""
    spec = spec or setup.spec
    batch = LossBatch.of(rollout, old, advantages, returns, spec.mask_truncated)
    forwards = Forwards(setup.roles, setup.reference, rollout, spec, kl_beta)
    forward = forwards(torch.arange(len(rollout), device=advantages.device))
    return update_loss(forward, batch, spec, kl_beta, counts_of(batch, spec.mask_truncated),
                       setup.critic is not None)


def update_on(setup, rollout, old, advantages, returns, kl_beta: float,
              generator: torch.Generator, spec=None) -> dict[str, float]:
    """`ppo_update`'s stats after its epochs over `rollout` (the optimizer steps taken)."""
    spec = spec or setup.spec
    batch = LossBatch.of(rollout, old, advantages, returns, spec.mask_truncated)
    forwards = Forwards(setup.roles, setup.reference, rollout, spec, kl_beta)
    return ppo_update(setup.roles, setup.optimizer, forwards, batch, spec, kl_beta, generator)
