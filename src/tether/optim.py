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
