"""Pieces every offline stage (SFT, RM, DPO) shares: the optimisation config, seeding, optimizer
and learning-rate schedule, response log-probs, and the checkpoint / resume bookkeeping.

`make_optimizer` and `make_lr_schedule` are also meant for PPO. The loops themselves stay in each
stage's file, readable top to bottom.
"""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Any

import numpy as np
import torch
from torch import nn

from tether import interrupt
from tether.checkpoint import load_latest_checkpoint, save_checkpoint
from tether.config import RunConfig
from tether.errors import TetherError
from tether.lm_head import masked_head_token_logprobs
from tether.logprobs import token_logprobs
from tether.optim import lr_factor, make_lr_schedule, make_optimizer  # noqa: F401 - one for all stages
from tether.rundir import RunDir, RunResult
from tether.train.offline_config import TrainConfig  # noqa: F401 - also exported from here
from tether.trunk_head import chunked_split, final_hidden

# ----------------------------------------------------------------------------- optimisation

def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def count_steps(n_rows: int, cfg: TrainConfig) -> int:
    """Optimizer steps for the run (derived: max_steps, else epochs * ceil(rows / batch))."""
    return cfg.max_steps if cfg.max_steps > 0 else cfg.epochs * -(-n_rows // cfg.batch_size)


def micro_batches(rows: list[int], n: int) -> list[list[int]]:
    """`rows` cut into `n` consecutive micro-batches of (near) equal size, empty ones dropped.

    `n` divides `batch_size` (validated), so full batches split evenly; the last batch of an epoch
    may be shorter and then splits into sizes that differ by at most one row. Callers weight each
    micro-batch by its share of the batch's rows or tokens, so uneven sizes are still exact.
    """
    size, extra = divmod(len(rows), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        if end > start:
            out.append(rows[start:end])
        start = end
    return out


def backward(loss: torch.Tensor) -> None:
    """Add d(loss)/d(params) to the gradients; refuses a non-finite loss instead of a silent bad
    update."""
    if not torch.isfinite(loss):
        raise TetherError(f"the loss is {loss.item()}: the step was not taken and nothing was "
                          "saved over the last good checkpoint; lower --lr or check the data, "
                          "then --resume")
    loss.backward()


def optimizer_step(model: nn.Module, optimizer, scheduler, max_grad_norm: float) -> float:
    """Clip the accumulated gradients, step, schedule, then zero the gradients for the next step.

    The gradients are those `backward` summed over the step's micro-batches; returns their norm
    before clipping.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if max_grad_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    if not torch.isfinite(grad_norm):  # a finite loss can still have an overflowing gradient
        optimizer.zero_grad(set_to_none=True)
        raise TetherError(f"the gradient norm is {float(grad_norm)}: the step was not taken and "
                          "nothing was saved over the last good checkpoint; lower --lr or "
                          "--max-grad-norm, then --resume")
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


def enable_gradient_checkpointing(model: nn.Module, context_fn=None) -> nn.Module:
    """Recompute each transformer layer's activations in the backward pass (less memory).

    Works on a plain Hugging Face model, on tether's wrappers (`RewardModel`, `ValueModel`: their
    `backbone`) and on a peft `PeftModel` (its wrapped transformers model): the outermost
    `PreTrainedModel` inside `model` gets transformers' checkpointing, non-reentrant. Non-reentrant
    checkpointing needs no input that requires grad, so a frozen base with LoRA adapters still
    gets its adapter gradients (transformers adds an input-grad hook anyway; it is harmless).
    transformers checkpoints a layer only while the module is in training mode and grad is on.
    `context_fn` goes to `torch.utils.checkpoint` (LoRA roles on one base pass
    `tether.lora.adapter_recompute_context`, so a layer is recomputed under the adapter it ran with).
    """
    from transformers import PreTrainedModel

    trunk = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if trunk is None or not trunk.supports_gradient_checkpointing:
        name = type(trunk if trunk is not None else model).__name__
        raise TetherError(f"{name} does not support gradient checkpointing; drop "
                          "--gradient-checkpointing")
    kwargs = {"use_reentrant": False} | ({"context_fn": context_fn} if context_fn else {})
    if hasattr(trunk, "activation_checkpointing_enable"):  # transformers >= 5.2x: the new name
        trunk.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        trunk.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


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
    run.announce_resume(state["step"] if state else None)
    run.truncate_metrics(after_step=state["step"] if state else -1)
    return state or {"step": 0}


def maybe_checkpoint(run: RunDir, cfg: RunConfig, step: int, total_steps: int,
                     models: dict[str, nn.Module], optimizer, scheduler, state: dict[str, Any]) -> None:
    """Checkpoint every `save_every` steps (not at the last step: the final model follows), and
    after any step when Ctrl-C or SIGTERM asked the run to stop (then raise `Interrupted`)."""
    due = cfg.save_every > 0 and step % cfg.save_every == 0 and step < total_steps
    if due or interrupt.requested():
        save_checkpoint(run.checkpoint_dir, step, models, optimizer, scheduler, state)
    if interrupt.requested():
        raise interrupt.stop(step, str(run.checkpoint_dir))


def print_result(result: RunResult) -> None:
    """One stderr line for the CLI: where the final model is, then the final metrics."""
    print(f"saved {result.output_path}  " + "  ".join(f"{k}={v:.4g}" for k, v in result.metrics.items()),
          file=sys.stderr)
