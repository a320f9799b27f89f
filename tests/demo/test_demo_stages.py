"""The demo's stages run side by side: worker processes, longest first, each one's output in its
log, an error that stops the demo or (for a sweep run) is reported, and an honest time left."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import pytest

from tether.demo.stages import Clock, Stage, Workers, run_stages
from tether.errors import TetherError


def napper(tag: str, seconds: float) -> tuple[str, int, float, float]:
    """A stage that prints, sleeps and says where and when it ran (module-level: a worker
    process imports it by name)."""
    print(f"{tag} is running")
    start = time.time()
    time.sleep(seconds)
    return tag, os.getpid(), start, time.time()


def imported(module: str) -> tuple[int, bool]:
    return os.getpid(), module in sys.modules


def failing(message: str) -> None:
    raise TetherError(message)


def quiet_clock(stages, jobs):
    return Clock(stages, jobs, time.perf_counter(), done_before=0, total=len(stages))


def test_two_jobs_run_in_two_worker_processes_at_once_each_with_its_log(tmp_path, capsys):
    stages = [Stage(f"s{i}", 1.0, napper, (f"s{i}", 1.0)) for i in range(2)]
    with Workers(2) as workers:
        # (a worker takes stages once it has imported, one worker after another: the demo
        # starts them long before its stages come; here, wait for both)
        assert len(workers.wait_ready()) == 2
        results, failures = run_stages(stages, 2, tmp_path / "logs", quiet_clock(stages, 2),
                                       workers=workers)
    assert failures == {} and set(results) == {"s0", "s1"}
    (_, pid0, start0, end0), (_, pid1, start1, end1) = results["s0"], results["s1"]
    assert len({pid0, pid1, os.getpid()}) == 3  # two workers, neither of them this process
    assert max(start0, start1) < min(end0, end1)  # they overlapped in time
    for name in ("s0", "s1"):
        assert (tmp_path / "logs" / f"{name}.log").read_text() == f"{name} is running\n"
    out = capsys.readouterr().out
    assert "[2/2]" in out and "s0 is running" not in out  # a stage's output goes to its log only


def test_one_job_runs_here_longest_first(tmp_path):
    stages = [Stage("short", 1.0, napper, ("short", 0.0)), Stage("long", 5.0, napper, ("long", 0.0)),
              Stage("middle", 3.0, napper, ("middle", 0.0))]
    results, _ = run_stages(stages, 1, tmp_path / "logs", quiet_clock(stages, 1))
    assert {pid for _, pid, _, _ in results.values()} == {os.getpid()}
    assert sorted(results, key=lambda name: results[name][2]) == ["long", "middle", "short"]
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failing_stage_stops_the_demo_unless_it_may_fail_alone(tmp_path, jobs):
    stages = [Stage("sweep/a", 2.0, failing, ("the sweep run broke",)),
              Stage("b", 1.0, napper, ("b", 0.0))]
    results, failures = run_stages(stages, jobs, tmp_path / "logs", quiet_clock(stages, jobs),
                                   keep_going=lambda stage: stage.name.startswith("sweep/"))
    assert failures == {"sweep/a": "the sweep run broke"} and set(results) == {"b"}
    stages = [Stage("ppo", 2.0, failing, ("the PPO run broke",)), Stage("b", 1.0, napper, ("b", 0.0))]
    with pytest.raises(TetherError, match="the PPO run broke"):
        run_stages(stages, jobs, tmp_path / "logs2", quiet_clock(stages, jobs))


def test_time_left_is_the_work_not_done_at_the_measured_rate_over_the_jobs(capsys):
    stages = [Stage("a", 10.0, napper), Stage("b", 10.0, napper), Stage("c", 20.0, napper)]
    clock = Clock(stages, 2, time.perf_counter(), done_before=2, total=5)
    clock.start("a")
    clock.start("b")
    clock.began["b"] = time.perf_counter() - 1.0  # b has run 1 s
    clock.finish("a", 5.0, ["c"])  # 0.5 s per unit: b has 10 * 0.5 - 1 = 4 s left, c 10 s
    line = capsys.readouterr().out
    assert line.startswith("[3/5] a finished in 5 s; 1 running, 1 to start; ")
    assert line.rstrip().endswith("about 7 s left")  # (4 + 10) / 2 jobs


def test_workers_start_on_entry_and_import_what_they_are_told_before_any_stage(tmp_path):
    before = set(multiprocessing.active_children())  # (an earlier test's, still exiting)
    with Workers(2, warm=("colorsys",)) as workers:
        # both processes exist at once, before a stage is submitted: neither starts cold later
        ours = set(multiprocessing.active_children()) - before
        assert len(ours) == 2 and ours == set(workers.children)
        stages = [Stage(f"s{i}", 1.0, imported, ("colorsys",)) for i in range(2)]
        results, _ = run_stages(stages, 2, tmp_path / "logs", quiet_clock(stages, 2),
                                workers=workers)
        assert all(loaded for _, loaded in results.values())
        stages = [Stage("s", 1.0, imported, ("xdrlib",))]  # a module nobody asked for
        results, _ = run_stages(stages, 2, tmp_path / "logs", quiet_clock(stages, 2),
                                workers=workers)
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
