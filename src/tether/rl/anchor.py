"""The KL's anchor over a run, and the start it is measured against.

The anchor is what the KL penalty pulls toward: the frozen SFT model by default, `--ref-model`,
a `--teacher` (on-policy distillation), or a reference that moves toward the policy
(`--ref-update`):

    none           frozen (the default)
    reset:N        every N batches the policy is copied into the reference (ProRL, Liu et al.
                   2025); --ref-reset-optimizer also clears the optimizer's state then
    mix:ALPHA,N    every N batches ref <- ALPHA * policy + (1 - ALPHA) * ref (TRL's
                   sync_ref_model, ref_model_mixup_alpha and ref_model_sync_steps; TR-DPO,
                   Gorbatovski et al. 2024)
    ema:ALPHA      that mix after every batch (an exponential moving average of the policy)

With LoRA the moving reference is an adapter of its own on the shared base (`add_anchor_adapter`:
a frozen copy of the trained adapter at the start), reset only: mixing two adapters' factors A
and B is not mixing their product.

When the anchor is not the policy's start (a teacher, or a reference that moves), the start is
kept frozen beside it (with LoRA, the base with the starting adapter: no copy of the weights)
and every batch logs `objective/kl_sft` and `objective/kl_sft_exact`, the KL of pi_old to the
start by k1 and over the vocabulary, beside `objective/kl` to the anchor: how far the run has
really gone from the SFT model, which the KL to a moving anchor does not say. A moving
reference is checkpointed with the run (`state_tensors`), so a resumed run anchors where the
uninterrupted one did.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from tether.choices import RefUpdate
from tether.errors import TetherError
from tether.rl.rollout import Rollout
from tether.rl.scoring import kl_sums, score_batch
from tether.run.checkpoint import placed_like, whole

TENSOR_PREFIX = "anchor/"  # the moving reference's tensors in a checkpoint's tensors file


def mix(ref_params: dict[str, torch.Tensor], params: dict[str, torch.Tensor], alpha: float
        ) -> None:
    """ref <- alpha * policy + (1 - alpha) * ref for each tensor of `ref_params`, in place, in
    TRL's order of operations (`ref.mul_(1 - alpha).add_(policy, alpha=alpha)`); alpha = 1 copies
    exactly. `params`: the policy's tensors under the same names."""
    if ref_params.keys() != params.keys():
        raise ValueError("the reference and the policy have different parameters; a moving "
                         "reference must be a copy of the policy")
    with torch.no_grad():
        for name, ref in ref_params.items():
            if alpha == 1.0:
                ref.copy_(params[name])
            else:
                ref.mul_(1.0 - alpha).add_(params[name], alpha=alpha)


def adapter_params(peft: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """The LoRA weights of one adapter of `peft`, by their names with the adapter's left out (so
    two adapters' weights pair by name)."""
    key = f".{adapter}."
    return {name.replace(key, "."): p for name, p in peft.named_parameters() if key in name}


def add_anchor_adapter(peft: nn.Module, source: str, name: str = "anchor") -> str:
    """A frozen copy of `peft`'s adapter `source` as adapter `name` (a LoRA run's moving
    reference: the base with an adapter of its own, no copy of the base); every other
    parameter's `requires_grad` kept as it was."""
    trainable = {n: p.requires_grad for n, p in peft.named_parameters()}
    peft.add_adapter(name, copy.deepcopy(peft.peft_config[source]))
    for n, p in peft.named_parameters():
        p.requires_grad_(trainable.get(n, False))
    mix(adapter_params(peft, name), adapter_params(peft, source), 1.0)
    return name


class Anchor:
    """The run's anchor, whose tensors move by `update` toward the policy's, and the frozen start
    the metrics compare with (`start`). `tensors()`: (the reference's tensors, the policy's, by
    the same names: the whole models', or two adapters' of a LoRA run; both empty for a teacher,
    which never moves), read when used, since FSDP2 replaces the parameters with its shards after
    the anchor is built (the two are sharded alike, so the mix is the same on every shard)."""

    def __init__(self, tensors: Callable[[], tuple[dict, dict]], start: nn.Module,
                 update: RefUpdate, reset_optimizer: bool = False):
        self.tensors, self.start = tensors, start
        self.update, self.reset_optimizer = update, reset_optimizer

    def kl_to_start(self, roles, rollout: Rollout, spec) -> dict[str, float]:
        """pi_old's KL to the start on this batch's sampled tokens, summed per sequence and
        averaged (k1, and over the vocabulary where it can be computed): call before the update."""
        sums = kl_sums(score_batch(roles, self.start, rollout, spec), rollout.action_mask)
        names = {"objective/kl_k1": "", "objective/kl_exact": "_exact"}  # kl_sft, kl_sft_exact
        return {f"objective/kl_sft{names[k]}": v for k, v in sums.items() if k in names}

    def after_batch(self, batches_done: int, optimizer: torch.optim.Optimizer) -> None:
        """Move the reference if --ref-update says so after `batches_done` batches."""
        alpha = self.update.alpha_after(batches_done)
        if alpha is None:
            return
        mix(*self.tensors(), alpha)
        if self.update.kind == "reset" and self.reset_optimizer:
            optimizer.state.clear()  # AdamW's moments and step counts start again (ProRL)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The moving reference's parameters for a checkpoint ({} when it never moves: a teacher's
        `tensors()` are empty)."""
        return {TENSOR_PREFIX + name: whole(p.detach()).contiguous().cpu()
                for name, p in self.tensors()[0].items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore `state_tensors`' output (taken out of a checkpoint's tensors)."""
        if not self.update.moves:
            return
        params = self.tensors()[0]
        if {TENSOR_PREFIX + name for name in params} != set(tensors):
            raise TetherError("the checkpoint holds no moving reference for this run's "
                              "--ref-update; resume with the --ref-update it was written with")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(placed_like(tensors[TENSOR_PREFIX + name].to(param.dtype), param))
