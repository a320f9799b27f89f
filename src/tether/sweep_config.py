"""`SweepConfig`: the command line of `tether sweep`, apart from its code so `--help` imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from tether.config import require_positive


@dataclass(kw_only=True)
class SweepConfig:
    """Run a grid of PPO and DPO/IPO runs from one YAML file; write the frontier report."""

    grid: str
    """The grid file (YAML: name, output_dir, seeds, and ppo / dpo / eval blocks; see docs/frontier.md)."""
    jobs: int = 1
    """Runs at once, each in its own process (1: one after another, in this process)."""
    output_dir: str = ""
    """Where the sweep directory goes (default: the grid file's output_dir, else runs)."""

    def validate(self) -> None:
        require_positive(self, "jobs")
