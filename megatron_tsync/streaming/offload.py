"""Bucket residency: a device cache of bucket vectors over a preallocated host arena, with a policy and prefetch.

Each open group holds one or two gradient-sized vectors (design note §1), each the size of this rank's DDP grad
buffer — 3.4 GB for a 7B model at TP=4/PP=2 in fp32 — so k interleaved groups can need tens of GB per GPU.
Only the bucket a backward is writing into (Q of the trajectory's group), the vectors an origin shift touches
(P += shift·Q) and the vectors a close folds must be on the accelerator, and only at that moment. The batch
accumulator (megatron's own buffer) never moves.

Memory plan (:class:`Residency`, configured by :class:`ResidencyConfig`):

- **device cache**: N preallocated device slots (``--max-device-buckets N``, or as many as ``--bucket-device-gib G``
  holds; the smaller of the two when both are given; N >= 2 since a shift touches P and Q at once). A vector is
  created in a device slot and lives in one slot at a time.
- **host arena**: slabs allocated once (``streaming.arena``; pinned when the device is a GPU), carved into slots.
  Size: ``--bucket-host-gib``, or automatically what the step's open groups can need beyond the device cache (the
  learner's bound, :meth:`Residency.begin_step`), refused with one error when host memory cannot hold it.
- **policy** (which device vector goes to the host when a slot is needed): the learner tells the residency the
  groups its next microbatches and closes will write, in order, then the groups with landed trajectories the planner
  still holds (:meth:`Residency.plan`). Evicted first: vectors of groups with no queued work, least recently used
  first; then those whose next use is furthest away (Belady's rule on the known schedule). Never the vector gradients
  are routed into, nor those the current operation needs.
- **prefetch**: when a schedule is planned, the host vectors of its first group are copied back (overlapping the
  first microbatch's forward); when microbatch i's backward starts, those of the group microbatch i + 1 writes
  (:meth:`Residency.advance`: overlapping backward i and forward i + 1 instead of stalling backward i + 1) — each
  only in place of a vector whose next use is later.
- **copies**: one :class:`streaming.mover.Mover` — on CUDA a side stream with events, the compute stream waiting
  only when it uses a vector; on CPU the same calls, synchronous. No memory is allocated per move: with the host
  arena full, a vector coming in swaps places with the one going out (``Mover.swap``), so the arena needs no spare.

Accounting per step (:meth:`Residency.step_stats`, the learner's ``StepResult.offload``; the run's log row and
TensorBoard ``stream/*``): vectors and bytes resident per tier (now and peak), arena sizes, moves each way, bytes
moved, prefetches and prefetch hits, seconds the learner waited on a copy.

The arithmetic is unchanged: moving a vector is an exact copy, so streamed gradients stay bit-identical to the
no-residency run. On a CPU-only machine "device" and "host" are both host memory: the moves are real copies (the
logic and the accounting are what the tests check), with no memory saved.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from megatron_tsync.streaming.arena import GIB, ArenaFull, Slot, SlotArena, SlotLayout
from megatron_tsync.streaming.buckets import BucketPool, GradRouter, GradVector
from megatron_tsync.streaming.mover import Mover

STAGING_BYTES = 16 << 20  # CUDA: the swap's device staging buffer is at most this (and at most 1/8 of a slot)


@dataclasses.dataclass(frozen=True)
class ResidencyConfig:
    """Where bucket vectors live (module docstring). Residency is on when either device bound is set."""

    max_device_vectors: int | None = None
    """Device cache slots (``--max-device-buckets``); None: bounded by ``device_gib`` only."""
    device_gib: float | None = None
    """Device cache size in GiB (``--bucket-device-gib``); None: ``max_device_vectors`` slots."""
    host_gib: float | None = None
    """Host arena size in GiB (``--bucket-host-gib``); None: sized per step from the learner's bound."""
    slab_gib: float = 1.0
    """Largest single allocation of an arena (a slab holds at least one slot)."""
    policy: str = "queued"
    """Eviction order: "queued" (module docstring) or "lru" (least recently used; a baseline for tests)."""

    @property
    def on(self) -> bool:
        return self.max_device_vectors is not None or self.device_gib is not None

    def device_slots(self, slot_bytes: int, staging_bytes: int = 0) -> int:
        """The device cache's slot count for vectors of ``slot_bytes`` (``device_gib`` also holds the copy engine's
        ``staging_bytes``); one clear error below 2."""
        n = math.inf if self.max_device_vectors is None else self.max_device_vectors
        if self.max_device_vectors is not None and self.max_device_vectors < 2:
            raise ValueError(f"max_device_buckets must be >= 2 (a shift touches P and Q at once), got {n}")
        if self.device_gib is not None:
            fit = int((self.device_gib * GIB - staging_bytes) // slot_bytes)
            if fit < 2:
                raise ValueError(f"--bucket-device-gib {self.device_gib:g} holds {fit} bucket vector(s) of "
                                 f"{slot_bytes / 2**20:.1f} MiB; at least 2 are needed (a shift touches P and Q)")
            n = min(n, fit)
        if n is math.inf:
            raise ValueError("bucket residency needs max_device_vectors or device_gib")
        return int(n)


@dataclasses.dataclass
class OffloadStats:
    device_in_use: int = 0  # vectors in the device cache now
    peak_device: int = 0  # ... at most this step
    host_in_use: int = 0  # vectors in the host arena now
    peak_host: int = 0
    device_bytes: int = 0  # bytes of vectors resident per tier, now (vector bytes, without slot padding)
    host_bytes: int = 0
    peak_device_bytes: int = 0
    peak_host_bytes: int = 0
    device_slots: int = 0  # the device cache's size (slots, bytes allocated)
    device_arena_bytes: int = 0
    host_slots: int = 0  # the host arena's size (slots, bytes allocated, slabs)
    host_arena_bytes: int = 0
    host_slabs: int = 0
    to_host: int = 0  # moves this step
    to_device: int = 0
    prefetched: int = 0  # host→device copies issued ahead of use (part of to_device)
    prefetch_hits: int = 0  # vectors found on the device when needed because a prefetch brought them
    bytes_moved: int = 0  # this step, both directions
    wait_s: float = 0.0  # seconds the learner waited on a copy this step (CUDA: compute-stream stall time)


TB_NAMES = {"device_bytes": "stream/resident_device_bytes", "host_bytes": "stream/resident_host_bytes",
            "peak_device_bytes": "stream/resident_device_bytes_peak",
            "peak_host_bytes": "stream/resident_host_bytes_peak", "bytes_moved": "stream/bytes_moved",
            "wait_s": "stream/copy_wait_s", "prefetch_hits": "stream/prefetch_hits"}
"""TensorBoard tags of the residency statistics (keys of :class:`OffloadStats`)."""


@dataclasses.dataclass
class _Held:
    v: GradVector
    group: str
    slot: Slot
    on_device: bool
    used: int  # logical clock of the last use
    prefetched: bool = False  # on the device because a prefetch brought it, not used since


class Residency:
    """The device cache and host arena of bucket vectors, their policy and their copies (module docstring)."""

    def __init__(self, router: GradRouter, cfg: ResidencyConfig):
        if not cfg.on:
            raise ValueError("Residency needs max_device_vectors or device_gib")
        if cfg.policy not in ("queued", "lru"):
            raise ValueError(f"residency policy must be 'queued' or 'lru', got {cfg.policy!r}")
        if cfg.host_gib is not None and cfg.host_gib <= 0:
            raise ValueError(f"--bucket-host-gib must be > 0, got {cfg.host_gib}")
        layout = SlotLayout(router.accumulator.parts)
        self.device = router.accumulator.parts[0].device
        staging = min(STAGING_BYTES, -(-layout.slot_bytes // 8)) if self.device.type == "cuda" else 0
        n_dev = cfg.device_slots(layout.slot_bytes, staging)
        self.router = router
        self.cfg = cfg
        slab = int(cfg.slab_gib * GIB)
        self.device_arena = SlotArena(layout, n_dev, self.device, slab_bytes=slab, name="bucket device cache")
        n_host = 0 if cfg.host_gib is None else int(cfg.host_gib * GIB // layout.slot_bytes)
        self.host_arena = SlotArena(layout, n_host, torch.device("cpu"), pin=self.device.type == "cuda",
                                    slab_bytes=slab, name="bucket host arena")
        self.mover = Mover(self.device, staging)
        self._held: dict[int, _Held] = {}
        self._clock = 0
        self._upcoming: list[str | None] = []
        self._cursor = 0
        self._pos: dict[str, int] = {}
        self.stats = OffloadStats()
        self._count()

    # ------------------------------------------------------------------ sizing and steps
    def begin_step(self, max_vectors: int) -> None:
        """A new step that holds at most ``max_vectors`` bucket vectors at once: an automatic host arena grows (in
        slabs) to what may not fit in the device cache; the step's counters and peaks restart."""
        if self.cfg.host_gib is None:
            self._grow_host(max(0, max_vectors - self.device_arena.capacity) - self.host_arena.capacity)
        s = self.stats
        s.to_host = s.to_device = s.prefetched = s.prefetch_hits = s.bytes_moved = 0
        s.wait_s = 0.0
        self.mover.bytes_moved = 0
        self.mover.take_wait_s()
        s.peak_device, s.peak_host = s.device_in_use, s.host_in_use
        s.peak_device_bytes, s.peak_host_bytes = s.device_bytes, s.host_bytes
        self._count()

    def step_stats(self) -> dict:
        """This step's statistics (``OffloadStats`` as a dict)."""
        self.stats.wait_s += self.mover.take_wait_s()
        self.stats.bytes_moved = self.mover.bytes_moved
        return dataclasses.asdict(self.stats)

    def _grow_host(self, n: int) -> None:
        self.host_arena.grow_within_host_memory(n, "bucket host arena")

    # ------------------------------------------------------------------ vectors
    def acquire(self, pool: BucketPool, tag: str, group: str, keep: tuple[GradVector, ...] = ()) -> GradVector:
        """A zero vector in a device slot (evicting by the policy if the cache is full), counted by ``pool``."""
        slot = self._device_slot(keep)
        self.mover.ready(slot)
        for p in slot.parts:
            p.zero_()
        v = pool.acquire(tag, parts=slot.parts)
        self._held[id(v)] = _Held(v, group, slot, True, self._tick())
        self._count()
        return v

    def release(self, v: GradVector) -> None:
        """The vector was folded on the device and goes back to the pool: its slot is free again."""
        h = self._held.get(id(v))
        if h is None:
            return
        if not h.on_device:
            raise AssertionError("a bucket vector was released while offloaded")
        del self._held[id(v)]
        self.mover.mark_used(h.slot)
        self.device_arena.give(h.slot)
        self._count()

    def need(self, *vs: GradVector) -> None:
        """Make ``vs`` device-resident now (evicting others by the policy) and wait for their copies."""
        for v in vs:
            h = self._held[id(v)]
            if not h.on_device:
                self._bring(h, keep=vs)
            elif h.prefetched:
                self.stats.prefetch_hits += 1
            h.prefetched = False
            h.used = self._tick()
            self.mover.ready(h.slot)
        self._count()

    # ------------------------------------------------------------------ schedule and prefetch
    def plan(self, upcoming: list[str | None]) -> None:
        """The groups the next operations write, in order (None: an operation that writes no bucket), then the
        groups with queued work; the first group's host vectors are prefetched."""
        self._upcoming = list(upcoming)
        self.advance(0)

    def advance(self, i: int) -> None:
        """Operation ``i`` of the plan comes next: prefetch the host vectors of the first group at or after it."""
        self._cursor = i
        self._pos = {}
        for j in range(len(self._upcoming) - 1, i - 1, -1):
            g = self._upcoming[j]
            if g is not None:
                self._pos[g] = j
        nxt = next((g for g in self._upcoming[i:] if g is not None), None)
        if nxt is not None:
            self.prefetch(nxt)

    def prefetch(self, group: str) -> None:
        """Start copying ``group``'s host vectors to the device, each only into a free slot or in place of a vector
        whose next use is later (never the routed vector or the group's own)."""
        pos = self._pos.get(group, math.inf)
        for h in [h for h in self._held.values() if h.group == group and not h.on_device]:
            if self.device_arena.free == 0:
                victim = self._victim(exclude={id(x.v) for x in self._held.values() if x.group == group})
                if victim is None or self._pos.get(victim.group, math.inf) <= pos:
                    break
                self._exchange(h, victim)
            else:
                self._to_device(h)
            h.prefetched = True
            self.stats.prefetched += 1
        self._count()

    # ------------------------------------------------------------------ internals
    def _device_slot(self, keep: tuple[GradVector, ...]) -> Slot:
        if self.device_arena.free == 0:
            victim = self._victim(exclude={id(k) for k in keep})
            if victim is None:
                raise AssertionError(f"cannot keep {self.device_arena.capacity} bucket vectors on the device: all "
                                     "are in use")
            self._evict(victim)
        return self.device_arena.take()

    def _victim(self, exclude: set[int]) -> _Held | None:
        """The device vector to evict first (module docstring), or None."""
        current = id(self.router.current)
        cands = [h for k, h in self._held.items() if h.on_device and k not in exclude and k != current]
        if not cands:
            return None
        if self.cfg.policy == "lru":
            return min(cands, key=lambda h: h.used)
        return min(cands, key=lambda h: (h.group in self._pos, -self._pos.get(h.group, 0), h.used))

    def _evict(self, h: _Held) -> None:
        try:
            host = self.host_arena.take()
        except ArenaFull:
            if self.cfg.host_gib is not None:
                raise ArenaFull(f"bucket host arena full: --bucket-host-gib {self.cfg.host_gib:g} holds "
                                f"{self.host_arena.capacity} vectors and this step needs more; raise it, or leave "
                                "it unset (sized from the step's open groups)") from None
            self._grow_host(1)  # only when used without begin_step's bound (tests, direct users)
            host = self.host_arena.take()
        self.mover.mark_used(h.slot)
        self.mover.copy(host, h.slot)
        self.device_arena.give(h.slot)
        self._place(h, host, on_device=False)
        self.stats.to_host += 1

    def _bring(self, h: _Held, keep: tuple[GradVector, ...]) -> None:
        if self.device_arena.free == 0:
            victim = self._victim(exclude={id(k) for k in keep})
            if victim is None:
                raise AssertionError(f"cannot keep {self.device_arena.capacity} bucket vectors on the device: all "
                                     "are in use")
            self._exchange(h, victim)
        else:
            self._to_device(h)

    def _exchange(self, h: _Held, victim: _Held) -> None:
        """``h`` (on the host) in, ``victim`` (on the device) out: through a free host slot if there is one, else by
        swapping the two slots' contents (``Mover.swap``: no spare slot needed)."""
        if self.host_arena.free > 0:
            self._evict(victim)
            self._to_device(h)
            return
        self.mover.mark_used(victim.slot)
        dev, host = victim.slot, h.slot
        self.mover.swap(dev, host)
        self._place(victim, host, on_device=False)
        self._place(h, dev, on_device=True)
        self.stats.to_host += 1
        self.stats.to_device += 1

    def _to_device(self, h: _Held) -> None:
        slot = self.device_arena.take()
        self.mover.copy(slot, h.slot)
        self.host_arena.give(h.slot)
        self._place(h, slot, on_device=True)
        self.stats.to_device += 1

    def _place(self, h: _Held, slot: Slot, on_device: bool) -> None:
        self.router.drop_views(h.v)
        h.v.parts = slot.parts
        h.slot, h.on_device = slot, on_device

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _count(self) -> None:
        s, vb = self.stats, self.device_arena.layout.vector_bytes
        s.device_in_use = sum(h.on_device for h in self._held.values())
        s.host_in_use = len(self._held) - s.device_in_use
        s.device_bytes, s.host_bytes = s.device_in_use * vb, s.host_in_use * vb
        s.peak_device = max(s.peak_device, s.device_in_use)
        s.peak_host = max(s.peak_host, s.host_in_use)
        s.peak_device_bytes = max(s.peak_device_bytes, s.device_bytes)
        s.peak_host_bytes = max(s.peak_host_bytes, s.host_bytes)
        s.device_slots, s.device_arena_bytes = self.device_arena.capacity, self.device_arena.nbytes
        s.host_slots, s.host_arena_bytes = self.host_arena.capacity, self.host_arena.nbytes
        s.host_slabs = len(self.host_arena.slabs)


class ResidentVectors:
    """Gradient vectors from a pool, optionally under residency: what ``GroupBuckets`` and ``CanonicalSum`` share.

    ``_acquire`` makes room on the device first (``keep``: vectors that must stay there; ``group``: whose vector it
    is, for the policy), ``_need`` brings vectors back before use, ``_release`` returns one to the pool (and forgets
    the router's cached views of it: under residency a new vector may reuse ``id(v)``)."""

    def __init__(self, router: GradRouter, pool: BucketPool, residency: Residency | None = None):
        self.router = router
        self.pool = pool
        self.residency = residency
        self.accumulator = router.accumulator

    def _acquire(self, tag: str, group: str, keep: tuple[GradVector, ...] = ()) -> GradVector:
        if self.residency is None:
            return self.pool.acquire(tag)
        return self.residency.acquire(self.pool, tag, group, keep)

    def _need(self, *vs: GradVector) -> None:
        if self.residency is not None:
            self.residency.need(*vs)

    def _release(self, v: GradVector) -> None:
        if self.residency is not None:
            self.residency.release(v)
            self.router.drop_views(v)
        self.pool.release(v)
