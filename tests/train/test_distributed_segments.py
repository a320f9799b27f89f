"""Chat episodes under torchrun with 2 gloo processes equal the 1-process run of the same config,
whether or not their template splits them into segments (issue 47 item 1).

- **qwen**: a Qwen-style model, ChatML with two EOS ids (`<|im_end|>`, `<|endoftext|>`). A turn
  that ended in `<|endoftext|>` used to fail the template's prefix proof, split its episode, and
  torchrun refused segments: the run stopped in batch 1. Such turns now go on in their row: no
  segment, and the ranks equal one process.
- **drops**: a template that is truly not append-only (it drops the separator after an assistant
  turn that a tool message follows): every episode that goes on splits, the ranks' episodes
  split into different numbers of rows, and the rows are gathered and renumbered by episode and
  updated in shares that differ by a row (a rank with fewer micro-batches runs a borrowed row),
  under FSDP2, which hangs on a rank that calls the model less often than the other; batch 2's
  13 rows make minibatches of 4, 4, 4 and 1 rows, so in the last one rank 0 has no row of its
  own and still sums the same stats as rank 1.

Independent truth: the 1-process run in this process, whose episodes are recorded (which turns
ended in which EOS, which rank's share of episodes took how many rows). The tolerance and the
checks of the metric lines are tests/train/test_distributed_ppo.py's (a different computation:
tests/processes.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import with_chat_template
from test_distributed_ppo import (
    assert_same_run,
    metrics,
    one_process,
    start_weights,
    torchrun_driver,
)

from tether.models.pretrained import load_tokenizer
from tether.rl import sources

pytestmark = [pytest.mark.slow, pytest.mark.across_processes]

PROMPTS = ["the movie was", "a film with a long plot and", "it", "the ending was very"]
# Two tool answers, then done: an episode of up to 3 turns.
ENVS = """
class Tool:
    def reset(self, row, seed):
        self.turn = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.turn += 1
        done = self.turn == 3
        return (None if done else [{"role": "tool", "content": "42"}]), len(action) / 10.0, done
"""
# tests/rl/env/test_segments.py's template that is not append-only
DROPS = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
         "{% if not (m['role'] == 'assistant' and not loop.last"
         " and messages[loop.index0 + 1]['role'] == 'tool') %}{{ '\\n' }}{% endif %}"
         "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
CASES = {  # stage, model, extra config
    "qwen": ("grpo", "qwen", {"stop_strings": ["e"]}),
    "drops": ("ppo", "drops", {"fsdp": True, "num_minibatches": 4, "ppo_epochs": 2,
                               "micro_batch_size": 1, "stop_strings": [" "]}),
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_segments")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "envs.py").write_text(ENVS)
    return root


def config(env: Path, model_dir: Path, name: str, extra: dict) -> dict[str, object]:
    return {"policy": str(model_dir), "prompts": str(env / "prompts.jsonl"),
            "env": f"{env / 'envs.py'}:Tool", "batch_size": 8, "samples_per_prompt": 2,
            "total_episodes": 16, "max_new_tokens": 16, "max_turns": 3, "lr": 3e-4,
            "device": "cpu", "save_every": 0, "sample_every": 0,
            "output_dir": str(env / "runs"), "run_name": name} | extra


@pytest.fixture(scope="module")
def models(env, tiny_qwen2_dir, tiny_model_dir):
    """Both cases' 2-process runs, in one launch."""
    dirs = {"qwen": tiny_qwen2_dir, "drops": with_chat_template(tiny_model_dir, DROPS,
                                                               env / "drops")}
    specs = [{"stage": stage, "config": config(env, dirs[model], f"{case}-2", extra)}
             for case, (stage, model, extra) in CASES.items()]
    result = torchrun_driver(specs, env / "spec.json")
    assert result.returncode == 0, result.stderr[-4000:]
    return dirs


def recorded_run(monkeypatch, stage: str, values: dict) -> list:
    """The 1-process run, with every batch's episodes (`Episodes`) recorded."""
    batches = []

    def recording(*args, **kwargs):
        batches.append(real(*args, **kwargs))
        return batches[-1]
    real = sources.run_episodes
    monkeypatch.setattr(sources, "run_episodes", recording)
    one_process(stage, values)
    return batches


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_equal_one(env, models, case, monkeypatch):
    stage, model, extra = CASES[case]
    batches = recorded_run(monkeypatch, stage, config(env, models[model], f"{case}-1", extra))
    runs = env / "runs"
    assert_same_run(runs / f"{case}-1", runs / f"{case}-2", start_weights(models[model], False))
    segments = [m["env/segments"] for m in metrics(runs / f"{case}-2")]
    if case == "qwen":
        # some turn that an episode went on from ended in <|endoftext|>, kept as sampled
        endoftext = load_tokenizer(str(models[model])).convert_tokens_to_ids("<|endoftext|>")
        assert any(ids[i] == endoftext and mask[i] and not mask[i + 1]
                   for batch in batches for record in batch.records
                   for ids, mask in [(record["token_ids"], record["action_mask"])]
                   for i in range(len(ids) - 1))
        assert segments == [0.0, 0.0]
    else:
        # episodes split, and the ranks' halves of a batch's episodes took different row counts
        assert all(s > 0 for s in segments)
        episode = [batch.rollout.episode.tolist() for batch in batches]
        assert any(sum(e < 4 for e in rows) != sum(e >= 4 for e in rows) for rows in episode)
        # and some minibatch held a single row: rank 0's share of it was empty
        assert any(len(rows) % -(-len(rows) // 4) == 1 for rows in episode)
