"""Episodes of several turns (tether.rl.env.episodes), against what the engine really sampled
and what the environment really said:

- tokens in, tokens out: each turn's ids in the row are exactly the ids the engine sampled,
  also where decoding and encoding them again gives other ids;
- the observation's tokens sit between the turns, outside `action_mask`, encoded as its text;
- the k samples of a prompt meet environments reset with the same seed;
- budgets: a turn cut at --max-new-tokens ends the episode as truncated (still scored), the
  episode's token budget and --max-turns end it, a long observation is cut with its marker.
"""

from __future__ import annotations

import pytest
import torch
from episode_helpers import episodes, policy_of

from tether.errors import TetherError
from tether.rl.env.render import CUT_MARKER


@pytest.fixture(scope="module")
def gpt2_policy(tiny_model_dir):
    return policy_of(tiny_model_dir)


@pytest.fixture(scope="module")
def llama_policy(tiny_llama_dir):
    return policy_of(tiny_llama_dir)


class Echo:
    """Answers every turn with a fixed text; done after `turns` turns; records what it saw."""

    log: list = []

    def __init__(self, turns: int = 3, observation: str = " and then", reward: float = 0.5):
        self.turns, self.observation, self.reward = turns, observation, reward

    def reset(self, row, seed):
        self.seen = {"seed": seed, "row": row, "actions": []}
        Echo.log.append(self.seen)
        return row["prompt"]

    def step(self, action):
        self.seen["actions"].append(action)
        done = len(self.seen["actions"]) >= self.turns
        return (None if done else self.observation), self.reward, done


ROWS = [{"prompt": "the movie was", "id": 0}, {"prompt": "a film and", "id": 1}]


def test_turns_hold_the_sampled_ids_and_observations_sit_between_them(gpt2_policy):
    Echo.log = []
    gpt2_policy.turns.clear()
    rows = ROWS * 2
    out = episodes(gpt2_policy, Echo, rows, max_new_tokens=8, stop_strings=[" "])
    tokenizer, rollout = gpt2_policy.tokenizer, out.rollout
    observation = tokenizer(" and then", add_special_tokens=False)["input_ids"]
    assert len(gpt2_policy.turns) >= 2  # several turns were sampled
    for row in range(len(rows)):
        expected, flags = [], []
        actions = Echo.log[row]["actions"]
        for turn, action in enumerate(actions):
            takers = [r for r in range(len(rows)) if len(Echo.log[r]["actions"]) > turn]
            ids = gpt2_policy.turns[turn][takers.index(row)]  # what the engine sampled
            # cut at the stop string, as the loop cuts it (the token that completes it kept)
            ids = ids[:next((k + 1 for k in range(len(ids))
                             if " " in tokenizer.decode(ids[:k + 1])), len(ids))]
            assert action == tokenizer.decode(ids, skip_special_tokens=True)
            expected += ids
            flags += [True] * len(ids)
            if turn + 1 < len(actions):
                expected += observation
                flags += [False] * len(observation)
        real = rollout.response_mask[row]
        assert rollout.responses[row][real].tolist() == expected
        assert rollout.action_mask[row][real].tolist() == flags
    assert rollout.action_mask.sum() < rollout.response_mask.sum()  # observations are there


def test_no_token_is_decoded_and_encoded_again(gpt2_policy):
    # Turns of random BPE tokens: encoding their text again merges pieces into other ids (the
    # drift peers shipped). The row must still hold the ids the engine sampled.
    Echo.log = []
    gpt2_policy.turns.clear()
    rows = ROWS * 4
    out = episodes(gpt2_policy, lambda: Echo(turns=2), rows, max_new_tokens=10,
                   stop_strings=["."], seed=7)
    tokenizer, rollout = gpt2_policy.tokenizer, out.rollout
    drifted = 0
    for row in range(len(rows)):
        flags = rollout.action_mask[row][rollout.response_mask[row]].tolist()
        first = (flags + [False]).index(False)  # the first turn's tokens
        ids = gpt2_policy.turns[0][row][:first]
        assert rollout.responses[row][:first].tolist() == ids
        text = tokenizer.decode(ids, skip_special_tokens=False)
        drifted += tokenizer(text, add_special_tokens=False)["input_ids"] != ids
    assert drifted > 0, "the test needs turns whose text encodes to other ids"


def test_the_k_samples_of_a_prompt_meet_the_same_environment_seed(gpt2_policy):
    Echo.log = []
    rows = [ROWS[0]] * 3 + [ROWS[1]] * 3
    episodes(gpt2_policy, Echo, rows, seeds=[11, 11, 11, 12, 12, 12], max_turns=1)
    assert [e["seed"] for e in Echo.log] == [11, 11, 11, 12, 12, 12]
    assert [e["row"]["id"] for e in Echo.log] == [0, 0, 0, 1, 1, 1]


def test_a_turn_cut_by_its_budget_ends_the_episode_as_truncated(gpt2_policy):
    Echo.log = []
    # no stop string and no EOS in 3 tokens: every first turn is cut
    out = episodes(gpt2_policy, Echo, ROWS, max_new_tokens=3, stop_strings=())
    assert all(len(e["actions"]) == 1 for e in Echo.log)  # scored once, then over
    assert not out.rollout.ended.any()
    assert out.rewards.tolist() == [0.5, 0.5]  # the environment still scored the cut turn
    assert int(out.rollout.action_mask.sum(1).max()) == 3


def test_the_episode_budget_and_max_turns_hold(gpt2_policy):
    Echo.log = []
    out = episodes(gpt2_policy, lambda: Echo(turns=50), ROWS * 4, max_turns=4, max_new_tokens=24,
                   stop_strings=[" "], max_episode_tokens=1000)
    assert max(len(e["actions"]) for e in Echo.log) == 4  # --max-turns
    assert not out.rollout.ended.any()  # stopped by the limit, not by the environment
    Echo.log = []
    budget = 14
    out = episodes(gpt2_policy, lambda: Echo(turns=50), ROWS * 4, max_turns=50,
                   max_new_tokens=6, stop_strings=[" "], max_episode_tokens=budget)
    after_prompt = out.rollout.response_mask.sum(1)
    assert int(after_prompt.max()) <= budget
    assert max(len(e["actions"]) for e in Echo.log) >= 2


def test_no_context_outgrows_the_positions_the_model_reads(gpt2_policy):
    Echo.log = []
    limit = 24
    out = episodes(gpt2_policy, lambda: Echo(turns=50), ROWS * 4, max_turns=50,
                   max_new_tokens=6, stop_strings=[" "], max_episode_tokens=1000,
                   max_context=limit)
    contexts = out.rollout.attention_mask.sum(1)  # prompt and everything after it
    assert int(contexts.max()) <= limit and int(contexts.max()) > limit - 6
    assert max(len(e["actions"]) for e in Echo.log) >= 2
    with pytest.raises(TetherError, match=r"first prompt holds \d+ tokens and the model reads at "
                                          r"most 3: no room for a turn; lower --max-prompt-len"):
        episodes(gpt2_policy, Echo, ROWS[:1], max_context=3)


def test_a_long_observation_is_cut_with_its_marker(gpt2_policy):
    long = " the movie was good" * 20
    out = episodes(gpt2_policy, lambda: Echo(turns=2, observation=long), ROWS, max_new_tokens=6,
                   stop_strings=[" "], max_observation=8)
    tokenizer = gpt2_policy.tokenizer
    cut = tokenizer(long, add_special_tokens=False)["input_ids"]
    kept = tokenizer.decode(cut[:8]) + CUT_MARKER.format(cut=len(cut) - 8)
    assert out.stats["env/cut_observations"] > 0
    row = out.rollout.responses[0][out.rollout.response_mask[0] & ~out.rollout.action_mask[0]]
    assert tokenizer.decode(row.tolist()) == kept


def test_the_one_turn_rollout_is_the_engine_s_sample(gpt2_policy):
    gpt2_policy.turns.clear()
    out = episodes(gpt2_policy, lambda: Echo(turns=1), ROWS, max_new_tokens=5, stop_strings=())
    sampled = gpt2_policy.turns[0]
    for row, ids in enumerate(sampled):
        assert out.rollout.responses[row][out.rollout.response_mask[row]].tolist() == ids
    assert torch.equal(out.rollout.action_mask, out.rollout.response_mask)


@pytest.mark.parametrize("policy", ["gpt2_policy", "llama_policy"])
def test_chat_episodes_append_the_template_s_tokens(policy, request, tmp_path):
    from tether.data.chat import render_chat

    p = request.getfixturevalue(policy)
    tokenizer = p.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        from conftest import GPT2_CHAT_TEMPLATE

        tokenizer.chat_template = GPT2_CHAT_TEMPLATE

    class Chat(Echo):
        def reset(self, row, seed):
            super().reset(row, seed)
            return [{"role": "user", "content": row["prompt"]}]

    Echo.log = []
    rows = ROWS * 4
    out = episodes(p, lambda: Chat(turns=2, observation="more please"), rows, max_new_tokens=16,
                   stop_strings=[" "], seed=3)
    # rows whose first turn ended at the stop string went on: their observation is the
    # template's closing of the assistant turn, then the user turn and the generation prompt
    went_on = [r for r, e in enumerate(Echo.log) if len(e["actions"]) == 2]
    assert went_on
    for row in went_on:
        ids = out.rollout.responses[row][out.rollout.response_mask[row]].tolist()
        flags = out.rollout.action_mask[row][out.rollout.response_mask[row]].tolist()
        first_end = flags.index(False)
        obs = ids[first_end:first_end + flags[first_end:].index(True)]
        messages = [{"role": "user", "content": rows[row]["prompt"]},
                    {"role": "assistant", "content": Echo.log[row]["actions"][0]}]
        before = render_chat(tokenizer, messages, False)
        after = render_chat(tokenizer, messages + [{"role": "user", "content": "more please"}],
                            True)
        opened = render_chat(tokenizer, messages[:1], True)
        closing = before[len(opened) + len(messages[1]["content"]):]  # e.g. EOS and a newline
        assert after.startswith(before) and closing
        assert tokenizer.decode(obs, skip_special_tokens=False) == closing + after[len(before):]
    assert out.stats["env/segments"] == 0


def test_every_environment_is_closed_once_its_batch_is_over(gpt2_policy):
    closed = []

    class Closing(Echo):
        def close(self):
            closed.append(self.seen["row"]["id"])

    class Failing(Closing):
        def step(self, action):
            raise ValueError("broken")

    Echo.log = []
    episodes(gpt2_policy, lambda: Closing(turns=2), ROWS * 2, stop_strings=[" "])
    assert sorted(closed) == [0, 0, 1, 1]  # ended or cut short, each closed once
    closed.clear()
    with pytest.raises(TetherError, match="raised ValueError: broken"):
        episodes(gpt2_policy, Failing, ROWS)
    assert sorted(closed) == [0, 1]  # a failed batch closes its environments too


def test_truncated_episodes_are_what_the_truncation_options_read(gpt2_policy):
    # Row 0's environment ends its episode at turn 2; row 1's never does and --max-turns 2 cuts
    # it; a turn cut by --max-new-tokens ends either. --missing-eos-penalty lowers the truncated
    # episodes alone, --mask-truncated takes their tokens out of the loss.
    from types import SimpleNamespace

    from tether.rl.update import loss_mask
    from tether.train.ppo import penalised_scores

    class ByRow(Echo):
        def step(self, action):
            observation, reward, done = super().step(action)
            return observation, reward, done and self.seen["row"]["id"] == 0

    Echo.log = []
    stops = [" ", "e", "a"]
    out = episodes(gpt2_policy, lambda: ByRow(turns=2), ROWS * 6, max_turns=2, max_new_tokens=12,
                   stop_strings=stops)
    two = [len(e["actions"]) == 2 for e in Echo.log]
    ended = out.rollout.ended.tolist()
    assert any(two) and any(out.rollout.ended) and not all(out.rollout.ended)
    for row, (r, e) in enumerate(zip(ROWS * 6, Echo.log)):  # done, and its last turn not cut
        cut = not any(stop in e["actions"][-1] for stop in stops)
        assert ended[row] == (r["id"] == 0 and len(e["actions"]) == 2 and not cut)
    cfg = SimpleNamespace(missing_eos_penalty=1.0, overlong_penalty=0)
    penalised = penalised_scores(out.rewards, out.rollout, cfg)
    assert (out.rewards - penalised).tolist() == [0.0 if e else 1.0 for e in ended]
    kept = loss_mask(out.rollout, True).any(1).tolist()
    assert kept == ended and bool(loss_mask(out.rollout, False).any(1).all())
