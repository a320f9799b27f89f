"""The bookkeeping the offline stages (SFT, RM, DPO) share around their loops: the start of a run
(LoRA targets, run directory, ranks, seed), the optimizer and schedule, restoring them on
--resume, the steps with their progress line, logging and checkpoints (`Steps`), the micro-batches
of a step, and the final save.

The loops themselves stay in each stage's file, readable top to bottom.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tether.data.rows import load_rows
from tether.errors import TetherError
from tether.models.adapter_checks import check_resumed_base, with_base_record
from tether.models.lora import LoraSpec, check_targets
from tether.models.prepare import enable_gradient_checkpointing
from tether.models.pretrained import TrainableLM, load_trainable_lm
from tether.models.saving import save_trained_lm
from tether.rl.roles import any_rank
from tether.run import distributed, interrupt
from tether.run.checkpoint import load_latest_checkpoint, save_checkpoint
from tether.run.launch import join, seed_everything
from tether.run.optim import NonFiniteStep, make_lr_schedule, make_optimizer
from tether.run.parse import parse_config
from tether.run.rundir import RunDir, RunResult, announce, print_result, progress
from tether.run.slicing import rank_micro_batches, token_parts
from tether.run.threads import use_threads
from tether.train.offline_config import TrainConfig


def stage_cli(config: type[TrainConfig], run: Callable[[Any], RunResult], argv: list[str]) -> int:
    """`tether <stage> [--config FILE.yaml] [--field value ...]` of every stage here (sft, rm, dpo,
    and the online ppo, rloo, grpo, distill): the stage's config parsed from `argv` (its command is
    `config.STAGE`), the run, and its result printed."""
    print_result(run(parse_config(config, argv, prog=f"tether {config.STAGE}")))
    return 0


def save_final(run_dir: RunDir, wrapped: nn.Module, d: distributed.Dist, owner: Any,
               rebuild: Callable[[], tuple[Any, nn.Module]], save: Callable[[Any], None]) -> None:
    """Rank 0 writes the final model with `save(owner)` while the other ranks wait; a full disk
    there is one line saying how to complete the run (`RunDir.writing_final`). Then the run
    directory is closed.

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
    run_dir.close()


def encode_data(cfg: TrainConfig, tokenizer, encode: Callable, source: str, what: str,
                *options) -> tuple[list, Any]:
    """The rows of `source` (its --split), announced as they are encoded by `encode`
    (tether.data.encoding) at --max-length and --on-long-prompt, `options` after: (examples,
    stats). Read and checked before the run directory is touched: bad input leaves no trace."""
    rows = load_rows(source, cfg.split)
    announce(f"{cfg.STAGE} {cfg.run_name}: encoding {len(rows)} {what} of {source}")
    return encode(tokenizer, rows, cfg.max_length, cfg.on_long_prompt, source, *options)


def open_run(cfg: TrainConfig) -> tuple[LoraSpec, RunDir, distributed.Dist]:
    """The start of an SFT, RM or DPO run once its data is read and checked, before any weights
    load: (the LoRA spec, its targets checked against `cfg.model`'s config; the run directory,
    checked, created once the model is loaded; this rank, its device: checked, writes nothing
    under torchrun), then the seed set."""
    lora = LoraSpec.from_config(cfg)
    check_targets(cfg.model, lora, cfg.trust_remote_code)
    run_dir = RunDir(cfg.output_dir, cfg.run_name, cfg.resume)
    d = join(cfg, cfg.batch_size)
    seed_everything(cfg.seed)
    return lora, run_dir, d


def wrap_trained(model: nn.Module, cfg: TrainConfig, d: distributed.Dist) -> nn.Module:
    """The trained model with torch's threads set for it (--threads), --gradient-checkpointing
    applied, under DDP / FSDP2 under torchrun; called as wrapped(fn, ...)."""
    use_threads(cfg.threads, model, d.device)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return distributed.wrap(model, d)


def start_training(run_dir: RunDir, cfg: TrainConfig, model: nn.Module, n_rows: int,
                   final: dict[str, float] | None = None) -> Steps:
    """The config recorded, then the optimizer and LR schedule of one offline stage and (with
    `cfg.resume`) their state restored from the latest checkpoint: the `Steps` still to run.

    `model` may be wrapped (`distributed.wrap`; under FSDP2 the optimizer then holds the shards).
    Metric lines logged after the checkpoint are dropped: those steps run again. `final`: logged
    with the last step's metrics.
    """
    run_dir.save_config(cfg)
    # derived: --max-steps, else --epochs * ceil(rows / batch)
    total_steps = cfg.max_steps if cfg.max_steps > 0 else cfg.epochs * -(-n_rows // cfg.batch_size)
    optimizer = make_optimizer(distributed.unwrap(model), cfg.lr, cfg.weight_decay)
    scheduler = make_lr_schedule(optimizer, total_steps, cfg.warmup_steps, cfg.lr_schedule)
    state = (load_latest_checkpoint(run_dir.checkpoint_dir, {"model": model}, optimizer, scheduler)
             if cfg.resume else None)
    if state is not None:  # adapters' checkpoints hold no base: it must be the same one
        check_resumed_base(state, model, run_dir.checkpoint_dir)
    run_dir.announce_resume(state["step"] if state else None)
    run_dir.truncate_metrics(after_step=state["step"] if state else -1)
    return Steps(run_dir, cfg, model, optimizer, scheduler, total_steps,
                 state["step"] if state else 0, final or {})


@dataclass
class Steps:
    """The optimizer steps of an offline run still to run, after `start` (0, or the resumed
    checkpoint's) up to `total`, and what happens around each. Used as

        with steps:
            for step in steps:
                ... the step's forward, backward and optimizer step ...
                steps.done(step, metrics)

    so that the progress line shows meanwhile, a stopped run (an error, Ctrl-C) frees its
    directory as an exit would, and a non-finite loss or gradient is one error naming its step.
    `metrics`: the last step's (empty until one has run).
    """

    run_dir: RunDir
    cfg: TrainConfig
    model: nn.Module  # may be wrapped
    optimizer: Any
    scheduler: Any
    total: int
    start: int
    final: dict[str, float]  # logged with the last step's metrics
    metrics: dict[str, float] = field(default_factory=dict)
    step: int = 0  # the step running

    def __iter__(self) -> Iterator[int]:
        for step in range(self.start + 1, self.total + 1):
            self.step = step
            yield step

    def __enter__(self) -> Steps:
        self.bar = progress(self.total, f"{self.cfg.STAGE} {self.cfg.run_name}",
                            initial=self.start)
        return self

    def __exit__(self, kind, exc, traceback) -> None:
        self.bar.close()
        if kind is not None:  # stopped: free the directory, as an exit would
            self.run_dir.release()
        if isinstance(exc, NonFiniteStep):  # nothing of this step was applied or saved
            raise TetherError(f"step {self.step}: {exc}") from None

    def done(self, step: int, metrics: dict[str, float]) -> None:
        """After step `step`'s update: the progress line (with its loss), `metrics` logged every
        `log_every` steps and at the last (with `final`), and a checkpoint every `save_every`
        steps (not at the last step: the final model follows) or after any step when Ctrl-C or
        SIGTERM asked the run to stop (then raise `Interrupted`). Under torchrun every rank
        calls this."""
        self.metrics = metrics
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
        if step % self.cfg.log_every == 0 or step == self.total:
            self.run_dir.log(step, metrics | (self.final if step == self.total else {}))
        due = self.cfg.save_every > 0 and step % self.cfg.save_every == 0 and step < self.total
        # a signal may reach the ranks at different steps: all stop at the same one
        asked = any_rank(interrupt.requested(), distributed.current())
        if due or asked:
            save_checkpoint(self.run_dir.checkpoint_dir, step, {"model": self.model},
                            self.optimizer, self.scheduler,
                            with_base_record({"step": step}, self.model),
                            config=self.run_dir.checkpoint_config)
        if asked:
            raise interrupt.stop(step, str(self.run_dir.checkpoint_dir))


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


def example_tokens(examples, indices: list[int], prompt_rows: int = 1) -> list[int]:
    """The tokens each example of `indices` puts through the model, what a token budget cuts by:
    its prompt `prompt_rows` times plus its responses (an SFT row's one: P + R; a pair in two
    rows, `prompt_rows=2`: 2 P + C + R; in one shared-prompt row: P + C + R)."""
    return [prompt_rows * len(examples[k].prompt) + sum(len(r) for r in examples[k].responses[:2])
            for k in indices]


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


