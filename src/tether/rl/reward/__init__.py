"""Where PPO's sequence scores come from, and what a score must be.

    a reward model    tether's own (`tether rm`) or a transformers sequence-classification
                      model (`models.py`): tether's own, on the policy's vocabulary, scores the
                      policy's token ids directly (`reward_from_model`); every other reward
                      model reads text (`reward_from_texts`): the decoded response and the prompt
                      as its row gave it, tokenised by its own tokenizer
    a served model    `tether serve-rm`, over HTTP (`remote.py`, --reward-url)
    a function        `(prompts: list[str], responses: list[str]) -> list[float]`, or one
                      written for TRL's convention, one or several, weighted (`functions.py`);
                      with --reward-workers, one call per response, N at a time (`pool.py`)

This module holds what they share: the `Reward` the loop calls, the `RewardScores` it gets, the
pool's `FailedRows`, and what a score must be (`MAX_SCORE`); each is checked where it is made
(a function's by `functions.py`, a reward model's by `models.py`). Whatever a function does
wrong (raises, calls `sys.exit`, returns NaN, the wrong count, an unordered set or anything but
numbers in order) stops the run with one line that names the function, where it failed and the
fix, before anything of the batch reaches the optimiser; loading it, its deadline and its event
loop are the user's code's (tether.run.user_code).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tether.errors import TetherError

RewardFn = Callable[[list[str], list[str]], Sequence[float]]
# A prompt as its row gave it: plain text, or a list of chat messages
Prompt = str | list[dict]


@dataclass
class FailedRows:
    """The rows of a batch whose score failed in the reward pool (tether.rl.reward.pool): raised
    on every try, did not return in time, or gave a score that is NaN, inf or out of range."""

    failed: torch.Tensor  # [B] bool: the row has no score (its entry in `scores` is NaN)
    retries: torch.Tensor  # [B] int64: calls made again for the row (all its functions)
    causes: dict[int, str]  # row -> "reward function f raised ... (prompt '...'; 3 tries)"


class RewardScores(NamedTuple):
    """What a reward gives a batch: the scores, and each reward function's own beside them."""

    scores: torch.Tensor  # [B] the score of each response (several functions: their weighted sum)
    parts: dict[str, torch.Tensor]  # name -> [B] one function's scores, NaN where it returned
    # None (tether.rl.reward.functions); {} for a reward model
    failed: FailedRows | None = None  # the reward pool's failed rows (NaN in `scores`); None: no pool


# The largest score magnitude a reward may give. Scores are float32 from here on, and the
# normalisation and group std square them (centred): 1e15 squared, times a million rows, is 1e36,
# still inside float32 (3.4e38), where 1e300 is inf at once and 1e20 overflows when squared. No
# real reward comes near it; one that does is a bug (a sentinel, a product gone wrong).
MAX_SCORE = 1e15


class NonFiniteScore(TetherError):
    """A reward model gave a score that is NaN, inf or past MAX_SCORE; the loop that catches it
    names its batch. Nothing of the batch reached the optimiser."""


# What the loop calls: reward(prompts, responses, rollout, rows) -> RewardScores, where `rows`
# are the prompt rows the responses answer (their other columns), or None where none are known.
Reward = Callable[[list[str], list[str], Any, "list[dict] | None"], RewardScores]
