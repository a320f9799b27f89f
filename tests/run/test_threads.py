"""`--threads`: the rule that picks torch's intra-op thread count (run/threads.py), by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tether.run import threads
from tether.run.threads import SMALL_MODEL, choose_threads, use_threads


@pytest.fixture
def restore_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_process_threads", 3)  # the process's count before tether's
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("requested, parameters, on_cpu, expected", [
    (4, 10, True, 4),  # asked for: always given
    (1, 10 ** 9, False, 1),
    (0, SMALL_MODEL - 1, True, 1),  # auto, a small model on the CPU: one thread
    (0, SMALL_MODEL, True, 7),  # auto, from 10M parameters on: the process's own count
    (0, 1000, False, 7),  # auto on an accelerator: the CPU threads are left alone
])
def test_choose_threads(requested, parameters, on_cpu, expected):
    assert choose_threads(requested, parameters, on_cpu, current=7) == expected


def test_use_threads_counts_the_models_parameters(restore_threads):
    small = nn.Linear(1000, 9_000)  # 9,009,000 parameters
    large = nn.Linear(1000, 10_000)  # 10,010,000
    assert sum(p.numel() for p in small.parameters()) < SMALL_MODEL
    assert use_threads(0, small, "cpu") == 1 == torch.get_num_threads()
    assert use_threads(0, large, "cpu") == 3 == torch.get_num_threads()  # back to the process's
    assert use_threads(2, small, torch.device("cpu")) == 2 == torch.get_num_threads()


@pytest.mark.parametrize("argv", [
    ["sft", "--model", "m", "--data", "d.jsonl", "--run-name", "r", "--threads", "-1"],
    ["generate", "--model", "m", "--prompts", "p.jsonl", "--threads", "-2"],
    ["sft", "--model", "m", "--data", "d.jsonl", "--run-name", "r", "--threads", "two"],
])
def test_a_bad_thread_count_is_one_line(argv, tmp_path, monkeypatch, capsys):
    from refusals import refused

    monkeypatch.chdir(tmp_path)
    refused(tmp_path, argv, r"threads", capsys)
