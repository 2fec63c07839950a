"""GroupBuckets' traffic accounting (streaming/accumulator.py): bytes the buckets moved, and the bytes the direct path
and equal-reward cohorts (lazy P) saved, per step."""

import types

import torch

from megatron_tsync.streaming.accumulator import GroupBuckets
from megatron_tsync.streaming.buckets import BucketPool, GradRouter


def _buckets(n: int = 10) -> GroupBuckets:
    buf = types.SimpleNamespace(grad_data=torch.zeros(n, dtype=torch.float64), param_index_map={})
    router = GradRouter(types.SimpleNamespace(buffers=[buf]))
    return GroupBuckets(router, BucketPool(router.accumulator))


def test_counts_bucket_bytes_and_what_cohorts_and_the_direct_path_saved():
    b = _buckets()
    V = 80  # 10 float64
    b.enter("A", 1.0, None), b.enter("A", 1.0, None)  # a cohort: one reward, Q only
    b.close("A", 0.5, lambda rho: 0.0)
    assert b.traffic == {"bucket_bytes": 4 * V, "saved_cohort_bytes": 4 * V, "saved_direct_bytes": 0}
    b.enter("B", 1.0, None), b.enter("B", 0.0, None)  # Q, then P and one shift
    assert b.traffic["bucket_bytes"] == (4 + 1 + 1 + 3) * V
    b.note_direct("B", 0.0, None)  # at the bucket's origin: it would have cost no shift
    assert b.traffic["saved_direct_bytes"] == 0
    b.note_direct("B", 1.0, None)  # a shift saved (P exists already)
    assert b.traffic["saved_direct_bytes"] == 3 * V
    b.close("B", 0.5, lambda rho: 0.0)
    assert b.traffic["bucket_bytes"] == (9 + 3 + 3) * V and b.traffic["saved_cohort_bytes"] == 4 * V
    b.note_direct("C", 1.0, None), b.note_direct("C", 1.0, None)  # no bucket at all: Q's zero-fill and fold
    assert b.traffic["saved_direct_bytes"] == (3 + 4) * V
    b.note_direct("C", 0.0, None)  # then a second reward: a shift and a P (zero-fill, fold)
    assert b.traffic["saved_direct_bytes"] == (3 + 4 + 7) * V
    b.note_direct("D", 1.0, 0.25), b.note_direct("D", 0.0, 0.25)  # α known (Dr.GRPO): no P, the shift only
    assert b.traffic["saved_direct_bytes"] == (14 + 4 + 3) * V
    assert b.traffic_stats() == {"bucket_bytes": 15 * V, "saved_cohort_bytes": 4 * V, "saved_direct_bytes": 21 * V}
    assert b.traffic == {"bucket_bytes": 0, "saved_cohort_bytes": 0, "saved_direct_bytes": 0}  # reset per step
