"""What data parallelism adds to the online loop (`tether.train.ppo`), and nothing else.

Under `torchrun --nproc-per-node W` every rank runs the same loop. The model work is split; the
arithmetic between model calls is not:

    prompts of batch b         every rank builds the whole global batch (a pure function of seed, b)
    sample                     rank r samples its contiguous rows (`slicing.rank_slice`), with
                               the rows' own noise (`rollout.sampling_uniforms`): invariant to W
    reward                     rank r scores the rows it sampled
    gather                     every rank gets the whole rollout and its scores (`gather_rollout`)
    score (old, ref, values)   rank r scores the rows it will update in epoch 0, in that epoch's
                               micro-batches (`scoring.micro_batches_of`), then every rank gets
                               all of them back in global order
    shaping, advantages,       computed on the global batch by every rank alike, so score
    KL controller, metrics     normalisation, whitening, reinforce++, group statistics, beta and
                               every logged number are the one-process ones, and the same bit for
                               bit on every rank (`check_same_beta` makes sure)
    update                     each minibatch is a slice of the global (shuffled) order; rank r
                               takes its share; losses are divided by the minibatch's global counts
                               and scaled by W (the wrapper averages gradients); stats are summed
                               over ranks, so --target-kl stops every rank at once

The roles are one `nn.ModuleDict` under one DDP/FSDP2 wrapper: one reduction covers policy and
critic, and under FSDP2 a separate frozen reference or reward model is sharded like them (DDP
replicates it and reduces nothing for it); frozen roles on the LoRA shared base (reference, reward
adapter) live in the policy's modules. Every model call goes through `Roles` (inside the
wrapper's forward for gradients, and always under FSDP2). The gathered rollout is small
([B, P + R] ids and a few [B, R] floats) next to the model's gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from tether.errors import TetherError
from tether.rl.reward import FailedRows
from tether.rl.rollout import Rollout, episode_numbers, padded_to
from tether.run import distributed
from tether.run.distributed import Dist


class Roles:
    """The models of the loop under one DDP/FSDP2 wrapper: `call(fn, *args)` runs `fn(policy,
    critic, *args)` inside the wrapper's forward (gradients reduce; FSDP2 gathers the shards);
    `peek` does the same without gradients, on the plain modules where every rank holds them whole
    (one process, DDP: a DDP forward would also broadcast buffers) and inside the wrapper under
    FSDP2, where every rank must make the same calls.

    `frozen` (a separate reference or reward model) join the wrapper too: DDP leaves parameters
    without gradients alone, and FSDP2 shards them like the policy, so they must be called inside
    `call`, `peek` or `generate`, as every model call of the loop is."""

    def __init__(self, policy: nn.Module, critic: nn.Module | None, d: Dist,
                 frozen: dict[str, nn.Module] | None = None):
        self.policy, self.critic, self.dist = policy, critic, d
        modules = {"policy": policy} | ({"critic": critic} if critic is not None else {})
        self.wrapped = distributed.wrap(nn.ModuleDict(modules | (frozen or {})), d)

    def call(self, fn: Callable, *args) -> Any:
        return self.wrapped(lambda _inner, *a: fn(self.policy, self.critic, *a), *args)

    @torch.no_grad()
    def peek(self, fn: Callable, *args) -> Any:
        if self.dist.fsdp:
            return self.call(fn, *args)
        return fn(self.policy, self.critic, *args)

    @torch.no_grad()
    def generate(self, fn: Callable, *args) -> Any:
        """`peek` for token-by-token generation. Under FSDP2 each layer's parameters are gathered
        at its first forward and kept until the call ends (then sharded again): one all-gather of
        the model per rollout instead of one per generated token, at the price of the whole
        model's parameters on every rank while it generates."""
        if not self.dist.fsdp:
            return fn(self.policy, self.critic, *args)
        from torch.distributed.fsdp import FSDPModule

        root = self.wrapped
        units = [m for m in root.modules() if isinstance(m, FSDPModule)]
        root.set_reshard_after_forward(False, recurse=True)
        try:
            return self.call(fn, *args)
        finally:
            for unit in units:
                unit.reshard()
            root.set_reshard_after_forward(True, recurse=True)
            root.set_reshard_after_forward(False, recurse=False)  # the root's default

    def run_policy(self, fn: Callable[[nn.Module], Any]) -> Any:
        """`fn(policy)` for sampling (`generate`): how the native engine reaches the policy."""
        return self.generate(lambda policy, _critic: fn(policy))

    def scorer(self, reward: Callable) -> Callable:
        """`reward(*args)` called inside the wrapper without gradients (`peek`): a reward model is
        sharded with the roles under FSDP2, and every rank must call it alike."""
        return lambda *args: self.peek(lambda _policy, _critic: reward(*args))

    def full_policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's full (unsharded) state dict on rank 0, keys as in `policy.state_dict()`
        (every rank must call this under FSDP2: it gathers the shards)."""
        full = distributed.full_state_dict(self.wrapped, self.dist)
        return {k[len("policy."):]: v for k, v in full.items() if k.startswith("policy.")}


def gather_rollout(rollout: Rollout, d: Dist, pad_token_id: int) -> Rollout:
    """Every rank's rows of the rollout, in rank order (the global batch), each rank's padded
    first to the widest context and response of any rank (`padded_to`). An episode's rows keep
    their episode, numbered after the previous ranks' episodes."""
    if not d.active:
        return rollout
    context = distributed.global_max(rollout.context_length, d)
    width = distributed.global_max(rollout.responses.shape[1], d)
    rollout = padded_to(rollout, context, width, pad_token_id)
    numbered = distributed.global_max(int(rollout.episode is not None), d)
    if numbered:  # episodes everywhere, renumbered below
        rollout = replace(rollout, episode=rollout.episode_ids())
    gathered = rollout.map_rows(lambda t: distributed.all_gather_rows(t, d))
    if not numbered:
        return gathered
    counts = distributed.all_gather_rows(torch.tensor([len(rollout)]), d).tolist()
    blocks = torch.split(gathered.episode, counts)
    return replace(gathered, episode=torch.cat(episode_numbers(blocks)))


def gather_failed(failed: FailedRows | None, offset: int, d: Dist) -> FailedRows | None:
    """Every rank's rows the reward pool could not score (tether.rl.reward.pool), in rank order,
    as the global batch's (`offset`: this rank's first row in it); the causes travel only when
    some row failed (every rank agrees on that, from the gathered mask)."""
    if failed is None:
        return None
    mask = distributed.all_gather_rows(failed.failed, d)
    causes = dict(distributed.all_gather_objects(
        [(row + offset, why) for row, why in failed.causes.items()], d)) if mask.any() else {}
    return FailedRows(mask, distributed.all_gather_rows(failed.retries, d), causes)


def sum_stats(stats: dict[str, float], d: Dist) -> dict[str, float]:
    """Each stat summed over ranks (one all-reduce; keys in the same order on every rank)."""
    if not d.active:
        return stats
    keys = sorted(stats)
    total = distributed.all_reduce_sum(torch.tensor([stats[k] for k in keys], dtype=torch.float64),
                                       d)
    return {k: float(v) for k, v in zip(keys, total.tolist(), strict=True)}


def check_same_beta(beta: float, d: Dist) -> None:
    """Every rank must hold rank 0's beta bit for bit (it is computed from gathered tensors by the
    same code); a difference means the ranks have drifted apart, and the run stops."""
    if d.active and distributed.broadcast_object(beta, d) != beta:
        raise TetherError(f"rank {d.rank}: beta {beta!r} differs from rank 0's; the ranks have "
                          "drifted apart (a bug: please report it)")


def any_rank(flag: bool, d: Dist) -> bool:
    """True on every rank when `flag` is true on some rank (Ctrl-C or SIGTERM seen by one)."""
    return not distributed.all_agree(not flag, d)
