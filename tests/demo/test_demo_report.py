"""The demo report: verdicts computed from the measurements (noise-aware, over seeds), and a page
that renders in a browser with its plots, verdicts and complete settings."""

from __future__ import annotations

import pytest
from pages import open_in_chromium

from tether.demo.report import Curve, verdicts, write_report

PROMPT_OFFSETS = [-0.1, 0.1, -0.05, 0.05]  # each prompt's gold sits this far from the mean


def samples_at(mean_gold: float, step: int, jitter=(0.0, 0.0, 0.0, 0.0)) -> list[dict]:
    return [{"prompt": f"prompt {i}", "response": f" was <b>great</b> {step}.", "score": 1.0,
             "gold_score": mean_gold + off + jit}
            for i, (off, jit) in enumerate(zip(PROMPT_OFFSETS, jitter))]


def ppo_curve(run: str, seed: int, proxy, gold, kl, distinct, beta=None, jitters=None) -> Curve:
    steps = [4 * i for i in range(len(proxy))]
    values = {"eval/score": list(proxy), "eval/gold_score": list(gold), "eval/kl": list(kl),
              "eval/distinct_2": list(distinct)}
    if beta is not None:
        values["objective/beta"] = list(beta)
    jitters = jitters or [(0.0,) * 4] * len(steps)
    samples = {s: samples_at(g, s, j) for s, g, j in zip(steps, gold, jitters)}
    return Curve(run, seed, steps, values, samples)


def point(run: str, gold: float, kl: float) -> Curve:
    """SFT, DPO or IPO: one evaluation."""
    return Curve(run, 0, [0], {"eval/score": [0.2], "eval/gold_score": [gold], "eval/kl": [kl],
                              "eval/distinct_2": [0.8]}, {0: samples_at(gold, 0)})


# The thesis, acted out: proxy climbs throughout, gold rises to 0.5 then falls to -0.4, distinct-2
# falls from 0.8 to 0.2 without a KL penalty; the adaptive run holds KL at ~2 with gold 0.45.
# Each prompt keeps its offset, so every paired difference equals the mean's (error 0).
HACKED = ppo_curve("ppo-no-kl", 0, [0.0, 0.5, 1.0, 1.5, 2.0], [0.1, 0.3, 0.5, 0.1, -0.4],
                   [0, 3, 8, 15, 30], [0.8, 0.7, 0.5, 0.3, 0.2], [0.0] * 5)
LEASHED = ppo_curve("ppo-adaptive", 0, [0.0, 0.3, 0.5, 0.6, 0.6], [0.1, 0.3, 0.4, 0.45, 0.45],
                    [0, 1.0, 1.8, 2.1, 2.0], [0.8, 0.75, 0.7, 0.7, 0.7], [0.1, 0.12, 0.13, 0.13,
                                                                           0.13])
SFT = point("sft", 0.1, 0.0)
DPO = point("dpo", 0.35, 1.5)  # above PPO: within KL 1.5 the best PPO evaluation has gold 0.3
IPO = point("ipo", 0.12, 0.5)  # +0.02 over SFT with error 0: holds; above the step-0 PPO points


def test_verdicts_hold_when_the_numbers_show_the_thesis():
    found = verdicts([HACKED, LEASHED, SFT, DPO, IPO], kl_target=2.0)
    assert [v.holds for v in found] == [True] * 5
    # Gold 0.1 -> -0.4: a fall of 0.5 on every prompt.
    assert "gold +0.100 -> -0.400 (a fall of +0.500 ± 0.000)" in found[0].evidence
    # The start value is shown beside the peak, with the rise and its error.
    assert "start +0.100, peak +0.500 at KL 8.00 (rise +0.400 ± 0.000)" in found[1].evidence
    assert "best at step 8" in found[1].evidence
    found = found[1:]
    # Adaptive vs free at the end: 0.45 - (-0.4) = 0.85 on every prompt.
    assert "final gold +0.850 ± 0.000 above the run without KL" in found[1].evidence
    # DPO at KL 1.5: the PPO evaluations within that KL are (0, 0.1), (1.0, 0.3) and (0, 0.1):
    # the best is 0.3 (ppo-adaptive, step 4), and DPO's 0.35 is above it.
    assert found[2].claim.startswith("DPO") and "+0.250 ± 0.000 over the SFT" in found[2].evidence
    assert "best PPO evaluation reached gold +0.300 (ppo-adaptive, step 4)" in found[2].note
    assert "sits above the PPO frontier" in found[2].note
    # IPO at KL 0.5: only the step-0 evaluations (gold 0.1) are within it; 0.12 is above them.
    assert "gold +0.100" in found[3].note and "above" in found[3].note


def test_verdicts_say_plainly_when_a_run_does_not_show_it():
    # Gold that never falls is no evidence of reward hacking; a KL far from its target is no
    # evidence of control. Each must be reported as not holding.
    honest = ppo_curve("ppo-no-kl", 1, [0.0, 0.5, 1.0], [0.1, 0.3, 0.5], [0, 1, 2],
                       [0.8, 0.8, 0.8])
    drifting = ppo_curve("ppo-adaptive", 1, [0.0, 0.5, 1.0], [0.1, 0.3, 0.6], [0, 5, 9],
                         [0.8, 0.8, 0.8])
    found = verdicts([honest, drifting], kl_target=2.0)
    assert [v.holds for v in found] == [False, False, False]
    # Gold that only falls from the first evaluation is hacking, but it never peaked.
    falling = ppo_curve("ppo-no-kl", 2, [0.0, 1.0, 2.0], [0.3, 0.0, -0.5], [0, 5, 9],
                        [0.8, 0.4, 0.2])
    assert [v.holds for v in verdicts([falling], kl_target=2.0)] == [True, False]


def test_a_rise_within_the_noise_is_not_called_a_peak():
    # The case: gold +0.002 above its start while the per-prompt differences spread by
    # ~0.08 (standard error ~0.04). Proxy rises, gold then falls a lot, diversity collapses:
    # everything else holds, so only the noise rule can make the verdict fail.
    noisy = ppo_curve("ppo-no-kl", 0, [0.0, 1.0, 2.0], [0.100, 0.102, -0.5], [0, 3, 9],
                      [0.8, 0.5, 0.2], jitters=[(0.0,) * 4, (0.08, -0.08, 0.08, -0.08),
                                                (0.0,) * 4])
    hacked, peaked = verdicts([noisy], kl_target=2.0)
    assert hacked.holds and not peaked.holds and "rise +0.002 ± 0.046" in peaked.evidence
    # Both changes point the claimed way; only the rise's error bar is too wide. It is not shown,
    # not contradicted: per-prompt rises 0.002 ± 0.08 have a standard error of
    # sqrt(4 * 0.08^2 / 3) / 2 = 0.046188, so about 1 * (2 * 0.046188 / 0.002)^2 = 2133.3 seeds.
    assert peaked.status == "not shown with 1 seed (needs about 2134 seeds)"
    assert hacked.status == "holds"


def test_a_verdict_the_numbers_contradict_says_so_and_one_that_needs_more_data_says_how_much(
        tmp_path):
    # Gold that rises to the end contradicts "gold ends below its start": no number of seeds
    # would show it, so it is called so, in capitals.
    honest = ppo_curve("ppo-no-kl", 1, [0.0, 0.5, 1.0], [0.1, 0.3, 0.5], [0, 1, 2],
                       [0.8, 0.3, 0.3])
    hacked, peaked = verdicts([honest], kl_target=2.0)
    assert hacked.status == peaked.status == "DOES NOT HOLD"  # no fall, and the peak is last
    # DPO above SFT by 0.02 on average, the prompts spread by 0.1 around it: gains of
    # 0.12, -0.08, 0.12, -0.08, standard error sqrt(4 * 0.1^2 / 3) / 2 = 0.057735; DPO trains
    # once, so the count is of held-out prompts: 4 * (2 * 0.057735 / 0.02)^2 = 133.3.
    dpo = Curve("dpo", 0, [0], {"eval/score": [0.2], "eval/gold_score": [0.12], "eval/kl": [1.0],
                                "eval/distinct_2": [0.8]},
                {0: samples_at(0.12, 0, (0.1, -0.1, 0.1, -0.1))})
    (found,) = verdicts([SFT, dpo], kl_target=2.0)
    assert not found.holds and "+0.020 ± 0.058 over the SFT model" in found.evidence
    assert found.status == "not shown with 4 held-out prompts (needs about 134 held-out prompts)"
    summary = write_report([SFT, dpo], tmp_path, 2.0, SETTINGS)[1]
    assert "[not shown with 4 held-out prompts (needs about 134 held-out prompts)] DPO" in summary
    assert "DOES NOT HOLD" not in summary


def test_offline_samples_say_which_model_wrote_them(tmp_path):
    path, _ = write_report([HACKED, SFT, DPO], tmp_path, 2.0, SETTINGS)
    page = path.read_text(encoding="utf-8")
    assert "the DPO policy, trained" in page and "the SFT model (every run&#x27;s start)" in page
    assert page.count("start (step 0, the SFT model)") == 4  # the PPO run's 4 samples only


def test_report_files_and_console_summary(tmp_path):
    path, summary = write_report([HACKED, LEASHED, SFT], tmp_path, 2.0, SETTINGS)
    page = path.read_text(encoding="utf-8")
    for name in ("reward_vs_step.png", "reward_vs_kl.png", "beta_kl_diversity.png",
                 "frontier.png"):
        assert (tmp_path / name).stat().st_size > 1000 and f"src='{name}'" in page
    assert "&lt;b&gt;great&lt;/b&gt;" in page  # generated text is escaped, never markup
    assert "ppo-no-kl" in summary and "[holds]" in summary
    assert summary.count("\n") >= 5


# What the settings must list (issue 10): every value that shaped the results.
REQUIRED_SETTINGS = ("SFT", "reward model", "PPO", "PPO betas", "DPO", "IPO",
                     "evaluation prompts", "seeds", "tether version")
REQUIRED_WORDS = ("lr", "batch", "epochs", "horizon", "held-out accuracy")
SETTINGS = {"SFT": "lr 0.003, 400 steps, batch 32", "reward model": "lr 0.001, 3 epochs, batch "
            "32, held-out accuracy 0.8", "PPO": "lr 1e-4, batch 32, 4 epochs", "PPO betas":
            "fixed 0.1, adaptive horizon 256", "DPO": "lr 5e-4", "IPO": "lr 5e-4",
            "evaluation prompts": "128", "seeds": "0", "tether version": "0.1.0"}


def check_rendered(report_path, n_verdicts: int):
    """Every image decoded with a real width; the summary, `n_verdicts` verdicts and complete
    settings visible as text."""
    driver = open_in_chromium(report_path)
    try:
        images = driver.execute_script(
            "return Array.from(document.images).map(i => [i.src, i.complete, i.naturalWidth])")
        summary = driver.find_element("id", "summary-table").text
        verdict_items = [li.text for li in driver.find_elements("css selector", "#verdicts li")]
        settings = driver.find_element("id", "settings").text
    finally:
        driver.quit()
    assert len(images) >= 4
    assert all(complete and width > 100 for _, complete, width in images), images
    assert "final gold" in summary and "ppo-no-kl" in summary
    assert len(verdict_items) == n_verdicts, verdict_items
    assert all(v.startswith(("Holds", "Does not hold", "Not shown with ")) for v in verdict_items), \
        verdict_items
    lines = settings.splitlines()
    for key in REQUIRED_SETTINGS:
        assert any(line.startswith(f"{key}:") for line in lines), (key, settings)
    for word in REQUIRED_WORDS:
        assert word in settings, (word, settings)


def test_report_renders_in_headless_chromium(tmp_path):
    path, _ = write_report([HACKED, LEASHED, SFT, DPO, IPO], tmp_path, 2.0, SETTINGS)
    check_rendered(path, n_verdicts=5)


def test_browser_check_catches_a_missing_image(tmp_path):
    # The check itself must be able to fail: delete one PNG and it must notice.
    path, _ = write_report([HACKED, LEASHED], tmp_path, 2.0, SETTINGS)
    check_rendered(path, n_verdicts=3)  # two on the no-KL run, one on the adaptive run
    (tmp_path / "frontier.png").unlink()
    with pytest.raises(AssertionError, match="frontier.png"):
        check_rendered(path, n_verdicts=3)


def test_browser_check_catches_incomplete_settings(tmp_path):
    incomplete = {k: v for k, v in SETTINGS.items() if k != "tether version"}
    path, _ = write_report([HACKED, LEASHED], tmp_path, 2.0, incomplete)
    with pytest.raises(AssertionError, match="tether version"):
        check_rendered(path, n_verdicts=3)


def _jitters(scale: float, n: int) -> list[tuple]:
    """Per-prompt noise growing with the step, so no paired error is exactly zero."""
    return [(scale * k, -scale * k, 2 * scale * k, -0.5 * scale * k) for k in range(n)]


def test_step_zero_note_names_the_runs_it_holds_for_and_seeds_are_judged_one_by_one():
    # Seed 0 starts at the SFT model's 0.1 prompt by prompt; seed 1 samples its own stream and
    # reads 0.12 at step 0. Seed 0 rises 0.1 -> 0.5 then falls; seed 1 only falls.
    seed0 = ppo_curve("ppo-no-kl", 0, [0.0, 1.0, 2.0], [0.1, 0.5, -0.4], [0, 3, 9],
                      [0.8, 0.5, 0.2])
    seed1 = ppo_curve("ppo-no-kl", 1, [0.0, 1.0, 2.0], [0.12, 0.0, -0.5], [0, 3, 9],
                      [0.8, 0.5, 0.2])
    from tether.demo.report import step0_note

    note = step0_note([seed0, seed1, SFT])
    assert "equals the step 0 of ppo-no-kl seed 0, prompt by prompt" in note
    assert "Seed(s) 1 start from the same SFT model" in note and "gold +0.120 against +0.100" in note
    peaked = verdicts([seed0, seed1], kl_target=2.0)[1]
    assert "2 seeds pooled" in peaked.evidence
    assert ("seed 0 peaks then falls (best at step 4, gold +0.500); seed 1 no rise beyond noise "
            "(best at step 0, gold +0.120)") in peaked.note


def _fake_sweep(root):
    """Three betas, one seed, evaluations at steps 0-40; per prompt the end gold (mean of steps
    20, 30, 40) is beta 0: -0.5 + (0.05, -0.05, 0.05, -0.05); beta 0.3: 0.3 + (0.1, -0.1, 0.1, -0.1) (its last evaluation a
    dip to 0.1); beta 1: 0.25 + (-0.1, 0.1, -0.1, 0.1). By hand (tests/tools/test_recommendation):
    beta 0.3 measures best, beta 1 is within noise of it (0.050 ± 0.115), beta 0 is not."""
    import json

    import yaml

    from tether.tools.sweep_plan import PlannedRun, Sweep

    # Each prompt's noise, scaled at step i by FACTOR[i]: the last three average to 1, and no
    # two evaluations share it, so no paired error in the sweep's verdicts is exactly zero.
    factor = [0.0, 1.0, 0.5, 1.0, 1.5]
    noise = {0.0: (0.05, -0.05, 0.05, -0.05), 0.3: (0.1, -0.1, 0.1, -0.1), 1.0: (-0.1, 0.1, -0.1, 0.1)}
    means = {0.0: [0.0, 0.2, -0.5, -0.5, -0.5], 0.3: [0.0, 0.2, 0.4, 0.4, 0.1],
             1.0: [0.0, 0.1, 0.2, 0.25, 0.3]}
    runs = []
    for beta, gold in means.items():
        name = f"ppo-beta{beta:g}-seed0"
        path = root / name
        (path / "final").mkdir(parents=True)
        (path / "config.yaml").write_text(yaml.safe_dump({"beta": beta}))
        rows = [{"step": 10 * i, "eval/kl": 0.5 * i / (1 + beta), "eval/kl_exact": 0.5 * i,
                 "eval/score": 0.3 * i, "eval/gold_score": g} for i, g in enumerate(gold)]
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (path / "samples.jsonl").write_text("".join(json.dumps({"step": 10 * i, "samples": [
            {"gold_score": g + n * factor[i]} for n in noise[beta]]}) + "\n"
            for i, g in enumerate(gold)))
        runs.append(PlannedRun(name, "ppo", 0, {"beta": beta},
                               {"beta": beta, "output_dir": str(root)}))
    return Sweep(root, runs, {"ppo": ["beta"]})


def test_page_recommends_a_beta_among_the_best_measured_and_never_prints_a_zero_error(tmp_path):
    from tether.tools import sweep_report

    sweep = _fake_sweep(tmp_path / "sweep")
    sweep_html, _ = sweep_report.section(sweep, {}, page_dir=tmp_path, configs=False)
    free = ppo_curve("ppo-no-kl", 0, [0.0, 0.5, 1.0, 1.5, 2.0], [0.1, 0.3, 0.5, 0.1, -0.4],
                     [0, 3, 8, 15, 30], [0.8, 0.7, 0.5, 0.3, 0.2], [0.0] * 5, _jitters(0.01, 5))
    leashed = ppo_curve("ppo-adaptive", 0, [0.0, 0.3, 0.5, 0.6, 0.6], [0.1, 0.3, 0.4, 0.45, 0.45],
                        [0, 1.0, 1.8, 2.1, 2.0], [0.8, 0.75, 0.7, 0.7, 0.7], [0.1] * 5,
                        _jitters(-0.02, 5))
    path, _ = write_report([free, leashed, SFT], tmp_path, 2.0, SETTINGS, sweep_html=sweep_html)
    driver = open_in_chromium(path)
    try:
        text = driver.find_element("tag name", "body").text
        recommended = driver.find_element("id", "recommended").text
        rule = driver.find_element("id", "rule").text
        rows = [[td.text for td in tr.find_elements("tag name", "td")]
                for tr in driver.find_elements("css selector", "#sweep-table tr")[1:]]
    finally:
        driver.quit()
    assert "± 0.000" not in text and "+- 0.000" not in text
    # The hand-worked answer: beta 0.3 measured best, beta 1 within noise, so beta 1; "no clear
    # winner" first, the rule's pick after the evidence, never "Recommended beta: 1" above it.
    assert recommended.startswith("No clear winner: PPO beta 0.3 measured best (end gold +0.300)")
    assert recommended.endswith("The rule's pick: beta 1 (PPO beta 1).")
    assert "Recommended beta" not in recommended
    assert "steps 20, 30, 40" in rule and "largest beta is recommended" in rule
    # The table shows the rule's measure and verdict, and agrees with the recommendation.
    versus = {row[0]: row[6] for row in rows}
    end_gold = {row[0]: row[5] for row in rows}
    assert end_gold == {"PPO beta 0": "-0.500", "PPO beta 0.3": "+0.300", "PPO beta 1": "+0.250"}
    assert versus["PPO beta 0.3"] == "measured best"
    assert versus["PPO beta 1"] == "-0.050 ± 0.115: within noise; recommended"
    assert versus["PPO beta 0"].endswith("below, beyond noise")
    recommended_row = next(row for row in rows if "recommended" in row[6])
    assert recommended_row[6].startswith(("measured best", "-0.050 ± 0.115: within noise"))
    # One seed: the final gold has no error bar, said in words.
    assert all(row[4].endswith("(one seed, no error bar)") for row in rows)
    # Beta 1's best evaluation is its last (gold 0.3 at step 40): rising, with no fall to judge
    # (not "a fall of +0.000 ± 0.000"); each fit says how many points it has (5: steps 0-40).
    assert versus and rows[2][10].startswith("gold still rising at its last evaluation")
    assert rows[2][10].endswith("the peak is the last evaluation: no fall to judge")
    assert all(" from 5 points; " in row[9] for row in rows)


def test_demo_page_one_colour_per_run_captions_and_width(tmp_path):
    # The demo page with the sweep's figures embedded, as the demo writes it: each run or
    # setting one colour across all seven figures, no colour for two of them (red was "no KL"
    # above and beta 0.3 in the sweep), captions in their figures, no sideways scroll.
    from pages import check_figures_and_layout, fake_sweep

    from tether.tools.report import figure_html
    from tether.tools.sweep_report import figures

    sweep_html = "".join(figure_html(src, title, caption, colours)
                         for title, src, caption, colours in figures(*fake_sweep()))
    path, _ = write_report([HACKED, LEASHED, SFT, DPO, IPO], tmp_path, 2.0, SETTINGS,
                           sweep_html=sweep_html)
    colours = check_figures_and_layout(path, min_figures=7)
    assert colours["ppo-no-kl"] == "#d62728" and colours["sft"] == "#000000"
    assert {"PPO beta 0.1", "PPO beta 1", "DPO beta 0.1", "dpo", "ipo"} <= set(colours)


def test_plotted_colours_are_the_legend_colours(tmp_path):
    # The map each <figure> carries is what the PNG shows: every run's colour covers pixels of
    # the frontier plot (thick mean lines and filled markers are drawn in the exact colour).
    import json
    import re

    from PIL import Image

    path, _ = write_report([HACKED, LEASHED, SFT, DPO, IPO], tmp_path, 2.0, SETTINGS)
    page = path.read_text(encoding="utf-8")
    found = re.search(r"<figure data-colours=\"([^\"]*)\"><img src='frontier.png'", page)
    colours = json.loads(found.group(1).replace("&quot;", '"'))
    assert set(colours) == {"ppo-no-kl", "ppo-adaptive", "sft", "dpo", "ipo"}
    image = Image.open(tmp_path / "frontier.png").convert("RGB")
    counts = {rgb: n for n, rgb in image.getcolors(maxcolors=image.width * image.height)}
    # (sft's black is also the text's: a weak check for it alone; the other four are not.)
    for run, colour in colours.items():
        rgb = tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
        assert counts.get(rgb, 0) >= 20, (run, colour, counts.get(rgb, 0))
