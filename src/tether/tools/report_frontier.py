"""`tether report RUN ... [bon.json] [interpolate.json]`: any run directories on one page
(tether.tools.report: a panel per metric, the configs diffed) and, where the runs evaluated a
gold reward (--gold-fn with --eval-prompts), the reward-KL frontier as `tether sweep` draws it
(tether.tools.sweep_report.figures): gold and proxy against KL with error bands, every
evaluation under the frontier, and Gao et al.'s fit per setting. Run directories named
NAME-seed<k> are the seeds of one setting, averaged. The baselines given beside them go on the
same figures: `tether bon`'s best-of-n curve at its exact KL with its standard errors and its own
Gao fit, and `tether interpolate`'s points (its interpolate.json, evaluated with a gold
function)."""

from __future__ import annotations

import html
import json
from pathlib import Path

from tether.errors import TetherError
from tether.run.parse import parse_config
from tether.tools.config import ReportConfig
from tether.tools.report import Palette, figure_html, read_run, write_report
from tether.tools.sweep_plan import PlannedRun
from tether.tools.sweep_report import figures, one_curve_sentence, versus_best_of_n
from tether.tools.sweep_results import read_interpolation, run_points, summarise

BASELINES = "tether bon's bon.json or tether interpolate's interpolate.json"


def baseline(path: str) -> tuple[str, list]:
    """("bon", the curve) or ("interpolate", `read_interpolation`) of a baseline's JSON file."""
    try:
        rows = json.loads(Path(path).read_text(encoding="utf-8"))
        if "n" in rows[0] and rows[0]["gold"] is not None:
            return "bon", rows
        if "eta" in rows[0] and "eval/gold_score" in rows[0]:
            return "interpolate", read_interpolation(Path(path).parent)
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        pass
    raise TetherError(f"{path} is not {BASELINES} with gold scores (--gold-fn); give one, or "
                      "a run directory")


def frontier_html(run_dirs: list[str], baselines: list[str], palette: Palette) -> str:
    """The frontier's figures for the runs that evaluated a gold reward and the baselines, in
    the page's `palette`."""
    given = {kind: (path, rows) for path in baselines for kind, rows in [baseline(path)]}
    configs = [read_run(d).config for d in run_dirs]  # NAME-seed<k>: a seed of setting NAME
    runs = [PlannedRun(Path(d).name, "ppo", c.get("seed", 0), {"run": Path(d).name.rsplit(
        "-seed", 1)[0]}, {"beta": c.get("beta", 0.05)}) for d, c in zip(run_dirs, configs)]
    points = [p for p in (run_points(run, Path(d)) for run, d in zip(runs, run_dirs)) if p.steps]
    if not points:
        if baselines:
            raise TetherError("the baselines are drawn against runs that evaluated a gold reward "
                              "(--gold-fn with --eval-prompts), and no run given did")
        return ""
    (where, line), curve, groups = given.get("interpolate", ("", [])), given.get(
        "bon", ("", []))[1], summarise(points)
    # as the sweep's page says them: RL against best-of-n per nat, and one curve or one per beta
    said = [one_curve_sentence(groups), curve and versus_best_of_n(groups, curve)]
    return "<h2 id='frontier'>The reward-KL frontier</h2>" + "".join(
        f"<p class='said'>{html.escape(s)}</p>" for s in said if s) + "".join(
        figure_html(src, title, caption, colours) for title, src, caption, colours in figures(
            groups, points, curve, (Path(where).parent.name, line), palette))


def cli(argv: list[str]) -> int:
    """`tether report RUN [RUN ...] [bon.json] [interpolate.json] [--output report.html]`."""
    # `tether report A B` reads as `--runs A B` (ReportConfig.POSITIONAL)
    cfg = parse_config(ReportConfig, argv, prog="tether report")
    run_dirs = [path for path in cfg.runs if not path.endswith(".json")]
    baselines = [path for path in cfg.runs if path.endswith(".json")]
    palette = Palette()  # one colour per run or setting on the whole page
    path = write_report(run_dirs, cfg.output, cfg.title,
                        frontier_html(run_dirs, baselines, palette), baselines, palette)
    print(f"report written to {path}")
    return 0
