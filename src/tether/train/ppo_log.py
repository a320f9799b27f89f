"""What the online loop records of a batch (tether.train.ppo): its metric line (docs/ppo.md
defines each metric), the held-out evaluations with their samples, and the sample tables the
trackers show. Rank 0 writes; every rank computes the same numbers."""

from __future__ import annotations

import torch

from tether.models.forward import autocast
from tether.rl.evaluation import evaluate_policy, measure_responses
from tether.rl.rollout import Rollout, decode_responses
from tether.rl.scoring import explained_variance, kl_sums
from tether.rl.update import BatchUpdate
from tether.run.rundir import RunDir
from tether.train.ppo_config import PPOConfig
from tether.train.ppo_setup import Setup
from tether.train.ppo_watch import collapsed


def batch_metrics(rollout: Rollout, raw_scores: torch.Tensor, scores: torch.Tensor,
                  done: BatchUpdate, beta: float, seq_kl: float, lr: float, elapsed: float,
                  has_critic: bool) -> dict[str, float]:
    """The batch's metric line (docs/ppo.md defines each), the same on every rank. Every count
    and mean is over the tokens the policy sampled."""
    mask, old = rollout.action_mask, done.old
    n_tokens = int(mask.sum())
    metrics = {
        "objective/score": raw_scores.mean().item(),
        "objective/kl": seq_kl,
        "objective/beta": beta,
        "objective/rlhf_reward": scores.mean().item() - beta * seq_kl,
        "policy/entropy": (old.entropy.sum() / n_tokens).item(),
        "rollout/response_len": mask.sum(1).float().mean().item(),
        "rollout/eos_rate": rollout.ended.float().mean().item(),
        **kl_sums(old, mask),
        "perf/tokens_per_s": n_tokens / elapsed,
        "perf/episodes_per_s": len(rollout) / elapsed,
        "perf/rollout_s": elapsed - done.update_s,
        "perf/update_s": done.update_s,
        "optim/lr": lr,
        **done.stats,
    }
    if has_critic:
        metrics["value/explained_var"] = explained_variance(old.values, done.returns, mask)
    metrics["policy/collapsed"] = float(collapsed(metrics))
    return metrics


def progress_fields(metrics: dict[str, float]) -> dict[str, str]:
    """The progress line's figures: the score, a KL that cannot be negative (k1, what the
    controller may read, can on a batch: the exact KL where the batch computed it, else k3,
    named kl_exact or kl_k3) and beta."""
    shown = "kl_exact" if "objective/kl_exact" in metrics else "kl_k3"
    return {"score": f"{metrics['objective/score']:.3f}",
            shown: f"{metrics[f'objective/{shown}']:.3f}",
            "beta": f"{metrics['objective/beta']:.3g}"}


def log_evaluation(rundir: RunDir, setup: Setup, cfg: PPOConfig, step: int) -> dict[str, float]:
    """Evaluate on the held-out prompts; log the samples (samples.jsonl) and return the metrics.

    Under several processes every rank evaluates every prompt alike (the same noise, the same
    numbers; FSDP2 needs every rank in each call) and rank 0 writes: replicated, not sharded."""
    with autocast(cfg.mixed_precision, setup.dist.device):
        # Sampled with the same seed each time: successive evaluations differ only through the
        # policy (tether.rl.evaluation.evaluate_policy).
        start = setup.anchor.start if setup.anchor is not None else None  # the SFT model, apart
        metrics, samples = evaluate_policy(
            setup.eval, lambda rollout: setup.roles.peek(lambda policy, _critic: (
                measure_responses(policy, setup.reference, rollout, cfg.chunked_lm_head, start))),
            setup.gold)
    rundir.log_samples(step, samples)
    return metrics


def final_evaluation(rundir: RunDir, setup: Setup, cfg: PPOConfig) -> dict[str, float]:
    """The held-out evaluation of the final policy, logged at the last batch, unless the last
    batch already had one (--eval-every dividing the run); {} without --eval-prompts."""
    if not cfg.eval_prompts or (cfg.eval_every and cfg.n_batches % cfg.eval_every == 0):
        return {}
    metrics = log_evaluation(rundir, setup, cfg, cfg.n_batches)
    rundir.log(cfg.n_batches, metrics)
    return metrics


def log_batch(rundir: RunDir, cfg: PPOConfig, step: int, metrics: dict[str, float],
              prompts: list[str], rollout: Rollout, tokenizer, raw_scores: torch.Tensor) -> None:
    """The metric line and sample table (rank 0 writes them; the table shows this rank's rows of
    the batch, `rollout`, the first of the global batch)."""
    if step % cfg.log_every == 0 or step == cfg.n_batches or "eval/score" in metrics:
        rundir.log(step, metrics)
    if cfg.sample_every and step % cfg.sample_every == 0:
        responses = decode_responses(tokenizer, rollout)  # only when a table is due
        rundir.log_text(step, "samples", sample_table(prompts, responses, raw_scores))


def sample_table(prompts: list[str], responses: list[str], scores: torch.Tensor,
                 n: int = 4) -> str:
    """A markdown table of the first `n` prompts, responses and scores (TensorBoard text)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")[:300]
    lines = ["| prompt | response | score |", "|---|---|---|"]
    lines += [f"| {cell(p)} | {cell(r)} | {float(s):.3f} |"
              for p, r, s in zip(prompts[:n], responses[:n], scores[:n].tolist(), strict=True)]
    return "\n".join(lines)
