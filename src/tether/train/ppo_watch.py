"""What the online loop watches across batches (`Watch`): a policy collapsing onto a few
sequences, a KL to the reference growing fast, and --max-kl. Each warning is given once, on rank
0; every rank stops past --max-kl alike, decided from the batch's global numbers."""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field

from tether.errors import TetherError
from tether.train.ppo_config import PPOConfig

# A policy whose entropy is near 0 nats per token while it sits far (in KL) from the reference has
# collapsed onto a few sequences (seen with --lr 1.0: entropy 0, KL ~40 nats). --target-kl cannot
# catch it: each batch's first update starts on-policy, with ratio 1.
COLLAPSE_ENTROPY, COLLAPSE_KL = 0.1, 10.0


def collapsed(metrics: dict[str, float]) -> bool:
    return (metrics["policy/entropy"] < COLLAPSE_ENTROPY
            and metrics["objective/kl"] > COLLAPSE_KL)


# The other way a run goes wrong: the KL keeps growing fast while the entropy rises (GRPO with
# LoRA at --lr 3e-3: 8.3 nats per batch, entropy 1.24 -> 1.89), which the collapse check, watching
# for entropy near 0, never sees. Warned once: past DRIFT_KL nats (twice the target under the
# adaptive controller, which aims there on purpose) and DRIFT_GROWTH times the KL of
# DRIFT_BATCHES batches before. Not with --beta 0: a run without the leash drifts by design.
DRIFT_KL, DRIFT_BATCHES, DRIFT_GROWTH = 4.0, 3, 2.0


@dataclass
class Watch:
    """What the loop watches across batches: each warning is given once (on rank 0; every rank
    stops past --max-kl alike, decided from global numbers)."""

    max_kl: float = 0.0
    drift_kl: float = DRIFT_KL
    quiet: bool = False  # a rank other than 0
    # this batch's KL and up to DRIFT_BATCHES before it; the first batch's entropy
    kls: deque = field(default_factory=lambda: deque(maxlen=DRIFT_BATCHES + 1))
    first_entropy: float | None = None
    warned: set[str] = field(default_factory=set)

    def check(self, metrics: dict[str, float], step: int) -> None:
        kl, beta = metrics["objective/kl"], metrics["objective/beta"]
        self.kls.append(kl)
        now = metrics["policy/entropy"]
        first = self.first_entropy = now if self.first_entropy is None else self.first_entropy
        if metrics["policy/collapsed"]:
            self._warn("collapse", f"batch {step}: the policy is collapsing (entropy "
                       f"{metrics['policy/entropy']:.3f} nats/token, KL {kl:.1f} nats at beta "
                       f"{beta:.3g}); lower --lr, raise --beta, or stop it with --max-kl")
        window = self.kls
        if beta > 0 and kl > self.drift_kl and kl > DRIFT_GROWTH * max(window[0], 0.0):
            moving = "rising" if now > first else "falling" if now < first else "unchanged"
            self._warn("drift", f"batch {step}: the KL to the reference is growing fast "
                       f"({window[0]:.1f} -> {kl:.1f} nats in {len(window) - 1} batches at beta "
                       f"{beta:.3g}) with the entropy {moving} ({first:.2f} -> {now:.2f} "
                       "nats/token); lower --lr, raise --beta, or cap it with --max-kl "
                       "(docs/ppo.md, \"Choosing --max-kl\")")
        if self.max_kl > 0 and kl > self.max_kl:
            raise TetherError(f"batch {step}: the KL to the reference is {kl:.2f} nats, past "
                              f"--max-kl {self.max_kl:g}, at beta {beta:.3g}; stopped, earlier "
                              "checkpoints are kept. Lower --lr or raise --beta")

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self.warned and not self.quiet:
            print(f"warning: {message}", file=sys.stderr, flush=True)
        self.warned.add(kind)


def watch_for(cfg: PPOConfig, quiet: bool) -> Watch:
    drift = max(DRIFT_KL, 2 * cfg.kl_target) if cfg.kl_ctl == "adaptive" else DRIFT_KL
    return Watch(cfg.max_kl, drift, quiet)
