"""`Curve`: one demo run at one seed as read back (evaluation metrics and samples per step)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tether.tools.frontier import over_seeds

PPO_RUNS = ("ppo-no-kl", "ppo-fixed", "ppo-adaptive")


@dataclass
class Curve:
    """One run at one seed: metric values at each evaluation step, and the samples there."""

    run: str
    seed: int
    steps: list[int] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=dict)
    samples: dict[int, list[dict]] = field(default_factory=dict)  # step -> [{prompt, response, score, gold_score}]

    def series(self, name: str) -> list[float]:
        return self.values.get(name, [])

    def final(self, name: str) -> float:
        return self.series(name)[-1]

    def at(self, steps: list[int], name: str | None) -> list[float]:
        """The values of `name` at `steps` (the steps themselves when `name` is None)."""
        return [float(s) if name is None else self.series(name)[self.steps.index(s)] for s in steps]


def by_run(curves: list[Curve]) -> dict[str, list[Curve]]:
    runs: dict[str, list[Curve]] = {}
    for curve in curves:
        runs.setdefault(curve.run, []).append(curve)
    return runs


def common_steps(group: list[Curve]) -> list[int]:
    """The evaluation steps every seed of a run has (all of them, when the runs finished)."""
    return sorted(set.intersection(*(set(c.steps) for c in group))) if group else []


def mean_series(group: list[Curve], name: str) -> tuple[list[int], list[float]]:
    """(steps, mean over seeds) of metric `name` at the steps every seed has."""
    steps = common_steps(group)
    return steps, over_seeds([c.at(steps, name) for c in group])[0]


def pooled_golds(group: list[Curve], step: int) -> list[float]:
    """Per-prompt gold scores at `step`, seed after seed (the same prompts in each)."""
    return [s["gold_score"] for c in group for s in c.samples.get(step, [])]
