"""Work handed to an engine (`RolloutEngine.submit`): a batch of episodes, sampled turn by turn
through it. An engine that samples the trainer's own weights runs the work when its result is
first asked for (`Deferred`), exactly where the synchronous loop ran it. The engine sampling
ahead of the trainer (`tether.rl.engines.ahead`) runs it now, in a thread of the trainer's
process (`Background`), while the trainer updates: the environment's code runs there and each
turn is sampled by the generator process.

Both give `result()`: the work's return value, or the exception it raised, raised again in the
caller's thread (a bad environment is still one line).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")  # a job's result (the engines' `submit` share it)


class Deferred(Generic[T]):
    """`work()` run at the first `result()`, in the caller's thread."""

    def __init__(self, work: Callable[[], T]):
        self.work: Callable[[], T] | None = work
        self.value: T | None = None

    def result(self) -> T:
        if self.work is not None:
            work, self.work = self.work, None
            self.value = work()
        return self.value


class Background(Generic[T]):
    """`work()` run now in a daemon thread, after `after` (the job submitted before it) is over:
    jobs run one at a time, in the order they were submitted. A daemon thread, so that work
    waiting on a stopped generator or a hung environment cannot keep the process from
    exiting."""

    def __init__(self, work: Callable[[], T], after: Background | None = None):
        self.done = threading.Event()  # set when the work is over (its error kept for `result`)
        self.value: T | None = None
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(work, after), daemon=True,
                         name="tether-ahead").start()

    def _run(self, work: Callable[[], T], after: Background | None) -> None:
        if after is not None:
            after.done.wait()
        try:
            self.value = work()
        except BaseException as exc:  # noqa: BLE001 - raised again by `result`, in the caller
            self.error = exc
        finally:
            self.done.set()

    def result(self) -> T:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value
