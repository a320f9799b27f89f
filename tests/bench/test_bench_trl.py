"""The benchmarks against TRL 1.12 (pyproject's `bench` extra: `pip install -e '.[bench]'`), both
sides, tiny: bench/peers/dpo.py, bench/peers/ppo.py and bench/scale/memory.py's `trl`
configuration. TRL's PPOTrainer is in 1.12's trl.experimental and gone from later releases, so
these need that version; bench/peers/grpo.py's TRL side needs 1.16 (a venv of its own,
docs/benchmarks.md; test_bench_grpo.py checks its config there).

They skip without TRL 1.12; CI installs the bench extra and sets TETHER_REQUIRE_TRL=1, so there
they fail instead.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest

TRL_VERSION = "1.12.0"  # pyproject's bench extra
try:
    INSTALLED = importlib.metadata.version("trl")
except importlib.metadata.PackageNotFoundError:
    INSTALLED = None
if INSTALLED != TRL_VERSION:
    if os.environ.get("TETHER_REQUIRE_TRL"):
        raise RuntimeError(f"TETHER_REQUIRE_TRL is set but TRL {TRL_VERSION} is not installed "
                           f"({INSTALLED or 'no TRL'}): pip install -e '.[bench]'")
    pytest.skip(f"needs TRL {TRL_VERSION} (pip install -e '.[bench]'), not "
                f"{INSTALLED or 'no TRL'}", allow_module_level=True)

from smoke import MEMORY_TINY, line_starting, markdown_row, row, run_main  # noqa: E402

SMOKES = {"bench/peers/dpo.py": "test_dpo_against_trl",
          "bench/peers/ppo.py": "test_ppo_against_trl",
          "bench/scale/memory.py": "test_memory_against_trl"}


@pytest.mark.slow
def test_dpo_against_trl(capsys):
    run_main("bench/peers/dpo.py", "--pairs", "16", "--batch-size", "8", "--repeats", "1")
    out = capsys.readouterr().out
    assert line_starting(out, "precision ").split() == [
        "precision", "reference", "tether", "pairs/s", "TRL", "pairs/s", "ratio"]
    for precision in ("fp32", "bf16 amp"):
        for reference in ("live (frozen copy)", "precomputed", "live, no sharing"):
            ours, theirs, ratio = row(out, f"{precision:<11}{reference}")[:3]
            assert ours > 0 and theirs > 0 and ratio == pytest.approx(ours / theirs, rel=0.05)


@pytest.mark.slow
def test_ppo_against_trl(capsys):
    run_main("bench/peers/ppo.py", "--episodes", "8", "--batch-size", "4", "--response-length",
             "4", "--repeats", "1")
    out = capsys.readouterr().out
    assert row(out, "TRL PPOTrainer", 2)[1] == 1.0
    for label in ("tether (separate critic)", "tether --critic shared"):
        episodes_s, vs_trl = row(out, label, 2)
        assert episodes_s > 0 and vs_trl > 0
    for name in ("tether", "shared"):
        line = line_starting(out, f"{name} update phase: ")
        assert "% of peak (rollout and scoring: " in line


@pytest.mark.slow
def test_memory_against_trl(capsys):
    """docs/scaling.md's `--configs full,trl`: both rows measured, the ratios to TRL's."""
    run_main("bench/scale/memory.py", "--configs", "full,trl", *MEMORY_TINY)
    out = capsys.readouterr().out
    trl = markdown_row(out, "(5) TRL 1.12 PPOTrainer")
    full = markdown_row(out, "(1) tether full fine-tuning")
    assert trl[3:5] == ["1.00x", "1.00x"] and float(trl[5]) == pytest.approx(4.0)
    assert all(cell.endswith("x") and float(cell[:-1]) > 0 for cell in full[3:5])
