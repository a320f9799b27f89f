"""`tether distill`: the online loop of `tether ppo` with the KL anchored to a teacher and
on-policy distillation's settings (`DistillConfig`); every PPO option still applies."""

from __future__ import annotations

from tether.train.offline import stage_cli
from tether.train.ppo import run
from tether.train.ppo_config import DistillConfig


def cli(argv: list[str]) -> int:
    return stage_cli(DistillConfig, run, argv)
