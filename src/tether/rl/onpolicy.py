"""One on-policy step per batch: the update's own forward pass scores the old policy.

Notation: B rollout batch, R response width, d hidden size.

With one optimizer step per rollout batch (--ppo-epochs 1, --num-minibatches 1, no
micro-batching: RLOO's and GRPO's usual settings, `tether rloo` and `tether grpo`'s defaults),
the old policy pi_old that scores the rollout is the policy the update differentiates, before its
only step, on the same rows. Its log-probs are then the update's log-probs, detached: one policy
forward per batch instead of two (rollout scoring, then update), and the ratio pi / pi_old is 1
by construction (TRL's GRPOTrainer skips the old-policy pass the same way when num_iterations = 1).

The order inside the step keeps every quantity what the two-pass loop computes: the reference is
scored first (no gradient); the policy's forward keeps its graph; the KL-shaped rewards and the
advantages, which may read log pi_old (KL in the reward), come from its detached log-probs; then
the loss of `ppo_step.minibatch_loss` on that same forward, one backward, one optimizer step.
Entropy and the exact KL (logged only) come from the detached hidden states, without a gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from tether.advantages import kl_shaped_rewards
from tether.lm_head import head_entropy
from tether.losses import assert_finite
from tether.models.critic import policy_and_values
from tether.models.forward import autocast
from tether.models.trunk_head import ResponseScores, exact_kl_at, score_responses, trunk_and_head
from tether.rl.rollout import Rollout
from tether.rl.scoring import Scored
from tether.rl.update import estimate_advantages, minibatch_loss, update_mode
from tether.train.ppo_config import PPOConfig


def fuses_scoring(cfg: PPOConfig) -> bool:
    """Whether a batch gets exactly one optimizer step over all its rows in one forward pass,
    so that the update's forward can also score pi_old."""
    return (cfg.ppo_epochs == 1 and cfg.num_minibatches == 1
            and cfg.micro_batch_rows == cfg.batch_size)


@torch.no_grad()
def _entropy(policy: nn.Module, rollout: Rollout, hidden: torch.Tensor, chunked: bool):
    """H(pi(. | s_t)) [B, R] from the update's hidden states through the LM head; a model whose
    logits are not head(hidden) gets one more forward (tether.models.trunk_head.trunk_and_head)."""
    try:
        _, head = trunk_and_head(policy)
    except ValueError:
        return score_responses(policy, rollout.input_ids, rollout.attention_mask,
                               rollout.context_length, rollout.temperature, chunked=chunked,
                               entropy=True).entropy
    return head_entropy(hidden.detach(), head, rollout.temperature)


def on_policy_step(policy: nn.Module, critic: nn.Module | None, reference: nn.Module,
                   optimizer: torch.optim.Optimizer, rollout: Rollout, ref: ResponseScores,
                   scores: torch.Tensor, cfg: PPOConfig, beta: float):
    """Score pi_old, shape the rewards, estimate the advantages and take the one optimizer step,
    all on one forward pass of the policy (and critic). `fuses_scoring(cfg)` must hold.

    Args:
        rollout: the batch, B rows. ref: `score_reference` of it. scores: [B] sequence scores
        (normalised, clipped). beta: the controller's coefficient for this batch.

    Returns:
        (old, kl, advantages, returns, stats): what `ppo_step.score_rollout`,
        `advantages.kl_shaped_rewards`, `ppo_step.estimate_advantages` and `ppo_step.ppo_update`
        return in the two-pass loop; `old` holds the detached [B, R] scores of pi_old.
    """
    if not fuses_scoring(cfg):
        raise ValueError("on_policy_step needs one epoch, one minibatch and no micro-batches")
    mask = rollout.response_mask
    in_reward = cfg.kl_in == "reward"
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with update_mode(cfg, policy, critic):
        optimizer.zero_grad(set_to_none=True)
        with autocast(cfg.mixed_precision, rollout.input_ids.device):
            current, values = policy_and_values(
                policy, critic, rollout.input_ids, rollout.attention_mask,
                rollout.context_length, rollout.temperature, chunked=cfg.chunked_lm_head,
                hidden=True)
        real = mask.float()
        # The logged entropy and exact KL under the forward's autocast, as score_rollout has them.
        with torch.no_grad(), autocast(cfg.mixed_precision, rollout.input_ids.device):
            exact = exact_kl_at(policy, reference, current.hidden.detach(), ref.hidden,
                                rollout.temperature)
            old = Scored(logprobs=current.logprobs.detach() * real,
                         ref_logprobs=ref.logprobs * real, values=values.detach().float() * real,
                         entropy=_entropy(policy, rollout, current.hidden, cfg.chunked_lm_head)
                         * real,
                         exact_kl=(exact.float() * real if exact is not None
                                   else torch.full_like(real, float("nan"))))
        rewards, kl = kl_shaped_rewards(scores, old.logprobs, old.ref_logprobs, mask,
                                        beta if in_reward else 0.0,
                                        cfg.resolved_estimator if in_reward else "k1")
        advantages, returns = estimate_advantages(cfg, rewards, old.values, mask)
        with autocast(cfg.mixed_precision, rollout.input_ids.device):
            loss, stats = minibatch_loss(policy, critic, rollout, old, advantages, returns, cfg,
                                         0.0 if in_reward else beta,
                                         (int(mask.sum()), len(rollout)), reference,
                                         computed=(current, values))
        loss.backward()
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")  # 0: off
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        assert_finite("gradient norm", grad_norm)
        optimizer.step()
    # On-policy, approx_kl is exactly 0, so --target-kl never refuses this step.
    stats |= {"policy/grad_norm": float(grad_norm), "policy/updates": 1.0,
              "policy/early_stopped": 0.0}
    return old, kl, advantages, returns, stats
