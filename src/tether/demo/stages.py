"""The demo's independent stages, run `jobs` at a time, one process each.

After SFT and the reward model, every remaining piece of the demo (each PPO run at each seed,
DPO, IPO, the SFT model's evaluation, each sweep run) reads only their outputs and writes only
its own run directory. So they can run side by side: each in a worker process with one torch
thread, its console output in `logs/<stage>.log`. Every stage seeds itself from its config, so
the numbers equal a one-at-a-time run's bit for bit (tests/demo/test_demo_stages.py).

Order: longest first (by `cost`, in PPO batches), the classic rule for packing jobs on machines
(Graham 1969), so that no long run starts last while a core sits idle.

The workers start before SFT (`Workers`), so their imports (torch, transformers, the trainers:
seconds of CPU each) run on the cores SFT leaves free instead of after it, on the critical path.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Stage:
    """One independent piece of work: `fn(*args)` returns what the report needs of it."""

    name: str  # as printed; its log is logs/<name>.log
    cost: float  # expected work in PPO batches of the demo's size: the order and the time left
    fn: Callable[..., Any]  # a module-level function, so a worker process can import it
    args: tuple = ()


def available_cores() -> int:
    """The cores this process may run on (a container's or taskset's limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


_ALL_WORKERS = None  # a worker's barrier over every worker of its pool (`Workers.wait_ready`)


def _prepare_worker(modules: tuple[str, ...], one_at_a_time, all_workers) -> None:
    """A worker's start: the modules its stages will import, imported now and by one worker at
    a time (so the parent, importing and training too, keeps a core), then one torch thread (the
    cores are shared out by process) and quiet progress bars."""
    global _ALL_WORKERS
    _ALL_WORKERS = all_workers
    with one_at_a_time:
        import torch
        from transformers.utils import logging as hf_logging

        for module in modules:
            importlib.import_module(module)
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()


def _ready() -> int:
    return os.getpid()


def _meet(timeout: float) -> int:
    """Held until every worker of the pool holds one: so each of `jobs` calls runs on its own."""
    _ALL_WORKERS.wait(timeout)
    return os.getpid()


class Workers:
    """`jobs` worker processes, started on entry and warmed with `warm`'s imports while the
    caller goes on; none for jobs 1 (the stages then run in this process). On an error (or
    Ctrl-C) inside the block, the workers are stopped at once, not waited for."""

    def __init__(self, jobs: int, warm: tuple[str, ...] = ()):
        self.jobs, self.warm = jobs, warm
        self.pool: ProcessPoolExecutor | None = None
        self.children: list = []  # the worker processes (not any other child of this process)

    def __enter__(self) -> Workers:
        if self.jobs > 1:
            # spawn, not fork: a forked torch with threads already started can deadlock
            context = get_context("spawn")
            self.pool = ProcessPoolExecutor(max_workers=self.jobs, mp_context=context,
                                            initializer=_prepare_worker,
                                            initargs=(self.warm, context.Lock(),
                                                      context.Barrier(self.jobs)))
            # A spawning pool starts a worker per task that finds none idle: one task per worker
            # now, so that every worker starts (and imports) now, not when its first stage comes.
            before = set(multiprocessing.active_children())
            for _ in range(self.jobs):
                self.pool.submit(_ready)
            self.children = [c for c in multiprocessing.active_children() if c not in before]
        return self

    def wait_ready(self, timeout: float = 120.0) -> set[int]:
        """Wait until every worker has started and imported; returns their process ids."""
        if self.pool is None:
            return set()
        return {future.result() for future in
                [self.pool.submit(_meet, timeout) for _ in range(self.jobs)]}

    def close(self) -> None:
        """No more stages: the workers exit while the caller goes on (writing the report)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False)

    def __exit__(self, kind, error, trace) -> None:
        if self.pool is None:
            return
        if kind is None:
            self.pool.shutdown(wait=True)
            for child in self.children:  # (after close(), shutdown no longer waits for them)
                child.join()
            return
        # Stop now, not after the stages still running: their work is lost either way.
        self.pool.shutdown(wait=False, cancel_futures=True)
        for child in self.children:
            child.terminate()
        for child in self.children:
            child.join(5)
            if child.is_alive():  # SIGTERM not acted on in 5 s (a loaded machine): SIGKILL
                child.kill()
                child.join(5)


def _in_worker(stage: Stage, log: str) -> tuple[Any, float]:
    """A worker's side of one stage: its output in its log; returns (its result, its seconds)."""
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(out):
        result = stage.fn(*stage.args)
    return result, time.perf_counter() - start


class Clock:
    """Progress over all stages: `[5/13] ppo-fixed-seed1 finished in 41 s; 2 running, 6 to
    start; 120 s so far, about 95 s left`. The time left divides the work not yet done (in cost
    units, the running stages' elapsed share taken off) by the rate measured on finished ones."""

    def __init__(self, stages: list[Stage], jobs: int, started: float, done_before: int,
                 total: int):
        self.cost = {s.name: s.cost for s in stages}
        self.jobs, self.started, self.count, self.total = jobs, started, done_before, total
        self.began: dict[str, float] = {}
        self.seconds_per_unit: list[float] = []

    def start(self, name: str) -> None:
        self.began[name] = time.perf_counter()

    def left(self, waiting: list[str]) -> str:
        if not self.seconds_per_unit:
            return ""
        rate = sum(self.seconds_per_unit) / len(self.seconds_per_unit)
        now = time.perf_counter()
        running = sum(max(0.0, self.cost[n] * rate - (now - t)) for n, t in self.began.items())
        queued = sum(self.cost[n] for n in waiting) * rate
        return f", about {(running + queued) / self.jobs:.0f} s left"

    def finish(self, name: str, seconds: float, waiting: list[str]) -> None:
        self.began.pop(name, None)
        self.count += 1
        self.seconds_per_unit.append(seconds / self.cost[name])
        print(f"[{self.count}/{self.total}] {name} finished in {seconds:.0f} s; "
              f"{len(self.began)} running, {len(waiting)} to start; "
              f"{time.perf_counter() - self.started:.0f} s so far{self.left(waiting)}",
              flush=True)


def run_stages(stages: list[Stage], jobs: int, log_dir: Path, clock: Clock,
               keep_going: Callable[[Stage], bool] = lambda stage: False,
               workers: Workers | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Run every stage, `jobs` at a time; returns ({name: result}, {name: error}).

    jobs 1 runs them here, one after another, printing as they go (as the demo always did); more
    run in `workers` (started here when not given). A stage that raises stops the demo with its
    error, unless `keep_going(stage)`: then its error is returned and the rest go on (a failed
    sweep run is reported on the sweep's page).
    """
    from tether.errors import TetherError
    from tether.run import interrupt

    order = sorted(stages, key=lambda s: -s.cost)  # stable: equal costs keep their order
    results: dict[str, Any] = {}
    failures: dict[str, str] = {}
    if jobs <= 1:
        for i, stage in enumerate(order):
            if stop := interrupt.between_steps():  # Ctrl-C during a stage that has no steps
                raise stop
            clock.start(stage.name)
            start = time.perf_counter()
            try:
                results[stage.name] = stage.fn(*stage.args)
            except TetherError as exc:
                if not keep_going(stage) or isinstance(exc, interrupt.Interrupted):
                    raise
                failures[stage.name] = str(exc)
            clock.finish(stage.name, time.perf_counter() - start,
                         [s.name for s in order[i + 1:]])
        return results, failures
    log_dir.mkdir(parents=True, exist_ok=True)
    if workers is None:
        with Workers(jobs) as own:
            return _run_in(own, order, log_dir, clock, keep_going, results, failures)
    return _run_in(workers, order, log_dir, clock, keep_going, results, failures)


def _run_in(workers: Workers, order: list[Stage], log_dir: Path, clock: Clock,
            keep_going: Callable[[Stage], bool], results: dict[str, Any],
            failures: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    from tether.errors import TetherError
    from tether.run import interrupt

    assert workers.pool is not None, "jobs 1 runs its stages in this process"
    waiting = list(order)
    running: dict[Future, Stage] = {}
    while waiting or running:
        while waiting and len(running) < workers.jobs:
            stage = waiting.pop(0)
            log = log_dir / f"{stage.name.replace('/', '-')}.log"
            running[workers.pool.submit(_in_worker, stage, str(log))] = stage
            clock.start(stage.name)
        # (a timeout, to see a stop asked of this process alone: `kill` of the demo's pid)
        done, _ = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
        if stop := interrupt.between_steps():  # the workers are stopped on the way out
            raise stop
        for future in done:
            stage = running.pop(future)
            try:
                results[stage.name], seconds = future.result()
            except TetherError as exc:
                if not keep_going(stage) or isinstance(exc, interrupt.Interrupted):
                    raise
                failures[stage.name] = str(exc)
                seconds = time.perf_counter() - clock.began[stage.name]
            clock.finish(stage.name, seconds, [s.name for s in waiting])
    return results, failures
