"""examples/distill/run.py --quick end to end: the teacher's and the student's SFT, the three
forms of `tether distill`, each evaluated against the teacher, and a summary whose figures are
numbers. The full run's figures are docs/ppo.md's ("A worked example"); --quick is too short to
show the effect, so it is not asserted here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parents[2] / "examples" / "distill" / "run.py"


@pytest.mark.slow
def test_quick_distill_example(tmp_path):
    done = subprocess.run([sys.executable, str(RUN), "--quick", "--out", str(tmp_path / "out"),
                           "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    commands = [line for line in done.stdout.splitlines() if line.startswith("$ tether ")]
    assert sum(c.startswith("$ tether distill ") for c in commands) == 3
    assert sum(c.startswith("$ tether eval ") for c in commands) == 6
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["teacher"]["kl_to_teacher"] == pytest.approx(0.0, abs=1e-6)  # itself
    for name in ("student, start (SFT)", "student, SFT alone", "student, k1 in the reward", "student, exact reverse KL",
                 "student, jsd (beta 0.5)"):
        assert all(math.isfinite(v) for v in summary[name].values()), name
        assert summary[name]["kl_to_teacher"] > 0, name
