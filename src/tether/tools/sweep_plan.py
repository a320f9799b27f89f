"""The plan of `tether sweep`: a grid file read and checked into one `PlannedRun` per (stage,
grid point, seed), each named by its values, and the state of each run on disk.

The grid file::

    name: beta-sweep            # runs go to <output_dir>/<name>/<run>
    output_dir: runs
    seeds: [0, 1, 2]
    ppo:                        # PPOConfig fields; a list is a grid axis
      policy: runs/sft/final
      reward_model: runs/rm/final
      prompts: data/prompts.jsonl
      eval_prompts: data/eval.jsonl
      gold_fn: my_task:gold
      beta: [0.0, 0.02, 0.05, 0.1]
    dpo:                        # DPOConfig fields (loss: [sigmoid, ipo] gives DPO and IPO)
      model: runs/sft/final
      data: data/pairs.jsonl
      loss: [sigmoid, ipo]
    eval: {}                    # EvalConfig fields for the DPO/IPO evaluations (default: PPO's)
    bon: {n: 16}                # optional: the best-of-n baseline of the ppo block's policy
                                # (BonConfig fields; default: PPO's evaluation settings)
    interpolate: {run: ppo-beta0-seed0}   # optional: that run's weights from its start, each
                                # point evaluated (InterpolateConfig fields; default run: the
                                # smallest beta's first)

A field whose own type is a list (e.g. stop_strings) is an axis only when given a list of lists.
Every bad field fails here, before any run starts, and so does a grid point given twice (`beta:
[0.1, 0.1]`, `[1, 1.0]`, `seeds: [0, 0]`: one run trained twice and counted as two seeds). Run
names are distinct by construction (`_axis_slugs`), so no two runs, and no two `--jobs` workers,
share a directory. The configs are imported by name, so planning imports no torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import itertools
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.errors import TetherError
from tether.run import scopes
from tether.run.config import (
    DeviceOptions,
    RewardOptions,
    SamplingOptions,
    check_run_name,
    config_to_dict,
)
from tether.run.parse import config_from_dict, load_yaml, unknown_key
from tether.tools.config import BonConfig, EvalConfig, InterpolateConfig

STAGE_CONFIGS = {"ppo": ("tether.train.ppo_config", "PPOConfig"),
                 "dpo": ("tether.train.offline_config", "DPOConfig")}


TOP_KEYS = ("name", "output_dir", "seeds", "ppo", "dpo", "eval", "bon", "interpolate")

# Why a grid point or seed given twice is refused, as every such refusal ends
REPEAT = ("so two runs would train the same thing (and the report count it as two seeds); "
          "remove the repeat")


# The PPO fields a DPO/IPO run's evaluation takes over, so both are measured alike: the sections
# PPO's held-out evaluation and `tether eval` share (the reward, the sampling, the device), and
# the evaluation's chunks (batch_size).
SHARED_EVAL_FIELDS = (*(f.name for section in (RewardOptions, SamplingOptions, DeviceOptions)
                        for f in dataclasses.fields(section)), "batch_size")


@dataclass
class PlannedRun:
    name: str
    stage: str  # "ppo", "dpo", or "bon" (the best-of-n baseline: its fields in eval_fields)
    seed: int
    point: dict[str, Any]  # the grid values that set this run apart (seed excluded)
    fields: dict[str, Any]  # the stage config's fields (run_name and output_dir included)
    eval_fields: dict[str, Any] = field(default_factory=dict)  # EvalConfig's (dpo), BonConfig's,
    # InterpolateConfig's (the ppo run the grid interpolates)

    @property
    def group(self) -> str:  # the grid point without its seed: runs averaged together
        return self.name.rsplit("-seed", 1)[0]


@dataclass
class Sweep:
    root: Path
    runs: list[PlannedRun]
    axes: dict[str, list[str]]  # stage -> its axis names


def config_class(stage: str):
    module, name = STAGE_CONFIGS[stage]
    return getattr(importlib.import_module(module), name)


def _slug(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9.+]", "_", f"{value:g}" if isinstance(value, float) else str(value))


def _axis_slugs(values: list) -> list[str]:
    """Each axis value's part of the run names, distinct by construction. Where two values would
    read alike (0.1234567 and 0.1234568 are both 0.123457 under :g; 'a/b' and 'a_b'; 'A' and 'a'
    on a case-insensitive disk), a float is written in full (repr), then anything still alike
    gets 6 hex digits of its value's hash. Values that read apart keep their plain names."""
    slugs = [_slug(v) for v in values]
    for precise in (lambda v, s: _slug(repr(v)) if isinstance(v, float) else s,
                    lambda v, s: f"{s}_{hashlib.sha256(repr(v).encode()).hexdigest()[:6]}"):
        lowered = [s.lower() for s in slugs]
        slugs = [precise(v, s) if lowered.count(s.lower()) > 1 else s
                 for v, s in zip(values, slugs)]
    return slugs  # still alike only for equal values: _stage_runs refuses those as a repeat


def _split_axes(stage: str, block: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list]]:
    """(fixed fields, axes) of a stage block; a list is an axis unless the field is list-typed."""
    if not isinstance(block, dict):
        raise TetherError(f"grid: '{stage}' must be a mapping of {stage} config fields")
    hints = typing.get_type_hints(config_class(stage))
    fixed, axes = {}, {}
    for key, value in block.items():
        if key not in hints:
            raise TetherError("grid: " + unknown_key(config_class(stage), key, value,
                                                     f"the '{stage}' block"))
        if key in ("run_name", "output_dir", "seed", "resume"):
            raise TetherError(f"grid: '{key}' is set by the sweep for each run; remove it from "
                              f"the '{stage}' block")
        list_typed = typing.get_origin(hints[key]) in (list, tuple)
        # `stop_strings: []` is the field's value (no stop strings), not an axis without values
        is_axis = isinstance(value, list) and (not list_typed or bool(value) and
                                               all(isinstance(v, list) for v in value))
        if is_axis and not value:
            raise TetherError(f"grid: {stage} axis '{key}' is an empty list; give it values")
        (axes if is_axis else fixed)[key] = value
    return fixed, axes


def _stage_runs(stage: str, block: dict, seeds: list[int], root: Path) -> list[PlannedRun]:
    """One run per grid point and seed, each config checked; a point given twice is refused."""
    fixed, axes = _split_axes(stage, block)
    slugs = {key: _axis_slugs(values) for key, values in axes.items()}
    runs, seen = [], {}  # seen: the config (run name aside) -> the grid point that gave it
    for index in itertools.product(*(range(len(values)) for values in axes.values())):
        point = {key: axes[key][i] for key, i in zip(axes, index)}
        label = "-".join(f"{key}{slugs[key][i]}" for key, i in zip(axes, index))
        for seed in seeds:
            name = f"{stage}-{label}-seed{seed}" if label else f"{stage}-seed{seed}"
            check_run_name(name)
            fields = {**fixed, **point, "seed": seed, "run_name": name, "output_dir": str(root)}
            same = _config_key(stage, name, fields)
            if same in seen:
                raise TetherError(_repeat_message(stage, axes, seen[same], index))
            seen[same] = index
            runs.append(PlannedRun(name, stage, seed, point, fields))
    return runs


def _checked(cls, name: str, fields: dict[str, Any]):
    """The config `fields` make, checked; a bad field is the grid's one line, naming the run."""
    try:
        return config_from_dict(cls, fields)
    except TetherError as exc:
        raise TetherError(f"grid: {name}: {exc}") from None


def _config_key(stage: str, name: str, fields: dict[str, Any]) -> str:
    """The run's checked config as the stage will see it (1 and 1.0 alike), its name aside."""
    cfg = config_to_dict(_checked(config_class(stage), name, fields))
    return repr(sorted((k, v) for k, v in cfg.items() if k != "run_name"))


def _repeat_message(stage: str, axes: dict[str, list], first: tuple, again: tuple) -> str:
    differ = [(key, axes[key][i], axes[key][j]) for key, i, j in zip(axes, first, again) if i != j]
    names = ", ".join(f"'{key}'" for key, _, _ in differ)
    if len(differ) == 1:
        said = f"axis {names} lists one setting twice ({differ[0][1]!r} and {differ[0][2]!r})"
    else:
        said = f"axes {names} list one setting twice (" + "; ".join(
            f"{key}: {a!r} and {b!r}" for key, a, b in differ) + ")"
    return f"grid: {stage} {said}, {REPEAT}"


def _check_block_acts(configs: list, block: dict[str, Any]) -> None:
    """A field of the ppo block that acts in none of its runs (`scale_rewards` without an
    `advantage: grpo` anywhere) would be recorded and ignored: refused, as a flag is. One inert
    in some runs only is a grid crossing its axes (`kl_target` beside `kl_ctl: [fixed,
    adaptive]`), and stays."""
    inert = [scopes.inert(cfg, scopes.given(cfg, block)) for cfg in configs]
    for name, line in inert[0].items() if inert else ():
        if all(name in lines for lines in inert):
            raise TetherError(f"grid: the ppo block's '{name}' has no effect in any of its runs: "
                              f"{line}")


def _ppo_defaults(runs: list[PlannedRun], block: dict[str, Any]) -> None:
    """Every PPO run evaluates at step 0 and about ten times more: the points of the frontier."""
    ppo_runs = [run for run in runs if run.stage == "ppo"]
    configs = [config_from_dict(config_class("ppo"), run.fields)  # checks every field now
               for run in ppo_runs]
    if any(not cfg.eval_prompts or not cfg.gold_fn for cfg in configs):
        raise TetherError("grid: the ppo block needs eval_prompts and gold_fn (the frontier "
                          "plots gold reward against KL on held-out prompts)")
    _check_block_acts(configs, block)
    for run, cfg in zip(ppo_runs, configs, strict=True):
        run.fields.setdefault("eval_every", max(1, cfg.n_batches // 10))


def _eval_base(ppo_block: dict, *more: str) -> dict[str, Any]:
    """PPO's evaluation settings (each axis at its first value), its held-out prompts as
    `prompts`, and the `more` fields named."""
    fixed, axes = _split_axes("ppo", ppo_block)  # (a list-typed field is an axis of lists)
    base = {k: axes[k][0] if k in axes else fixed[k] for k in ppo_block
            if k in SHARED_EVAL_FIELDS or k in more}
    if "eval_prompts" in ppo_block:
        base["prompts"] = ppo_block["eval_prompts"]
    return base


def _bon_run(ppo_block: dict, bon_block: dict, root: Path, seed: int) -> PlannedRun:
    """The best-of-n baseline (tether bon) of the PPO runs' starting policy, sampled and scored
    as their evaluations are; its own fields from the bon block. Its file: bon/bon.json."""
    if not ppo_block or not isinstance(bon_block, dict):
        raise TetherError("grid: 'bon' is a mapping of tether bon fields beside a ppo block (it "
                          "samples the ppo block's policy on its eval_prompts)")
    base = _eval_base(ppo_block, "policy")
    base["model"] = base.pop("policy", "")
    fields = base | {"seed": seed, "output": str(root / "bon" / "bon.json")} | bon_block
    _checked(BonConfig, "bon", fields)
    return PlannedRun("bon", "bon", seed, {}, {"output_dir": str(root)}, fields)


def _interpolation(runs: list[PlannedRun], ppo_block: dict, block: dict, root: Path) -> None:
    """The interpolate block: one PPO run's weights on the line from its start (tether
    interpolate), each point evaluated as the run's evaluations are, into <run>/interpolate/;
    done in that run's job, after its training (its fields: the run's eval_fields)."""
    ppo_runs = [run for run in runs if run.stage == "ppo"]
    if not ppo_runs or not isinstance(block, dict):
        raise TetherError("grid: 'interpolate' is a mapping of tether interpolate fields (and "
                          "'run', a ppo run's name) beside a ppo block")
    fields = dict(block)
    name = fields.pop("run", min(ppo_runs, key=lambda r: r.fields.get("beta", 0.05)).name)
    run = next((r for r in ppo_runs if r.name == name), None)
    if run is None:
        raise TetherError(f"grid: interpolate: run {name!r} is not one of the grid's ppo runs "
                          f"({', '.join(r.name for r in ppo_runs)})")
    final = root / name / "final"
    run.eval_fields = _eval_base(ppo_block) | {
        "reference": run.fields["policy"], "model": str(final), "seed": run.seed,
        "output_dir": str(final.parent / "interpolate")} | fields
    _checked(InterpolateConfig, "interpolate", run.eval_fields)


def _dpo_eval(runs: list[PlannedRun], ppo_block: dict, eval_block: dict) -> None:
    """A DPO/IPO run's evaluation settings: PPO's (first grid value), then the eval block."""
    base = _eval_base(ppo_block) | eval_block
    for run in (run for run in runs if run.stage == "dpo"):
        final = Path(run.fields["output_dir"]) / run.name / "final"
        run.eval_fields = {**base, "model": str(final), "seed": run.seed,
                           "output": str(final.parent / "eval.json")}
        config_from_dict(EvalConfig, run.eval_fields)  # bad eval settings fail now
        if not run.eval_fields.get("gold_fn"):
            raise TetherError("grid: DPO/IPO runs need a gold_fn to be placed on the frontier"
                              " (in the ppo block or in eval)")


def _read_grid(grid_path: str) -> dict[str, Any]:
    """The grid file's top level, its shape checked: a mapping of known keys, each of its type."""
    grid = load_yaml(grid_path)
    if not isinstance(grid, dict):
        raise TetherError(f"grid {grid_path} must be a YAML mapping of {', '.join(TOP_KEYS)} "
                          f"(got {type(grid).__name__}); see docs/frontier.md for its format")
    if unknown := sorted(set(grid) - set(TOP_KEYS), key=str):
        raise TetherError(f"grid {grid_path}: unknown key '{unknown[0]}'; allowed: "
                          f"{', '.join(TOP_KEYS)}")
    if not grid.get("ppo") and not grid.get("dpo"):
        raise TetherError(f"grid {grid_path}: give a 'ppo' and/or a 'dpo' block of config fields")
    seeds = grid.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise TetherError(f"grid {grid_path}: 'seeds' must be a non-empty list of integers")
    if repeated := sorted({s for s in seeds if seeds.count(s) > 1}):
        raise TetherError(f"grid {grid_path}: 'seeds' lists {repeated[0]} twice, {REPEAT}")
    for key, kinds, what in (("name", (str, int), "a plain name"), ("output_dir", (str,), "a path"),
                             ("eval", (dict, type(None)), "a mapping of eval fields")):
        value = grid.get(key)
        if key in grid and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise TetherError(f"grid {grid_path}: '{key}' must be {what}, got {value!r}")
    return grid


def plan(grid_path: str, output_dir: str | None = None) -> Sweep:
    """Read and check the grid file; every bad field fails here, before any run starts."""
    grid = _read_grid(grid_path)
    seeds = grid.get("seeds", [0])
    name = str(grid.get("name", Path(grid_path).stem))
    check_run_name(name)
    # `~` as a shell would: YAML and a quoted --output-dir pass it through as a literal folder
    root = Path(output_dir or grid.get("output_dir", "runs")).expanduser() / name
    runs, axes = [], {}
    for stage in ("ppo", "dpo"):
        if grid.get(stage):
            stage_runs = _stage_runs(stage, grid[stage], seeds, root)
            axes[stage] = list(stage_runs[0].point) if stage_runs else []
            runs += stage_runs
    names = {run.name.lower() for run in runs}  # distinct by construction (_axis_slugs), and
    assert len(names) == len(runs), "two planned runs share a directory"  # checked: one dir each
    _ppo_defaults(runs, grid.get("ppo") or {})
    _dpo_eval(runs, grid.get("ppo") or {}, grid.get("eval") or {})
    if "interpolate" in grid:
        _interpolation(runs, grid.get("ppo") or {}, grid["interpolate"], root)
    if "bon" in grid:
        runs.append(_bon_run(grid.get("ppo") or {}, grid["bon"] or {}, root, seeds[0]))
    return Sweep(root, runs, axes)


def unplanned(sweep: Sweep) -> list[str]:
    """Run directories in the sweep directory that the grid no longer plans (points or seeds
    taken out of it): kept on disk as they are, left out of the report."""
    planned = {run.name for run in sweep.runs}
    return sorted(p.name for p in (sweep.root.iterdir() if sweep.root.is_dir() else ())
                  if p.name not in planned and (p / "config.yaml").is_file())


def state(run: PlannedRun) -> str:
    """done (final model, merged/ too with merge_lora, and for DPO/IPO its evaluation), broken
    (started, unfinished: --resume completes it) or new. As RunDir.finished, read off the plan."""
    if run.stage == "bon":  # one file, written whole or not at all
        return "done" if Path(run.eval_fields["output"]).is_file() else "new"
    path = Path(run.fields["output_dir"]) / run.name
    finished = ((path / "final").exists()
                and (not run.fields.get("merge_lora") or (path / "merged").exists())
                and (run.stage != "dpo" or (path / "eval.json").exists())
                and (run.stage != "ppo" or not run.eval_fields  # the grid's interpolation
                     or (path / "interpolate" / "interpolate.json").exists()))
    return "done" if finished else "broken" if path.exists() else "new"


