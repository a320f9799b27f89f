"""The runner of the user's code (tether.run.user_code.calls): N calls at a time, a timeout and
retries each, outcomes in the calls' order, sync and `async def` calls alike, SystemExit and
KeyboardInterrupt carried out of the event loop, and the guard against a blocked loop.

Independent truths: counters the calls keep themselves (how many ran at once, when each try
began), the order they were made in, and the clock.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest

import tether
from tether.errors import TetherError
from tether.run.user_code.calls import LOOP_GRACE_S, Call, Refused, Runner
from tether.run.user_code.loop import event_loop, run_coroutine


class Meter:
    """Calls that sleep `seconds[i]` and count how many run at once and the order they end in."""

    def __init__(self, seconds: list[float]):
        self.seconds, self.lock = seconds, threading.Lock()
        self.running = self.most = 0
        self.ended: list[int] = []

    def _enter(self) -> None:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)

    def _leave(self, i: int) -> int:
        with self.lock:
            self.running -= 1
            self.ended.append(i)
        return i * 10

    def sync_call(self, i: int):
        def run():
            self._enter()
            time.sleep(self.seconds[i])
            return self._leave(i)
        return Call(run)

    def async_call(self, i: int):
        async def run():
            self._enter()
            await asyncio.sleep(self.seconds[i])
            return self._leave(i)
        return Call(run, is_async=True)


# Call i sleeps longer the earlier it is: they end in the reverse of their order in each wave
SECONDS = [0.02 * (12 - i) for i in range(12)]


@pytest.mark.parametrize("kind", ["sync_call", "async_call"])
def test_n_at_a_time_and_the_outcomes_in_the_calls_order(kind):
    meter = Meter(SECONDS)
    outcomes = Runner(workers=4).run([getattr(meter, kind)(i) for i in range(12)])
    assert meter.most == 4  # never more than 4 at once, and 4 were reached
    assert meter.ended != sorted(meter.ended)  # they ended out of order ...
    assert [o.value for o in outcomes] == [10 * i for i in range(12)]  # ... came back in order
    assert all(o.cause is None and o.tries == 1 and o.error is None for o in outcomes)


def test_a_sync_and_an_async_call_give_the_same_outcomes():
    def plain(x):
        if x < 0:
            raise ValueError("negative")
        return x * 2

    async def coroutine(x):
        return plain(x)
    for runner in (Runner(), Runner(workers=3, retries=1, retry_delay=0.01)):
        made = [runner.run([Call(partial(fn, x), is_async=fn is coroutine) for x in (1, -1, 2)])
                for fn in (plain, coroutine)]
        sync, asynchronous = ([(o.value, o.cause.split(" (at")[0] if o.cause else None, o.tries)
                               for o in outcomes] for outcomes in made)
        tries = runner.retries + 1
        assert sync == asynchronous == [(2, None, 1), (None, "raised ValueError: negative",
                                                        tries), (4, None, 1)]


@pytest.mark.parametrize("is_async", [False, True])
def test_a_call_past_its_timeout_is_left_and_named(is_async):
    async def waits():
        await asyncio.sleep(30)

    def sleeps():
        time.sleep(30)  # a daemon thread, left running
    started = time.monotonic()
    [outcome] = Runner(timeout=0.2, timeout_flag="--env-timeout").run(
        [Call(waits if is_async else sleeps, is_async=is_async)])
    assert time.monotonic() - started < 5
    assert (outcome.value, outcome.cause, outcome.tries, outcome.error) == (
        None, "did not return within 0.2 s (--env-timeout)", 1, None)


def test_retries_wait_their_delays_doubling():
    # 3 failures then a value: tries at 0, then after 0.05, 0.1 and 0.2 s (each doubled).
    began: list[float] = []

    def flaky():
        began.append(time.monotonic())
        if len(began) <= 3:
            raise ConnectionError(f"try {len(began)}")
        return "ok"
    [outcome] = Runner(retries=3, retry_delay=0.05).run([Call(flaky)])
    assert (outcome.value, outcome.tries) == ("ok", 4)
    gaps = [b - a for a, b in zip(began, began[1:])]
    for gap, delay in zip(gaps, (0.05, 0.1, 0.2), strict=True):
        assert delay <= gap < delay + 0.5, gaps
    began.clear()
    [failed] = Runner(retries=1, retry_delay=0.01).run([Call(flaky)])  # tries 1 and 2 fail
    assert failed.cause.startswith("raised ConnectionError: try 2 (at ") and failed.tries == 2
    assert isinstance(failed.error, ConnectionError)


def test_a_refused_value_is_not_retried_and_a_bug_is_raised_after_every_call():
    calls = {"refused": 0, "late": 0}

    def refused():
        calls["refused"] += 1
        return float("nan")

    def check(value):
        if value != value:
            raise Refused("a non-finite score (nan)")
        if value < 0:
            raise TetherError(f"bug {value}")
        return value

    def late():
        time.sleep(0.2)
        calls["late"] += 1
        return 1.0
    runner = Runner(workers=4, retries=3, retry_delay=0.01)
    [outcome] = runner.run([Call(refused, check)])
    assert (outcome.cause, outcome.tries, calls["refused"]) == (
        "returned a non-finite score (nan)", 1, 1)
    with pytest.raises(TetherError, match=r"^bug -1\.0$"):  # the first bug in the calls' order
        runner.run([Call(late, check), Call(lambda: -1.0, check), Call(lambda: -2.0, check)])
    assert calls["late"] == 1  # the batch ended first


@pytest.mark.parametrize("is_async", [False, True])
def test_sys_exit_is_a_failed_try_and_ctrl_c_is_the_caller_s(is_async):
    def exits():
        sys.exit(3)

    def interrupts():
        raise KeyboardInterrupt

    async def exits_async():
        exits()

    async def interrupts_async():
        interrupts()

    def hangs():
        time.sleep(30)
    [outcome] = Runner().run([Call(exits_async if is_async else exits, is_async=is_async)])
    assert outcome.cause.startswith("raised SystemExit(3): it called sys.exit (at ")
    assert isinstance(outcome.error, SystemExit)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):  # at once: the hung call is not waited for
        Runner(workers=2).run([Call(hangs), Call(interrupts_async if is_async else interrupts,
                                                 is_async=is_async)])
    assert time.monotonic() - started < 5
    assert Runner().run([Call(lambda: 7)])[0].value == 7  # the loop goes on


def test_a_coroutine_that_exits_raises_in_the_caller_and_the_loop_lives_on():
    async def exits():
        sys.exit(4)

    async def answers():
        return 5
    loop = event_loop()
    with pytest.raises(SystemExit):
        run_coroutine(exits())
    assert run_coroutine(answers()) == 5 and event_loop() is loop and loop.is_running()


def test_the_guard_ends_a_process_whose_event_loop_is_blocked(tmp_path):
    """An `async def` call that sleeps without await: its timeout cannot act, and past it and
    the grace the process ends with one line naming the call, exit 2 (before the guard: for
    ever). A call beside it that awaits is not what the line names."""
    script = tmp_path / "blocked.py"
    script.write_text(
        "import asyncio, time\n"
        "from tether.run.user_code.calls import Call, Runner\n"
        "async def blocks():\n"
        "    time.sleep(60)\n"
        "async def waits():\n"
        "    await asyncio.sleep(60)\n"
        "Runner(workers=2, timeout=0.5, timeout_flag='--env-timeout').run([\n"
        "    Call(blocks, is_async=True, label='environment e:E: step of episode 0'),\n"
        "    Call(waits, is_async=True, label='environment e:E: step of episode 1')])\n"
        "print('not reached')\n")
    src = str(Path(tether.__file__).resolve().parents[1])
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, env=os.environ | {"PYTHONPATH": src})
    took = time.monotonic() - started
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.splitlines() == [
        "error: environment e:E: step of episode 0 did not return within 0.5 s (--env-timeout) "
        "and holds the event loop, so no timeout can act: an async def function that waits "
        "without await (time.sleep, a synchronous request) blocks every call; await "
        "asyncio.sleep or an async client instead, or write it as a plain function; "
        "checkpoints written so far are intact"]
    assert 0.5 + LOOP_GRACE_S <= took < 0.5 + LOOP_GRACE_S + 30
