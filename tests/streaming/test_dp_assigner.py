"""streaming.ready_queue.DataParallelAssigner: the one owner of which DP rank trains a trajectory."""

import pytest

from megatron_tsync.streaming.ready_queue import DataParallelAssigner


def test_arrival_order_round_robin_and_sticky():
    a = DataParallelAssigner(3)
    assert [a.assign(t) for t in ("s0g1t2", "s0g0t0", "s0g1t0", "s0g0t1")] == [0, 1, 2, 0]
    assert a.assign("s0g0t0") == 1  # a later chunk of the same trajectory (turn-level OPD) keeps its rank
    assert a.rank_of("s0g1t0") == 2 and a.rank_of("never", default=7) == 7
    assert a.assign("s0g1t1") == 1  # the sticky repeat did not advance the counter


def test_every_rank_replays_the_same_assignment():
    order = [f"s0g{g}t{i}" for i in range(4) for g in range(3)]
    ranks = []
    for _ in range(2):  # two ranks, each with its own assigner, fed the same broadcast arrival order
        a = DataParallelAssigner(2)
        ranks.append([a.assign(t) for t in order])
    assert ranks[0] == ranks[1] and ranks[0].count(0) == ranks[0].count(1) == 6


def test_bad_size():
    with pytest.raises(ValueError, match="data-parallel size"):
        DataParallelAssigner(0)
