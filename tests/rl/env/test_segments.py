"""A chat template that is not append-only is caught, never trained on silently; one that is
append-only keeps an episode in one row, whichever of the model's EOS tokens ended a turn.

The template here drops the newline after an assistant turn when a tool message follows it (the
separator verl lost at every assistant -> tool boundary). Appending the tool message's tokens
after the policy's turn would give the model a context the template never writes; the prefix
proof fails, and the episode continues as a new segment: a row of its own whose context is the
conversation as the template renders it, while the first segment keeps the tokens the policy
sampled. The same episodes with an append-only template stay one row each.
"""

from __future__ import annotations

import json

import pytest
import torch
from episode_helpers import Scripted, episodes, policy_of, scripted_episodes

from tether.data.chat import render_chat
from tether.data.encoding import encode_prompt, special_prefix
from tether.models.pretrained import load_tokenizer

APPENDS = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
           "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
DROPS = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
         "{% if not (m['role'] == 'assistant' and not loop.last"
         " and messages[loop.index0 + 1]['role'] == 'tool') %}{{ '\\n' }}{% endif %}"
         "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


class Tool:
    """Answers each turn with a tool message; done after two turns."""

    log: list = []

    def reset(self, row, seed):
        self.actions = []
        Tool.log.append(self.actions)
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.actions.append(action)
        if len(self.actions) == 2:
            return None, 1.0, True
        return [{"role": "tool", "content": "42"}], 0.0, False


ROWS = [{"prompt": "the movie was"}, {"prompt": "a film and"}] * 4


@pytest.fixture()
def policy(tiny_model_dir):
    return policy_of(tiny_model_dir)


def run(policy, template):
    policy.tokenizer.chat_template = template
    Tool.log = []
    return episodes(policy, Tool, ROWS, max_new_tokens=16, stop_strings=[" "], seed=3)


def test_an_append_only_template_keeps_one_row_per_episode(policy):
    out = run(policy, APPENDS)
    assert any(len(a) == 2 for a in Tool.log)  # some episodes went on after the tool message
    assert out.rollout.episode is None and out.stats["env/segments"] == 0
    assert len(out.rollout) == len(ROWS)


def test_a_template_that_drops_a_separator_starts_a_new_segment(policy):
    out = run(policy, DROPS)
    tokenizer, rollout = policy.tokenizer, out.rollout
    went_on = [i for i, actions in enumerate(Tool.log) if len(actions) == 2]
    assert went_on and out.stats["env/segments"] == len(went_on) / len(ROWS)
    assert rollout.episode is not None and len(rollout) == len(ROWS) + len(went_on)
    episode = rollout.episode.tolist()
    for i in went_on:
        first, second = [r for r, e in enumerate(episode) if e == i]
        # the first segment: the prompt and the turn as sampled, nothing after it
        assert not (rollout.response_mask[first] & ~rollout.action_mask[first]).any()
        # the second: its context is the template's whole rendering, then the second turn
        messages = [{"role": "user", "content": ROWS[i]["prompt"]},
                    {"role": "assistant", "content": Tool.log[i][0]},
                    {"role": "tool", "content": "42"}]
        context = encode_prompt(tokenizer, render_chat(tokenizer, messages, True),
                                special_prefix(tokenizer))
        ids = rollout.input_ids[second][rollout.attention_mask[second].bool()].tolist()
        prompt_part = ids[:len(ids) - int(rollout.response_mask[second].sum())]
        assert prompt_part == context
        assert torch.equal(rollout.action_mask[second], rollout.response_mask[second])
        # the episode's reward on its last segment only
        assert out.rewards[second] == 1.0 and out.rewards[first] == 0.0


def test_a_split_is_said_with_its_turn_and_where_the_texts_part(policy, capsys):
    run(policy, DROPS)
    lines = [x for x in capsys.readouterr().err.splitlines() if "new segment" in x]
    # said once, for the first split: the turn, where the texts part, the cause
    assert len(lines) == 1, lines
    assert "turn 0: the episode goes on as a new segment" in lines[0]
    assert "<|endoftext|>' they have '\\n' and '<|tool|>42<|endoftext|>\\n'" in lines[0]
    assert "it rewrites an earlier turn" in lines[0]


def test_a_turn_ended_by_the_other_eos_stays_in_its_row(tiny_qwen2_dir):
    tokenizer = load_tokenizer(str(tiny_qwen2_dir))
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    engine = Scripted(tokenizer, lambda context: "yes", end_id=endoftext)
    Tool.log = []
    out = scripted_episodes(engine, Tool, [{"prompt": "hi"}], max_turns=2,
                            eos_token_ids=(im_end, endoftext))
    assert Tool.log == [["yes", "yes"]]
    assert out.rollout.episode is None and out.stats["env/segments"] == 0
    # the second turn read the sampled <|endoftext|> where ChatML writes <|im_end|>, then the
    # template's text after it
    assert engine.contexts[1] == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                                  "yes<|endoftext|>\n<|im_start|>tool\n42<|im_end|>\n"
                                  "<|im_start|>assistant\n")
    # the row keeps both turns' sampled ids, each ended by <|endoftext|>, as sampled
    record = out.records[0]
    sampled = [t for t, m in zip(record["token_ids"], record["action_mask"], strict=True) if m]
    yes = tokenizer("yes", add_special_tokens=False)["input_ids"]
    assert sampled == (yes + [endoftext]) * 2


def test_a_segmented_batch_trains(policy, tiny_model_dir, tmp_path):
    # the whole loop on such a template: episodes of two rows are grouped by episode
    from tether.train.ppo import run as train
    from tether.train.ppo_config import GRPOConfig

    policy.tokenizer.chat_template = DROPS
    model = tmp_path / "model"
    import shutil

    shutil.copytree(tiny_model_dir, model)
    policy.tokenizer.save_pretrained(model)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    Tool.log = []
    result = train(GRPOConfig(run_name="segments", output_dir=str(tmp_path / "runs"),
                              policy=str(model), prompts=str(prompts), batch_size=8,
                              samples_per_prompt=4, total_episodes=16, max_new_tokens=16,
                              max_turns=2, stop_strings=[" "], lr=1e-3, device="cpu",
                              save_every=0, sample_every=0), env=Tool)
    lines = [json.loads(x) for x in (result.output_path.parent / "metrics.jsonl").read_text()
             .splitlines()]
    assert any(x["env/segments"] > 0 for x in lines)
    assert all(x["policy/updates"] >= 1 for x in lines)
