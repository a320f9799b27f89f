"""`tether report`: run directories of any stage on one page, configs diffed, checked in a browser."""

from __future__ import annotations

import json

import pytest
from pages import check_figures_and_layout, check_report_page, fake_run, fake_sweep

from tether.cli import main
from tether.tools import sweep_report
from tether.tools.report import (
    GUIDE,
    Palette,
    config_diff,
    legend_colours,
    metric_names,
    plot_metrics,
    plt,
    read_run,
    read_samples,
    rows_html,
    write_report,
)


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


def test_rows_html_escapes_every_cell_and_read_samples_keys_them_by_step(runs):
    # A header row of th cells, then td rows; text that looks like markup is shown, not parsed.
    assert rows_html([("a", "<b>")], "th") + rows_html([["1 & 2", ""]]) == (
        "<tr><th>a</th><th>&lt;b&gt;</th></tr><tr><td>1 &amp; 2</td><td></td></tr>")
    assert read_samples(runs[0]) == {}  # no samples.jsonl: no evaluations logged
    (runs[1] / "samples.jsonl").write_text('{"step": 0, "samples": [{"gold_score": 0.5}]}\n'
                                           '{"step": 6, "samples": [{"gold_score": -1.0}]}\n')
    assert read_samples(runs[1]) == {0: [{"gold_score": 0.5}], 6: [{"gold_score": -1.0}]}


def test_report_refuses_what_is_not_a_run(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "--output", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a tether run directory" in err and "\n" not in err
    assert not (tmp_path / "r.html").exists()


def test_palette_gives_each_label_one_colour_and_keeps_the_demo_runs_apart():
    palette = Palette()
    # The demo's runs keep their colours (matplotlib's tab:red, tab:blue and black in hex).
    assert palette("ppo-no-kl") == "#d62728" and palette("ppo-fixed") == "#1f77b4"
    assert palette("sft") == "#000000"
    # Any other label takes the free colours in order: tab:brown, then tab:pink; asked again, the
    # same colour; none of them is a demo run's colour (red meant "no KL" and beta 0.3 before).
    assert palette("PPO beta 0.3") == "#8c564b" and palette("DPO beta 0.1") == "#e377c2"
    assert palette("PPO beta 0.3") == "#8c564b"
    many = [palette(f"setting {i}") for i in range(30)]
    assert len(set(many)) == 30 and not set(many) & set(Palette().named.values())


def test_legend_colours_reads_what_was_drawn():
    fig, (left, right) = plt.subplots(1, 2)
    left.plot([0, 1], [0, 1], color="tab:red", label="a")
    right.errorbar([0], [1], yerr=[0.1], fmt="s", color="#00ff00", label="b")
    right.scatter([0], [1], color="#0000ff", label="c")
    right.plot([0, 1], [1, 1], color="grey", label="seed 0", gid=GUIDE)  # a style, no run
    right.plot([0, 1], [0, 2], color="tab:red", label="a: fit R² 0.9", gid="a")  # keyed by gid
    assert legend_colours(fig) == {"a": "#d62728", "b": "#00ff00", "c": "#0000ff"}
    right.plot([0, 1], [2, 2], color="tab:blue", label="a")  # one run, two colours: a bug
    with pytest.raises(ValueError, match="a is drawn in #d62728 and #1f77b4"):
        legend_colours(fig)
    plt.close(fig)


def test_step_axes_get_whole_number_ticks(runs, monkeypatch):
    # Steps 1, 2, 3: matplotlib's default ticks would be 1.00, 1.25, ..., 3.00.
    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)  # the figures stay open to be inspected
    figures = plot_metrics([read_run(r) for r in runs], ["train/loss", "train/lr"])
    assert [title for title, _, _ in figures] == ["train/ metrics"]
    ax = drawn[0].axes[0]
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert len(ticks) >= 2 and all(t == int(t) for t in ticks), ticks
    # Each run in one colour in every panel, and different runs in different colours.
    assert figures[0][2] == {"sft": "#000000", "ppo": "#8c564b"}


def test_report_page_figures_captions_and_wide_config_table(tmp_path):
    # Six runs: a seven-column config table, with long values that ran off the page at 1400 px.
    runs = [fake_run(tmp_path, f"run-{i}", {"policy": f"/a/very/long/path/to/a/checkpoint/{i}/"
                                            f"{'x' * 60}/final", "lr": 10.0 ** -i, "seed": i},
                     [{"step": s, "train/loss": 1.0 / (s + i), "eval/score": s * i}
                      for s in (1, 2, 3)]) for i in range(6)]
    out = write_report(runs, tmp_path / "report.html")
    colours = check_figures_and_layout(out, min_figures=2)
    assert set(colours) == {f"run-{i}" for i in range(6)}


def test_layout_check_catches_a_caption_outside_its_figure_and_clashing_colours(runs, tmp_path):
    out = write_report(runs, tmp_path / "r.html")
    text = out.read_text()
    # The caption moved out of its figure, where it reads as the next figure's heading.
    moved = text.replace("<figcaption>", "</figure><figcaption>", 1)
    (tmp_path / "moved.html").write_text(moved)
    with pytest.raises(AssertionError):
        check_figures_and_layout(tmp_path / "moved.html", min_figures=2)
    # Two figures that draw the same run in different colours.
    first = text.index("data-colours=")
    clash = text[:first] + 'data-colours="{&quot;sft&quot;: &quot;#123456&quot;}" x' + text[
        text.index(" ", first):]
    (tmp_path / "clash.html").write_text(clash)
    with pytest.raises(AssertionError, match="sft"):
        check_figures_and_layout(tmp_path / "clash.html", min_figures=2)


def test_gao_fit_is_drawn_only_over_the_measured_kl(monkeypatch):
    # Gains 0, 0.3, 0.2 at KL 0, 1, 4 (d = 0, 1, 2). R = d (alpha - beta_RL log d) passes through
    # all three: d = 1 gives alpha = 0.3; d = 2 gives 2 (0.3 - beta_RL ln 2) = 0.2, beta_RL =
    # 0.2 / ln 2 = 0.28854. Its peak, d* = exp(alpha / beta_RL - 1) = exp(1.5 ln 2 - 1) = 1.0405,
    # lies inside the data: a star there. Two parameters through 3 points: "only 3 points".
    groups, points = fake_sweep()
    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)
    titled = {title: (caption, colours)
              for title, _, caption, colours in sweep_report.figures(groups, points)}
    ax = drawn[-1].axes[0]
    fit_line = next(line for line in ax.get_lines() if line.get_label().startswith("PPO beta 0.1"))
    assert min(fit_line.get_xdata()) == 0.0 and max(fit_line.get_xdata()) == pytest.approx(2.0)
    assert fit_line.get_label() == "PPO beta 0.1: fit of only 3 points, R² 1.00"
    star = next(line for line in ax.get_lines() if line.get_marker() == "*")
    assert star.get_xdata()[0] == pytest.approx(1.0405, abs=1e-4)
    assert star.get_ydata()[0] == pytest.approx(0.28854 * 1.0405, abs=1e-4)  # beta_RL d*
    assert "no extrapolation" in titled["Gao et al.'s fit per beta"][0]
    # One colour per setting in every figure: the DPO marker too (it took the cycle's default).
    maps = [colours for _, colours in titled.values()]
    # Settings take the free colours in order: brown, pink, then tab:olive for the third, DPO.
    assert maps[0]["DPO beta 0.1"] == maps[1]["DPO beta 0.1"] == "#bcbd22"
    assert maps[0]["PPO beta 0.1"] == maps[1]["PPO beta 0.1"] == maps[2]["PPO beta 0.1"]
    assert "DPO marked" in titled["The frontier"][0]


def test_a_fitted_peak_past_the_data_is_named_not_drawn(monkeypatch):
    # Gains 0, 0.3, 0.5 at d = 0, 1, 2: alpha = 0.3, beta_RL = 0.05 / ln 2 = 0.072135, d* =
    # exp(0.3 / 0.072135 - 1) = exp(3.1589) = 23.544, KL 554.3: far past the data (KL 4).
    groups, points = fake_sweep(((0.0, 0.0), (1.0, 0.3), (4.0, 0.5)))
    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)
    titled = {t: c for t, _, c, _ in sweep_report.figures(groups[:2], points[:2])}
    labels = [line.get_label() for line in drawn[-1].axes[0].get_lines()]
    assert "PPO beta 0.1: fit of only 3 points, peak beyond the data (KL 554), R² 1.00" in labels
    assert max(max(line.get_xdata()) for line in drawn[-1].axes[0].get_lines()) <= 2.0
    assert "DPO" not in titled["The frontier"]  # no DPO run, no promise of its marker


def frontier_runs(root):
    """Two seeds of ppo-a and one of ppo-b with gold evaluations at steps 0, 2, 4, a bon.json and
    an interpolation evaluated with a gold function."""
    gold = {("a", 0): [0.0, 0.3, 0.5], ("a", 1): [0.0, 0.5, 0.3], ("b", 0): [0.0, 0.1, 0.2]}
    for (name, seed), golds in gold.items():
        fake_run(root, f"ppo-{name}-seed{seed}", {"beta": 0.1 if name == "a" else 0.2, "seed": seed},
                 [{"step": s, "eval/kl": s / 2, "eval/kl_exact": s / 2, "eval/score": g + 1,
                   "eval/gold_score": g} for s, g in zip((0, 2, 4), golds)])
    bon = root / "bon.json"
    bon.write_text(json.dumps([{"n": n, "proxy": n, "proxy_se": 0.1, "gold": 0.1 * n,
                                "gold_se": 0.05, "kl_bound": 0.5 * n, "kl_exact": 0.4 * n}
                               for n in (1, 2, 3)]))
    line = root / "interp"
    line.mkdir()
    rows = []
    for eta, golds in ((0, [0.0, 0.2]), (1, [0.4, 0.6])):
        path = line / f"eta{eta}"
        (line / f"eta{eta}.eval.json").write_text(json.dumps(
            {"samples": [{"gold_score": g} for g in golds]}))
        rows.append({"eta": eta, "path": str(path), "eval/kl": eta * 1.5,
                     "eval/gold_score": sum(golds) / 2})
    (line / "interpolate.json").write_text(json.dumps(rows))
    return gold, bon, line / "interpolate.json"


def test_report_draws_the_frontier_of_runs_with_gold_and_the_baselines(tmp_path, monkeypatch,
                                                                       capsys):
    from tether.tools import report_frontier

    gold, bon, line = frontier_runs(tmp_path)
    runs = [str(tmp_path / f"ppo-{n}-seed{s}") for n, s in gold]
    seen = {}

    def figures(groups, points, curve, interpolated, palette):
        seen.update(groups={g.label: g for g in groups}, curve=curve, line=interpolated)
        return sweep_report.figures(groups, points, curve, interpolated, palette)
    monkeypatch.setattr(report_frontier, "figures", figures)
    out = tmp_path / "page.html"
    assert main(["report", *runs, str(bon), str(line), "--output", str(out)]) == 0, \
        capsys.readouterr().err
    # the seeds of ppo-a averaged step by step; ppo-b alone; both labelled with their beta
    a, b = seen["groups"]["PPO beta 0.1 (run ppo-a)"], seen["groups"]["PPO beta 0.2 (run ppo-b)"]
    assert a.seeds == [0, 1] and a.mean["gold"] == pytest.approx([0.0, 0.4, 0.4])
    assert b.mean["gold"] == pytest.approx([0.0, 0.1, 0.2]) and a.fit is not None
    assert [c["n"] for c in seen["curve"]] == [1, 2, 3]
    # the interpolation: each point's mean gold and its standard error over prompts
    assert seen["line"][0] == "interp"
    assert [pytest.approx(p) for p in seen["line"][1]] == [(0, 0.0, 0.1, 0.1), (1, 1.5, 0.5, 0.1)]
    page = out.read_text()
    assert "id='frontier'" in page and "dashed squares are best-of-n" in page
    assert "interp&#x27;s weights interpolated" in page
    # and says what the sweep's page says: RL against best-of-n, one curve against one per beta
    assert "Best-of-3: gold" in page and "One curve for every setting" in page
    colours = check_figures_and_layout(out, min_figures=4)
    assert {"best-of-n", "interpolated", "PPO beta 0.1 (run ppo-a)"} <= set(colours)


def test_report_refuses_a_baseline_it_cannot_draw(tmp_path, capsys):
    gold, bon, line = frontier_runs(tmp_path)
    plain = fake_run(tmp_path, "sft", {"lr": 1e-3}, [{"step": 1, "train/loss": 1.0}])
    out = tmp_path / "page.html"
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"a": 1}))
    no_gold = tmp_path / "no_gold.json"
    no_gold.write_text(json.dumps([{"n": 1, "gold": None}]))
    for args, says in (([str(plain), str(bon)], "and no run given did"),
                       ([str(tmp_path / "ppo-b-seed0"), str(other)], "is not tether bon's"),
                       ([str(tmp_path / "ppo-b-seed0"), str(no_gold)], "with gold scores"),
                       ([str(tmp_path / "ppo-b-seed0"), str(tmp_path / "missing.json")],
                        "is not tether bon's")):
        assert main(["report", *args, "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1 and not out.exists(), err
