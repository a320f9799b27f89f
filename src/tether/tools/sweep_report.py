"""The sweep's report: results.csv and report.html (the frontier, Gao et al.'s fit, beta).

    sweep_results   each finished run's evaluation points, summarised per grid point
    write()         the CSV, three figures, a table, the recommended beta with its evidence

Figures are drawn with tether.tools.report's machinery (inline PNGs in one self-contained page).
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from tether.tools.frontier import (
    Recommendation,
    error_text,
    frontier,
    gao_fit,
    mean_and_stderr,
    one_curve_test,
    recommend_beta,
)
from tether.tools.report import (
    GUIDE,
    MARKERS,
    Palette,
    config_html,
    figure_html,
    plt,
    png_data,
    read_run,
    relative_link,
    rows_html,
    write_page,
)
from tether.tools.sweep_plan import Sweep, unplanned
from tether.tools.sweep_results import (
    Group,
    RunPoints,
    best_of_n_curve,
    collect,
    interpolation,
    summarise,
    write_csv,
)


def _plot_groups(ax, groups: list[Group], metric: str, palette: Palette) -> None:
    """Each PPO group: mean over seeds against mean KL, a band of one standard error; each
    DPO/IPO group: one marker with error bars."""
    for g in groups:
        colour = palette(g.label)
        xs, ys, es = g.mean["kl"], g.mean[metric], g.stderr[metric]
        if g.stage == "dpo":
            ax.errorbar(xs, ys, yerr=es, xerr=g.stderr["kl"], fmt=MARKERS[g.label[:3].lower()],
                        markersize=9, color=colour, markeredgecolor="black", label=g.label,
                        capsize=3)
            continue
        ax.plot(xs, ys, "-o", markersize=3, color=colour, label=g.label)
        ax.fill_between(xs, [y - e for y, e in zip(ys, es)], [y + e for y, e in zip(ys, es)],
                        color=colour, alpha=0.2)


BON = "best-of-n"  # the baselines' labels and colours in every figure
INTERPOLATED = "interpolated"


def _frontier_figure(groups: list[Group], points: list[RunPoints], palette: Palette,
                     curve: list[dict], line: tuple[str, list]):
    """Every evaluation in its setting's colour, the frontier over all of them, DPO/IPO marked,
    the best-of-n curve (`curve`: bon.json) at its exact KL, and the interpolation of one run
    (`line`: sweep_results.interpolation); returns (figure, caption)."""
    fig, ax = plt.subplots(figsize=(8, 5))
    name, etas = line
    if etas:
        ax.errorbar([p[1] for p in etas], [p[2] for p in etas], yerr=[p[3] for p in etas],
                    fmt=":D", markersize=5, capsize=2, color=palette(INTERPOLATED),
                    gid=INTERPOLATED,
                    label=f"{name}'s weights from its start, eta {etas[0][0]:g}..{etas[-1][0]:g}")
    if curve:
        ax.errorbar([c["kl_exact"] for c in curve], [c["gold"] for c in curve],
                    yerr=[c["gold_se"] for c in curve], fmt="--s", markersize=4, capsize=2,
                    color=palette(BON), gid=BON, label=f"{BON}, n = 1..{curve[-1]['n']} (exact KL)")
    for g in (g for g in groups if g.stage != "dpo"):
        mine = [(k, y) for p in points if p.run.group == g.name
                for k, y in zip(p.values["kl"], p.values["gold"])]
        if mine:
            ax.scatter(*zip(*mine), s=10, alpha=0.55, color=palette(g.label), label=g.label)
    everything = [(k, g) for p in points for k, g in zip(p.values["kl"], p.values["gold"])]
    edge = frontier(everything)
    edge.append((max(k for k, _ in everything), edge[-1][1]))  # the best holds to the last KL
    ax.step(*zip(*edge), where="post", color="black", label="frontier: best gold within the KL",
            gid=GUIDE)
    offline = [g for g in groups if g.stage == "dpo"]
    for g in offline:
        ax.plot(g.mean["kl"], g.mean["gold"], MARKERS[g.label[:3].lower()], markersize=11,
                color=palette(g.label), markeredgecolor="black", label=g.label)
    ax.set(xlabel="KL(pi || ref), nats per response", ylabel="gold reward",
           title="The reward-KL frontier")
    ax.legend(fontsize=8)
    caption = ("every evaluation of every run, in its setting's colour; the black steps are the "
               "best gold reached within each KL.")
    if etas:
        caption += (f" The diamonds are {name}'s weights interpolated from its starting model "
                    "(tether interpolate), each evaluated on the same prompts.")
    if curve:
        caption += (f" The dashed squares are best-of-n from one pool of {curve[-1]['n']} samples "
                    "of the starting policy (tether bon), at best-of-n's exact KL, ± one standard "
                    "error over prompts.")
    if offline:
        caption += (" " + "/".join(sorted({g.label[:3] for g in offline}))
                    + " marked (evaluated once, at the end).")
    return fig, caption


def _fit_label(g: Group, top: float) -> str:
    """The legend of one fit: how many points it rests on and where its peak lies."""
    # Two parameters through three points: an R² near 1 says little, so the legend says "only".
    label = f"{g.label}: fit of {'only ' if g.fit.n <= 3 else ''}{g.fit.n} points"
    peak = g.fit.peak()
    if peak is None:
        label += ", no peak"
    elif peak[0] ** 0.5 > top:
        label += f", peak beyond the data (KL {peak[0]:.3g})"
    return label + f", R² {g.fit.r2:.2f}"


def _fit_figure(fitted: list[Group], palette: Palette, curve: list[dict]):
    """Gao et al.'s fit per setting, each drawn only over the d its evaluations reached, and
    their best-of-n form fitted to the best-of-n curve."""
    fig, ax = plt.subplots(figsize=(8, 5))
    # Gao et al.'s best-of-n form fitted to the gold gain over n = 1 against the exact KL (None
    # without a curve, or with too few points)
    gains = [c["gold"] - curve[0]["gold"] for c in curve]
    bon_fit = gao_fit([c["kl_exact"] for c in curve], gains, form="bon")
    if bon_fit is not None:
        ds = [c["kl_exact"] ** 0.5 for c in curve]
        ax.scatter(ds, gains, marker="s", s=12, color=palette(BON))
        ax.plot(ds, [bon_fit.predict(d * d) for d in ds], "--", color=palette(BON), gid=BON,
                label=f"{BON}: d (alpha - beta d), R² {bon_fit.r2:.2f}")
    for g in fitted:
        colour = palette(g.label)
        ds = [max(k, 0) ** 0.5 for k, _ in g.gains]
        ax.scatter(ds, [y for _, y in g.gains], s=10, color=colour, alpha=0.6)
        low, top = min(ds), max(ds)
        grid = [low + (top - low) * j / 60 for j in range(61)]
        ax.plot(grid, [g.fit.predict(d * d) for d in grid], color=colour,
                label=_fit_label(g, top), gid=g.label)
        peak = g.fit.peak()
        if peak is not None and low <= peak[0] ** 0.5 <= top:
            ax.plot([peak[0] ** 0.5], [peak[1]], "*", markersize=12, color=colour,
                    markeredgecolor="black", gid=g.label)
    ax.set(xlabel="d = sqrt(KL)", ylabel="gold gain over the start",
           title="Gao et al. 2022: gold = d (alpha - beta_RL log d)")
    ax.legend(fontsize=8)
    return fig


def versus_best_of_n(groups: list[Group], curve: list[dict]) -> str:
    """The page's sentence on RL against best-of-n: best-of-N's gold gain at its exact KL, and
    the best PPO setting's mean gain (over seeds) at an evaluation within that KL."""
    top = curve[-1]
    gain, se = top["gold"] - curve[0]["gold"], top["gold_se"]
    said = (f"Best-of-{top['n']}: gold {gain:+.3f} ± {se:.3f} over the starting policy at "
            f"{top['kl_exact']:.2f} nats (its exact KL; the usual formula says "
            f"{top['kl_bound']:.2f})")
    rl = [(y - g.mean["gold"][0], k, g.label) for g in groups if g.stage == "ppo"
          and g.steps[:1] == [0] for k, y in zip(g.mean["kl"], g.mean["gold"])
          if k <= top["kl_exact"]]
    if not rl:
        return said + "; no PPO evaluation lies within that KL."
    best, kl, label = max(rl)
    verdict = ("more gold than" if best - gain > 2 * se else "less gold than"
               if gain - best > 2 * se else "as much gold, within two standard errors, as")
    return (f"{said}; the best PPO setting within it, {label}, gains {best:+.3f} at {kl:.2f} "
            f"nats: within this KL, RL buys {verdict} best-of-n.")


def interpolation_sentence(name: str, etas: list) -> str:
    """The page's sentence on the interpolated run: its best point against its own end."""
    eta, kl, gold, se = max(etas, key=lambda p: p[2])
    end = etas[-1]
    return (f"Interpolating {name}'s weights from its start (WiSE-FT; WARP's LITI): the best "
            f"point, eta {eta:g}, reaches gold {gold:+.3f} ± {se:.3f} at KL {kl:.2f}, against "
            f"{end[2]:+.3f} ± {end[3]:.3f} at KL {end[1]:.2f} for eta {end[0]:g}.")


def one_curve_sentence(groups: list[Group]) -> str:
    """The page's sentence on Gao et al.'s "the KL penalty acts as early stopping"
    (frontier.one_curve_test on the PPO settings' (KL, gold gain) points); "" with fewer than
    two fitted settings."""
    parts = [g.gains for g in groups if g.fit is not None]
    test = one_curve_test(parts)
    if test is None:
        return ""
    share, p = test
    verdict = ("holds on this task: the settings' points lie on one curve within noise"
               if p > 0.05 else "does not hold on this task: the settings trace different curves")
    return (f"One curve for every setting (Gao et al.: a KL penalty acts as early stopping) "
            f"{verdict} (a fit per setting cuts the residual sum of squares by {share:.0%} "
            f"against one fit to all {sum(map(len, parts))} points; permutation p = {p:.3f}).")


def figures(groups: list[Group], points: list[RunPoints], curve: list[dict] | None = None,
            line: tuple[str, list] = ("", []), palette: Palette | None = None
            ) -> list[tuple[str, str, str, dict[str, str]]]:
    """[(title, img src, caption, legend colours)]; one colour per setting in every figure
    (`palette`: the page's, when it has other figures)."""
    # One colour per setting, handed out in the groups' order, so the sweep page and the demo
    # page (which embeds these figures) colour each setting alike, and no setting takes a colour
    # of the demo's own runs (RUN_COLOURS).
    palette = palette or Palette()
    for g in groups:
        palette(g.label)
    out = []

    def add(title: str, fig, caption: str) -> None:
        src, colours = png_data(fig)
        out.append((title, src, caption, colours))

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, title in zip(axes, ("gold", "proxy"), ("gold reward", "proxy reward")):
        _plot_groups(ax, groups, metric, palette)
        ax.set(xlabel="KL(pi || ref), nats per response", ylabel=title, title=f"{title} against KL")
    axes[0].legend(fontsize=8)
    add("Gold and proxy reward against KL", fig,
        "mean over seeds at each evaluation; the band is one standard error (none with one seed).")
    add("The frontier", *_frontier_figure(groups, points, palette, curve or [], line))
    if fitted := [g for g in groups if g.fit is not None]:
        add("Gao et al.'s fit per beta", _fit_figure(fitted, palette, curve or []),
            "points: every evaluation of every seed; lines: the least-squares fit, drawn only "
            "over the KL each setting reached (no extrapolation); a star marks a fitted peak "
            "inside the data.")
    return out


def _number(value: float | None, fmt: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, fmt)


TABLE_COLUMNS = ("setting", "seeds", "start gold", "final KL", "final gold", "end gold",
                 "vs the best end gold", "final proxy", "Gao fit: alpha, beta_RL", "fit quality",
                 "verdict")


def _versus(g: Group, rec: Recommendation | None) -> str:
    """The rule's comparison, as the table shows it: this setting's end gold against the best."""
    if rec is None or g.label not in rec.tied + list(rec.gaps):
        return "-"
    if g.label == rec.best:
        text = "measured best"
    else:
        gap, err = rec.gaps[g.label]
        text = f"{-gap:+.3f} ± {err:.3f}: " + ("within noise" if g.label in rec.tied else
                                                 "below, beyond noise")
    return text + ("; recommended" if g.label == rec.label else "")


def table_rows(groups: list[Group], rec: Recommendation | None = None) -> list[list[str]]:
    rows = []
    for g in groups:
        final_gold, final_se = mean_and_stderr(g.final_gold)
        end = sum(g.end_gold) / len(g.end_gold) if g.end_gold else None
        rows.append([g.label, str(len(g.seeds)),
                     _number(g.mean["gold"][0], "+.3f") if g.stage == "ppo" else "-",
                     _number(g.mean["kl"][-1], ".2f"),
                     error_text(final_gold, final_se, len(g.final_gold)),
                     _number(end, "+.3f"), _versus(g, rec),
                     _number(g.mean["proxy"][-1], "+.3f"),
                     f"{g.fit.alpha:.3f}, {g.fit.beta_rl:.3f}" if g.fit else "-",
                     g.fit.describe(max(g.mean["kl"])) if g.fit else "-", g.verdict or "-"])
    return rows


def best_observed(groups: list[Group]) -> str:
    """Where gold peaked over the whole sweep: the setting, the step, its KL (means over seeds)."""
    g, i = max(((g, i) for g in groups for i in range(len(g.steps))),
               key=lambda gi: gi[0].mean["gold"][gi[1]])
    where = f"step {g.steps[i]}" if g.stage == "ppo" else "its end"
    gold = error_text(g.mean["gold"][i], g.stderr["gold"][i], len(g.seeds))
    return (f"The best single evaluation of the sweep (mean gold over seeds), {gold}, was "
            f"{g.label} (beta {g.beta:g}) at {where}, KL {g.mean['kl'][i]:.2f}; one evaluation "
            "is not the end of training, which the recommendation judges.")


def rule_sentence(groups: list[Group]) -> str:
    """The rule in one sentence, naming the evaluations it averages (said only beside a
    recommendation, so some PPO group has its end steps)."""
    ppo = [g for g in groups if g.stage == "ppo" and g.end_steps]
    steps = ", ".join(str(s) for s in ppo[0].end_steps)
    seeds = sorted({s for g in ppo for s in g.seeds})
    return (f"The rule: each beta is judged on its end gold, the mean gold of its last "
            f"{len(ppo[0].end_steps)} evaluations (steps {steps}), per "
            f"held-out prompt, over seed(s) {', '.join(map(str, seeds))}; a beta whose gap to the "
            "best, paired prompt by prompt, is within twice its standard error cannot be told "
            "apart from the best, and among those the largest beta is recommended.")


EXPLAIN = """<p class='note'>Each point is one held-out evaluation: KL is the mean over prompts
of the summed log-ratio log pi(y) - log ref(y) of the sampled response (nats); gold and proxy are
mean scores. <b>Final gold</b> is the last evaluation alone; <b>end gold</b>, which the
recommendation uses, averages the last few. The <b>frontier</b> is the best gold any run reached
within each KL budget. The <b>proxy keeps rising while gold falls</b> when the policy exploits
the reward model's errors: past some KL, more proxy buys less true reward (Gao et al. 2022).
Their fit, gold gain = d (alpha - beta_RL log d) with d = sqrt(KL), rises then peaks at
d = exp(alpha / beta_RL - 1); a negative beta_RL means no peak was reached, and a peak beyond
the KL the runs reached is an extrapolation, not a measurement.</p>"""


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
    ppo = [g for g in groups if g.stage == "ppo" and g.end_gold]  # judged on end gold (END_EVALS)
    rec = recommend_beta({g.label: g.end_gold for g in ppo}, {g.label: g.beta for g in ppo},
                         {g.label: len(g.seeds) for g in ppo})
    rows = table_rows(groups, rec)
    summary = "\n".join("  ".join(row[:7]) for row in [list(TABLE_COLUMNS[:7]), *rows])
    if groups:
        summary += "\n" + best_observed(groups)
    if rec is not None:
        head, evidence, pick = recommendation_text(rec)
        summary += f"\n{head}: {evidence}{' ' + pick if pick else ''}\n" + rule_sentence(groups)
    body = [f"<p>{len(points)} of {len(sweep.runs)} runs finished; every point is in "
            f"<a href='{relative_link(sweep.root / 'results.csv', page_dir)}'>results.csv</a>.</p>"]
    if left_out := unplanned(sweep):  # points or seeds taken out of the grid: the report is the grid's, as it is now
        body.append(f"<p id='left-out' class='note'>{len(left_out)} run(s) in the sweep directory "
                    "are not in this grid and are left out: "
                    f"{html.escape(', '.join(left_out))}.</p>")
    if failures:
        body.append("<ul id='failures'>" + "".join(
            f"<li class='fails'><b>{html.escape(n)}</b>: {html.escape(e)}</li>"
            for n, e in failures.items()) + "</ul>")
    body.append("<p id='recommended'>" + (
        "<b>{}</b>: {} <b>{}</b>".format(*map(html.escape, recommendation_text(rec))) if rec
        else "No PPO run finished.") + "</p>")
    if rec is not None:
        body.append(f"<p id='rule' class='note'>{html.escape(rule_sentence(groups))}</p>")
    if groups:
        body.append(f"<p id='best-gold'>{html.escape(best_observed(groups))}</p>")
    line, curve = interpolation(sweep), best_of_n_curve(sweep)
    for key, said in (("interpolated", line[1] and interpolation_sentence(*line)),
                      ("one-curve", one_curve_sentence(groups)),
                      ("best-of-n", curve and groups and versus_best_of_n(groups, curve))):
        if said:
            body.append(f"<p id='{key}'>{html.escape(said)}</p>")
            summary += "\n" + said
    body.append(f"<table id='sweep-table'>{rows_html([TABLE_COLUMNS], 'th')}{rows_html(rows)}"
                f"</table>{EXPLAIN}")
    if points:
        body += [figure_html(src, title, caption, colours)
                 for title, src, caption, colours in figures(groups, points, curve, line)]
    if (finished := [read_run(sweep.root / p.run.name) for p in points]) and configs:
        body.append("<h2 id='configs'>Configs</h2>" + config_html(finished, page_dir))
    return "\n".join(body), summary


UNCLEAR = "No clear winner: "  # how recommend_beta's evidence opens when the best is tied


def recommendation_text(rec: Recommendation) -> tuple[str, str, str]:
    """(headline, evidence, pick): the recommendation as the page and the console say it.

    Where the evidence cannot separate the best measured beta from others, "No clear winner"
    is the headline and the rule's pick comes after the evidence: "Recommended beta: 1" just
    above "beta 0 measured best" would read as a contradiction."""
    if rec.evidence.startswith(UNCLEAR):
        return ("No clear winner", rec.evidence.removeprefix(UNCLEAR),
                f"The rule's pick: beta {rec.beta:g} ({rec.label}).")
    return f"Recommended beta: {rec.beta:g} ({rec.label})", rec.evidence, ""


def write(sweep: Sweep, failures: dict[str, str]) -> tuple[Path, str]:
    """results.csv and report.html in the sweep directory; returns (page, console summary)."""
    body, summary = section(sweep, failures)
    path = write_page(sweep.root / "report.html", f"tether sweep: {sweep.root.name}",
                      "<h2 id='recommendation'>Which beta?</h2>" + body)
    return path, summary
