"""Calls of the user's code, N at a time, each within a timeout and tried again when it fails:
what the reward pool, an environment's batch of calls, a tool call and a served reward model's
posts all run on.

    outcomes = Runner(workers=8, retries=2, timeout=60).run(
        [Call(lambda: f([p], [r]), check) for p, r in zip(prompts, responses)])
    # outcomes[i]: call i's value, or why it failed and after how many tries

How: every call is a task on the process's event loop (tether.run.user_code.loop), at most
`workers` running (a semaphore). An `async def` function's coroutine runs on that loop; a plain
function runs in a daemon thread of its own per call (so `workers` threads at most, as a pool of
them would have, but a call past its timeout is left running in its thread without holding a
worker for ever, or keeping the process from exiting: nothing in Python can stop a thread); an
awaitable it returns (an `async def` method called there) is awaited on the loop. Outcomes come
back in the calls' order, whatever order the calls finish in.

A try fails when the call raises (any exception, `sys.exit` included) or does not return within
`timeout`: it is tried again after `retry_delay` seconds, then twice that, and so on (a rate
limit or a dropped connection often clears), up to `retries` times. A value its `check` refuses
(`Refused`: a NaN score) fails at once: the function answered, and asking a deterministic one
again gets the same answer. A TetherError (tether's verdict: a `check` that finds a bug in what
the function returned, tether's own code inside a call) is never retried: once every call has
ended, the first in the calls' order is raised. A KeyboardInterrupt from the user's code stops
every call and is raised in the caller, as Ctrl-C is.

The guard: the timeouts run on the loop, so an `async def` function that blocks it (time.sleep
or a synchronous request inside it) stops every one of them, its own too. While a coroutine of
the user's is awaited, a deadline (tether.run.user_code.deadline) of its timeout plus
LOOP_GRACE_S is armed: a loop that could not stop the call by then is blocked, and the process
ends with one line naming the call, as a hung call without a loop does.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tether.errors import TetherError
from tether.run.user_code.deadline import Deadline
from tether.run.user_code.load import raised
from tether.run.user_code.loop import Escaped, guarded, in_daemon_thread, run_coroutine

RETRY_DELAY_S = 0.1  # the wait before the first retry; each next one waits twice as long
MAX_RETRY_DELAY_S = 10.0  # ... up to this
# How late a timeout may act before the loop counts as blocked: a loop that is not blocked acts
# within milliseconds, so this is seconds of a coroutine of the user's holding it.
LOOP_GRACE_S = 5.0


class Refused(Exception):
    """What a `check` raises for a value that is a failed result (a NaN score), not a bug in the
    function: the call fails without a retry."""


@dataclass(frozen=True)
class Call:
    """One call of the user's code: `run()` (its result, or an awaitable of it); `check(value)`
    turns its return into the value kept, raising Refused for a failed result and TetherError
    for a bug; whether `run` is an `async def` function (its coroutine is made on the loop, not
    in a thread); the function's file (the traceback line `raised` names); `label`, what the
    guard's line calls it ("reward function task:score", "environment f:make: step of ...")."""

    run: Callable[[], Any]
    check: Callable[[Any], Any] = lambda value: value
    is_async: bool = False
    own_file: str | None = None
    label: str = "a call of your code"


@dataclass
class Outcome:
    """One call's result: `value` (what `check` made of the return), or `cause` when it failed
    on every try ("raised ...", "did not return within ...", "returned ..."), with `error`, what
    its last try raised (None: it timed out, or its value was refused); `tries`: calls made."""

    value: Any
    cause: str | None
    tries: int
    error: BaseException | None = None


@dataclass(frozen=True)
class Runner:
    """`workers` calls at a time, each within `timeout` seconds (0: no limit; `timeout_flag`, the
    option that sets it, named in lines), each tried again up to `retries` times after
    `retry_delay` seconds (doubling)."""

    workers: int = 1
    retries: int = 0
    timeout: float = 0.0
    retry_delay: float = RETRY_DELAY_S
    timeout_flag: str = ""

    def run(self, calls: list[Call]) -> list[Outcome]:
        """Every call's outcome, in the calls' order (module docstring)."""
        outcomes = run_coroutine(self._all(calls))
        bug = next((o for o in outcomes if isinstance(o, TetherError)), None)
        if bug is not None:  # the first, in the calls' order
            raise bug
        return outcomes

    async def _all(self, calls: list[Call]) -> list[Outcome | TetherError]:
        limit = asyncio.Semaphore(self.workers)

        async def one(call: Call) -> Outcome | TetherError:
            async with limit:
                return await self._tried(call)
        tasks = [asyncio.ensure_future(one(call)) for call in calls]
        try:
            return await asyncio.gather(*tasks)
        finally:  # a KeyboardInterrupt, or Ctrl-C in the caller: the other calls stop waiting
            for task in tasks:
                task.cancel()

    async def _tried(self, call: Call) -> Outcome | TetherError:
        """One call, tried up to 1 + retries times (module docstring)."""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(min(self.retry_delay * 2 ** (attempt - 1), MAX_RETRY_DELAY_S))
            started = time.monotonic()
            try:
                value = await asyncio.wait_for(guarded(self._once(call)), self.timeout or None)
                return Outcome(call.check(value), None, attempt + 1)
            except Refused as refused:
                return Outcome(None, f"returned {refused}", attempt + 1)
            except TetherError as bug:
                return bug
            except Escaped as escaped:
                if isinstance(escaped.__cause__, KeyboardInterrupt):
                    raise  # every call stops, and the caller gets the KeyboardInterrupt
                error = escaped.__cause__  # SystemExit: the call failed, as a raise does
            except TimeoutError as exc:  # ours, or one the user's code raised (socket.timeout)
                ours = self.timeout and time.monotonic() - started >= self.timeout
                error = None if ours else exc
            except Exception as exc:  # the user's code
                error = exc
        cause = (f"raised {raised(error, call.own_file)}" if error is not None
                 else f"did not return within {self.timeout:g} s{self._flag()}")
        return Outcome(None, cause, self.retries + 1, error)

    async def _once(self, call: Call) -> Any:
        """One try: `call.run()`, an awaitable it gives awaited under the guard."""
        started = time.monotonic()
        result = call.run() if call.is_async else await in_daemon_thread(call.run)
        if not inspect.isawaitable(result):
            return result
        if not self.timeout:
            return await result
        left = self.timeout + LOOP_GRACE_S - (time.monotonic() - started)
        blocked = (f"{call.label} did not return within {self.timeout:g} s{self._flag()} and "
                   "holds the event loop, so no timeout can act: an async def function that "
                   "waits without await (time.sleep, a synchronous request) blocks every call; "
                   "await asyncio.sleep or an async client instead, or write it as a plain "
                   "function; checkpoints written so far are intact")
        with Deadline(max(left, 1e-3), blocked):
            return await result

    def _flag(self) -> str:
        return f" ({self.timeout_flag})" if self.timeout_flag else ""
