"""The demo's report: plots, verdicts that respect noise, example generations, one HTML page.

Input is one `Curve` per (run, seed): the evaluation metrics logged at each evaluation step and
the samples generated there (with each prompt's gold score). Output: PNGs, `report.html` beside
them, and a console table with the same numbers. A verdict is computed from the measurements,
over all seeds, on the per-prompt scores (tether.tools.frontier), and stated plainly either way.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path

from tether.demo.curves import PPO_RUNS, Curve, by_run, common_steps, mean_series, pooled_golds
from tether.demo.plots import plot_all
from tether.tools.frontier import paired_difference, peak_then_fall
from tether.tools.report import config_html, figure_html, read_run, rows_html, write_page


@dataclass
class Verdict:
    claim: str
    holds: bool
    evidence: str
    note: str = ""  # a sentence that interprets the result
    # Where it does not hold but every change it names points the claimed way and only an error
    # bar is too wide: what it was measured on (1 seed; 128 prompts), and about how many would
    # show it.
    count: int = 0
    unit: str = "seed"
    needs: int = 0

    @property
    def status(self) -> str:
        """`holds`, `not shown with 1 seed (needs about 4 seeds)`, or `DOES NOT HOLD` where
        the numbers contradict the claim."""
        if self.holds:
            return "holds"
        if self.needs:
            return (f"not shown with {self.count} {self.unit}{'s' if self.count > 1 else ''} "
                    f"(needs about {self.needs} {self.unit}s)")
        return "DOES NOT HOLD"


def needed_to_show(changes: list[tuple[float, float]], count: int) -> int:
    """How many seeds (or prompts) would put every change beyond twice its error if its mean
    held; 0 when a change points the wrong way (no number of them shows it).

    `changes`: (mean, standard error) of each change, on the claim's side when positive,
    measured over `count` of them. The error of such a mean falls about as 1/sqrt(count), so a
    change at mean m with error e needs about count * (2e/m)^2. Over seeds this is an order of
    magnitude (the error also holds the prompts' and the sampling's spread), which is what a
    reader choosing --seeds needs.
    """
    if any(mean <= 0 for mean, _ in changes):
        return 0
    return max(count + 1, *(math.ceil(count * (2 * se / mean) ** 2) for mean, se in changes))


def _judged(claim: str, evidence: str, shown: bool, changes: list[tuple[float, float]],
            measured_on: tuple[int, str], note: str = "") -> Verdict:
    """A verdict from its other conditions (`shown`: each one that is not a noise test holds)
    and the changes that must each exceed twice their error; `measured_on`: (3, "seed")."""
    beyond = all(mean > 2 * se for mean, se in changes)
    needs = needed_to_show(changes, measured_on[0]) if shown and not beyond else 0
    return Verdict(claim, shown and beyond, evidence, note, *measured_on, needs)


def _no_kl_verdicts(free: list[Curve]) -> list[Verdict]:
    """Proxy keeps rising while gold ends below its start and diversity collapses; and,
    separately, whether gold first rose to a peak beyond noise."""
    steps, proxy = mean_series(free, "eval/score")
    gold, dist, kl = (mean_series(free, name)[1]
                      for name in ("eval/gold_score", "eval/distinct_2", "eval/kl"))
    proxy_rising = proxy[-1] >= max(proxy) - 0.1 * (max(proxy) - min(proxy))
    start, final = pooled_golds(free, steps[0]), pooled_golds(free, steps[-1])
    drop, drop_se = paired_difference(final, start)  # start - final, per prompt
    collapsed = dist[-1] < 0.5 * dist[0]
    hacked = _judged(
        "no KL penalty: the proxy keeps rising while gold ends below its start and diversity "
        "collapses",
        f"proxy {proxy[0]:+.2f} -> max {max(proxy):+.2f} -> final {proxy[-1]:+.2f}; gold "
        f"{gold[0]:+.3f} -> {gold[-1]:+.3f} (a fall of {drop:+.3f} ± {drop_se:.3f}); "
        f"distinct-2 {dist[0]:.2f} -> {dist[-1]:.2f}; {len(free)} seed(s)",
        proxy_rising and collapsed, [(drop, drop_se)], (len(free), "seed"))
    peak = gold.index(max(gold))
    found = peak_then_fall(start, pooled_golds(free, steps[peak]), final, kl[peak])
    pooled = f"{len(free)} seeds pooled: " if len(free) > 1 else ""
    peaked = _judged("no KL penalty: gold first peaks above its start, then falls",
                     f"{pooled}{found.evidence}, best at step {steps[peak]}; a peak must beat the "
                     "start by twice its error", peak > 0, [found.rise, found.fall],
                     (len(free), "seed"),
                     _per_seed_peaks(free) if len(free) > 1 else "")
    return [hacked, peaked]


def _per_seed_peaks(free: list[Curve]) -> str:
    """The same test seed by seed (each at its own best evaluation), so a seed that peaks is
    named even when the pooled verdict, or another section's seed-0 run, says otherwise."""
    parts = []
    for curve in free:
        gold, steps = curve.series("eval/gold_score"), curve.steps
        peak = gold.index(max(gold))
        found = peak_then_fall(pooled_golds([curve], steps[0]), pooled_golds([curve], steps[peak]),
                               pooled_golds([curve], steps[-1]), curve.series("eval/kl")[peak])
        word = ("peaks then falls" if peak > 0 and found.holds else
                "no rise beyond noise" if not found.rose or peak == 0 else "no fall beyond noise")
        parts.append(f"seed {curve.seed} {word} (best at step {steps[peak]}, gold "
                     f"{gold[peak]:+.3f})")
    return "Seed by seed, same test: " + "; ".join(parts) + "."


def _adaptive_verdict(adaptive: list[Curve], free: list[Curve], kl_target: float) -> Verdict:
    steps, kl = mean_series(adaptive, "eval/kl")
    near = abs(kl[-1] - kl_target) <= 0.5 * kl_target
    gap, gap_se = paired_difference(pooled_golds(free, common_steps(free)[-1]),
                                    pooled_golds(adaptive, steps[-1]))
    return _judged(
        "adaptive beta: KL stays near its target and final gold beats the unpenalised run",
        f"final KL {kl[-1]:.2f} (target {kl_target:.2f}); final gold {gap:+.3f} ± {gap_se:.3f} "
        "above the run without KL (paired over the same prompts and seeds)",
        near, [(gap, gap_se)], (len(adaptive), "seed"))


def _offline_verdict(name: str, curves: list[Curve], sft: list[Curve],
                     ppo: list[Curve]) -> Verdict:
    """DPO or IPO against its start (the SFT model) and against the PPO frontier at its KL."""
    gain, gain_se = paired_difference(pooled_golds(sft, 0), pooled_golds(curves, 0))
    kl = sum(c.final("eval/kl") for c in curves) / len(curves)
    gold = sum(c.final("eval/gold_score") for c in curves) / len(curves)
    within = [(g, run, s) for run, group in by_run(ppo).items()
              for s, k, g in zip(*mean_series(group, "eval/kl"), mean_series(
                  group, "eval/gold_score")[1]) if k <= kl]
    if within:
        best, run, step = max(within)
        side = "above" if gold > best else "below"
        note = (f"At KL <= {kl:.2f} the best PPO evaluation reached gold {best:+.3f} ({run}, "
                f"step {step}); {name.upper()} at {gold:+.3f} sits {side} the PPO frontier there: "
                + ("it buys more gold per nat of KL" if side == "above" else
                   "PPO buys more gold for the same KL"))
    else:
        note = f"No PPO evaluation stayed within {name.upper()}'s KL of {kl:.2f}."
    if gain <= 2 * gain_se:
        note += f" ({name.upper()}'s own gain over SFT is within noise: a tentative placement.)"
    # DPO and IPO train once, on the demo's seed, whatever --seeds says: their error is over
    # the held-out prompts, so that is what more of would tighten it.
    return _judged(f"{name.upper()}: gold rises above the SFT model's beyond noise",
                   f"gold {gold:+.3f} at KL {kl:.2f}, {gain:+.3f} ± {gain_se:.3f} over the SFT "
                   "model (paired over the same prompts)", True, [(gain, gain_se)],
                   (len(pooled_golds(sft, 0)), "held-out prompt"), note)


def verdicts(curves: list[Curve], kl_target: float) -> list[Verdict]:
    """Check the thesis from the measurements alone, over all seeds of each run.

    1. Without the KL penalty the proxy keeps rising (its final mean is within 10% of the run's
       range of its maximum) while gold ends below its start by more than twice the error of
       the drop, and diversity collapses (final distinct-2 below half its start).
    1b. Separately: the gold reward first rose to a peak and then fell, each by more than twice
       its standard error (tether.tools.frontier.peak_then_fall).
    2. With the adaptive controller the KL ends within 50% of its target, and the final gold
       beats the unpenalised run's by more than twice the standard error of the gap.
    3. DPO and IPO each raise gold above the SFT model by more than twice its error; a note
       places each against the PPO frontier at its KL.
    """
    runs = by_run(curves)
    free, adaptive = runs.get("ppo-no-kl", []), runs.get("ppo-adaptive", [])
    out = []
    if free and len(free[0].steps) > 1:
        out += _no_kl_verdicts(free)
    if adaptive and free:
        out.append(_adaptive_verdict(adaptive, free, kl_target))
    ppo = [c for c in curves if c.run in PPO_RUNS]
    out += [_offline_verdict(name, runs[name], runs["sft"], ppo) for name in ("dpo", "ipo")
            if runs.get(name) and runs.get("sft")]
    return out


SUMMARY_COLUMNS = ("run", "seed", "final proxy", "start gold", "final gold", "peak gold",
                   "final KL", "distinct-2", "final beta")


def summary_rows(curves: list[Curve]) -> list[list[str]]:
    rows = []
    for c in curves:
        gold = c.series("eval/gold_score")
        beta = c.series("objective/beta")
        rows.append([c.run, str(c.seed), f"{c.final('eval/score'):+.3f}", f"{gold[0]:+.3f}",
                     f"{gold[-1]:+.3f}", f"{max(gold):+.3f}", f"{c.final('eval/kl'):.2f}",
                     f"{c.final('eval/distinct_2'):.2f}", f"{beta[-1]:.3f}" if beta else "-"])
    return rows


def console_table(curves: list[Curve], found: list[Verdict]) -> str:
    rows = [list(SUMMARY_COLUMNS)] + summary_rows(curves)
    widths = [max(len(r[i]) for r in rows) for i in range(len(SUMMARY_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [f"[{v.status}] {v.claim} ({v.evidence})" + (f" {v.note}" if v.note else "")
              for v in found]
    return "\n".join(lines)


OFFLINE_LABELS = {"sft": "the SFT model (every run's start)", "dpo": "the DPO policy, trained",
                  "ipo": "the IPO policy, trained"}


def step0_note(curves: list[Curve]) -> str:
    """Which PPO runs' step 0 the SFT row equals, checked prompt by prompt, and why the others
    differ: every run starts from the SFT model, but each samples its evaluation with its own
    seed (tether.rl.evaluation: run seed + offset), and the SFT model is scored with seed 0's."""
    runs = by_run(curves)
    if not runs.get("sft"):
        return ""
    sft = runs["sft"][0]
    sft_golds = pooled_golds([sft], 0)
    ppo = [c for c in curves if c.run in PPO_RUNS and c.steps and c.steps[0] == 0]
    same = [c for c in ppo if pooled_golds([c], 0) == sft_golds]
    other = sorted({c.seed for c in ppo if c not in same})
    named = ", ".join(f"{c.run} seed {c.seed}" for c in same) or "no PPO run"
    text = (f"The SFT row (sampled with seed {sft.seed}) equals the step 0 of {named}, prompt by "
            "prompt.")
    if other:
        starts = ", ".join(f"{c.series('eval/gold_score')[0]:+.3f}" for c in ppo
                           if c.seed in other and c.run == ppo[0].run)
        text += (f" Seed(s) {', '.join(map(str, other))} start from the same SFT model but sample "
                 f"their evaluations with their own seed, so their step 0 reads differently "
                 f"(gold {starts} against {sft.series('eval/gold_score')[0]:+.3f}): that spread is "
                 "sampling noise, not a different start.")
    return text


def _sample_points(curve: Curve) -> list[tuple[str, int]]:
    if not curve.steps:
        return []
    if curve.run not in PPO_RUNS:  # evaluated once: say which model wrote these
        return [(OFFLINE_LABELS.get(curve.run, curve.run), curve.steps[0])]
    gold = curve.series("eval/gold_score")
    best = curve.steps[gold.index(max(gold))]
    points = [("start (step 0, the SFT model)", curve.steps[0]), ("best gold", best),
              ("end", curve.steps[-1])]
    unique = {}  # step -> the first label that names it
    for label, step in points:
        if step in curve.samples:
            unique.setdefault(step, f"{label} (step {step})" if "step" not in label else label)
    return [(label, step) for step, label in unique.items()]


def _samples_html(curves: list[Curve], per_point: int = 4) -> str:
    parts = []
    for curve in curves:
        if curve.seed != min(c.seed for c in curves if c.run == curve.run):
            continue  # one seed's examples per run keeps the page readable
        parts.append(f"<h3>{html.escape(curve.run)} (seed {curve.seed})</h3><table>"
                     + rows_html([("model", "prompt", "response", "proxy", "gold")], "th"))
        for label, step in _sample_points(curve):
            parts += [rows_html([(label, s["prompt"], s["response"], f"{s['score']:+.2f}",
                                  f"{s['gold_score']:+.2f}")])
                      for s in curve.samples[step][:per_point]]
        parts.append("</table>")
    return "\n".join(parts)


def _verdicts_html(found: list[Verdict]) -> str:
    def kind(v: Verdict) -> str:
        return "holds" if v.holds else "unshown" if v.needs else "fails"

    return "".join(
        f"<li class='{kind(v)}'><b>{html.escape(v.status[0].upper() + v.status[1:].lower())}"
        f"</b>: {html.escape(v.claim)}. <span>{html.escape(v.evidence)}.</span>"
        + (f" <i>{html.escape(v.note)}</i>" if v.note else "") + "</li>" for v in found)


def write_report(curves: list[Curve], out_dir: str | Path, kl_target: float,
                 settings: dict[str, str], run_dirs: list[Path] | None = None,
                 sweep_html: str = "") -> tuple[Path, str]:
    """Write `report.html` and its PNGs into `out_dir`; returns (path, console summary).

    `run_dirs`: the runs whose configs the settings section diffs and links (tether.tools.report);
    `sweep_html`: the demo's beta sweep section, already rendered.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = plot_all(curves, out, kl_target)
    found = verdicts(curves, kl_target)
    images = "".join(figure_html(name, title, "", colours)
                     for title, (name, colours) in figures.items())
    settings_items = "".join(f"<li>{html.escape(k)}: {html.escape(v)}</li>"
                             for k, v in settings.items())
    configs = config_html([read_run(d) for d in run_dirs], out) if run_dirs else ""
    body = _BODY.format(
        table=rows_html([SUMMARY_COLUMNS], "th") + rows_html(summary_rows(curves)),
        verdicts=_verdicts_html(found) or "<li>No PPO runs to judge.</li>", images=images,
        samples=_samples_html(curves), settings=settings_items, configs=configs,
        sweep=sweep_html, step0=html.escape(step0_note(curves)))
    path = write_page(out / "report.html", "tether demo: the KL leash at work", body,
                      "The KL leash at work")
    return path, console_table(curves, found)


_BODY = """\
<p>A small language model learned to write short movie reviews (SFT). A reward model learned
what reviewers like from a limited set of noisy preference pairs (the <i>proxy</i>). PPO then
optimised the proxy three ways: with no KL penalty, with a fixed beta, and with the adaptive
controller that keeps KL(pi || pi_SFT) near a target. DPO and IPO learned from the same pairs
offline. The <i>gold</i> reward is what we actually want: the sentiment of the text (VADER) if it
is a well-formed review, and -1 if it is not. No run ever sees it.</p>
<h2 id="summary">Summary</h2>
<ul id="verdicts">{verdicts}</ul>
<p class="note">A verdict holds only when each change it names exceeds twice its standard error,
computed on the per-prompt scores of the same held-out prompts (paired), pooled over seeds.
"Not shown" means every change points the claimed way but one is within twice its error: more
seeds would be needed (about as many as said, if the changes held). "Does not hold" means the
numbers contradict the claim.</p>
<table id="summary-table">{table}</table>
<p>Proxy and gold are means over held-out prompts; KL is the mean over those prompts of the summed
per-token log-ratio log pi(y) - log pi_SFT(y) of the sampled response; distinct-2 is the share of
unique word pairs among all generated word pairs. The SFT model, DPO and IPO are evaluated once,
exactly as PPO evaluates itself (same prompts, same seeded sampling). {step0}</p>
<h2>Plots</h2>
<p class="note">Thick lines are the mean over seeds with a band of one standard error; thin
lines are the seeds (one line style each). SFT, DPO and IPO are single points (circle, square,
diamond).</p>
<p class="note"><b>Why the proxy keeps rising while gold falls:</b> the reward model only saw
well-formed reviews, so it has no reason to dislike repetitive or broken text that contains the
words it likes. Without a leash PPO finds those texts: the proxy climbs, the gold reward (which
scores ill-formed text -1) falls, and the responses lose their variety (Gao et al. 2022).</p>
<p class="note"><b>Why adaptive beta first falls:</b> every run starts at the SFT model, where
the KL is 0, below the target. The controller (Ziegler et al. 2019) lowers beta in proportion to
the relative error, clipped at -20%, each batch, until the KL approaches the target; then it
rises again to hold the policy there.</p>
{images}
{sweep}
<h2>Example generations</h2>
<p>For each PPO run: at the start (the SFT model), at its best gold and at the end. For SFT, DPO
and IPO: the model named, after its training.</p>
{samples}
<h2 id="settings-heading">Settings</h2><ul id="settings">{settings}</ul>
{configs}"""
