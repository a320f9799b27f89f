"""The pairwise losses of the offline stages: Bradley-Terry for reward models, DPO and IPO for the
policy, where the KL to the reference is implicit. The online losses are in `tether.losses`.

Notation: B pairs; each loss returns per-pair or mean losses and never logs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tether.choices import entry, positive, same_shape


def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                       margin: torch.Tensor | None = None) -> torch.Tensor:
    """Pairwise reward-model loss under the Bradley-Terry model (Ouyang et al. 2022, eq. 1).

    P(chosen > rejected) = sigmoid(r_c - r_r - m);  L = -mean log sigmoid(r_c - r_r - m)

    The optional margin m (Touvron et al. 2023, Llama 2, eq. 2) asks for a larger gap on pairs
    whose preference is stronger.

    Args:
        chosen_rewards: [B] scores of the preferred responses.
        rejected_rewards: [B] scores of the others.
        margin: optional [B] non-negative margins.

    Returns:
        Scalar loss.
    """
    same_shape(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        same_shape(chosen_rewards=chosen_rewards, margin=margin)
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
             ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             chosen_lengths: torch.Tensor | None = None,
             rejected_lengths: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct preference losses, where the KL to the reference is implicit.

    h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r))

    sigmoid (DPO, Rafailov et al. 2023, eq. 7), with label smoothing eps (conservative DPO,
    Mitchell 2023): L = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
    ipo (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", eq. 17, tau = beta): L = (h - 1 / (2 beta))^2. If lengths are given, each
    log-ratio is first divided by its response length (a per-token average).

    Args:
        policy_chosen, policy_rejected, ref_chosen, ref_rejected: [B] per-sequence summed
            log-probs of the responses.
        beta: > 0; the KL strength (DPO) or tau (IPO).
        loss_type: "sigmoid" or "ipo".
        label_smoothing: in [0, 0.5), the assumed probability that a label is flipped (sigmoid).
        chosen_lengths, rejected_lengths: optional [B] response lengths (IPO only).

    Returns:
        (losses [B], chosen_rewards [B], rejected_rewards [B]); rewards are beta * (policy - ref),
        detached.
    """
    entry(("sigmoid", "ipo"), loss_type, "loss_type")
    positive("beta", beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing}")
    same_shape(policy_chosen=policy_chosen, policy_rejected=policy_rejected,
               ref_chosen=ref_chosen, ref_rejected=ref_rejected)
    chosen_logratio = policy_chosen - ref_chosen
    rejected_logratio = policy_rejected - ref_rejected
    if loss_type == "sigmoid":
        h = chosen_logratio - rejected_logratio
        losses = (-(1.0 - label_smoothing) * F.logsigmoid(beta * h)
                  - label_smoothing * F.logsigmoid(-beta * h))
    else:
        if (chosen_lengths is None) != (rejected_lengths is None):
            raise ValueError("pass both chosen_lengths and rejected_lengths, or neither")
        if chosen_lengths is not None:
            same_shape(policy_chosen=policy_chosen, chosen_lengths=chosen_lengths,
                       rejected_lengths=rejected_lengths)
            chosen_logratio = chosen_logratio / chosen_lengths.clamp(min=1)
            rejected_logratio = rejected_logratio / rejected_lengths.clamp(min=1)
        h = chosen_logratio - rejected_logratio
        losses = (h - 1.0 / (2.0 * beta)).square()
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards
