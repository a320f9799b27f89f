"""The online loop (ppo, rloo, grpo) under torchrun with 2 gloo processes equals the 1-process run
of the same config: final weights within 1e-5, the same beta sequence, the same metrics; with
DDP and FSDP2, full fine-tuning and the LoRA shared base, GPT-2 and Llama-style; and a 2-process
checkpoint resumes on 1 process.

Independent truth: the 1-process loop (train/ppo.py without any collective), run in this
process. Each config moves the weights by far more than the tolerance (checked), so a rank that
updated on the wrong rows, a loss divided by a per-rank count, or a missing gradient reduction
shows up.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tether.train.ppo import run
from tether.train.ppo_config import GRPOConfig, PPOConfig, RLOOConfig

pytestmark = pytest.mark.slow

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very", "music",
           "the actor"]
REWARDS = "def length_reward(prompts, responses):\n    return [len(r) / 10.0 for r in responses]\n"
CONFIGS = {"ppo": PPOConfig, "rloo": RLOOConfig, "grpo": GRPOConfig}
SRC = str(Path(__file__).resolve().parents[1] / "src")
WEIGHT_ATOL = 1e-5


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_ppo")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "rewards.py").write_text(REWARDS)
    return root


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def base_args(env: Path, model_dir: Path, name: str) -> dict[str, object]:
    # lr 3e-4: Adam moves every weight by ~lr a step (far past the tolerance) while the float
    # noise between batch shapes, which Adam amplifies on tiny gradients, stays well inside it.
    return {"policy": str(model_dir), "prompts": str(env / "prompts.jsonl"),
            "reward_fn": f"{env / 'rewards.py'}:length_reward", "batch_size": 8,
            "total_episodes": 24, "max_new_tokens": 6, "lr": 3e-4, "device": "cpu",
            "save_every": 0, "sample_every": 0, "output_dir": str(env / "runs"), "run_name": name}


def flags(values: dict[str, object]) -> list[str]:
    out = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False:
            out += [flag, str(value)]
    return out


def torchrun(stage: str, values: dict[str, object], nproc: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", "tether", stage, *flags(values)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def one_process(stage: str, values: dict[str, object]):
    values = {k: v for k, v in values.items() if k != "fsdp"}
    return run(CONFIGS[stage](**values))


def final_weights(run_dir: Path) -> dict:
    final = run_dir / "final"
    name = "adapter_model.safetensors" if (final / "adapter_config.json").exists() \
        else "model.safetensors"
    return load_file(str(final / name))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def start_weights(model_dir: Path, lora: bool) -> dict | None:
    return None if lora else load_file(str(model_dir / "model.safetensors"))


def assert_same_run(one: Path, two: Path, start: dict | None) -> None:
    w1, w2 = final_weights(one), final_weights(two)
    assert w1.keys() == w2.keys()
    worst = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    assert worst < WEIGHT_ATOL, worst
    # The run really moved the weights (LoRA: B starts at 0, so the adapter itself is the move).
    # (The tokenizer's added pad token grows the embeddings: those are compared where they fit.)
    moved = max(float((w1[k] - start[k] if start else w1[k]).abs().max()) for k in w1
                if not start or (k in start and start[k].shape == w1[k].shape))
    assert moved > 100 * WEIGHT_ATOL, moved
    m1, m2 = metrics(one), metrics(two)
    assert [m["step"] for m in m1] == [m["step"] for m in m2]
    # The adaptive controller's error is clipped at every batch of these configs (a tiny KL
    # target), so beta is a function of the batch count alone and must agree bit for bit; every
    # rank checked its beta against rank 0's each batch (ppo_dist.check_same_beta).
    assert [m["objective/beta"] for m in m1] == [m["objective/beta"] for m in m2]
    for a, b in zip(m1, m2, strict=True):
        for key in ("objective/kl", "objective/score", "policy/entropy", "policy/loss",
                    "rollout/response_len", "policy/updates", "policy/approx_kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


CASES = {
    # stage, model, extra config, weights file kind
    "ppo-gae-gpt2-ddp-full": ("ppo", "gpt2", {"num_minibatches": 2, "ppo_epochs": 2,
                                              "micro_batch_size": 2, "score_norm": "running"}),
    "ppo-gae-gpt2-fsdp-lora-shared": ("ppo", "gpt2", {"fsdp": True, "lora_r": 4,
                                                      "num_minibatches": 2, "ppo_epochs": 2}),
    "rloo-llama-fsdp-lora": ("rloo", "llama", {"fsdp": True, "lora_r": 4,
                                               "samples_per_prompt": 2}),
    "grpo-llama-ddp-full": ("grpo", "llama", {"samples_per_prompt": 4, "num_minibatches": 2,
                                              "ppo_epochs": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_equal_one(env, tiny_model_dir, tiny_llama_dir, case):
    stage, model, extra = CASES[case]
    model_dir = tiny_model_dir if model == "gpt2" else tiny_llama_dir
    values = base_args(env, model_dir, f"{case}-2") | extra
    if stage == "ppo":  # adaptive beta, its error clipped each batch: beta moves every batch
        values |= {"kl_ctl": "adaptive", "kl_target": 1e-4, "kl_horizon": 100}
    result = torchrun(stage, values)
    assert result.returncode == 0, result.stderr[-3000:]
    one_process(stage, values | {"run_name": f"{case}-1"})
    runs = env / "runs"
    assert_same_run(runs / f"{case}-1", runs / f"{case}-2",
                    start_weights(model_dir, bool(extra.get("lora_r"))))
    if stage == "ppo":
        betas = [m["objective/beta"] for m in metrics(runs / f"{case}-2")]
        assert len(set(betas)) == len(betas)  # it did move


def test_two_process_checkpoint_resumes_on_one(env, tiny_model_dir):
    # 2 processes save at batch 2 (and 3); the final model and the batch-3 checkpoint are removed,
    # and 1 process resumes from batch 2: the result is the uninterrupted 1-process run's.
    values = base_args(env, tiny_model_dir, "resume") | {
        "save_every": 2, "score_norm": "running", "kl_ctl": "adaptive", "kl_target": 1e-4,
        "kl_horizon": 100, "num_minibatches": 2}
    result = torchrun("ppo", values)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = env / "runs" / "resume"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_2", "step_3"]
    for leftover in (run_dir / "final", run_dir / "checkpoints" / "step_3"):
        import shutil

        shutil.rmtree(leftover)
    one_process("ppo", values | {"resume": True})
    one_process("ppo", values | {"run_name": "resume-ref"})
    assert_same_run(env / "runs" / "resume-ref", run_dir,
                    start_weights(tiny_model_dir, lora=False))


def test_batch_the_world_size_cannot_split_is_one_line(env, tiny_model_dir):
    # 6 rows of groups of 2 cannot go 3 groups to 2 ranks evenly... 6 rows / 2 ranks = 3 rows,
    # not whole groups of 2: refused on every rank before anything is written.
    values = base_args(env, tiny_model_dir, "bad") | {"batch_size": 6, "samples_per_prompt": 2,
                                                      "advantage": "rloo"}
    result = torchrun("ppo", values)
    assert result.returncode != 0
    assert "must split over 2 processes in whole groups" in result.stderr
    assert not (env / "runs" / "bad").exists()
