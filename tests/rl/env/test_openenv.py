"""OpenEnv servers as environments (tether.rl.env.openenv), on loopback: a guess-the-number
`Environment` defined here is served by OpenEnv's own server (uvicorn on 127.0.0.1, a free
port, in a thread), and tether's episodes must see exactly the observations, rewards and ends
that environment computes, through the generic client (a URL) and a typed one (the client and
Action classes); every session is closed, also when tether truncates an episode; and a GRPO run
through `--env openenv:<url>` trains with finite metrics. Needs the extra: pip install -e
'.[openenv]'."""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import random
import socket
import threading
import time
from contextlib import contextmanager

import pytest
from episode_helpers import episodes, policy_of

from tether.errors import TetherError
from tether.rl.env.load import load_environment
from tether.rl.env.openenv import openenv_environment
from tether.train.ppo import run
from tether.train.ppo_config import GRPOConfig


def extra(module: str):
    """`module`, or skip the file without it; CI installs the extra and sets
    TETHER_REQUIRE_ENV_EXTRAS, so there these tests run, never skip."""
    if os.environ.get("TETHER_REQUIRE_ENV_EXTRAS"):
        return importlib.import_module(module)
    return pytest.importorskip(module)


extra("openenv.core")
uvicorn = extra("uvicorn")  # openenv-core's server runs on it
from fastapi import FastAPI  # noqa: E402 - after the skip: openenv brings fastapi
from openenv.core import EnvClient  # noqa: E402
from openenv.core.client_types import StepResult  # noqa: E402
from openenv.core.env_server import Action, Environment, HTTPEnvServer, Observation, State  # noqa: E402

TRIES = 3


class Guess(Action):
    guess: str


class Hint(Observation):
    message: str = ""
    tries_left: int = 0


class GuessNumber(Environment):
    """A number from 1 to 9 drawn from the reset's seed; three tries. A right guess scores 1 and
    ends the episode, a wrong one -0.1 ("Higher."/"Lower."), a non-number -0.5."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, **kwargs) -> Hint:
        self.target, self.tries = random.Random(seed).randint(1, 9), TRIES
        return Hint(message=f"Guess my number from 1 to 9. You have {TRIES} tries.",
                    tries_left=TRIES)

    def step(self, action: Guess, timeout_s=None, **kwargs) -> Hint:
        self.tries -= 1
        text = action.guess.strip()
        if text.isdigit() and int(text) == self.target:
            return Hint(message="Right!", tries_left=self.tries, reward=1.0, done=True)
        if not text.isdigit():
            message, reward = "Say a number.", -0.5
        else:
            message, reward = ("Higher." if int(text) < self.target else "Lower."), -0.1
        return Hint(message=message, tries_left=self.tries, reward=reward, done=self.tries == 0)

    @property
    def state(self) -> State:
        return State(step_count=TRIES - self.tries)


class GuessClient(EnvClient[Guess, Hint, State]):
    """The typed client an OpenEnv environment ships."""

    def _step_payload(self, action: Guess) -> dict:
        return {"guess": action.guess}

    def _parse_result(self, payload: dict) -> StepResult[Hint]:
        hint = Hint(**payload.get("observation", {}), reward=payload.get("reward"),
                    done=payload.get("done", False))
        return StepResult(observation=hint, reward=payload.get("reward"),
                          done=payload.get("done", False))

    def _parse_state(self, payload: dict) -> State:
        return State(**payload)


class NaNReward(GuessNumber):
    """Ends every episode at its first step, with a NaN reward (OpenEnv's JSON writes null)."""

    def step(self, action: Guess, timeout_s=None, **kwargs) -> Hint:
        return Hint(message="?", reward=float("nan"), done=True)


@contextmanager
def serving(max_sessions: int, env: type = GuessNumber):
    """(url, server) of `env` served on a free loopback port until the block ends."""
    server = HTTPEnvServer(env, Guess, Hint, max_concurrent_envs=max_sessions)
    app = FastAPI()
    server.register_routes(app)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    web = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=web.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not web.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        web.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def served():
    with serving(max_sessions=64) as out:
        yield out


def wait_closed(server, timeout: float = 10.0, collect: bool = False) -> None:
    """Wait for the server to hold no session. `collect`: run the cyclic garbage collector
    first, which frees the episodes of a batch that failed (its exception's traceback holds
    them in a cycle); episodes that ran their course are freed as soon as tether drops them."""
    if collect:
        gc.collect()
    deadline = time.monotonic() + timeout
    while server.active_sessions and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.active_sessions == 0, f"{server.active_sessions} sessions left open"


def expected(seed: int, guesses: list[str]) -> list[tuple]:
    """What GuessNumber itself answers: the first prompt, then (observation, reward, done) per
    guess, the observation None once done (tether asks nothing more)."""
    env = GuessNumber()
    out = [env.reset(seed=seed).message]
    for guess in guesses:
        hint = env.step(Guess(guess=guess))
        out.append((None if hint.done else hint.message, hint.reward, hint.done))
        if hint.done:
            break
    return out


def factories(url: str) -> dict:
    return {"url": load_environment(f"openenv:{url}"),
            "typed": openenv_environment(lambda: GuessClient(base_url=url), action=Guess)}


@pytest.mark.parametrize("kind", ["url", "typed"])
def test_a_scripted_episode_sees_what_the_server_env_computes(served, kind):
    url, server = served
    factory = factories(url)[kind]
    for seed in (0, 1, 1_000_033 + 5):
        target = str(random.Random(seed).randint(1, 9))
        for guesses in (["five", "1" if target != "1" else "9", target], ["0", "0", "0", "0"]):
            env = factory()
            seen = [env.reset({"prompt": "ignored"}, seed)]
            for guess in guesses:
                seen.append(env.step(guess))
                if seen[-1][2]:
                    break
            assert seen == expected(seed, guesses)
    wait_closed(server)  # every episode ended done: each closed its session


def test_chat_and_named_fields(served):
    url, _ = served
    env = load_environment(f"openenv:{url}?chat=true&observation=tries_left&action=guess")()
    assert env.reset({}, 3) == [{"role": "user", "content": str(TRIES)}]
    assert env.step("x") == ("2", -0.5, False)
    env.close()


def test_truncated_episodes_close_their_sessions_and_run_through_the_loop(served, tiny_model_dir):
    url, server = served
    factory, log = load_environment(f"openenv:{url}"), []

    class Logged:  # what each episode did, as data: holding the episodes would keep them open
        def __init__(self):
            self.env, self.seen = factory(), {"actions": [], "answers": []}
            log.append(self.seen)

        def reset(self, row, seed):
            self.seen["seed"] = seed
            return self.env.reset(row, seed)

        def step(self, action):
            self.seen["actions"].append(action)
            self.seen["answers"].append(self.env.step(action))
            return self.seen["answers"][-1]
    out = episodes(policy_of(tiny_model_dir), Logged, [{}] * 6, seeds=[4, 4, 4, 7, 7, 7],
                   max_turns=2, max_new_tokens=4, stop_strings=(" ",))
    for seen, record in zip(log, out.records):
        replay = expected(seen["seed"], seen["actions"])
        assert seen["answers"] == replay[1:]
        assert record["turn_rewards"] == [reward for _, reward, _ in replay[1:]]
        assert out.prompts[0] == replay[0]
    assert sorted(seen["seed"] for seen in log) == [4, 4, 4, 7, 7, 7]
    assert not any(record["done"] for record in out.records)  # 2 turns of 3, no right guess
    wait_closed(server)  # so the finalizers closed every session


def test_a_full_server_is_one_line_with_the_fix(tiny_model_dir):
    with serving(max_sessions=2) as (url, server):
        with pytest.raises(TetherError, match="max_concurrent_envs >= that, or lower "
                                              "--batch-size"):
            episodes(policy_of(tiny_model_dir), load_environment(f"openenv:{url}"), [{}] * 3,
                     max_turns=1)
        wait_closed(server, collect=True)


def test_a_server_that_went_away_is_not_called_full():
    """Before: "as a full one does ... max_concurrent_envs >= that" for a server that stopped."""
    with serving(max_sessions=4) as (url, server):
        factory = load_environment(f"openenv:{url}")
        env = factory()
        env.reset({}, 0)
    with pytest.raises(TetherError, match=r"^OpenEnv: the session ended \(.*\): the server "
                                          r"stopped, crashed or restarted; see its log") as caught:
        env.step("5")  # the session the stopped server closed
    assert "max_concurrent_envs" not in str(caught.value)
    with pytest.raises(TetherError, match=r"^OpenEnv: Failed to connect .*; start the server or "
                                          r"fix its URL$"):
        factory().reset({}, 0)  # nothing listens there now


class Killed(GuessClient):
    """A server killed as a session opens: the connection drops with no close frame (1006)."""

    async def reset(self, **kwargs):
        from websockets.exceptions import ConnectionClosedError
        raise ConnectionClosedError(None, None)


def test_a_killed_server_is_not_called_full():
    """Before: "as a full one does ... max_concurrent_envs >= that"."""
    env = openenv_environment(lambda: Killed(base_url="http://127.0.0.1:1"), action=Guess)()
    with pytest.raises(TetherError, match=r"^OpenEnv: the session ended \(no close frame .*\): "
                                          r"the server stopped, crashed or restarted"):
        env.reset({}, 0)


def test_a_nan_reward_is_one_line_not_zero():
    """Before: the episode's reward was 0.0, silently (the NaN arrives as null)."""
    with serving(max_sessions=4, env=NaNReward) as (url, server):
        env = load_environment(f"openenv:{url}")()
        env.reset({}, 0)
        with pytest.raises(TetherError, match=r"^OpenEnv: the server sent no reward \(null\) "
                                              r"with done; .* a NaN reward as null"):
            env.step("5")
        wait_closed(server)


@pytest.mark.parametrize("spec, message", [
    ("openenv:127.0.0.1:8000", "give the OpenEnv server's URL"),
    ("openenv:http://127.0.0.1:1?colour=red", "no option 'colour'; the options are action"),
    ("openenv:http://127.0.0.1:1", "cannot read the OpenEnv schema at http://127.0.0.1:1/schema"),
])
def test_a_bad_spec_is_one_line(spec, message):
    with pytest.raises(TetherError, match=message) as caught:
        load_environment(spec)
    assert "\n" not in str(caught.value)


def test_a_bad_field_is_one_line(served):
    url, _ = served
    with pytest.raises(TetherError, match="the OpenEnv action has no field 'answer'; it has guess"):
        load_environment(f"openenv:{url}?action=answer")
    with pytest.raises(TetherError, match="give action="):
        openenv_environment(lambda: GuessClient(base_url=url))


def test_a_grpo_run_through_the_env_string(served, tiny_model_dir, tmp_path):
    url, server = served
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(4)))
    cfg = GRPOConfig(output_dir=str(tmp_path / "runs"), run_name="openenv",
                     policy=str(tiny_model_dir), prompts=str(prompts), env=f"openenv:{url}",
                     max_turns=3, batch_size=8, total_episodes=16, max_new_tokens=6,
                     stop_strings=[" "], lr=1e-3, device="cpu", save_every=0, sample_every=0,
                     seed=2)
    result = run(cfg)
    metrics = result.metrics
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))
    assert 1.0 <= metrics["env/turns"] <= 3.0
    # GuessNumber's rewards: -0.5 a non-number, -0.1 a miss, 1 a hit; three turns at most
    assert -1.5 <= metrics["objective/score"] <= 1.0
    wait_closed(server)
