"""The one place an `--env` value becomes an environment factory.

    reasoning-gym:<dataset>[?key=value&...]   a reasoning-gym dataset (tether.rl.env.reasoning_gym)
    openenv:<server url>[?key=value&...]      an OpenEnv server, through its generic client
                                              (tether.rl.env.openenv)
    file.py:make_env, module:make_env         the user's own factory (tether.run.user_code.load)

An adapter's package is an optional extra: a missing one is one line with the pip command.
Options after `?` are `key=value` pairs joined by `&`, percent-escapes decoded (`%26` is `&`); a
`+` stays a plus, not a space, so `operators=["+","-"]` means what it says.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import unquote

from tether.errors import TetherError
from tether.rl.env import openenv, reasoning_gym
from tether.run.user_code.load import load_function

# prefix -> the adapter's from_spec(target, options, where): the factory the value names
ADAPTERS: dict[str, Callable[[str, dict[str, str], str], Callable]] = {
    "reasoning-gym": reasoning_gym.from_spec,
    "openenv": openenv.from_spec,
}


def load_environment(spec: str, max_turns: int = 0) -> Callable:
    """The environment factory `spec` (an --env value) names. An adapter's whose episodes need
    more turns than `max_turns` (--max-turns; 0: unchecked) allows is refused."""
    prefix, sep, rest = spec.partition(":")
    if not sep or prefix not in ADAPTERS:
        return load_function(spec, "environment factory")
    target, _, query = rest.partition("?")
    factory = ADAPTERS[prefix](target, parse_options(query, spec), spec)
    attempts = getattr(factory, "attempts", 1)  # reasoning-gym's: a turn per attempt
    if max_turns and attempts > max_turns:
        raise TetherError(f"--env {spec}: attempts={attempts} needs up to {attempts} turns, and "
                          f"--max-turns {max_turns} ends each episode before them; raise "
                          f"--max-turns to {attempts}, or lower attempts")
    return factory


def parse_options(query: str, where: str) -> dict[str, str]:
    """`a=1&b=x` -> {"a": "1", "b": "x"}; a key without a value, or given twice, is refused."""
    options: dict[str, str] = {}
    for part in filter(None, query.split("&")):
        key, eq, value = part.partition("=")
        key = unquote(key)
        if not eq or not key:
            raise TetherError(f"--env {where}: option {part!r} is not key=value; write it as "
                              "?key=value&key=value")
        if key in options:
            raise TetherError(f"--env {where} gives {key} twice; give it once")
        options[key] = unquote(value)
    return options
