"""Sequence packing and token-budget micro-batches: the padding taken out of a batch, and a batch
cut by the tokens it holds rather than by its rows.

Notation: B rows, L padded width, N = sum_b n_b the real tokens of the batch (n_b those of row b),
W ranks, C the token budget of one micro-batch.

Packing. A padded batch [B, L] holds B * L token slots of which N are real; a forward over it
spends (B * L - N) / (B * L) of its FLOPs on padding, most of it when lengths vary. Packed, the
real tokens of every row stand one after another in a single row [1, N]:

    padded  [[pad a0 a1 a2],            packed  [a0 a1 a2 b0 b1 c0 c1 c2 c3]      input_ids
             [pad pad b0 b1],                   [ 0  1  2  0  1  0  1  2  3]      position_ids
             [ c0 c1 c2 c3]]

`position_ids` restart at 0 with every sequence: they are what the padded forward gives each real
token (`tether.models.forward.position_ids_from_mask`: 0, 1, ... over a row's real tokens), and
they are how the model tells the sequences apart. transformers (5.x, sdpa and eager) reads a drop
in `position_ids` as a sequence boundary when `attention_mask` is None and no cache is passed
(`masking_utils.find_packed_sequence_indices`) and builds the block-diagonal causal mask itself,
so a token attends to the earlier tokens of its own sequence only: exactly what it saw padded.
`tether.models.packed` runs the forward and checks that per model.

Per-token facts (masks, targets, outputs) travel with the same index: `Packing.pack` takes any
[B, L, ...] tensor to [1, N, ...], `Packing.unpack` takes [1, N, ...] back to [B, L, ...] with
`fill` in the padding; both are gathers/scatters, so gradients flow through them unchanged.

Token-budget micro-batches. A micro-batch of a fixed row count holds anywhere between a few
short rows' and a few long rows' tokens; its memory is set by its tokens. `token_budget_cut` cuts
a minibatch by first-fit decreasing (FFD) into micro-batches of at most C tokens each, and
`balance_ranks` deals its rows to W ranks by the longest-processing-time rule (LPT). Which rows
share a micro-batch changes nothing in the step: every loss term is divided by the whole
minibatch's counts (tether.rl.update.Counts), never by a micro-batch's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tether.errors import TetherError


@dataclass(frozen=True)
class Packing:
    """Where each real token of a padded [B, L] batch sits in its packed row [1, N]."""

    index: torch.Tensor  # [N] long: flat slot b * L + l of packed token i in the padded batch
    position_ids: torch.Tensor  # [1, N] long: 0, 1, ... restarting at every sequence
    lengths: torch.Tensor  # [B] long: n_b, the real tokens of each row (0 for an empty row)
    rows: int  # B
    width: int  # L

    @property
    def tokens(self) -> int:  # N
        return int(self.index.numel())

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] -> [1, N, ...]: the real slots, row after row, in column order."""
        flat = values.reshape(self.rows * self.width, *values.shape[2:])
        return flat[self.index][None]

    def unpack(self, packed: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """[1, N, ...] -> [B, L, ...]: each packed value back in its slot, `fill` in the padding.
        The inverse of `pack` on the real slots; differentiable in `packed`."""
        rest = packed.shape[2:]
        out = packed.new_full((self.rows * self.width, *rest), fill)
        out = out.index_put((self.index,), packed[0])
        return out.reshape(self.rows, self.width, *rest)


def pack_rows(attention_mask: torch.Tensor) -> Packing:
    """The packing of a padded batch whose real slots are `attention_mask` [B, L] (1 or True).

    A row's real slots keep their column order (left or right padding, or a hole, alike); row b's
    k-th real token gets position k, which is what `position_ids_from_mask` gives it padded:

        position_ids = concat_b (0, 1, ..., n_b - 1)
    """
    real = attention_mask.bool()
    rows, width = real.shape
    index = real.reshape(-1).nonzero().squeeze(-1)  # row-major: row after row, columns in order
    lengths = real.sum(dim=1)
    starts = torch.cumsum(lengths, 0) - lengths  # [B] where each row's tokens begin in the pack
    row_of = torch.repeat_interleave(torch.arange(rows, device=real.device), lengths)  # [N]
    positions = torch.arange(index.numel(), device=real.device) - starts[row_of]
    return Packing(index, positions[None], lengths, rows, width)


# ----------------------------------------------------------------------------- token budgets

def token_budget_cut(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Rows 0..n-1 of lengths `lengths` cut into micro-batches of at most `budget` tokens each.

    First-fit decreasing (Johnson 1973): take the rows longest first (ties: lower index first) and
    put each into the first micro-batch it still fits in, opening a new one when none has room. It
    uses at most 11/9 OPT + 6/9 micro-batches (Dosa 2007), and on typical length spreads the
    optimum or one more; the fewer the micro-batches, the fewer forwards and the fuller each.

    A row longer than `budget` alone cannot be split (its tokens attend to each other), so it
    gets a micro-batch of its own, over the budget: the one case where a micro-batch exceeds it.
    Rows of length 0 go with the first micro-batch (they cost nothing).

    Returns the micro-batches in the order they were opened, each its row indices ascending.
    """
    if budget < 1:
        raise TetherError(f"a token budget must be >= 1 token, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        length = lengths[i]
        fit = next((b for b, free in enumerate(room) if length <= free), None)
        if fit is None:
            bins.append([i])
            room.append(budget - length)  # negative for a row over the budget: nothing fits after
        else:
            bins[fit].append(i)
            room[fit] -= length
    return [sorted(rows) for rows in bins]


def balance_ranks(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Rows 0..n-1 dealt to `world` ranks so their token sums are as even as a greedy rule makes
    them: the longest-processing-time rule (Graham 1969), rows longest first (ties: lower index),
    each to the rank with the fewest tokens so far (ties: lower rank). The largest rank's sum is
    at most (4/3 - 1/(3W)) of the best possible.

    Why LPT and not Karmarkar-Karp's differencing: both are near-optimal on many rows; LPT is a
    dozen lines, deterministic, and its bound holds for any input, while KK's advantage shows only
    on few rows of wildly different lengths. Every rank must run the same number of forwards
    under torchrun (`equal_counts`), which neither rule gives by itself.

    Returns each rank's rows, ascending.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ranks: list[list[int]] = [[] for _ in range(world)]
    sums = [0] * world
    for i in order:
        rank = min(range(world), key=lambda r: (sums[r], r))
        ranks[rank].append(i)
        sums[rank] += lengths[i]
    return [sorted(rows) for rows in ranks]


def equal_counts(cuts: list[list[list[int]]], lengths: Sequence[int]) -> list[list[list[int]]]:
    """Every rank's micro-batches made as many as the rank with the most: a rank with fewer splits
    its fullest micro-batch of two or more rows (its last row into a new one; a split never
    exceeds the budget), and when every micro-batch is a single row it gets empty ones, which the
    caller runs as a borrowed row whose loss counts 0 (`tether.run.slicing.rank_micro_batches`)."""
    most = max(len(cut) for cut in cuts)
    out = []
    for cut in cuts:
        cut = [list(rows) for rows in cut]
        while len(cut) < most:
            splittable = [b for b, rows in enumerate(cut) if len(rows) > 1]
            if not splittable:
                cut.append([])
                continue
            fullest = max(splittable, key=lambda b: (sum(lengths[i] for i in cut[b]), -b))
            cut.append([cut[fullest].pop()])
        out.append(cut)
    return out


def rank_token_cuts(lengths: Sequence[int], budget: int, world: int) -> list[list[list[int]]]:
    """A minibatch's rows cut for `world` ranks: `balance_ranks`, then `token_budget_cut` on each
    rank's rows, then `equal_counts`. Returns, per rank, its micro-batches of row indices into
    `lengths`."""
    cuts = []
    for rows in balance_ranks(lengths, world):
        local = token_budget_cut([lengths[i] for i in rows], budget)
        cuts.append([[rows[j] for j in part] for part in local])
    return equal_counts(cuts, lengths)
