"""`tether demo`: SFT -> RM -> PPO (with and without the KL leash) -> DPO/IPO, and a report."""

from __future__ import annotations


def cli(argv: list[str]) -> int:
    """`tether demo [--quick] [--field value ...]`."""
    from tether.demo.config import DemoConfig
    from tether.demo.pipeline import run  # light: it imports torch once its workers have started
    from tether.run.parse import parse_config

    run(parse_config(DemoConfig, argv, prog="tether demo"))
    return 0
