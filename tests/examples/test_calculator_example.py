"""examples/calculator/run.py --quick end to end: every stage through the CLI, and a summary whose
figures are numbers. The learning effect is the full run's (docs/agents.md); --quick is too short
to show it reliably, so it is not asserted here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parents[2] / "examples" / "calculator" / "run.py"


@pytest.mark.slow
def test_quick_calculator_example(tmp_path):
    # A subprocess, as a user runs it: the script puts its own folder on sys.path.
    done = subprocess.run([sys.executable, str(RUN), "--quick", "--out", str(tmp_path / "out"),
                           "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    commands = [line for line in done.stdout.splitlines() if line.startswith("$ tether ")]
    for stage in ("tether sft ", "tether eval ", "tether grpo "):
        assert any(c.startswith(f"$ {stage}") for c in commands), stage  # printed as typed
    assert commands and all("--threads 1 " in c for c in commands)  # the example's --threads
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    for policy in ("sft", "grpo"):
        figures = summary[policy]
        assert set(figures) >= {"success", "tool_call_rate", "tool_calls", "tool_errors", "turns"}
        assert all(math.isfinite(v) for v in figures.values()), figures
        assert 0.0 <= figures["success"] <= 1.0 and 0.0 <= figures["tool_call_rate"] <= 1.0
    assert all(math.isfinite(s) and s >= 0 for s in summary["seconds"].values())
