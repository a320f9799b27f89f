"""Calling an environment's code: the factory, `reset` and `step`, sync or `async def`, the
episodes of a batch concurrently, each call under a timeout, each return checked.

Whatever the code does wrong stops the run with one line that names the environment, the call,
the episode and the fix, before anything of the batch reaches the optimiser, as a reward
function's errors do (tether.rl.rewards): it raises (its file and line named), returns the wrong
type, a non-finite reward, or does not return within `--env-timeout` seconds. A synchronous
call runs in a daemon thread of its own, so a hung one cannot keep the process from exiting.

Concurrency: async calls run together on one event loop kept for the run (a client bound to a
loop keeps working); sync calls each in a thread, at most `workers` at a time. An environment
that draws from Python's global random stream is not reproducible when its episodes overlap:
draw from `random.Random(seed)` (the seed `reset` receives) instead.
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
import threading
from collections.abc import Callable
from typing import Any

from tether.data.chat import chat_messages
from tether.errors import TetherError
from tether.rl.rewards import MAX_SCORE, function_name, out_of_range, raised


class EnvCalls:
    """Runs batches of environment calls, each within `timeout` seconds (None: no limit, for
    --tools, whose steps time their own calls); `close()` stops its event loop."""

    def __init__(self, factory: Callable, timeout: float | None, workers: int):
        self.factory, self.name = factory, function_name(factory)
        self.timeout, self.loop = timeout, asyncio.new_event_loop()
        self.workers = workers

    def gather(self, calls: list[Callable[[], Any]], labels: list[str]) -> list[Any]:
        """`[call() for call in calls]`, run concurrently, awaited when they return awaitables;
        a failure is one line naming `labels[i]` (e.g. "step of episode 3 (row 7), turn 2")."""
        limit = asyncio.Semaphore(self.workers) if calls else None

        async def one(call: Callable[[], Any], label: str) -> Any:
            async with limit:
                try:
                    return await asyncio.wait_for(self._run(call), self.timeout)
                except asyncio.TimeoutError:
                    raise TetherError(f"environment {self.name}: {label} did not return within "
                                      f"{self.timeout:g} s; fix the hang or raise --env-timeout "
                                      "(what the run wrote before is intact)") from None
                except TetherError:
                    raise
                except (Exception, SystemExit) as exc:  # the user's code; Ctrl-C stays Ctrl-C
                    raise TetherError(f"environment {self.name}: {label} raised {raised(exc)}; "
                                      "fix the environment (what the run wrote before is "
                                      "intact)") from exc

        async def every() -> list[Any]:
            return list(await asyncio.gather(*(one(c, lab) for c, lab in zip(calls, labels)),
                                             return_exceptions=True))
        results = self.loop.run_until_complete(every())
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:  # the first episode's failure, whichever finished first
            raise failed
        return results

    async def _run(self, call: Callable[[], Any]) -> Any:
        """`call()` in a daemon thread; an awaitable it returns (an `async def` method's
        coroutine, created there and not yet run) is awaited on the loop."""
        done: asyncio.Future = self.loop.create_future()

        def work() -> None:
            try:
                outcome = (call(), None)
            except BaseException as exc:  # handed to the loop, which raises it there
                outcome = (None, exc)
            try:
                self.loop.call_soon_threadsafe(_settle, done, *outcome)
            except RuntimeError:  # the loop closed after a timeout: nobody waits for it
                if inspect.iscoroutine(outcome[0]):
                    outcome[0].close()  # never awaited, and never will be
        threading.Thread(target=work, daemon=True, name="tether-env").start()
        result = await done
        return await result if inspect.isawaitable(result) else result

    def make(self, count: int) -> list[Any]:
        """`count` fresh environments from the factory."""
        envs = self.gather([self.factory] * count, [f"make_env() for episode {i}"
                                                     for i in range(count)])
        for env in envs:
            if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
                raise TetherError(f"environment factory {self.name} returned a "
                                  f"{type(env).__name__}, which has no reset(row, seed) and "
                                  "step(action) methods; return an environment object "
                                  "(docs/agents.md)")
        return envs

    def close(self) -> None:
        self.loop.close()


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # timed out meanwhile: nobody waits for it
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


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
    if getattr(reward, "ndim", None) == 0 and hasattr(reward, "item"):
        reward = reward.item()  # a 0-d tensor or numpy scalar
    if not isinstance(reward, numbers.Real):  # bools count as 0 and 1, as a reward function's
        raise TetherError(f"{where} returned a reward of type {type(reward).__name__}; {fix}")
    why = out_of_range(float(reward))
    if why is not None:
        raise TetherError(f"{where} returned {why.replace('score', 'reward')}; return a finite "
                          f"float within +-{MAX_SCORE:g} (a failed episode is a low reward, not "
                          "NaN)")
    if getattr(done, "ndim", None) == 0 and hasattr(done, "item"):
        done = done.item()
    if not isinstance(done, (bool, int)) or isinstance(done, int) and done not in (0, 1):
        raise TetherError(f"{where} returned done={done!r}; {fix}")
    return observation, float(reward), bool(done)
