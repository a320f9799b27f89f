"""Reward modelling: a scalar head on an LM trunk, trained with the Bradley-Terry loss.

    L = -mean log sigmoid(r(x, y_c) - r(x, y_r) - m)  +  c * mean((r(x, y_c) + r(x, y_r))^2)

The first term is InstructGPT's pairwise loss (Ouyang et al. 2022, eq. 1) with Llama 2's optional
margin m (Touvron et al. 2023, eq. 2); the second, off by default, is reward centring (Eisenstein
et al. 2023, "Helping or Herding?", sec. 3), which pins the otherwise free offset of the scores
near zero. Accuracy is measured on a held-out split. Optionally the scores are normalised so SFT
samples score mean 0, std 1; the constants are stored with the model and applied by `score`.
Both terms are means over pairs, so with --grad-accum-steps each micro-batch's loss is weighted by
its share of the batch's pairs and the accumulated gradient is the full batch's; so also with
--micro-batch-tokens, which cuts the batch by each pair's tokens instead, and with --pack, whose
forward on packed rows reads each score at the same last real token. Under torchrun
the share is of the global batch (times the world size: DDP / FSDP2 average the ranks'
gradients), and the logged metrics and held-out accuracy come from every rank's scores gathered.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace

import torch

from tether.data.batches import batch_order, collate_pairs, collate_sft, split_holdout, to_device
from tether.data.encoding import encode_preferences, encode_sft
from tether.data.rows import load_rows
from tether.models.base_location import write_json
from tether.models.forward import autocast
from tether.models.limits import check_rows_fit, longest_row, model_positions
from tether.models.prepare import disable_dropout
from tether.models.pretrained import load_tokenizer
from tether.models.reward_model import RewardModel
from tether.models.saving import atomic_dir
from tether.preference import bradley_terry_loss
from tether.run import distributed
from tether.run.config import ENSEMBLE_JSON
from tether.run.optim import backward, optimizer_step
from tether.run.rundir import RunDir, RunResult, run_finished
from tether.run.slicing import gather_outputs
from tether.train import offline
from tether.train.offline_config import RMConfig


def pair_scores(model: RewardModel, batch, packed: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected scores `[B]` each, from one forward pass over the `[2B, T]` batch.
    `packed`: its real tokens run as packed rows without padding (`RewardModel.forward`)."""
    scores = model(batch["input_ids"], batch["attention_mask"], packed=packed)
    half = scores.shape[0] // 2
    return scores[:half], scores[half:]


def rm_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None,
            center_rewards_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, Bradley-Terry part) of `[B]` chosen and rejected scores: both means over pairs."""
    bt_loss = bradley_terry_loss(chosen, rejected, margin)
    center_loss = ((chosen + rejected) ** 2).mean()  # Eisenstein et al. 2023, sec. 3
    return bt_loss + center_rewards_coef * center_loss, bt_loss


@torch.no_grad()
def evaluate(wrapped, examples, pad_id: int, batch_size: int, d: distributed.Dist,
             packed: bool = False) -> dict[str, float]:
    """Pairwise accuracy (ties count half) and mean Bradley-Terry loss on held-out pairs, over
    every rank's share of them (`packed`: the forwards on packed rows)."""
    def score(rows):
        batch = to_device(collate_pairs([examples[k] for k in rows], pad_id), d.device)
        return torch.stack(wrapped(pair_scores, batch, packed), dim=-1)  # [b, 2]: chosen, rejected
    wrapped.eval()
    chosen, rejected = gather_outputs(score, len(examples), batch_size, d, wrapped).unbind(-1)
    wrapped.train()  # called in training only: between steps and after the last
    correct = (chosen > rejected).sum().item() + 0.5 * (chosen == rejected).sum().item()
    return {"eval/accuracy": correct / len(examples),
            "eval/loss": bradley_terry_loss(chosen, rejected).item()}


@torch.no_grad()
def fit_normalization(wrapped, examples, pad_id: int, batch_size: int, d: distributed.Dist
                      ) -> dict[str, float]:
    """Set the model's stored (mean, std) so raw scores of these SFT samples map to mean 0, std 1
    (on every rank, from every rank's share of the samples)."""
    def score(rows):
        batch = to_device(collate_sft([examples[k] for k in rows], pad_id), d.device)
        return wrapped(lambda m, b: m(b["input_ids"], b["attention_mask"]), batch)[:, None]
    wrapped.eval()
    raw = gather_outputs(score, len(examples), batch_size, d, wrapped)[:, 0]  # [N] raw scores
    std = raw.std(unbiased=False).item() if len(raw) > 1 else 1.0
    model = distributed.unwrap(wrapped)
    model.set_normalization(raw.mean().item(), std if std > 0 else 1.0)
    return {"norm/mean": model.norm_mean, "norm/std": model.norm_std}


def _load_data(cfg: RMConfig, tokenizer):
    def encode(source):
        return offline.encode_data(cfg, tokenizer, encode_preferences, source, "pairs",
                                   cfg.margin_column)
    examples, stats = encode(cfg.data)
    held_out = encode(cfg.eval_data)[0] if cfg.eval_data else []
    norm = (encode_sft(tokenizer, load_rows(cfg.normalize_data, cfg.split), cfg.max_length,
                       cfg.on_long_prompt, cfg.normalize_data)[0] if cfg.normalize_data else [])
    positions = [model_positions(cfg.model, cfg.trust_remote_code)]  # the trunk's, any head
    for source, encoded in ((cfg.data, examples), (cfg.eval_data, held_out),
                            (cfg.normalize_data, norm)):
        check_rows_fit(positions, longest_row(encoded), cfg.max_length, source)
    if not cfg.eval_data:
        examples, held_out = split_holdout(examples, cfg.eval_fraction, cfg.seed)
    return examples, held_out, norm, stats


def accumulate_pairs(wrapped, train, indices: list[int], cfg: RMConfig, d: distributed.Dist,
                     pad_id: int) -> list[torch.Tensor]:
    """Forward and backward over this rank's share of the global batch `indices`, in its
    micro-batches; returns the global batch's chosen and rejected scores and margins, `[B]` each
    (pair by pair, in the micro-batches' order), gathered from every rank (the logged loss is the full batch's). With --micro-batch-tokens the
    cut is by each pair's tokens, chosen row plus rejected row (`step_micro_batches`)."""
    # each pair's tokens as two rows, chosen and rejected: 2 P + C + R
    micro = offline.step_micro_batches(indices, offline.example_tokens(train, indices, 2), cfg, d)
    parts = []
    for i, (rows, real) in enumerate(micro):
        batch = to_device(collate_pairs([train[k] for k in rows], pad_id), d.device)
        with distributed.no_sync(wrapped, skip=i < len(micro) - 1):
            with autocast(cfg.mixed_precision, d.device):
                chosen, rejected = wrapped(pair_scores, batch, cfg.pack)  # [b], [b]
            margin = batch["margin"] if cfg.margin_column else None
            part, _ = rm_loss(chosen, rejected, margin, cfg.center_rewards_coef)
            # a mean over this share of the global batch's pairs, whatever the cut
            backward(part * len(rows) / len(indices) * (d.grad_scale if real else 0.0), d)
        if real:
            parts.append(torch.stack([chosen.detach(), rejected.detach(), batch["margin"]], -1))
    local = torch.cat(parts) if parts else torch.zeros((0, 3), device=d.device)
    return list(distributed.all_gather_rows(local, d).unbind(-1))


def run(cfg: RMConfig) -> RunResult:
    """Train a reward model; returns its directory (load with `RewardModel.from_pretrained`)."""
    if cfg.ensemble > 1:
        return run_ensemble(cfg)
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    train, held_out, norm_examples, stats = _load_data(cfg, tokenizer)  # bad input fails here
    lora, run_dir, d = offline.open_run(cfg)

    model = RewardModel.from_causal_lm(cfg.model, tokenizer, cfg.dtype, cfg.trust_remote_code, lora)
    disable_dropout(model).to(d.device).train()  # a score must not depend on a dropout draw
    wrapped = offline.wrap_trained(model, cfg, d)
    steps = offline.start_training(run_dir, cfg, wrapped, len(train))
    pad_id = tokenizer.pad_token_id

    with steps:
        for step in steps:
            indices = batch_order(len(train), cfg.batch_size, cfg.seed, step - 1)  # global batch
            chosen, rejected, margins = accumulate_pairs(wrapped, train, indices, cfg, d, pad_id)
            loss, bt_loss = rm_loss(chosen, rejected, margins if cfg.margin_column else None,
                                    cfg.center_rewards_coef)
            grad_norm = optimizer_step(wrapped, steps.optimizer, steps.scheduler, cfg.max_grad_norm)
            metrics = {"train/loss": loss.item(), "train/bt_loss": bt_loss.item(),
                       "rewards/chosen": chosen.mean().item(),
                       "rewards/rejected": rejected.mean().item(),
                       "rewards/margin": (chosen - rejected).mean().item(),
                       "rewards/accuracy": (chosen > rejected).float().mean().item(),
                       "train/grad_norm": grad_norm, "train/lr": steps.scheduler.get_last_lr()[0]}
            if held_out and cfg.eval_every and step % cfg.eval_every == 0 and step < steps.total:
                metrics |= evaluate(wrapped, held_out, pad_id, cfg.batch_size, d, cfg.pack)
            steps.done(step, metrics)

    final = stats.as_metrics()
    if held_out:
        final |= evaluate(wrapped, held_out, pad_id, cfg.batch_size, d, cfg.pack)
    if norm_examples:
        final |= fit_normalization(wrapped, norm_examples, pad_id, cfg.batch_size, d)
    run_dir.log(steps.total, final)

    def rebuild():  # FSDP2: an unsharded copy for rank 0 to save
        fresh = RewardModel.from_causal_lm(cfg.model, tokenizer, cfg.dtype,
                                           cfg.trust_remote_code, lora)
        fresh.set_normalization(model.norm_mean, model.norm_std)
        return fresh, fresh

    def save(owner: RewardModel) -> None:
        owner.save_pretrained(run_dir.final_dir, tokenizer)  # with LoRA: the adapter and the head
        if cfg.merge_lora:
            owner.save_merged(run_dir.merged_dir, tokenizer)

    offline.save_final(run_dir, wrapped, d, model, rebuild, save)
    return RunResult(run_dir.final_dir, steps.metrics | final)


def run_ensemble(cfg: RMConfig) -> RunResult:
    """`--ensemble K`: member k is the run `tether rm --seed SEED+k` into RUN/member<k>/ (its
    head's start, its batches' order and, without --eval-data, its held-out pairs move with the
    seed; with --resume a finished member is kept), then RUN/final/ holds their final models
    (hard links, no second copy on disk) and the list of them, written at once: the directory
    --reward-model reads as one ensemble (tether.rl.reward.ensemble)."""
    root = RunDir(cfg.output_dir, cfg.run_name, cfg.resume)  # a finished ensemble: as a run
    names = [f"member{k}" for k in range(cfg.ensemble)]
    metrics = {}
    for k, name in enumerate(names):
        if not (cfg.resume and run_finished(root.path / name)):
            member = replace(cfg, ensemble=1, seed=cfg.seed + k, output_dir=str(root.path),
                             run_name=name)
            metrics |= {f"{name}/{key}": value for key, value in run(member).metrics.items()
                        if key.startswith("eval/")}
    if distributed.current().is_main:
        with atomic_dir(root.final_dir) as tmp:
            for name in names:
                shutil.copytree(root.path / name / "final", tmp / name, copy_function=os.link)
            write_json(tmp / ENSEMBLE_JSON, {"members": names}, indent=2)
    return RunResult(root.final_dir, metrics)


def cli(argv: list[str]) -> int:
    return offline.stage_cli(RMConfig, run, argv)
