"""Held-out episodes: the loop's evaluation (--eval-prompts with an environment) and `tether eval`
with the same seed run the same episodes, on environments seeded apart from training's."""

from __future__ import annotations

import json

from tether.cli import main
from tether.train.ppo import run
from tether.train.ppo_config import GRPOConfig

ENV = '''
import json, os

LOG = os.path.join(os.path.dirname(__file__), "seeds.jsonl")


class Seeded:
    def reset(self, row, seed):
        self.seed, self.turn = seed, 0
        with open(LOG, "a") as f:
            f.write(json.dumps({"row": row["prompt"], "seed": seed}) + "\\n")
        return row["prompt"]

    def step(self, action):
        self.turn += 1
        hint = [" warmer", " colder"][(self.seed + self.turn) % 2]
        return hint, float(len(action) % 2 == self.seed % 2), self.turn == 2
'''


def test_the_loop_s_evaluation_is_tether_eval_s(tiny_model_dir, tmp_path):
    (tmp_path / "envs.py").write_text(ENV)
    prompts = ["the movie was", "a film", "it", "the plot"]
    for name in ("train", "held"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                        for p in prompts))
    env, stops = f"{tmp_path / 'envs.py'}:Seeded", ["a", "e", "o"]
    result = run(GRPOConfig(
        run_name="g", output_dir=str(tmp_path / "runs"), policy=str(tiny_model_dir),
        prompts=str(tmp_path / "train.jsonl"), eval_prompts=str(tmp_path / "held.jsonl"),
        env=env, max_turns=2, stop_strings=stops, batch_size=8, samples_per_prompt=2,
        total_episodes=16, max_new_tokens=6, lr=1e-2, device="cpu", save_every=0,
        sample_every=0, seed=7))
    log = [json.loads(x) for x in (tmp_path / "seeds.jsonl").read_text().splitlines()]
    held = {x["seed"] for x in log[-len(prompts):]}  # the final evaluation's resets
    trained = {x["seed"] for x in log[:-len(prompts)]}
    assert len(held) == len(prompts) and not held & trained
    loop = result.metrics
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(result.output_path), "--prompts", str(tmp_path / "held.jsonl"),
                 "--env", env, "--max-turns", "2", "--stop-strings", *stops,
                 "--max-new-tokens", "6", "--seed", "7", "--device", "cpu",
                 "--output", str(out)]) == 0
    assert {x["seed"] for x in [json.loads(x) for x in (tmp_path / "seeds.jsonl").read_text()
                                .splitlines()][-len(prompts):]} == held
    alone = json.loads(out.read_text())["metrics"]
    for key in ("eval/score", "eval/kl", "eval/turns", "eval/response_len"):
        assert alone[key] == loop[key], key
