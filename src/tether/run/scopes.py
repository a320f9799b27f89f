"""Where an option acts: the one mechanism that refuses an option the user gave where the run's
other settings leave it without effect (GRPO's --scale-rewards under --advantage rloo, a critic's
--vf-coef without a critic, vLLM's --engine-kv-cache-mb with the native engine, --max-turns
without an environment). Accepted, it would be recorded in config.yaml and ignored: the run
directory would describe a run that did not happen.

    SCOPES       a config class's ClassVar: field -> `Scope`, merged over its bases (a section
                 such as `EnvOptions` declares its own)
    from_table   the scopes a table of `tether.choices` implies: each entry's `options` act
                 only when the config names that entry
    given        the one rule for what the user gave
    inert        field -> the one line, for the given fields a config's settings leave inert

What the user gave: every option named on the command line or as a key of a hand-written
--config file (even at its default: naming it is a choice), and every field whose value differs
from its default (so a recorded config.yaml, which names every field, counts its changed values
only). A sweep grid's block is checked as a whole by its planner (tether.tools.sweep_plan): a
grid crosses its axes, so an option inert in some of its runs is a plan, and one inert in all of
them is refused with the same line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tether.errors import TetherError


@dataclass(frozen=True)
class Scope:
    """Where an option acts: `acts(cfg)`; elsewhere it would be accepted, recorded and ignored."""

    needs: str  # the setting it acts under, as the user would pass it
    acts: Callable[[Any], bool]
    instead: Callable[[Any], str]  # what this config runs with instead
    fix: str  # besides dropping it


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def from_table(field: str, table: dict, fix: Callable[[str], str] | None = None
               ) -> dict[str, Scope]:
    """The scopes of the options the entries of `table` (a `tether.choices` table, chosen by the
    config field `field`) hold as their own: option -> acts when `field` names an entry that holds
    it. `fix(name)`: the advice for an entry (default: pass --field name)."""
    holders: dict[str, list[str]] = {}
    for name, choice in table.items():
        for option in choice.options:
            holders.setdefault(option, []).append(name)
    fix = fix or (lambda name: f"pass {flag(field)} {name}")
    return {option: Scope(f"{flag(field)} {' or '.join(names)}",
                          lambda c, names=tuple(names): getattr(c, field) in names,
                          lambda c: f"{flag(field)} {getattr(c, field)}", fix(names[0]))
            for option, names in holders.items()}


def scopes_of(cls: type) -> dict[str, Scope]:
    """`cls`'s SCOPES merged over its bases, the most derived last (it may override)."""
    out: dict[str, Scope] = {}
    for klass in reversed(cls.__mro__):
        out |= vars(klass).get("SCOPES", {})
    return out


def field_default(f: dataclasses.Field) -> Any:
    """A config field's default (a default factory's value, made anew), or dataclasses.MISSING
    for a required field."""
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


def given(cfg: Any, named: Iterable[str] = ()) -> set[str]:
    """The fields the user gave (module docstring): `named` (flags, a hand-written --config
    file's keys) and every field whose value differs from its default."""
    changed = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != field_default(f)}
    return changed | set(named)


def inert(cfg: Any, fields: set[str]) -> dict[str, str]:
    """The fields of `fields` that `cfg`'s settings leave without effect, each with its line."""
    command = getattr(cfg, "STAGE", None) or getattr(cfg, "COMMAND", "")
    return {name: f"{flag(name)} applies with {scope.needs}, and tether {command} runs with "
                  f"{scope.instead(cfg)}, where it has no effect; drop it, or {scope.fix}"
            for name, scope in scopes_of(type(cfg)).items()
            if name in fields and not scope.acts(cfg)}


def check_given(cfg: Any, fields: set[str]) -> None:
    """The first of `inert(cfg, fields)`, refused."""
    for line in inert(cfg, fields).values():
        raise TetherError(line)
