"""The demo report: verdicts computed from the measurements, and a page that renders in a browser."""

from __future__ import annotations

import os
import shutil

import pytest

from tether.demo.report import Curve, verdicts, write_report


def ppo_curve(run: str, seed: int, proxy, gold, kl, distinct, beta=None) -> Curve:
    steps = [4 * i for i in range(len(proxy))]
    values = {"eval/score": list(proxy), "eval/gold_score": list(gold), "eval/kl": list(kl),
              "eval/distinct_2": list(distinct)}
    if beta is not None:
        values["objective/beta"] = list(beta)
    samples = {s: [{"prompt": "the movie", "response": f" was <b>great</b> {s}.", "score": 1.0,
                    "gold_score": -1.0}] for s in steps}
    return Curve(run, seed, steps, values, samples)


# The thesis, acted out: proxy climbs throughout, gold rises to 0.5 then falls to -0.4, distinct-2
# falls from 0.8 to 0.2 without a KL penalty; the adaptive run holds KL at ~2 with gold 0.45.
HACKED = ppo_curve("ppo-no-kl", 0, [0.0, 0.5, 1.0, 1.5, 2.0], [0.1, 0.3, 0.5, 0.1, -0.4],
                   [0, 3, 8, 15, 30], [0.8, 0.7, 0.5, 0.3, 0.2], [0.0] * 5)
LEASHED = ppo_curve("ppo-adaptive", 0, [0.0, 0.3, 0.5, 0.6, 0.6], [0.1, 0.3, 0.4, 0.45, 0.45],
                    [0, 1.0, 1.8, 2.1, 2.0], [0.8, 0.75, 0.7, 0.7, 0.7], [0.1, 0.12, 0.13, 0.13,
                                                                           0.13])


def test_verdicts_hold_when_the_numbers_show_the_thesis():
    found = verdicts([HACKED, LEASHED], kl_target=2.0)
    assert [v.holds for v in found] == [True, True]
    assert "gold peak +0.50 at step 8" in found[0].evidence


def test_verdicts_say_plainly_when_a_run_does_not_show_it():
    # Gold that never falls is no evidence of reward hacking; a KL far from its target is no
    # evidence of control. Each must be reported as not holding.
    honest = ppo_curve("ppo-no-kl", 1, [0.0, 0.5, 1.0], [0.1, 0.3, 0.5], [0, 1, 2],
                       [0.8, 0.8, 0.8])
    drifting = ppo_curve("ppo-adaptive", 1, [0.0, 0.5, 1.0], [0.1, 0.3, 0.6], [0, 5, 9],
                         [0.8, 0.8, 0.8])
    found = verdicts([honest, drifting], kl_target=2.0)
    assert [v.holds for v in found] == [False, False]
    # Gold that only falls from the first evaluation never peaked: no rise, no peak-then-fall.
    falling = ppo_curve("ppo-no-kl", 2, [0.0, 1.0, 2.0], [0.3, 0.0, -0.5], [0, 5, 9],
                        [0.8, 0.4, 0.2])
    assert not verdicts([falling], kl_target=2.0)[0].holds


def test_report_files_and_console_summary(tmp_path):
    sft = Curve("sft", 0, [0], {"eval/score": [0.0], "eval/gold_score": [0.1], "eval/kl": [0.0],
                                "eval/distinct_2": [0.8]}, {})
    path, summary = write_report([HACKED, LEASHED, sft], tmp_path, 2.0, {"seeds": "1"})
    page = path.read_text(encoding="utf-8")
    for name in ("reward_vs_step.png", "reward_vs_kl.png", "beta_kl_diversity.png",
                 "frontier.png"):
        assert (tmp_path / name).stat().st_size > 1000 and f"src='{name}'" in page
    assert "&lt;b&gt;great&lt;/b&gt;" in page  # generated text is escaped, never markup
    assert "ppo-no-kl" in summary and "[holds]" in summary
    assert summary.count("\n") >= 5


def find_browser() -> tuple[str, str] | None:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


def open_in_chromium(path):
    """Open a file in headless Chromium through chromedriver; returns the driver."""
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    browser = find_browser()
    if browser is None:
        if os.environ.get("TETHER_REQUIRE_BROWSER"):
            pytest.fail("chromium and chromedriver are required (CI installs them)")
        pytest.skip("chromium/chromedriver not installed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(browser[1]), options=options)
    driver.get(path.resolve().as_uri())
    return driver


def check_rendered(report_path):
    """Every image decoded with a real width, and the summary and verdicts visible as text."""
    driver = open_in_chromium(report_path)
    try:
        images = driver.execute_script(
            "return Array.from(document.images).map(i => [i.src, i.complete, i.naturalWidth])")
        summary = driver.find_element("id", "summary-table").text
        verdict_text = driver.find_element("id", "verdicts").text
    finally:
        driver.quit()
    assert len(images) >= 4
    assert all(complete and width > 100 for _, complete, width in images), images
    assert "final gold" in summary and "ppo-no-kl" in summary
    assert "hold" in verdict_text.lower()


def test_report_renders_in_headless_chromium(tmp_path):
    path, _ = write_report([HACKED, LEASHED], tmp_path, 2.0, {"seeds": "1"})
    check_rendered(path)


def test_browser_check_catches_a_missing_image(tmp_path):
    # The check itself must be able to fail: delete one PNG and it must notice.
    path, _ = write_report([HACKED, LEASHED], tmp_path, 2.0, {"seeds": "1"})
    (tmp_path / "frontier.png").unlink()
    with pytest.raises(AssertionError):
        check_rendered(path)
