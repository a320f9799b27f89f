"""Every program in bench/, examples/ and tests/ imports tether before transformers, TRL, vLLM,
peft, datasets or accelerate, or a module of its own folder that imports them.

Why: in a venv with the vllm extra on a CPU machine, vLLM's CPU build pulls torchvision built for
CUDA torch. `import tether` marks it absent (tether.hide_mismatched_extensions) before transformers looks for it;
transformers decides once, when it is first imported, whether torchvision is there, so when it
comes first it counts on a torchvision that tether then hides, and its image utilities (which
vLLM imports) fail with "No module named 'torchvision.io'; 'torchvision' is not a package".
bench/engine.py did that (docs/benchmarks.md's vLLM figure could not be reproduced by its own
command). Imports inside functions run after every module-level one, so an `import tether` at
module level, before the first module-level import of those, holds for the whole program.

The check reads the source (nothing is imported): a program "needs tether first" when it, or a
module of its own folder that it imports (bench/peers/grpo.py imports ppo.py, ...), imports one
of those packages anywhere, at module level or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# transformers and what imports it (trl, vllm, peft), or decides at import which extensions it
# has (datasets, accelerate)
NEEDS_TETHER_FIRST = {"transformers", "trl", "vllm", "peft", "datasets", "accelerate"}
# The folders whose modules import each other by bare name (sys.path entries): bench/ (its
# scripts put their subfolders on the path), each example, and the tests' helpers.
GROUPS = {"bench": sorted((ROOT / "bench").rglob("*.py")),
          **{f"examples/{d.name}": sorted(d.glob("*.py"))
             for d in sorted((ROOT / "examples").iterdir()) if d.is_dir()},
          "tests": sorted((ROOT / "tests").glob("*.py")),
          "tests/audit": sorted((ROOT / "tests" / "audit").glob("*.py"))}
# Every bench and example file, and the tests' own programs (run as scripts, e.g. under torchrun;
# under pytest, tests/conftest.py imports tether before any test module).
PROGRAMS = [path for name, paths in GROUPS.items() for path in paths
            if not name.startswith("tests") or '__name__ == "__main__"' in path.read_text()]


def imported_names(node: ast.AST) -> list[str]:
    """The modules an import statement names (`from . import x` names none: not used here)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    return []


def module_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every import that runs when the file runs: outside functions and
    classes, inside `if`/`try` blocks included."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        found += [(node.lineno, name) for name in imported_names(node)]
        todo += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
    return sorted(found)


def top(name: str) -> str:
    return name.split(".")[0]


def local_module(name: str, group: list[Path]) -> Path | None:
    """The file of `group` that `import name` finds (bench/ scripts put their folders on the
    path and import siblings by bare name: `from ppo import build_workload`)."""
    matches = [path for path in group if path.stem == name]
    return matches[0] if len(matches) == 1 else None


def group_of(path: Path) -> list[Path]:
    return next(paths for paths in GROUPS.values() if path in paths)


def needs_tether_first(path: Path, seen: frozenset[Path] = frozenset()) -> bool:
    """Whether `path`, or a local module it imports, imports one of NEEDS_TETHER_FIRST."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        for name in imported_names(node):
            if top(name) in NEEDS_TETHER_FIRST:
                return True
            local = local_module(name, group_of(path))
            if local is not None and local not in seen and needs_tether_first(local, seen | {path}):
                return True
    return False


def first_import_needing_tether(path: Path) -> tuple[int, str] | None:
    for line, name in module_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
        local = local_module(name, group_of(path))
        if top(name) in NEEDS_TETHER_FIRST or (local is not None and needs_tether_first(local)):
            return line, name
    return None


def problem(path: Path) -> str | None:
    """Why `path` breaks the rule, or None."""
    if not needs_tether_first(path):
        return None
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    tether_lines = [line for line, name in module_level_imports(
        ast.parse(path.read_text(encoding="utf-8"))) if top(name) == "tether"]
    if not tether_lines:
        return (f"{shown} imports transformers (or TRL, vLLM, ...) but not tether at module "
                "level: add `import tether` at the top, before them (see this test's docstring)")
    first = first_import_needing_tether(path)
    if first is not None and first[0] < tether_lines[0]:
        return (f"{shown}:{first[0]} imports {first[1]} before tether (line {tether_lines[0]}): "
                "import tether first (see this test's docstring)")
    return None


@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: str(p.relative_to(ROOT)))
def test_tether_is_imported_before_transformers(path):
    assert problem(path) is None, problem(path)


def test_the_check_sees_what_it_must(tmp_path, monkeypatch):
    """The rule on made-up programs: transformers inside a function, or through a sibling
    module imported before tether, fails; tether first, or none of those packages, passes."""
    cases = {"helper.py": "def f():\n    from transformers import AutoModel\n",  # no tether
             "late.py": "from helper import f\nimport tether\n",  # the sibling comes first
             "inner.py": "import torch\n\ndef main():\n    import trl\n",  # no tether at all
             "first.py": "import torch\nimport tether  # why\nfrom helper import f\n",
             "guarded.py": "import tether\ntry:\n    import vllm\nexcept ImportError:\n    pass\n",
             "plain.py": "import json\nfrom helper2 import g\n"}  # none of them: nothing to check
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setitem(GROUPS, "made-up", sorted(tmp_path.glob("*.py")))
    verdicts = {name: problem(tmp_path / name) for name in cases}
    assert {name: v is None for name, v in verdicts.items()} == {
        "helper.py": False, "late.py": False, "inner.py": False, "first.py": True,
        "guarded.py": True, "plain.py": True}
    assert verdicts["late.py"].startswith("late.py:1 imports helper before tether (line 2)")
    assert verdicts["inner.py"].startswith("inner.py imports transformers (or TRL")
