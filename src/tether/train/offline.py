"""The bookkeeping the offline stages (SFT, RM, DPO) share around their loops: the optimizer and
schedule of a run, restoring it on --resume, checkpointing when due or asked, and the final save.

The loops themselves stay in each stage's file, readable top to bottom.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from tether.models.adapter_checks import check_resumed_base, with_base_record
from tether.models.lora import LoraSpec
from tether.models.pretrained import TrainableLM, load_trainable_lm
from tether.models.saving import save_trained_lm
from tether.run import distributed, interrupt
from tether.run.checkpoint import load_latest_checkpoint, save_checkpoint
from tether.run.config import RunConfig
from tether.run.optim import make_lr_schedule, make_optimizer
from tether.run.rundir import RunDir
from tether.run.slicing import rank_micro_batches, token_parts
from tether.train.offline_config import TrainConfig


def count_steps(n_rows: int, cfg: TrainConfig) -> int:
    """Optimizer steps for the run (derived: max_steps, else epochs * ceil(rows / batch))."""
    return cfg.max_steps if cfg.max_steps > 0 else cfg.epochs * -(-n_rows // cfg.batch_size)


def save_final(run_dir: RunDir, wrapped: nn.Module, d: distributed.Dist, owner: Any,
               rebuild: Callable[[], tuple[Any, nn.Module]], save: Callable[[Any], None]) -> None:
    """Rank 0 writes the final model with `save(owner)` while the other ranks wait; a full disk
    there is one line saying how to complete the run (`RunDir.writing_final`).

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
        with run_dir.writing_final():
            save(owner)
    distributed.barrier(d)


def start_training(run: RunDir, cfg: TrainConfig, model: nn.Module, n_rows: int):
    """Optimizer, LR schedule and (with `cfg.resume`) the restored state of one offline stage.

    `model` may be wrapped (`distributed.wrap`; under FSDP2 the optimizer then holds the shards).
    Returns (total_steps, optimizer, scheduler, state); `state["step"]` is where the loop resumes.
    """
    total_steps = count_steps(n_rows, cfg)
    optimizer = make_optimizer(distributed.unwrap(model), cfg.lr, cfg.weight_decay)
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
        if state is not None:  # adapters' checkpoints hold no base: it must be the same one
            check_resumed_base(state, next(iter(models.values())), run.checkpoint_dir)
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
        save_checkpoint(run.checkpoint_dir, step, models, optimizer, scheduler,
                        with_base_record(state, next(iter(models.values()))),
                        config=run.checkpoint_config)
    if asked:
        raise interrupt.stop(step, str(run.checkpoint_dir))


def save_final_lm(run_dir: RunDir, wrapped: nn.Module, d: distributed.Dist, lm: TrainableLM,
                  tokenizer, cfg: TrainConfig) -> None:
    """The end of an SFT or DPO run: the trained LM (or its LoRA adapter) to `final/`, merged into
    its base too with --merge-lora (`save_final`: rank 0 writes, FSDP2 shards gathered into a
    fresh copy of the starting model); then the run directory is closed."""
    lora = LoraSpec.from_config(cfg)

    def rebuild():  # FSDP2: an unsharded copy for rank 0 to save
        fresh = load_trainable_lm(cfg.model, tokenizer, lora, cfg.dtype, cfg.trust_remote_code)
        return fresh, fresh.model

    save_final(run_dir, wrapped, d, lm, rebuild, lambda owner: save_trained_lm(
        owner, tokenizer, run_dir.final_dir, run_dir.merged_dir if cfg.merge_lora else None))
    run_dir.close()


def step_micro_batches(indices: list[int], lengths: list[int], cfg, d: distributed.Dist
                       ) -> list[tuple[list[int], bool]]:
    """This rank's micro-batches of the step's rows (SFT) or pairs (RM, DPO) `indices`: (rows,
    real). --grad-accum-steps equal parts (`rank_micro_batches`), or with --micro-batch-tokens
    parts of at most that many tokens, by `lengths` (the tokens each of `indices` puts through
    the model): under torchrun the rows dealt to the ranks for even token sums and as many
    micro-batches on every rank, an empty one run as a borrowed row whose loss counts 0
    (`tether.run.slicing.token_parts`; one process: the whole step cut first-fit decreasing).
    Every loss divides by the step's global count, so the cut changes no gradient."""
    if not cfg.micro_batch_tokens:
        return rank_micro_batches(indices, cfg.grad_accum_steps, d)
    mine = token_parts(lengths, cfg.micro_batch_tokens, d)[d.rank]
    return [([indices[j] for j in part], True) if part else ([indices[0]], False)
            for part in mine]


