"""`tether sweep`: a grid of PPO and DPO/IPO runs from one YAML file, then the frontier report.

    grid.yaml -> sweep_plan.plan()   one PlannedRun per (stage, grid point, seed), named by its
                                     values (the grid file's format is in tools/sweep_plan.py)
    execute()                        each run through its stage's real `run` (ppo.run, dpo.run), a
                                     DPO/IPO policy then scored by `tether eval` as PPO scores its
                                     own; --jobs N: N worker processes, each calling `execute_run`
    resume                           finished runs are kept, broken ones --resume from their
                                     checkpoint
    sweep_report.write()             results.csv and report.html: frontier, Gao fit, which beta
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tether.errors import AlreadyFinished, TetherError
from tether.run import lock
from tether.run.config import config_from_dict, parse_config
from tether.tools import evaluate
from tether.tools.config import EvalConfig, SweepConfig
from tether.tools.sweep_plan import PlannedRun, Sweep, config_class, plan, state
from tether.tools.sweep_report import write
from tether.train import dpo, ppo


def execute_run(run: PlannedRun) -> None:
    """One run through its stage's own `run`, resumed when it was started before."""
    resume = state(run) == "broken"
    cfg = config_from_dict(config_class(run.stage), {**run.fields, "resume": resume})
    if run.stage == "ppo":
        try:
            ppo.run(cfg)
        except AlreadyFinished:
            pass
        return
    try:
        dpo.run(cfg)
    except AlreadyFinished:  # trained before; only its evaluation was missing
        pass
    evaluate.run(config_from_dict(EvalConfig, run.eval_fields))


def _save_plan(sweep: Sweep) -> None:
    sweep.root.mkdir(parents=True, exist_ok=True)
    (sweep.root / "plan").mkdir(exist_ok=True)
    for run in sweep.runs:
        text = yaml.safe_dump(dataclasses.asdict(run), sort_keys=False)
        (sweep.root / "plan" / f"{run.name}.yaml").write_text(text, encoding="utf-8")


def worker_main() -> None:
    """A --jobs worker: `python -c '...worker_main()' plan/<run>.yaml` runs that one run."""
    import torch

    torch.set_num_threads(1)  # N workers share the cores; tiny and small models gain nothing
    data = yaml.safe_load(Path(sys.argv[1]).read_text(encoding="utf-8"))
    try:
        execute_run(PlannedRun(**data))
    except TetherError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


class Progress:
    """One line per event: `sweep: 3/10 done, 2 running, 1 failed (95 s)`."""

    def __init__(self, total: int, done: int):
        self.total, self.done, self.failed, self.running = total, done, 0, 0
        self.started = time.perf_counter()

    def say(self, event: str) -> None:
        print(f"sweep: {self.done}/{self.total} done, {self.running} running, {self.failed} "
              f"failed ({time.perf_counter() - self.started:.0f} s) - {event}", flush=True)


def _run_in_process(todo: list[PlannedRun], progress: Progress) -> dict[str, str]:
    failures = {}
    for run in todo:
        progress.running = 1
        progress.say(f"{'resuming' if state(run) == 'broken' else 'starting'} {run.name}")
        try:
            execute_run(run)
            progress.done += 1
        except TetherError as exc:
            failures[run.name] = str(exc)
            progress.failed += 1
        progress.running = 0
        progress.say(f"{run.name}: {failures.get(run.name, 'finished')}")
    return failures


def _run_workers(sweep: Sweep, todo: list[PlannedRun], jobs: int,
                 progress: Progress) -> dict[str, str]:
    """Up to `jobs` worker processes at once, each one run, its output in logs/<run>.log."""
    import tether

    env = dict(os.environ)
    source = str(Path(tether.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    (sweep.root / "logs").mkdir(exist_ok=True)
    waiting, running, failures = list(todo), {}, {}
    while waiting or running:
        while waiting and len(running) < jobs:
            run = waiting.pop(0)
            log = open(sweep.root / "logs" / f"{run.name}.log", "w", encoding="utf-8")
            command = [sys.executable, "-c",
                       "from tether.tools.sweep import worker_main; worker_main()",
                       str(sweep.root / "plan" / f"{run.name}.yaml")]
            running[run.name] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                  env=env), log)
            progress.running = len(running)
            progress.say(f"started {run.name}")
        time.sleep(0.2)
        for name, (proc, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[name]
            progress.running = len(running)
            if proc.returncode == 0:
                progress.done += 1
                progress.say(f"{name} finished")
            else:
                lines = (sweep.root / "logs" / f"{name}.log").read_text().strip().splitlines()
                failures[name] = lines[-1] if lines else f"exit code {proc.returncode}"
                progress.failed += 1
                progress.say(f"{name} failed: {failures[name]} (logs/{name}.log)")
    return failures


def execute(sweep: Sweep, jobs: int = 1) -> dict[str, str]:
    """Run every run not yet done; returns {run name: error} for those that failed.

    One sweep at a time per directory (tether.run.lock): a second one would truncate the first's
    logs/<run>.log and plan files, and each of its runs would be refused by that run's own lock.
    """
    sweep.root.mkdir(parents=True, exist_ok=True)
    held = lock.acquire(sweep.root, "sweep directory",
                        "wait for it to finish or give this one another name or --output-dir")
    try:
        _save_plan(sweep)
        todo = [run for run in sweep.runs if state(run) != "done"]
        progress = Progress(len(sweep.runs), len(sweep.runs) - len(todo))
        progress.say(f"{len(todo)} to run, {jobs} at a time")
        if jobs <= 1:
            return _run_in_process(todo, progress)
        return _run_workers(sweep, todo, jobs, progress)
    finally:
        if held is not None:
            held.release()


def cli(argv: list[str]) -> int:
    """`tether sweep GRID.yaml [--jobs N] [--output-dir DIR]`."""
    if argv and not argv[0].startswith("--"):
        argv = ["--grid", *argv]
    cfg = parse_config(SweepConfig, argv, prog="tether sweep")
    sweep = plan(cfg.grid, cfg.output_dir or None)
    failures = execute(sweep, cfg.jobs)
    path, summary = write(sweep, failures)
    print(summary)
    print(f"report written to {path}")
    if failures:
        print(f"error: {len(failures)} run(s) failed; fix the cause and run the same command "
              "again: finished runs are kept, broken ones resume", file=sys.stderr)
        return 1
    return 0
