"""kill -9 in the middle of any stage, then --resume: the final weights are bit-identical to a run
that was never killed (checkpoints are atomic; data order, RNG and optimizer state come back).

The same computation in three processes (tests/processes.py): the killed child, the resumed run
and the whole run here all train with this process's thread count (`--threads`, and the child's
OMP_NUM_THREADS), so the weights must be equal bit for bit on any CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from offline_fixtures import preference_rows, sft_rows, write_jsonl
from processes import pinned_threads, same_settings_env
from safetensors.torch import load_file

from tether.cli import main

ENV = """
import random


class Guess:
    def reset(self, row, seed):
        self.rng, self.turn = random.Random(seed), 0
        return row["prompt"]

    def step(self, action):
        self.turn += 1
        hint = self.rng.choice([" warmer", " colder", " again"])
        return hint, float(len(action) % 3 == self.turn % 3), self.turn == 3
"""


def _argv(stage, model, root, name):
    common = ["--run-name", name, "--output-dir", str(root / "runs"), "--device", "cpu",
              "--seed", "3", "--save-every", "1", *pinned_threads()]
    if stage == "ppo":
        (root / "rewards.py").write_text(
            "def length(prompts, responses):\n    return [len(r) / 10 for r in responses]\n")
        return ["ppo", "--policy", str(model), "--prompts", str(root / "prompts.jsonl"),
                "--reward-fn", f"{root / 'rewards.py'}:length", "--batch-size", "4",
                "--total-episodes", "80", "--max-new-tokens", "4", "--lr", "1e-3",
                "--kl-ctl", "adaptive", "--kl-target", "0.5", "--kl-horizon", "64",
                "--score-norm", "running", *common]
    if stage == "ppo-ahead":  # sampled ahead by a generator process
        return [*_argv("ppo", model, root, name), "--max-staleness", "4",
                "--generator-threads", "1"]
    if stage == "ppo-env":  # episodes whose observations depend on the environment's seed
        (root / "envs.py").write_text(ENV)
        return ["grpo", "--policy", str(model), "--prompts", str(root / "prompts.jsonl"),
                "--env", f"{root / 'envs.py'}:Guess", "--max-turns", "3", "--batch-size", "4",
                "--samples-per-prompt", "2", "--total-episodes", "80", "--max-new-tokens", "4",
                "--lr", "1e-3", "--stop-strings", "a", "e", "o", *common]
    data = root / ("sft.jsonl" if stage == "sft" else "prefs.jsonl")
    return [stage, "--model", str(model), "--data", str(data), "--batch-size", "4",
            "--max-steps", "60", "--lr", "1e-3", "--lr-schedule", "cosine", *common]


def _weights(run_dir):
    out = {}
    for path in sorted((run_dir / "final").glob("*.safetensors")):
        out |= {f"{path.name}:{k}": v for k, v in load_file(str(path)).items()}
    return out


def _children(pid: int) -> list[int]:
    """The processes `pid` started (with --max-staleness: the generator and multiprocessing's
    resource tracker)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


@pytest.mark.slow
@pytest.mark.across_processes
@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "ppo", "ppo-env", "ppo-ahead"])
def test_kill_9_then_resume_is_bit_identical(stage, tiny_model_dir, tmp_path):
    """With ppo-ahead it is the trainer's children that are killed (`pkill -9 -P`: the generator
    and the resource tracker); the trainer ends with its one line and exit 2, no traceback."""
    write_jsonl(tmp_path / "sft.jsonl", sft_rows(24))
    write_jsonl(tmp_path / "prefs.jsonl", preference_rows(24))
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"]} for r in sft_rows(12)])
    proc = subprocess.Popen([sys.executable, "-m", "tether.cli",
                             *_argv(stage, tiny_model_dir, tmp_path, "killed")],
                            stderr=subprocess.PIPE, text=True, env=same_settings_env())
    seen = 0
    for line in proc.stderr:  # progress lines: kill in the middle of the run, mid-step
        seen += ": step " in line
        if seen == 3:
            for pid in _children(proc.pid) if stage == "ppo-ahead" else [proc.pid]:
                os.kill(pid, signal.SIGKILL)
            break
    rest = [line for line in proc.stderr.read().splitlines() if ": step " not in line]
    proc.wait(timeout=120)
    if stage == "ppo-ahead":
        assert proc.returncode == 2 and rest == [
            "error: the generator process (--max-staleness) ended with exit code -9 (out of "
            "memory, or killed); lower --max-staleness or --batch-size, or pass "
            "--max-staleness 0"], rest
    else:
        assert proc.returncode == -signal.SIGKILL
    run_dir = tmp_path / "runs" / "killed"
    assert not (run_dir / "final").exists() and list((run_dir / "checkpoints").glob("step_*"))
    assert main([*_argv(stage, tiny_model_dir, tmp_path, "killed"), "--resume"]) == 0
    assert main(_argv(stage, tiny_model_dir, tmp_path, "whole")) == 0
    a, b = _weights(run_dir), _weights(tmp_path / "runs" / "whole")
    assert a and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The metric log reads as one run.
    killed = (run_dir / "metrics.jsonl").read_text().splitlines()
    whole = (tmp_path / "runs" / "whole" / "metrics.jsonl").read_text().splitlines()
    assert [line.split('"perf/')[0] for line in killed] == [line.split('"perf/')[0] for line in whole]
    if stage == "ppo-env":  # the episodes went past their first turn
        assert max(json.loads(line)["env/turns"] for line in whole) > 1.5
