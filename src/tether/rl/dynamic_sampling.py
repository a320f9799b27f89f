"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO", sec. 3.2, eq. 11): a rollout batch keeps only
the groups whose k responses do not all score the same, refilled from further prompts so that
the batch keeps its size.

Why: under rloo and grpo a group of equal scores has zero advantage (every response equals its
baseline), so it adds no policy gradient; as training succeeds on more prompts, more groups are
all-correct, and a fixed-size batch carries fewer responses that teach anything. The filter looks
at the scores the advantages see (the raw score less --missing-eos-penalty and
--overlong-penalty, before normalisation). With the KL in the reward a group's returns still
differ through their KL, so the filter drops groups that carry KL signal: DAPO runs it with
beta = 0, and it suits --kl-in loss or --beta 0 best.

`collect` draws through a callable and knows nothing of models or ranks: `draw(0)` is the batch's
own prompts, `draw(j)` for j >= 1 a further round of as many prompts. Every rank draws the same
global rows (gathered), so every rank keeps the same ones.

A long search is never silent: while a batch is still short, a note every `NOTE_EVERY_S`
seconds says how far it got, and a batch that ran out of rounds says so and what it holds
instead (a reward that is constant on every response finds no group to keep: each batch draws
all its rounds). Rounds with nothing to keep are let go at once, so memory holds only the
rounds the batch is made of.

The same refill replaces the groups that hold a row the reward pool could not score
(tether.rl.reward.pool, --reward-workers): such a group is dropped, with or without
--dynamic-sampling, named in a warning and counted (reward_pool/failed), and never used to top a
batch up. Without --dynamic-sampling up to FAILURE_ROUNDS further draws replace them; a batch
still short after its draws ends the run with one line (BatchUnscored) rather than train on
fewer groups, or on a score that is not one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tether.advantages import varied_groups
from tether.errors import TetherError
from tether.rl.reward import FailedRows, NonFiniteScore
from tether.rl.rollout import Rollout, concat_rollouts

NOTE_EVERY_S = 30.0  # how often a batch still short says how far it got
# Without --dynamic-sampling: the most further draws that replace the groups the reward pool
# could not score (a batch whose rows keep failing: an endpoint down, a bug that raises on every
# response) before the run ends with one line
FAILURE_ROUNDS = 4


class BatchUnscored(NonFiniteScore):
    """The reward pool's failures left a batch without enough scored groups after every draw
    allowed; the loop names its batch, as it does for a NonFiniteScore (which this is)."""
WHY_EQUAL = ("the reward may be constant: check it; or the prompts are too easy or too hard for "
             "the policy")


@dataclass
class Drawn:
    """One round of a batch, global rows: the prompts, what was sampled and how it scored."""

    prompts: list[str]  # [B] prompt texts
    rollout: Rollout  # B rows
    raw_scores: torch.Tensor  # [B] the reward's scores
    scores: torch.Tensor  # [B] what the filter judges: the raw scores with the length penalties
    turn_rewards: torch.Tensor | None = None  # [B, R] episodes: each turn's reward on its token
    stats: dict[str, float] = field(default_factory=dict)  # the source's (env/...)
    failed: FailedRows | None = None  # the rows the reward pool could not score (None: no pool)

    def select(self, rows: list[int]) -> Drawn:
        index = torch.tensor(rows, dtype=torch.long)
        device = self.rollout.input_ids.device
        return Drawn([self.prompts[i] for i in rows], self.rollout.select(index.to(device)),
                     self.raw_scores[index.to(self.raw_scores.device)],
                     self.scores[index.to(self.scores.device)],
                     None if self.turn_rewards is None else self.turn_rewards[index.to(device)],
                     self.stats)


def collect(draw: Callable[[int], Drawn], k: int, max_rounds: int, pad_token_id: int,
            say: Callable[[str], None] = print, warn: Callable[[str], None] | None = None,
            dynamic: bool = True) -> tuple[Drawn, dict[str, float]]:
    """A batch of as many groups as `draw(0)` holds. With `dynamic` (--dynamic-sampling): each
    group's scores varied, drawn from at most `max_rounds` further rounds; a batch still short is
    topped up with dropped groups of equal scores, round 0's first, in order (their advantage is
    0: they only add the KL term's gradient). Either way a group with a row the reward pool
    could not score (`Drawn.failed`) is dropped and drawn again (without `dynamic`: round 0 with
    no failure is the batch as it is), and a batch that still lacks scored groups after
    `max_rounds` further rounds raises BatchUnscored. `say`: where the notes of a long search go
    (module docstring), without the `note: ` and batch prefix; `warn`: where each draw's failed
    rows are named (without the `warning: ` and batch prefix).

    Returns the batch (groups in the order drawn) and its stats: with `dynamic`,
    `rollout/dynamic_rounds` (extra rounds drawn), `rollout/varied_groups` (share of the batch's
    groups with spread) and `rollout/equal_groups_first` (share of round 0's groups that were
    all equal); with a pool, `failure_stats`.
    """
    first = draw(0)
    if not dynamic and first.failed is None:  # no reward pool: nothing is ever refilled (nor
        return first, {}  # entered here: the plain batch's path stays in its own files)
    if not dynamic and not _has_failures(first):  # no failure: nothing is refilled
        return first, failure_stats([first], k, 0, dynamic)
    if dynamic and first.rollout.episode is not None:
        raise TetherError("--dynamic-sampling cannot regroup episodes that a chat template split "
                          "into segments; use an append-only template or drop --dynamic-sampling")
    groups = len(first.prompts) // k
    drawn_all, rounds, keeps, spares = _search(draw, first, k, max_rounds, say, warn, dynamic)
    # the batch's (round, group) pairs: the kept groups in the order drawn, then spares in the
    # order drawn, `groups` at most; varied_count of them were kept rather than spares
    chosen = [(r, g) for r, keep in enumerate(keeps) for g in keep.nonzero().flatten().tolist()]
    chosen = chosen[:groups]
    varied_count = len(chosen)
    chosen += [(r, g) for r, spare in enumerate(spares)
               for g in spare.nonzero().flatten().tolist()][:groups - varied_count]
    if len(chosen) < groups:
        raise BatchUnscored(_unscored(drawn_all, k, len(chosen), groups))
    if dynamic and varied_count < groups:
        say(f"--dynamic-sampling {max_rounds} drew all its rounds and found {varied_count} of "
            f"{groups} groups with differing rewards: the batch is topped up with "
            f"{groups - varied_count} groups of equal rewards, which add only the KL term's "
            f"gradient ({WHY_EQUAL})")
    batch = _joined(rounds, chosen, k, pad_token_id, first.stats)
    stats = failure_stats(drawn_all, k, len(drawn_all) - 1, dynamic)
    if dynamic:
        stats |= {"rollout/dynamic_rounds": float(len(drawn_all) - 1),
                  "rollout/varied_groups": varied_count / groups,
                  # round 0's scored groups of equal scores (a failed group is neither)
                  "rollout/equal_groups_first": float(spares[0].float().mean())}
    return batch, stats


def _search(draw: Callable[[int], Drawn], first: Drawn, k: int, max_rounds: int,
            say: Callable[[str], None], warn: Callable[[str], None] | None, dynamic: bool
            ) -> tuple[list[Drawn], list[Drawn | None], list[torch.Tensor], list[torch.Tensor]]:
    """Rounds drawn until they hold a batch of groups to keep, or `max_rounds` further ones ran
    out (`collect`): (every round, for the failure counts; the rounds kept for their groups,
    None where nothing is; each round's [G] groups to keep; each round's spares, scored groups
    of equal scores that may top a batch up)."""
    groups = len(first.prompts) // k
    drawn_all = [first]  # every round, for the failure counts (failed rounds' tensors: freed)
    rounds: list[Drawn | None] = [first]
    keeps, spares = [], []
    found = spare_found = 0
    noted = time.monotonic()
    while True:
        drawn = drawn_all[-1]
        usable = ~_failed_groups(drawn, k)
        varied = varied_groups(drawn.scores, k) & usable if dynamic else usable
        keeps.append(varied)
        spares.append(usable & ~varied)
        _warn_failures(drawn, k, warn)
        found += int(varied.sum())
        # a round's spares are kept only while those kept so far could fall short of what the
        # batch may still lack (with no failure, round 0's always suffice: later rounds free)
        wanted = spare_found < groups - found and bool(spares[-1].any())
        spare_found += int(spares[-1].sum())
        if len(rounds) < len(drawn_all):  # round 0 is kept as it is
            rounds.append(drawn if varied.any() or wanted else None)  # nothing to keep: freed
        if found >= groups or len(drawn_all) > max_rounds:
            break
        more = len(drawn_all)
        if dynamic and more > 1 and time.monotonic() - noted >= NOTE_EVERY_S:
            noted = time.monotonic()
            say(f"dynamic sampling round {more - 1} of {max_rounds} has found {found} of "
                f"{groups} groups with differing rewards ({WHY_EQUAL})")
        drawn_all.append(draw(more))
        old = drawn_all[-2]  # kept for its failure counts alone: its rollout is not needed
        drawn_all[-2] = Drawn(old.prompts, None, old.raw_scores, old.scores, None, {}, old.failed)
    return drawn_all, rounds, keeps, spares


def _joined(rounds: list[Drawn | None], chosen: list[tuple[int, int]], k: int,
            pad_token_id: int, stats: dict[str, float]) -> Drawn:
    """The `chosen` (round, group) pairs' rows as one batch, in the order drawn."""
    parts = [drawn.select(rows) for r, drawn in enumerate(rounds)
             if (rows := [g * k + j for rr, g in chosen if rr == r for j in range(k)])]
    rollout = concat_rollouts([part.rollout for part in parts], pad_token_id)
    width = rollout.responses.shape[1]
    turn_rewards = (None if parts[0].turn_rewards is None else torch.cat(
        [F.pad(part.turn_rewards, (0, width - part.turn_rewards.shape[1])) for part in parts]))
    return Drawn([p for part in parts for p in part.prompts], rollout,
                 torch.cat([part.raw_scores for part in parts]),
                 torch.cat([part.scores for part in parts]), turn_rewards, stats)


# ----------------------------------------------------------------- the reward pool's failures

def _has_failures(drawn: Drawn) -> bool:
    return drawn.failed is not None and bool(drawn.failed.failed.any())


def _failed_groups(drawn: Drawn, k: int) -> torch.Tensor:
    """[G] bool: the groups with a row the reward pool could not score."""
    if drawn.failed is None:
        return torch.zeros(len(drawn.prompts) // k, dtype=torch.bool)
    return drawn.failed.failed.cpu().view(-1, k).any(dim=1)


def _warn_failures(drawn: Drawn, k: int, warn: Callable[[str], None] | None) -> None:
    """One line per draw with failed rows: how many, and the first's function, row and cause."""
    if warn is None or not _has_failures(drawn):
        return
    causes = drawn.failed.causes
    row = min(causes)
    dropped = int(_failed_groups(drawn, k).sum())
    more = f" (and {len(causes) - 1} more responses)" if len(causes) > 1 else ""
    warn(f"response {row}: {causes[row]}{more}; {dropped} group{'s' if dropped > 1 else ''} of "
         f"{k} dropped and drawn again (counted in reward_pool/failed)")


def failure_stats(drawn_all: list[Drawn], k: int, redraws: int, dynamic: bool
                  ) -> dict[str, float]:
    """The reward pool's counts over every draw of a batch ({} without a pool):
    `reward_pool/failed` (responses without a score), `reward_pool/failed_groups` (groups dropped for
    them), `reward_pool/retries` (calls made again), and without --dynamic-sampling
    `reward_pool/redraws` (draws made to replace the dropped groups; with it they are
    rollout/dynamic_rounds)."""
    if drawn_all[0].failed is None:
        return {}
    stats = {"reward_pool/failed": float(sum(int(d.failed.failed.sum()) for d in drawn_all)),
             "reward_pool/failed_groups": float(sum(int(_failed_groups(d, k).sum())
                                               for d in drawn_all)),
             "reward_pool/retries": float(sum(int(d.failed.retries.sum()) for d in drawn_all))}
    return stats if dynamic else stats | {"reward_pool/redraws": float(redraws)}


def _unscored(drawn_all: list[Drawn], k: int, have: int, groups: int) -> str:
    """The line of a batch that failures left short."""
    failed = sum(int(d.failed.failed.sum()) for d in drawn_all)
    rows = sum(len(d.prompts) for d in drawn_all)
    last = next(d for d in reversed(drawn_all) if _has_failures(d)).failed.causes
    every = "every response" if failed == rows else f"{failed} of {rows} responses"
    return (f"the reward pool failed on {every} of {len(drawn_all)} draws, leaving {have} of "
            f"{groups} groups of {k} scored; the last: response {min(last)}: "
            f"{last[min(last)]}; fix the reward function (run it by hand on that response), or "
            "raise --reward-retries or --reward-fn-timeout; checkpoints written so far are intact")
