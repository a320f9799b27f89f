"""Python reward functions as the loop's reward: tether's form and TRL's, one or several, weighted.

Two ways to write a reward function, told apart by its signature (`takes_trl_arguments`):

    tether's   fn(prompts, responses): the prompt texts the policy continued (a chat rendered by
               its template) and the decoded responses, all strings
    TRL's      fn(prompts, completions, completion_ids, **kwargs), called with keywords as TRL's
               GRPOTrainer calls it: each prompt as its row gave it (a string, or the chat's
               messages), each completion a string, or for a chat prompt one assistant message
               `[{"role": "assistant", "content": text}]`; `completion_ids` the sampled token ids
               of each response (EOS included, as the policy sampled it); every other column of
               the prompt file by its name (a list aligned with the batch, a prompt answered k
               times repeated k times); and `trainer_state` (a transformers `TrainerState` whose
               `global_step` is the batches done and `max_steps` the run's batches)

Several functions (`--reward-fn a.py:f,b.py:g --reward-weights 1,0.5`) score each response with
their weighted sum. A function may return None for a response it does not apply to (TRL's
convention): that entry is left out of the sum (NaN, summed with nansum), and a response that
every function left out stops the run with one line, since it has no score to learn from. Each
function's own scores come back beside the sum (`RewardScores.parts`), for `reward/<name>`.

Without a pool each function is called once per batch (`call_reward_function`), on the calling
thread, under --reward-fn-timeout's deadline (tether.run.user_code.deadline); Ctrl-C inside it
stays Ctrl-C. With a pool (--reward-workers N > 1, tether.rl.reward.pool) each function is called once per
response, N calls at a time, every function's calls together; a response whose score failed in
any function (after its retries) has a NaN score and is named in `RewardScores.failed`, for the
loop to drop its group and draw again. Either way a function may be `async def`.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from transformers import TrainerState

from tether.data.prompts import prompt_messages
from tether.errors import TetherError
from tether.rl.reward import MAX_SCORE, FailedRows, RewardFn, RewardScores
from tether.rl.reward.pool import RewardPool
from tether.run.user_code.calls import Call, Refused
from tether.run.user_code.deadline import Deadline
from tether.run.user_code.load import (
    function_name,
    is_async_function,
    load_function,
    own_file,
    raised,
)
from tether.run.user_code.loop import run_coroutine

# The keywords a TRL-style function is called with besides the prompt file's columns
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state")
# Columns that are the prompt or a reference completion, never passed as keywords (TRL drops
# `prompt`, `completion` and `completion_ids`; `messages` is tether's other prompt column)
PROMPT_COLUMNS = frozenset({"prompt", "messages", "completion", "completion_ids"})
FIX = "it must return a list of one finite float per response, in their order"


@dataclass(frozen=True)
class RewardFunction:
    """One reward function, the name its metric goes by (`reward/<name>`) and its weight."""

    fn: Callable
    name: str
    weight: float = 1.0


def load_reward_functions(spec: str) -> list[Callable]:
    """The functions `--reward-fn` names: `file.py:f` or several joined by commas."""
    return [load_function(name.strip(), "reward function") for name in spec.split(",")
            if name.strip()]


def weighted(functions: Sequence[Callable], weights: Sequence[float]) -> list[RewardFunction]:
    """`functions` with their `weights` (none given: 1 each, TRL's default) and metric names:
    each its `__name__`, numbered from the second on when two share one (`f`, `f_2`)."""
    if weights and len(weights) != len(functions):
        raise TetherError(f"--reward-weights has {len(weights)} weights for {len(functions)} "
                          "reward functions; give one weight per --reward-fn function, in order")
    if bad := [w for w in weights if not math.isfinite(w)]:
        raise TetherError(f"--reward-weights holds {bad[0]}; give finite numbers")
    names, seen = [], {}
    for fn in functions:
        name = getattr(fn, "__name__", type(fn).__name__)
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return [RewardFunction(fn, name, float(w)) for fn, name, w in
            zip(functions, names, weights or [1.0] * len(functions), strict=True)]


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
    process prints one line and exits with code 2 (`tether.run.user_code.deadline`: a hung call
    cannot be stopped, only left)."""
    def hung() -> str:  # the deadline's line, built only when it passes
        return (f"{what} {function_name(fn)} did not return within {timeout:g} s "
                "(--reward-fn-timeout); fix the hang, or raise --reward-fn-timeout (0: no limit); "
                "checkpoints written so far are intact")
    try:
        with Deadline(timeout, hung):
            scores = (fn(**keywords) if keywords is not None
                      else fn(list(prompts), list(responses)))
            if inspect.isawaitable(scores):  # an `async def` function: its coroutine, run now
                scores = run_coroutine(scores)
    except (Exception, SystemExit) as exc:  # the user's code, on one line; Ctrl-C stays Ctrl-C
        raise TetherError(f"{what} {function_name(fn)} raised {raised(exc, own_file(fn))}; fix "
                          f"the function ({FIX}); checkpoints written so far are intact") from exc
    values = returned_scores(scores, len(responses), what, fn, allow_none)
    bad = [(i, why) for i, v in enumerate(values) if v is not None and (why := out_of_range(v))]
    if bad:
        raise TetherError(f"{what} {function_name(fn)} returned {bad[0][1]} for response "
                          f"{bad[0][0]}; {FIX}, each within +-{MAX_SCORE:g}")
    return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)


def returned_scores(scores: Any, n: int, what: str, fn: Callable, allow_none: bool = False
                    ) -> list[float | None]:
    """What the reward function `fn` returned for `n` responses, as floats (None kept with
    `allow_none`), or a TetherError unless `n` numbers in order; the caller checks the range.

    Numbers in a defined order are real numbers in a list or tuple (not a str, whose characters
    float() would read), or a 1-D tensor or array. `allow_none`: None items are kept (as None)
    instead of refusing the list."""
    if isinstance(scores, (list, tuple)):
        items = list(scores)
    elif getattr(scores, "ndim", None) == 1 and hasattr(scores, "tolist"):  # tensor, ndarray
        items = scores.tolist()
    else:  # a set or dict (no order of the responses'), a generator, a string, a scalar, None
        items = None
    if items is None or not all(_is_real(s) or (allow_none and s is None) for s in items):
        raise TetherError(f"{what} {function_name(fn)} returned {_shown(scores)}, not a list of "
                          f"numbers in the responses' order; {FIX}")
    values = [None if s is None else float(s) for s in items]
    if len(values) != n:
        raise TetherError(f"{what} {function_name(fn)} returned {len(values)} scores for {n} "
                          f"responses; {FIX}")
    return values


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


def out_of_range(value: float) -> str | None:
    """Why `value` cannot be a score (not finite, or past MAX_SCORE), or None."""
    if not math.isfinite(value):
        return f"a non-finite score ({value})"
    if abs(value) > MAX_SCORE:
        return f"a score of {value:g} (past +-{MAX_SCORE:g}: float32 maths on it overflows)"
    return None


def takes_trl_arguments(fn: Callable, columns: Sequence[str]) -> bool:
    """Whether `fn` is written for TRL's call: it names `completions`, `completion_ids` or
    `trainer_state`, or takes `**kwargs` and needs nothing but `prompts` and columns by name.
    Anything else (`fn(prompts, responses)`, `fn(p, r, **kw)`, a signature Python cannot read)
    is tether's form, called with two lists as before."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    names = {p.name for p in parameters}
    if names & {"completions", "completion_ids", "trainer_state"}:
        return True
    return (any(p.kind is p.VAR_KEYWORD for p in parameters)
            and required_parameters(fn) <= {"prompts", *columns})


def required_parameters(fn: Callable) -> set[str]:
    """The names `fn` cannot be called without (no default, not `*args` or `**kwargs`)."""
    return {p.name for p in inspect.signature(fn).parameters.values()
            if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def row_columns(rows: Sequence[dict]) -> dict[str, list]:
    """The rows' other columns by name, each a list aligned with `rows` (None where a row lacks
    it). A column named like a TRL argument could not be told apart from it: refused."""
    names = [k for k in dict.fromkeys(k for row in rows for k in row) if k not in PROMPT_COLUMNS]
    if clash := [k for k in names if k in TRL_ARGUMENTS]:
        raise TetherError(f"the prompt file has a column {clash[0]!r}, a name the reward "
                          "functions are called with; rename that column")
    return {k: [row.get(k) for row in rows] for k in names}


def trl_arguments(prompts: list[str], responses: list[str], rows: Sequence[dict] | None,
                  completion_ids: list[list[int]] | None, state: TrainerState) -> dict[str, Any]:
    """The keywords of TRL's call (module docstring). Without `rows` the prompts are the texts
    and there are no columns; without `completion_ids` (an answer inside an episode) that
    keyword is left out."""
    # each prompt as its row gave it: the chat's messages (never []), else the plain text
    originals = ([prompt_messages(row) or text for row, text in zip(rows, prompts, strict=True)]
                 if rows is not None else list(prompts))
    completions = [[{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
                   for prompt, text in zip(originals, responses, strict=True)]
    keywords = {"prompts": originals, "completions": completions, "trainer_state": state}
    if completion_ids is not None:
        keywords["completion_ids"] = completion_ids
    return keywords | (row_columns(rows) if rows is not None else {})


@dataclass
class RewardFunctions:
    """Reward functions as the loop's `Reward` (tether.rl.reward): called on every batch,
    checked, weighted and summed. `state` is what TRL-style functions get as `trainer_state`
    (the loop moves its `global_step`); `what` names them in errors; `timeout`: seconds each
    call may take (--reward-fn-timeout; 0: no limit); `pool`: each response its own call, N at
    a time (--reward-workers; None: one call per batch)."""

    functions: list[RewardFunction]
    what: str = "reward function"
    state: TrainerState = field(default_factory=TrainerState)
    timeout: float = 0.0
    pool: RewardPool | None = None

    def __call__(self, prompts: list[str], responses: list[str], rollout,
                 rows: list[dict] | None = None) -> RewardScores:
        return self.score(prompts, responses, rows, rollout.sampled_ids())

    def score(self, prompts: list[str], responses: list[str], rows: list[dict] | None,
              completion_ids: list[list[int]] | None) -> RewardScores:
        """Each function's scores, and their weighted sum over the functions that applied."""
        each = self.keywords(prompts, responses, rows, completion_ids)
        if self.pool is not None:
            return self.pooled(prompts, responses, each)
        parts = {f.name: call_reward_function(f.fn, prompts, responses, self.what, keywords,
                                              allow_none=True, timeout=self.timeout)
                 for f, keywords in zip(self.functions, each)}
        return self.summed(parts, prompts)

    def keywords(self, prompts: list[str], responses: list[str], rows: list[dict] | None,
                 completion_ids: list[list[int]] | None) -> list[dict[str, Any] | None]:
        """Each function's keywords: TRL's (`trl_arguments`, built once for them all), or None
        for a function of tether's form."""
        columns = list(row_columns(rows)) if rows is not None else []
        trl = [takes_trl_arguments(f.fn, columns) for f in self.functions]
        keywords = (trl_arguments(prompts, responses, rows, completion_ids, self.state)
                    if any(trl) else None)
        for f in (f for f, t in zip(self.functions, trl) if t):
            missing = sorted(required_parameters(f.fn) - set(keywords) - set(TRL_ARGUMENTS))
            if missing:  # TRL passes the dataset's columns by name: one the rows lack, named
                raise TetherError(f"{self.what} {function_name(f.fn)} takes {missing[0]!r}, a "
                                  "column the prompt file's rows lack (they have: "
                                  f"{', '.join(columns) or 'none'}); add {missing[0]!r} to every "
                                  "row of the --prompts file (and of --eval-prompts), or give "
                                  "the parameter a default")
        return [keywords if t else None for t in trl]

    def summed(self, parts: dict[str, torch.Tensor], prompts: list[str],
               failed: torch.Tensor | None = None) -> RewardScores:
        """The weighted sum of the functions' scores `parts` (NaN: None, left out), NaN on the
        `failed` rows; a row that no function scored, and none failed, stops the run."""
        stacked = torch.stack(list(parts.values()), dim=1)  # [B, F]
        failed = torch.zeros(len(stacked), dtype=torch.bool) if failed is None else failed
        unscored = torch.isnan(stacked).all(dim=1) & ~failed
        if unscored.any():
            i = int(unscored.nonzero()[0])
            raise TetherError(f"every {self.what} returned None for response {i} (prompt "
                              f"{prompts[i][:60]!r}); make at least one function score every "
                              "response")
        scores = (stacked * torch.tensor([f.weight for f in self.functions])).nansum(dim=1)
        return RewardScores(scores.masked_fill(failed, math.nan), parts)

    def pooled(self, prompts: list[str], responses: list[str], each: list) -> RewardScores:
        """`score` through the pool: every function on every response, one response per call
        (tether.rl.reward.pool), the outcomes back in the rows' order; `each`: `keywords`."""
        n = len(responses)
        calls = []
        for f, keywords in zip(self.functions, each):
            name = function_name(f.fn)
            check = partial(one_score, self.what, f.fn)
            for i in range(n):  # TRL's keywords for row i alone: each list cut to its item
                run = (partial(f.fn, **{k: v if k == "trainer_state" else v[i:i + 1]
                                        for k, v in keywords.items()}) if keywords is not None
                       else partial(f.fn, [prompts[i]], [responses[i]]))
                calls.append(Call(run, check, is_async_function(f.fn), own_file(f.fn),
                                  f"{self.what} {name}"))
        outcomes = self.pool.run(calls)
        parts, failed = {}, torch.zeros(n, dtype=torch.bool)
        retries, causes = torch.zeros(n, dtype=torch.long), {}
        for j, f in enumerate(self.functions):
            mine = outcomes[j * n:(j + 1) * n]
            parts[f.name] = torch.tensor([math.nan if o.value is None else o.value for o in mine],
                                         dtype=torch.float32)
            for i, o in enumerate(mine):
                retries[i] += o.tries - 1
                if o.cause is not None and i not in causes:
                    failed[i] = True
                    tries = f"{o.tries} tr{'y' if o.tries == 1 else 'ies'}"
                    causes[i] = (f"{self.what} {function_name(f.fn)} {o.cause} (prompt "
                                 f"{prompts[i][:40]!r}; {tries})")
        scored = self.summed(parts, prompts, failed)
        return scored._replace(failed=FailedRows(failed, retries, causes))


def one_score(what: str, fn: Callable, value: Any) -> float | None:
    """A pooled call's return (one response's): its score, None (the function does not apply),
    `Refused` when it is NaN, inf or out of range (a failed row), TetherError when it is not
    one number (a bug: `returned_scores`). `what` and `fn` name the function in errors."""
    [score] = returned_scores(value, 1, what, fn, allow_none=True)
    if score is not None and (why := out_of_range(score)):
        raise Refused(why)
    return score


def reward_from_functions(functions: Sequence[Callable], weights: Sequence[float] = (),
                          what: str = "reward function", max_steps: int = 0,
                          timeout: float = 0.0, pool: RewardPool | None = None
                          ) -> RewardFunctions:
    """`functions` (with `weights`) as the loop's reward; `max_steps`: the run's batches;
    `timeout`: seconds each call may take (0: no limit); `pool`: the reward pool, or None."""
    return RewardFunctions(weighted(functions, list(weights)), what,
                           TrainerState(global_step=0, max_steps=max_steps), timeout, pool)
