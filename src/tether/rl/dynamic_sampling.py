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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tether.advantages import varied_groups
from tether.errors import TetherError
from tether.rl.rollout import Rollout, concat_rollouts

NOTE_EVERY_S = 30.0  # how often a batch still short says how far it got
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

    def select(self, rows: list[int]) -> Drawn:
        index = torch.tensor(rows, dtype=torch.long)
        device = self.rollout.input_ids.device
        return Drawn([self.prompts[i] for i in rows], self.rollout.select(index.to(device)),
                     self.raw_scores[index.to(self.raw_scores.device)],
                     self.scores[index.to(self.scores.device)],
                     None if self.turn_rewards is None else self.turn_rewards[index.to(device)],
                     self.stats)


def collect(draw: Callable[[int], Drawn], k: int, max_rounds: int, pad_token_id: int,
            say: Callable[[str], None] = print) -> tuple[Drawn, dict[str, float]]:
    """A batch of as many groups as `draw(0)` holds, each group's scores varied, drawn from at
    most `max_rounds` further rounds; a batch still short is topped up with round 0's dropped
    groups, in order (their advantage is 0: they only add the KL term's gradient). `say`: where
    the notes of a long search go (module docstring), without the `note: ` and batch prefix.

    Returns the batch (groups in the order drawn) and its stats: `rollout/dynamic_rounds` (extra
    rounds drawn), `rollout/varied_groups` (share of the batch's groups with spread) and
    `rollout/equal_groups_first` (share of round 0's groups that were all equal).
    """
    rounds: list[Drawn | None] = [draw(0)]
    if rounds[0].rollout.episode is not None:
        raise TetherError("--dynamic-sampling cannot regroup episodes that a chat template split "
                          "into segments; use an append-only template or drop --dynamic-sampling")
    keeps = [varied_groups(rounds[0].scores, k)]
    groups = len(rounds[0].prompts) // k
    found = int(keeps[0].sum())
    noted = time.monotonic()
    while found < groups and len(rounds) <= max_rounds:
        drawn = draw(len(rounds))
        keeps.append(varied_groups(drawn.scores, k))
        found += int(keeps[-1].sum())
        rounds.append(drawn if keeps[-1].any() else None)  # a round with nothing to keep: freed
        more = found < groups and len(rounds) <= max_rounds  # the last round's note is below
        if more and time.monotonic() - noted >= NOTE_EVERY_S:
            noted = time.monotonic()
            say(f"dynamic sampling round {len(rounds) - 1} of {max_rounds} has found {found} of "
                f"{groups} groups with differing rewards ({WHY_EQUAL})")
    if found < groups:
        say(f"--dynamic-sampling {max_rounds} drew all its rounds and found {found} of {groups} "
            f"groups with differing rewards: the batch is topped up with {groups - found} "
            f"groups of equal rewards, which add only the KL term's gradient ({WHY_EQUAL})")
    chosen = [(r, g) for r, keep in enumerate(keeps) for g in keep.nonzero().flatten().tolist()]
    chosen = chosen[:groups]
    varied = len(chosen)
    chosen += [(0, g) for g in (~keeps[0]).nonzero().flatten().tolist()][:groups - varied]
    parts = []
    for r, drawn in enumerate(rounds):
        rows = [g * k + j for rr, g in chosen if rr == r for j in range(k)]
        if rows:
            parts.append(drawn.select(rows))
    rollout = concat_rollouts([part.rollout for part in parts], pad_token_id)
    width = rollout.responses.shape[1]
    turn_rewards = (None if parts[0].turn_rewards is None else torch.cat(
        [F.pad(part.turn_rewards, (0, width - part.turn_rewards.shape[1])) for part in parts]))
    batch = Drawn([p for part in parts for p in part.prompts], rollout,
                  torch.cat([part.raw_scores for part in parts]),
                  torch.cat([part.scores for part in parts]), turn_rewards, rounds[0].stats)
    stats = {"rollout/dynamic_rounds": float(len(rounds) - 1),
             "rollout/varied_groups": varied / groups,
             "rollout/equal_groups_first": float((~keeps[0]).float().mean())}
    return batch, stats
