"""`tether rloo`: the online loop of `tether ppo` with RLOO's conventional settings
(`RLOOConfig`); every PPO option still applies."""

from __future__ import annotations

from tether.train.offline import stage_cli
from tether.train.ppo import run
from tether.train.ppo_config import RLOOConfig


def cli(argv: list[str]) -> int:
    return stage_cli(RLOOConfig, run, argv)
