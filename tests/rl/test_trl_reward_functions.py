"""Reward functions written for TRL's GRPOTrainer run unchanged (issue 32): called with
keywords (prompts and completions as messages for a chat, completion_ids, the prompt file's other
columns, trainer_state), several of them weighted (--reward-weights), None for "does not apply",
and each function's mean logged as reward/<name>. tether's own (prompts, responses) form is
called as before.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from tether.cli import main
from tether.errors import TetherError
from tether.rl.reward.functions import (
    reward_from_functions,
    takes_trl_arguments,
    weighted,
)
from tether.rl.rollout import Rollout

# ---- two functions in the shape TRL's docs give them (a chat dataset with a `solution` column)

def accuracy_reward(completions, solution, **kwargs):
    """1 when the completion's text is the solution, else 0."""
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if content.strip() == answer else 0.0
            for content, answer in zip(contents, solution)]


def think_format_reward(completions, **kwargs):
    """1 when the completion is <think>...</think> then an answer."""
    pattern = r"^<think>.*?</think>\s*\S.*$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, content, re.DOTALL) else 0.0 for content in contents]


CHATS = [[{"role": "user", "content": "What is 2 + 2?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 * 3?"}]]
ROWS = [{"prompt": CHATS[0], "solution": "4", "level": 1},
        {"prompt": CHATS[1], "solution": "9", "level": 2}]


def _rollout(responses: list[list[int]], prompt_width: int = 2) -> Rollout:
    """A rollout in tether's layout holding `responses` (right-padded with 0)."""
    width = max(len(r) for r in responses)
    ids = torch.zeros(len(responses), prompt_width + width, dtype=torch.long)
    mask = torch.zeros(len(responses), width, dtype=torch.bool)
    for i, r in enumerate(responses):
        ids[i, prompt_width:prompt_width + len(r)] = torch.tensor(r)
        mask[i, :len(r)] = True
    return Rollout(ids, torch.cat([torch.ones(len(responses), prompt_width, dtype=torch.long),
                                   mask.long()], dim=1), mask, torch.ones(len(responses),
                                                                           dtype=torch.bool),
                   prompt_width)


def test_trl_style_functions_get_trls_arguments_and_their_weighted_sum():
    # Two prompts, each answered twice (k = 2: rows 0, 0, 1, 1), as the loop hands them over.
    rows = [ROWS[0], ROWS[0], ROWS[1], ROWS[1]]
    texts = ["<chat 0>", "<chat 0>", "<chat 1>", "<chat 1>"]  # the rendered prompts
    responses = ["<think>2+2</think> 4", "4", "<think>hm</think> 8", "9"]
    ids = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
    seen = []

    def spy(prompts, completions, completion_ids, solution, trainer_state, **kwargs):
        seen.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                         solution=solution, kwargs=kwargs, step=trainer_state.global_step,
                         max_steps=trainer_state.max_steps))
        return [0.0] * len(completions)

    reward = reward_from_functions([accuracy_reward, think_format_reward, spy], [1.0, 0.5, 2.0],
                                   max_steps=7)
    reward.state.global_step = 3
    scored = reward(texts, responses, _rollout(ids), rows)
    got = seen[0]
    assert got["prompts"] == [CHATS[0], CHATS[0], CHATS[1], CHATS[1]]  # the messages, not text
    assert got["completions"] == [[{"role": "assistant", "content": r}] for r in responses]
    assert got["completion_ids"] == ids
    assert got["solution"] == ["4", "4", "9", "9"]
    assert got["kwargs"] == {"level": [1, 1, 2, 2]}  # every other column, aligned
    assert (got["step"], got["max_steps"]) == (3, 7)
    # accuracy: "4" == "4" on rows 0 and 1 ("<think>..</think> 4" strips to itself: 0); 8 != 9; 9
    # format: rows 0 and 2 open with <think>...</think> and an answer
    assert scored.parts["accuracy_reward"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert scored.parts["think_format_reward"].tolist() == [1.0, 0.0, 1.0, 0.0]
    # 1 * accuracy + 0.5 * format (+ 2 * 0): 0.5, 1, 0.5, 1
    assert scored.scores.tolist() == [0.5, 1.0, 0.5, 1.0]


def test_plain_prompts_give_strings_and_none_is_left_out_of_the_sum():
    rows = [{"prompt": "2 + 2 =", "task": "math"}, {"prompt": "def add", "task": "code"}]

    def math_only(prompts, completions, task, **kwargs):
        assert prompts == ["2 + 2 =", "def add"] and completions == [" 4", " (a, b)"]
        return [3.0 if t == "math" else None for t in task]

    def code_only(completions, task, **kwargs):
        return [None if t == "math" else -1.0 for t in task]

    scored = reward_from_functions([math_only, code_only], [2.0, 1.0])(
        ["2 + 2 =", "def add"], [" 4", " (a, b)"], _rollout([[1], [2]]), rows)
    # row 0: 2 * 3 (code_only: None, left out) = 6; row 1: 1 * -1 (math_only: None) = -1
    assert scored.scores.tolist() == [6.0, -1.0]
    assert math.isnan(scored.parts["math_only"][1]) and scored.parts["math_only"][0] == 3.0
    # a response no function scored has nothing to learn from: one line
    with pytest.raises(TetherError, match=r"^every reward function returned None for response 1"
                                          r" \(prompt 'def add'\); make at least one function"):
        reward_from_functions([math_only])(["2 + 2 =", "def add"], [" 4", " (a, b)"],
                                           _rollout([[1], [2]]), rows)


def test_a_column_the_rows_lack_is_named():
    """Before: the function's TypeError, and "fix the function"; the function is right, the
    prompt file is not."""
    rows = [{"prompt": CHATS[0], "level": 1}, {"prompt": CHATS[1], "level": 2}]
    with pytest.raises(TetherError, match=r"^reward function .*:accuracy_reward takes 'solution'"
                                          r", a column the prompt file's rows lack \(they have: "
                                          r"level\); add 'solution' to every row of the --prompts "
                                          r"file"):
        reward_from_functions([think_format_reward, accuracy_reward])(
            ["<chat 0>", "<chat 1>"], ["4", "9"], _rollout([[1], [2]]), rows)

def test_tethers_own_form_is_called_as_before():
    seen = []

    def score(prompts, responses):
        seen.append((prompts, responses))
        return [float(len(r)) for r in responses]

    scored = reward_from_functions([score])(["<chat 0>", "<chat 1>"], ["ab", "c"],
                                            _rollout([[1, 2], [3]]), ROWS)
    assert seen == [(["<chat 0>", "<chat 1>"], ["ab", "c"])]  # the rendered texts, strings
    assert scored.scores.tolist() == [2.0, 1.0] and list(scored.parts) == ["score"]


@pytest.mark.parametrize("fn, trl", [
    (lambda prompts, responses: 0, False),
    (lambda p, r, **kw: 0, False),  # two positional parameters TRL would not fill
    (lambda prompts, responses, **kw: 0, False),
    (lambda completions, **kwargs: 0, True),
    (lambda prompts, completions: 0, True),
    (lambda completion_ids, **kwargs: 0, True),
    (lambda **kwargs: 0, True),
    (lambda prompts, solution, **kwargs: 0, True),  # `solution` is a column
    (len, False),  # no signature to read: tether's form
], ids=["tether", "tether-kw", "tether-named-kw", "completions", "no-kwargs", "ids", "kwargs",
        "column", "builtin"])
def test_which_form_a_signature_asks_for(fn, trl):
    assert takes_trl_arguments(fn, ["solution"]) is trl


def test_weights_are_checked_and_names_kept_apart():
    def f(completions, **kwargs):
        return [1.0] * len(completions)
    g = f
    assert [(r.name, r.weight) for r in weighted([f, g], [1, 0.5])] == [("f", 1.0), ("f_2", 0.5)]
    assert [r.weight for r in weighted([f, g], [])] == [1.0, 1.0]  # TRL's default: a plain sum
    with pytest.raises(TetherError, match=r"^--reward-weights has 1 weights for 2 reward "
                                          r"functions; give one weight per"):
        weighted([f, g], [1.0])
    with pytest.raises(TetherError, match=r"^--reward-weights holds nan; give finite numbers$"):
        weighted([f], [math.nan])


# ---- the command line, end to end on a tiny chat model

REWARDS = '''
import json, os, re

def accuracy_reward(completions, solution, **kwargs):
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if c.strip() == s else 0.0 for c, s in zip(contents, solution)]

def length_reward(completion_ids, prompts, completions, solution, **kwargs):
    with open(os.environ["SEEN"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions,
                            "ids": completion_ids, "solution": solution}) + "\\n")
    return [float(len(ids)) for ids in completion_ids]
'''


@pytest.fixture
def chat_task(tmp_path, monkeypatch):
    (tmp_path / "rewards.py").write_text(REWARDS)
    rows = [{"prompt": [{"role": "user", "content": f"say {w}"}], "solution": w}
            for w in ("a", "b", "c", "d")]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SEEN", str(tmp_path / "seen.jsonl"))
    return tmp_path, rows


def _grpo(model, *flags):
    return ["grpo", "--policy", str(model), "--prompts", "p.jsonl", "--output-dir", "runs",
            "--run-name", "trl", "--batch-size", "4", "--samples-per-prompt", "2",
            "--total-episodes", "8", "--max-new-tokens", "6", "--ppo-epochs", "1",
            "--device", "cpu", "--save-every", "0", "--report-to", "none",
            "--reward-fn", "rewards.py:accuracy_reward,rewards.py:length_reward", *flags]


def test_grpo_cli_with_two_weighted_trl_functions(tiny_qwen2_dir, chat_task):
    from transformers import AutoTokenizer

    tmp_path, rows = chat_task
    assert main(_grpo(tiny_qwen2_dir, "--reward-weights", "1,0.5")) == 0
    lines = [json.loads(x) for x in (tmp_path / "runs/trl/metrics.jsonl").read_text().splitlines()]
    batches = [m for m in lines if "objective/score" in m]
    assert len(batches) == 2
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    seen = [json.loads(x) for x in (tmp_path / "seen.jsonl").read_text().splitlines()]
    for metrics, call in zip(batches, seen, strict=True):
        # every prompt is a row's messages, answered twice in a row, its solution beside it
        by_prompt = {json.dumps(r["prompt"]): r["solution"] for r in rows}
        assert call["prompts"][0::2] == call["prompts"][1::2]
        assert call["solution"] == [by_prompt[json.dumps(p)] for p in call["prompts"]]
        # each completion is one assistant message, the decoding of the ids the policy sampled
        for completion, ids in zip(call["completions"], call["ids"], strict=True):
            assert completion == [{"role": "assistant",
                                   "content": tokenizer.decode(ids, skip_special_tokens=True)}]
            assert 1 <= len(ids) <= 6
        length = sum(len(ids) for ids in call["ids"]) / 4
        assert metrics["reward/length_reward"] == pytest.approx(length)
        # the score is 1 * accuracy + 0.5 * length, batch means alike
        assert metrics["objective/score"] == pytest.approx(
            metrics["reward/accuracy_reward"] + 0.5 * length)


@pytest.mark.parametrize("weights, message", [
    (["1"], r"--reward-weights has 1 weights for 2 reward functions; give one weight per"),
    (["1,inf"], r"config field 'reward_weights' must be a finite number, got inf"),
])
def test_bad_weights_are_one_line_and_exit_2(tiny_qwen2_dir, chat_task, capsys, weights, message):
    capsys.readouterr()
    assert main(_grpo(tiny_qwen2_dir, "--reward-weights", *weights)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and re.search(message, err[0]), err
    assert not (chat_task[0] / "runs").exists()  # refused before anything was written
