"""Every split of a batch into rows, in one place: each rank's contiguous slice of a global batch,
its micro-batches (of rows, or of a token budget) and the chunks of a scoring pass.

Token-budget micro-batches. A micro-batch of a fixed row count holds anywhere between a few
short rows' and a few long rows' tokens; its memory is set by its tokens. `token_budget_cut` cuts
a minibatch by first-fit decreasing (FFD) into micro-batches of at most C tokens each, and
`balance_ranks` deals its rows to W ranks by the longest-processing-time rule (LPT). Which rows
share a micro-batch changes nothing in the step: every loss term is divided by the whole
minibatch's counts (tether.rl.update.Counts), never by a micro-batch's.

Under torchrun every rank must call a wrapped model equally often (DDP syncs buffers and FSDP2
gathers parameters in each call), so the helpers here give every rank the same number of pieces,
padding a short one with a borrowed row marked not real.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tether.errors import TetherError
from tether.run import distributed
from tether.run.checkpoint import reshard
from tether.run.distributed import Dist


def rank_slice(n: int, d: Dist) -> slice:
    """This rank's contiguous part of `n` global rows: rank r takes rows [r*n/W, (r+1)*n/W).

    Contiguous slices keep a prompt's k samples (consecutive rows) on one rank when k divides the
    per-rank batch. Sizes differ by at most one when W does not divide n (a short last batch)."""
    return slice(n * d.rank // d.world_size, n * (d.rank + 1) // d.world_size)


def shard(rows: list[Any], d: Dist) -> list[Any]:
    """This rank's part of a global batch (see `rank_slice`)."""
    return rows[rank_slice(len(rows), d)]


def chunks(n: int, size: int) -> list[slice]:
    """`range(n)` as consecutive slices of `size` rows (the last may be shorter)."""
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def micro_batches(rows: list[int], n: int) -> list[list[int]]:
    """`rows` cut into `n` consecutive micro-batches of (near) equal size, empty ones dropped.

    `n` divides `batch_size` (validated), so full batches split evenly; the last batch of an epoch
    may be shorter and then splits into sizes that differ by at most one row. Callers weight each
    micro-batch by its share of the batch's rows or tokens, so uneven sizes are still exact.
    """
    return [part for part in _even_parts(rows, n) if part]


def _even_parts(rows: list[int], n: int) -> list[list[int]]:
    """`rows` cut into `n` consecutive parts whose sizes differ by at most one, the longer ones
    first; a part is empty when there are fewer rows than parts."""
    size, extra = divmod(len(rows), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [rows[start:end] for start, end in itertools.pairwise(bounds)]


def rank_micro_batches(indices: list[int], n_micro: int, d: Dist
                       ) -> list[tuple[list[int], bool]]:
    """This rank's slice of the global batch `indices`, cut into micro-batches: (rows, real).

    One process: `micro_batches` of the whole batch, all real. Under torchrun every rank gets
    exactly `n_micro` entries, because every rank must call the wrapped model equally often (DDP
    syncs buffers and FSDP2 gathers parameters in each call); an entry with no rows of its own (a
    short last batch) borrows the batch's first row and is marked not real: its loss is scaled
    by 0 and its outputs are dropped.
    """
    mine = shard(indices, d)
    if not d.active:
        return [(rows, True) for rows in micro_batches(mine, n_micro)]
    return [(rows, True) if rows else ([indices[0]], False) for rows in _even_parts(mine, n_micro)]


def rank_chunks(n: int, chunk_size: int, d: Dist) -> list[tuple[list[int], bool]]:
    """This rank's slice of `n` rows (evaluation, scoring) in chunks of `chunk_size`: (rows, real).

    Every rank gets the same number of chunks (padded with a not-real chunk of row 0), so the
    wrapped model is called equally often on every rank; gather the real outputs with
    `distributed.all_gather_rows` to get all `n` in order. One process: `range(0, n, chunk_size)`.
    """
    mine = list(range(n))[rank_slice(n, d)]
    most = -(-n // d.world_size)  # the largest slice
    count = -(-most // chunk_size)
    chunks = [mine[i * chunk_size:(i + 1) * chunk_size] for i in range(count)]
    return [(rows, True) if rows else ([0], False) for rows in chunks]


@torch.no_grad()
def gather_outputs(fn: Callable[[list[int]], torch.Tensor], n: int, chunk_size: int,
                   d: Dist, wrapped: nn.Module | None = None) -> torch.Tensor:
    """`fn(rows)` (`[len(rows), k]`, e.g. scores or log-probs of a batch of those rows) for all `n`
    rows, in order, on every rank: each rank runs its slice (`rank_chunks`), then the slices are
    gathered. Every rank calls `fn` equally often, as wrapped models need. Pass `wrapped` (the
    model `fn` calls) to leave it resharded afterwards (FSDP2 keeps the root gathered after a
    no-grad forward; see `checkpoint.reshard`)."""
    outs, out = [], None
    for rows, real in rank_chunks(n, chunk_size, d):
        out = fn(rows)
        if real:
            outs.append(out)
    local = torch.cat(outs) if outs else torch.zeros((0, out.shape[-1]), device=out.device)
    if wrapped is not None:
        reshard(wrapped)
    return distributed.all_gather_rows(local, d)


# ----------------------------------------------------------------------------- PPO's minibatches

def micro_rows(micro_batch_size: int, minibatch_size: int, d: Dist) -> int:
    """Rows per forward on a rank: `micro_batch_size` (--micro-batch-size, per rank), or 0 for the
    rank's whole share of a minibatch of `minibatch_size` global rows (the largest share, where
    the ranks' shares differ: episodes split into segments)."""
    return micro_batch_size or -(-minibatch_size // d.world_size)


def token_parts(lengths: Sequence[int], budget: int, d: Dist) -> list[list[list[int]]]:
    """Every rank's micro-batches of a minibatch whose rows hold `lengths` real tokens, under the
    token budget `budget` (--micro-batch-tokens), as positions into the minibatch: rows dealt to
    the ranks for even token sums (`balance_ranks`), each rank's cut first-fit decreasing
    (`token_budget_cut`), and as many micro-batches on every rank (`equal_counts`). An empty
    micro-batch is a rank's turn to run a borrowed row whose loss counts 0 (every rank calls the
    wrapped model equally often). One process: `token_budget_cut` of the whole minibatch."""
    cuts = []
    for rows in balance_ranks(lengths, d.world_size):
        local = token_budget_cut([lengths[i] for i in rows], budget)
        cuts.append([[rows[j] for j in part] for part in local])
    return equal_counts(cuts, lengths)


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
    caller runs as a borrowed row whose loss counts 0 (`token_parts`)."""
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
