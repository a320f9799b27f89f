"""DPO and IPO: preference optimisation with the KL to a frozen reference left implicit.

With per-sequence summed log-probs and h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r)):

    sigmoid (DPO, Rafailov et al. 2023, eq. 7):  L = -log sigmoid(beta * h)   (label smoothing: cDPO)
    ipo (Azar et al. 2023, eq. 17):               L = (h - 1 / (2 beta))^2 on per-token averages

The formulas live in `tether.losses.dpo_loss`; this file is the loop. Chosen and rejected go
through the policy in one forward pass: by default one row per pair, [prompt | chosen | rejected]
with an attention mask that keeps the two responses apart (`tether.train.prefix`); with
`--no-share-prompt`, the concatenated [2B, P+R] batch (`collate_pairs`). With
`--precompute-ref-logprobs` the reference is scored once before training and then dropped, so
only one model is in memory while training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from tether.config import parse_config, require_positive
from tether.data import batch_order, collate_pairs, encode_preferences, load_rows
from tether.errors import TetherError
from tether.losses import dpo_loss
from tether.models import (
    disable_dropout,
    frozen_copy,
    load_causal_lm,
    load_tokenizer,
    resolve_device,
    save_model,
)
from tether.rundir import RunDir, RunResult, progress
from tether.train.common import (
    TrainConfig,
    autocast,
    maybe_checkpoint,
    optimizer_step,
    print_result,
    response_logprobs,
    seed_everything,
    start_training,
    to_device,
)
from tether.train.prefix import can_share, collate_shared, shared_pair_logprobs


@dataclass(kw_only=True)
class DPOConfig(TrainConfig):
    """DPO / IPO on {prompt, chosen, rejected} rows (start from the SFT model)."""

    lr: float = 5e-7
    """Peak learning rate (AdamW); DPO wants a small one (Rafailov et al. 2023 use 5e-7)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO's logistic loss; ipo: IPO's squared loss on per-token log-ratio averages."""
    beta: float = 0.1
    """Strength of the implicit KL leash (DPO beta, IPO tau); larger stays closer to the reference."""
    label_smoothing: float = 0.0
    """Assumed probability that a preference label is flipped, in [0, 0.5) (conservative DPO; sigmoid only)."""
    ref_model: str = ""
    """Reference model; empty: the starting `model` itself."""
    precompute_ref_logprobs: bool = False
    """Score the reference once before training and drop it (one model in memory, no ref forward per step)."""
    share_prompt: bool = True
    """One row per pair, [prompt | chosen | rejected], masked so the responses never see each other (same log-probs, fewer tokens)."""

    def validate(self) -> None:
        super().validate()
        require_positive(self, "beta")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise TetherError(f"config field 'label_smoothing' must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing > 0 and self.loss == "ipo":
            raise TetherError("config field 'label_smoothing' applies to loss=sigmoid only; set it to 0 for ipo")


def collate(model, examples, pad_id: int, share_prompt: bool) -> dict[str, torch.Tensor]:
    """A prompt-shared batch when asked and possible, else the concatenated [2B, T] batch."""
    if share_prompt and can_share(model, examples):
        return collate_shared(examples, pad_id)
    return collate_pairs(examples, pad_id)


def pair_logprobs(model, batch, chunked: bool = True) -> tuple[torch.Tensor, ...]:
    """Summed response log-probs and lengths: (chosen, rejected, chosen_len, rejected_len), `[B]` each.
    `chunked`: through the LM head in chunks (tether.lm_head), never the full logits."""
    if "segment" in batch:
        return shared_pair_logprobs(model, batch, chunked)
    logprobs, mask = response_logprobs(model, batch, chunked)  # [2B, T-1]: chosen rows, then rejected rows
    summed, lengths = (logprobs * mask).sum(-1), mask.sum(-1)  # [2B]
    half = summed.shape[0] // 2
    return summed[:half], summed[half:], lengths[:half], lengths[half:]


@torch.no_grad()
def precompute_ref_logprobs(ref_model, examples, pad_id: int, cfg: DPOConfig, device) -> torch.Tensor:
    """Reference log-probs of every pair, `[N, 2]` (chosen, rejected), in one eval pass."""
    was_training = ref_model.training
    ref_model.eval()
    out = []
    for start in range(0, len(examples), cfg.batch_size):
        batch = to_device(collate(ref_model, examples[start:start + cfg.batch_size], pad_id, cfg.share_prompt), device)
        with autocast(cfg.mixed_precision, device):
            chosen, rejected, _, _ = pair_logprobs(ref_model, batch, cfg.chunked_lm_head)
        out.append(torch.stack([chosen, rejected], dim=-1).float().cpu())
    ref_model.train(was_training)
    return torch.cat(out)


def _reference(cfg: DPOConfig, policy, tokenizer, examples, device):
    """(frozen reference model, None) or (None, precomputed [N, 2] log-probs)."""
    if cfg.ref_model:
        ref = load_causal_lm(cfg.ref_model, tokenizer, cfg.dtype, cfg.trust_remote_code)
        disable_dropout(ref).to(device).eval().requires_grad_(False)  # fresh load: no copy needed
    else:
        ref = policy if cfg.precompute_ref_logprobs else frozen_copy(policy)
    if not cfg.precompute_ref_logprobs:
        return ref, None
    # Before any update (and before a resumed checkpoint is loaded) the policy *is* the reference.
    table = precompute_ref_logprobs(ref, examples, tokenizer.pad_token_id, cfg, device)
    return None, table


def dpo_metrics(losses, chosen_rewards, rejected_rewards, beta: float) -> dict[str, float]:
    """Per-step statistics; rewards are beta * log(pi / ref) of each response."""
    margins = chosen_rewards - rejected_rewards
    # log(pi/ref) averaged over both responses: a KL-like drift measure on the preference data
    # (not on policy samples, so it can be negative).
    implicit_kl = ((chosen_rewards + rejected_rewards) / (2 * beta)).mean()
    return {"train/loss": losses.mean().item(),
            "rewards/chosen": chosen_rewards.mean().item(),
            "rewards/rejected": rejected_rewards.mean().item(),
            "rewards/margins": margins.mean().item(),
            "rewards/accuracies": (margins > 0).float().mean().item(),
            "objective/implicit_kl": implicit_kl.item()}


def run(cfg: DPOConfig) -> RunResult:
    """Train `cfg.model` with DPO or IPO; returns the final model's path and last metrics."""
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    rows = load_rows(cfg.data, cfg.split)
    examples, stats = encode_preferences(tokenizer, rows, cfg.max_length, cfg.on_long_prompt, cfg.data)
    run_dir = RunDir(cfg.output_dir, cfg.run_name, cfg.resume)
    run_dir.save_config(cfg)

    seed_everything(cfg.seed)
    device = resolve_device(cfg.device)
    policy = load_causal_lm(cfg.model, tokenizer, cfg.dtype, cfg.trust_remote_code)
    disable_dropout(policy).to(device).train()  # DPO compares log-probs of fixed sequences
    reference, ref_table = _reference(cfg, policy, tokenizer, examples, device)
    total_steps, optimizer, scheduler, state = start_training(run_dir, cfg, policy,
                                                              len(examples))
    data_stats = stats.as_metrics()

    metrics: dict[str, float] = {}
    bar = progress(total_steps, f"dpo {cfg.run_name}", initial=state["step"])
    for step in range(state["step"] + 1, total_steps + 1):
        indices = batch_order(len(examples), cfg.batch_size, cfg.seed, step - 1)
        pairs = [examples[i] for i in indices]
        batch = to_device(collate(policy, pairs, tokenizer.pad_token_id, cfg.share_prompt), device)
        with autocast(cfg.mixed_precision, device):
            policy_chosen, policy_rejected, chosen_len, rejected_len = pair_logprobs(policy, batch, cfg.chunked_lm_head)  # [B] each
            if ref_table is not None:
                ref_chosen, ref_rejected = ref_table[indices].to(device).unbind(-1)
            else:
                with torch.no_grad():
                    ref_chosen, ref_rejected, _, _ = pair_logprobs(reference, batch, cfg.chunked_lm_head)
        ipo = cfg.loss == "ipo"  # IPO compares per-token averages (Azar et al. 2023)
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=cfg.beta,
            loss_type=cfg.loss, label_smoothing=cfg.label_smoothing,
            chosen_lengths=chosen_len if ipo else None, rejected_lengths=rejected_len if ipo else None)
        grad_norm = optimizer_step(policy, optimizer, scheduler, losses.mean(), cfg.max_grad_norm)
        bar.update(1)
        metrics = dpo_metrics(losses, chosen_rewards, rejected_rewards, cfg.beta)
        metrics |= {"logps/chosen": policy_chosen.mean().item(), "logps/rejected": policy_rejected.mean().item(),
                    "train/grad_norm": grad_norm, "train/lr": scheduler.get_last_lr()[0]}
        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
        if step % cfg.log_every == 0 or step == total_steps:
            run_dir.log(step, metrics | (data_stats if step == total_steps else {}))
        maybe_checkpoint(run_dir, cfg, step, total_steps, {"model": policy}, optimizer, scheduler,
                         {"step": step})
    bar.close()
    save_model(policy, tokenizer, run_dir.final_dir)
    run_dir.close()
    return RunResult(run_dir.final_dir, metrics | data_stats)


def cli(argv: list[str]) -> int:
    cfg = parse_config(DPOConfig, argv, prog="tether dpo")
    print_result(run(cfg))
    return 0
