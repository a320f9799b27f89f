"""What the online loop watches across batches (`Watch`): a policy collapsing onto a few
sequences, a KL to the reference growing fast, --max-kl, and batches that taught the policy
nothing. Each warning about the run's course is given once, on rank 0; a batch that taught
nothing is named every time, and a run in which no batch gave the policy a loss fails at its end.
Every rank stops alike, decided from the batch's global numbers."""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field

from tether.choices import ADVANTAGES
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
    max_kl_to: str = "anchor"  # what --max-kl caps: "anchor" (objective/kl) or "sft"
    drift_kl: float = DRIFT_KL
    quiet: bool = False  # a rank other than 0
    # this batch's KL and up to DRIFT_BATCHES before it; the first batch's entropy
    kls: deque = field(default_factory=lambda: deque(maxlen=DRIFT_BATCHES + 1))
    first_entropy: float | None = None
    first_spread: tuple[float, float] | None = None  # an ensemble's first (score, members' std)
    warned: set[str] = field(default_factory=set)
    # batches whose policy loss held a token, over the whole run (a resume restores it from the
    # checkpoint; None: a checkpoint written before it was counted, so the end is not judged)
    trained: int | None = 0

    def check(self, metrics: dict[str, float], step: int) -> None:
        kl, beta = metrics["objective/kl"], metrics["objective/beta"]
        self.kls.append(kl)
        now = metrics["policy/entropy"]
        first = self.first_entropy = now if self.first_entropy is None else self.first_entropy
        if "reward/ensemble_std" in metrics:  # a reward-model ensemble (tether.rl.reward.ensemble)
            self.first_spread = self.first_spread or (metrics["objective/score"],
                                                      metrics["reward/ensemble_std"])
        if metrics["policy/collapsed"]:
            self._warn("collapse", f"batch {step}: the policy is collapsing (entropy "
                       f"{metrics['policy/entropy']:.3f} nats/token, KL {kl:.1f} nats at beta "
                       f"{beta:.3g}); lower --lr, raise --beta, or stop it with --max-kl")
        if beta > 0 and kl > self.drift_kl and kl > DRIFT_GROWTH * max(self.kls[0], 0.0):
            moving = "rising" if now > first else "falling" if now < first else "unchanged"
            self._warn("drift", f"batch {step}: the KL to the reference is growing fast "
                       f"({self.kls[0]:.1f} -> {kl:.1f} nats in {len(self.kls) - 1} batches at "
                       f"beta {beta:.3g}) with the entropy {moving} ({first:.2f} -> {now:.2f} "
                       "nats/token); lower --lr, raise --beta, or cap it with --max-kl "
                       "(docs/ppo.md, \"Choosing --max-kl\")" + self._disagreement(metrics))
        if self.max_kl > 0 and self.max_kl_to == "sft" and metrics["objective/kl_sft"] > self.max_kl:
            raise TetherError(f"batch {step}: the KL to the SFT model is "
                              f"{metrics['objective/kl_sft']:.2f} nats, past --max-kl "
                              f"{self.max_kl:g} (--max-kl-to sft), at beta {beta:.3g}; stopped, "
                              "earlier checkpoints are kept. Lower --lr, raise --beta or move "
                              "the reference less often")
        if self.max_kl > 0 and self.max_kl_to == "anchor" and kl > self.max_kl:
            raise TetherError(f"batch {step}: the KL to the reference is {kl:.2f} nats, past "
                              f"--max-kl {self.max_kl:g}, at beta {beta:.3g}; stopped, earlier "
                              "checkpoints are kept. Lower --lr or raise --beta")

    def _disagreement(self, metrics: dict[str, float]) -> str:
        """The drift warning's last clause for an ensemble whose members disagree more while the
        proxy rises: the policy is moving where the reward models are unsure (Coste et al.
        2024), which a single model cannot show."""
        spread = (metrics.get("objective/score"), metrics.get("reward/ensemble_std"))
        (score0, std0), (score, std) = self.first_spread or spread, spread
        if std is None or not (score > score0 and std > std0):  # (None: a single reward model)
            return ""
        return (f"; the reward models disagree more as the proxy rises (members' std {std0:.3g} "
                f"-> {std:.3g} while the score went {score0:.3g} -> {score:.3g}): the policy is "
                "exploiting where they are unsure; try --reward-aggregate min or uwo:LAMBDA "
                "(docs/rm.md, \"Ensembles\")")

    def check_learned(self, step: int, message: str | None, trained: bool) -> None:
        """Count a batch that gave the policy a loss; warn (each time) about one that taught it
        nothing, `message` (`nothing_learned`)."""
        if trained and self.trained is not None:
            self.trained += 1
        if message is not None and not self.quiet:
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def check_trained(self, cfg: PPOConfig) -> None:
        """At the run's end, before the final policy is written: a run in which no batch gave the
        policy a loss would save the starting policy as if it had been trained."""
        if self.trained == 0:
            raise TetherError(f"no batch of this run trained the policy: in all {cfg.n_batches} "
                              f"batches {_truncated(cfg, None)} and --mask-truncated left "
                              "nothing to train on, so final/ was not written (the checkpoints "
                              f"are kept); {_truncation_fix(cfg)}")

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self.warned and not self.quiet:
            print(f"warning: {message}", file=sys.stderr, flush=True)
        self.warned.add(kind)


def watch_for(cfg: PPOConfig, quiet: bool) -> Watch:
    drift = max(DRIFT_KL, 2 * cfg.kl_target) if cfg.kl_ctl == "adaptive" else DRIFT_KL
    return Watch(cfg.max_kl, cfg.max_kl_to, drift, quiet)


def nothing_learned(step: int, rows: int, loss_rows: int, zero_advantages: bool,
                    cfg: PPOConfig, has_critic: bool) -> str | None:
    """Why batch `step` of `rows` responses taught the policy nothing, with the fix, or None.

    Two ways: --mask-truncated dropped every response from the policy's loss (none ended, so no
    minibatch took a step, or with a critic only the critic learned), or every advantage of the
    group estimators is exactly 0 (each prompt's responses scored alike, so the surrogate has no
    gradient; a KL loss term may still pull toward the reference). The optimizer and schedule
    behave as they did; this names the batch."""
    if loss_rows == 0:
        only = " for the policy (only the critic learned)" if has_critic else ""
        return (f"batch {step}: {_truncated(cfg, rows)} and --mask-truncated left nothing to "
                f"train on{only}; {_truncation_fix(cfg)}")
    if zero_advantages and ADVANTAGES[cfg.advantage].compares_group:
        fix = (f"even after --dynamic-sampling {cfg.dynamic_sampling} rounds: check that the "
               "reward tells responses apart" if cfg.dynamic_sampling else
               "check that the reward tells responses apart, or resample such groups with "
               "--dynamic-sampling 3")
        return (f"batch {step}: every advantage is 0 (each prompt's {cfg.samples_per_prompt} "
                f"responses scored alike), so the reward taught the policy nothing; {fix}")
    return None


def _truncated(cfg: PPOConfig, rows: int | None) -> str:
    """That all `rows` responses (episodes) of a batch, or with None every one of the run's,
    never ended."""
    if cfg.episodic:
        return (f"all {rows} episodes were cut off before they ended" if rows is not None
                else "every episode was cut off before it ended")
    limit = f"reached --max-new-tokens {cfg.max_new_tokens}"
    return f"all {rows} responses {limit}" if rows is not None else f"every response {limit}"


def _truncation_fix(cfg: PPOConfig) -> str:
    limits = ("--max-new-tokens, --max-turns or --max-episode-tokens" if cfg.episodic
              else "--max-new-tokens")
    return f"raise {limits} or drop --mask-truncated"
