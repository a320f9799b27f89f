"""Asynchronous generation (--max-staleness) under torchrun with 2 gloo processes equals the
1-process run of the same config, and leaves no process behind.

Each rank starts its own generator (`tether.rl.engines.ahead.start`, a copy of the rank's policy
in a spawned process) and prefetches its slice of every later batch; the weights reach it after
every update. Independent truth: the 1-process run of the same config in this process (its own
generator): final weights within the distributed tests' 1e-5, the same beta and metrics, the
staleness metrics included (a generator that sampled with other weights, or a rank that took
another rank's rows, changes them). The run moves the weights far past the tolerance (checked).

Processes: every process of the launch carries a marker in its environment; while it runs the
test counts the generators (spawned children of the ranks, 2 at once), and after it no process
with the marker is left (a generator that outlived its rank would be an orphan, reparented away
from torchrun and never reaped); the same when one rank fails mid-run. Outside torchrun, a
trainer killed with SIGKILL (no `close`, no exit handlers) leaves a generator that must notice
and end on its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_distributed_ppo import assert_same_run, metrics, one_process
from torchrun_helpers import ROOT, torchrun_command

from tether.rl.engines import generator

pytestmark = [pytest.mark.slow, pytest.mark.across_processes]

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very", "music",
           "the actor"]
REWARDS = "def length_reward(prompts, responses):\n    return [len(r) / 10.0 for r in responses]\n"
# Rank 1 alone fails at its second batch, as a rank-local fault would (rank 0 is then ended by
# its broken collective or by torchrun).
REWARDS += """
import os
CALLS = []
def failing_reward(prompts, responses):
    CALLS.append(1)
    if os.environ.get("RANK") == "1" and len(CALLS) == 2:
        raise RuntimeError("rank 1 fails on its own")
    return [len(r) / 10.0 for r in responses]
"""
# Two turns with an observation between them, for the episodes sampled ahead.
ENVS = """
class Hint:
    def reset(self, row, seed):
        self.seed, self.turn = seed, 0
        return row["prompt"]

    def step(self, action):
        self.turn += 1
        return [" warmer", " colder and"][(self.seed + self.turn) % 2], len(action) % 3, self.turn == 2
"""
MARK = "TETHER_ASYNC_TEST_MARK"
# The staleness metrics of the batches sampled ahead: computed on the global batch on every rank.
ASYNC_KEYS = ("async/staleness_mean", "async/staleness_max", "async/version_kl",
              "async/overrun_tokens", "rollout/engine_kl")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_async")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "rewards.py").write_text(REWARDS)
    (root / "envs.py").write_text(ENVS)
    return root


def config(env: Path, model_dir: Path, name: str, **extra) -> dict[str, object]:
    # 3 batches of 2 optimizer steps; --max-staleness 4: batches 2 and 3 are both sampled by the
    # starting weights while batch 1 trains (2 batches ahead), then trained 2 and 4 steps later.
    return {"policy": str(model_dir), "prompts": str(env / "prompts.jsonl"),
            "reward_fn": f"{env / 'rewards.py'}:length_reward", "batch_size": 8,
            "samples_per_prompt": 2, "num_minibatches": 2, "total_episodes": 24,
            "max_new_tokens": 6, "lr": 3e-4, "device": "cpu", "save_every": 0,
            "sample_every": 0, "output_dir": str(env / "runs"), "run_name": name,
            "max_staleness": 4, "threads": 1, "generator_threads": 1} | extra


def placed(env: Path, extra: dict) -> dict:
    """`extra` with its --env file named by its path in `env` (`config` takes no "env" key:
    that name is its first argument's)."""
    return extra | ({"env": f"{env / extra['env']}"} if "env" in extra else {})


def marked(mark: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment holds `MARK=mark`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            status = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone, or not ours
            continue
        zombie = status.rsplit(")", 1)[1].split()[0] == "Z"
        if f"{MARK}={mark}".encode() in environ.split(b"\0") and not zombie:
            found.append((int(entry), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


def launch_watched(specs: list[dict], spec_path: Path, timeout: float = 600
                   ) -> tuple[subprocess.CompletedProcess, int, list[tuple[int, str]]]:
    """tests/dist_driver.py on `specs` under torchrun with 2 ranks: (the result, the most
    generator processes seen alive at once, the marked processes left 2 s after it ended)."""
    spec_path.write_text(json.dumps(specs))
    mark = uuid.uuid4().hex
    cmd, env = torchrun_command([str(ROOT / "tests" / "dist_driver.py"), str(spec_path)],
                                {MARK: mark})
    out, err = spec_path.with_suffix(".out"), spec_path.with_suffix(".err")
    most = 0
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=stdout, stderr=stderr, text=True)
        deadline = time.monotonic() + timeout
        while process.poll() is None:
            if time.monotonic() > deadline:
                process.kill()
                break
            # A generator: a multiprocessing spawn child (the ranks are torchrun's plain children)
            most = max(most, sum("multiprocessing" in cmd and "spawn_main" in cmd
                                 for _, cmd in marked(mark)))
            time.sleep(0.2)
        process.wait()
    time.sleep(2)  # a generator told to close has its join timeout; an orphan has none
    result = subprocess.CompletedProcess(cmd, process.returncode, out.read_text(), err.read_text())
    return result, most, marked(mark)


CASES = {  # model, extra config
    "ddp-gpt2-full": ("gpt2", {}),
    # Each sync gathers every shard whole on every rank, in the same order, before it sends.
    "fsdp-gpt2-full": ("gpt2", {"fsdp": True}),
    # Only the adapter travels (the generator's copy holds the base, frozen).
    "fsdp-llama-lora": ("llama", {"fsdp": True, "lora_r": 4}),
    # Episodes sampled ahead: each rank's run in a thread while it updates, its turns sampled by
    # its own generator, no collective among them (the ranks' turns may take different widths).
    "ddp-llama-env": ("llama", {"env": "envs.py:Hint", "reward_fn": "", "max_turns": 2,
                                "stop_strings": ["a", "e"]}),
}


@pytest.fixture(scope="module")
def two_process_runs(env, tiny_model_dir, tiny_llama_dir):
    """Every case's 2-process run in one launch, watched: (model dirs, most generators seen
    alive at once, the marked processes left after it)."""
    dirs = {"gpt2": tiny_model_dir, "llama": tiny_llama_dir}
    specs = [{"stage": "grpo", "config": config(env, dirs[model], f"{case}-2") | placed(env, extra)}
             for case, (model, extra) in CASES.items()]
    result, most, left = launch_watched(specs, env / "spec.json")
    assert result.returncode == 0, result.stderr[-4000:]
    return dirs, most, left


def test_each_rank_runs_its_own_generator_and_none_is_left(two_process_runs):
    _, most, left = two_process_runs
    assert most == 2, most  # each rank ran its own generator, both at once
    assert left == [], left


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_with_staleness_equal_one(env, two_process_runs, case):
    dirs, _, _ = two_process_runs
    model, extra = CASES[case]
    one_process("grpo", config(env, dirs[model], f"{case}-1") | placed(env, extra))
    runs = env / "runs"
    lora = bool(extra.get("lora_r"))
    start = None if lora else load_file(str(dirs[model] / "model.safetensors"))
    assert_same_run(runs / f"{case}-1", runs / f"{case}-2", start)
    m1, m2 = metrics(runs / f"{case}-1"), metrics(runs / f"{case}-2")
    # The batches were sampled ahead: batch 3's tokens are 4 steps stale, on both runs alike.
    assert [m["async/staleness_max"] for m in m2] == [0.0, 2.0, 4.0]
    for a, b in zip(m1, m2, strict=True):
        for key in ASYNC_KEYS:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_a_failed_rank_leaves_no_generator(env, tiny_model_dir):
    values = config(env, tiny_model_dir, "async-fails",
                    reward_fn=f"{env / 'rewards.py'}:failing_reward")
    result, most, left = launch_watched([{"stage": "grpo", "config": values}],
                                        env / "fail.json")
    assert result.returncode != 0 and "rank 1 fails on its own" in result.stderr
    assert most == 2, most
    assert left == [], left


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has ended: only its exit status waits to be read)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# A trainer that starts its generator and is killed (SIGKILL: no `close`, no exit handlers).
KILLED_TRAINER = """
import os, signal, sys
from types import SimpleNamespace
import torch
from transformers import AutoModelForCausalLM
from tether.rl.engines import ahead
from tether.run.optim import StepCounter

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
engine = ahead.start(SimpleNamespace(engine="native"), model, None, StepCounter(), 1, 0,
                     torch.device("cpu"))
print(engine.launched.process.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_trainers_generator_ends(tiny_model_dir):
    env = os.environ | {"PYTHONPATH": f"{ROOT / 'src'}", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", KILLED_TRAINER, str(tiny_model_dir)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 10 * generator.POLL_S
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)
