"""reasoning-gym datasets as environments (tether.rl.env.reasoning_gym), checked against the
dataset itself: the question an episode asks is the entry its seed names, the dataset's own
answer scores 1 and a wrong one what the dataset's `score_answer` gives (0), the k samples of a
prompt (one seed) meet one question, and a short GRPO run through `--env reasoning-gym:...`
trains with finite metrics. Needs the extra: pip install -e '.[reasoning-gym]'."""

from __future__ import annotations

import importlib
import json
import math
import os

import pytest
from episode_helpers import episodes, policy_of

from tether.errors import TetherError
from tether.rl.env.load import load_environment
from tether.rl.env.reasoning_gym import NO_TAGS, RETRY
from tether.train.ppo import run
from tether.train.ppo_config import GRPOConfig


def extra(module: str):
    """`module`, or skip the file without it; CI installs the extra and sets
    TETHER_REQUIRE_ENV_EXTRAS, so there these tests run, never skip."""
    if os.environ.get("TETHER_REQUIRE_ENV_EXTRAS"):
        return importlib.import_module(module)
    return pytest.importorskip(module)


rg = extra("reasoning_gym")


def dataset(name="leg_counting", **config):
    return rg.create_dataset(name, **({"seed": 0} | config))  # the adapter's default seed: 0


def tagged(answer: str) -> str:
    return f"I think it is <answer>{answer}</answer>"


def test_the_question_is_the_seed_s_entry_and_the_dataset_s_answer_scores_1():
    factory = load_environment("reasoning-gym:leg_counting?size=50")
    data = dataset(size=50)
    for seed in (0, 7, 49, 50, 1_000_033 * 3 + 2):  # the last: run seed 3, prompt row 2
        entry = data[seed % 50]
        env = factory()
        messages = env.reset({}, seed)
        assert messages[0]["role"] == "system" and "<answer>" in messages[0]["content"]
        assert messages[1:] == [{"role": "user", "content": entry["question"]}]
        assert env.step(tagged(entry["answer"])) == (None, 1.0, True)
        wrong = str(int(entry["answer"]) + 1)
        env = factory()
        env.reset({}, seed)
        assert env.step(tagged(wrong)) == (None, data.score_answer(wrong, entry), True)
        assert data.score_answer(wrong, entry) == 0.0
        env = factory()
        env.reset({}, seed)  # the right number without the tags is no answer
        assert env.step(entry["answer"]) == (None, 0.0, True)
        assert env.metrics() == {"solved": 0.0, "answered": 0.0}


def test_one_seed_one_question_and_a_row_may_name_its_entry():
    factory = load_environment("reasoning-gym:basic_arithmetic?size=100&seed=3")
    data = dataset("basic_arithmetic", size=100, seed=3)

    def question(row, seed):
        return factory().reset(row, seed)[-1]["content"]
    assert question({}, 5) == question({"prompt": "ignored"}, 5) == data[5]["question"]
    assert len({question({}, s) for s in range(10)}) == 10  # ten seeds, ten questions
    assert question({"question_index": 42}, 5) == data[42]["question"]
    with pytest.raises(TetherError, match="question_index 100 is not an entry"):
        question({"question_index": 100}, 5)


def test_retries_tell_a_wrong_answer_and_score_the_last_one():
    factory = load_environment("reasoning-gym:leg_counting?size=20&attempts=3&system=none")
    entry = dataset(size=20)[4]
    env = factory()
    assert env.reset({}, 4) == [{"role": "user", "content": entry["question"]}]  # no system
    assert env.step(tagged("0")) == (RETRY, 0.0, False)
    assert env.step("no tags") == (NO_TAGS, 0.0, False)
    assert env.step(tagged(entry["answer"])) == (None, 1.0, True)
    assert env.metrics() == {"solved": 1.0, "answered": 1.0}
    env = factory()
    env.reset({}, 4)
    assert [env.step(tagged("0"))[1:] for _ in range(3)] == [(0.0, False), (0.0, False),
                                                              (0.0, True)]


@pytest.mark.parametrize("spec, message", [
    ("reasoning-gym:leg_countin", "no dataset 'leg_countin'; it has e.g. leg_counting"),
    ("reasoning-gym:leg_counting?sizes=4", "no option 'sizes'; its options are attempts, system"),
    ("reasoning-gym:leg_counting?attempts=0", "attempts=0; give a whole number >= 1"),
    ("reasoning-gym:leg_counting?min_animals=30", "refused the options of leg_counting"),
    ("reasoning-gym:leg_counting?system=pirate", "give one of DeepSeekZero"),
    ("reasoning-gym:leg_counting?size", "option 'size' is not key=value"),
    ("reasoning-gym:", "names no dataset"),
    # issue 48: before, a ZeroDivisionError or reasoning-gym's own assertion, inside the adapter
    ("reasoning-gym:leg_counting?size=0", "size=0; give a whole number >= 1"),
    ("reasoning-gym:leg_counting?size=-1", "size=-1; give a whole number >= 1"),
    ("reasoning-gym:leg_counting?size=abc", "size='abc'; give a whole number >= 1"),
    ("reasoning-gym:leg_counting?seed=abc", "seed='abc'; give a whole number"),
])
def test_a_bad_spec_is_one_line_naming_it(spec, message):
    with pytest.raises(TetherError, match=message.replace("?", r"\?")) as caught:
        load_environment(spec)
    assert str(caught.value).startswith(f"--env {spec}") and "\n" not in str(caught.value)


def test_attempts_beyond_max_turns_are_refused():
    """Before: accepted, and the attempts past --max-turns never happened."""
    spec = "reasoning-gym:leg_counting?attempts=3"
    with pytest.raises(TetherError, match=r"^--env reasoning-gym:leg_counting\?attempts=3: "
                                          r"attempts=3 needs up to 3 turns, and --max-turns 1 "
                                          r"ends each episode before them; raise --max-turns to 3"):
        load_environment(spec, max_turns=1)
    assert load_environment(spec, max_turns=3)().reset({}, 0)  # enough turns: as before


def test_options_are_typed_as_the_dataset_s_config():
    factory = load_environment('reasoning-gym:basic_arithmetic?size=7&operators=["+"]'
                               "&allow_parentheses=false&min_terms=2&max_terms=2")
    question = factory().reset({}, 3)[-1]["content"]
    data = dataset("basic_arithmetic", size=7, operators=["+"], allow_parentheses=False,
                   min_terms=2, max_terms=2)
    assert question == data[3]["question"] and "-" not in question.replace("- ", "")


def test_the_k_samples_of_a_prompt_answer_one_question(tiny_llama_dir):
    factory = load_environment("reasoning-gym:basic_arithmetic?size=50&system=none")
    out = episodes(policy_of(tiny_llama_dir), factory, [{}] * 4, seeds=[8, 8, 9, 9],
                   max_turns=1, max_new_tokens=4, stop_strings=())
    assert out.prompts[0] == out.prompts[1] != out.prompts[2] == out.prompts[3]
    assert [r["reward"] for r in out.records] == [0.0] * 4  # an untrained model: no tags


def test_a_grpo_run_through_the_env_string(tiny_llama_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(4)))
    cfg = GRPOConfig(output_dir=str(tmp_path / "runs"), run_name="rg", policy=str(tiny_llama_dir),
                     prompts=str(prompts), env="reasoning-gym:chain_sum?size=32&attempts=2"
                     "&system=none&max_terms=3&max_digits=2", max_turns=2, batch_size=8,
                     total_episodes=16, max_new_tokens=8, max_prompt_len=64,
                     max_observation_tokens=24, lr=1e-3, device="cpu", save_every=0,
                     sample_every=0, seed=1)
    result = run(cfg)
    assert {"env/solved", "env/answered", "env/turns"} <= set(result.metrics)
    assert all(math.isfinite(v) for v in result.metrics.values() if isinstance(v, float))
    # an untrained model writes no tags: an episode whose first turn ended (EOS) was told so
    # and tried again; one cut at --max-new-tokens ended there (truncated)
    assert 1.0 < result.metrics["env/turns"] <= 2.0
    assert result.metrics["env/solved"] == 0.0
