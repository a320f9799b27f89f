"""Pieces every offline stage (SFT, RM, DPO) shares: the optimisation config, seeding, optimizer
and learning-rate schedule, response log-probs, data parallelism (joining the ranks, each rank's
micro-batches), and the checkpoint / resume / final-save bookkeeping.

`make_optimizer`, `make_lr_schedule`, `join`, `wrap_frozen`, `rank_chunks` and `save_final` are
also meant for PPO. The loops themselves stay in each stage's file, readable top to bottom.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from tether import distributed, interrupt
from tether.checkpoint import load_latest_checkpoint, plain_model, reshard, save_checkpoint
from tether.config import RunConfig
from tether.errors import TetherError
from tether.lm_head import masked_head_token_logprobs
from tether.logprobs import token_logprobs
from tether.models import resolve_device
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


def backward(loss: torch.Tensor, d: distributed.Dist | None = None) -> None:
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


# ----------------------------------------------------------------------------- data parallelism

TIMEOUT_ENV = "TETHER_DIST_TIMEOUT_S"  # seconds a rank waits for the others (default 600)


def join(cfg: RunConfig, global_batch: int) -> distributed.Dist:
    """Resolve `cfg.device` and join torchrun's ranks (one process: the plain `Dist`).

    Checked before anything is written, identically on every rank: the world size divides the
    global batch (`--batch-size` keeps its one-process meaning, each rank takes its slice), and a
    rank that cannot reach the others gives up after `TETHER_DIST_TIMEOUT_S` seconds.
    """
    device = resolve_device(cfg.device)
    world = int(os.environ["WORLD_SIZE"]) if distributed.launched() else 1
    if global_batch % world:
        raise TetherError(f"--batch-size {global_batch} is the global batch and must be divisible "
                          f"by the {world} ranks (each rank takes an equal slice); use a multiple "
                          f"of {world} or another --nproc-per-node")
    timeout = os.environ.get(TIMEOUT_ENV, str(distributed.TIMEOUT_S))
    if not timeout.isdigit() or int(timeout) < 1:
        raise TetherError(f"{TIMEOUT_ENV}={timeout!r} must be a whole number of seconds >= 1")
    with _stderr_kept_on_success():
        return distributed.setup(device, cfg.fsdp, timeout_s=int(timeout))


@contextlib.contextmanager
def _stderr_kept_on_success():
    """Hold back what C++ code writes to stderr (fd 2) inside the block: replayed if the block
    succeeds, dropped if it raises. c10d logs every retry of an unreachable store with a C++
    stack trace (dozens of lines); `distributed.setup` turns the failure into one line."""
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            os.close(saved)
            raise
        os.dup2(saved, 2)
        os.close(saved)
        held.seek(0)
        os.write(2, held.read())


def rank_micro_batches(indices: list[int], n_micro: int, d: distributed.Dist
                       ) -> list[tuple[list[int], bool]]:
    """This rank's slice of the global batch `indices`, cut into micro-batches: (rows, real).

    One process: `micro_batches` of the whole batch, all real. Under torchrun every rank gets
    exactly `n_micro` entries, because every rank must call the wrapped model equally often (DDP
    syncs buffers and FSDP2 gathers parameters in each call); an entry with no rows of its own (a
    short last batch) borrows the batch's first row and is marked not real: its loss is scaled
    by 0 and its outputs are dropped.
    """
    mine = distributed.shard(indices, d)
    if not d.active:
        return [(rows, True) for rows in micro_batches(mine, n_micro)]
    size, extra = divmod(len(mine), n_micro)
    out, start = [], 0
    for i in range(n_micro):
        end = start + size + (1 if i < extra else 0)
        out.append((mine[start:end], True) if end > start else ([indices[0]], False))
        start = end
    return out


def rank_chunks(n: int, chunk_size: int, d: distributed.Dist) -> list[tuple[list[int], bool]]:
    """This rank's slice of `n` rows (evaluation, scoring) in chunks of `chunk_size`: (rows, real).

    Every rank gets the same number of chunks (padded with a not-real chunk of row 0), so the
    wrapped model is called equally often on every rank; gather the real outputs with
    `distributed.all_gather_rows` to get all `n` in order. One process: `range(0, n, chunk_size)`.
    """
    mine = list(range(n))[distributed.rank_slice(n, d)]
    most = -(-n // d.world_size)  # the largest slice
    count = -(-most // chunk_size)
    chunks = [mine[i * chunk_size:(i + 1) * chunk_size] for i in range(count)]
    return [(rows, True) if rows else ([0], False) for rows in chunks]


@torch.no_grad()
def gather_outputs(fn: Callable[[list[int]], torch.Tensor], n: int, chunk_size: int,
                   d: distributed.Dist, wrapped: nn.Module | None = None) -> torch.Tensor:
    """`fn(rows)` (`[len(rows), k]`, e.g. scores or log-probs of a batch of those rows) for all `n`
    rows, in order, on every rank: each rank runs its slice (`rank_chunks`), then the slices are
    gathered. Every rank calls `fn` equally often, as wrapped models need. Pass `wrapped` (the
    model `fn` calls) to leave it resharded afterwards (FSDP2 keeps the root gathered after a
    no-grad forward; see `checkpoint.reshard`)."""
    outs, out = [], None
    for rows, real in rank_chunks(n, chunk_size, d):
        out = fn(rows)
        if real:
            outs.append(out)
    local = torch.cat(outs) if outs else torch.zeros((0, out.shape[-1]), device=out.device)
    if wrapped is not None:
        reshard(wrapped)
    return distributed.all_gather_rows(local, d)


def wrap_frozen(model: nn.Module, d: distributed.Dist) -> nn.Module:
    """A model that is only scored with (a reference, a reward model) in the form the loops call
    it, `wrapped(fn, *args)`: sharded under FSDP2 like the trained one (it would not fit either),
    plain otherwise (DDP has nothing to reduce for it and refuses a model without gradients)."""
    return distributed.wrap(model, d) if d.fsdp else distributed.Parallel(model)


def save_final(wrapped: nn.Module, d: distributed.Dist, owner: Any,
               rebuild: Callable[[], tuple[Any, nn.Module]], save: Callable[[Any], None]) -> None:
    """Rank 0 writes the final model with `save(owner)` while the other ranks wait.

    Under FSDP2 the trained model is sharded, so every rank gathers its full state dict and rank
    0 loads it into `rebuild()` = (a fresh unsharded owner, its module) before saving (one more
    copy of the model in rank 0's CPU memory, once, at the end).
    """
    if d.fsdp:
        state = distributed.full_state_dict(wrapped, d)  # every rank: a collective
        if d.is_main:
            owner, module = rebuild()
            module.load_state_dict(state)
    if d.is_main:
        save(owner)
    distributed.barrier(d)


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

    `model` may be wrapped (`distributed.wrap`; under FSDP2 the optimizer then holds the shards).
    Returns (total_steps, optimizer, scheduler, state); `state["step"]` is where the loop resumes.
    """
    total_steps = count_steps(n_rows, cfg)
    optimizer = make_optimizer(plain_model(model), cfg.lr, cfg.weight_decay)
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
    after any step when Ctrl-C or SIGTERM asked the run to stop (then raise `Interrupted`).
    Under torchrun every rank calls this; `models` may be wrapped."""
    due = cfg.save_every > 0 and step % cfg.save_every == 0 and step < total_steps
    asked = interrupt.requested()
    d = distributed.current()
    if d.active:  # a signal may reach the ranks at different steps: all stop at the same one
        asked = not distributed.all_agree(not asked, d)
    if due or asked:
        save_checkpoint(run.checkpoint_dir, step, models, optimizer, scheduler, state)
    if asked:
        raise interrupt.stop(step, str(run.checkpoint_dir))


def print_result(result: RunResult) -> None:
    """One stderr line for the CLI: where the final model is, then the final metrics (rank 0)."""
    if not distributed.current().is_main:
        return
    print(f"saved {result.output_path}  " + "  ".join(f"{k}={v:.4g}" for k, v in result.metrics.items()),
          file=sys.stderr)
