"""The one optimizer, learning-rate schedule and optimizer step of every stage (SFT, RM, DPO,
PPO), with one failure behaviour.

AdamW with weight decay on matrices only, and a schedule of `warmup` steps of linear warm-up,
(k + 1) / warmup for k = 0 .. warmup - 1, then constant, linear or cosine decay to 0 over the
remaining steps. A PPO "step" of the schedule is one rollout batch.

A NaN or inf loss (checked before its backward) or gradient norm (checked before the step) raises
`NonFiniteStep`: the step is not taken, nothing is saved, and the loop's error line names the
step or batch. The policy's version, what asynchronous generation tags tokens with, is the count
of the optimizer's steps (`StepCounter`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from tether.errors import TetherError
from tether.run import distributed
from tether.run.distributed import Dist, unwrap


class StepCounter:
    """The policy version: how many optimizer steps have been taken (a post-step hook). A step
    with every learning rate 0 changes no weight and is not counted: torch's distributed
    checkpoint takes one to create the optimizer's state when a run resumes."""

    def __init__(self, optimizer: torch.optim.Optimizer | None = None):
        self.version = 0
        if optimizer is not None:
            optimizer.register_step_post_hook(self._stepped)

    def _stepped(self, optimizer: torch.optim.Optimizer, *_args) -> None:
        if any(float(group["lr"]) != 0 for group in optimizer.param_groups):
            self.version += 1


def make_optimizer(models: nn.Module | Sequence[nn.Module], lr: float,
                   weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of `models` (each shared tensor once); decay on
    matrices only (biases and norms are not shrunk, as in GPT-2/nanoGPT)."""
    models = [models] if isinstance(models, nn.Module) else list(models)
    # each shared tensor once, where it first appears (a dict keeps the first key's place)
    unique = {id(p): p for model in models for p in model.parameters() if p.requires_grad}
    params = list(unique.values())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier on the peak lr at `step`: linear warm-up, then constant / linear / cosine to 0."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}")


def make_lr_schedule(optimizer, total_steps: int, warmup_steps: int = 0, schedule: str = "linear"):
    """A LambdaLR following `lr_factor`; its state (the step count) is checkpointed."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warmup_steps, schedule))


def step_schedule(scheduler) -> None:
    """One step of an online run's schedule, which counts batches, not optimizer steps: a batch
    that took no step (every minibatch skipped) still spends its place, so batch n's rate does
    not depend on which batches trained, and the checkpointed count is the batches done (a resume
    is bit-identical). PyTorch warns when a schedule's first step comes before any optimizer
    step, meaning a step-counting schedule; here that warning would be a false alarm, and the
    loop names such a batch itself (`tether.train.ppo_watch.nothing_learned`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` "
                                r"before `optimizer.step\(\)`")
        scheduler.step()


# ----------------------------------------------------------------------------- the step

class NonFiniteStep(TetherError):
    """A NaN or inf loss or gradient norm: the step was not taken. The loop that catches it names
    its step or batch; nothing has been saved over the last good checkpoint."""


def _not_finite(what: str, value: float, fix: str) -> NonFiniteStep:
    return NonFiniteStep(f"the {what} is {value}: the step was not taken and nothing was saved "
                         f"over the last good checkpoint; {fix}, then --resume")


def backward(loss: torch.Tensor, d: Dist | None = None) -> None:
    """Add d(loss)/d(params) to the gradients; a non-finite loss raises `NonFiniteStep` instead of
    a silent bad update. Under torchrun the check is global (every rank stops with the same line,
    none is left waiting in the gradient reduction)."""
    finite = bool(torch.isfinite(loss))
    if d is not None and d.active:
        finite = distributed.all_agree(finite, d)
    if not finite:
        raise _not_finite("loss", loss.item(), "lower --lr or check the data")
    loss.backward()


def clip_and_step(params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                  max_grad_norm: float) -> float:
    """The one optimizer step of every stage: clip the accumulated gradients of `params` to
    `max_grad_norm` (0: no clipping), refuse a non-finite norm (`NonFiniteStep`, the gradients
    dropped), step, and zero the gradients. Returns the norm before clipping.

    The gradients are those `backward` summed over the step's micro-batches. Under DDP they are
    already the global ones on every rank; FSDP2's sharded norm is a DTensor reduced over ranks,
    so the norm is global either way.
    """
    # max_grad_norm 0: no clipping; an infinite bound scales every gradient by exactly 1.
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0
                                               else math.inf)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    if not torch.isfinite(grad_norm):  # a finite loss can still have an overflowing gradient
        optimizer.zero_grad(set_to_none=True)
        raise _not_finite("gradient norm", float(grad_norm), "lower --lr or --max-grad-norm")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


def optimizer_step(model: nn.Module, optimizer, scheduler, max_grad_norm: float) -> float:
    """An offline stage's step: `clip_and_step` on the gradients of `model` (possibly wrapped),
    then one step of the learning-rate schedule. Returns the gradient norm before clipping."""
    params = [p for p in unwrap(model).parameters() if p.grad is not None]
    grad_norm = clip_and_step(params, optimizer, max_grad_norm)
    scheduler.step()
    return grad_norm
