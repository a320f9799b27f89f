"""A deadline on a call of the user's code (`--reward-fn`, `--gold-fn`; the guard of the event
loop, tether.run.user_code.calls): past it, one line and exit 2, whatever the call is doing.

    with Deadline(600, "reward function task:score did not return within 600 s ..."):
        scores = fn(prompts, responses)

The call runs where it is called, on the calling thread, so the user's code sees what it would
see without a deadline, and returns bit-identical results: the main thread (math_verify's parse
and verify time themselves with SIGALRM, which only the main thread may set:
huggingface/Math-Verify#50, trl#5281), torch's per-thread state (no_grad, autocast, the CUDA
device of a torchrun rank) and Python's (an asyncio loop, `threading.local`).

Nothing in Python can stop a thread from outside: a call blocked in C (a sleep, a socket read with
no timeout, a lock, a subprocess) never sees an exception raised into it. So the one watchdog
thread (a daemon, started by the first deadline) prints the line and ends the process with
`os._exit(2)` when a deadline passes, as `kill -9` would: checkpoints are written under a temp
name and renamed when complete (tether.run.checkpoint), so the last complete one is intact and
`--resume` goes on from it, and the run directory's lock dies with the process. Under torchrun
the rank whose call hung ends, and torchrun stops the others (docs/errors.md, "Several
processes"). From Python the process ends too (use a timeout of 0 to wait for ever instead).

Cost on the normal path: a lock taken twice and a dict entry per call, a few microseconds; the
watchdog sleeps until the earliest deadline and is woken only when a call sets an earlier one.
A call that holds the GIL in C for its whole duration (a regular expression that backtracks
for ever) starves the watchdog thread too, until it lets go.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time

EXIT_CODE = 2  # as every other error line's (tether.cli)


class _Watchdog:
    """The deadlines of the calls running now, and the daemon thread that watches them."""

    def __init__(self):
        self._cond = threading.Condition()
        self._deadlines: dict[int, tuple[float, str]] = {}  # token -> (deadline, error line)
        self._tokens = 0
        self._sleeping_until = math.inf  # the deadline the watchdog thread waits for
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, message: str) -> int:
        deadline = time.monotonic() + seconds
        with self._cond:
            self._tokens += 1
            self._deadlines[self._tokens] = (deadline, message)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, daemon=True,
                                                name="tether-watchdog")
                self._thread.start()
            elif deadline < self._sleeping_until:  # it would wake too late: wake it now
                self._cond.notify()
            return self._tokens

    def disarm(self, token: int) -> None:
        with self._cond:  # no wake-up: the watchdog finds the entry gone when it next looks
            del self._deadlines[token]

    def _watch(self) -> None:
        with self._cond:
            while True:
                deadline, message = min(self._deadlines.values(), default=(math.inf, ""))
                left = deadline - time.monotonic()
                if left <= 0:
                    _end_process(message() if callable(message) else message)
                # at most TIMEOUT_MAX at a time (a wait past it raises): --reward-fn-timeout 1e300
                wait = None if deadline == math.inf else min(left, threading.TIMEOUT_MAX)
                self._sleeping_until = deadline if wait is None else time.monotonic() + wait
                self._cond.wait(wait)


def _end_process(message: str) -> None:
    """The error line, on a line of its own (after a progress bar on a terminal), then exit."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to keep
            stream.flush()
    # Straight to the file descriptor: the stuck call may hold sys.stderr's lock.
    line = ("\n" if os.isatty(2) else "") + f"error: {message}\n"
    with contextlib.suppress(OSError):
        os.write(2, line.encode("utf-8", "replace"))
    os._exit(EXIT_CODE)


_WATCHDOG = _Watchdog()


def _forked() -> None:
    """A forked child (a sweep worker) has none of its parent's threads: a watchdog of its own."""
    global _WATCHDOG
    _WATCHDOG = _Watchdog()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forked)


class Deadline:
    """`with Deadline(seconds, message):` the block must end within `seconds` (0: no limit), or
    the process prints `error: <message>` and exits with code 2 (module docstring). `message`
    may be a function returning it, called only then."""

    __slots__ = ("seconds", "message", "token")

    def __init__(self, seconds: float, message: str):
        self.seconds, self.message, self.token = seconds, message, 0

    def __enter__(self) -> Deadline:
        if self.seconds > 0:
            self.token = _WATCHDOG.arm(self.seconds, self.message)
        return self

    def __exit__(self, *exc) -> None:
        if self.token:
            _WATCHDOG.disarm(self.token)
