"""Running a bench script as docs/ run it, for the smoke tests of tests/bench/: tiny settings,
from the repository root, either through its `__main__` in the test's process (`run_main`: a
process of its own would add only an interpreter's start-up; the processes the script starts
itself are real ones), or in a fresh process (`run`: shell scripts, torchrun, and the vLLM venv,
where what the process imports first is what is tested). Each smoke test file declares the
scripts it covers in its `SMOKES` table, which test_bench_cited.py reads."""

from __future__ import annotations

import logging
import math
import os
import re
import runpy
import subprocess
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# bench/scale/memory.py's smallest workload: a 1-layer GPT-2 of width 32, 8 + 8 tokens, 2 rows
MEMORY_TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--vocab", "300", "--seq-len",
               "16", "--batch-size", "2", "--minibatch-size", "2", "--threads", "1"]
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?|nan|inf", re.IGNORECASE)


def run(*command: str, timeout: float = 300, env: dict | None = None) -> str:
    """`python bench/x.py ARGS` ("python" is this interpreter) or `bash bench/x.sh ARGS` in a
    fresh process from the repository root, on this checkout's sources; its stdout. A non-zero
    exit fails the test with the end of its output."""
    argv = [sys.executable if command[0] == "python" else command[0], *command[1:]]
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    full_env = os.environ | {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
                             "TOKENIZERS_PARALLELISM": "false"} | (env or {})
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=full_env)
    assert done.returncode == 0, (f"{' '.join(command)} exited {done.returncode}:\n"
                                  f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done.stdout


@contextmanager
def _process_state_kept():
    """What a bench script may set for its whole process, put back: argv, the import path, the
    environment, the working directory, logging's switch, the warning filters and torch's
    thread count."""
    argv, path, env, cwd = sys.argv[:], sys.path[:], dict(os.environ), os.getcwd()
    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            yield
    finally:
        sys.argv[:], sys.path[:] = argv, path
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        logging.disable(logging.NOTSET)
        torch.set_num_threads(threads)


def run_main(script: str, *args: str) -> None:
    """`python SCRIPT ARGS` run in this process (its `if __name__ == "__main__"` block), from
    the repository root with its folder first on the import path, as Python runs a script; read
    what it printed with capsys."""
    with _process_state_kept():
        os.chdir(ROOT)
        sys.argv = [script, *args]
        sys.path.insert(0, str((ROOT / script).parent))
        runpy.run_path(str(ROOT / script), run_name="__main__")


def numbers(line: str) -> list[float]:
    """Every number in a printed line (figures, ratios such as 1.45x, sizes)."""
    return [float(x) for x in NUMBER.findall(line)]


def finite(line: str, count: int | None = None) -> list[float]:
    """The numbers of `line`, asserted finite (and `count` of them, when given)."""
    found = numbers(line)
    assert found and all(math.isfinite(x) for x in found), line
    assert count is None or len(found) == count, (count, line)
    return found


def line_starting(text: str, prefix: str) -> str:
    """The one line of `text` that starts with `prefix`."""
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, (prefix, text)
    return lines[0]


def row(text: str, name: str, count: int | None = None) -> list[float]:
    """The finite numbers of the one table row of `text` labelled `name` (the label, spaces,
    then a number)."""
    pattern = re.compile(re.escape(name) + r"\s+[-+]?[\d.]")
    lines = [line for line in text.splitlines() if pattern.match(line)]
    assert len(lines) == 1, (name, text)
    return finite(lines[0][len(name):], count)


def markdown_row(text: str, label: str) -> list[str]:
    """The cells of the one markdown table row of `text` whose first cell is `label`."""
    rows = [line for line in text.splitlines() if line.startswith(f"| {label} |")]
    assert len(rows) == 1, (label, text)
    return [cell.strip() for cell in rows[0].strip("|").split("|")]
