"""Sequence packing and token-budget micro-batches: the padding taken out of a batch, and a batch
cut by the tokens it holds rather than by its rows.

Notation: B rows, L padded width, N = sum_b n_b the real tokens of the batch (n_b those of row b),
W ranks, C the token budget of one micro-batch, S the slots of a packed row.

Packing. A padded batch [B, L] holds B * L token slots of which N are real; a forward over it
spends (B * L - N) / (B * L) of its FLOPs on padding, most of it when lengths vary. Packed, the
real tokens of several rows stand one after another in n < B rows of S slots (S: the longest
sequence; `pack_rows`, rows filled first-fit decreasing), or in one row of N (S = N):

    padded [B = 3, L = 4]       packed [n = 2, S = 5]
    [[pad a0 a1 a2],            [[c0 c1 c2 c3 .],         input_ids (. a tail slot)
     [pad pad b0 b1],            [a0 a1 a2 b0 b1]]
     [ c0 c1 c2 c3]]            [[ 0  1  2  3 0],         position_ids
                                 [ 0  1  2  0  1]]

`position_ids` restart at 0 with every sequence: they are what the padded forward gives each real
token (`tether.models.forward.position_ids_from_mask`: 0, 1, ... over a row's real tokens), and
they are how the model tells the sequences apart. transformers (5.x, sdpa and eager) reads a drop
in `position_ids` as a sequence boundary when `attention_mask` is None and no cache is passed
(`masking_utils.find_packed_sequence_indices`) and builds the block-diagonal causal mask itself,
so a token attends to the earlier tokens of its own sequence only: exactly what it saw padded.
`tether.models.packed` runs the forward and checks that per model.

Per-token facts (masks, targets, outputs) travel with the same index: `Packing.pack` takes any
[B, L, ...] tensor to [n, S, ...], `Packing.unpack` takes [n, S, ...] back to [B, L, ...] with
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
    """Where each real token of a padded [B, L] batch sits in the packed rows [n, S]."""

    index: torch.Tensor  # [N] long: flat slot b * L + l of real token i in the padded batch
    slot: torch.Tensor  # [N] long: flat slot r * S + s of real token i in the packed rows
    position_ids: torch.Tensor  # [n, S] long: 0, 1, ... restarting at every sequence
    sequence_ids: torch.Tensor  # [n, S] long: the padded row of each slot (-1 - r in row r's tail)
    lengths: torch.Tensor  # [B] long: n_b, the real tokens of each row (0 for an empty row)
    rows: int  # B
    width: int  # L
    packed_rows: int  # n
    packed_width: int  # S

    @property
    def tokens(self) -> int:  # N
        return int(self.index.numel())

    def pack(self, values: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """[B, L, ...] -> [n, S, ...]: the real slots, sequence after sequence, `fill` in each
        packed row's tail."""
        rest = values.shape[2:]
        flat = values.reshape(self.rows * self.width, *rest)
        out = flat.new_full((self.packed_rows * self.packed_width, *rest), fill)
        out = out.index_put((self.slot,), flat[self.index])
        return out.reshape(self.packed_rows, self.packed_width, *rest)

    def unpack(self, packed: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """[n, S, ...] -> [B, L, ...]: each packed value back in its slot, `fill` in the padding.
        The inverse of `pack` on the real slots; differentiable in `packed`."""
        rest = packed.shape[2:]
        flat = packed.reshape(self.packed_rows * self.packed_width, *rest)
        out = packed.new_full((self.rows * self.width, *rest), fill)
        out = out.index_put((self.index,), flat[self.slot])
        return out.reshape(self.rows, self.width, *rest)


def pack_rows(attention_mask: torch.Tensor, width: int = 0) -> Packing:
    """The packing of a padded batch whose real slots are `attention_mask` [B, L] (1 or True)
    into rows of `width` slots (0: the longest sequence's length, so no row holds more than the
    padded batch's longest; `token_budget_cut` decides which sequences share a row).

    A row's real slots keep their column order (left or right padding, or a hole, alike); a
    sequence's k-th real token gets position k, which is what `position_ids_from_mask` gives it
    padded:

        position_ids = concat over the sequences of a packed row of (0, 1, ..., n_b - 1)

    A packed row's tail (fewer than S tokens fit) holds `fill` tokens numbered 0, 1, ... as a
    sequence of their own, which nothing reads. Why rows of the longest length and not one row of
    N: sdpa and eager attention cost (row length)^2 per row whatever the mask, so one row of N
    tokens costs N^2 against the padded B L^2; rows of width L cost n L^2 with n < B. Kernels that
    take sequence boundaries (flash-attention's varlen) cost sum n_b^2 either way.
    """
    real = attention_mask.bool()
    rows, padded_width = real.shape
    lengths = real.sum(dim=1)
    n_of = lengths.tolist()
    width = max(width, max(n_of, default=0), 1)  # a sequence is never split over two rows
    bins = _rows_of(n_of, width)
    starts, used = [0] * rows, []  # the slot each sequence starts at; each packed row's end
    for packed_row, members in enumerate(bins):
        start = packed_row * width
        for b in members:
            starts[b], start = start, start + n_of[b]
        used.append(start)
    device = real.device
    index = real.reshape(-1).nonzero().squeeze(-1)  # row-major: row after row, columns in order
    row_of = torch.repeat_interleave(torch.arange(rows, device=device), lengths)  # [N]
    offset = torch.arange(index.numel(), device=device) - (torch.cumsum(lengths, 0) - lengths)[row_of]
    slot = torch.tensor(starts, dtype=torch.long, device=device)[row_of] + offset  # [N]
    every = torch.arange(len(bins) * width, device=device)
    tail = torch.ones(every.shape, dtype=torch.bool, device=device).index_fill(0, slot, False)
    tail_start = torch.tensor(used, dtype=torch.long, device=device)[every // width]
    # the tail of packed row r: positions 0, 1, ... and sequence id -1 - r (its own sequence)
    positions = torch.where(tail, every - tail_start,
                            torch.zeros_like(every).index_put((slot,), offset))
    sequence = torch.where(tail, -1 - every // width,
                           torch.zeros_like(every).index_put((slot,), row_of))
    shape = (len(bins), width)
    return Packing(index, slot, positions.reshape(shape), sequence.reshape(shape), lengths, rows,
                   padded_width, len(bins), width)


def _rows_of(lengths: list[int], width: int) -> list[list[int]]:
    """The sequences of each packed row: `token_budget_cut` with the row width as the budget,
    empty sequences dropped (they have no slot)."""
    real = [i for i, n in enumerate(lengths) if n > 0]
    parts = token_budget_cut([lengths[i] for i in real], width) if real else [[]]
    return [[real[j] for j in part] for part in parts]


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
