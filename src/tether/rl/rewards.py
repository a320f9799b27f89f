"""Where PPO's sequence scores come from: a reward model or a Python function, checked.

A reward function is any callable `(prompts: list[str], responses: list[str]) -> list[float]`,
named on the command line as `module:function` or `path/to/file.py:function`. Whatever it does
wrong (raises, returns NaN, the wrong count, not numbers) stops the run with one line that names
the function and the fix, before anything of the batch reaches the optimiser.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tether.errors import TetherError

RewardFn = Callable[[list[str], list[str]], Sequence[float]]
# What the loop calls: reward(prompts, responses, rollout) -> scores [B]
Reward = Callable[[list[str], list[str], Any], torch.Tensor]


def load_reward_function(spec: str) -> RewardFn:
    """Import `module:function` (or `file.py:function`) and return the callable."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise TetherError(f"reward function {spec!r} must look like module:function or "
                          "path/to/file.py:function")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise TetherError(f"reward function file {module_name} does not exist; fix the path")
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except TetherError:
        raise
    except Exception as exc:  # an import error of the user's module, whatever its type
        raise TetherError(f"cannot import {module_name} for reward function {spec!r}: "
                          f"{type(exc).__name__}: {exc}; check the module is on PYTHONPATH") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise TetherError(f"{module_name} has no callable named {attr!r}; fix the function name "
                          f"in {spec!r}")
    return fn


def function_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def call_reward_function(fn: RewardFn, prompts: list[str], responses: list[str],
                         what: str = "reward function") -> torch.Tensor:
    """Call `fn` and return its scores as a float32 tensor [B], or stop with a clear message."""
    name = function_name(fn)
    fix = "it must return one finite float per response"
    try:
        scores = fn(list(prompts), list(responses))
    except Exception as exc:  # the user's code: report it as an input problem, on one line
        raise TetherError(f"{what} {name} raised {type(exc).__name__}: {exc}; fix the function "
                          f"({fix}); checkpoints written so far are intact") from exc
    returned = f"{type(scores).__name__} {str(scores)[:60]}"
    try:
        # float() would take a dict's keys, or the string "1.5": both score the wrong thing
        if isinstance(scores, (dict, str, bytes)):
            raise TypeError
        scores = list(scores)
        if any(isinstance(s, (str, bytes)) for s in scores):
            raise TypeError
        values = [float(s) for s in scores]
    except (TypeError, ValueError):
        raise TetherError(f"{what} {name} returned {returned}, not a list of numbers; "
                          f"{fix}") from None
    if len(values) != len(responses):
        raise TetherError(f"{what} {name} returned {len(values)} scores for {len(responses)} "
                          f"responses; {fix}")
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise TetherError(f"{what} {name} returned a non-finite score ({values[bad[0]]}) for "
                          f"response {bad[0]}; {fix}")
    return torch.tensor(values, dtype=torch.float32)


def check_one_reward(reward_fn: Callable | None, reward_fn_spec: str, reward_model: str) -> None:
    """Exactly one reward source: a Python callable, `--reward-fn` or `--reward-model`."""
    given = [name for name, on in (("a Python reward_fn", reward_fn is not None),
                                   ("--reward-fn", bool(reward_fn_spec)),
                                   ("--reward-model", bool(reward_model))) if on]
    if len(given) != 1:
        raise TetherError("give exactly one reward: --reward-model, --reward-fn or a Python "
                          f"reward_fn (got {', '.join(given) if given else 'none'})")


def reward_from_model(reward_model: nn.Module, chunk: int) -> Reward:
    """A reward model as a `Reward`: it scores the policy's own token ids (no re-tokenising),
    `chunk` rows at a time, read at each response's last real token (EOS)."""
    @torch.no_grad()
    def reward(prompts, responses, rollout) -> torch.Tensor:  # rollout: tether.rl.rollout.Rollout
        # The reward model reads the policy's own token ids at the last real token (EOS).
        return torch.cat([reward_model.score(rollout.input_ids[i:i + chunk],
                                             rollout.attention_mask[i:i + chunk],
                                             rollout.context_length)
                          for i in range(0, len(rollout), chunk)])
    return reward


def reward_from_function(fn: Callable, what: str) -> Reward:
    """A Python `(prompts, responses) -> scores` function as a `Reward`, checked on every call."""
    return lambda prompts, responses, rollout: call_reward_function(fn, prompts, responses, what)
