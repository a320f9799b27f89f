"""Environments: episodes of several turns, where the policy acts and an environment answers.

The protocol is tether's own, small and in-process (docs/agents.md):

    make_env() -> env                       a factory, called once per episode
    env.reset(row, seed) -> str | list[dict]
        the episode's first prompt, as text or as chat messages. `row` is the prompt file's row
        (all its columns); `seed` is the same for the k samples of one prompt, so they meet the
        same environment (a group baseline compares like with like)
    env.step(action) -> (observation, reward, done)
        `action` is the policy's decoded turn. `observation` is text to append (str), chat
        messages to append (a `tool` or `user` turn: list[dict]) or None; `reward` a float;
        `done` ends the episode
    env.close()                             optional: called once the episode's batch is over
                                            (a session to end, a process to stop)
    env.metrics() -> dict[str, float]       optional: counts of its own, averaged over the
                                            batch's episodes and logged as env/<name>
    `async def` versions are accepted; the episodes of a batch run concurrently.

    calls      calling that code: sync or async, concurrently, under a timeout, checked
    render     the tokens an observation adds after the policy's turn (tokens in, tokens out)
    episodes   a batch of episodes sampled turn by turn into one `Rollout`
    tools      typed Python functions as an environment (the model's tool calls)
    load       an --env value as a factory: a file's or module's, or an adapter's
               (`reasoning-gym:<dataset>`, `openenv:<url>`)
    openenv, reasoning_gym   adapters to environments users already have (optional extras,
               `extras` imports them)

An environment with one turn whose `step` returns a reward function's score and done is exactly
a `--reward-fn` run (tests/rl/env/test_one_turn.py).
"""

from __future__ import annotations

from typing import Protocol

Observation = str | list[dict] | None


class Environment(Protocol):
    """One episode's environment (see the module docstring); methods may be `async def`."""

    def reset(self, row: dict, seed: int) -> str | list[dict]: ...

    def step(self, action: str) -> tuple[Observation, float, bool]: ...

