"""The bad-input tests' shared check: exit 2, one `error:` line on stderr, no traceback, and no
file or directory created or changed, as every bad input must fail (docs/errors.md)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from tether.cli import main


def snapshot(root: Path) -> dict[str, str]:
    """Every file's sha256 and every directory ("dir") under `root`, by relative path: a refused
    call may create neither."""
    root = Path(root)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file()
            else "dir" for p in sorted(root.rglob("*"))}


def refused(root: Path, argv: list[str], pattern: str, capsys) -> str:
    """Run `tether.cli.main(argv)` and assert exit 2, exactly one non-empty stderr line, starting
    `error: ` and matching `pattern` (re.search), no traceback, and `snapshot(root)` unchanged.
    Returns that line, for callers that assert more on it."""
    before = snapshot(root)
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err, err
    assert re.search(pattern, lines[0]), lines[0]
    after = snapshot(root)
    # pytest rewrites the asserts of test files only: name what changed here
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert after == before, f"created, changed or removed under {root}: {changed}"
    return lines[0]
