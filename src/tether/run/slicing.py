"""Every split of a batch into rows, in one place: each rank's contiguous slice of a global batch,
its micro-batches, the chunks of a scoring pass, and the rows a rank updates in PPO's first epoch.

Under torchrun every rank must call a wrapped model equally often (DDP syncs buffers and FSDP2
gathers parameters in each call), so the helpers here give every rank the same number of pieces,
padding a short one with a borrowed row marked not real.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from tether.data.packing import rank_token_cuts
from tether.run import distributed
from tether.run.checkpoint import reshard
from tether.run.distributed import Dist


def rank_slice(n: int, d: Dist) -> slice:
    """This rank's contiguous part of `n` global rows: rank r takes rows [r*n/W, (r+1)*n/W).

    Contiguous slices keep a prompt's k samples (consecutive rows) on one rank when k divides the
    per-rank batch. Sizes differ by at most one when W does not divide n (a short last batch)."""
    start = n * d.rank // d.world_size
    return slice(start, n * (d.rank + 1) // d.world_size)


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
    size, extra = divmod(len(rows), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        if end > start:
            out.append(rows[start:end])
        start = end
    return out


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
    size, extra = divmod(len(mine), n_micro)
    out, start = [], 0
    for i in range(n_micro):
        end = start + size + (1 if i < extra else 0)
        out.append((mine[start:end], True) if end > start else ([indices[0]], False))
        start = end
    return out


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
    rank's whole share of a minibatch of `minibatch_size` global rows."""
    return micro_batch_size or minibatch_size // d.world_size


def token_parts(lengths: list[int], budget: int, d: Dist) -> list[list[list[int]]]:
    """Every rank's micro-batches of a minibatch whose rows hold `lengths` real tokens, under the
    token budget `budget` (--micro-batch-tokens), as positions into the minibatch: rows dealt to
    the ranks for even token sums, each rank's cut first-fit decreasing, and as many micro-batches
    on every rank (`tether.data.packing.rank_token_cuts`). An empty micro-batch is a rank's turn
    to run a borrowed row whose loss counts 0 (every rank calls the wrapped model equally often).
    One process: `token_budget_cut` of the whole minibatch."""
    return rank_token_cuts(lengths, budget, d.world_size)


def epoch0_rows(batch: int, minibatch: int, d: Dist, rank: int | None = None) -> torch.Tensor:
    """The global rows rank `rank` (default: this one) updates in the first epoch: its share of
    each minibatch of the rollout order. Scoring these rows in the update's micro-batches keeps
    the first epoch's ratio exactly 1."""
    d = d if rank is None else replace(d, rank=rank)
    return torch.cat([torch.arange(start, min(start + minibatch, batch))[
        rank_slice(min(minibatch, batch - start), d)] for start in range(0, batch, minibatch)])

