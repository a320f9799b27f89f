"""Where PPO's sequence scores come from: a reward model or a Python function, checked.

A reward model is tether's own (`tether rm`) or a transformers sequence-classification model
(`tether.models.hub_reward`). Tether's own, on the policy's vocabulary, scores the policy's token
ids directly (`reward_from_model`); every other reward model reads text (`reward_from_texts`): the
decoded response and the prompt as its row gave it (plain text, or the chat messages, which the
reward model renders with its own template), tokenised by its own tokenizer.

A reward function is a callable `(prompts: list[str], responses: list[str]) -> list[float]`, or
one written for TRL's convention (`tether.rl.reward_functions`, which calls it and combines
several), named on the command line as `module:function` or `path/to/file.py:function`; loading it runs
the named file's code, as `python` would (the current directory first on the import path, as
`python -m` puts it, so `--gold-fn task:gold` finds ./task.py from the `tether` command too).
Whatever it does wrong (raises, calls `sys.exit`, returns NaN, the wrong count, an unordered set
or anything but numbers in order) stops the run with one line that names the function, where it
failed and the fix, before anything of the batch reaches the optimiser; a call that does not
return within --reward-fn-timeout seconds ends the process with one line (tether.run.watchdog).
Ctrl-C inside it is the user's, not the function's: it stops the run as anywhere else. An
`async def` function runs on the process's event loop (tether.run.event_loop), checked alike.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from tether.data.chat import is_messages
from tether.data.prompts import format_prompt, prompt_messages
from tether.data.rows import load_rows
from tether.errors import TetherError
from tether.models.hub_reward import TETHER, load_hub_reward_model, reward_model_kind
from tether.models.prepare import freeze, fuse_gelu
from tether.models.pretrained import check_same_vocabulary
from tether.models.reward_model import RewardModel
from tether.run.event_loop import run_coroutine
from tether.run.watchdog import Deadline

RewardFn = Callable[[list[str], list[str]], Sequence[float]]
# A prompt as its row gave it: plain text, or a list of chat messages
Prompt = str | list[dict]


@dataclass
class FailedRows:
    """The rows of a batch whose score failed in the reward pool (tether.rl.reward_pool): raised
    on every try, did not return in time, or gave a score that is NaN, inf or out of range."""

    failed: torch.Tensor  # [B] bool: the row has no score (its entry in `scores` is NaN)
    retries: torch.Tensor  # [B] int64: calls made again for the row (all its functions)
    causes: dict[int, str]  # row -> "reward function f raised ... (prompt '...'; 3 tries)"


class RewardScores(NamedTuple):
    """What a reward gives a batch: the scores, and each reward function's own beside them."""

    scores: torch.Tensor  # [B] the score of each response (several functions: their weighted sum)
    parts: dict[str, torch.Tensor]  # name -> [B] one function's scores, NaN where it returned
    # None (tether.rl.reward_functions); {} for a reward model
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


def load_reward_function(spec: str, what: str = "reward function") -> RewardFn:
    """Import `module:function` (or `file.py:function`) and return the callable (`what` names it
    in errors: a reward function, an environment factory, a tool).

    This runs the module's code. A module name is found as `python -m` finds one: the current
    directory first on the import path (the `tether` script's own path does not hold it), so
    ./task.py is `task:gold` from any launcher, and a file's own imports find its neighbours."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise TetherError(f"{what} {spec!r} must look like module:function or "
                          "path/to/file.py:function")
    _current_directory_first()
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise TetherError(f"{what} file {module_name} does not exist; fix the path")
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except TetherError:
        raise
    except (Exception, SystemExit) as exc:  # the user's module, whatever it raised (not Ctrl-C)
        own = str(Path(module_name).resolve()) if module_name.endswith(".py") else None
        raise TetherError(f"cannot import {module_name} for {what} {spec!r}: "
                          f"{raised(exc, own)}; fix the module (and check it is on the import "
                          "path: the current directory or PYTHONPATH)") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise TetherError(f"{module_name} has no callable named {attr!r}; fix the function name "
                          f"in {spec!r}")
    return fn


def _current_directory_first() -> None:
    """Put the current directory first on sys.path, as `python -m` does (the `tether` console
    script starts with its own bin directory there instead); kept, so that imports the function
    makes when called resolve as they did when it was loaded."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def raised(exc: BaseException, own_file: str | None = None) -> str:
    """`ValueError: message (at task.py:12)`: what the user's code raised and where, the one
    line of its traceback worth reading: the innermost in `own_file` (the function's own file),
    else the innermost of all. The whole traceback stays on the TetherError's __cause__."""
    what = (f"SystemExit({exc.code!r}): it called sys.exit" if isinstance(exc, SystemExit)
            else f"{type(exc).__name__}: {exc}")
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if own_file and f.filename == own_file]
    if own or frames:
        frame = (own or frames)[-1]
        where = os.path.relpath(frame.filename)
        what += f" (at {frame.filename if where.startswith('..') else where}:{frame.lineno})"
    return what


def function_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def call_reward_function(fn: RewardFn, prompts: list[str], responses: list[str],
                         what: str = "reward function", keywords: dict[str, Any] | None = None,
                         allow_none: bool = False, timeout: float = 0.0) -> torch.Tensor:
    """Call `fn` and return its scores as a float32 tensor [B], or stop with a clear message.

    It must return scores in the responses' order: a list or tuple, or a 1-D tensor or array,
    of finite real numbers (bools count as 0 and 1), one per response. A set, a dict, a
    generator or a string is refused: their order, or their items, are not the responses'.
    `keywords`: call `fn(**keywords)` (TRL's convention) instead of `fn(prompts, responses)`.
    `allow_none`: a None score means "does not apply" and comes back as NaN (TRL's convention
    for several functions; the caller decides what a row no function scored means).
    `timeout`: seconds the call may take (--reward-fn-timeout; 0: no limit), past which the
    process prints one line and exits with code 2 (`tether.run.watchdog`: a hung call cannot
    be stopped, only left)."""
    name = function_name(fn)
    fix = "it must return a list of one finite float per response, in their order"
    hung = (f"{what} {name} did not return within {timeout:g} s (--reward-fn-timeout); fix the "
            "hang, or raise --reward-fn-timeout (0: no limit); checkpoints written so far are "
            "intact")
    try:
        with Deadline(timeout, hung):
            scores = (fn(**keywords) if keywords is not None
                      else fn(list(prompts), list(responses)))
            if inspect.isawaitable(scores):  # an `async def` function: its coroutine, run now
                scores = run_coroutine(scores)
    except (Exception, SystemExit) as exc:  # the user's code, on one line; Ctrl-C stays Ctrl-C
        raise TetherError(f"{what} {name} raised {raised(exc, own_file(fn))}; fix the function "
                          f"({fix}); checkpoints written so far are intact") from exc
    values = returned_scores(scores, len(responses), what, name, allow_none)
    bad = [(i, why) for i, v in enumerate(values) if v is not None and (why := out_of_range(v))]
    if bad:
        raise TetherError(f"{what} {name} returned {bad[0][1]} for response {bad[0][0]}; {fix}, "
                          f"each within +-{MAX_SCORE:g}")
    return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)


def own_file(fn: Callable) -> str | None:
    """The file `fn` is written in (its traceback line worth naming, `raised`), or None."""
    code = (getattr(fn, "__code__", None)  # a function; else a callable object's __call__
            or getattr(vars(type(fn)).get("__call__"), "__code__", None))
    return getattr(code, "co_filename", None)


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


def check_one_reward(reward_fn: Callable | None, reward_fn_spec: str, reward_model: str,
                     reward_url: str = "") -> None:
    """Exactly one reward source: a Python callable, `--reward-fn`, `--reward-model` or
    `--reward-url` (a reward model served by `tether serve-rm`)."""
    given = [name for name, on in (("a Python reward_fn", reward_fn is not None),
                                   ("--reward-fn", bool(reward_fn_spec)),
                                   ("--reward-model", bool(reward_model)),
                                   ("--reward-url", bool(reward_url))) if on]
    if len(given) != 1:
        raise TetherError("give exactly one reward: --reward-model, --reward-url, --reward-fn or "
                          f"a Python reward_fn (got {', '.join(given) if given else 'none'})")


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


def reward_from_model(reward_model: nn.Module, chunk: int, name: str = "") -> Reward:
    """A reward model as a `Reward`: it scores the policy's own token ids (no re-tokenising),
    `chunk` rows at a time, read at each response's last real token (EOS). `name` names it when
    a score is not finite (`checked_model_scores`)."""
    @torch.no_grad()
    def reward(prompts, responses, rollout, rows=None) -> RewardScores:  # rollout: a Rollout
        # The reward model reads the policy's own token ids at the last real token (EOS).
        scores = torch.cat([reward_model.score(rollout.input_ids[i:i + chunk],
                                               rollout.attention_mask[i:i + chunk],
                                               rollout.context_length)
                            for i in range(0, len(rollout), chunk)])
        return RewardScores(checked_model_scores(scores, name, prompts), {})
    return reward


# ----------------------------------------------------------------------------- reward models

def prompt_originals(tokenizer, *sources: str) -> dict[str, Prompt]:
    """Each prompt text the policy continues (a chat rendered with the policy's template, as
    `tether.data.prompts.load_prompts` gives it) -> the prompt as its row gave it, for a reward
    model that renders a chat with its own template. `sources`: prompt files (empty ones skipped)."""
    originals: dict[str, Prompt] = {}
    for source in sources:
        for i, row in enumerate(load_rows(source) if source else []):
            where = f"{source}: row {i}"
            messages = prompt_messages(row, where)  # content parts joined, as the policy saw them
            original = messages if messages is not None else str(row["prompt"])
            originals[format_prompt(tokenizer, row, where)] = original
    return originals


def reward_from_texts(reward_model: nn.Module, chunk: int, originals: dict[str, Prompt],
                      name: str = "") -> Reward:
    """A reward model that reads text as a `Reward`: each prompt text is looked up in
    `originals` (one missing there is read as plain text), the responses are the decoded ones,
    and the model's `score_texts` tokenises both with its own tokenizer, `chunk` rows at a time.
    `name` names it when a score is not finite (`checked_model_scores`)."""
    @torch.no_grad()
    def reward(prompts, responses, rollout, rows=None) -> RewardScores:
        scores = reward_model.score_texts([originals.get(p, p) for p in prompts],
                                          list(responses), chunk)
        return RewardScores(checked_model_scores(scores, name, prompts), {})
    return reward


@dataclass
class ModelReward:
    """A reward model ready for the loop: the `Reward` it gives, the model (frozen), and the
    model a critic may start from (it reads the policy's token ids), or None."""

    reward: Reward
    model: nn.Module
    critic_init: nn.Module | None


def check_chat_prompts(has_chat_template: bool, originals: dict[str, Prompt], name: str
                       ) -> None:
    """A reward model that reads text renders chat prompts with its own template: without one,
    chat prompts are refused at start-up (in process, and for a served model alike)."""
    if not has_chat_template and any(is_messages(p) for p in originals.values()):
        raise TetherError(f"the prompts are chat messages but the reward model {name} has no "
                          "chat template to render them with; give plain-text prompts, or a "
                          "reward model whose tokenizer has a chat_template")


def load_scoring_model(path: str, device, dtype: str = "float32",
                       trust_remote_code: bool = False) -> nn.Module:
    """The reward model at `path`, frozen on `device`: tether's own (`RewardModel`) or a
    sequence-classification model (`HubRewardModel`). Both score texts with `score_texts`; this
    is what `load_reward_model` loads and what `tether serve-rm` serves."""
    if reward_model_kind(path, trust_remote_code) == TETHER:
        model = RewardModel.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    else:
        model = load_hub_reward_model(path, dtype, trust_remote_code)
    return freeze(fuse_gelu(model), device)


def has_chat_template(model: nn.Module) -> bool:
    """Whether a reward model that reads text can render chat prompts (its tokenizer's template)."""
    return bool(getattr(model.tokenizer, "chat_template", None))


def load_reward_model(path: str, policy_tokenizer, originals: dict[str, Prompt], chunk: int,
                      device, dtype: str = "float32", trust_remote_code: bool = False
                      ) -> ModelReward:
    """The reward model at `path` (tether's own, or a sequence-classification model) as the
    loop's reward, scoring `chunk` rows per forward.

    Tether's own on the policy's vocabulary scores the policy's ids (the fast path); any other
    reads text (`reward_from_texts`). A critic can start from a model that reads the policy's
    ids: tether's own on the fast path, or a sequence-classification model whose vocabulary is
    the policy's (the policy may add a pad token to it).
    """
    policy_vocab = policy_tokenizer.get_vocab()
    model = load_scoring_model(path, device, dtype, trust_remote_code)
    if isinstance(model, RewardModel):
        fast = model.tokenizer.get_vocab() == policy_vocab
        if fast:  # the policy's ids index its embeddings
            check_same_vocabulary(policy_tokenizer, {"reward model": (None, model.backbone)})
            return ModelReward(reward_from_model(model, chunk, path), model, model)
        critic_init = None
    else:
        vocab = model.tokenizer.get_vocab()
        # the same ids for the same tokens, and no policy token it lacks but the pad tether added
        same_ids = (vocab.items() <= policy_vocab.items()
                    and set(policy_vocab) - set(vocab) <= {policy_tokenizer.pad_token})
        critic_init = model if same_ids and model.head is not None else None
    check_chat_prompts(has_chat_template(model), originals, path)
    return ModelReward(reward_from_texts(model, chunk, originals, path), model, critic_init)
