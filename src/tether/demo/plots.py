"""The demo's figures: every run as the mean over its seeds with a band of one standard error,
each seed a thin line of its own style; single evaluations (SFT, DPO, IPO) as large markers.
Each run has one colour on the whole page (tether.tools.report.Palette, RUN_COLOURS); pyplot comes
from tether.tools.report, on the Agg backend (no screen needed: the demo runs on servers and CI)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.ticker import MaxNLocator

from tether.demo.curves import PPO_RUNS, Curve, by_run, common_steps
from tether.tools.frontier import mean_and_stderr, over_seeds
from tether.tools.report import GUIDE, MARKERS, Palette, plt, png_data

SEED_STYLES = ("-", "--", ":", "-.")


def _points(ax, run: str, group: list[Curve], x_name: str | None, y_name: str,
            palette: Palette) -> None:
    """A run evaluated once: one marker at the mean over seeds, error bars when seeds differ."""
    ys = [c.series(y_name)[0] for c in group if c.series(y_name)]
    if not ys:
        return
    xs = [0.0 if x_name is None else c.series(x_name)[0] for c in group]
    (x, x_se), (y, y_se) = mean_and_stderr(xs), mean_and_stderr(ys)
    drawn = ax.errorbar([x], [y], xerr=[x_se], yerr=[y_se], fmt=MARKERS.get(run, "o"),
                        markersize=10, color=palette(run), markeredgecolor="black", zorder=5,
                        label=run, capsize=3)
    drawn.lines[0].set_gid(run)


def plot_runs(ax, curves: list[Curve], x_name: str | None, y_name: str,
              palette: Palette) -> None:
    """Against the step (`x_name` None: whole-number ticks, never 1.2) or another metric (its
    mean over seeds per step); each run in its palette colour."""
    if x_name is None:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for run, group in by_run(curves).items():
        if all(len(c.steps) == 1 for c in group):
            _points(ax, run, group, x_name, y_name, palette)
            continue
        steps = common_steps(group)
        if not steps or not group[0].series(y_name):
            continue
        colour = palette(run)

        if len(group) > 1:
            for i, curve in enumerate(group):
                ax.plot(curve.at(steps, x_name), curve.at(steps, y_name), SEED_STYLES[i % len(SEED_STYLES)],
                        color=colour, alpha=0.45, linewidth=1)
        xs, _ = over_seeds([c.at(steps, x_name) for c in group])
        ys, errors = over_seeds([c.at(steps, y_name) for c in group])
        ax.plot(xs, ys, "-", color=colour, linewidth=2.2, label=f"{run} (mean of {len(group)})"
                if len(group) > 1 else run, gid=run)
        if len(group) > 1:
            ax.fill_between(xs, [m - e for m, e in zip(ys, errors)],
                            [m + e for m, e in zip(ys, errors)], color=colour, alpha=0.18)


def _seed_legend(ax, curves: list[Curve]) -> None:
    seeds = sorted({c.seed for c in curves if c.run in PPO_RUNS})
    if len(seeds) > 1:  # thin lines: one style per seed, named once
        for i, seed in enumerate(seeds):
            ax.plot([], [], SEED_STYLES[i % len(SEED_STYLES)], color="grey", label=f"seed {seed}",
                    gid=GUIDE)
    ax.legend(fontsize=8)


def plot_all(curves: list[Curve], out_dir: Path, kl_target: float
             ) -> dict[str, tuple[str, dict[str, str]]]:
    """Draw every figure; returns {title: (file name, legend colours)}."""
    ppo = [c for c in curves if c.run in PPO_RUNS]
    palette = Palette()
    figures = {}

    for x_name, name, title in ((None, "reward_vs_step.png", "Proxy and gold reward against step"),
                                ("eval/kl", "reward_vs_kl.png", "Proxy and gold reward against KL")):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, metric, label in zip(axes, ("eval/score", "eval/gold_score"),
                                     ("proxy reward", "gold reward")):
            plot_runs(ax, ppo, x_name, metric, palette)
            ax.set(xlabel="PPO batch" if x_name is None else "KL(pi || ref), nats per response",
                   ylabel=label, title=f"{label} against {'step' if x_name is None else 'KL'}")
        _seed_legend(axes[0], ppo)
        figures[title] = png_data(fig, out_dir / name, dpi=90)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    plot_runs(axes[0], ppo, None, "objective/beta", palette)
    axes[0].set(xlabel="PPO batch", ylabel="beta", title="beta's trajectory")
    plot_runs(axes[1], ppo, None, "eval/kl", palette)
    axes[1].axhline(kl_target, color=palette("ppo-adaptive"), linestyle=":",
                    label="adaptive target", gid=GUIDE)
    axes[1].set(xlabel="PPO batch", ylabel="KL, nats", title="KL against step")
    plot_runs(axes[2], ppo, None, "eval/distinct_2", palette)
    axes[2].set(xlabel="PPO batch", ylabel="distinct-2", title="diversity (distinct-2)")
    for ax in axes:
        _seed_legend(ax, ppo)
    figures["beta, KL and diversity against step"] = png_data(fig, out_dir / "beta_kl_diversity.png", dpi=90)

    fig, ax = plt.subplots(figsize=(7, 5))
    plot_runs(ax, curves, "eval/kl", "eval/gold_score", palette)
    ax.set(xlabel="KL(pi || ref), nats per response", ylabel="gold reward",
           title="The frontier: gold reward against KL, every run")
    _seed_legend(ax, curves)
    figures["The frontier: gold reward against KL"] = png_data(fig, out_dir / "frontier.png", dpi=90)
    return figures
