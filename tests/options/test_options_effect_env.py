"""Every environment option of the online loop, `tether generate` and `tether eval` takes effect
(--env, --tools, --max-turns, --max-episode-tokens, --max-observation-tokens, --env-timeout,
--env-workers, --reward-per-turn, and eval's --stop-strings); each test fails when the option it
names is silently ignored (tests/audit/mutate_options.py).

The environments live in a file the runs import by name (`--env file.py:Name`), as a user's do.
They record what each episode saw in a JSON-lines log next to it, read back here.
"""

from __future__ import annotations

import json
import math

import pytest
from test_options_effect_online import PROMPTS

from tether.cli import main
from tether.errors import TetherError
from tether.models.pretrained import load_tokenizer
from tether.rl import sources
from tether.rl.env.render import CUT_MARKER
from tether.train import ppo
from tether.train.ppo_config import PPOConfig

ENVS = '''
import asyncio, json, os, time

LOG = os.path.join(os.path.dirname(__file__), "episodes.jsonl")


def log(**values):
    with open(LOG, "a") as f:
        f.write(json.dumps(values) + "\\n")


class Endless:
    """Never done: every turn answered with OBS; reward 1 on the first turn, 0 after."""
    OBS = " and then"

    def reset(self, row, seed):
        self.turn = 0
        return row["prompt"]

    def step(self, action):
        self.turn += 1
        log(turn=self.turn, action=action)
        return self.OBS, float(self.turn == 1), False


class Long(Endless):
    OBS = " the plot" * 40


class Slow(Endless):
    def step(self, action):
        time.sleep(3)
        return super().step(action)


class Crowded:
    """Async: records how many steps are in flight at once."""
    inside = 0

    def reset(self, row, seed):
        return row["prompt"]

    async def step(self, action):
        Crowded.inside += 1
        log(inside=Crowded.inside)
        await asyncio.sleep(0.05)
        Crowded.inside -= 1
        return None, 1.0, True


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def length(prompts, responses):
    return [len(r) / 10.0 for r in responses]
'''


@pytest.fixture
def envs(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(ENVS)
    return path


def logged(envs) -> list[dict]:
    log = envs.parent / "episodes.jsonl"
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


STOPS = ["a", "e", "o"]  # a turn ends at a vowel: the untrained model writes few spaces


def env_run(model_dir, tmp_path, envs, name, env="Endless", **overrides):
    """One in-process online run with the environment `env` of the file; its metric lines."""
    data = tmp_path / f"prompts-{name}.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    values = dict(run_name=name, output_dir=str(tmp_path / "runs"), policy=str(model_dir),
                  prompts=str(data), batch_size=4, total_episodes=4, max_new_tokens=6, lr=1e-3,
                  ppo_epochs=1, device="cpu", save_every=0, sample_every=0, report_to="none",
                  stop_strings=STOPS) | overrides
    if env:
        values["env"] = f"{envs}:{env}"
    ppo.run(PPOConfig(**values))
    lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def spy_rollouts(monkeypatch) -> list:
    """The rollouts of every batch the environment source collects."""
    seen, real = [], sources.EnvSource.collect

    def collect(self, *args):
        out = real(self, *args)
        seen.append(out)
        return out
    monkeypatch.setattr(sources.EnvSource, "collect", collect)
    return seen


def test_env_and_max_turns_shape_the_episodes(tiny_model_dir, tmp_path, envs, monkeypatch):
    seen = spy_rollouts(monkeypatch)
    lines = env_run(tiny_model_dir, tmp_path, envs, "turns", max_turns=2)
    turns = [x["turn"] for x in logged(envs)]
    assert max(turns) == 2 and 1 in turns  # --max-turns 2 cuts endless episodes at 2 turns
    assert 1 < lines[-1]["env/turns"] <= 2
    rollout = seen[0].rollout
    assert bool((rollout.action_mask < rollout.response_mask).any())  # observations inside


def test_max_episode_tokens_bounds_what_follows_the_prompt(tiny_model_dir, tmp_path, envs,
                                                          monkeypatch):
    seen = spy_rollouts(monkeypatch)
    env_run(tiny_model_dir, tmp_path, envs, "budget", max_turns=8, max_episode_tokens=9)
    lengths = [int(n) for c in seen for n in c.rollout.response_mask.sum(1)]
    assert max(lengths) <= 9 and max(x["turn"] for x in logged(envs)) >= 2


def test_max_observation_tokens_cuts_a_long_observation(tiny_model_dir, tmp_path, envs,
                                                        monkeypatch):
    seen = spy_rollouts(monkeypatch)
    lines = env_run(tiny_model_dir, tmp_path, envs, "cut", env="Long", max_turns=2,
                    max_observation_tokens=5)
    assert lines[-1]["env/cut_observations"] > 0
    tokenizer = load_tokenizer(str(tiny_model_dir))
    ids = tokenizer(" the plot" * 40, add_special_tokens=False)["input_ids"]
    kept = tokenizer.decode(ids[:5]) + CUT_MARKER.format(cut=len(ids) - 5)
    rollout = seen[0].rollout
    observed = [tokenizer.decode(rollout.responses[r][rollout.response_mask[r]
                                                     & ~rollout.action_mask[r]])
                for r in range(len(rollout))]
    assert kept in observed and all(o in ("", kept) for o in observed)


def test_env_timeout_stops_a_hung_step(tiny_model_dir, tmp_path, envs):
    with pytest.raises(TetherError, match="did not return within 0.5 s"):
        env_run(tiny_model_dir, tmp_path, envs, "slow", env="Slow", env_timeout=0.5)


def test_env_workers_bounds_the_calls_at_once(tiny_model_dir, tmp_path, envs):
    env_run(tiny_model_dir, tmp_path, envs, "one", env="Crowded", env_workers=1)
    assert max(x["inside"] for x in logged(envs)) == 1
    (envs.parent / "episodes.jsonl").unlink()
    env_run(tiny_model_dir, tmp_path, envs, "four", env="Crowded", env_workers=4)
    assert max(x["inside"] for x in logged(envs)) > 1  # the bound above was the option's


def test_reward_per_turn_puts_each_turn_s_reward_on_its_tokens(tiny_model_dir, tmp_path, envs,
                                                              monkeypatch):
    # Endless rewards the first turn only. Summed, the episode's 1 sits on its last sampled token;
    # per turn, on the first turn's last token. beta 0: the shaped rewards are the rewards.
    from tether.rl import update

    shaped, real = [], update.kl_shaped_rewards

    def spy(scores, logprobs, ref_logprobs, mask, *args, **kw):
        out = real(scores, logprobs, ref_logprobs, mask, *args, **kw)
        shaped.append((out[0], mask))
        return out
    monkeypatch.setattr(update, "kl_shaped_rewards", spy)

    def last_one_at_end(name, **extra):
        shaped.clear()
        env_run(tiny_model_dir, tmp_path, envs, name, max_turns=2, beta=0.0, kl_ctl="fixed",
                advantage="reinforce++", **extra)
        rewards, mask = shaped[0]
        at = [m.nonzero().flatten() for m in mask.bool()]
        # the rows of two turns: an observation between their sampled tokens
        rows = [r for r in range(len(rewards)) if len(at[r]) < int(at[r][-1] - at[r][0]) + 1]
        assert rows and all(float(rewards[r].sum()) == 1.0 for r in rows)
        return [float(rewards[r, at[r][-1]]) == 1.0 for r in rows]
    assert all(last_one_at_end("summed"))
    assert not any(last_one_at_end("per-turn", reward_per_turn=True))


def test_reward_per_turn_is_refused_where_it_means_nothing():
    from tether.run.parse import parse_config
    from tether.train.ppo_config import PPOConfig

    base = ["--policy", "p", "--prompts", "p", "--reward-per-turn"]
    with pytest.raises(TetherError, match="pass --env or --tools"):
        parse_config(PPOConfig, base)
    with pytest.raises(TetherError, match="compares whole episodes"):
        parse_config(PPOConfig, [*base, "--env", "e.py:E", "--advantage", "rloo",
                                 "--samples-per-prompt", "2", "--batch-size", "4"])


def test_tools_make_episodes_scored_by_the_reward(tiny_qwen2_tools_dir, tmp_path, envs,
                                                  monkeypatch):
    seen = spy_rollouts(monkeypatch)
    lines = env_run(tiny_qwen2_tools_dir, tmp_path, envs, "tools", env="",
                    tools=[f"{envs}:add"], reward_fn=f"{envs}:length", max_prompt_len=512)
    assert "env/tool_calls" in lines[-1] and math.isfinite(lines[-1]["objective/score"])
    assert seen and '"name": "add"' in seen[0].prompts[0]  # the schema is in the first prompt


# ----------------------------------------------------------------------------- generate, eval

def cli_run(tool, model, envs, tmp_path, name, *extra) -> list[dict]:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n"
                            for p in ("the movie was", "a film", "it", "the plot")))
    out = tmp_path / f"{name}.{'jsonl' if tool == 'generate' else 'json'}"
    # bon: a pool of 2 per row; interpolate: the line from the model to itself, its last point
    target = {"interpolate": ["--from", str(model), "--to", str(model), "--points", "0,1",
                              "--output-dir", str(tmp_path / name)],
              "bon": ["--model", str(model), "--n", "2", "--output", str(out)]}
    args = [tool, *target.get(tool, ["--model", str(model), "--output", str(out)]), "--prompts",
            str(data), "--max-new-tokens", "6", "--device", "cpu", *extra]
    assert main(args) == 0
    if tool == "generate":
        return [json.loads(x) for x in out.read_text().splitlines()]
    if tool == "interpolate":
        return [json.loads((tmp_path / name / "eta1.eval.json").read_text())]
    return [json.loads(out.read_text())]


@pytest.mark.parametrize("tool", ["generate", "eval", "bon", "interpolate"])
def test_episode_options_of_generate_and_eval(tool, tiny_model_dir, tmp_path, envs, capsys):
    env, stops = f"{envs}:Endless", ["--stop-strings", *STOPS]
    out = cli_run(tool, tiny_model_dir, envs, tmp_path, "two", "--env", env, "--max-turns", "2",
                  *stops)
    assert max(x["turn"] for x in logged(envs)) == 2
    if tool == "generate":  # counted as what they are (issue 47)
        assert f"{len(out)} episodes written to " in capsys.readouterr().err
    (envs.parent / "episodes.jsonl").unlink()
    out = cli_run(tool, tiny_model_dir, envs, tmp_path, "budget", "--env", f"{envs}:Long",
                  "--max-turns", "8", "--max-episode-tokens", "30",
                  "--max-observation-tokens", "5", *stops)
    if tool == "generate":
        assert all(len(r["token_ids"]) - r["action_mask"].index(1) <= 30 for r in out)
        assert any(r["cut_observations"] for r in out)
    elif tool != "bon":  # (bon.json holds the curve; the turns below tell)
        assert out[0]["metrics"]["eval/cut_observations"] > 0
    # the cut observation and its marker (40 tokens) leave no room for a second turn in 30
    assert max(x["turn"] for x in logged(envs)) == 1
    with pytest.raises(AssertionError, match="assert 2 == 0"):  # one line, exit status 2
        cli_run(tool, tiny_model_dir, envs, tmp_path, "slow", "--env", f"{envs}:Slow",
                "--env-timeout", "0.5", *stops)
    assert "did not return within 0.5 s" in capsys.readouterr().err
    cli_run(tool, tiny_model_dir, envs, tmp_path, "one", "--env", f"{envs}:Crowded",
            "--env-workers", "1", *stops)
    assert max(x["inside"] for x in logged(envs) if "inside" in x) == 1


def test_eval_stop_strings_cut_each_response(tiny_model_dir, tmp_path, envs):
    # The same noise with and without --stop-strings: each cut response is a prefix of its uncut
    # self that ends at its first vowel's token; some are cut.
    def responses(name, *extra):
        out = cli_run("eval", tiny_model_dir, envs, tmp_path, name, "--reward-fn",
                      f"{envs}:length", *extra)
        return [s["response"] for s in out[0]["samples"]]
    cut, whole = responses("cut", "--stop-strings", *STOPS), responses("whole")
    assert len(cut) == len(whole) == 4
    for short, full in zip(cut, whole):
        assert full.startswith(short)
        if short != full:
            assert any(v in short for v in STOPS)
    assert cut != whole


@pytest.mark.parametrize("tool", ["generate", "eval", "interpolate"])
def test_tools_of_generate_and_eval_reach_the_first_prompt(tool, tiny_qwen2_tools_dir, tmp_path,
                                                           envs):
    extra = ["--reward-fn", f"{envs}:length"] if tool != "generate" else []
    out = cli_run(tool, tiny_qwen2_tools_dir, envs, tmp_path, "tools", "--tools", f"{envs}:add",
                  "--max-prompt-len", "512", *extra)
    prompts = [r["prompt"] for r in out] if tool == "generate" else [
        s["prompt"] for s in out[0]["samples"]]
    assert len(prompts) == 4 and all('"name": "add"' in p for p in prompts)
    if tool == "generate":  # no reward function: none written (issue 48; before, 0.0 on each)
        assert all(r["reward"] is None and r["turn_rewards"] is None for r in out)
