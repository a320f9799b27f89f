"""`tether report RUN [RUN ...]`: any run directories, of any stage, on one HTML page (the
command, and the frontier it adds where runs evaluated a gold reward: tether.tools.report_frontier).

    runs/<name>/config.yaml, metrics.jsonl   -> RunRecord (read_run)
    one panel per metric, a line per run     -> PNGs embedded in the page (plot_metrics)
    the configs side by side, differences first, a link to each config.yaml
    -> report.html (self-contained: the figures are inline PNG data)

The demo's report and the sweep's report add their own sections to the same page machinery
(`figure_html`, `write_page`, `config_diff`).
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
import yaml

matplotlib.use("Agg")  # no screen needed: reports are written on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.container import ErrorbarContainer  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from tether.errors import TetherError  # noqa: E402
from tether.run.atomic import atomic_write_bytes, json_lines  # noqa: E402
from tether.tools.outputs import check_output  # noqa: E402

# Logged every step but about the machine, not the training: left out of the curves.
SKIPPED_PREFIXES = ("perf/", "data/")
PANELS_PER_ROW = 3


@dataclass
class RunRecord:
    """One run directory as read back: its config and every logged metric line."""

    name: str
    path: Path
    config: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)

    def series(self, name: str) -> tuple[list[float], list[float]]:
        """(steps, values) of metric `name`, in logged order; non-numbers (NaN logged as text)
        are skipped."""
        steps, values = [], []
        for row in self.metrics:
            value = row.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                steps.append(float(row["step"]))
                values.append(float(value))
        return steps, values


def read_run(path: str | Path) -> RunRecord:
    """Read `path/config.yaml` and `path/metrics.jsonl` (a line cut off by a kill is skipped)."""
    path = Path(path)
    if not (path / "config.yaml").is_file() and not (path / "metrics.jsonl").is_file():
        raise TetherError(f"{path} is not a tether run directory (no config.yaml or "
                          "metrics.jsonl); pass the directory a stage wrote under --output-dir")
    config: dict[str, Any] = {}
    if (path / "config.yaml").is_file():
        try:
            config = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError):
            raise TetherError(f"{path / 'config.yaml'} is not valid YAML; restore it from the "
                              "run or leave the run out") from None
        if not isinstance(config, dict):  # a list or a scalar: no fields to show or diff
            raise TetherError(f"{path / 'config.yaml'} is a YAML {type(config).__name__}, not the "
                              "mapping of config fields a run records; restore it from the run "
                              "or leave the run out")
    metrics = ([row for _, row in json_lines(path / "metrics.jsonl")
                if isinstance(row, dict) and "step" in row]
               if (path / "metrics.jsonl").is_file() else [])
    return RunRecord(path.name, path, config, metrics)


def read_samples(path: Path) -> dict[int, list[dict[str, Any]]]:
    """step -> the samples a run logged with each evaluation (`path/samples.jsonl`; {} without
    one): prompt, response and scores per held-out prompt."""
    out = {}
    if (path / "samples.jsonl").exists():
        for line in (path / "samples.jsonl").read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            out[int(row["step"])] = row["samples"]
    return out


def metric_names(runs: list[RunRecord]) -> list[str]:
    """Every numeric metric any run logged, sorted by namespace then name."""
    return sorted({key for run in runs for row in run.metrics for key, value in row.items()
                   if key != "step" and isinstance(value, (int, float))
                   and not key.startswith(SKIPPED_PREFIXES)})


# One colour per run or setting on a page (issue 22): the demo's runs keep theirs on every page;
# any other label (a sweep setting, a run of `tether report`) takes the next colour none of them
# uses, so a colour never means two things on the demo page, which embeds the sweep's figures.
RUN_COLOURS = {"sft": "black", "ppo-no-kl": "tab:red", "ppo-fixed": "tab:blue",
               "ppo-adaptive": "tab:green", "dpo": "tab:purple", "ipo": "tab:orange"}
FREE_COLOURS = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan", "#393b79", "#e7ba52",
                "#7b4173", "#637939", "#5254a3", "#ad494a")
# One marker per model evaluated once (the demo's SFT; DPO and IPO on every page).
MARKERS = {"sft": "o", "dpo": "s", "ipo": "D"}
GUIDE = "guide"  # gid of drawn lines that are no run or setting (seed styles, targets, frontier)


class Palette:
    """label -> colour, fixed for a whole page: pass one to every plot of the page.

    Named labels (RUN_COLOURS) keep their colour; any other takes the first free colour in the
    order it is first asked for; past FREE_COLOURS, hues spaced by the golden ratio."""

    def __init__(self):
        self.named = {k: to_hex(v) for k, v in RUN_COLOURS.items()}
        self.assigned: dict[str, str] = {}

    def __call__(self, label: str) -> str:
        if label in self.named:
            return self.named[label]
        if label not in self.assigned:
            used = set(self.named.values()) | set(self.assigned.values())
            free = [c for c in map(to_hex, FREE_COLOURS) if c not in used]
            self.assigned[label] = free[0] if free else to_hex(
                matplotlib.colormaps["hsv"]((len(self.assigned) * 0.618034) % 1.0))
        return self.assigned[label]


def legend_colours(fig) -> dict[str, str]:
    """{run or setting: colour} of every labelled artist in the figure, read back from what was
    drawn; keyed by the artist's gid where the plot set one (the run, when the legend text adds
    more, e.g. a fit's R²), else by its label. Guides (gid GUIDE) are left out. A run drawn in
    two colours within one figure is a plotting bug: ValueError."""
    out: dict[str, str] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            artist = handle.lines[0] if isinstance(handle, ErrorbarContainer) else handle
            if artist.get_gid() == GUIDE:
                continue
            colour = to_hex(artist.get_color() if isinstance(artist, Line2D)
                            else artist.get_facecolor()[0])
            key = artist.get_gid() or label
            if out.setdefault(key, colour) != colour:
                raise ValueError(f"{key} is drawn in {out[key]} and {colour} in one figure")
    return out


def png_data(fig, path: Path | None = None, dpi: int = 80) -> tuple[str, dict[str, str]]:
    """A finished matplotlib figure as (its <img> src, its legend_colours), closed afterwards.

    The src is the PNG inline (base64 data) or, given `path`, the file written there, named as
    a page beside it links it."""
    colours = legend_colours(fig)
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(path or buffer, format="png", dpi=dpi)
    plt.close(fig)
    if path is not None:
        return path.name, colours
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii"), colours


def figure_html(src: str, title: str, caption: str = "",
                colours: dict[str, str] | None = None) -> str:
    """<figure> with its image and, inside it, its caption; `colours` (legend_colours) goes in
    data-colours as JSON, so a test can check one colour per run across the page."""
    data = html.escape(json.dumps(colours or {}, sort_keys=True), quote=True)
    return (f"<figure data-colours=\"{data}\"><img src='{html.escape(src)}' "
            f"alt='{html.escape(title)}'><figcaption><b>{html.escape(title)}</b> "
            f"{html.escape(caption)}</figcaption></figure>")


def plot_metrics(runs: list[RunRecord], names: list[str], palette: Palette | None = None
                 ) -> list[tuple[str, str, dict[str, str]]]:
    """One figure per metric namespace, a panel per metric, a line per run:
    [(title, img src, legend colours)]; each run has one colour in every figure (`palette`: the
    page's, when it has other figures)."""
    palette = palette or Palette()
    figures = []
    namespaces: dict[str, list[str]] = {}
    for name in names:
        namespaces.setdefault(name.split("/")[0], []).append(name)
    for namespace, group in namespaces.items():
        rows = (len(group) + PANELS_PER_ROW - 1) // PANELS_PER_ROW
        fig, axes = plt.subplots(rows, PANELS_PER_ROW, figsize=(13, 3.2 * rows), squeeze=False)
        for ax, name in zip(axes.flat, group):
            for run in runs:
                steps, values = run.series(name)
                if steps:
                    ax.plot(steps, values, "-o" if len(steps) < 3 else "-", markersize=4,
                            color=palette(run.name), label=run.name)
            ax.set(title=name, xlabel="step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: never 1.2
        for ax in list(axes.flat)[len(group):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=8)
        figures.append((f"{namespace}/ metrics", *png_data(fig)))
    return figures


def config_diff(configs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """(shared, differing): fields with one value in every config, and fields whose values
    differ (or are missing somewhere), each with its value per config (None where missing)."""
    shared, differing = {}, {}
    for key in sorted({k for c in configs for k in c}):
        values = [c.get(key) for c in configs]
        if all(key in c for c in configs) and all(v == values[0] for v in values):
            shared[key] = values[0]
        else:
            differing[key] = values
    return shared, differing


def rows_html(rows: Iterable[Iterable[str]], cell: str = "td") -> str:
    """Table rows of text, each cell escaped (`cell` "th": header cells)."""
    return "".join("<tr>" + "".join(f"<{cell}>{html.escape(c)}</{cell}>" for c in row) + "</tr>"
                   for row in rows)


def _json(value: Any) -> str:
    return "" if value is None else json.dumps(value)


def config_html(runs: list[RunRecord], page_dir: Path) -> str:
    """The configs side by side: differences in a table, shared values folded away, and a link
    to each run's config.yaml (relative to the page)."""
    shared, differing = config_diff([run.config for run in runs])
    links = "".join(f"<li><a href='{html.escape(relative_link(run.path / 'config.yaml', page_dir))}'>"
                    f"{html.escape(run.name)}/config.yaml</a></li>" for run in runs)
    header = rows_html([["field", *(r.name for r in runs)]], "th")
    rows = rows_html([k, *map(_json, values)] for k, values in differing.items())
    same = rows_html([k, _json(v)] for k, v in shared.items())
    return (f"<ul class='config-links'>{links}</ul>"
            f"<table id='config-diff'>{header}{rows or '<tr><td>(none)</td></tr>'}</table>"
            f"<details><summary>{len(shared)} fields the runs share</summary>"
            f"<table id='config-shared'>{same}</table></details>")


def relative_link(target: Path, start: Path) -> str:
    return Path(os.path.relpath(target.resolve(), start.resolve())).as_posix()


# The style of every page (the demo's too). A finding's first word is green where it holds, red
# where it fails, amber where it is not shown yet (the demo's verdicts). A figure is a framed block
# with its caption tight under its image and space before the next, so a caption never reads as
# the next figure's heading; a table wider than the page scrolls inside itself (display: block)
# and long cells wrap, so the page itself never scrolls sideways.
STYLE = """body { font-family: sans-serif; max-width: 1150px; margin: 2em auto; padding: 0 1em;
  line-height: 1.45; }
li.holds b { color: #1a7f37; } li.fails b { color: #b42318; } li.unshown b { color: #9a6700; }
.note { color: #555; }
table { border-collapse: collapse; margin: 1em 0; display: block;
  max-width: 100%; overflow-x: auto; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; font-size: 0.9em;
  overflow-wrap: anywhere; min-width: 4em; }
img { max-width: 100%; display: block; }
figure { margin: 0 0 2.5em 0; padding: 0.6em; border: 1px solid #ddd; border-radius: 4px; }
figcaption { margin-top: 0.3em; color: #333; font-size: 0.92em; }"""


def write_page(path: Path, title: str, body: str, heading: str = "") -> Path:
    """Write a whole page to `path`: `title` in the browser's tab, `heading` (default: the title)
    above `body`, in STYLE; returns the path."""
    text = (f"<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{html.escape(heading or title)}</h1>\n{body}\n</body></html>\n")
    atomic_write_bytes(path, text.encode("utf-8"))
    return path


def runs_section(runs: list[RunRecord], page_dir: Path, palette: Palette | None = None) -> str:
    """The metric curves side by side and the configs diffed: the body `tether report` writes."""
    figures = "".join(figure_html(src, title, "a line per run, one colour per run in every "
                                  "panel", colours)
                      for title, src, colours in plot_metrics(runs, metric_names(runs), palette))
    return (f"<h2 id='curves'>Metrics</h2>{figures or '<p>No metrics logged.</p>'}"
            f"<h2 id='configs'>Configs</h2>{config_html(runs, page_dir)}")


def write_report(run_dirs: list[str | Path], output: str | Path, title: str = "tether runs",
                 section: str = "", inputs: list[str] = (), palette: Palette | None = None
                 ) -> Path:
    """Read every run in `run_dirs` and write one page to `output`, `section` after the run
    names (`tether report`'s frontier: tether.tools.report_frontier, drawn with `palette`, which
    the runs' panels then share); returns its path. `inputs`: other files the page reads, which
    `output` must not be."""
    if not run_dirs:
        raise TetherError("tether report needs at least one run directory: tether report RUN ...")
    output = check_output(output, [("run directory", d) for d in run_dirs]
                          + [("baseline", f) for f in inputs], "report.html",
                          own_default="report.html")
    runs = [read_run(d) for d in run_dirs]
    names = ", ".join(run.name for run in runs)
    return write_page(output, title, f"<p>Runs: {html.escape(names)}.</p>" + section
                      + runs_section(runs, output.parent, palette))
