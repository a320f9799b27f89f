"""`tether grpo`: the online loop of `tether ppo` with GRPO's conventional settings
(`GRPOConfig`); every PPO option still applies."""

from __future__ import annotations

from tether.train.offline import stage_cli
from tether.train.ppo import run
from tether.train.ppo_config import GRPOConfig


def cli(argv: list[str]) -> int:
    return stage_cli(GRPOConfig, run, argv)
