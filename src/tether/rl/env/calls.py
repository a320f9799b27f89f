"""Calling an environment's code: the factory, `reset`, `step` and `close`, sync or `async def`,
the episodes of a batch concurrently, each call under a timeout, each return checked.

Whatever the code does wrong stops the run with one line that names the environment, the call,
the episode and the fix, before anything of the batch reaches the optimiser, as a reward
function's errors do (tether.rl.reward): it raises (its file and line named; `sys.exit`
included), returns the wrong type, a non-finite reward, or does not return within
`--env-timeout` seconds. A KeyboardInterrupt it raises stops the run as Ctrl-C does.

The calls run on the user's code's runner (tether.run.user_code.calls): each in a daemon thread
of its own (a hung one cannot keep the process from exiting), at most `workers` at a time; an
`async def` method's coroutine on the process's one event loop (a client bound to a loop keeps
working), where one that blocks the loop ends the process with one line. An environment that
draws from Python's global random stream is not reproducible when its episodes overlap: draw
from `random.Random(seed)` (the seed `reset` receives) instead.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from tether.data.chat import chat_messages
from tether.errors import TetherError
from tether.rl.reward import MAX_SCORE
from tether.rl.reward.functions import out_of_range
from tether.run.user_code.calls import Call, Runner
from tether.run.user_code.load import function_name

INTACT = "(what the run wrote before is intact)"


class EnvCalls:
    """Runs batches of environment calls, each within `timeout` seconds (None: no limit, for
    --tools, whose steps time their own calls), `workers` at a time."""

    def __init__(self, factory: Callable, timeout: float | None, workers: int):
        self.factory, self.name = factory, function_name(factory)
        self.runner = Runner(workers, timeout=timeout or 0.0, timeout_flag="--env-timeout")

    def gather(self, calls: list[Callable[[], Any]], labels: list[str]) -> list[Any]:
        """`[call() for call in calls]`, run concurrently, awaited when they return awaitables;
        a failure is one line naming `labels[i]` (e.g. "step of episode 3 (row 7), turn 2"),
        the first in the calls' order."""
        outcomes = self.runner.run([Call(call, label=f"environment {self.name}: {label}")
                                    for call, label in zip(calls, labels)])
        for outcome, label in zip(outcomes, labels):
            if outcome.error is not None:
                raise TetherError(f"environment {self.name}: {label} {outcome.cause}; fix the "
                                  f"environment {INTACT}") from outcome.error
            if outcome.cause is not None:
                raise TetherError(f"environment {self.name}: {label} did not return within "
                                  f"{self.runner.timeout:g} s; fix the hang or raise --env-timeout "
                                  f"{INTACT}")
        return [outcome.value for outcome in outcomes]

    def make(self, count: int) -> list[Any]:
        """`count` fresh environments from the factory."""
        envs = self.gather([self.factory] * count, [f"make_env() for episode {i}"
                                                     for i in range(count)])
        for env in envs:
            if isinstance(env, type):  # its methods unbound: reset(row, seed) would miss a seed
                raise TetherError(f"environment factory {self.name} returned the class "
                                  f"{env.__name__}, not an environment; return {env.__name__}() "
                                  "(or pass the class itself as the factory)")
            if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
                raise TetherError(f"environment factory {self.name} returned a "
                                  f"{type(env).__name__}, which has no reset(row, seed) and "
                                  "step(action) methods; return an environment object "
                                  "(docs/agents.md)")
        return envs


def checked_prompt(value: Any, where: str) -> str | list[dict]:
    """A `reset` result: non-empty text, or chat messages (each content one string)."""
    if isinstance(value, str):
        if not value.strip():
            raise TetherError(f"{where} returned an empty prompt; return the episode's first "
                              "prompt as text or as chat messages")
        return value
    if isinstance(value, list):
        return chat_messages(value, "prompt", where)
    raise TetherError(f"{where} returned a {type(value).__name__}; return the episode's first "
                      "prompt as text (str) or chat messages (list of {role, content})")


def checked_step(value: Any, where: str) -> tuple[str | list[dict] | None, float, bool]:
    """A `step` result: (observation, reward, done) with an observation of None, text or chat
    messages, a finite real reward and a bool-like done."""
    fix = "return (observation, reward, done): observation None, a str or messages, a float, a bool"
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        shown = f"a {type(value).__name__}" + (f" of {len(value)}" if isinstance(value, (tuple, list))
                                               else "")
        raise TetherError(f"{where} returned {shown}; {fix}")
    observation, reward, done = value
    if isinstance(observation, list):
        observation = chat_messages(observation, "observation", where)
    elif observation is not None and not isinstance(observation, str):
        raise TetherError(f"{where} returned an observation of type {type(observation).__name__};"
                          f" {fix}")
    reward, done = _item(reward), _item(done)
    if not isinstance(reward, numbers.Real):  # bools count as 0 and 1, as a reward function's
        raise TetherError(f"{where} returned a reward of type {type(reward).__name__}; {fix}")
    why = out_of_range(float(reward))
    if why is not None:
        raise TetherError(f"{where} returned {why.replace('score', 'reward')}; return a finite "
                          f"float within +-{MAX_SCORE:g} (a failed episode is a low reward, not "
                          "NaN)")
    if not isinstance(done, (bool, int)) or isinstance(done, int) and done not in (0, 1):
        raise TetherError(f"{where} returned done={done!r}; {fix}")
    return observation, float(reward), bool(done)


def _item(value: Any) -> Any:
    """A 0-d tensor or numpy scalar as its Python number; anything else as it is."""
    return value.item() if getattr(value, "ndim", None) == 0 and hasattr(value, "item") else value
