"""The package's size and shape, in the figures the reshaping issues quote: source lines, files over
400 lines, functions over 60 lines, and the branches of train/ on whether an engine is there.

    python tests/audit/shape.py                       # this tree's src/
    python tests/audit/shape.py --src /other/tree/src

A function's length runs from its `def` (decorators left out) to its last line, docstring
included, as an editor shows it; nested functions count inside their parent and on their own.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

FILE_LIMIT, FUNCTION_LIMIT = 400, 60
# `setup.engine is not None`, `if engine is None`, `cfg.engine == "vllm"`, `engine != "native"`
ENGINE_BRANCH = re.compile(r"engine\s+is\s+(not\s+)?None|\.engine\s*[!=]=|engine\s*[!=]=\s*\"")


def long_functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > FUNCTION_LIMIT:
                out.append((node.name, length))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[2] / "src"))
    args = parser.parse_args()
    package = Path(args.src).resolve() / "tether"
    files = sorted(package.rglob("*.py"))
    lines = {f.relative_to(package): len(f.read_text(encoding="utf-8").splitlines())
             for f in files}
    print(f"src lines: {sum(lines.values())} in {len(files)} files")
    big = sorted(((n, str(f)) for f, n in lines.items() if n > FILE_LIMIT), reverse=True)
    print(f"files over {FILE_LIMIT} lines: {len(big)}: "
          + ", ".join(f"{name} {n}" for n, name in big))
    functions = [(f"{f.relative_to(package)}:{name}", n) for f in files
                 for name, n in long_functions(f)]
    print(f"functions over {FUNCTION_LIMIT} lines: {len(functions)}: "
          + ", ".join(f"{name} {n}" for name, n in sorted(functions, key=lambda x: -x[1])))
    branches = [f"{f.relative_to(package)}:{i}" for f in sorted((package / "train").glob("*.py"))
                for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
                if ENGINE_BRANCH.search(line.split("#")[0])]
    print(f"engine-presence branches in train/: {len(branches)}: {', '.join(branches)}")


if __name__ == "__main__":
    main()
