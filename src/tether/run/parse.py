"""Reading a stage's config: a YAML file and/or command-line flags, validated into its dataclass
(`tether.run.config`).

`parse_config` reads `--config file.yaml` first, then lets flags override it, then checks types,
allowed values and the config's own `validate()`. Every problem becomes a one-line `TetherError`
naming the field and what it accepts. `config_from_dict` does the same for a dict (a sweep grid's
block, a recorded config.yaml).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from tether.errors import TetherError
from tether.run import scopes, trl_names
from tether.run.config import C
from tether.run.config_help import COMMA_LISTS, help_text
from tether.run.paths import resolve_paths
from tether.run.scopes import field_default, flag


def _coerce(name: str, tp: Any, value: Any) -> Any:
    """Check `value` against annotation `tp`; return it (ints widen to float). TetherError if not.
    `tp` is a type a config field has: bool, int, float, str, a Literal, or a list of one of them
    (tests/run/test_config.py holds every stage's fields to these)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            allowed = ", ".join(str(c) for c in choices)
            raise TetherError(f"config field '{name}' must be one of: {allowed} (got {value!r})")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise TetherError(f"config field '{name}' must be a list, got {value!r}")
        return [_coerce(name, typing.get_args(tp)[0], v) for v in value]
    if tp is float and isinstance(value, str):
        value = _float_spelling(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
    accepted, said = _PLAIN[tp]
    if not isinstance(value, accepted) or (isinstance(value, bool) and tp is not bool):
        raise TetherError(f"config field '{name}' must be {said}, got {value!r}")
    if tp is int and abs(value) > MAX_INT:  # e.g. 2**63: an overflow deep in torch or the seeds
        raise TetherError(f"config field '{name}' must be an integer within +-{MAX_INT} "
                          f"(2**40 - 1), got {value}")
    if tp is float and not abs(value) <= sys.float_info.max:  # an int of 400 digits too
        raise TetherError(f"config field '{name}' must be a finite number, got {value!r}")
    return float(value) if tp is float else value


# More than any count or size a run can reach, and a run's seeds derived from its seed
# (seed x 1,000,033 + row) stay within torch's 64 bits.
MAX_INT = 2**40 - 1
# The plain types: what each accepts (ints widen to float; a bool is no number) and its name.
_PLAIN = {bool: ((bool,), "true or false"), int: ((int,), "an integer"),
          float: ((int, float), "a number"), str: ((str,), "a string")}


def _float_spelling(text: str) -> float | str:
    """A string that spells a finite float as people write it in YAML (`1e-4`, `3E5`, `+2.5`,
    `1_000.0`), as that float; anything else unchanged, for the type error to name."""
    try:
        value = float(text.strip().replace("_", ""))
    except ValueError:
        return text
    return value if math.isfinite(value) else text


def _check_dict(cls: type, d: dict[str, Any], source: str, prog: str | None = None) -> dict[str, Any]:
    """Reject unknown fields and wrongly typed values; return the coerced values."""
    if not isinstance(d, dict):
        raise TetherError(f"{source} must be a mapping of config fields, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
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
        if key not in names:  # every unknown key of the file at once, not one per try
            raise TetherError(joined([unknown_key(cls, k, v, source, prog) for k, v in d.items()
                                      if k not in names and not (k == "stage" and stage)]))
        out[key] = _coerce(key, hints[key], value)
    return out


def config_from_dict(cls: type[C], d: dict[str, Any]) -> C:
    """Build `cls` from a dict (e.g. a saved config), checking names, types and `validate()`."""
    values = _check_dict(cls, d, f"{cls.__name__} dict")
    missing = [f.name for f in dataclasses.fields(cls)
               if field_default(f) is dataclasses.MISSING and f.name not in values]
    if missing:
        raise TetherError(f"missing required config field '{missing[0]}'")
    cfg = resolve_paths(cls(**values))
    _validate(cfg)
    return cfg


def _validate(cfg: Any, named: set[str] | None = None) -> None:
    """Types and choices, the config's `validate()`, then, for a config the user wrote (`named`
    given: flags and a --config file), the option scopes of the fields they gave
    (`tether.run.scopes`). A dict (a sweep grid's run) skips them: a grid crosses its axes, so
    `kl_target` beside `kl_ctl: [fixed, adaptive]` is inert in half its runs by design; the grid
    checks its block as a whole (sweep_plan)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):  # every field, its default too, checked in one place
        _coerce(f.name, hints[f.name], getattr(cfg, f.name))
    if hasattr(cfg, "validate"):
        cfg.validate()
    if named is not None:
        scopes.check_given(cfg, scopes.given(cfg, named))


# ----------------------------------------------------------------------------- unknown names

def unknown_flag(cls: type, flag: str, value: Any, prog: str | None = None) -> str:
    """The one line for a flag `cls` has no field for (`flag` as typed, `--num_generations`)."""
    name = flag.removeprefix("--").replace("-", "_")
    return _unknown(cls, name, value, prog, shown=(flag, f"{flag} {value}"), as_key=False)


def unknown_key(cls: type, key: str, value: Any, source: str, prog: str | None = None) -> str:
    """The one line for a YAML key `cls` has no field for; `source` says where the key stands."""
    shown = (f"config field '{key}' in {source}", f"config field '{key}: {value}' in {source}")
    return _unknown(cls, str(key), value, prog, shown=shown, as_key=True)


def joined(lines: list[str]) -> str:
    """Several unknown names as one line, each with its own hint (a command line copied from TRL
    holds several of its names: one round trip for all of them), the docs cited once."""
    lines = list(dict.fromkeys(lines))
    if len(lines) == 1:
        return lines[0]
    cite = f" ({trl_names.DOC})"
    cited = any(line.endswith(cite) for line in lines)
    return (f"{len(lines)} names tether does not know: "
            + " | ".join(line.removesuffix(cite) for line in lines) + (cite if cited else ""))


def _unknown_flags(argv: list[str], fields: set[str], hints: dict) -> list[tuple[str, Any]]:
    """Every flag of `argv` that names no field, as typed, with the value after it (or None)."""
    found = []
    for i, token in enumerate(argv):
        flag, eq, attached = token.partition("=")
        name = flag[2:].replace("-", "_")
        negated = name.startswith("no_") and hints.get(name[3:]) is bool
        if flag.startswith("--") and name not in fields and not negated:
            after = argv[i + 1] if i + 1 < len(argv) else "--"
            found.append((flag, attached if eq else (None if after.startswith("--") else after)))
    return found


def _unknown(cls: type, name: str, value: Any, prog: str | None, shown: tuple[str, str],
             as_key: bool) -> str:
    """TRL's name -> tether's option (`trl_names`), else the field it is a near miss of, else
    where the list is: never the whole list, which is a wall of ~90 names (`--help` has it)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    stage = getattr(cls, "STAGE", None)
    prog = prog or (f"tether {stage}" if stage else cls.__name__)
    if trl := trl_names.hint(name, value, fields, stage, prog, shown, as_key):
        return trl
    if close := difflib.get_close_matches(name, sorted(fields), n=1, cutoff=0.75):
        meant = f"'{close[0]}'" if as_key else flag(close[0])
        return f"unknown {'' if as_key else 'option '}{shown[0]}; did you mean {meant}?"
    return f"unknown {'' if as_key else 'option '}{shown[0]}; see {prog} --help"


# ----------------------------------------------------------------------------- command line

def _split_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    path, rest, args = None, [], iter(argv)
    for arg in args:
        if arg == "--config":
            # the next argument, whatever it looks like
            if (path := next(args, None)) is None:
                raise TetherError("--config needs a path to a YAML file")
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return path, rest


class _KeyTwice(Exception):
    """A key written twice in one mapping: its args are (key, first line, second line)."""


def _map_of_unique_keys(loader: yaml.SafeLoader, node: yaml.MappingNode):
    """SafeLoader's mapping, refusing a key written twice in one mapping: PyYAML keeps the last
    value without a word, so `lr: 1e-4` high in a file is overridden by a forgotten `lr: 1` below.
    A merge (`<<: *defaults`) may be overridden by the keys beside it, as YAML means."""
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        with contextlib.suppress(TypeError):  # an unhashable key: the mapping's own error
            if key in seen:
                raise _KeyTwice(key, seen[key], line)
            seen[key] = line
    yield from yaml.SafeLoader.construct_yaml_map(loader, node)


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader with `_map_of_unique_keys` for every mapping."""


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _map_of_unique_keys)


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML mapping; TetherError when the file is missing, a directory, unreadable, or
    gives a key twice."""
    p = Path(path)
    if p.is_dir():
        inside = p / "config.yaml"  # a run directory: its settings are its config.yaml
        raise TetherError(f"config file {path} is a directory, not a YAML file; name the file"
                          + (f", e.g. {inside}" if inside.is_file() else ""))
    if not p.is_file():
        raise TetherError(f"config file {path} not found; pass an existing YAML file to --config")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except _KeyTwice as twice:
        key, first, second = twice.args
        raise TetherError(f"config file {path} gives {key!r} twice (lines {first} and "
                          f"{second}); YAML would keep the second silently: keep one") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TetherError(f"config file {path} is not valid UTF-8 YAML ({first})") from None
    return {} if data is None else data


def _check_required(cls: type, values: dict[str, Any], prog: str) -> None:
    """Name every required field that neither the YAML file nor a flag gives, on one line."""
    missing = [f.name for f in dataclasses.fields(cls)
               if field_default(f) is dataclasses.MISSING and f.name not in values]
    if missing:
        flags = ", ".join(flag(name) for name in missing)
        raise TetherError(f"missing required option{'s' if len(missing) > 1 else ''}: {flags} "
                          f"(give them as flags or in --config FILE.yaml; see {prog} --help)")


def parse_config(cls: type[C], argv: list[str], prog: str | None = None) -> C:
    """Parse `argv` into `cls`: `--config file.yaml` supplies values, flags win, then validate."""
    yaml_path, rest = _split_config_flag(list(argv))
    rest = _named_flags(cls, _positional_flag(cls, rest))
    if "-h" in rest or "--help" in rest:
        print(help_text(cls, prog or cls.__name__, _description(cls)))
        raise SystemExit(0)
    flags = _read_flags(cls, rest, prog)
    raw = load_yaml(yaml_path) if yaml_path else {}
    values = _check_dict(cls, raw, yaml_path, prog) if yaml_path else {}
    _check_required(cls, values | flags, prog or cls.__name__)
    cfg = resolve_paths(cls(**(values | flags)))
    _validate(cfg, set(flags) | (set() if _recorded(cls, raw) else set(values)))
    return cfg


def _read_flags(cls: type, argv: list[str], prog: str | None) -> dict[str, Any]:
    """The fields the flags give, typed (`_coerce`): `--name value` or `--name=value`; a list's
    values after one flag (`--stop-strings A B`, none: the empty list; a list of numbers in
    `COMMA_LISTS` may join them with commas, `--reward-weights 1,0.5`); a bool's `--name` and
    `--no-name`. The last of a repeated flag wins. An unknown flag is `unknown_flag`'s one line,
    in the same words as for a YAML key."""
    fields = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        flag, eq, attached = argv[i].partition("=")
        name = flag[2:].replace("-", "_")
        negated = name not in fields and name[3:] in fields and name.startswith("no_")
        if not flag.startswith("--"):  # a value no flag takes, or a short flag
            raise TetherError(f"unexpected argument {argv[i]!r}: a value goes after its flag "
                              "(see --help)")
        if name not in fields and not (negated and hints[name[3:]] is bool):
            raise TetherError(joined([unknown_flag(cls, *unknown, prog)
                                      for unknown in _unknown_flags(argv, fields, hints)]))
        i += 1
        field = name[3:] if negated else name
        if hints[field] is bool:
            if eq:
                on = "--" + field.replace("_", "-")
                raise TetherError(f"{flag} takes no value (got {argv[i - 1]!r}): {on} sets it, "
                                  f"--no-{on[2:]} clears it")
            out[field] = not negated
            continue
        many = typing.get_origin(hints[name]) is list
        texts = [attached] if eq else []
        while i < len(argv) and (many or not texts) and _is_value(argv[i]):
            texts.append(argv[i])
            i += 1
        if not texts and not many:
            raise TetherError(f"{flag} needs a value (see --help)")
        item = typing.get_args(hints[name])[0] if many else hints[name]
        if many and name in COMMA_LISTS and item is not str:  # --reward-weights 1,0.5
            texts = [part for text in texts for part in text.split(",") if part]
        typed = [_typed(item, text) for text in texts]
        out[name] = _coerce(name, hints[name], typed if many else typed[0])
    return out


def _is_value(token: str) -> bool:
    """Whether a token after a flag is a value, not the next flag: anything that does not start
    with `-`, and, of those that do, `-` alone and numbers (`-1`, `-.5`, `-1e9`, `-inf`, `-nan`);
    any other `-x` is taken for a mistyped flag, not swallowed as a value."""
    key = token.partition("=")[0]
    return not key.startswith("-") or not key.startswith("--") and (
        not key[1:2].isalpha() or key[1:].lower() in ("inf", "infinity", "nan"))


def _typed(tp: Any, text: str) -> Any:
    """A flag's text as a value of `tp`, as Python reads one (`int('1_000')`, `float('1e-4')`);
    text that does not read as one stays text, for `_coerce` to refuse by the field's name."""
    with contextlib.suppress(ValueError):
        return int(text) if tp is int else float(text) if tp is float else text
    return text


def _recorded(cls: type, raw: dict[str, Any]) -> bool:
    """Whether a --config file is a run's recorded config.yaml (a `stage:` line, or every field:
    one whose `stage:` line was deleted to start another stage from it). It names every field,
    chosen or not, so only its changed values count as given; a hand-written file's keys all do."""
    return "stage" in raw or {f.name for f in dataclasses.fields(cls)} <= set(raw)


def _positional_flag(cls: type, argv: list[str]) -> list[str]:
    """A config class may name one field `POSITIONAL`: leading bare arguments are its value
    (`tether sweep grid.yaml` is `--grid grid.yaml`; `tether report A B` is `--runs A B`)."""
    name = getattr(cls, "POSITIONAL", None)
    return [flag(name), *argv] if name and argv and not argv[0].startswith("-") else argv


def _named_flags(cls: type, argv: list[str]) -> list[str]:
    """A config class may spell a field's flag in its command's words, `FLAG_NAMES = {"--student":
    "--policy"}` (`tether distill --student S`): each such flag read as the field's own."""
    names = getattr(cls, "FLAG_NAMES", {})
    return [names.get(a.partition("=")[0], a.partition("=")[0]) + "".join(a.partition("=")[1:])
            for a in argv]


def _description(cls: type) -> str:
    """The docstring's first paragraph (all of it, not its first line), and the --config line."""
    paragraph = (cls.__doc__ or cls.__name__).strip().split("\n\n")[0]
    config = ("--config FILE.yaml  read field values from a YAML file (keys are field names with "
              "underscores); flags given here override it.")
    return "\n".join(textwrap.wrap(" ".join(paragraph.split()), 100)) + "\n\n" + "\n".join(
        textwrap.wrap(config, 100, subsequent_indent=" " * 20))
