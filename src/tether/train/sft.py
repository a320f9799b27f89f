"""Supervised fine-tuning: next-token cross-entropy on response tokens only.

    L = - sum_{t in response} log p(y_t | y_<t) / (number of response tokens in the batch)

With --grad-accum-steps k the batch runs as k micro-batches (or, with --micro-batch-tokens C, as
micro-batches of at most C tokens); each divides its token sum by the whole batch's token count,
so the summed gradients are the full batch's, not a mean of per-micro-batch means, and the step
does not depend on the cut (the bug of prime-rl PR #583 and open-instruct PR #1137, which
tether's SFT never had). --pack runs each micro-batch as packed rows without padding
(tether.data.packing); the loss is the same.
Under torchrun each rank takes its slice of the same global batch and divides by the global token
count (summed over ranks), times the world size because DDP / FSDP2 average the ranks' gradients.

Prompt tokens condition the model but carry no loss (InstructGPT, Ouyang et al. 2022, sec. 3.5;
the prompt is given, not something to imitate). EOS is part of the response so the model learns
to stop. In a multi-turn chat every assistant turn is a response (TRL's `assistant_only_loss`;
--loss-on last trains the final one only) and the user turns between them are prompt: the
batch's `response_mask` says which tokens count. A `{text}` row is all response.
"""

from __future__ import annotations

from tether.data.batches import batch_order, collate_sft, to_device
from tether.data.encoding import encode_sft
from tether.models.forward import autocast
from tether.models.limits import check_rows_fit, language_model, longest_row
from tether.models.pretrained import load_tokenizer, load_trainable_lm
from tether.models.trunk_head import response_logprobs
from tether.run import distributed
from tether.run.optim import backward, optimizer_step
from tether.run.rundir import RunResult
from tether.train import offline
from tether.train.offline_config import SFTConfig


def response_tokens(batch) -> int:
    """Response tokens that carry loss (the first token has no prediction)."""
    return int(batch["response_mask"][:, 1:].sum())


def sft_loss(model, batch, batch_tokens: int | None = None, chunked: bool = True,
             packed: bool = False) -> tuple:
    """Negative log-likelihood summed over response tokens, divided by `batch_tokens` (the whole
    step's count when this is one of its micro-batches; default: this batch's own count, a token
    mean). Returns (loss, n_tokens of this batch). `chunked`: log-probs through the LM head in
    chunks (tether.lm_head), never the full logits. `packed`: the rows run packed, no padding."""
    logprobs, mask = response_logprobs(model, batch, chunked, packed)  # [N, T-1] each
    n_tokens = mask.sum()
    denominator = n_tokens if batch_tokens is None else batch_tokens
    return -(logprobs * mask).sum() / max(float(denominator), 1.0), n_tokens


def run(cfg: SFTConfig) -> RunResult:
    """Fine-tune `cfg.model` on `cfg.data`; returns the final model's path and last metrics."""
    # Read and check the data before touching the run directory: bad input leaves no trace.
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    examples, stats = offline.encode_data(cfg, tokenizer, encode_sft, cfg.data, "rows", cfg.loss_on)
    positions = language_model(cfg.model, "--model", trust_remote_code=cfg.trust_remote_code)
    check_rows_fit([positions], longest_row(examples), cfg.max_length, cfg.data)
    lora, run_dir, d = offline.open_run(cfg)

    lm = load_trainable_lm(cfg.model, tokenizer, lora, cfg.dtype, cfg.trust_remote_code)
    model = lm.model.to(d.device).train()  # with LoRA: the base with the adapter's layers injected
    wrapped = offline.wrap_trained(model, cfg, d)
    steps = offline.start_training(run_dir, cfg, wrapped, len(examples),
                                   final={"data/rows": float(len(examples)), **stats.as_metrics()})
    with steps:
        for step in steps:
            indices = batch_order(len(examples), cfg.batch_size, cfg.seed, step - 1)  # global batch
            micro = [(collate_sft([examples[i] for i in rows], tokenizer.pad_token_id), real)
                     for rows, real in offline.step_micro_batches(
                         indices, offline.example_tokens(examples, indices), cfg, d)]
            # the whole global batch's tokens: every rank's part of the loss divides by it
            n_tokens = distributed.global_sum(sum(response_tokens(b) for b, real in micro if real), d)
            loss = 0.0
            for i, (batch, real) in enumerate(micro):
                with distributed.no_sync(wrapped, skip=i < len(micro) - 1):
                    with autocast(cfg.mixed_precision, d.device):
                        part, _ = wrapped(sft_loss, to_device(batch, d.device), n_tokens,
                                          cfg.chunked_lm_head, cfg.pack)
                    backward(part * (d.grad_scale if real else 0.0), d)
                loss += part.item() if real else 0.0
            loss = distributed.global_sum(loss, d)
            grad_norm = optimizer_step(wrapped, steps.optimizer, steps.scheduler, cfg.max_grad_norm)
            steps.done(step, {"train/loss": loss, "train/tokens": float(n_tokens),
                              "train/grad_norm": grad_norm,
                              "train/lr": steps.scheduler.get_last_lr()[0]})

    offline.save_final_lm(run_dir, wrapped, d, lm, tokenizer, cfg)
    return RunResult(run_dir.final_dir, steps.metrics | steps.final)


def cli(argv: list[str]) -> int:
    return offline.stage_cli(SFTConfig, run, argv)
