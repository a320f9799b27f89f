"""`tether grpo`: the online loop of `tether ppo` with GRPO's conventional settings
(`GRPOConfig`); every PPO option still applies."""

from __future__ import annotations

from tether.run.parse import parse_config
from tether.run.rundir import print_result
from tether.train.ppo import run
from tether.train.ppo_config import GRPOConfig

__all__ = ["GRPOConfig", "run", "cli"]


def cli(argv: list[str]) -> int:
    print_result(run(parse_config(GRPOConfig, argv, prog="tether grpo")))
    return 0
