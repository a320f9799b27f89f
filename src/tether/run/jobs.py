"""Independent jobs run `jobs` at a time, each in a warm worker process: the runs of `tether
sweep --jobs N` and the demo's stages after SFT and the reward model.

    Workers(n, warm)    n worker processes, started at once; each imports `warm` and takes one
                        torch thread while the caller goes on
    run_jobs(...)       every job, longest first: here, one after another (jobs 1), or each in
                        the next free worker, its output in logs/<name>.log
    Progress            one line per job that ends: `[5/13] ppo-fixed-seed1 finished in 41 s;
                        2 running, 6 to start; 120 s so far, about 95 s left`

Each job seeds itself from its config, so its numbers are the same in a worker as in this
process, bit for bit (tests/run/test_jobs.py; tests/demo/test_demo.py on a whole stage).

Why processes, one torch thread each: the jobs are small models that gain nothing from a second
intra-op thread (docs/benchmarks.md, "CPU threads"), so the cores are shared out by process.
Why spawn, not fork: a forked child of a process whose torch has already started threads can
deadlock (fork copies the locks, not the threads that hold them).
Why warm: a worker's imports (torch, transformers, the trainers: seconds of CPU each) run as soon
as it starts, on cores the caller leaves free (the demo trains SFT meanwhile), one worker at a
time; and a worker takes job after job, so they are paid once per worker, not once per job.
Why longest first: Graham's rule for packing jobs on machines (Graham 1969, "Bounds on
multiprocessing timing anomalies": longest processing time first ends within 4/3 of the best
schedule), so that no long job starts last while the other cores sit idle. Equal costs keep the
caller's order.

Stopping: Ctrl-C reaches every process of the terminal's group; the workers ignore it, and this
process stops them (SIGTERM, then SIGKILL), and only them, never another child of the caller.
A job that fails stops the whole run with its error unless `keep_going(job)`: then its error
line is returned and the others go on (a worker that dies, killed or out of memory, fails only
its own job and is replaced).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import connection, get_context
from pathlib import Path
from typing import Any

from tether.errors import TetherError
from tether.run import interrupt


@dataclass(frozen=True)
class Job:
    """One independent piece of work: `fn(*args)` returns what the caller needs of it."""

    name: str  # as printed; its log is logs/<name>.log ('/' written as '-')
    fn: Callable[..., Any]  # a module-level function, so a worker process can import it
    args: tuple = ()
    cost: float = 1.0  # expected work, in a unit the jobs share: the order and the time left


def available_cores() -> int:
    """The cores this process may run on (a container's or taskset's limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def log_path(log_dir: Path, name: str) -> Path:
    return log_dir / f"{name.replace('/', '-')}.log"


def _call(job: Job, keep_going: bool = True) -> tuple[Any, str | None, bool, float]:
    """Run one job, here or in a worker: (its result, its error line or None, whether that is a
    TetherError, seconds). A bug's traceback is printed (a worker's goes to the job's log); a
    failure is raised as it is unless `keep_going`, and a stop asked for (`Interrupted`) always."""
    start, result, error, tether_error = time.perf_counter(), None, None, False
    try:
        result = job.fn(*job.args)
    except Exception as exc:
        if not keep_going or isinstance(exc, interrupt.Interrupted):
            raise
        tether_error = isinstance(exc, TetherError)
        if not tether_error:
            traceback.print_exc()  # a bug: its traceback, then the next job
        # what a failed job reports: a TetherError's own line; for any other exception the last
        # line of its traceback (`ValueError: no gold today`)
        error = (str(exc) if tether_error
                 else traceback.format_exception_only(type(exc), exc)[-1].strip())
    return result, error, tether_error, time.perf_counter() - start


def _serve(warm: tuple[str, ...], one_at_a_time, inbox: connection.Connection) -> None:
    """A worker process: its imports, then each job it is sent, until told to stop (None) or
    its caller is gone. Sends back (result, error line or None, whether a TetherError, seconds)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its caller stops it (`Workers.__exit__`)
    with one_at_a_time:  # one worker at a time, so the caller (importing, training) keeps a core
        import torch
        from transformers.utils import logging as hf_logging

        for module in warm:
            importlib.import_module(module)
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    with contextlib.suppress(EOFError):  # the caller is gone
        while (task := inbox.recv()) is not None:
            job, log = task
            with open(log, "w", encoding="utf-8") as out, contextlib.redirect_stdout(out), \
                    contextlib.redirect_stderr(out):
                answer = _call(job)
            inbox.send(answer)


class Workers:
    """`count` worker processes (spawn), started on entry and warmed with `warm`'s imports while
    the caller goes on. On an error (or Ctrl-C) inside the block they are stopped at once, not
    waited for; otherwise the block's end waits for them to exit."""

    def __init__(self, count: int, warm: tuple[str, ...] = ()):
        self.count, self.warm = count, warm
        self.processes: list = []  # ours alone: never any other child of this process
        self.inboxes: list[connection.Connection] = []  # the pipe to each, in the same order
        self.closed = False

    def __enter__(self) -> Workers:
        self.context = get_context("spawn")
        self.one_at_a_time = self.context.Lock()
        for _ in range(self.count):
            process, inbox = self._spawn()
            self.processes.append(process)
            self.inboxes.append(inbox)
        return self

    def _spawn(self) -> tuple[Any, connection.Connection]:
        ours, theirs = self.context.Pipe()
        process = self.context.Process(target=_serve,
                                       args=(self.warm, self.one_at_a_time, theirs))
        process.start()
        theirs.close()  # (so that this end reads EOF once the worker is gone)
        return process, ours

    def send(self, i: int, job: Job, log: Path) -> None:
        """Job to worker i (a fresh one in place of one that died)."""
        if not self.processes[i].is_alive():
            self.processes[i], self.inboxes[i] = self._spawn()
        self.inboxes[i].send((job, str(log)))

    def outcome(self, i: int) -> tuple | None:
        """Worker i's answer once its job has ended, None while it runs. A worker that died
        without one (killed, out of memory) fails its job."""
        if not self.inboxes[i].poll() and self.processes[i].is_alive():
            return None
        try:
            return self.inboxes[i].recv()
        except EOFError:
            self.processes[i].join(5)
            return None, f"its worker process ended (exit code {self.processes[i].exitcode})", \
                False, None

    def close(self) -> None:
        """No more jobs: the workers exit while the caller goes on (writing its report)."""
        if self.closed:
            return
        self.closed = True
        for inbox in self.inboxes:
            with contextlib.suppress(OSError):  # (a worker already gone)
                inbox.send(None)

    def __exit__(self, kind, error, trace) -> None:
        if kind is None:
            self.close()
            for process in self.processes:
                process.join()
            return
        # Stop now, not after the jobs still running: their work is lost either way.
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.join(5)
            if process.is_alive():  # SIGTERM not acted on in 5 s (a loaded machine): SIGKILL
                process.kill()
                process.join(5)


class Progress:
    """One line per job that ends: `[5/13] ppo-fixed-seed1 finished in 41 s; 2 running, 6 to
    start; 120 s so far, about 95 s left`, or `... failed in 41 s: <its error line>
    (logs/<name>.log); ...`. The time left divides the work not yet done (in cost units, the
    running jobs' elapsed share taken off) by the rate measured on finished ones."""

    def __init__(self, todo: list[Job], jobs: int, started: float, done_before: int,
                 total: int):
        self.cost = {job.name: job.cost for job in todo}
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

    def finish(self, name: str, seconds: float | None, waiting: list[str], error: str | None = None,
               log: Path | None = None) -> None:
        """`seconds` as the job measured them (None: since `start`)."""
        if seconds is None:
            seconds = time.perf_counter() - self.began[name]
        self.began.pop(name, None)
        self.count += 1
        if error is None:  # (a failure's seconds say nothing of the rate)
            self.seconds_per_unit.append(seconds / self.cost[name])
        how = "finished" if error is None else "failed"
        said = "" if error is None else f": {error}" + (f" ({log.parent.name}/{log.name})"
                                                        if log else "")
        print(f"[{self.count}/{self.total}] {name} {how} in {seconds:.0f} s{said}; "
              f"{len(self.began)} running, {len(waiting)} to start; "
              f"{time.perf_counter() - self.started:.0f} s so far{self.left(waiting)}",
              flush=True)


def run_jobs(todo: list[Job], jobs: int, log_dir: Path, progress: Progress,
             keep_going: Callable[[Job], bool] = lambda job: False,
             workers: Workers | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Run every job, `jobs` at a time, longest first; returns ({name: result}, {name: error}).

    jobs 1 runs them here, one after another, their output on the console; more run in
    `workers` (started here, no more of them than there are jobs, when not given). A job that
    raises stops the run with its error (a worker's bug as a RuntimeError naming its log, where
    its traceback is), unless `keep_going(job)`: then its error line is returned and the rest go
    on. A stop asked for (Ctrl-C, `kill`) always stops the run.
    """
    order = sorted(todo, key=lambda job: -job.cost)  # stable: equal costs keep their order
    results: dict[str, Any] = {}
    failures: dict[str, str] = {}
    if jobs > 1:
        log_dir.mkdir(parents=True, exist_ok=True)
    pool = (contextlib.nullcontext() if jobs <= 1 else Workers(min(jobs, len(order)))
            if workers is None else contextlib.nullcontext(workers))
    with pool as running:  # workers started here are stopped here; the caller's stay its own
        ended = (_run_here(order, progress, keep_going) if jobs <= 1 else
                 _run_in(running, order, log_dir, progress))
        for job, (result, error, tether_error, seconds), waiting, log in ended:
            if error is None:
                results[job.name] = result
            elif not keep_going(job):  # (a worker's: one here has raised its own exception)
                raise (TetherError(error) if tether_error else
                       RuntimeError(f"{job.name}: {error} (its traceback is in {log})"))
            else:
                failures[job.name] = error
            progress.finish(job.name, seconds, [j.name for j in waiting], error, log)
    return results, failures


def _run_here(order: list[Job], progress: Progress, keep_going: Callable[[Job], bool]
              ) -> Iterator[tuple[Job, tuple, list[Job], None]]:
    """Each job in this process, one after another, its output on the console: (job, its
    answer as a worker gives it, the jobs still waiting, no log) as it ends."""
    for i, job in enumerate(order):
        if stop := interrupt.between_steps():  # Ctrl-C during a job that has no steps
            raise stop
        progress.start(job.name)
        yield job, _call(job, keep_going(job)), order[i + 1:], None


def _run_in(workers: Workers, order: list[Job], log_dir: Path, progress: Progress
            ) -> Iterator[tuple[Job, tuple, list[Job], Path]]:
    """Each job in the next free worker: (job, its answer, the jobs still waiting, its log) as
    it ends."""
    waiting = list(order)
    running: dict[int, Job] = {}  # worker index -> the job it runs
    while waiting or running:
        for i in range(len(workers.inboxes)):
            if waiting and i not in running:
                running[i] = job = waiting.pop(0)
                workers.send(i, job, log_path(log_dir, job.name))
                progress.start(job.name)
        # (a timeout, to see a stop asked of this process alone: `kill` of the caller's pid)
        connection.wait([workers.inboxes[i] for i in running]
                        + [workers.processes[i].sentinel for i in running], timeout=1.0)
        if stop := interrupt.between_steps():  # the workers are stopped on the way out
            raise stop
        for i, job in list(running.items()):
            if (answer := workers.outcome(i)) is not None:
                del running[i]
                yield job, answer, waiting, log_path(log_dir, job.name)
