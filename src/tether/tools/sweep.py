"""`tether sweep`: a grid of PPO and DPO/IPO runs from one YAML file, then the frontier report.

    grid.yaml -> sweep_plan.plan()   one PlannedRun per (stage, grid point, seed), named by its
                                     values (the grid file's format is in tools/sweep_plan.py)
    execute()                        each run through its stage's real `run` (ppo.run, dpo.run), a
                                     DPO/IPO policy then scored by `tether eval` as PPO scores its
                                     own; --jobs N: N worker processes (tether.run.jobs), each
                                     calling `execute_run`; a failed run is reported, not fatal
    resume                           finished runs are kept, broken ones --resume from their
                                     checkpoint; a run whose recorded config is not what the grid
                                     gives it now is refused first (check_recorded)
    sweep_report.write()             results.csv and report.html: frontier, Gao fit, which beta
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tether.errors import AlreadyFinished, TetherError
from tether.rl.reward.functions import load_reward_functions
from tether.run import interrupt, lock
from tether.run.atomic import atomic_write_bytes, read_record
from tether.run.config import config_to_dict
from tether.run.jobs import Job, Progress, run_jobs
from tether.run.parse import config_from_dict, parse_config
from tether.run.paths import resolved_paths
from tether.run.resume import HARMLESS_ON_RESUME, NOT_COMPARED, field_defaults
from tether.tools import bon, evaluate, interpolate
from tether.tools.config import BonConfig, EvalConfig, InterpolateConfig, SweepConfig
from tether.tools.sweep_plan import PlannedRun, Sweep, config_class, plan, state, unplanned
from tether.tools.sweep_report import write
from tether.train import dpo, ppo


def execute_run(run: PlannedRun) -> None:
    """One run through its stage's own `run`, resumed when it was started before; a DPO/IPO
    policy is then scored by `tether eval`."""
    if run.stage == "bon":
        bon.run(config_from_dict(BonConfig, run.eval_fields))
        _made(run)
        return
    resume = state(run) == "broken"
    cfg = config_from_dict(config_class(run.stage), {**run.fields, "resume": resume})
    with contextlib.suppress(AlreadyFinished):  # (DPO/IPO: only its evaluation was missing)
        (ppo if run.stage == "ppo" else dpo).run(cfg)
    if run.stage == "dpo":
        evaluate.run(config_from_dict(EvalConfig, run.eval_fields))
    elif run.eval_fields:  # the grid's interpolation of this PPO run; an unfinished one redone
        shutil.rmtree(run.eval_fields["output_dir"], ignore_errors=True)
        interpolate.run(config_from_dict(InterpolateConfig, run.eval_fields))
        _made(run)


def _baseline(run: PlannedRun) -> tuple[type, Path] | None:
    """A baseline the grid makes (its best-of-n; a PPO run's interpolation): its config class
    and the file that records the settings it was made with; None for anything else."""
    if run.stage == "bon":
        return BonConfig, Path(run.eval_fields["output"]).with_suffix(".yaml")
    if run.stage == "ppo" and run.eval_fields:
        return InterpolateConfig, Path(run.eval_fields["output_dir"]) / "interpolate.yaml"
    return None


def _made(run: PlannedRun) -> None:
    """Record the settings a baseline was just made with (`_baseline`'s file), so that a grid
    changed under it is refused as one changed under a run is (`_recorded_changes`)."""
    cls, record = _baseline(run)
    text = yaml.safe_dump(config_to_dict(config_from_dict(cls, run.eval_fields)), sort_keys=False)
    atomic_write_bytes(record, text.encode("utf-8"))


# What locates a run rather than shapes it; with rundir's harmless fields, never a "change".
NOT_A_CHANGE = {"run_name", "output_dir", *HARMLESS_ON_RESUME, *NOT_COMPARED}


def _differences(saved: Any, cfg: Any, record: str, locating: tuple[str, ...] = ()) -> list[str]:
    """`field: saved -> planned` for each field of the planned `cfg` that changes the result; a
    field tether gained after the run was made is no change while it keeps its default (rundir's
    resume rule)."""
    if not isinstance(saved, dict):
        return [f"its {record} cannot be read"]
    planned, defaults = config_to_dict(cfg), field_defaults(cfg)
    resolved = resolved_paths(saved)  # a path recorded relative to here is the same path
    return [f"{key}: {saved.get(key, defaults.get(key, value))!r} -> {value!r}"  # shown as recorded
            for key, value in planned.items() if key not in NOT_A_CHANGE and key not in locating
            and resolved.get(key, defaults.get(key, value)) != value]


def _recorded_changes(run: PlannedRun) -> list[str]:
    """How the run's directory differs from what the grid gives it now: its config.yaml against
    the planned config, and a DPO/IPO evaluation's eval.json against the planned eval settings."""
    path = Path(run.fields["output_dir"]) / run.name
    out = []
    if (path / "config.yaml").is_file():
        out += _differences(read_record(path / "config.yaml"),
                            config_from_dict(config_class(run.stage), run.fields), "config.yaml")
    if run.stage == "dpo" and (path / "eval.json").is_file():
        record = read_record(path / "eval.json", json.loads)
        diff = _differences(record.get("config") if isinstance(record, dict) else None,
                            config_from_dict(EvalConfig, run.eval_fields), "eval.json",
                            locating=("model", "output"))  # the run's own final/ and eval.json
        out += [d if d.startswith("its ") else f"evaluation {d}" for d in diff]
    if (baseline := _baseline(run)) and baseline[1].is_file():
        cls, record = baseline
        out += _differences(read_record(record), config_from_dict(cls, run.eval_fields),
                            record.name)
    return out


def _in_use(run: PlannedRun) -> bool:
    """Whether another process holds the run's directory: what it records is in flux, and the
    run's own lock refuses that run alone when its turn comes (docs/frontier.md)."""
    try:
        lock.probe(Path(run.fields["output_dir"]) / run.name, "run directory", "")
    except TetherError:
        return True
    return False


def check_recorded(sweep: Sweep) -> None:
    """Refuse a grid changed under runs already in the sweep directory (finished or broken):
    their results would be reported as the new grid's. Reads only; new runs are no change."""
    changed = {run.name: diff for run in sweep.runs
               if (diff := _recorded_changes(run)) and not _in_use(run)}
    if not changed:
        return
    shown = [f"{name} ({'; '.join(diff[:3])}{'; ...' if len(diff) > 3 else ''})"
             for name, diff in list(changed.items())[:3]]
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    raise TetherError(
        f"the grid changed under {len(changed)} run(s) already in {sweep.root}: "
        f"{', '.join(shown)}{more}; to keep them, give the new grid another 'name:' or "
        "--output-dir; to redo them under this grid, delete those run directories (for an "
        "evaluation alone, its eval.json); or restore the grid's old values")


def save_plan(sweep: Sweep) -> None:
    """plan/<run>.yaml: a record of the grid's runs, one file each."""
    (sweep.root / "plan").mkdir(parents=True, exist_ok=True)
    for run in sweep.runs:
        text = yaml.safe_dump(dataclasses.asdict(run), sort_keys=False)
        (sweep.root / "plan" / f"{run.name}.yaml").write_text(text, encoding="utf-8")


def prepare(sweep: Sweep) -> None:
    """Before any run, reading only: refuse a grid changed under runs already there, and name
    the runs it left out. (plan/<run>.yaml is written once the sweep directory is held.)"""
    check_recorded(sweep)
    if left_out := unplanned(sweep):
        print(f"sweep: {len(left_out)} run(s) in {sweep.root} are not in this grid; kept as they "
              f"are, left out of the report: {', '.join(left_out)}", flush=True)


def execute(sweep: Sweep, jobs: int = 1) -> dict[str, str]:
    """Run every run not yet done; returns {run name: error} for those that failed.

    One sweep at a time per directory (tether.run.lock): a second one would truncate the first's
    logs/<run>.log and plan files, and each of its runs would be refused by that run's own lock.
    A grid changed under runs already there is refused before anything is written.
    """
    prepare(sweep)
    sweep.root.mkdir(parents=True, exist_ok=True)
    held = lock.acquire(sweep.root, "sweep directory",
                        "wait for it to finish or give this one another name or --output-dir")
    try:
        save_plan(sweep)
        todo = [run for run in sweep.runs if state(run) != "done"]
        resuming = [run.name for run in todo if state(run) == "broken"]
        done, logs = len(sweep.runs) - len(todo), sweep.root / "logs"
        print(f"[{done}/{len(sweep.runs)}] sweep {sweep.root}: {len(todo)} to run, {jobs} at a "
              "time" + (f"; resuming {', '.join(resuming)}" if resuming else "")
              + (f"; each one's output in {logs}" if jobs > 1 else ""), flush=True)
        work = [Job(run.name, execute_run, (run,)) for run in todo]  # equal costs: grid order
        progress = Progress(work, jobs, time.perf_counter(), done, len(sweep.runs))
        return run_jobs(work, jobs, logs, progress, keep_going=lambda job: True)[1]
    except interrupt.Interrupted as exc:  # (a sweep has no --resume: the same command goes on)
        said = str(exc).removesuffix("; continue with --resume")
        raise interrupt.Interrupted(f"{said}; run the same command again: finished runs are "
                                    "kept, broken ones resume", exc.exit_code - 128) from None
    finally:
        if held is not None:
            held.release()


def check_functions(sweep: Sweep) -> None:
    """Import every reward and gold function the grid names, before any run starts: a DPO/IPO
    run's evaluation would otherwise meet a bad `gold_fn` only after its training."""
    specs = {fields.get(name) for run in sweep.runs for fields in (run.fields, run.eval_fields)
             for name in ("reward_fn", "gold_fn")}
    for spec in sorted(spec for spec in specs if spec):
        try:
            load_reward_functions(spec)
        except TetherError as exc:
            raise TetherError(f"grid: {exc}") from None


def cli(argv: list[str]) -> int:
    """`tether sweep GRID.yaml [--jobs N] [--output-dir DIR]` (parse_config reads GRID.yaml as
    --grid: SweepConfig.POSITIONAL)."""
    cfg = parse_config(SweepConfig, argv, prog="tether sweep")
    sweep = plan(cfg.grid, cfg.output_dir or None)
    check_functions(sweep)  # before anything is written
    failures = execute(sweep, cfg.jobs)
    path, summary = write(sweep, failures)
    print(summary)
    print(f"report written to {path}")
    if failures:
        print(f"error: {len(failures)} run(s) failed; fix the cause and run the same command "
              "again: finished runs are kept, broken ones resume", file=sys.stderr)
        return 1
    return 0
