"""Report pages in the tests: fake run directories, and opening a page in headless Chromium
(skipped where it is not installed, except in CI, which sets TETHER_REQUIRE_BROWSER)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import yaml


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


def fake_run(root, name, config, rows):
    path = root / name
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows)
                                        + '{"step": 9, "train/lo')  # a line cut off by a kill
    return path


def check_report_page(path, min_images: int, expected: dict[str, list[str]]):
    """Open the page in headless Chromium: every image decodes with a real width, and each
    element id shows the expected texts."""
    driver = open_in_chromium(path)
    try:
        images = driver.execute_script(
            "return Array.from(document.images).map(i => [i.alt, i.complete, i.naturalWidth])")
        texts = {key: driver.find_element("id", key).text for key in expected}
    finally:
        driver.quit()
    assert len(images) >= min_images, images
    assert all(complete and width > 100 for _, complete, width in images), images
    for key, wanted in expected.items():
        for text in wanted:
            assert text in texts[key], (key, text, texts[key][:300])



# Where every figure, its image and its caption sit, and each figure's legend colours.
_FIGURES_JS = """
return Array.from(document.querySelectorAll('figure')).map(f => {
  const img = f.querySelector('img'), cap = f.querySelector('figcaption');
  const box = r => r && [r.top, r.bottom, r.left, r.right];
  return {colours: f.dataset.colours || null, figure: box(f.getBoundingClientRect()),
          image: box(img && img.getBoundingClientRect()),
          caption: box(cap && cap.getBoundingClientRect()),
          border: parseFloat(getComputedStyle(f).borderTopWidth)};
});"""
_CAPTIONS_OUTSIDE_JS = """return Array.from(document.querySelectorAll('figcaption'))
  .filter(c => c.parentElement.tagName !== 'FIGURE').length;"""
_WIDTH_JS = "return [document.documentElement.scrollWidth, document.documentElement.clientWidth];"


def page_figures(path, widths=(1400, 600)):
    """Open the page at 1400 px: (its figures as _FIGURES_JS sees them, the number of captions
    outside a <figure>, {width: (scrollWidth, clientWidth)} at each width)."""
    driver = open_in_chromium(path)
    try:
        driver.set_window_size(1400, 900)
        found = driver.execute_script(_FIGURES_JS)
        outside = driver.execute_script(_CAPTIONS_OUTSIDE_JS)
        widths_seen = {}
        for width in widths:
            driver.set_window_size(width, 900)
            widths_seen[width] = tuple(driver.execute_script(_WIDTH_JS))
    finally:
        driver.quit()
    return found, outside, widths_seen


def check_figures_and_layout(path, min_figures: int) -> dict[str, str]:
    """What issue 22 asks of every page, in the browser: each caption is a <figcaption> inside
    its <figure>'s box, tight under its image and well clear of the next figure, in a framed
    figure; the legends (each figure's data-colours) give a run one colour on the whole page and
    a colour to one run only; the page never scrolls sideways at 1400 px nor at 600 px.
    Returns the page's {run: colour}."""
    import json

    found, outside, widths = page_figures(path)
    assert len(found) >= min_figures, found
    assert outside == 0, f"{outside} caption(s) outside a <figure>"
    for i, f in enumerate(found):
        assert f["caption"] and f["image"], f
        top, bottom = f["figure"][0], f["figure"][1]
        assert top <= f["caption"][0] and f["caption"][1] <= bottom, ("caption outside", f)
        assert 0 <= f["caption"][0] - f["image"][1] <= 12, ("caption far from its image", f)
        assert f["border"] > 0, ("figure without a frame", f)
        if i + 1 < len(found):  # well clear of the next figure, which a reader might take it for
            assert found[i + 1]["figure"][0] - f["caption"][1] >= 30, (f, found[i + 1])
    page_colours: dict[str, str] = {}
    for f in found:
        for run, colour in json.loads(f["colours"] or "{}").items():
            assert page_colours.setdefault(run, colour) == colour, (run, colour, page_colours)
    runs_by_colour: dict[str, str] = {}
    for run, colour in page_colours.items():
        assert runs_by_colour.setdefault(colour, run) == run, (colour, run, runs_by_colour)
    for width, (scroll, client) in widths.items():
        assert scroll <= client, f"the page scrolls sideways at {width} px: {scroll} > {client}"
    return page_colours


def fake_sweep(gold_gains=((0.0, 0.0), (1.0, 0.3), (4.0, 0.2))):
    """Three sweep settings as tether.tools.sweep_report sees them: PPO beta 0.1 (one seed,
    evaluations at KL 0, 1, 4 with gold gains `gold_gains`), PPO beta 1 and DPO beta 0.1;
    returns (groups, points) for sweep_report.figures."""
    from tether.tools.frontier import gao_fit
    from tether.tools.sweep_plan import PlannedRun
    from tether.tools.sweep_results import Group, RunPoints

    def run(name, stage, beta, kls, golds):
        planned = PlannedRun(f"{name}-seed0", stage, 0, {"beta": beta}, {"beta": beta})
        values = {"kl": list(kls), "kl_exact": list(kls), "proxy": list(golds), "gold": list(golds)}
        points = RunPoints(planned, [6 * i for i in range(len(kls))], values)
        group = Group(name=name, stage=stage, beta=beta, label=f"{stage.upper()} beta {beta:g}",
                      seeds=[0], steps=points.steps, mean=values,
                      stderr={k: [0.0] * len(kls) for k in values}, final_gold=[golds[-1]])
        return group, points

    low, low_points = run("ppo-beta0.1", "ppo", 0.1, [k for k, _ in gold_gains],
                          [g for _, g in gold_gains])
    low.gains = list(gold_gains)
    low.fit = gao_fit([k for k, _ in gold_gains], [g for _, g in gold_gains])
    high, high_points = run("ppo-beta1", "ppo", 1.0, [0.0, 0.1, 0.2], [0.0, 0.05, 0.08])
    offline, offline_points = run("dpo-beta0.1", "dpo", 0.1, [0.5], [0.15])
    return [low, high, offline], [low_points, high_points, offline_points]
