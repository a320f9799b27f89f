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

A field whose own type is a list (e.g. stop_strings) is an axis only when given a list of lists.
Every bad field fails here, before any run starts. The configs are imported by name, so planning
imports no torch.
"""

from __future__ import annotations

import importlib
import itertools
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.errors import TetherError
from tether.run.config import check_run_name, config_from_dict, load_yaml
from tether.tools.config import EvalConfig

STAGE_CONFIGS = {"ppo": ("tether.train.ppo_config", "PPOConfig"),
                 "dpo": ("tether.train.offline_config", "DPOConfig")}


TOP_KEYS = ("name", "output_dir", "seeds", "ppo", "dpo", "eval")


# The PPO fields a DPO/IPO run's evaluation takes over, so both are measured alike.
SHARED_EVAL_FIELDS = ("reward_model", "reward_fn", "gold_fn", "max_prompt_len", "max_new_tokens",
                      "temperature", "batch_size", "device", "dtype", "trust_remote_code")


@dataclass
class PlannedRun:
    name: str
    stage: str  # "ppo" or "dpo"
    seed: int
    point: dict[str, Any]  # the grid values that set this run apart (seed excluded)
    fields: dict[str, Any]  # the stage config's fields (run_name and output_dir included)
    eval_fields: dict[str, Any] = field(default_factory=dict)  # EvalConfig fields (dpo only)

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


def _split_axes(stage: str, block: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list]]:
    """(fixed fields, axes) of a stage block; a list is an axis unless the field is list-typed."""
    if not isinstance(block, dict):
        raise TetherError(f"grid: '{stage}' must be a mapping of {stage} config fields")
    hints = typing.get_type_hints(config_class(stage))
    fixed, axes = {}, {}
    for key, value in block.items():
        if key not in hints:
            names = ", ".join(sorted(hints))
            raise TetherError(f"grid: unknown {stage} field '{key}'; allowed fields: {names}")
        if key in ("run_name", "output_dir", "seed", "resume"):
            raise TetherError(f"grid: '{key}' is set by the sweep for each run; remove it from "
                              f"the '{stage}' block")
        list_typed = typing.get_origin(hints[key]) in (list, tuple)
        is_axis = isinstance(value, list) and (not list_typed or
                                               all(isinstance(v, list) for v in value))
        if is_axis and not value:
            raise TetherError(f"grid: {stage} axis '{key}' is an empty list; give it values")
        (axes if is_axis else fixed)[key] = value
    return fixed, axes


def _stage_runs(stage: str, block: dict, seeds: list[int], root: Path) -> list[PlannedRun]:
    fixed, axes = _split_axes(stage, block)
    runs = []
    for values in itertools.product(*axes.values()):
        point = dict(zip(axes, values))
        label = "-".join(f"{k}{_slug(v)}" for k, v in point.items())
        for seed in seeds:
            name = f"{stage}-{label}-seed{seed}" if label else f"{stage}-seed{seed}"
            check_run_name(name)
            fields = {**fixed, **point, "seed": seed, "run_name": name, "output_dir": str(root)}
            runs.append(PlannedRun(name, stage, seed, point, fields))
    return runs


def _ppo_defaults(runs: list[PlannedRun]) -> None:
    """Every PPO run evaluates at step 0 and about ten times more: the points of the frontier."""
    for run in runs:
        if run.stage != "ppo":
            continue
        cfg = config_from_dict(config_class("ppo"), run.fields)  # checks every field now
        if not cfg.eval_prompts or not cfg.gold_fn:
            raise TetherError("grid: the ppo block needs eval_prompts and gold_fn (the frontier "
                              "plots gold reward against KL on held-out prompts)")
        if "eval_every" not in run.fields:
            run.fields["eval_every"] = max(1, cfg.n_batches // 10)


def _dpo_eval(runs: list[PlannedRun], ppo_block: dict, eval_block: dict) -> None:
    """A DPO/IPO run's evaluation settings: PPO's (first grid value), then the eval block."""
    base = {k: (v[0] if isinstance(v, list) and k != "stop_strings" else v)
            for k, v in ppo_block.items() if k in SHARED_EVAL_FIELDS}
    if "eval_prompts" in ppo_block:
        base["prompts"] = ppo_block["eval_prompts"]
    base |= eval_block
    for run in runs:
        if run.stage == "dpo":
            final = Path(run.fields["output_dir"]) / run.name / "final"
            run.eval_fields = {**base, "model": str(final), "seed": run.seed,
                               "output": str(final.parent / "eval.json")}
            config_from_dict(EvalConfig, run.eval_fields)  # bad eval settings fail now
            if not run.eval_fields.get("gold_fn"):
                raise TetherError("grid: DPO/IPO runs need a gold_fn to be placed on the frontier"
                                  " (in the ppo block or in eval)")


def plan(grid_path: str, output_dir: str | None = None) -> Sweep:
    """Read and check the grid file; every bad field fails here, before any run starts."""
    grid = load_yaml(grid_path)
    unknown = sorted(set(grid) - set(TOP_KEYS))
    if unknown:
        raise TetherError(f"grid {grid_path}: unknown key '{unknown[0]}'; allowed: "
                          f"{', '.join(TOP_KEYS)}")
    if not grid.get("ppo") and not grid.get("dpo"):
        raise TetherError(f"grid {grid_path}: give a 'ppo' and/or a 'dpo' block of config fields")
    seeds = grid.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise TetherError(f"grid {grid_path}: 'seeds' must be a non-empty list of integers")
    name = str(grid.get("name", Path(grid_path).stem))
    check_run_name(name)
    root = Path(output_dir or grid.get("output_dir", "runs")) / name
    runs, axes = [], {}
    for stage in ("ppo", "dpo"):
        if grid.get(stage):
            stage_runs = _stage_runs(stage, grid[stage], seeds, root)
            axes[stage] = list(stage_runs[0].point) if stage_runs else []
            runs += stage_runs
    _ppo_defaults(runs)
    _dpo_eval(runs, grid.get("ppo") or {}, grid.get("eval") or {})
    return Sweep(root, runs, axes)


def state(run: PlannedRun) -> str:
    """done (final model, and for DPO/IPO its evaluation), broken (started, unfinished) or new."""
    path = Path(run.fields["output_dir"]) / run.name
    finished = (path / "final").exists() and (run.stage != "dpo" or (path / "eval.json").exists())
    return "done" if finished else "broken" if path.exists() else "new"


