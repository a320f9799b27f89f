"""`tether <stage> --help`: every config field, grouped into the sections its class declares.

A config class marks a section with a comment line `# ---- name` above its fields; each field's
docstring (the string after it) is its help. Fields a subclass redefines keep the section of the
base class that introduced them, unless the subclass puts them under a section of its own. Only
the config modules are imported, so help comes up without loading torch.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from typing import Any, Literal

from tether.run.scopes import field_default, flag

SECTION = re.compile(r"^\s*# ---- ([^(]+?)\s*(\(.*\))?\s*$")
WIDTH = 100


def _class_fields(cls: type) -> list[tuple[str, str | None, str]]:
    """(field, section or None, docstring) for the fields `cls` itself defines, in order."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return []
    # the section of a line: the last `# ---- name` above it (None before the first)
    section_at, section = [], None
    for line in source.splitlines():
        section_at.append(section)
        if match := SECTION.match(line):
            section = match.group(1)
    body = ast.parse(source).body[0].body
    out = []
    for node, after in zip(body, [*body[1:], None]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        doc = str(after.value.value) if is_doc else ""
        out.append((node.target.id, section_at[node.lineno - 1], " ".join(doc.split())))
    return out


def field_sections(cls: type) -> dict[str, list[tuple[str, str]]]:
    """Section -> [(field, help)]: the stage's own sections first (model, data, rollout, KL,
    optimisation), the shared ones (device, memory, run and logging) after them."""
    section_of: dict[str, str] = {}
    help_of: dict[str, str] = {}
    # within a section, the fields of the most derived class first (a stage's own before those
    # of the sections it inherits), each class's in its order: `declared`, the most derived
    # class that declares each field (its rank in the MRO)
    declared: dict[str, int] = {}
    classes = [k for k in cls.__mro__ if dataclasses.is_dataclass(k)]
    for rank, klass in reversed(list(enumerate(classes))):
        for name, section, doc in _class_fields(klass):
            section_of[name] = section or section_of.get(name, "options")
            help_of[name] = doc or help_of.get(name, "")
            declared[name] = rank
    # section order: the sections of the most derived class first
    sections: dict[str, list[tuple[str, str]]] = {
        section: [] for klass in classes for _, section, _ in _class_fields(klass) if section}
    for field in sorted(dataclasses.fields(cls), key=lambda f: declared.get(f.name, 0)):
        sections.setdefault(section_of.get(field.name, "options"), []).append(
            (field.name, help_of.get(field.name, "")))
    return sections


def _flag(name: str, tp: Any) -> str:
    if tp is bool:
        return f"{flag(name)}, --no-{name.replace('_', '-')}"
    if typing.get_origin(tp) is Literal:
        return f"{flag(name)} {{{','.join(str(a) for a in typing.get_args(tp))}}}"
    return f"{flag(name)} {getattr(tp, '__name__', 'VALUE').upper()}"


# List fields whose items never hold a comma (`file.py:function`), so commas may join them too.
COMMA_LISTS = frozenset({"tools", "reward_weights", "points"})


def _list_note(name: str, tp: Any) -> str:
    """How a list flag takes its values: several after one flag, each value one item."""
    if typing.get_origin(tp) not in (list, tuple):
        return ""
    if name in COMMA_LISTS:
        return f" Several values follow one flag ({flag(name)} A B) or join with commas (A,B)."
    return f" Several values follow one flag ({flag(name)} A B), not comma-separated."


def help_text(cls: type, prog: str, description: str) -> str:
    """The whole help page of config `cls`. A config whose class names a `POSITIONAL` field
    takes that field's value as its first, bare argument too (`tether sweep grid.yaml`)."""
    hints = typing.get_type_hints(cls)
    fields_by_name = {f.name: f for f in dataclasses.fields(cls)}
    positional = getattr(cls, "POSITIONAL", None)
    first = ""
    if positional:
        many = typing.get_origin(hints[positional]) in (list, tuple)
        first = f" {positional.upper()}" + (" ..." if many else "")
    out = [f"usage: {prog}{first} [--config FILE.yaml] [--field value ...]", "", description, "",
           "  -h, --help  show this help and exit"]
    for section, fields in field_sections(cls).items():
        out += ["", f"{section}:"]
        for name, doc in fields:
            # `required` for a field without a default (a default factory's value is a default,
            # e.g. `[]`: such a field is never required); a required field shows no default
            default = field_default(fields_by_name[name])
            shown = "required" if default is dataclasses.MISSING else f"default: {default!r}"
            if name == positional:
                shown += "; or give it as the first argument(s), before any flag"
            also = [k for k, v in getattr(cls, "FLAG_NAMES", {}).items() if v == flag(name)]
            out.append("  " + _flag(name, hints[name]) + "".join(f", or {a}" for a in also))
            out += textwrap.wrap(f"{doc}{_list_note(name, hints[name])} ({shown})", WIDTH,
                                 initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(out)
