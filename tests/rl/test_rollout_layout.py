"""The rollout layout built by its one constructor (`Rollout.from_parts`, with `right_padded` and
`left_pad` for per-row lists) as each of its four builders uses it, and the episode helpers
(`last_rows`, `episode_sums`, `sampled_ids`), against tensors written out by hand."""

from __future__ import annotations

import torch

from tether.rl.engines.vllm_engine import _layout
from tether.rl.env.episodes import Episode, Segment, _laid_out, _one_turn
from tether.rl.rollout import Rollout, left_pad, right_padded

PAD = 99  # a pad id no token below uses, so a misplaced pad shows


def test_batched_parts_are_laid_out_prompt_then_response():
    # The native engine's case: prompts [2, 3] left-padded, responses [2, 3] right-padded.
    prompt_ids = torch.tensor([[PAD, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    responses = torch.tensor([[3, 2, PAD], [4, 4, 4]])
    response_mask = torch.tensor([[True, True, False], [True, True, True]])
    ended = torch.tensor([True, False])
    rollout = Rollout.from_parts(prompt_ids, prompt_mask, responses, response_mask, ended, 0.7)
    assert rollout.input_ids.tolist() == [[PAD, 5, 6, 3, 2, PAD], [7, 8, 9, 4, 4, 4]]
    assert rollout.attention_mask.tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert rollout.attention_mask.dtype == torch.long and rollout.input_ids.dtype == torch.long
    assert rollout.context_length == 3 and rollout.temperature == 0.7
    assert rollout.responses.tolist() == responses.tolist()
    assert rollout.response_mask is response_mask and rollout.ended is ended
    assert rollout.action_mask is response_mask  # single turn: every real token was sampled
    assert rollout.engine_logprobs is None and rollout.episode is None and rollout.versions is None
    # the optional per-row fields are passed through as given
    logprobs, versions = torch.tensor([[-0.5, -1.0, 0.0], [-0.25] * 3]), torch.ones(2, 3).long()
    tagged = Rollout.from_parts(prompt_ids, prompt_mask, responses, response_mask, ended, 1.0,
                                engine_logprobs=logprobs, versions=versions)
    assert tagged.engine_logprobs is logprobs and tagged.versions is versions


def test_right_padded_puts_each_row_first_and_the_fill_after():
    rows = right_padded([[1, 2], [], [3]], 3, PAD, torch.long)
    assert rows.tolist() == [[1, 2, PAD], [PAD] * 3, [3, PAD, PAD]] and rows.dtype == torch.long
    # a Python float becomes the float32 nearest to it, as torch.tensor(..., float32) makes it
    floats = right_padded([[0.1], [-1.5, 0.3]], 2, 0.0, torch.float32)
    assert floats.dtype == torch.float32
    assert floats.tolist() == torch.tensor([[0.1, 0.0], [-1.5, 0.3]], dtype=torch.float32).tolist()
    assert right_padded([[True], []], 2, False, torch.bool).tolist() == [[True, False], [False] * 2]


def test_left_pad_puts_each_row_last_and_the_pads_before():
    ids, mask = left_pad([[5, 6, 7], [8], (9, 10)], PAD, "cpu")
    assert ids.tolist() == [[5, 6, 7], [PAD, PAD, 8], [PAD, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long


def test_the_vllm_engine_s_lists_are_laid_out_to_the_given_width():
    prompt_ids, prompt_mask = torch.tensor([[PAD, 5], [6, 7]]), torch.tensor([[0, 1], [1, 1]])
    # row 0 ends on EOS 2; row 1 is empty (nothing sampled): not ended; a width of 3
    rollout = _layout(prompt_ids, prompt_mask, [[3, 2], []], [[-0.5, -0.25], []], 3, [2], PAD,
                      1.0)
    assert rollout.input_ids.tolist() == [[PAD, 5, 3, 2, PAD], [6, 7, PAD, PAD, PAD]]
    assert rollout.attention_mask.tolist() == [[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    assert rollout.response_mask.tolist() == [[True, True, False], [False] * 3]
    assert rollout.ended.tolist() == [True, False]
    assert rollout.engine_logprobs.tolist() == [[-0.5, -0.25, 0.0], [0.0] * 3]
    assert rollout.engine_logprobs.dtype == torch.float32 and rollout.context_length == 2


def _episode(segments: list[Segment], rewards: list[float], done: bool) -> Episode:
    return Episode(env=None, segments=segments, messages=None, prompt="p", text="t",
                   rewards=rewards, done=done, over=True)


def _segmented() -> list[Episode]:
    """Episode 0 in two segments (a template forced a new context after its first turn), the
    second context longer than the first; episode 1 in one. Versions and log-probs on the
    sampled tokens only; the observation's tokens (20, 21) are not sampled."""
    first = Segment([5, 6], [7, 20, 21], [True, False, False], [-0.5, 0.0, 0.0], [3, 0, 0],
                    {0: 0.25})
    second = Segment([5, 6, 7, 20, 21, 22], [8, 2], [True, True], [-1.0, -0.25], [4, 4],
                     {1: 1.0})
    alone = Segment([30], [31], [True], [-2.0], [4], {0: -1.0})
    return [_episode([first, second], [0.25, 1.0], True), _episode([alone], [-1.0], False)]


def test_a_segmented_episode_is_laid_out_one_row_per_segment():
    out = _laid_out(_segmented(), PAD, torch.device("cpu"), 0.5, own_logprobs=True,
                    versioned=True)
    rollout = out.rollout
    # context: the widest prompt (6); width: the longest segment after its prompt (3)
    assert rollout.context_length == 6 and rollout.temperature == 0.5
    assert rollout.input_ids.tolist() == [[PAD, PAD, PAD, PAD, 5, 6, 7, 20, 21],
                                          [5, 6, 7, 20, 21, 22, 8, 2, PAD],
                                          [PAD, PAD, PAD, PAD, PAD, 30, 31, PAD, PAD]]
    assert rollout.attention_mask.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 1],
                                               [1, 1, 1, 1, 1, 1, 1, 1, 0],
                                               [0, 0, 0, 0, 0, 1, 1, 0, 0]]
    T, F = True, False
    assert rollout.response_mask.tolist() == [[T, T, T], [T, T, F], [T, F, F]]
    assert rollout.action_mask.tolist() == [[T, F, F], [T, T, F], [T, F, F]]
    assert rollout.engine_logprobs.tolist() == [[-0.5, 0, 0], [-1.0, -0.25, 0], [-2.0, 0, 0]]
    assert rollout.versions.tolist() == [[3, 0, 0], [4, 4, 0], [4, 0, 0]]
    assert rollout.ended.tolist() == [T, T, F]  # an episode's done on each of its rows
    assert rollout.episode.tolist() == [0, 0, 1]
    assert [t.dtype for t in (rollout.input_ids, rollout.attention_mask, rollout.response_mask,
                              rollout.action_mask, rollout.engine_logprobs, rollout.versions,
                              rollout.ended, rollout.episode)] == [
        torch.long, torch.long, torch.bool, torch.bool, torch.float32, torch.long, torch.bool,
        torch.long]
    assert out.turn_rewards.tolist() == [[0.25, 0, 0], [0, 1.0, 0], [-1.0, 0, 0]]
    assert out.rewards.tolist() == [0.0, 1.25, -1.0]  # an episode's sum on its last row
    # without engine log-probs, version tags or a second segment, those fields are absent
    plain = _laid_out(_segmented()[1:], PAD, torch.device("cpu"), 1.0, own_logprobs=False,
                      versioned=False).rollout
    assert plain.engine_logprobs is None and plain.versions is None and plain.episode is None
    assert plain.input_ids.tolist() == [[30, 31]] and plain.attention_mask.tolist() == [[1, 1]]


def test_one_turn_episodes_keep_the_engine_s_layout_and_end_by_the_environment():
    sampled = Rollout.from_parts(torch.tensor([[PAD, 5], [6, 7]]), torch.tensor([[0, 1], [1, 1]]),
                                 torch.tensor([[3, 2], [4, PAD]]),
                                 torch.tensor([[True, True], [True, False]]),
                                 torch.tensor([True, True]), 1.0,
                                 versions=torch.tensor([[1, 1], [1, 0]]))
    episodes = [_episode([Segment([5])], [0.5], False), _episode([Segment([6, 7])], [2.0], True)]
    out = _one_turn(sampled, episodes)
    for name in ("input_ids", "attention_mask", "response_mask", "action_mask", "versions"):
        assert getattr(out.rollout, name) is getattr(sampled, name)
    assert out.rollout.context_length == 2 and out.rollout.episode is None
    assert out.rollout.ended.tolist() == [False, True]  # the environment's done, not the EOS
    assert out.turn_rewards.tolist() == [[0.0, 0.5], [2.0, 0.0]]  # on the last sampled token


def test_episode_helpers_on_a_segmented_rollout():
    rollout = _laid_out(_segmented(), PAD, torch.device("cpu"), 1.0, own_logprobs=False,
                        versioned=False).rollout
    # rows 0 and 1 are episode 0, row 2 episode 1: an episode ends on rows 1 and 2
    assert rollout.last_rows().tolist() == [False, True, True]
    sampled = rollout.action_mask.sum(dim=1)  # [1, 2, 1] tokens the policy sampled per row
    assert rollout.episode_sums(sampled).tolist() == [3, 1]
    assert rollout.episode_sums(sampled)[rollout.episode_ids()].tolist() == [3, 3, 1]
    floats = torch.tensor([0.5, 0.25, -1.0])
    assert rollout.episode_sums(floats).tolist() == [0.75, -1.0]
    assert rollout.episode_sums(floats).dtype == torch.float32
    # the policy's tokens of episode 0 are 7 (first segment) then 8, 2 (second); 20, 21 are
    # the observation's
    assert rollout.sampled_ids() == [[7, 8, 2], [31]]


def test_episode_helpers_when_rows_are_episodes():
    rollout = Rollout.from_parts(torch.tensor([[5], [6], [7]]), torch.ones(3, 1).long(),
                                 torch.tensor([[1, 2], [3, PAD], [4, 5]]),
                                 torch.tensor([[True, True], [True, False], [True, True]]),
                                 torch.tensor([True, True, False]), 1.0)
    assert rollout.last_rows().tolist() == [True] * 3
    x = torch.tensor([2.0, -1.0, 0.5])
    assert rollout.episode_sums(x).tolist() == x.tolist()
    assert rollout.sampled_ids() == [[1, 2], [3], [4, 5]]
