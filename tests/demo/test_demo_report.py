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
    assert all(v.startswith(("Holds", "Does not hold")) for v in verdict_items), verdict_items
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
