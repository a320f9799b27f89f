"""tether.run.jobs, the runner of `tether sweep --jobs` and of the demo's stages: worker processes,
longest first, each job's output in its log, an error that stops the run or (keep_going) is
reported, a worker that dies failing only its job, Ctrl-C stopping our workers and nothing else,
and an honest time left."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tether.errors import TetherError
from tether.run import interrupt
from tether.run.jobs import Job, Progress, Workers, run_jobs


def napper(tag: str, seconds: float) -> tuple[str, int, float, float]:
    """A job that prints, sleeps and says where and when it ran (module-level: a worker
    process imports it by name)."""
    print(f"{tag} is running", flush=True)
    start = time.time()
    time.sleep(seconds)
    return tag, os.getpid(), start, time.time()


def meet(tag: str, room: str, count: int) -> int:
    """A job that waits until `count` jobs are in `room` at once: it returns only if they ran
    side by side (no timing luck: a worker still importing is waited for)."""
    Path(room, tag).touch()
    deadline = time.time() + 120
    while len(os.listdir(room)) < count:
        if time.time() > deadline:
            raise TetherError(f"{tag} waited alone")
        time.sleep(0.05)
    print(f"{tag} is running")
    return os.getpid()


def imported(module: str) -> tuple[int, bool]:
    return os.getpid(), module in sys.modules


def failing(message: str) -> None:
    raise TetherError(message)


def buggy(message: str) -> None:
    raise ValueError(message)


def dies() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would


def quiet(todo, jobs):
    return Progress(todo, jobs, time.perf_counter(), done_before=0, total=len(todo))


def test_two_jobs_run_in_two_worker_processes_at_once_each_with_its_log(tmp_path, capsys):
    (tmp_path / "room").mkdir()
    todo = [Job(f"s/{i}", meet, (f"s{i}", str(tmp_path / "room"), 2)) for i in range(2)]
    results, failures = run_jobs(todo, 2, tmp_path / "logs", quiet(todo, 2))
    assert failures == {} and set(results) == {"s/0", "s/1"}
    assert len({results["s/0"], results["s/1"], os.getpid()}) == 3  # two workers, not this one
    for i in range(2):  # ('/' in a name: a flat file name)
        assert (tmp_path / "logs" / f"s-{i}.log").read_text() == f"s{i} is running\n"
    out = capsys.readouterr().out
    assert "[2/2]" in out and "is running" not in out  # a job's output goes to its log only


def test_one_job_runs_here_longest_first(tmp_path):
    todo = [Job("short", napper, ("short", 0.0), cost=1.0),
            Job("long", napper, ("long", 0.0), cost=5.0),
            Job("middle", napper, ("middle", 0.0), cost=3.0)]
    results, _ = run_jobs(todo, 1, tmp_path / "logs", quiet(todo, 1))
    assert {pid for _, pid, _, _ in results.values()} == {os.getpid()}
    assert sorted(results, key=lambda name: results[name][2]) == ["long", "middle", "short"]
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failing_job_stops_the_run_unless_it_may_fail_alone(tmp_path, jobs, capsys):
    todo = [Job("sweep/a", failing, ("the sweep run broke",), cost=2.0),
            Job("b", napper, ("b", 0.0))]
    results, failures = run_jobs(todo, jobs, tmp_path / "logs", quiet(todo, jobs),
                                 keep_going=lambda job: job.name.startswith("sweep/"))
    assert failures == {"sweep/a": "the sweep run broke"} and set(results) == {"b"}
    line = next(x for x in capsys.readouterr().out.splitlines() if "sweep/a" in x)
    # the error line, and where the job's output is when it has a log of its own
    # (jobs 1: b waits for a; jobs 2: b went to the other worker at once, and either may end
    # first: that worker may have imported first)
    expected = (r"\[1/2\] sweep/a failed in 0 s: the sweep run broke; 0 running, 1 to start; "
                if jobs == 1 else r"\[[12]/2\] sweep/a failed in 0 s: the sweep run broke "
                r"\(logs/sweep-a.log\); [01] running, 0 to start; ")
    assert re.match(expected, line), line
    todo = [Job("ppo", failing, ("the PPO run broke",), cost=2.0), Job("b", napper, ("b", 0.0))]
    with pytest.raises(TetherError, match="the PPO run broke"):
        run_jobs(todo, jobs, tmp_path / "logs2", quiet(todo, jobs))


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_bug_keeps_its_traceback_and_may_fail_alone_too(tmp_path, jobs, capsys):
    todo = [Job("a", buggy, ("no gold today",)), Job("b", napper, ("b", 0.0))]
    results, failures = run_jobs(todo, jobs, tmp_path / "logs", quiet(todo, jobs),
                                 keep_going=lambda job: True)
    assert failures == {"a": "ValueError: no gold today"} and set(results) == {"b"}
    where = (tmp_path / "logs" / "a.log").read_text() if jobs > 1 else capsys.readouterr().err
    assert "Traceback" in where and "in buggy" in where
    with pytest.raises(ValueError if jobs == 1 else RuntimeError, match="no gold today") as caught:
        run_jobs(todo[:1], jobs, tmp_path / "logs2", quiet(todo[:1], jobs))
    if jobs > 1:  # a worker's bug names the log that holds its traceback
        assert str(caught.value) == (f"a: ValueError: no gold today (its traceback is in "
                                     f"{tmp_path / 'logs2' / 'a.log'})")


def test_a_worker_that_dies_fails_its_job_alone_and_a_fresh_one_goes_on(tmp_path):
    todo = [Job("dies", dies, cost=2.0), Job("b", napper, ("b", 0.0))]
    with Workers(1) as workers:
        first = workers.processes[0].pid
        results, failures = run_jobs(todo, 2, tmp_path / "logs", quiet(todo, 1),
                                     keep_going=lambda job: True, workers=workers)
        assert failures == {"dies": "its worker process ended (exit code -9)"}
        assert results["b"][1] == workers.processes[0].pid != first


def test_time_left_is_the_work_not_done_at_the_measured_rate_over_the_jobs(capsys):
    todo = [Job("a", napper, cost=10.0), Job("b", napper, cost=10.0), Job("c", napper, cost=20.0)]
    progress = Progress(todo, 2, time.perf_counter(), done_before=2, total=5)
    progress.start("a")
    progress.start("b")
    progress.began["b"] = time.perf_counter() - 1.0  # b has run 1 s
    progress.finish("a", 5.0, ["c"])  # 0.5 s per unit: b has 10 * 0.5 - 1 = 4 s left, c 10 s
    line = capsys.readouterr().out
    assert line.startswith("[3/5] a finished in 5 s; 1 running, 1 to start; ")
    assert line.rstrip().endswith("about 7 s left")  # (4 + 10) / 2 jobs
    # A failure's seconds do not set the rate (with them: (0.5 + 5) / 2 per unit, 28 s)
    progress.finish("b", 50.0, ["c"], error="it broke")
    assert capsys.readouterr().out.rstrip().endswith("about 5 s left")  # c alone, 20 * 0.5 / 2


def test_workers_start_on_entry_and_import_what_they_are_told_before_any_job(tmp_path):
    before = set(multiprocessing.active_children())  # (an earlier test's, still exiting)
    with Workers(2, warm=("colorsys",)) as workers:
        # both processes exist at once, before a job is sent: neither starts cold later
        ours = set(multiprocessing.active_children()) - before
        assert len(ours) == 2 and ours == set(workers.processes)
        todo = [Job(f"s{i}", imported, ("colorsys",)) for i in range(2)]
        results, _ = run_jobs(todo, 2, tmp_path / "logs", quiet(todo, 2), workers=workers)
        assert all(loaded for _, loaded in results.values())
        todo = [Job("s", imported, ("xdrlib",))]  # a module nobody asked for
        results, _ = run_jobs(todo, 2, tmp_path / "logs", quiet(todo, 2), workers=workers)
        assert results["s"][1] is False
        workers.close()  # they exit on their own, while this process goes on
    assert not any(child.is_alive() for child in ours)  # the block's end waited for them


def test_an_error_in_the_block_stops_the_workers_at_once():
    before = set(multiprocessing.active_children())
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        with Workers(2, warm=("tether.train.ppo",)):
            ours = set(multiprocessing.active_children()) - before
            raise KeyboardInterrupt  # Ctrl-C during SFT, while the workers still import
    assert len(ours) == 2 and not any(child.is_alive() for child in ours)
    assert time.perf_counter() - start < 5  # terminated, not waited for


def test_ctrl_c_stops_our_workers_and_no_other_child(tmp_path):
    """The terminal's Ctrl-C reaches every process of its group: the workers ignore it, and the
    runner, seeing the stop asked of it, ends them, and only them."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    todo = [Job(f"s{i}", napper, (f"s{i}", 60.0)) for i in range(2)]
    seen = {}

    def press_ctrl_c(workers: Workers) -> None:
        logs = [tmp_path / "logs" / f"s{i}.log" for i in range(2)]
        while not all(log.is_file() and log.read_text() for log in logs):
            time.sleep(0.05)  # both jobs running, so both workers have ignored SIGINT
        for process in workers.processes:
            os.kill(process.pid, signal.SIGINT)
        time.sleep(1.0)
        seen["alive"] = [process.is_alive() for process in workers.processes]
        interrupt._received.append(signal.SIGINT)  # what the CLI's handler records

    try:
        start = time.perf_counter()
        with pytest.raises(interrupt.Interrupted, match="SIGINT: stopped"):
            with Workers(2) as workers:
                threading.Thread(target=press_ctrl_c, args=(workers,), daemon=True).start()
                run_jobs(todo, 2, tmp_path / "logs", quiet(todo, 2), workers=workers)
        assert seen["alive"] == [True, True]
        assert not any(process.is_alive() for process in workers.processes)
        assert time.perf_counter() - start < 50  # not after the jobs' 60 s
        assert bystander.poll() is None  # another child of the caller: untouched
    finally:
        interrupt._received.clear()
        bystander.kill()
        bystander.wait()
