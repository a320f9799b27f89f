"""Typed stage configs: a YAML file and/or command-line flags, validated into one dataclass.

Every stage config is a dataclass that inherits `RunConfig`; each field has a type, a default and a
docstring, which tyro turns into `--help`. `parse_config` reads `--config file.yaml` first, then lets
flags override it, then checks types, allowed values and the config's own `validate()`. Every
problem becomes a one-line `TetherError` naming the field and what it accepts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import tyro
import yaml

from tether.errors import TetherError

C = TypeVar("C")

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True)
class RunConfig:
    """Fields every stage shares: where outputs go, seeding, checkpointing, device."""

    # ---- run and logging
    run_name: str
    """Name of the run; everything is written to <output_dir>/<run_name>/."""
    output_dir: str = "runs"
    """Directory that holds run directories."""
    seed: int = 0
    """Seed for Python, NumPy and torch (data order, initialisation, sampling)."""
    resume: bool = False
    """Continue from the last checkpoint in the run directory (model, optimizer, scheduler, RNG, data position)."""
    resume_allow_changes: bool = False
    """On --resume, accept changed logging, checkpoint or device settings (recorded in resumes.jsonl); other changes are refused."""
    log_every: int = 10
    """Optimizer steps between metric log lines (metrics.jsonl and TensorBoard)."""
    save_every: int = 100
    """Optimizer steps between checkpoints (0: only the final model)."""
    report_to: str = "tensorboard"
    """Trackers beside metrics.jsonl, comma-separated: tensorboard, wandb, mlflow, or none (wandb and mlflow are extras: pip install 'tether[wandb]')."""
    # ---- model and device
    device: str = "auto"
    """Device: auto (cuda when available, else cpu), cpu, cuda, cuda:N or mps."""
    threads: int = 0
    """CPU threads per operation; 0 (auto): 1 for a model under 10M parameters on the CPU (more are slower there), else torch's default (one per core, or OMP_NUM_THREADS)."""
    trust_remote_code: bool = False
    """Allow model repositories to run their own Python code (off unless you trust the source)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the model weights are loaded in."""

    # ---- memory and scale (docs/scaling.md)
    lora_r: int = 0
    """LoRA rank; 0 trains every weight. With LoRA all roles share one frozen base (docs/scaling.md)."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is (alpha / r) * B A."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input (sft only: rm, dpo and ppo keep dropout off)."""
    lora_target_modules: str = "all-linear"
    """Comma-separated names of the linear layers that get adapters; all-linear: every linear layer of the trunk."""
    merge_lora: bool = False
    """Also write the adapter merged into its base as a plain Hugging Face model (<run>/merged/)."""
    fsdp: bool = False
    """Under torchrun: shard parameters, gradients and optimizer state over the ranks with FSDP2 instead of replicating the model with DDP (docs/scaling.md)."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them (less memory, ~30% more compute)."""
    mixed_precision: Literal["no", "bf16"] = "no"
    """Run forward passes under torch.autocast in bfloat16 (weights and optimizer stay in `dtype`; log-probs, KL and advantages in fp32)."""
    chunked_lm_head: bool = True
    """Compute log-probs, entropy and KL from hidden states through the LM head in chunks, never a [B, R, V] logits tensor (off: the plain path, for comparison)."""

    def validate(self) -> None:
        """Check values that the types alone cannot; raise TetherError naming the field."""
        check_run_name(self.run_name)
        from tether.run.trackers import parse_report_to

        parse_report_to(self.report_to)
        for name in ("log_every",):
            if getattr(self, name) < 1:
                raise TetherError(f"config field '{name}' must be >= 1, got {getattr(self, name)}")
        require_positive(self, "lora_r", "lora_dropout", "threads", allow_zero=True)
        require_positive(self, "lora_alpha")
        if self.lora_dropout >= 1:
            raise TetherError(f"config field 'lora_dropout' must be in [0, 1), got {self.lora_dropout}")
        if not self.lora_r and self.merge_lora:
            raise TetherError("--merge-lora needs a LoRA run; pass --lora-r (e.g. 16) or drop --merge-lora")
        if self.mixed_precision == "bf16" and self.dtype == "float16":
            raise TetherError("--mixed-precision bf16 would recast float16 weights to bfloat16; "
                              "use --dtype float32 (or bfloat16) with it")
        if self.save_every < 0:
            raise TetherError(f"config field 'save_every' must be >= 0, got {self.save_every}")
        check_device(self.device)


def check_run_name(name: str) -> None:
    """A run name is one plain directory name: never a path that could leave `output_dir`."""
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise TetherError(f"config field 'run_name' must be a plain non-empty name (no '/', not "
                          f"'.' or '..'), got {name!r}")


def check_device(device: str) -> None:
    if not (device in ("auto", "cpu", "cuda", "mps")
            or (device.startswith("cuda:") and device[5:].isdigit())):
        raise TetherError(f"config field 'device' must be one of: auto, cpu, cuda, cuda:N, mps "
                          f"(got {device!r})")


def check_stop_strings(stop_strings: Any) -> None:
    """An empty stop string is inside every text, so it would end each response after its first
    token; no stop strings is the empty list (`--stop-strings` omitted, or given no values)."""
    for k, stop in enumerate(stop_strings):
        if stop == "":
            raise TetherError(f"--stop-strings value {k} is the empty string, which every response "
                              "contains, so each would end after one token; drop it (omit "
                              "--stop-strings for none)")


def require_positive(cfg: Any, *names: str, allow_zero: bool = False) -> None:
    """Raise TetherError for the first field in `names` that is not > 0 (or >= 0)."""
    for name in names:
        value = getattr(cfg, name)
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise TetherError(f"config field '{name}' must be {bound}, got {value}")


# ----------------------------------------------------------------------------- dict round trip

def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain JSON/YAML-safe values (tuples become lists), its paths resolved
    (`resolved_paths`): what a run directory records means the same from any directory."""
    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, Path):
            return str(v)
        return v
    return resolved_paths({f.name: plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)})


# ----------------------------------------------------------------------------- paths

# The fields, of any stage or tool config, that name files and directories. They are resolved
# when a config is parsed or recorded, so that a run's config.yaml names the same models and files
# whatever directory `tether eval`, `report` or `--resume` later runs in (issue 23). Relative paths
# are read against the current directory, as they always were; `~` is expanded in all of them.
OUTPUT_PATH_FIELDS = frozenset({"output_dir", "output"})  # always local: made absolute
INPUT_PATH_FIELDS = frozenset({"model", "policy", "ref_model", "reward_model", "reference", "data",
                               "eval_data", "normalize_data", "prompts", "eval_prompts", "runs",
                               "grid"})  # absolute when they exist here; else a hub name, kept
FUNCTION_FIELDS = frozenset({"reward_fn", "gold_fn"})  # file.py:function; module:function kept


def input_path(value: str) -> str:
    """`~` expanded; absolute when it names a file or directory that exists here. Anything else
    stays as given: a hub name (`gpt2`, `org/name`), which the loaders look up after local paths
    as this does, or a missing path, whose error then names what the user typed."""
    expanded = os.path.expanduser(value)
    return os.path.abspath(expanded) if expanded and os.path.exists(expanded) else expanded


def output_path(value: str) -> str:
    """`~` expanded and made absolute (empty stays empty: the field's default place)."""
    return os.path.abspath(os.path.expanduser(value)) if value else value


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
        if not isinstance(value, str) or not value:
            return value
        if name in OUTPUT_PATH_FIELDS:
            return output_path(value)
        if name in INPUT_PATH_FIELDS:
            return input_path(value)
        return function_path(value) if name in FUNCTION_FIELDS else value
    return {name: resolve(name, value) for name, value in values.items()}


def resolve_paths(cfg: Any) -> Any:
    """Resolve `cfg`'s path fields in place (`resolved_paths`); returns `cfg`."""
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    for name, value in resolved_paths(values).items():
        if value != values[name]:
            setattr(cfg, name, value)
    return cfg


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(name: str, tp: Any, value: Any) -> Any:
    """Check `value` against annotation `tp`; return it (ints widen to float). TetherError if not."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            allowed = ", ".join(str(c) for c in choices)
            raise TetherError(f"config field '{name}' must be one of: {allowed} (got {value!r})")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            with contextlib.suppress(TetherError):
                return _coerce(name, arg, value)
        raise TetherError(f"config field '{name}' must be {_type_name(tp)}, got {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise TetherError(f"config field '{name}' must be a list, got {value!r}")
        (item_tp, *_rest) = typing.get_args(tp) or (Any,)
        items = [_coerce(name, item_tp, v) for v in value]
        return tuple(items) if origin is tuple else items
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise TetherError(f"config field '{name}' must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TetherError(f"config field '{name}' must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            value = _float_spelling(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TetherError(f"config field '{name}' must be a number, got {value!r}")
        if not math.isfinite(value):
            raise TetherError(f"config field '{name}' must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise TetherError(f"config field '{name}' must be a string, got {value!r}")
        return value
    return value


def _float_spelling(text: str) -> float | str:
    """A string that spells a finite float as people write it in YAML (`1e-4`, `3E5`, `+2.5`,
    `1_000.0`), as that float; anything else unchanged, for the type error to name."""
    try:
        value = float(text.strip().replace("_", ""))
    except ValueError:
        return text
    return value if math.isfinite(value) else text


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_dict(cls: type, d: dict[str, Any], source: str) -> dict[str, Any]:
    """Reject unknown fields and wrongly typed values; return the coerced values."""
    if not isinstance(d, dict):
        raise TetherError(f"{source} must be a mapping of config fields, got {type(d).__name__}")
    hints = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out = {}
    stage = getattr(cls, "STAGE", None)
    for key, value in d.items():
        if key == "stage" and stage:  # a run's config.yaml records the command that made it
            if value != stage:
                raise TetherError(f"{source} is the config of a tether {value} run (stage: "
                                  f"{value}), not {stage}; pass it to tether {value}, or delete its "
                                  f"'stage:' line to start a {stage} run from its settings")
            continue
        if key not in names:
            raise TetherError(f"unknown config field '{key}' in {source}; allowed fields: {', '.join(names)}")
        out[key] = _coerce(key, hints[key], value)
    return out


def config_from_dict(cls: type[C], d: dict[str, Any]) -> C:
    """Build `cls` from a dict (e.g. a saved config), checking names, types and `validate()`."""
    values = _check_dict(cls, d, f"{cls.__name__} dict")
    missing = [f.name for f in dataclasses.fields(cls)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               and f.name not in values]
    if missing:
        raise TetherError(f"missing required config field '{missing[0]}'")
    cfg = resolve_paths(cls(**values))
    _validate(cfg)
    return cfg


def _validate(cfg: Any) -> None:
    hints = _field_types(type(cfg))
    for f in dataclasses.fields(cfg):  # flags were typed by tyro; re-check choices in one place
        _coerce(f.name, hints[f.name], getattr(cfg, f.name))
    if hasattr(cfg, "validate"):
        cfg.validate()


# ----------------------------------------------------------------------------- command line

def _split_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    path, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise TetherError("--config needs a path to a YAML file")
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML mapping; TetherError when the file is missing, unreadable or not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise TetherError(f"config file {path} not found; pass an existing YAML file to --config")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TetherError(f"config file {path} is not valid UTF-8 YAML ({first})") from None
    return {} if data is None else data


def _check_flags(cls: type, argv: list[str]) -> None:
    """Catch unknown flags and values outside a field's choices ourselves, so the user gets one
    line in the same words as for a YAML file, not a usage box."""
    names = {f.name for f in dataclasses.fields(cls)}
    hints = _field_types(cls)
    for i, arg in enumerate(argv):
        name = arg[2:].split("=", 1)[0].replace("-", "_") if arg.startswith("--") else ""
        if typing.get_origin(hints.get(name)) is not Literal:
            continue
        value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
        if value is not None:
            _coerce(name, hints[name], value)
    for arg in argv:
        if not arg.startswith("--") or arg in ("--help",):
            continue
        flag = arg[2:].split("=", 1)[0].replace("-", "_")
        base = flag[3:] if flag.startswith("no_") else flag
        if flag not in names and base not in names:
            allowed = ", ".join("--" + n.replace("_", "-") for n in sorted(names))
            raise TetherError(f"unknown option {arg.split('=', 1)[0]}; allowed options: {allowed}")


def _check_required(cls: type, values: dict[str, Any], argv: list[str], prog: str) -> None:
    """Name every required field that neither the YAML file nor a flag gives, on one line."""
    given = {arg[2:].split("=", 1)[0].replace("-", "_") for arg in argv if arg.startswith("--")}
    missing = [f.name for f in dataclasses.fields(cls)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               and f.name not in values and f.name not in given]
    if missing:
        flags = ", ".join("--" + name.replace("_", "-") for name in missing)
        raise TetherError(f"missing required option{'s' if len(missing) > 1 else ''}: {flags} "
                          f"(give them as flags or in --config FILE.yaml; see {prog} --help)")


def parse_config(cls: type[C], argv: list[str], prog: str | None = None) -> C:
    """Parse `argv` into `cls`: `--config file.yaml` supplies values, flags win, then validate."""
    yaml_path, rest = _split_config_flag(list(argv))
    rest = _positional_flag(cls, rest)
    if "-h" in rest or "--help" in rest:
        from tether.run.config_help import help_text

        print(help_text(cls, prog or cls.__name__, _description(cls)))
        raise SystemExit(0)
    _check_flags(cls, rest)
    values = _check_dict(cls, load_yaml(yaml_path), yaml_path) if yaml_path else {}
    _check_required(cls, values, rest, prog or cls.__name__)
    default = cls(**{f.name: values.get(f.name, _default_of(f)) for f in dataclasses.fields(cls)})
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            cfg = tyro.cli(cls, args=rest, default=default, prog=prog, description=_description(cls))
    except SystemExit as exc:
        if exc.code in (0, None):
            raise
        raise TetherError(_tyro_message(stderr.getvalue())) from None
    resolve_paths(cfg)
    _validate(cfg)
    return cfg


def _positional_flag(cls: type, argv: list[str]) -> list[str]:
    """A config class may name one field `POSITIONAL`: leading bare arguments are its value
    (`tether sweep grid.yaml` is `--grid grid.yaml`; `tether report A B` is `--runs A B`)."""
    name = getattr(cls, "POSITIONAL", None)
    bare = 0
    while name and bare < len(argv) and not argv[bare].startswith("-"):
        bare += 1
    if not bare:
        return argv
    return ["--" + name.replace("_", "-"), *argv[:bare], *argv[bare:]]


def _description(cls: type) -> str:
    """The docstring's first paragraph (all of it, not its first line), and the --config line."""
    paragraph = (cls.__doc__ or cls.__name__).strip().split("\n\n")[0]
    config = ("--config FILE.yaml  read field values from a YAML file (keys are field names with "
              "underscores); flags given here override it.")
    return "\n".join(textwrap.wrap(" ".join(paragraph.split()), 100)) + "\n\n" + "\n".join(
        textwrap.wrap(config, 100, subsequent_indent=" " * 20))


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return tyro.MISSING  # tyro then requires the flag


def _tyro_message(text: str) -> str:
    """Boil tyro's framed usage error down to its informative lines."""
    keep = []
    for line in text.splitlines():
        line = line.strip(" │╭╮╰╯─|")  # noqa: B005 - a set of frame characters, on purpose
        if line and not line.startswith(("usage:", "For full helptext", "─")):
            keep.append(line)
    msg = " ".join(keep) or "invalid command-line arguments"
    return f"{msg} (see --help)"
