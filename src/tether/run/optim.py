"""The one optimizer and learning-rate schedule of every stage (SFT, RM, DPO, PPO).

AdamW with weight decay on matrices only, and a schedule of `warmup` steps of linear warm-up,
(k + 1) / warmup for k = 0 .. warmup - 1, then constant, linear or cosine decay to 0 over the
remaining steps. A PPO "step" is one rollout batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from tether.errors import TetherError
from tether.run import distributed
from tether.run.checkpoint import plain_model
from tether.run.distributed import Dist


def make_optimizer(models: nn.Module | Sequence[nn.Module], lr: float,
                   weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of `models` (each shared tensor once); decay on
    matrices only (biases and norms are not shrunk, as in GPT-2/nanoGPT)."""
    models = [models] if isinstance(models, nn.Module) else list(models)
    params, seen = [], set()
    for model in models:
        for p in model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
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
    def factor(step: int) -> float:
        return lr_factor(step, total_steps, warmup_steps, schedule)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def backward(loss: torch.Tensor, d: Dist | None = None) -> None:
    """Add d(loss)/d(params) to the gradients; refuses a non-finite loss instead of a silent bad
    update. Under torchrun the check is global (every rank stops with the same line, none is left
    waiting in the gradient reduction)."""
    finite = bool(torch.isfinite(loss))
    if d is not None and d.active:
        finite = distributed.all_agree(finite, d)
    if not finite:
        raise TetherError(f"the loss is {loss.item()}: the step was not taken and nothing was "
                          "saved over the last good checkpoint; lower --lr or check the data, "
                          "then --resume")
    loss.backward()


def optimizer_step(model: nn.Module, optimizer, scheduler, max_grad_norm: float) -> float:
    """Clip the accumulated gradients, step, schedule, then zero the gradients for the next step.

    The gradients are those `backward` summed over the step's micro-batches; returns their norm
    before clipping. `model` may be wrapped: DDP's gradients are already the global ones on every
    rank, and FSDP2's sharded norm is reduced over ranks by DTensor, so the norm is global.
    """
    params = [p for p in plain_model(model).parameters() if p.grad is not None]
    # max_grad_norm 0: no clipping; an infinite bound scales every gradient by exactly 1.
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0
                                               else math.inf)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    if not torch.isfinite(grad_norm):  # a finite loss can still have an overflowing gradient
        optimizer.zero_grad(set_to_none=True)
        raise TetherError(f"the gradient norm is {float(grad_norm)}: the step was not taken and "
                          "nothing was saved over the last good checkpoint; lower --lr or "
                          "--max-grad-norm, then --resume")
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


