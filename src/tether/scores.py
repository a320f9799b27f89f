"""Sequence scores before they become per-token rewards (`tether.advantages.kl_shaped_rewards`):
normalised per batch or over the run, DAPO's soft penalty for long responses, and the groups of
samples whose scores vary (the ones that carry a gradient under rloo and grpo).

Notation: B responses (rows), k the samples of one prompt (consecutive rows).
"""

from __future__ import annotations

import math

import torch

from tether.choices import positive


class ScoreNormalizer:
    """Scores -> (score - mean) / std: per batch, or with running moments over the run (the
    running form is a streaming version of the reward normalisation of Ziegler et al. 2019).

    mode "none": unchanged; "batch": population moments of this batch; "running": moments of
    every score seen so far (Chan et al.'s parallel update), checkpointed with `state_dict`.
    """

    def __init__(self, mode: str):
        self.mode = mode
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        if self.mode == "none":
            return scores
        if self.mode == "batch":
            return (scores - scores.mean()) / (scores.std(unbiased=False) + 1e-8)
        # Chan et al. parallel update of the running mean and sum of squared deviations.
        n, mean = scores.numel(), scores.mean().item()
        m2 = ((scores - mean) ** 2).sum().item()
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta ** 2 * self.count * n / total
        self.count = total
        std = math.sqrt(self.m2 / total) if total > 1 else 1.0
        return (scores - self.mean) / (std + 1e-8)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), state["mean"], state["m2"]


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), added to the score:

        0                                   |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
        -1                                  |y| > L_max

    Args:
        lengths: [B] response lengths in tokens. max_len: L_max (--max-new-tokens).
        cache: L_cache > 0, the window before L_max where the penalty grows from 0 to -1.

    Returns:
        [B] fp32 penalties in [-1, 0].
    """
    positive("cache", cache)
    start = max_len - cache
    lengths = lengths.float()
    inside = (start - lengths) / cache
    return torch.where(lengths <= start, torch.zeros_like(lengths),
                       torch.where(lengths <= max_len, inside, -torch.ones_like(lengths)))


def varied_groups(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[B / k] bool: True for each group of k consecutive scores that are not all equal.

    A group whose k responses all score exactly the same has zero advantage under rloo and grpo
    (each response equals its baseline), so it adds no policy gradient. DAPO's dynamic sampling
    (Yu et al. 2025, "DAPO", eq. 11: 0 < |{o_i : o_i correct}| < G) keeps only the others.

    Args:
        scores: [B] sequence scores, B a multiple of k, groups in consecutive rows.
    """
    if k < 1 or scores.numel() % k:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {k}")
    groups = scores.reshape(-1, k)
    return groups.amax(dim=1) != groups.amin(dim=1)
