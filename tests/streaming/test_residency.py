"""Bucket residency's parts (``streaming/arena.py``, ``mover.py``, ``offload.py``) on vectors shaped like a two-buffer
grad buffer (float64 + float32 parts), without a model: slots carved once from slabs and reused, no allocation per
move (``torch.empty`` & co. counted), exact round trips, the eviction order of the policy against LRU, prefetch (and
that it never evicts a vector needed sooner), the routed vector never evicted, the arenas' limits and their errors,
the copy accounting. The learner-level exactness and memory bounds are in ``test_offload.py``.
"""

import pytest
import torch

from megatron_tsync.streaming import arena, offload
from megatron_tsync.streaming.arena import ALIGN, ArenaFull, SlotArena, SlotLayout
from megatron_tsync.streaming.buckets import BucketPool, GradVector
from megatron_tsync.streaming.mover import Mover
from megatron_tsync.streaming.offload import Residency, ResidencyConfig


class Router:
    """What residency asks of ``GradRouter``: the accumulator's shapes, the routed vector, dropping cached views."""

    def __init__(self):
        self.accumulator = GradVector([torch.zeros(1000, dtype=torch.float64), torch.zeros(37, dtype=torch.float32)])
        self.current = self.accumulator
        self.dropped = 0

    def drop_views(self, v):
        assert v is not self.current
        self.dropped += 1


def _res(n_device=3, host_gib=None, policy="queued", bound=8):
    r = Router()
    res = Residency(r, ResidencyConfig(max_device_vectors=n_device, host_gib=host_gib, policy=policy))
    res.begin_step(bound)
    return r, res, BucketPool(r.accumulator, keep_free=False)


def _fill(v, seed):
    g = torch.Generator().manual_seed(seed)
    for p in v.parts:
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
    return [p.clone() for p in v.parts]


def _where(res, v):
    return "device" if any(res.device_arena.owns(p) for p in v.parts) else "host" if all(
        res.host_arena.owns(p) for p in v.parts) else "elsewhere"


def test_layout_and_arena_carve_slabs_once():
    like = [torch.zeros(1000, dtype=torch.float64), torch.zeros(37, dtype=torch.float32)]
    lay = SlotLayout(like)
    assert lay.offsets == (0, 8000) and lay.slot_bytes == 8000 + 192 and lay.vector_bytes == 8148  # 148 → 192
    assert all(o % ALIGN == 0 for o in lay.offsets)
    a = SlotArena(lay, 5, torch.device("cpu"), slab_bytes=2 * lay.slot_bytes + 1)
    assert len(a.slabs) == 3 and a.capacity == 5 and a.nbytes == 5 * lay.slot_bytes  # slabs of 2, 2, 1 slots
    slots = [a.take() for _ in range(5)]
    assert [s.index for s in slots] == [0, 1, 2, 3, 4]
    assert all([p.dtype for p in s.parts] == [torch.float64, torch.float32] and s.parts[0].shape == (1000,)
               for s in slots)
    ptrs = {p.data_ptr() for s in slots for p in s.parts}
    assert len(ptrs) == 10 and all(a.owns(p) for s in slots for p in s.parts)
    with pytest.raises(ArenaFull, match="all 5 slots"):
        a.take()
    a.give(slots[3])
    assert a.take() is slots[3]  # reused, not reallocated
    assert not a.owns(torch.zeros(3))


def test_moves_are_exact_and_allocate_nothing(monkeypatch):
    r, res, pool = _res(n_device=2, bound=6)
    vs = [res.acquire(pool, f"Q:g{i}", f"g{i}") for i in range(6)]  # 4 evictions into the host arena
    ref = {id(v): _fill(v, i) for i, v in enumerate(vs)}
    calls = []
    for name in ("empty", "zeros", "empty_like", "zeros_like", "ones"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1])
    slabs = (len(res.device_arena.slabs), len(res.host_arena.slabs))
    for order in ([0, 1], [5, 2], [3, 4, 0], [1, 5], [2, 3]):
        for i in order:
            res.need(vs[i])
            assert _where(res, vs[i]) == "device"
        assert all(_where(res, v) in ("device", "host") for v in vs)
    monkeypatch.undo()
    assert calls == [] and (len(res.device_arena.slabs), len(res.host_arena.slabs)) == slabs
    assert pool.stats.allocated == 0 and pool.stats.in_use == 6
    for v in vs:
        res.need(v)
        assert all(torch.equal(p, q) for p, q in zip(v.parts, ref[id(v)]))  # bit-exact round trips
    s = res.step_stats()
    assert s["peak_device"] == 2 and s["host_in_use"] == 4 and s["host_slots"] == 4  # bound 6 − 2 device slots
    assert s["bytes_moved"] == (s["to_host"] + s["to_device"]) * res.device_arena.layout.vector_bytes > 0


def test_eviction_keeps_queued_groups_lru_does_not():
    """Device [a(g0), b(g1), c(g2)], a the least recently used; g0 and g2 have queued work: a new vector evicts b
    (no queued member); LRU evicts a. Among queued groups the one used furthest ahead goes first."""
    for policy, evicted in (("queued", "b"), ("lru", "a")):
        r, res, pool = _res(n_device=3, policy=policy)
        named = {n: res.acquire(pool, n, g) for n, g in (("a", "g0"), ("b", "g1"), ("c", "g2"))}
        res.plan(["g2", None, "g0"])
        res.acquire(pool, "d", "g3")
        assert [n for n, v in named.items() if _where(res, v) == "host"] == [evicted], policy
    r, res, pool = _res(n_device=3)
    a, c, d = (res.acquire(pool, n, g) for n, g in (("a", "g0"), ("c", "g2"), ("d", "g3")))
    res.plan(["g0", "g3", "g2"])
    res.acquire(pool, "e", "g4")
    assert _where(res, c) == "host" and _where(res, a) == _where(res, d) == "device"


def test_routed_vector_is_never_evicted():
    r, res, pool = _res(n_device=2, policy="lru")
    q = res.acquire(pool, "Q:g0", "g0")
    r.current = q  # backward writes into it
    for i in range(1, 5):
        res.acquire(pool, f"Q:g{i}", f"g{i}")
        assert _where(res, q) == "device"
    r.current = r.accumulator


def test_prefetch_brings_the_next_group_and_counts_a_hit():
    r, res, pool = _res(n_device=3)
    q = {g: res.acquire(pool, f"Q:{g}", g) for g in ("g0", "g1", "g2", "g3")}  # q[g0] evicted (LRU among idle)
    assert _where(res, q["g0"]) == "host"
    res.plan(["g3", "g0"])  # microbatch 0 writes g3, microbatch 1 writes g0
    assert res.stats.prefetched == 0  # g3 is on the device already
    res.advance(1)  # microbatch 0's backward started: prefetch g0 in place of an idle group's vector
    assert _where(res, q["g0"]) == "device" and res.stats.prefetched == 1
    assert _where(res, q["g3"]) == "device"
    moved = res.stats.to_device
    res.need(q["g0"])
    assert res.stats.prefetch_hits == 1 and res.stats.to_device == moved  # no copy at the point of use


def test_prefetch_never_evicts_a_vector_needed_sooner():
    r, res, pool = _res(n_device=3)
    q = {g: res.acquire(pool, f"Q:{g}", g) for g in ("g0", "g1", "g2", "g3")}
    res.plan(["g1", "g2", "g3", "g0"])  # every device vector is used before g0
    res.prefetch("g0")
    assert _where(res, q["g0"]) == "host" and res.stats.prefetched == 0 and res.stats.to_host == 1


def test_queued_policy_moves_less_than_lru_on_a_cyclic_schedule():
    """Groups written round-robin (interleaved arrivals) with 3 device slots for 4 groups: LRU evicts exactly the
    vector needed next, every time; the schedule-aware policy keeps most of them."""
    moves = {}
    for policy in ("queued", "lru"):
        r, res, pool = _res(n_device=3, policy=policy)
        q = {g: res.acquire(pool, f"Q:{g}", g) for g in ("g0", "g1", "g2", "g3")}
        sched = ["g0", "g1", "g2", "g3"] * 5
        res.plan(sched)
        for i, g in enumerate(sched):
            res.need(q[g])
            res.advance(i + 1)
        moves[policy] = res.stats.to_device + res.stats.to_host
    assert moves["queued"] < moves["lru"] / 2, moves


def test_release_frees_the_slot_and_refuses_offloaded_vectors():
    r, res, pool = _res(n_device=2)
    a, b, c = (res.acquire(pool, n, n) for n in "abc")
    assert _where(res, a) == "host"
    with pytest.raises(AssertionError, match="released while offloaded"):
        res.release(a)
    res.release(b)
    assert res.device_arena.free == 1 and res.stats.device_in_use == 1


def test_arena_limits_and_errors(monkeypatch):
    with pytest.raises(ValueError, match=">= 2"):
        Residency(Router(), ResidencyConfig(max_device_vectors=1))
    slot = SlotLayout(Router().accumulator.parts).slot_bytes
    assert ResidencyConfig(device_gib=3.5 * slot / 2**30).device_slots(slot) == 3
    assert ResidencyConfig(max_device_vectors=2, device_gib=3.5 * slot / 2**30).device_slots(slot) == 2
    with pytest.raises(ValueError, match="--bucket-device-gib .* holds 1 bucket vector"):
        ResidencyConfig(device_gib=1.5 * slot / 2**30).device_slots(slot)
    r, res, pool = _res(n_device=2, host_gib=1.5 * slot / 2**30)  # one host slot, whatever the bound
    assert res.host_arena.capacity == 1
    res.acquire(pool, "a", "a"), res.acquire(pool, "b", "b"), res.acquire(pool, "c", "c")
    with pytest.raises(ArenaFull, match="--bucket-host-gib"):
        res.acquire(pool, "d", "d")
    r, res, pool = _res(n_device=2, bound=2)
    monkeypatch.setattr(arena, "host_available_bytes", lambda: 10 * slot)
    with pytest.raises(ValueError, match="--max-open-groups, or set --bucket-host-gib"):
        res.begin_step(2 + 20)  # 20 host slots > 0.8 × 10
    res.begin_step(2 + 8)
    assert res.host_arena.capacity == 8 and len(res.host_arena.slabs) == 1  # one slab for the growth


def test_mover_cpu_copies_synchronously_and_accounts():
    lay = SlotLayout([torch.zeros(300, dtype=torch.float64)])
    a = SlotArena(lay, 2, torch.device("cpu"))
    src, dst = a.take(), a.take()
    src.parts[0].copy_(torch.arange(300.0, dtype=torch.float64))
    m = Mover(torch.device("cpu"))
    m.copy(dst, src)
    m.ready(dst)  # nothing pending on CPU
    assert torch.equal(dst.parts[0], src.parts[0]) and src.side is None and dst.side is None
    assert m.bytes_moved == 2400 and m.copies == 1
    assert m.take_wait_s() > 0 and m.take_wait_s() == 0.0  # reset by the read
