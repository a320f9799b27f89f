"""The package's shape (docs/design.md, "Layers"): every module imports alone, no import cycle (imports
inside functions included), imports point down the layers, the root holds the public maths and
the entry points only, no function in src runs past 80 lines, and every declared dependency is
imported somewhere.

The import graph is read from the source text (every `import` statement, wherever it stands), so
it sees imports a run never executes; the import test runs each module in a process of its own.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import sys
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tether"

# Lower layers first; a module may import its own layer (without a cycle) and the ones below it.
LAYERS = [
    # the public maths and its tables
    {"tether.errors", "tether.choices", "tether.kl", "tether.logprobs", "tether.advantages",
     "tether.losses", "tether.preference", "tether.lm_head"},
    {"tether.run"},  # configs, run directories, checkpoints, processes: no data format
    {"tether.data"},
    {"tether.models"},
    {"tether.rl"},
    {"tether.train"},
    {"tether.tools"},
    {"tether.demo"},
    {"tether.cli", "tether.__main__"},
]
ROOT_MODULES = {"__init__", "__main__", "cli", "errors", "choices", "kl", "logprobs",
                "advantages", "losses", "preference", "lm_head"}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def layer_of(name: str) -> int:
    for rank, members in enumerate(LAYERS):
        if any(name == m or name.startswith(m + ".") for m in members):
            return rank
    # the package (and what it runs on import) sits below every layer
    return -1 if name == "tether" else len(LAYERS)


def imported(path: Path) -> set[str]:
    """The tether modules `path` imports anywhere in its text (a `from tether.x import y` counts
    as tether.x.y when that is a module, else tether.x)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name.startswith("tether")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tether"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in MODULES else node.module)
    return {name for name in out if name in MODULES and name != "tether"}


GRAPH = {name: imported(path) for name, path in MODULES.items()}


def test_no_import_cycle_anywhere():
    """Depth-first search of the import graph: a module reached again while on the stack is a
    cycle, reported with its whole path."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = "open"
        stack.append(name)
        for child in sorted(GRAPH[name]):
            if state.get(child) == "open":
                cycle = stack[stack.index(child):] + [child]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if child not in state:
                visit(child)
        stack.pop()
        state[name] = "done"
    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


def test_imports_point_down_the_layers():
    upward = [f"{name} imports {child}" for name, children in sorted(GRAPH.items())
              for child in sorted(children) if layer_of(child) > layer_of(name)]
    assert not upward, upward
    assert all(layer_of(name) < len(LAYERS) for name in MODULES), "a module outside every layer"


def test_the_root_holds_the_public_maths_and_the_entry_points_only():
    root = {p.stem for p in SRC.glob("*.py")}
    assert root == ROOT_MODULES and len(root) <= 12
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    assert packages == {"data", "models", "run", "rl", "train", "tools", "demo"}


def test_no_function_in_src_runs_past_80_lines():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - start + 1 > 80:
                    long.append(f"{name}.{node.name}: {node.end_lineno - start + 1} lines")
    assert not long, long


# A distribution whose import name differs from its own (pyyaml). (tensorboard, used through
# torch.utils.tensorboard, is an extra now: tether.run.extras.)
IMPORT_NAMES = {"pyyaml": "yaml"}


def test_every_declared_dependency_is_imported():
    # [project] dependencies, read as text (tomllib is Python 3.11+; tether supports 3.10)
    toml = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^dependencies = \[(.*?)^\]", toml, re.M | re.S).group(1)
    requirements = re.findall(r'^\s*"([^"]+)"', block, re.M)
    assert len(requirements) > 5  # the block was found and read
    text = "\n".join(path.read_text(encoding="utf-8") for path in MODULES.values())
    unused = []
    for requirement in requirements:
        distribution = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]
        name = IMPORT_NAMES.get(distribution.lower(), distribution)
        if not re.search(rf"^\s*(from|import) {re.escape(name)}\b", text, re.M):
            unused.append(distribution)
    assert not unused, f"declared but never imported: {unused}"


def _import_alone(name: str) -> str:
    """Import `name` in a child process forked from this one before any tether module was
    imported here; '' or the child's traceback."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the import, then out without running the parent's cleanup
        os.close(read)
        try:
            importlib.import_module(name)
            code = 0
        except BaseException:  # noqa: BLE001 - any failure is the answer
            os.write(write, traceback.format_exc().encode())
            code = 1
        os.close(write)
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    return message or ("" if os.waitstatus_to_exitcode(status) == 0 else f"exit {status}")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_every_module_imports_alone():
    """Each module in a process of its own where no tether module was imported before it (the
    libraries they use are, to keep the test fast): an import-order bug such as a circular
    import shows up here, whichever module the rest of the suite imported first."""
    loaded = [m for m in sys.modules if m == "tether" or m.startswith("tether.")]
    saved = {m: sys.modules.pop(m) for m in loaded}
    try:
        failures = {name: error for name in sorted(MODULES) if name != "tether.__main__"
                    if (error := _import_alone(name))}
    finally:
        sys.modules.update(saved)
    assert not failures, "\n".join(f"{name}:\n{error}" for name, error in failures.items())


def test_help_imports_no_torch():
    """`tether <stage> --help` reads only the config modules: they stay free of torch."""
    import subprocess

    configs = ["tether.cli", "tether.run.config", "tether.train.ppo_config",
               "tether.train.offline_config", "tether.tools.config", "tether.demo.config"]
    code = (f"import sys; import {', '.join(configs)}; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
