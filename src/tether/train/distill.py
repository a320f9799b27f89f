"""`tether distill`: the online loop of `tether ppo` with the KL anchored to a teacher and
on-policy distillation's settings (`DistillConfig`); every PPO option still applies."""

from __future__ import annotations

from tether.run.parse import parse_config
from tether.run.rundir import print_result
from tether.train.ppo import run
from tether.train.ppo_config import DistillConfig

__all__ = ["DistillConfig", "run", "cli"]


def cli(argv: list[str]) -> int:
    print_result(run(parse_config(DistillConfig, argv, prog="tether distill")))
    return 0
