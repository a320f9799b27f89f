"""`tether report`: run directories of any stage on one page, configs diffed, checked in a browser."""

from __future__ import annotations

import pytest
from pages import check_report_page, fake_run

from tether.cli import main
from tether.tools.report import config_diff, metric_names, read_run, write_report


@pytest.fixture
def runs(tmp_path):
    sft = fake_run(tmp_path, "sft", {"model": "base", "lr": 1e-3, "seed": 0},
                   [{"step": s, "train/loss": 3.0 / s, "train/lr": 1e-3, "perf/tokens_per_s": 9.0}
                    for s in (1, 2, 3)])
    ppo = fake_run(tmp_path, "ppo", {"policy": "sft/final", "lr": 1e-5, "seed": 0, "beta": 0.1},
                   [{"step": s, "objective/kl": 0.5 * s, "eval/score": 0.1 * s, "train/lr": 1e-5}
                    for s in (0, 1, 2)])
    return [sft, ppo]


def test_config_diff_by_hand():
    shared, differing = config_diff([{"a": 1, "b": 2, "c": [1]}, {"a": 1, "b": 3, "c": [1]},
                                     {"a": 1, "b": 2, "c": [1], "d": 0}])
    assert shared == {"a": 1, "c": [1]}
    assert differing == {"b": [2, 3, 2], "d": [None, None, 0]}


def test_read_run_skips_cut_lines_and_machine_metrics(runs):
    sft = read_run(runs[0])
    assert sft.series("train/loss") == ([1.0, 2.0, 3.0], [3.0, 1.5, 1.0])
    assert metric_names([sft, read_run(runs[1])]) == [
        "eval/score", "objective/kl", "train/loss", "train/lr"]


def test_report_cli_writes_a_page_that_renders(runs, tmp_path, capsys):
    out = tmp_path / "out" / "report.html"
    assert main(["report", str(runs[0]), str(runs[1]), "--output", str(out)]) == 0
    assert "report written to" in capsys.readouterr().out
    text = out.read_text()
    # The links to each config resolve from where the page is.
    assert "href='../sft/config.yaml'" in text and "href='../ppo/config.yaml'" in text
    # eval, objective and train namespaces: three figures; lr and the start model differ.
    check_report_page(out, 3, {"config-diff": ["lr", "0.001", "1e-05", "beta", "policy"]})


def test_browser_check_catches_a_broken_image(runs, tmp_path):
    out = write_report(runs, tmp_path / "r.html")
    text = out.read_text()
    start = text.index("base64,") + len("base64,")
    out.write_text(text[:start] + "AAAA" + text[start + 40:])  # a damaged PNG
    with pytest.raises(AssertionError):
        check_report_page(out, 3, {})


def test_report_refuses_what_is_not_a_run(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "--output", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a tether run directory" in err and "\n" not in err
    assert not (tmp_path / "r.html").exists()
