"""The sweep's results: results.csv and report.html (the frontier, Gao et al.'s fit, beta).

    collect()     each finished run's evaluation points: (step, KL, exact KL, proxy, gold)
    summarise()   per group (a grid point over its seeds): mean and standard error per step,
                  the gold gain over the start, the Gao fit, the observed peak
    write()       the CSV, three figures, a table, the recommended beta with its evidence

Figures are drawn with tether.tools.report's machinery (inline PNGs in one self-contained page).
"""

from __future__ import annotations

import csv
import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from tether.tools.frontier import (
    GaoFit,
    frontier,
    gao_fit,
    mean_and_stderr,
    peak_then_fall,
    recommend_beta,
)
from tether.tools.report import (
    config_html,
    figure_html,
    page,
    plt,
    png_data,
    read_run,
    relative_link,
    write_page,
)
from tether.tools.sweep_plan import PlannedRun, Sweep, state, unplanned

METRICS = {"kl": "eval/kl", "kl_exact": "eval/kl_exact", "proxy": "eval/score",
           "gold": "eval/gold_score"}


@dataclass
class RunPoints:
    run: PlannedRun
    steps: list[int] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=dict)  # METRICS key -> per step
    gold_by_prompt: dict[int, list[float]] = field(default_factory=dict)  # step -> per prompt


def collect(sweep: Sweep) -> list[RunPoints]:
    """The evaluation points of every finished run (PPO: each evaluation; DPO/IPO: one)."""
    out = []
    for run in sweep.runs:
        if state(run) != "done":
            continue
        path = sweep.root / run.name
        points = RunPoints(run)
        if run.stage == "dpo":
            record = json.loads((path / "eval.json").read_text(encoding="utf-8"))
            rows = [{"step": 0, **record["metrics"]}]
            points.gold_by_prompt[0] = [s["gold_score"] for s in record["samples"]]
        else:
            rows = [r for r in read_run(path).metrics if "eval/gold_score" in r]
            points.gold_by_prompt = _sample_golds(path / "samples.jsonl")
        for row in rows:
            points.steps.append(int(row["step"]))
            for key, name in METRICS.items():
                points.values.setdefault(key, []).append(float(row.get(name, float("nan"))))
        if points.steps:
            out.append(points)
    return out


def _sample_golds(path: Path) -> dict[int, list[float]]:
    """step -> the per-prompt gold scores PPO logged with each evaluation (samples.jsonl)."""
    out = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            with_step = json.loads(line)
            out[int(with_step["step"])] = [s["gold_score"] for s in with_step["samples"]]
    return out


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
    final_gold_by_prompt: list[float] = field(default_factory=list)  # seeds in order, per prompt
    fit: GaoFit | None = None
    gains: list[tuple[float, float]] = field(default_factory=list)  # (KL, gold - start gold)
    verdict: str = ""  # gold peaks then falls, or not, with its evidence (PPO)


def _label(run: PlannedRun) -> str:
    if run.stage == "dpo":
        name = "IPO" if run.fields.get("loss") == "ipo" else "DPO"
        return f"{name} beta {run.fields.get('beta', 0.1):g}"
    extra = ", ".join(f"{k} {v}" for k, v in run.point.items() if k != "beta")
    return f"PPO beta {run.fields.get('beta', 0.05):g}" + (f" ({extra})" if extra else "")


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
            per_step = [[m.values[key][m.steps.index(s)] for m in members] for s in steps]
            stats = [mean_and_stderr(v) for v in per_step]
            mean[key], stderr[key] = [m for m, _ in stats], [e for _, e in stats]
        group = Group(name, first.stage, float(first.fields.get("beta", 0.05)), _label(first),
                      [m.run.seed for m in members], steps, mean, stderr,
                      [m.values["gold"][-1] for m in members])
        last = [m.gold_by_prompt.get(m.steps[-1]) for m in sorted(members, key=lambda m: m.run.seed)]
        if all(last):
            group.final_gold_by_prompt = [g for scores in last for g in scores]
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


MARKERS = {"DPO": "s", "IPO": "D"}


def _plot_groups(ax, groups: list[Group], metric: str) -> None:
    """Each PPO group: mean over seeds against mean KL, a band of one standard error; each
    DPO/IPO group: one marker with error bars."""
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, g in enumerate(groups):
        colour = colours[i % len(colours)]
        xs, ys, es = g.mean["kl"], g.mean[metric], g.stderr[metric]
        if g.stage == "dpo":
            ax.errorbar(xs, ys, yerr=es, xerr=g.stderr["kl"], fmt=MARKERS[g.label[:3]],
                        markersize=9, color=colour, label=g.label, capsize=3)
            continue
        ax.plot(xs, ys, "-o", markersize=3, color=colour, label=g.label)
        ax.fill_between(xs, [y - e for y, e in zip(ys, es)], [y + e for y, e in zip(ys, es)],
                        color=colour, alpha=0.2)


def figures(groups: list[Group], points: list[RunPoints]) -> list[tuple[str, str, str]]:
    """[(title, png, caption)]."""
    out = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, title in zip(axes, ("gold", "proxy"), ("gold reward", "proxy reward")):
        _plot_groups(ax, groups, metric)
        ax.set(xlabel="KL(pi || ref), nats per response", ylabel=title, title=f"{title} against KL")
    axes[0].legend(fontsize=8)
    out.append(("Gold and proxy reward against KL", png_data(fig),
                "mean over seeds at each evaluation; the band is one standard error."))

    fig, ax = plt.subplots(figsize=(8, 5))
    everything = [(k, g) for p in points for k, g in zip(p.values["kl"], p.values["gold"])]
    ax.scatter(*zip(*everything), s=8, color="lightgrey", label="every evaluation")
    edge = frontier(everything)
    edge.append((max(k for k, _ in everything), edge[-1][1]))  # the best holds to the last KL
    ax.step(*zip(*edge), where="post", color="black", label="frontier: best gold within the KL")
    for g in groups:
        if g.stage == "dpo":
            ax.plot(g.mean["kl"], g.mean["gold"], MARKERS[g.label[:3]], markersize=11,
                    markeredgecolor="black", label=g.label)
    ax.set(xlabel="KL(pi || ref), nats per response", ylabel="gold reward",
           title="The reward-KL frontier")
    ax.legend(fontsize=8)
    out.append(("The frontier", png_data(fig), "every evaluation of every run in grey; DPO/IPO "
                "marked (evaluated once, at the end)."))

    fitted = [g for g in groups if g.fit is not None]
    if fitted:
        fig, ax = plt.subplots(figsize=(8, 5))
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, g in enumerate(fitted):
            colour = colours[i % len(colours)]
            ds = [max(k, 0) ** 0.5 for k, _ in g.gains]
            ax.scatter(ds, [y for _, y in g.gains], s=10, color=colour, alpha=0.6)
            top = max(ds) if ds else 1.0
            grid = [top * j / 60 for j in range(61)]
            ax.plot(grid, [g.fit.predict(d * d) for d in grid], color=colour,
                    label=f"{g.label}: R² {g.fit.r2:.2f}")
        ax.set(xlabel="d = sqrt(KL)", ylabel="gold gain over the start",
               title="Gao et al. 2022: gold = d (alpha - beta_RL log d)")
        ax.legend(fontsize=8)
        out.append(("Gao et al.'s fit per beta", png_data(fig), "points: every evaluation of "
                    "every seed; lines: the least-squares fit."))
    return out


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
             "gold rises, no fall beyond noise" if found.rose else "no rise beyond noise")
    return f"{label}: {found.evidence}"


def _number(value: float | None, fmt: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, fmt)


TABLE_COLUMNS = ("setting", "seeds", "start gold", "final KL", "final gold", "final proxy",
                 "alpha", "beta_RL", "R²", "fitted peak KL", "fitted peak gold", "verdict")


def table_rows(groups: list[Group]) -> list[list[str]]:
    rows = []
    for g in groups:
        final_gold, final_se = mean_and_stderr(g.final_gold)
        peak = g.fit.peak() if g.fit else None
        rows.append([g.label, str(len(g.seeds)),
                     _number(g.mean["gold"][0], "+.3f") if g.stage == "ppo" else "-",
                     _number(g.mean["kl"][-1], ".2f"), f"{final_gold:+.3f} ± {final_se:.3f}",
                     _number(g.mean["proxy"][-1], "+.3f"),
                     _number(g.fit.alpha if g.fit else None, ".3f"),
                     _number(g.fit.beta_rl if g.fit else None, ".3f"),
                     _number(g.fit.r2 if g.fit else None, ".2f"),
                     _number(peak[0] if peak else None, ".2f"),
                     _number(peak[1] if peak else None, "+.3f"), g.verdict or "-"])
    return rows


def best_observed(groups: list[Group]) -> str:
    """Where gold peaked over the whole sweep: the setting, the step, its KL (means over seeds)."""
    g, i = max(((g, i) for g in groups for i in range(len(g.steps))),
               key=lambda gi: gi[0].mean["gold"][gi[1]])
    where = f"step {g.steps[i]}" if g.stage == "ppo" else "its end"
    return (f"The best mean gold of the sweep, {g.mean['gold'][i]:+.3f} ± {g.stderr['gold'][i]:.3f},"
            f" was reached by {g.label} (beta {g.beta:g}) at {where}, KL {g.mean['kl'][i]:.2f}.")


def recommendation(groups: list[Group]):
    ppo = [g for g in groups if g.stage == "ppo"]
    return recommend_beta({g.label: g.final_gold for g in ppo}, {g.label: g.beta for g in ppo},
                          {g.label: g.final_gold_by_prompt for g in ppo if g.final_gold_by_prompt})


EXPLAIN = """<p class='note'>Each point is one held-out evaluation: KL is the mean over prompts
of the summed log-ratio log pi(y) - log ref(y) of the sampled response (nats); gold and proxy are
mean scores. The <b>frontier</b> is the best gold any run reached within each KL budget. The
<b>proxy keeps rising while gold falls</b> when the policy exploits the reward model's errors:
past some KL, more proxy buys less true reward (Gao et al. 2022). Their fit, gold gain =
d (alpha - beta_RL log d) with d = sqrt(KL), rises then peaks at d = exp(alpha / beta_RL - 1);
a negative beta_RL means no peak was reached. The recommended beta is the one whose runs end with
the most gold; when two betas are within twice the error of their gap, the larger is chosen.</p>"""


def section(sweep: Sweep, failures: dict[str, str], page_dir: Path | None = None,
            configs: bool = True) -> tuple[str, str]:
    """The sweep's results as HTML (recommendation, table, figures, configs) and a console
    summary; also writes results.csv. Links are relative to `page_dir` (default: the sweep
    directory); the demo embeds this section in its own page."""
    page_dir = page_dir or sweep.root
    points = collect(sweep)
    axes = list(dict.fromkeys(a for names in sweep.axes.values() for a in names))
    write_csv(sweep.root / "results.csv", points, axes)
    groups = summarise(points)
    rec = recommendation(groups)
    rows = table_rows(groups)
    summary = "\n".join("  ".join(row[:6]) for row in [list(TABLE_COLUMNS[:6]), *rows])
    if groups:
        summary += "\n" + best_observed(groups)
    if rec is not None:
        summary += f"\nrecommended beta {rec.beta:g} ({rec.label}): {rec.evidence}"
    body = [f"<p>{len(points)} of {len(sweep.runs)} runs finished; every point is in "
            f"<a href='{relative_link(sweep.root / 'results.csv', page_dir)}'>results.csv</a>.</p>"]
    left_out = unplanned(sweep)
    if left_out:  # points or seeds taken out of the grid: the report is the grid's, as it is now
        body.append(f"<p id='left-out' class='note'>{len(left_out)} run(s) in the sweep directory "
                    "are not in this grid and are left out: "
                    f"{html.escape(', '.join(left_out))}.</p>")
    if failures:
        body.append("<ul id='failures'>" + "".join(
            f"<li class='fails'><b>{html.escape(n)}</b>: {html.escape(e)}</li>"
            for n, e in failures.items()) + "</ul>")
    body.append("<p id='recommended'>" + (
        f"<b>Recommended beta: {rec.beta:g}</b> ({html.escape(rec.label)}). "
        f"{html.escape(rec.evidence)}." if rec else "No PPO run finished.") + "</p>")
    if groups:
        body.append(f"<p id='best-gold'>{html.escape(best_observed(groups))}</p>")
    header = "".join(f"<th>{html.escape(c)}</th>" for c in TABLE_COLUMNS)
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                    for row in rows)
    body.append(f"<table id='sweep-table'><tr>{header}</tr>{cells}</table>{EXPLAIN}")
    if points:
        body += [figure_html(data, title, caption)
                 for title, data, caption in figures(groups, points)]
    finished = [read_run(sweep.root / p.run.name) for p in points]
    if finished and configs:
        body.append("<h2 id='configs'>Configs</h2>" + config_html(finished, page_dir))
    return "\n".join(body), summary


def write(sweep: Sweep, failures: dict[str, str]) -> tuple[Path, str]:
    """results.csv and report.html in the sweep directory; returns (page, console summary)."""
    body, summary = section(sweep, failures)
    path = write_page(sweep.root / "report.html",
                      page(f"tether sweep: {sweep.root.name}",
                           "<h2 id='recommendation'>Which beta?</h2>" + body))
    return path, summary
