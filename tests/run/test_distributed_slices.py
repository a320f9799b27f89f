"""Which rows each rank takes (no processes: `Dist` says rank and world size)."""

from tether.run.distributed import Dist
from tether.run.slicing import rank_chunks, rank_micro_batches


def test_micro_batches_split_each_ranks_slice_and_pad_empty_ones():
    batch = [10, 11, 12, 13, 14, 15]
    # rank r of 2 takes rows [3r, 3r+3); 2 micro-batches split them 2 + 1
    assert rank_micro_batches(batch, 2, Dist(0, 2)) == [([10, 11], True), ([12], True)]
    assert rank_micro_batches(batch, 2, Dist(1, 2)) == [([13, 14], True), ([15], True)]
    # a short last batch of 2 rows: 1 row per rank, and the second micro-batch has none; it
    # borrows the batch's first row, marked not real, so both ranks call the model twice
    assert rank_micro_batches([7, 9], 2, Dist(1, 2)) == [([9], True), ([7], False)]
    # one process: the old behaviour, empty micro-batches dropped
    assert rank_micro_batches([7, 9], 3, Dist()) == [([7], True), ([9], True)]


def test_chunks_are_equal_in_number_on_every_rank():
    # 5 rows on 2 ranks: rank 0 rows 0-1, rank 1 rows 2-4; chunks of 2 -> 2 chunks each
    assert rank_chunks(5, 2, Dist(0, 2)) == [([0, 1], True), ([0], False)]
    assert rank_chunks(5, 2, Dist(1, 2)) == [([2, 3], True), ([4], True)]
    # fewer rows than ranks: rank_slice gives row 0 to rank 1; rank 0 runs a stand-in
    assert rank_chunks(1, 4, Dist(0, 2)) == [([0], False)]
    assert rank_chunks(1, 4, Dist(1, 2)) == [([0], True)]
    assert rank_chunks(5, 2, Dist()) == [([0, 1], True), ([2, 3], True), ([4], True)]
