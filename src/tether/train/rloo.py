"""`tether rloo`: the online loop of `tether ppo` with RLOO's conventional settings
(`RLOOConfig`); every PPO option still applies."""

from __future__ import annotations

from tether.run.parse import parse_config
from tether.run.rundir import print_result
from tether.train.ppo import run
from tether.train.ppo_config import RLOOConfig

__all__ = ["RLOOConfig", "run", "cli"]


def cli(argv: list[str]) -> int:
    print_result(run(parse_config(RLOOConfig, argv, prog="tether rloo")))
    return 0
