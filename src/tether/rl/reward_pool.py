"""The reward pool (--reward-workers N > 1): each response scored by its own call, N calls at a
time, each within --reward-fn-timeout seconds and tried again up to --reward-retries times; a
row whose score fails is a counted failure, never a silent zero, and never an error by itself.

    calls = [lambda: f([prompt_i], [response_i]) for each row i]    # one row per call
    outcomes = RewardPool(workers=8, retries=2, timeout=60).run(calls, check)
    # outcomes[i]: row i's score, or why it failed and after how many tries

Why one row per call: a reward that waits on something (an API judge, ~50 ms a call; a sandbox
running a program; a proof checker) is latency-bound per response, so the batch takes
ceil(B / N) waits instead of B; a retry repeats one response's call, not its batch's; a timeout
or a failure names one row and costs one group (the k responses of its prompt), not the batch.
A function that scores a batch faster as a whole (a model forward, a vectorised check) gains
nothing from the pool: keep it at --reward-workers 1, one call per batch. A function whose
score of a response depends on the other responses of the call (a rank within the batch) must
stay at 1 too: in the pool each call sees one row.

How: every call is a task on the process's event loop (tether.run.event_loop), at most N
running (a semaphore). An `async def` function's coroutine runs on that loop; a plain function
runs in a daemon thread of its own per call (so N threads at most, as a pool of N would have,
but a call past its timeout is left running in its thread without holding a worker for ever, or
keeping the process from exiting: nothing in Python can stop a thread). A plain function
therefore runs off the main thread: one that times itself with SIGALRM (math_verify's
`parse`/`verify` with their default timeout) cannot run in the pool.

A call fails when it raises (any exception; Ctrl-C stays Ctrl-C), or does not return within
the timeout: it is tried again, after RETRY_DELAY_S, then twice that, and so on (a rate limit
or a dropped connection often clears), up to `retries` times. A call that returns a NaN, inf or
out-of-range score fails at once: the function answered, and asking a deterministic function
again gets the same answer. A call that returns something that is not one number per response
(a set, the wrong count, a string) is a bug in the function: the batch stops with one line, as
without the pool. Scores come back in the rows' order, whatever order the calls finish in.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tether.errors import TetherError
from tether.rl.rewards import FailedRows, raised
from tether.run.distributed import Dist, all_gather_objects, all_gather_rows
from tether.run.event_loop import in_daemon_thread, run_coroutine
from tether.run.watchdog import Deadline

RETRY_DELAY_S = 0.1  # the wait before the first retry; each next one waits twice as long
MAX_RETRY_DELAY_S = 10.0  # ... up to this
MAX_WORKERS = 1024  # more concurrent calls than any endpoint or machine serves


class ScoreRefused(Exception):
    """What a `check` raises for a value that is a failed score (NaN, inf, out of range), not a
    bug in the function: the row fails without a retry."""


@dataclass(frozen=True)
class Call:
    """One call of the user's code: `run()` (its result, or an awaitable of it); `check(value)`
    turns its return into the value kept, raising ScoreRefused for a failed score and
    TetherError for a bug (which stops the batch once every call has ended); whether `run` is
    an `async def` function (its coroutine is made on the loop, not in a thread)."""

    run: Callable[[], Any]
    check: Callable[[Any], Any]
    is_async: bool
    own_file: str | None = None  # the function's file: the traceback line `raised` names


@dataclass
class Outcome:
    """One call's result: `value` (what `check` made of the return), or `cause` when it failed
    on every try; `tries`: calls made."""

    value: Any
    cause: str | None
    tries: int


def is_async_function(fn: Callable) -> bool:
    """`async def fn`, or an object whose `__call__` is one (a functools.partial of either)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return (inspect.iscoroutinefunction(fn)
            or inspect.iscoroutinefunction(vars(type(fn)).get("__call__")))


@dataclass(frozen=True)
class RewardPool:
    """`workers` calls at a time, each within `timeout` seconds (0: no limit), each tried again
    up to `retries` times after `retry_delay` seconds (doubling)."""

    workers: int
    retries: int = 2
    timeout: float = 0.0
    retry_delay: float = RETRY_DELAY_S

    def run(self, calls: list[Call]) -> list[Outcome]:
        """Every call's outcome, in the calls' order (a bug `Call.check` found: raised).

        The per-call timeouts need the loop to run; an `async def` function that blocks it (a
        synchronous request or sleep inside it) stops them all. So the whole batch also has a
        deadline, that of every call timing out on every try, one wave of `workers` after
        another, plus a minute: past it the process ends with one line (tether.run.watchdog),
        as a hung call without the pool does."""
        waves = -(-len(calls) // self.workers)  # ceil
        delays = sum(min(self.retry_delay * 2 ** j, MAX_RETRY_DELAY_S) for j in range(self.retries))
        bound = (waves * ((self.retries + 1) * self.timeout + delays) + 60.0) if self.timeout else 0
        hung = (f"the reward pool did not finish a batch within {bound:g} s, past every call's "
                "--reward-fn-timeout: an async def reward function blocks the event loop (a "
                "synchronous call inside it: use an async client, or a plain function); "
                "checkpoints written so far are intact")
        with Deadline(bound, hung):
            outcomes = run_coroutine(self._all(calls))
        bug = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if bug is not None:  # the first bug, in the rows' order
            raise bug
        return outcomes

    async def _all(self, calls: list[Call]) -> list[Any]:
        limit = asyncio.Semaphore(self.workers)

        async def one(call: Call) -> Outcome:
            async with limit:
                return await self._tried(call)
        return list(await asyncio.gather(*(one(c) for c in calls), return_exceptions=True))

    async def _tried(self, call: Call) -> Outcome:
        """One call, tried up to 1 + retries times (module docstring)."""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(min(self.retry_delay * 2 ** (attempt - 1), MAX_RETRY_DELAY_S))
            started = time.monotonic()
            try:
                value = await asyncio.wait_for(self._once(call), self.timeout or None)
            except TimeoutError as exc:  # ours, or one the user's code raised (socket.timeout)
                ours = self.timeout and time.monotonic() - started >= self.timeout
                cause = (f"did not return within {self.timeout:g} s (--reward-fn-timeout)"
                         if ours else f"raised {raised(exc, call.own_file)}")
                continue
            except (Exception, SystemExit) as exc:  # the user's code; Ctrl-C stays Ctrl-C
                cause = f"raised {raised(exc, call.own_file)}"
                continue
            try:
                return Outcome(call.check(value), None, attempt + 1)
            except ScoreRefused as refused:
                return Outcome(None, f"returned {refused}", attempt + 1)
        return Outcome(None, cause, self.retries + 1)

    @staticmethod
    async def _once(call: Call) -> Any:
        result = call.run() if call.is_async else await in_daemon_thread(call.run)
        return await result if inspect.isawaitable(result) else result


def pool_for(settings) -> RewardPool | None:
    """The pool `settings` ask for (a config with `reward_workers`, `reward_retries` and
    `reward_fn_timeout`: PPOConfig, EvalConfig), or None: 0 or 1 workers is one call per batch."""
    workers = settings.reward_workers
    return (RewardPool(workers, settings.reward_retries, settings.reward_fn_timeout)
            if workers > 1 else None)


def check_reward_pool(workers: int, retries: int, default_retries: int, has_functions: bool,
                      episodic: bool) -> None:
    """--reward-workers and --reward-retries: in range, and only where they act (Python reward
    or gold functions scoring a batch's responses), never accepted and ignored."""
    if not 0 <= workers <= MAX_WORKERS:
        raise TetherError(f"--reward-workers {workers} must lie in [0, {MAX_WORKERS}] (0 or 1: "
                          "one call per batch; N > 1: N rows scored at a time)")
    if retries < 0:
        raise TetherError(f"--reward-retries {retries} must be >= 0 (0: a failed call is not "
                          "tried again)")
    if workers > 1 and episodic:
        raise TetherError(f"--reward-workers {workers} scores a batch's responses in parallel; "
                          "an episode's reward is scored inside its environment's step, which "
                          "--env-workers already runs concurrently; drop it")
    if workers > 1 and not has_functions:
        raise TetherError(f"--reward-workers {workers} scores the rows of --reward-fn and "
                          "--gold-fn functions in parallel, and this run has none; drop it (a "
                          "reward model scores a batch in one forward)")
    if retries != default_retries and workers <= 1:
        raise TetherError(f"--reward-retries {retries} retries calls of the reward pool, and "
                          "there is none; pass --reward-workers N (N > 1) or drop it")


def no_failures(n: int) -> FailedRows:
    """The report of `n` rows that all scored."""
    return FailedRows(torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long), {})


def gather_failed(failed: FailedRows | None, offset: int, d: Dist) -> FailedRows | None:
    """Every rank's failed rows, in rank order, as the global batch's (`offset`: this rank's
    first row in it); the causes travel only when some row failed (every rank agrees on that,
    from the gathered mask)."""
    if failed is None:
        return None
    mask = all_gather_rows(failed.failed.to(torch.uint8), d).bool()  # gloo has no bool
    retries = all_gather_rows(failed.retries, d)
    causes: dict[int, str] = {}
    if mask.any():
        pairs = all_gather_objects([(row + offset, why) for row, why in failed.causes.items()], d)
        causes = dict(pairs)
    return FailedRows(mask, retries, causes)


def check_scored(failed: FailedRows | None, what: str) -> None:
    """Where a failed row cannot be drawn again (a held-out evaluation: its prompts are fixed),
    it stops the run with one line naming the first, as a raising function does without the
    pool."""
    if failed is None or not failed.causes:
        return
    first = min(failed.causes)
    raise TetherError(f"{len(failed.causes)} of {len(failed.failed)} responses of {what} have "
                      f"no score: response {first}: {failed.causes[first]}; fix the function, or raise "
                      "--reward-retries or --reward-fn-timeout; checkpoints written so far are "
                      "intact")
