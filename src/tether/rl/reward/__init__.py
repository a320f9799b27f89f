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
pool's `FailedRows`, and the score checks. Whatever a function does wrong (raises, calls
`sys.exit`, returns NaN, the wrong count, an unordered set or anything but numbers in order)
stops the run with one line that names the function, where it failed and the fix, before
anything of the batch reaches the optimiser; loading it, its deadline and its event loop are
the user's code's (tether.run.user_code).
"""

from __future__ import annotations

import math
import numbers
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


def out_of_range(value: float) -> str | None:
    """Why `value` cannot be a score (not finite, or past MAX_SCORE), or None."""
    if not math.isfinite(value):
        return f"a non-finite score ({value})"
    if abs(value) > MAX_SCORE:
        return f"a score of {value:g} (past +-{MAX_SCORE:g}: float32 maths on it overflows)"
    return None


# What the loop calls: reward(prompts, responses, rollout, rows) -> RewardScores, where `rows`
# are the prompt rows the responses answer (their other columns), or None where none are known.
Reward = Callable[[list[str], list[str], Any, "list[dict] | None"], RewardScores]


def returned_scores(scores: Any, n: int, what: str, name: str, allow_none: bool = False
                    ) -> list[float | None]:
    """What a reward function returned for `n` responses, as floats (None kept with
    `allow_none`), or a TetherError unless `n` numbers in order; the caller checks the range."""
    fix = "it must return a list of one finite float per response, in their order"
    values = _ordered_numbers(scores, allow_none)
    if values is None:
        raise TetherError(f"{what} {name} returned {_shown(scores)}, not a list of numbers in "
                          f"the responses' order; {fix}")
    if len(values) != n:
        raise TetherError(f"{what} {name} returned {len(values)} scores for {n} "
                          f"responses; {fix}")
    return values


def _ordered_numbers(scores: Any, allow_none: bool = False) -> list[float | None] | None:
    """The scores as floats, or None unless they are real numbers in a defined order: a list or
    tuple (not a str, whose characters float() would read), or a 1-D tensor or array.
    `allow_none`: None items are kept (as None) instead of refusing the list."""
    if isinstance(scores, (list, tuple)):
        items = list(scores)
    elif getattr(scores, "ndim", None) == 1 and hasattr(scores, "tolist"):  # tensor, ndarray
        items = scores.tolist()
    else:  # a set or dict (no order of the responses'), a generator, a string, a scalar, None
        return None
    if not all(_is_real(s) or (allow_none and s is None) for s in items):
        return None
    return [None if s is None else float(s) for s in items]


def _is_real(value: Any) -> bool:
    """A real number: int, float, bool, a numpy scalar, or a 0-d tensor or array of one."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    return isinstance(value, numbers.Real)


def _shown(value: Any) -> str:
    """What a function returned, in a few words (and why a set cannot do)."""
    text = f"{type(value).__name__} {str(value)[:60]}"
    if isinstance(value, (set, frozenset)):
        text += " (a set has no order: its scores would go to the wrong responses)"
    return text


def checked_model_scores(scores: torch.Tensor, name: str, prompts: list) -> torch.Tensor:
    """`scores` [B] of the reward model `name`, or `NonFiniteScore` naming the first row whose
    score is NaN, inf or past MAX_SCORE. A reward model's forward is finite on finite weights
    and inputs, so the cause is in it (NaN or inf weights, or weights so large its float32
    forward overflows), never the policy's learning rate, which is where the loss's NaN would
    point a batch later."""
    for row, value in enumerate(scores.tolist()):
        why = out_of_range(value)
        if why is not None:
            prompt = str(prompts[row])[:40] if row < len(prompts) else "?"
            raise NonFiniteScore(f"the reward model {name} gave response {row} (prompt "
                                 f"{prompt!r}) {why}: its weights hold NaN or inf, or are so "
                                 "large that its forward overflows; check or retrain the reward "
                                 "model, and what it reads; checkpoints written so far are intact")
    return scores


def check_reward_fn_timeout(timeout: float, default: float, has_functions: bool) -> None:
    """--reward-fn-timeout times the reward and gold functions: a value other than the default
    with neither is an option that would be accepted and ignored."""
    if timeout != default and not has_functions:
        raise TetherError(f"--reward-fn-timeout {timeout:g} limits the calls of --reward-fn and "
                          "--gold-fn functions, and this run has none; drop it (an environment's "
                          "calls have --env-timeout)")
