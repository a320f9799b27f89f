"""docs/architecture.md stays true: every file it names exists, and every code name it quotes is
defined in the package (a def, a class, a field or a module-level name), so a rename that leaves
the page behind fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tether"
PAGE = ROOT / "docs" / "architecture.md"


def quoted() -> set[str]:
    text = re.sub(r"```.*?```", "", PAGE.read_text(encoding="utf-8"), flags=re.S)
    return set(re.findall(r"`([^`]+)`", text))


def test_every_file_the_page_names_exists():
    files = [q.split(" ")[0] for q in quoted() if re.fullmatch(r"[\w/]+\.(py|md)( \(.*\))?", q)
             or q.endswith("/")]
    assert len(files) > 10
    missing = [f for f in files if not ((SRC / f).exists() or (ROOT / f).exists())]
    assert not missing, missing


def test_every_code_name_the_page_quotes_is_defined():
    names = {q.split(".")[-1] for q in quoted()
             if re.fullmatch(r"[A-Za-z_][\w.]*", q) and not q.endswith(".py")}
    source = "\n".join(p.read_text(encoding="utf-8") for p in SRC.rglob("*.py"))
    defined = set(re.findall(r"\b(?:def|class)\s+(\w+)", source))
    defined |= set(re.findall(r"^\s*(\w+)\s*(?::|=)", source, flags=re.M))  # fields, names
    assert len(names) > 20
    missing = sorted(n for n in names if n not in defined)
    assert not missing, missing
