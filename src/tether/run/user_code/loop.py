"""The process's one event loop for the user's coroutines (`async def` reward functions,
environments and tools), on a daemon thread of its own, started by the first coroutine and kept
for the process.

    scores = run_coroutine(fn(prompts, responses))   # from any thread; blocks until it ends

Why one loop, kept: an async client (httpx, aiohttp, an OpenAI client) binds its connections to
the loop that first used them, so a loop per call or per batch breaks it on the second batch
("Event loop is closed"). Why its own thread: the caller may itself be a worker thread (a --tools
episode's step), or run inside someone else's loop (a notebook), where `run_until_complete`
raises; a loop on another thread takes coroutines from anywhere (`run_coroutine_threadsafe`).
A daemon thread never keeps the process from exiting. A forked child (a sweep worker) has none
of its parent's threads: it starts a loop of its own.

SystemExit and KeyboardInterrupt raised by the user's code never reach asyncio: a task lets
those two out of the loop, which ends the loop's thread ("Task exception was never retrieved")
and leaves every caller waiting on it for ever. `guarded` carries them out as `Escaped`, and
`run_coroutine` raises the original in the caller's thread: a `sys.exit` is the caller's one
error line, a KeyboardInterrupt stops the run as Ctrl-C does.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

_LOCK = threading.Lock()
_LOOP: asyncio.AbstractEventLoop | None = None


class Escaped(Exception):
    """A SystemExit or KeyboardInterrupt the user's code raised on the loop (its `__cause__`),
    carried out as an ordinary exception (module docstring)."""


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's loop, running on its daemon thread (started on the first call)."""
    global _LOOP
    with _LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, daemon=True,
                             name="tether-event-loop").start()
        return _LOOP


def run_coroutine(awaitable: Awaitable) -> Any:
    """Run `awaitable` (a coroutine, or any awaitable) on the process's loop and return its
    result (or raise its exception), blocking the calling thread. Ctrl-C while waiting cancels
    it and stays Ctrl-C."""
    future = asyncio.run_coroutine_threadsafe(guarded(awaitable), event_loop())
    try:
        return future.result()
    except Escaped as escaped:
        raise escaped.__cause__ from None
    except KeyboardInterrupt:
        future.cancel()
        raise


async def guarded(awaitable: Awaitable) -> Any:
    """`await awaitable`, its SystemExit or KeyboardInterrupt raised as `Escaped` (in the same
    task, before asyncio sees it)."""
    try:
        return await awaitable
    except (SystemExit, KeyboardInterrupt) as exc:
        raise Escaped() from exc


async def in_daemon_thread(call: Callable[[], Any]) -> Any:
    """`call()` in a daemon thread of its own, awaited on the running loop. A caller that stops
    waiting (a timeout) leaves the thread running: nothing can stop a thread from outside, and a
    daemon thread neither holds a worker of a pool for ever nor keeps the process alive."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def work() -> None:
        try:
            outcome = (call(), None)
        except BaseException as exc:  # handed to the loop, which raises it in the awaiter
            outcome = (None, exc)
        loop.call_soon_threadsafe(_settle, done, *outcome)
    threading.Thread(target=work, daemon=True, name="tether-user-call").start()
    return await done


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # timed out or cancelled meanwhile: nobody waits for it
        if inspect.iscoroutine(result):
            result.close()  # an `async def` method's coroutine, never awaited, and never will be
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _forked() -> None:
    global _LOOP, _LOCK
    _LOOP, _LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forked)
