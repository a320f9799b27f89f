"""DPO and IPO: preference optimisation with the KL to a frozen reference left implicit.

With per-sequence summed log-probs and h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r)):

    sigmoid (DPO, Rafailov et al. 2023, eq. 7):  L = -log sigmoid(beta * h)   (label smoothing: cDPO)
    ipo (Azar et al. 2023, eq. 17):               L = (h - 1 / (2 beta))^2 on per-token averages

The formulas live in `tether.preference.dpo_loss`; this file is the loop. Chosen and rejected go
through the policy in one forward pass: by default one row per pair, [prompt | chosen | rejected]
with an attention mask that keeps the two responses apart (`tether.models.pair_row`); with
`--no-share-prompt`, the concatenated [2B, P+R] batch (`collate_pairs`). With
`--precompute-ref-logprobs` the reference is scored once before training and then dropped, so
only one model is in memory while training. DPO and IPO losses are means over pairs, so with
--grad-accum-steps, or --micro-batch-tokens (pairs cut by their tokens), each micro-batch
contributes its pairs' loss sum divided by the batch's pairs. --pack runs the two-row layout's
forwards (policy and reference) on packed rows, the same log-probs; the shared-prompt row is not
packed (docs/dpo.md says why).
Under torchrun each rank takes its slice of the global batch (its loss divided by the global pair
count, times the world size: DDP / FSDP2 average the gradients), and the metrics come from every
rank's log-probs gathered. Every model call goes through a wrapper (`wrapped(fn, batch)`), also
the reference's: with LoRA it is the policy's own model with the adapter off.
"""

from __future__ import annotations

from functools import partial

import torch

from tether.data.batches import batch_order, collate_pairs, to_device
from tether.data.encoding import encode_preferences
from tether.models.forward import autocast
from tether.models.limits import check_rows_fit, language_model, longest_row
from tether.models.pair_row import can_share, collate_shared, shared_pair_logprobs
from tether.models.prepare import disable_dropout
from tether.models.pretrained import (
    TrainableLM,
    load_tokenizer,
    load_trainable_lm,
)
from tether.models.reference import check_reference, reference_model
from tether.models.trunk_head import response_logprobs
from tether.preference import dpo_loss
from tether.run import distributed
from tether.run.distributed import wrap_frozen
from tether.run.optim import backward, optimizer_step
from tether.run.rundir import RunResult
from tether.run.slicing import gather_outputs
from tether.train import offline
from tether.train.offline_config import DPOConfig


def collate(model, examples, pad_id: int, share_prompt: bool) -> dict[str, torch.Tensor]:
    """A prompt-shared batch when asked and possible, else the concatenated [2B, T] batch."""
    if share_prompt and can_share(model, examples):
        return collate_shared(examples, pad_id)
    return collate_pairs(examples, pad_id)


def pair_logprobs(model, batch, chunked: bool = True, packed: bool = False
                  ) -> tuple[torch.Tensor, ...]:
    """Summed response log-probs and lengths: (chosen, rejected, chosen_len, rejected_len), `[B]` each.
    `chunked`: through the LM head in chunks (tether.lm_head), never the full logits. `packed`:
    the two-row layout's real tokens run as packed rows without padding (tether.models.packed;
    the shared-prompt row is never packed: DPOConfig refuses --pack with it)."""
    if "segment" in batch:
        return shared_pair_logprobs(model, batch, chunked)
    # [2B, T-1]: chosen rows, then rejected rows
    logprobs, mask = response_logprobs(model, batch, chunked, packed)
    summed, lengths = (logprobs * mask).sum(-1), mask.sum(-1)  # [2B]
    half = summed.shape[0] // 2
    return summed[:half], summed[half:], lengths[:half], lengths[half:]


def _reference(cfg: DPOConfig, lm: TrainableLM, tokenizer, d: distributed.Dist):
    """(the model that decides the batch layout, a function of the policy wrapper giving
    `ref_fn(batch)`, the reference's `pair_logprobs`). Built before the policy is wrapped: the
    full-weight copy must be taken of the plain model."""
    logps = partial(pair_logprobs, chunked=cfg.chunked_lm_head, packed=cfg.pack)  # (model, batch)
    if cfg.precompute_ref_logprobs and not cfg.ref_model and lm.peft is None:
        # Before any update (and before a resumed checkpoint is loaded) the policy *is* the
        # reference: scored once through its own wrapper, no copy made.
        return lm.model, lambda wrapped: partial(wrapped, logps)
    reference = reference_model(lm, cfg.ref_model, tokenizer, cfg.dtype, cfg.trust_remote_code)
    if lm.peft is not None and not cfg.ref_model:
        # LoRA: a view of the policy's own model, so it is called through the policy's wrapper.
        return reference, lambda wrapped: partial(wrapped, lambda _model, b: logps(reference, b))
    ref_wrapped = wrap_frozen(reference.to(d.device), d)
    return reference, lambda _wrapped: partial(ref_wrapped, logps)


def reference_logps(ref_fn, layout_model, examples, pad_id: int, cfg: DPOConfig,
                    d: distributed.Dist, wrapped):
    """`ref_logps(rows, batch)`: the reference's (chosen, rejected) log-probs of a micro-batch,
    `[b]` each, by `ref_fn(batch)` (`_reference`: the reference's `pair_logprobs`) at every step.

    With --precompute-ref-logprobs they are looked up instead in a table scored here, once
    (before a resumed checkpoint is loaded: the start's log-probs), so that the caller can drop a
    separate reference: every pair's, `[N, 2]` on the CPU, in one pass split over the ranks and
    gathered, batched as `layout_model` decides (`collate`); `wrapped`, the model `ref_fn` calls,
    is left resharded."""
    if not cfg.precompute_ref_logprobs:
        return torch.no_grad()(lambda rows, batch: ref_fn(batch)[:2])

    @torch.no_grad()
    def score(rows):
        batch = to_device(collate(layout_model, [examples[k] for k in rows], pad_id,
                                  cfg.share_prompt), d.device)
        with autocast(cfg.mixed_precision, d.device):
            chosen, rejected, _, _ = ref_fn(batch)
        return torch.stack([chosen, rejected], dim=-1).float()
    wrapped.eval()
    table = gather_outputs(score, len(examples), cfg.batch_size, d, wrapped).cpu()
    wrapped.train()
    return lambda rows, batch: table[rows].to(d.device).unbind(-1)


def pair_lengths(model, examples, indices: list[int], share_prompt: bool) -> list[int]:
    """The tokens each pair of `indices` puts through the model: P + C + R in one shared-prompt
    row (when `collate` builds those for these pairs), else 2 P + C + R in two rows."""
    shared = share_prompt and can_share(model, [examples[k] for k in indices])
    return offline.example_tokens(examples, indices, 1 if shared else 2)


def accumulate_pairs(wrapped, layout_model, examples, indices: list[int], ref_logps,
                     cfg: DPOConfig, d: distributed.Dist, pad_id: int) -> list[torch.Tensor]:
    """Forward and backward over this rank's share of the global batch `indices`, in its
    micro-batches; returns the global batch's policy (chosen, rejected, chosen_len,
    rejected_len) and reference (chosen, rejected) log-probs, `[B]` each (pair by pair, in the
    micro-batches' order), gathered from every
    rank for the metrics. `ref_logps(rows, batch)`: the reference's (chosen, rejected). With
    --micro-batch-tokens the cut is by each pair's tokens in its layout (`pair_lengths`)."""
    lengths = pair_lengths(layout_model, examples, indices, cfg.share_prompt)
    micro = offline.step_micro_batches(indices, lengths, cfg, d)
    parts = []
    for i, (rows, real) in enumerate(micro):
        batch = to_device(collate(layout_model, [examples[k] for k in rows], pad_id,
                                  cfg.share_prompt), d.device)
        with distributed.no_sync(wrapped, skip=i < len(micro) - 1):
            with autocast(cfg.mixed_precision, d.device):
                # chosen, rejected and their lengths: [b] each
                policy_logps = wrapped(pair_logprobs, batch, cfg.chunked_lm_head, cfg.pack)
                ref_chosen, ref_rejected = ref_logps(rows, batch)
            losses, _, _ = pair_losses(cfg, policy_logps, ref_chosen, ref_rejected)
            # the loss is a mean over the global batch's pairs, whatever the cut
            backward(losses.sum() / len(indices) * (d.grad_scale if real else 0.0), d)
        if real:
            parts.append(torch.stack([t.detach().float() for t in
                                      (*policy_logps, ref_chosen, ref_rejected)], dim=-1))
    local = torch.cat(parts) if parts else torch.zeros((0, 6), device=d.device)
    return list(distributed.all_gather_rows(local, d).unbind(-1))


def pair_losses(cfg: DPOConfig, policy_logps, ref_chosen, ref_rejected):
    """`dpo_loss` on (chosen, rejected, chosen_len, rejected_len) policy log-probs and the reference's;
    returns (losses, chosen_rewards, rejected_rewards), `[B]` each."""
    policy_chosen, policy_rejected, chosen_len, rejected_len = policy_logps
    # the lengths act under ipo alone: IPO compares per-token averages (Azar et al. 2023)
    return dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=cfg.beta,
                    loss_type=cfg.loss, label_smoothing=cfg.label_smoothing,
                    chosen_lengths=chosen_len, rejected_lengths=rejected_len)


def dpo_metrics(losses, chosen_rewards, rejected_rewards, beta: float) -> dict[str, float]:
    """Per-step statistics; rewards are beta * log(pi / ref) of each response."""
    margins = chosen_rewards - rejected_rewards
    # log(pi/ref) averaged over both responses: a KL-like drift measure on the preference data
    # (not on policy samples, so it can be negative).
    # log pi - log ref on the data's responses, not a KL (not sampled from pi): it can be < 0
    logratio = ((chosen_rewards + rejected_rewards) / (2 * beta)).mean()
    return {"train/loss": losses.mean().item(),
            "rewards/chosen": chosen_rewards.mean().item(),
            "rewards/rejected": rejected_rewards.mean().item(),
            "rewards/margins": margins.mean().item(),
            "rewards/accuracies": (margins > 0).float().mean().item(),
            "objective/logratio": logratio.item()}


def run(cfg: DPOConfig) -> RunResult:
    """Train `cfg.model` with DPO or IPO; returns the final model's path and last metrics."""
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    examples, stats = offline.encode_data(cfg, tokenizer, encode_preferences, cfg.data, "pairs")
    # Before any weights load, from the models' configs and tokenizers alone: the reference's
    # path and vocabulary, a reward model or classifier given as --model or --ref-model, and rows
    # longer than either model reads (tether.models.limits).
    check_reference(cfg.ref_model, tokenizer, cfg.trust_remote_code)
    named = {"--model": cfg.model, "--ref-model": cfg.ref_model}  # "": the model is its own
    positions = [language_model(path, option, trust_remote_code=cfg.trust_remote_code)
                 for option, path in named.items() if path]
    check_rows_fit(positions, longest_row(examples), cfg.max_length, cfg.data)
    lora, run_dir, d = offline.open_run(cfg)

    lm = load_trainable_lm(cfg.model, tokenizer, lora, cfg.dtype, cfg.trust_remote_code)
    policy = lm.model
    disable_dropout(policy).to(d.device).train()  # DPO compares log-probs of fixed sequences
    ref_layout, make_ref_fn = _reference(cfg, lm, tokenizer, d)
    # after the reference copy: only the trained model recomputes
    wrapped = offline.wrap_trained(policy, cfg, d)
    pad_id = tokenizer.pad_token_id
    ref_logps = reference_logps(make_ref_fn(wrapped), ref_layout, examples, pad_id, cfg, d,
                                wrapped)
    # with --precompute-ref-logprobs a separate reference is dropped here
    del ref_layout, make_ref_fn
    steps = offline.start_training(run_dir, cfg, wrapped, len(examples), final=stats.as_metrics())

    with steps:
        for step in steps:
            indices = batch_order(len(examples), cfg.batch_size, cfg.seed, step - 1)  # global
            *policy_logps, ref_chosen, ref_rejected = accumulate_pairs(
                wrapped, policy, examples, indices, ref_logps, cfg, d, pad_id)
            grad_norm = optimizer_step(wrapped, steps.optimizer, steps.scheduler, cfg.max_grad_norm)
            # Metrics are the full global batch's, from the log-probs every rank produced.
            metrics = dpo_metrics(*pair_losses(cfg, policy_logps, ref_chosen, ref_rejected),
                                  cfg.beta)
            metrics |= {"logps/chosen": policy_logps[0].mean().item(),
                        "logps/rejected": policy_logps[1].mean().item(),
                        "train/grad_norm": grad_norm, "train/lr": steps.scheduler.get_last_lr()[0]}
            steps.done(step, metrics)
    offline.save_final_lm(run_dir, wrapped, d, lm, tokenizer, cfg)
    return RunResult(run_dir.final_dir, steps.metrics | steps.final)


def cli(argv: list[str]) -> int:
    return offline.stage_cli(DPOConfig, run, argv)
