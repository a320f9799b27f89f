"""bench/gelu.py runs end to end on tiny settings: its correctness checks pass and it reports a
time and both ratios for every row."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import gelu  # noqa: E402


def test_bench_checks_and_reports_every_row():
    lines = gelu.main(["--repeats", "1", "--batch", "2", "--length", "8", "--big", "16", "2048",
                       "--threads", "0"])  # 0: leave this process's torch threads alone
    rows = lines[2:]
    labels = [row[:24].strip() for row in rows]
    assert labels == ["[2, 1024] fwd", "[2, 1024] fwd+bwd", "[16, 1024] fwd", "[16, 1024] fwd+bwd",
                      "[16, 1024] bf16 fwd", "[16, 1024] bf16 fwd+bwd", "[16, 2048] fwd",
                      "[16, 2048] fwd+bwd", "GPT-2 [2, 8] fwd", "GPT-2 [2, 8] fwd+bwd"]
    for row in rows:
        ours, torch_ms, hf_ms, torch_ratio, hf_ratio = row[24:].split()
        assert float(ours) > 0 and float(torch_ms) > 0 and float(hf_ms) > 0
        # Ratios are the other's time over tether's (times printed to 0.01 ms, hence the slack).
        for ratio, other in ((torch_ratio, torch_ms), (hf_ratio, hf_ms)):
            expected = float(other) / float(ours)
            assert abs(float(ratio.rstrip("x")) - expected) <= 0.01 + 0.02 * expected


def test_grpo_rows_time_both_gelus_and_restore_tethers():
    from tether.models import activations

    before = activations.gelu_tanh
    try:
        lines = gelu.time_grpo(1, ("--no-trl", "--episodes", "8", "--batch-size", "8",
                                   "--response-length", "4", "--threads", "0"))
    finally:
        logging.disable(logging.NOTSET)  # the GRPO bench silences logging for its whole process
    assert [line.split(":")[0] for line in lines] == ["bench/grpo.py rloo", "bench/grpo.py grpo"]
    for line in lines:
        words = line.split()
        ours, theirs, ratio = float(words[2]), float(words[7]), float(words[10].strip("(x),"))
        assert ours > 0 and theirs > 0
        assert abs(ratio - theirs / ours) <= 0.05 * theirs / ours  # times printed to 0.01 s
    assert activations.gelu_tanh is before
