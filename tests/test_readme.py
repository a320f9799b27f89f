"""The README's KL-core example runs as printed, and its test command is the one CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kl_core_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    example = next(b for b in blocks if "from tether import kl" in b)
    scope: dict = {}
    exec(compile(example, "README.md", "exec"), scope)  # noqa: S102 - our own README
    # The example's controller saw the batch KL once: beta moved off 0.1 by at most 0.2 * 2/1e4.
    assert scope["ctl"].beta != 0.1 and abs(scope["ctl"].beta - 0.1) <= 0.1 * 0.2 * 2 / 10000 + 1e-12
    assert scope["rewards"].shape == (2, 5)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if "pytest" in line and "pip" in line)
    assert command.strip() in (ROOT / ".ci" / "run").read_text()
