"""Supervised fine-tuning: next-token cross-entropy on response tokens only.

    L = - sum_{t in response} log p(y_t | y_<t) / (number of response tokens in the batch)

Prompt tokens condition the model but carry no loss (InstructGPT, Ouyang et al. 2022, sec. 3.5;
the prompt is given, not something to imitate). EOS is part of the response so the model learns
to stop.
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.config import parse_config
from tether.data import batch_order, collate_sft, encode_sft, load_rows
from tether.models import load_causal_lm, load_tokenizer, resolve_device, save_model
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


@dataclass(kw_only=True)
class SFTConfig(TrainConfig):
    """Supervised fine-tuning on {prompt, response} or {messages} rows."""

    lr: float = 2e-5
    """Peak learning rate (AdamW)."""


def sft_loss(model, batch, chunked: bool = True) -> tuple:
    """Token-mean negative log-likelihood over response tokens; returns (loss, n_tokens).
    `chunked`: log-probs through the LM head in chunks (tether.lm_head), never the full logits."""
    logprobs, mask = response_logprobs(model, batch, chunked)  # [N, T-1] each
    n_tokens = mask.sum().clamp(min=1)
    return -(logprobs * mask).sum() / n_tokens, n_tokens


def run(cfg: SFTConfig) -> RunResult:
    """Fine-tune `cfg.model` on `cfg.data`; returns the final model's path and last metrics."""
    # Read and check the data before touching the run directory: bad input leaves no trace.
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    rows = load_rows(cfg.data, cfg.split)
    examples, stats = encode_sft(tokenizer, rows, cfg.max_length, cfg.on_long_prompt, cfg.data)
    run_dir = RunDir(cfg.output_dir, cfg.run_name, cfg.resume)
    run_dir.save_config(cfg)

    seed_everything(cfg.seed)
    device = resolve_device(cfg.device)
    model = load_causal_lm(cfg.model, tokenizer, cfg.dtype, cfg.trust_remote_code).to(device)
    model.train()
    total_steps, optimizer, scheduler, state = start_training(run_dir, cfg, model,
                                                              len(examples))
    data_stats = {"data/rows": float(len(examples)), **stats.as_metrics()}

    metrics: dict[str, float] = {}
    bar = progress(total_steps, f"sft {cfg.run_name}", initial=state["step"])
    for step in range(state["step"] + 1, total_steps + 1):
        indices = batch_order(len(examples), cfg.batch_size, cfg.seed, step - 1)
        batch = to_device(collate_sft([examples[i] for i in indices], tokenizer.pad_token_id), device)
        with autocast(cfg.mixed_precision, device):
            loss, n_tokens = sft_loss(model, batch, cfg.chunked_lm_head)
        grad_norm = optimizer_step(model, optimizer, scheduler, loss, cfg.max_grad_norm)
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.4f}")
        metrics = {"train/loss": loss.item(), "train/tokens": float(n_tokens),
                   "train/grad_norm": grad_norm, "train/lr": scheduler.get_last_lr()[0]}
        if step % cfg.log_every == 0 or step == total_steps:
            run_dir.log(step, metrics | (data_stats if step == total_steps else {}))
        maybe_checkpoint(run_dir, cfg, step, total_steps, {"model": model}, optimizer, scheduler,
                         {"step": step})
    bar.close()
    save_model(model, tokenizer, run_dir.final_dir)
    run_dir.close()
    return RunResult(run_dir.final_dir, metrics | data_stats)


def cli(argv: list[str]) -> int:
    cfg = parse_config(SFTConfig, argv, prog="tether sft")
    print_result(run(cfg))
    return 0
