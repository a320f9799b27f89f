"""Environments that misbehave: each case is one line naming the environment, the call, the
episode and the fix (a TetherError; `tether` prints it as one `error:` line and exits 2), never
a traceback, a hang or a silent zero. An async environment runs like a sync one."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
from episode_helpers import episodes, policy_of

from tether.cli import main
from tether.errors import TetherError

ROWS = [{"prompt": "the movie was"}, {"prompt": "a film and"}]


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return policy_of(tiny_model_dir)


class Good:
    def reset(self, row, seed):
        return row["prompt"]

    def step(self, action):
        return None, 1.0, True


def variant(**methods):
    """A `Good` whose methods are replaced by `methods` (name -> function of self and args)."""
    return type("Bad", (Good,), methods)


def raising(self, *args):
    raise ValueError("the server said no")


CASES = {
    "reset raises": (variant(reset=raising), r"reset of episode 0 raised ValueError: the server "
                                             r"said no \(at .*test_bad_envs.py:\d+\); fix the env"),
    "step raises": (variant(step=raising), r"step of episode 0, turn 0 raised ValueError"),
    "reset returns a number": (variant(reset=lambda self, row, seed: 42),
                               r"reset of episode 0 returned a int; return the episode's first"),
    "reset returns nothing": (variant(reset=lambda self, row, seed: "  "),
                              r"returned an empty prompt"),
    "reset returns bad messages": (variant(reset=lambda self, row, seed: [{"content": "x"}]),
                                   r"message 0 has no 'role'"),
    "step returns two values": (variant(step=lambda self, a: (None, 1.0)),
                                r"step of episode 0, turn 0 returned a tuple of 2; return "
                                r"\(observation, reward, done\)"),
    "step returns a NaN reward": (variant(step=lambda self, a: (None, math.nan, True)),
                                  r"returned a non-finite reward \(nan\)"),
    "step returns an inf reward": (variant(step=lambda self, a: (None, -math.inf, True)),
                                   r"returned a non-finite reward \(-inf\)"),
    "step returns a text reward": (variant(step=lambda self, a: (None, "good", True)),
                                   r"returned a reward of type str"),
    "step returns a number observation": (variant(step=lambda self, a: (3, 1.0, False)),
                                          r"returned an observation of type int"),
    "step returns done=2": (variant(step=lambda self, a: (None, 1.0, 2)), r"returned done=2"),
    "messages in a plain episode": (variant(step=lambda self, a: ([{"role": "tool",
                                                                     "content": "4"}], 0.0,
                                                                   False)),
                                    r"returned chat messages in a plain-text episode"),
    "the factory returns no environment": (lambda: object(),
                                           r"returned a object, which has no reset\(row, seed\)"),
    # issue 48: before, `reset(row, seed)` called on the class missed an argument
    "the factory returns the class": (lambda: Good, r"returned the class Good, not an "
                                                     r"environment; return Good\(\)"),
    # issue 48: before, a traceback (AttributeError: 'str' object has no attribute 'items')
    "metrics returns a str": (variant(metrics=lambda self: "good"),
                              r"^metrics\(\) of environment Bad \(.*test_bad_envs.py:\d+\) "
                              r"returned a str 'good'; return a dict of \{name: number\}"),
    "metrics returns text values": (variant(metrics=lambda self: {"solved": "yes"}),
                                    r"metrics\(\) of environment Bad .* returned a dict "),
    "metrics raises": (variant(metrics=raising), r"metrics\(\) of environment Bad .* raised "
                                                 r"ValueError: the server said no \(at "),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_environment_is_one_line(policy, case):
    factory, pattern = CASES[case]
    with pytest.raises(TetherError, match=pattern) as caught:  # turns end at a space: 2 turns
        episodes(policy, factory, ROWS * 4, max_turns=2, max_new_tokens=24, stop_strings=[" "])
    assert "\n" not in str(caught.value)
    assert "environment" in str(caught.value)


def test_a_hung_step_stops_at_the_timeout(policy):
    hang = variant(step=lambda self, a: time.sleep(30))
    started = time.perf_counter()
    with pytest.raises(TetherError, match=r"step of episode 0, turn 0 did not return within "
                                          r"0.5 s; fix the hang or raise --env-timeout"):
        episodes(policy, hang, ROWS, timeout=0.5)
    assert time.perf_counter() - started < 10  # the hung thread is left behind, not waited for


class Async:
    """An `async def` environment whose calls overlap: each step waits, then answers."""

    running = 0
    most = 0

    async def reset(self, row, seed):
        return row["prompt"]

    async def step(self, action):
        Async.running += 1
        Async.most = max(Async.most, Async.running)
        await asyncio.sleep(0.2)
        Async.running -= 1
        return None, float(len(action)), True


def test_async_environments_run_concurrently(policy):
    Async.most = 0
    started = time.perf_counter()
    out = episodes(policy, Async, ROWS * 4, max_turns=1, stop_strings=(), workers=8)
    assert Async.most == 8  # all eight steps were in flight at once
    assert time.perf_counter() - started < 0.2 * 8  # not one after another
    assert out.rewards.tolist() == [float(len(t)) for t in out.row_texts]


BAD_ENV = """
class Env:
    def reset(self, row, seed):
        return row["prompt"]

    def step(self, action):
        raise RuntimeError("the scorer crashed")


def make_env():
    return Env()
"""


BAD_METRICS = BAD_ENV.replace('raise RuntimeError("the scorer crashed")',
                              "return None, 1.0, True\n\n    def metrics(self):\n"
                              "        return 'solved'")


@pytest.mark.parametrize("source, says", [
    (BAD_ENV, ["environment ", "step of episode of", "RuntimeError: the scorer crashed"]),
    (BAD_METRICS, ["metrics() of environment Env (", "env.py:9) returned a str 'solved'"]),
], ids=["step-raises", "metrics-returns-text"])
def test_the_cli_prints_one_line_and_exits_2(tiny_model_dir, tmp_path, capsys, source, says):
    (tmp_path / "env.py").write_text(source)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    capsys.readouterr()
    code = main(["grpo", "--policy", str(tiny_model_dir), "--prompts", str(prompts), "--env",
                 f"{tmp_path / 'env.py'}:make_env", "--batch-size", "4", "--total-episodes", "4",
                 "--output-dir", str(tmp_path / "runs"), "--device", "cpu", "--max-new-tokens",
                 "4"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("ppo ")]
    assert code == 2 and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(part in lines[0] for part in says), lines[0]


@pytest.mark.parametrize("argv, says", [
    (["grpo", "--env", "ENV", "--reward-fn", "REWARD"], "an environment rewards its own episodes"),
    (["eval", "--env", "ENV", "--reward-fn", "REWARD"], "an environment rewards its own episodes"),
    (["grpo", "--tools", "TOOL"], "--tools episodes are scored by --reward-fn"),
    (["eval", "--tools", "TOOL"], "--tools episodes are scored by --reward-fn"),
    (["grpo", "--env", "ENV", "--tools", "TOOL", "--reward-fn", "REWARD"],
     "give --env or --tools, not both"),
    (["grpo", "--reward-fn", "REWARD", "--max-turns", "2"],
     "--max-turns applies with --env or --tools, and tether grpo runs with no environment, "
     "where it has no effect; drop it, or pass --env or --tools"),
    # issue 48: before, an IndexError (grpo), or responses without the tools (generate)
    (["grpo", "--tools", "", "--reward-fn", "REWARD"],
     "--tools '' names no tool; give file.py:function (several joined by commas), or drop"),
    (["generate", "--tools", " , "], "--tools ' , ' names no tool"),
], ids=["env-and-reward", "eval-env-and-reward", "tools-no-reward", "eval-tools-no-reward",
        "env-and-tools", "turns-without-env", "tools-empty", "generate-tools-empty"])
def test_one_reward_per_episode(argv, says, tiny_model_dir, tmp_path, capsys):
    (tmp_path / "env.py").write_text(BAD_ENV + "\n\ndef add(a: int, b: int) -> int:\n"
                                     '    """Add.\n\n    Args:\n        a: a.\n        b: b.\n'
                                     '    """\n    return a + b\n\n\n'
                                     "def score(prompts, responses):\n"
                                     "    return [0.0 for _ in responses]\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    names = {"ENV": f"{tmp_path / 'env.py'}:make_env", "TOOL": f"{tmp_path / 'env.py'}:add",
             "REWARD": f"{tmp_path / 'env.py'}:score"}
    model = ["--policy" if argv[0] == "grpo" else "--model", str(tiny_model_dir)]
    capsys.readouterr()
    code = main([argv[0], *model, "--prompts", str(prompts), "--device", "cpu",
                 *(["--output-dir", str(tmp_path / "runs")] if argv[0] == "grpo" else []),
                 *[names.get(a, a) for a in argv[1:]]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_a_python_environment_and_a_reward_are_refused(tiny_model_dir, tmp_path):
    from tether.train.ppo import run
    from tether.train.ppo_config import GRPOConfig

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = GRPOConfig(policy=str(tiny_model_dir), prompts=str(prompts), device="cpu",
                     output_dir=str(tmp_path / "runs"))
    with pytest.raises(TetherError, match="an environment rewards its own episodes"):
        run(cfg, reward_fn=lambda p, r: [0.0] * len(r), env=lambda: None)
