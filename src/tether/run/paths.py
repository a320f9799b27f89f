"""What a config's paths mean: the fields that name files, directories and functions, resolved
when a config is parsed or recorded (`resolve_paths`, `resolved_paths`), and read back from a
run's config.yaml (`recorded_input_path`, `resolved_record`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from tether.errors import TetherError

# The fields, of any stage or tool config, that name files and directories. They are resolved
# when a config is parsed or recorded, so that a run's config.yaml names the same models and files
# whatever directory `tether eval`, `report` or `--resume` later runs in (issue 23). Relative paths
# are read against the current directory, as they always were; `~` is expanded in all of them.
OUTPUT_PATH_FIELDS = frozenset({"output_dir", "output"})  # always local: made absolute
# Those that name a model: a missing one that looks local is refused before torch loads
# (`check_local_path`, run by the CLI's preflight).
MODEL_PATH_FIELDS = frozenset({"model", "policy", "ref_model", "reward_model", "reference"})
INPUT_PATH_FIELDS = MODEL_PATH_FIELDS | frozenset({
    "base", "data", "eval_data", "normalize_data", "prompts", "eval_prompts", "runs", "grid",
    "adapter"})  # absolute when they exist here; else a hub name, kept
FUNCTION_FIELDS = frozenset({"reward_fn", "gold_fn", "env", "tools"})  # file.py:function; module:function kept


def check_local_path(name_or_path: str) -> None:
    """A string that looks like a path (`./x`, `/x`, `~/x`, `a/b/c`) but is missing is a typo,
    not a hub name."""
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not Path(name_or_path).expanduser().exists():
        raise TetherError(f"model path {name_or_path} does not exist; pass a model directory or hub name")


def input_path(value: str) -> str:
    """`~` expanded; absolute when it names a file or directory that exists here. Anything else
    stays as given: a hub name (`gpt2`, `org/name`), which the loaders look up after local paths
    as this does, or a missing path, whose error then names what the user typed."""
    expanded = os.path.expanduser(value)
    return os.path.abspath(expanded) if expanded and os.path.exists(expanded) else expanded


def function_path(spec: str) -> str:
    """`file.py:function` with its file resolved as `input_path` does. `module:function` for a
    one-name module that is a file in the current directory (`task:gold`, ./task.py: the loader
    looks there first) becomes that file's absolute `file.py:function`, so a later command from
    another directory imports the same code, not its own ./task.py. Any other module stays as
    written: it is found on the import path (an installed package), not at a path."""
    file, sep, function = spec.rpartition(":")
    if not sep:
        return spec
    if file.endswith(".py"):
        return input_path(file) + sep + function
    if file.isidentifier() and os.path.isfile(file + ".py"):
        return os.path.abspath(file + ".py") + sep + function
    return spec


def resolved_paths(values: dict[str, Any]) -> dict[str, Any]:
    """`values` (config field -> value) with every path field resolved by the rules above;
    idempotent, so a recorded config resolves to itself."""
    def resolve(name: str, value: Any) -> Any:
        if isinstance(value, list):
            return [resolve(name, v) for v in value]
        if not isinstance(value, str) or not value:  # empty stays empty: the default place
            return value
        if name in OUTPUT_PATH_FIELDS:  # `~` expanded and made absolute
            return os.path.abspath(os.path.expanduser(value))
        if name in INPUT_PATH_FIELDS:
            return input_path(value)
        if name in FUNCTION_FIELDS:  # several joined by commas (--reward-fn a.py:f,b.py:g)
            return ",".join(function_path(spec) for spec in value.split(","))
        return value
    return {name: resolve(name, value) for name, value in values.items()}


def recorded_input_path(value: str, config_path: Path, field: str) -> str:
    """An input path as a run's config.yaml (`config_path`) records it, for a command that reads
    the record (`tether eval`'s default reference). tether writes these absolute (issue 23); a
    relative one is a hand edit or an old run's, and means different things from different
    directories (from the wrong one: another model, and a KL of 0.15 where it is 0). It is read
    against the run directory (the config file's), where it means the same from anywhere; one
    that names a file or directory only from the current directory, or a different one from
    each, is refused, since which one was meant cannot be told. Neither: kept, a hub name."""
    expanded = os.path.expanduser(value)
    if os.path.isabs(expanded):
        return expanded
    beside_run = config_path.parent / expanded
    from_here = Path(os.path.abspath(expanded))
    fix = (f"write the absolute path of the model meant in {config_path}, or pass --reference "
           "PATH")
    if beside_run.exists():
        if from_here.exists() and from_here.resolve() != beside_run.resolve():
            raise TetherError(f"{config_path} records {field} {value!r}, a relative path that names "
                              f"two different things: {beside_run} (from the run directory) and "
                              f"{from_here} (from the current directory); {fix}")
        return os.path.abspath(beside_run)
    if from_here.exists():
        raise TetherError(f"{config_path} records {field} {value!r}, a relative path (tether writes "
                          f"absolute ones): it names {from_here} from the current directory but "
                          "nothing from the run directory, so it depends on where the command "
                          f"runs; {fix}")
    return expanded


def resolved_record(values: dict[str, Any], config_path: Path) -> dict[str, Any]:
    """A run's recorded config (`config_path`'s) with its paths resolved to compare with a
    resumed one: a relative input path that names something from the run directory is that
    (`recorded_input_path`'s reading), any other as `resolved_paths` reads it (an old run's,
    relative to the directory it was made in, as then)."""
    def from_run(name: str, value: Any) -> Any:
        if name not in INPUT_PATH_FIELDS or not isinstance(value, str) or not value:
            return value
        beside_run = config_path.parent / os.path.expanduser(value)
        relative = not os.path.isabs(os.path.expanduser(value))
        return os.path.abspath(beside_run) if relative and beside_run.exists() else value
    return resolved_paths({name: from_run(name, value) for name, value in values.items()})


def resolve_paths(cfg: Any) -> Any:
    """Resolve `cfg`'s path fields in place (`resolved_paths`); returns `cfg`."""
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    for name, value in resolved_paths(values).items():
        if value != values[name]:
            setattr(cfg, name, value)
    return cfg
