"""bench/scale/torchrun_exit.py runs: one launch of the `tether` command under torchrun on 2 ranks, and
one of the minimal script with the early import; a rank that finished never aborts at exit in
either (the fixed path), and the count line reports it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scale" / "torchrun_exit.py"
SMOKES = {"bench/scale/torchrun_exit.py": "test_one_launch_counts_no_abort"}


@pytest.mark.parametrize("mode", ["cli", "early-import"])
def test_one_launch_counts_no_abort(mode):
    out = subprocess.run([sys.executable, str(BENCH), "--mode", mode, "--launches", "1",
                          "--burners", "0"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == (f"{mode}: 0 of 1 launches had a rank abort at exit "
                                           "(0 failed in all), 0 burner(s)")
