"""The demo's report: plots, a verdict per seed, example generations, one HTML page.

Input is one `Curve` per (run, seed): the evaluation metrics logged at each evaluation step and
the samples generated there. Output: PNGs, `report.html` beside them, and a console table with the
same numbers. The verdicts are computed from the measurements and stated plainly either way.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no screen needed; the demo runs on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402

PPO_RUNS = ("ppo-no-kl", "ppo-fixed", "ppo-adaptive")
COLOURS = {"sft": "black", "ppo-no-kl": "tab:red", "ppo-fixed": "tab:blue",
           "ppo-adaptive": "tab:green", "dpo": "tab:purple", "ipo": "tab:orange"}


@dataclass
class Curve:
    """One run at one seed: metric values at each evaluation step, and the samples there."""

    run: str
    seed: int
    steps: list[int] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=dict)
    samples: dict[int, list[dict]] = field(default_factory=dict)  # step -> [{prompt, response, score, gold_score}]

    def series(self, name: str) -> list[float]:
        return self.values.get(name, [])

    def final(self, name: str) -> float:
        return self.series(name)[-1]


@dataclass
class Verdict:
    claim: str
    seed: int
    holds: bool
    evidence: str


def verdicts(curves: list[Curve], kl_target: float) -> list[Verdict]:
    """Check the thesis on each seed, from the measurements alone.

    1. Without the KL penalty the proxy keeps rising (its final value is within 10% of the run's
       range of its maximum) while the gold reward peaks and then falls (it rises above its start,
       then ends at least 0.1 below that peak) and diversity collapses (final distinct-2 below
       half its start).
    2. With the adaptive controller the KL ends within 50% of its target, and the final gold
       reward beats the unpenalised run's final gold reward.
    """
    out = []
    by_key = {(c.run, c.seed): c for c in curves}
    for seed in sorted({c.seed for c in curves}):
        free = by_key.get(("ppo-no-kl", seed))
        adaptive = by_key.get(("ppo-adaptive", seed))
        if free is not None and len(free.steps) > 1:
            proxy, gold, dist = free.series("eval/score"), free.series("eval/gold_score"), free.series(
                "eval/distinct_2")
            proxy_rising = proxy[-1] >= max(proxy) - 0.1 * (max(proxy) - min(proxy))
            peak = gold.index(max(gold))
            # A peak needs a rise before the fall: gold that only falls from the start is not it.
            gold_fell = peak > 0 and max(gold) > gold[0] and max(gold) - gold[-1] >= 0.1
            collapsed = dist[-1] < 0.5 * dist[0]
            out.append(Verdict(
                "no KL penalty: proxy keeps rising, gold peaks then falls, diversity collapses",
                seed, proxy_rising and gold_fell and collapsed,
                f"proxy {proxy[0]:+.2f} -> max {max(proxy):+.2f} -> final {proxy[-1]:+.2f}; "
                f"gold peak {max(gold):+.2f} at step {free.steps[gold.index(max(gold))]} -> "
                f"final {gold[-1]:+.2f}; distinct-2 {dist[0]:.2f} -> {dist[-1]:.2f}"))
        if adaptive is not None and free is not None and adaptive.steps:
            kl_final = adaptive.final("eval/kl")
            near = abs(kl_final - kl_target) <= 0.5 * kl_target
            beats = adaptive.final("eval/gold_score") > free.final("eval/gold_score")
            out.append(Verdict(
                "adaptive beta: KL stays near its target and final gold beats the unpenalised run",
                seed, near and beats,
                f"final KL {kl_final:.2f} (target {kl_target:.2f}); final gold "
                f"{adaptive.final('eval/gold_score'):+.2f} vs {free.final('eval/gold_score'):+.2f} without KL"))
    return out


def _by_run(curves: list[Curve]) -> dict[str, list[Curve]]:
    runs: dict[str, list[Curve]] = {}
    for curve in curves:
        runs.setdefault(curve.run, []).append(curve)
    return runs


def _plot_lines(ax, curves: list[Curve], x_name: str | None, y_name: str, label_runs: bool):
    for run, group in _by_run(curves).items():
        for i, curve in enumerate(group):
            ys = curve.series(y_name)
            if not ys:
                continue
            xs = curve.steps if x_name is None else curve.series(x_name)
            style = "-o" if len(ys) == 1 else "-"
            ax.plot(xs, ys, style, color=COLOURS.get(run, "grey"), alpha=0.8,
                    label=run if (label_runs and i == 0) else None, markersize=5)


def plot_all(curves: list[Curve], out_dir: Path, kl_target: float) -> dict[str, str]:
    """Draw every figure; returns {title: file name}."""
    ppo = [c for c in curves if c.run in PPO_RUNS]
    figures = {}

    def save(fig, name: str, title: str):
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        figures[title] = name

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, title in zip(axes, ("eval/score", "eval/gold_score"), ("proxy reward", "gold reward")):
        _plot_lines(ax, ppo, None, metric, label_runs=True)
        ax.set(xlabel="PPO batch", ylabel=title, title=f"{title} against step")
    axes[0].legend()
    save(fig, "reward_vs_step.png", "Proxy and gold reward against step")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, title in zip(axes, ("eval/score", "eval/gold_score"), ("proxy reward", "gold reward")):
        _plot_lines(ax, ppo, "eval/kl", metric, label_runs=True)
        ax.set(xlabel="KL(pi || ref), nats per response", ylabel=title, title=f"{title} against KL")
    axes[0].legend()
    save(fig, "reward_vs_kl.png", "Proxy and gold reward against KL")

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    _plot_lines(axes[0], ppo, None, "objective/beta", label_runs=True)
    axes[0].set(xlabel="PPO batch", ylabel="beta", title="beta's trajectory")
    _plot_lines(axes[1], ppo, None, "eval/kl", label_runs=True)
    axes[1].axhline(kl_target, color="tab:green", linestyle=":", label="adaptive target")
    axes[1].set(xlabel="PPO batch", ylabel="KL, nats", title="KL against step")
    _plot_lines(axes[2], ppo, None, "eval/distinct_2", label_runs=True)
    axes[2].set(xlabel="PPO batch", ylabel="distinct-2", title="diversity (distinct-2)")
    for ax in axes:
        ax.legend()
    save(fig, "beta_kl_diversity.png", "beta, KL and diversity against step")

    fig, ax = plt.subplots(figsize=(7, 5))
    _plot_lines(ax, curves, "eval/kl", "eval/gold_score", label_runs=True)
    ax.set(xlabel="KL(pi || ref), nats per response", ylabel="gold reward",
           title="The frontier: gold reward against KL, every run")
    ax.legend()
    save(fig, "frontier.png", "The frontier: gold reward against KL")
    return figures


SUMMARY_COLUMNS = ("run", "seed", "final proxy", "final gold", "peak gold", "final KL",
                   "distinct-2", "final beta")


def summary_rows(curves: list[Curve]) -> list[list[str]]:
    rows = []
    for c in curves:
        gold = c.series("eval/gold_score")
        beta = c.series("objective/beta")
        rows.append([c.run, str(c.seed), f"{c.final('eval/score'):+.3f}", f"{gold[-1]:+.3f}",
                     f"{max(gold):+.3f}", f"{c.final('eval/kl'):.2f}",
                     f"{c.final('eval/distinct_2'):.2f}", f"{beta[-1]:.3f}" if beta else "-"])
    return rows


def console_table(curves: list[Curve], found: list[Verdict]) -> str:
    rows = [list(SUMMARY_COLUMNS)] + summary_rows(curves)
    widths = [max(len(r[i]) for r in rows) for i in range(len(SUMMARY_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for v in found:
        lines.append(f"[{'holds' if v.holds else 'DOES NOT HOLD'}] seed {v.seed}: {v.claim} "
                     f"({v.evidence})")
    return "\n".join(lines)


def _sample_points(curve: Curve) -> list[tuple[str, int]]:
    if not curve.steps:
        return []
    gold = curve.series("eval/gold_score")
    best = curve.steps[gold.index(max(gold))]
    points = [("start", curve.steps[0]), ("best gold", best), ("end", curve.steps[-1])]
    seen, unique = set(), []
    for label, step in points:
        if step not in seen and step in curve.samples:
            seen.add(step)
            unique.append((label, step))
    return unique


def _samples_html(curves: list[Curve], per_point: int = 4) -> str:
    parts = []
    for curve in curves:
        if curve.seed != min(c.seed for c in curves if c.run == curve.run):
            continue  # one seed's examples per run keeps the page readable
        parts.append(f"<h3>{html.escape(curve.run)} (seed {curve.seed})</h3><table>"
                     "<tr><th>when</th><th>prompt</th><th>response</th><th>proxy</th>"
                     "<th>gold</th></tr>")
        for label, step in _sample_points(curve):
            for s in curve.samples[step][:per_point]:
                parts.append(
                    f"<tr><td>{label} (step {step})</td><td>{html.escape(s['prompt'])}</td>"
                    f"<td>{html.escape(s['response'])}</td><td>{s['score']:+.2f}</td>"
                    f"<td>{s['gold_score']:+.2f}</td></tr>")
        parts.append("</table>")
    return "\n".join(parts)


def write_report(curves: list[Curve], out_dir: str | Path, kl_target: float,
                 settings: dict[str, str]) -> tuple[Path, str]:
    """Write `report.html` and its PNGs into `out_dir`; returns (path, console summary)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = plot_all(curves, out, kl_target)
    found = verdicts(curves, kl_target)
    rows = summary_rows(curves)
    table = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                    for row in rows)
    verdict_items = "".join(
        f"<li class='{'holds' if v.holds else 'fails'}'><b>{'Holds' if v.holds else 'Does not hold'}"
        f"</b> (seed {v.seed}): {html.escape(v.claim)}. <span>{html.escape(v.evidence)}</span></li>"
        for v in found)
    images = "".join(f"<figure><img src='{name}' alt='{html.escape(title)}'>"
                     f"<figcaption>{html.escape(title)}</figcaption></figure>"
                     for title, name in figures.items())
    settings_items = "".join(f"<li>{html.escape(k)}: {html.escape(v)}</li>"
                             for k, v in settings.items())
    page = _PAGE.format(
        header="".join(f"<th>{c}</th>" for c in SUMMARY_COLUMNS), table=table,
        verdicts=verdict_items or "<li>No PPO runs to judge.</li>", images=images,
        samples=_samples_html(curves), settings=settings_items)
    path = out / "report.html"
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path, console_table(curves, found)


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tether demo: the KL leash at work</title>
<style>
body {{ font-family: sans-serif; max-width: 1100px; margin: 2em auto; line-height: 1.45; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: left; font-size: 0.92em; }}
li.holds b {{ color: #1a7f37; }} li.fails b {{ color: #b42318; }}
img {{ max-width: 100%; }} figure {{ margin: 1.5em 0; }}
</style></head><body>
<h1>The KL leash at work</h1>
<p>A small language model learned to write short movie reviews (SFT). A reward model learned
what reviewers like from a limited set of noisy preference pairs (the <i>proxy</i>). PPO then
optimised the proxy three ways: with no KL penalty, with a fixed beta, and with the adaptive
controller that keeps KL(pi || pi_SFT) near a target. DPO and IPO learned from the same pairs
offline. The <i>gold</i> reward is what we actually want: the sentiment of the text (VADER) if it
is a well-formed review, and -1 if it is not. No run ever sees it.</p>
<h2 id="summary">Summary</h2>
<ul id="verdicts">{verdicts}</ul>
<table id="summary-table"><tr>{header}</tr>{table}</table>
<p>Proxy and gold are means over held-out prompts; KL is the mean over those prompts of the summed
per-token log-ratio log pi(y) - log pi_SFT(y) of the sampled response; distinct-2 is the share of
unique word pairs among all generated word pairs.</p>
<h2>Plots</h2>
{images}
<h2>Example generations</h2>
<p>At the start, at the point of best gold reward, and at the end of each run.</p>
{samples}
<h2>Settings</h2><ul>{settings}</ul>
</body></html>
"""
