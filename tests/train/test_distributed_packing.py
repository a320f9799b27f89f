"""--pack and --micro-batch-tokens under torchrun (2 gloo processes): each rank packs the rows of
its own micro-batches inside the wrapped forward, and a token budget deals each minibatch's rows
to the ranks for even token sums, with as many micro-batches on every rank (a borrowed row, its
loss counting 0, where one has fewer). Either way a 2-process run equals the 1-process padded
run of the same config, row-count micro-batches (DDP with full fine-tuning; FSDP2 with the LoRA
shared base, where every role is a view of one sharded model).

Independent truth: the 1-process padded loop, in this process. That the forwards really are
packed when --pack is on is checked in one process (tests/rl/test_packed_update.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from torchrun_helpers import ROOT, torchrun

from tether.train.ppo import run
from tether.train.ppo_config import GRPOConfig, PPOConfig

pytestmark = [pytest.mark.slow, pytest.mark.across_processes]

# One prompt far longer than the others: a minibatch holding it once gives that row to one rank
# alone under a token budget, the other three rows to the other (fillers on the first).
PROMPTS = ["it", "a film with a long plot and the actor and the music were quite long and the "
           "ending was very fine and the scene was fun", "fun", "music"]
CASES = {  # name: (stage, model fixture, extra config)
    "ppo-gpt2-ddp-pack": ("ppo", "tiny_model_dir", {"num_minibatches": 2, "ppo_epochs": 2,
                                                    "micro_batch_size": 2}),
    "grpo-llama-fsdp-lora-pack": ("grpo", "tiny_llama_dir", {"fsdp": True, "lora_r": 4,
                                                             "samples_per_prompt": 2,
                                                             "ppo_epochs": 2}),
    # 8 rows of ~8-16 tokens, 4 a minibatch, 2 a rank: a budget of 20 gives a rank one or two
    # micro-batches, so the ranks' counts differ unless equalised
    "ppo-gpt2-ddp-tokens": ("ppo", "tiny_model_dir", {"num_minibatches": 2, "ppo_epochs": 2,
                                                      "micro_batch_tokens": 20}),
    # every row alone (budget 1): a rank dealt the longest row alone runs borrowed rows while
    # the other runs its several
    "ppo-gpt2-ddp-tokens-1": ("ppo", "tiny_model_dir", {"num_minibatches": 2,
                                                        "micro_batch_tokens": 1}),
    "grpo-llama-fsdp-tokens-pack": ("grpo", "tiny_llama_dir", {"fsdp": True,
                                                               "samples_per_prompt": 2,
                                                               "ppo_epochs": 2,
                                                               "micro_batch_tokens": 30}),
}
# What the 1-process reference run drops: it is the plain padded loop
TWO_PROCESS_ONLY = ("fsdp", "micro_batch_tokens")
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
        run(CONFIGS[stage](**{k: v for k, v in values.items() if k not in TWO_PROCESS_ONLY}))
        one, two = (final_weights(tmp_path / "runs" / f"{name}-{n}") for n in (1, 2))
        worst = max(float((one[k] - two[k]).abs().max()) for k in one)
        assert worst < 1e-5, (name, worst)
        lines = [(tmp_path / "runs" / f"{name}-{n}" / "metrics.jsonl").read_text().splitlines()
                 for n in (1, 2)]
        for a, b in zip(*lines, strict=True):
            a, b = json.loads(a), json.loads(b)
            for key in ("policy/loss", "policy/grad_norm", "objective/kl"):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (name, key)
