"""A one-turn environment is a reward function: reset returns the row's prompt, step returns the
reward function's score and done. grpo, rloo and ppo with GAE then train bit-identical final
weights to the `--reward-fn` run, on GPT-2 and Llama: the episode path adds nothing to a turn."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tether.train.ppo import run
from tether.train.ppo_config import GRPOConfig, PPOConfig, RLOOConfig

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]


def length_reward(prompts, responses):
    return [len(r) / 10.0 - 0.3 * r.count("e") for r in responses]


class OneTurn:
    def reset(self, row, seed):
        self.prompt = row["prompt"]
        return row["prompt"]

    def step(self, action):
        return None, length_reward([self.prompt], [action])[0], True


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("one_turn") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    return path


def weights(result) -> dict[str, torch.Tensor]:
    files = sorted(result.output_path.glob("*.safetensors"))
    assert files
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("family", ["tiny_model_dir", "tiny_llama_dir"])
@pytest.mark.parametrize("stage, extra", [
    (GRPOConfig, {}),
    (RLOOConfig, {"kl_in": "loss"}),
    (PPOConfig, {"ppo_epochs": 2, "num_minibatches": 2, "critic": "separate",
                 "stop_strings": ["e"]}),
], ids=["grpo", "rloo", "ppo-gae"])
def test_a_one_turn_environment_trains_what_a_reward_function_trains(family, stage, extra,
                                                                     prompts, request):
    values = dict(output_dir=str(prompts.parent / "runs"), policy=str(request.getfixturevalue(family)),
                  prompts=str(prompts), batch_size=8, total_episodes=16, max_new_tokens=6,
                  lr=1e-2, device="cpu", save_every=0, sample_every=0, seed=4) | extra
    name = f"{stage.__name__}-{family}"
    with_fn = run(stage(run_name=f"fn-{name}", **values), reward_fn=length_reward)
    with_env = run(stage(run_name=f"env-{name}", max_turns=1, **values), env=OneTurn)
    a, b = weights(with_fn), weights(with_env)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    start = load_file(str(next(request.getfixturevalue(family).glob("*.safetensors"))))
    assert any(not torch.equal(v, start[k.split(":", 1)[1]]) for k, v in a.items()
               if k.split(":", 1)[1] in start and v.shape == start[k.split(":", 1)[1]].shape)
