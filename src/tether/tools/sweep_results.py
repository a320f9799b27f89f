"""The sweep's results as numbers: each finished run's evaluation points read back, and each grid
point summarised over its seeds (tether.tools.sweep_report draws and writes them).

    collect()     each finished run's evaluation points: (step, KL, exact KL, proxy, gold)
    summarise()   per group (a grid point over its seeds): mean and standard error per step,
                  the gold gain over the start, the Gao fit, the end gold the recommendation
                  judges, whether gold peaks then falls
    write_csv()   results.csv: every point of every run
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

from tether.tools.frontier import (
    GaoFit,
    end_of_training,
    gao_fit,
    mean_and_stderr,
    over_seeds,
    peak_then_fall,
)
from tether.tools.report import read_run, read_samples
from tether.tools.sweep_plan import PlannedRun, Sweep, state

METRICS = {"kl": "eval/kl", "kl_exact": "eval/kl_exact", "proxy": "eval/score",
           "gold": "eval/gold_score"}


@dataclass
class RunPoints:
    run: PlannedRun
    steps: list[int] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=dict)  # METRICS key -> per step
    gold_by_prompt: dict[int, list[float]] = field(default_factory=dict)  # step -> per prompt


def best_of_n_curve(sweep: Sweep) -> list[dict]:
    """The best-of-n baseline's bon.json (one object per n), [] when the grid has none or it is
    not written yet."""
    done = [run for run in sweep.runs if run.stage == "bon" and state(run) == "done"]
    return json.loads(Path(done[0].eval_fields["output"]).read_text("utf-8")) if done else []


def interpolation(sweep: Sweep) -> tuple[str, list[tuple[float, float, float, float]]]:
    """The grid's interpolation, read back: (its run, `read_interpolation`); ("", []) when the
    grid has none or it is not done."""
    for run in sweep.runs:
        if run.stage == "ppo" and run.eval_fields and state(run) == "done":
            return run.name, read_interpolation(Path(run.eval_fields["output_dir"]))
    return "", []


def read_interpolation(directory: Path) -> list[tuple[float, float, float, float]]:
    """`tether interpolate`'s evaluated points in `directory`: [(eta, KL, gold, gold's standard
    error over prompts)]."""
    rows = json.loads((directory / "interpolate.json").read_text("utf-8"))
    golds = [[s["gold_score"] for s in json.loads(Path(row["path"] + ".eval.json")
                                                  .read_text("utf-8"))["samples"]]
             for row in rows]
    return [(row["eta"], row["eval/kl"], *mean_and_stderr(gold)) for row, gold in zip(rows, golds)]


def collect(sweep: Sweep) -> list[RunPoints]:
    """The evaluation points of every finished run (PPO: each evaluation; DPO/IPO: one)."""
    # (bon: `best_of_n_curve`)
    points = (run_points(run, sweep.root / run.name) for run in sweep.runs
              if run.stage != "bon" and state(run) == "done")
    return [p for p in points if p.steps]


def run_points(run: PlannedRun, path: Path) -> RunPoints:
    """The evaluation points of `run`, read from its directory `path`: each logged evaluation
    with a gold score (PPO), or its eval.json (DPO/IPO); none (no `steps`) without."""
    points = RunPoints(run)
    if run.stage == "dpo":
        record = json.loads((path / "eval.json").read_text(encoding="utf-8"))
        rows = [{"step": 0, **record["metrics"]}]
        points.gold_by_prompt[0] = [s["gold_score"] for s in record["samples"]]
    else:
        rows = [r for r in read_run(path).metrics if "eval/gold_score" in r]
        points.gold_by_prompt = {step: [s["gold_score"] for s in samples]
                                 for step, samples in read_samples(path).items()}
    points.steps = [int(row["step"]) for row in rows]
    points.values = {key: [float(row.get(name, float("nan"))) for row in rows]
                     for key, name in METRICS.items()}
    return points


@dataclass
class Group:
    """One grid point over its seeds: mean and standard error at each shared evaluation step."""

    name: str
    stage: str
    beta: float
    label: str  # what the plots call it: the grid values
    seeds: list[int]
    steps: list[int]
    mean: dict[str, list[float]]
    stderr: dict[str, list[float]]
    final_gold: list[float]  # each seed's last gold
    end_steps: list[int] = field(default_factory=list)  # the evaluations END_EVALS averages
    end_gold: list[float] = field(default_factory=list)  # per (seed, prompt), seeds in order
    fit: GaoFit | None = None
    gains: list[tuple[float, float]] = field(default_factory=list)  # (KL, gold - start gold)
    verdict: str = ""  # gold peaks then falls, or not, with its evidence (PPO)


def _label(run: PlannedRun) -> str:
    if run.stage == "dpo":
        name = "IPO" if run.fields.get("loss") == "ipo" else "DPO"
        return f"{name} beta {run.fields.get('beta', 0.1):g}"
    extra = ", ".join(f"{k} {v}" for k, v in run.point.items() if k != "beta")
    return f"PPO beta {run.fields.get('beta', 0.05):g}" + (f" ({extra})" if extra else "")


# The recommendation's measure of the end of training: per prompt, the mean gold of the last
# END_EVALS evaluations after step 0 (one evaluation can be a dip; frontier.end_of_training).
END_EVALS = 3


def summarise(points: list[RunPoints]) -> list[Group]:
    groups: dict[str, list[RunPoints]] = {}
    for p in points:
        groups.setdefault(p.run.group, []).append(p)
    out = []
    for name, members in groups.items():
        steps = sorted(set.intersection(*(set(m.steps) for m in members)))
        first = members[0].run
        mean, stderr = {}, {}
        for key in METRICS:
            mean[key], stderr[key] = over_seeds([[m.values[key][m.steps.index(s)] for s in steps]
                                                 for m in members])
        group = Group(name, first.stage, float(first.fields.get("beta", 0.05)), _label(first),
                      [m.run.seed for m in members], steps, mean, stderr,
                      [m.values["gold"][-1] for m in members])
        group.end_steps = [s for s in steps if s > 0][-END_EVALS:] or steps[-1:]
        ordered = sorted(members, key=lambda m: m.run.seed)
        if all(s in m.gold_by_prompt for m in ordered for s in group.end_steps):
            group.end_gold = [g for m in ordered for g in end_of_training(
                [m.gold_by_prompt[s] for s in group.end_steps], END_EVALS)]
        if first.stage == "ppo" and steps and steps[0] == 0:
            for m in members:  # gold gain over that seed's own start (step 0, the SFT policy)
                start = m.values["gold"][m.steps.index(0)]
                group.gains += [(k, g - start) for k, g in zip(m.values["kl"], m.values["gold"])]
            group.fit = gao_fit([k for k, _ in group.gains], [g for _, g in group.gains])
            group.verdict = _verdict(group, members)
        out.append(group)
    return out


def write_csv(path: Path, points: list[RunPoints], axes: list[str]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "stage", "group", "seed", *axes, "step", *METRICS])
        for p in points:
            for i, step in enumerate(p.steps):
                writer.writerow([p.run.name, p.run.stage, p.run.group, p.run.seed,
                                 *[p.run.point.get(a, "") for a in axes], step,
                                 *[f"{p.values[k][i]:.6g}" for k in METRICS]])


def _verdict(group: Group, members: list[RunPoints]) -> str:
    """Peak then fall, judged on per-prompt scores pooled over seeds (frontier.peak_then_fall)."""
    peak_index = max(range(len(group.steps)), key=lambda i: group.mean["gold"][i])
    at = {name: group.steps[i] for name, i in (("start", 0), ("peak", peak_index),
                                               ("final", len(group.steps) - 1))}
    pooled = {name: [g for m in members for g in m.gold_by_prompt.get(step, [])]
              for name, step in at.items()}
    if peak_index == 0 or len({len(v) for v in pooled.values()}) != 1 or not pooled["start"]:
        return "gold never rose above its start" if peak_index == 0 else ""
    found = peak_then_fall(pooled["start"], pooled["peak"], pooled["final"],
                           group.mean["kl"][peak_index])
    label = ("gold peaks then falls" if found.holds else
             "gold still rising at its last evaluation" if peak_index == len(group.steps) - 1
             and found.rose else
             "gold rises, no fall beyond noise" if found.rose else "no rise beyond noise")
    return f"{label}: {found.evidence}"
