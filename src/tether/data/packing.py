"""Sequence packing: the padding taken out of a batch.

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

A packed row's sequences are chosen as a token-budget micro-batch's rows are, first-fit
decreasing with the row width as the budget (`tether.run.slicing.token_budget_cut`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tether.run.slicing import token_budget_cut


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
    # the sequences of each packed row: `token_budget_cut` with the row width as the budget, empty
    # sequences dropped (they have no slot)
    nonempty = [i for i, n in enumerate(n_of) if n > 0]
    parts = token_budget_cut([n_of[i] for i in nonempty], width) if nonempty else [[]]
    bins = [[nonempty[j] for j in part] for part in parts]
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
