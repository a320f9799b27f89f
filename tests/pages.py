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

