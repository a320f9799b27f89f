"""--pack under torchrun (2 gloo processes): each rank packs the rows of its own micro-batches
inside the wrapped forward, so a 2-process packed run equals the 1-process padded run of the same
config (DDP with full fine-tuning; FSDP2 with the LoRA shared base, where every role is a view of
one sharded model); and --micro-batch-tokens, which would need as many micro-batches on every
rank, is refused there with one line.

Independent truth: the 1-process padded loop, in this process. That the forwards really are
packed when --pack is on is checked in one process (tests/rl/test_packed_update.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from torchrun_helpers import ROOT, torchrun

from tether.errors import TetherError
from tether.run.distributed import Dist
from tether.train.ppo import run
from tether.train.ppo_config import GRPOConfig, PPOConfig
from tether.train.ppo_setup import check_world

pytestmark = pytest.mark.slow

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]
CASES = {  # name: (stage, model fixture, extra config)
    "ppo-gpt2-ddp-pack": ("ppo", "tiny_model_dir", {"num_minibatches": 2, "ppo_epochs": 2,
                                                    "micro_batch_size": 2}),
    "grpo-llama-fsdp-lora-pack": ("grpo", "tiny_llama_dir", {"fsdp": True, "lora_r": 4,
                                                             "samples_per_prompt": 2,
                                                             "ppo_epochs": 2}),
}
CONFIGS = {"ppo": PPOConfig, "grpo": GRPOConfig}


def config(env: Path, model_dir, name: str, extra: dict) -> dict:
    return {"policy": str(model_dir), "prompts": str(env / "prompts.jsonl"),
            "reward_fn": f"{env / 'rewards.py'}:length_reward", "batch_size": 8,
            "total_episodes": 16, "max_new_tokens": 6, "lr": 3e-4, "device": "cpu",
            "save_every": 0, "sample_every": 0, "output_dir": str(env / "runs"),
            "run_name": name} | extra


def final_weights(run_dir: Path) -> dict:
    final = run_dir / "final"
    name = ("adapter_model.safetensors" if (final / "adapter_config.json").exists()
            else "model.safetensors")
    return load_file(str(final / name))


def test_two_processes_packed_equal_one_padded(tmp_path, request):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                    for p in PROMPTS))
    (tmp_path / "rewards.py").write_text("def length_reward(prompts, responses):\n"
                                         "    return [len(r) / 10.0 for r in responses]\n")
    specs = [{"stage": stage, "config": config(tmp_path, request.getfixturevalue(model),
                                               f"{name}-2", extra | {"pack": True})}
             for name, (stage, model, extra) in CASES.items()]
    (tmp_path / "spec.json").write_text(json.dumps(specs))
    result = torchrun([str(ROOT / "tests" / "dist_driver.py"), str(tmp_path / "spec.json")],
                      timeout=600, nproc=2)
    assert result.returncode == 0, result.stderr[-4000:]
    for name, (stage, model, extra) in CASES.items():
        values = config(tmp_path, request.getfixturevalue(model), f"{name}-1", extra)
        run(CONFIGS[stage](**{k: v for k, v in values.items() if k != "fsdp"}))
        one, two = (final_weights(tmp_path / "runs" / f"{name}-{n}") for n in (1, 2))
        worst = max(float((one[k] - two[k]).abs().max()) for k in one)
        assert worst < 1e-5, (name, worst)
        lines = [(tmp_path / "runs" / f"{name}-{n}" / "metrics.jsonl").read_text().splitlines()
                 for n in (1, 2)]
        for a, b in zip(*lines, strict=True):
            a, b = json.loads(a), json.loads(b)
            for key in ("policy/loss", "policy/grad_norm", "objective/kl"):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (name, key)


def test_a_token_budget_under_torchrun_is_refused(tmp_path, tiny_model_dir):
    cfg = GRPOConfig(**config(tmp_path, tiny_model_dir, "x", {"micro_batch_tokens": 64}))
    with pytest.raises(TetherError, match="--micro-batch-tokens runs in one process"):
        check_world(cfg, Dist(rank=0, world_size=2))
