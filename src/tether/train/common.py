"""Pieces every offline stage (SFT, RM, DPO) shares: the optimisation config, seeding, optimizer
and learning-rate schedule, response log-probs, and the checkpoint / resume bookkeeping.

`make_optimizer` and `make_lr_schedule` are also meant for PPO. The loops themselves stay in each
stage's file, readable top to bottom.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from tether.checkpoint import load_latest_checkpoint, save_checkpoint
from tether.config import RunConfig, require_positive
from tether.lm_head import masked_head_token_logprobs
from tether.logprobs import token_logprobs
from tether.rundir import RunDir, RunResult
from tether.trunk_head import chunked_split, final_hidden


@dataclass(kw_only=True)
class TrainConfig(RunConfig):
    """Fields of every offline stage: model, data, batching and optimisation."""

    model: str
    """Causal LM to start from: a local directory or a hub name."""
    data: str
    """Training rows: .jsonl, .json, .parquet, .csv, a save_to_disk directory, or a hub dataset name."""
    split: str = "train"
    """Split to read when `data` is a dataset with splits."""
    max_length: int = 512
    """Maximum tokens per sequence (prompt + response); longer responses are truncated and counted."""
    on_long_prompt: Literal["error", "skip"] = "error"
    """What to do with a prompt that leaves no room for a response: stop with an error, or skip the row (counted)."""
    batch_size: int = 8
    """Rows (SFT) or pairs (RM, DPO) per optimizer step."""
    epochs: int = 1
    """Passes over the data (ignored when max_steps > 0)."""
    max_steps: int = 0
    """Optimizer steps to run; 0 means `epochs` passes over the data."""
    lr: float = 1e-5
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay (applied to matrices only, not to biases or norms)."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to `lr`."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    """Learning-rate decay after warm-up: constant, linear to 0, or cosine to 0."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step: each forward/backward sees batch_size / grad_accum_steps rows (same update, less memory)."""

    def validate(self) -> None:
        super().validate()
        require_positive(self, "max_length", "batch_size", "epochs", "lr")
        require_positive(self, "max_steps", "warmup_steps", "weight_decay", "max_grad_norm",
                         allow_zero=True)


# ----------------------------------------------------------------------------- optimisation

def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over trainable parameters; decay on matrices only (biases and norms are not shrunk,
    as in GPT-2/nanoGPT)."""
    params = [p for p in model.parameters() if p.requires_grad]
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


def count_steps(n_rows: int, cfg: TrainConfig) -> int:
    """Optimizer steps for the run (derived: max_steps, else epochs * ceil(rows / batch))."""
    return cfg.max_steps if cfg.max_steps > 0 else cfg.epochs * -(-n_rows // cfg.batch_size)


def optimizer_step(model: nn.Module, optimizer, scheduler, loss: torch.Tensor,
                   max_grad_norm: float) -> float:
    """Backward, clip, step, schedule. Refuses a non-finite loss instead of a silent bad update."""
    if not torch.isfinite(loss):
        raise FloatingPointError(f"loss is {loss.item()}; lower the learning rate or check the data")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    if max_grad_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    optimizer.step()
    scheduler.step()
    return float(grad_norm)


# ----------------------------------------------------------------------------- log-probs

def response_logprobs(model: nn.Module, batch: dict[str, torch.Tensor], chunked: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each next token of the response and the mask of those tokens.

    Logits at position t predict token t+1, so both outputs are `[N, T-1]`: `logprobs[:, t]` is
    log p(input_ids[:, t+1]) where `mask[:, t]` (= response_mask[:, t+1]) is 1, and 0 elsewhere.
    `chunked`: only the response positions' hidden states go through the LM head, in chunks
    (tether.lm_head; no [N, T, V] logits); else the plain path through the full logits.
    """
    mask = batch["response_mask"][:, 1:]
    tokens = batch["input_ids"][:, 1:]  # [N, T-1]
    split = chunked_split(model, chunked)
    if split is None:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logprobs = token_logprobs(logits[:, :-1], tokens) * mask  # [N, T-1]
    else:
        trunk, head = split
        hidden = final_hidden(trunk, batch["input_ids"], batch["attention_mask"])  # [N, T, d]
        logprobs = masked_head_token_logprobs(hidden[:, :-1], head, tokens, mask)
    return logprobs, mask.to(logprobs.dtype)


def autocast(mixed_precision: str, device: torch.device):
    """`torch.autocast` in bfloat16 when asked, else a no-op context."""
    if mixed_precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


# ----------------------------------------------------------------------------- run bookkeeping

def start_training(run: RunDir, cfg: TrainConfig, model: nn.Module, n_rows: int):
    """Optimizer, LR schedule and (with `cfg.resume`) the restored state of one offline stage.

    Returns (total_steps, optimizer, scheduler, state); `state["step"]` is where the loop resumes.
    """
    total_steps = count_steps(n_rows, cfg)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay)
    scheduler = make_lr_schedule(optimizer, total_steps, cfg.warmup_steps, cfg.lr_schedule)
    state = resume_or_start(run, cfg, {"model": model}, optimizer, scheduler)
    return total_steps, optimizer, scheduler, state


def resume_or_start(run: RunDir, cfg: RunConfig, models: dict[str, nn.Module], optimizer,
                    scheduler) -> dict[str, Any]:
    """Restore the latest checkpoint when `cfg.resume` (returns its state), else `{"step": 0}`.

    Metric lines logged after the checkpoint are dropped: those steps run again.
    """
    state = None
    if cfg.resume:
        state = load_latest_checkpoint(run.checkpoint_dir, models, optimizer, scheduler)
    state = state or {"step": 0}
    run.truncate_metrics(after_step=state["step"])
    return state


def maybe_checkpoint(run: RunDir, cfg: RunConfig, step: int, total_steps: int,
                     models: dict[str, nn.Module], optimizer, scheduler, state: dict[str, Any]) -> None:
    """Checkpoint every `save_every` steps (not at the last step: the final model follows)."""
    if cfg.save_every > 0 and step % cfg.save_every == 0 and step < total_steps:
        save_checkpoint(run.checkpoint_dir, step, models, optimizer, scheduler, state)


def print_result(result: RunResult) -> None:
    """One stderr line for the CLI: where the final model is, then the final metrics."""
    print(f"saved {result.output_path}  " + "  ".join(f"{k}={v:.4g}" for k, v in result.metrics.items()),
          file=sys.stderr)
