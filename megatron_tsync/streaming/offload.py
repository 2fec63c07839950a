"""Host offload of idle gradient buckets: at most N bucket vectors on the accelerator, the rest in host memory.

Each open group holds one or two gradient-sized vectors (design note §1), each the size of this rank's DDP grad
buffer — 3.4 GB for a 7B model at TP=4/PP=2 in fp32 — so k interleaved groups can need tens of GB per GPU.
Only the bucket a backward is writing into (Q of the trajectory's group), the vectors an origin shift touches
(P += shift·Q) and the vectors a close folds must be on the accelerator, and only at that moment. With
``--max-device-buckets N`` the :class:`Residency` keeps at most N bucket vectors on the device, moving the least
recently used idle one to (pinned) host memory when another must come in. The batch accumulator (megatron's own
buffer) never moves.

Cost per move: one gradient-sized copy over PCIe/NVLink-C2C (3.4 GB at ~50 GB/s ≈ 70 ms for the 7B example),
against a long trajectory's forward-backward of seconds. Copies are synchronous here (no side stream): a first,
correct version. On a CPU-only machine "device" and "host" are both host memory: the moves are real copies (the
logic and the accounting are what the tests check), with no memory saved. Not run on a GPU.

The arithmetic is unchanged: moving a vector is an exact copy, so streamed gradients stay bit-identical to the
no-offload run.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

from megatron_tsync.streaming.buckets import BucketPool, GradRouter, GradVector


@dataclasses.dataclass
class OffloadStats:
    device_in_use: int = 0
    peak_device: int = 0
    host_in_use: int = 0
    peak_host: int = 0
    to_host: int = 0
    to_device: int = 0
    bytes_moved: int = 0


class Residency:
    """Where each bucket vector lives; evicts least-recently-used idle vectors beyond ``max_device``."""

    def __init__(self, router: GradRouter, max_device: int):
        if max_device < 2:
            raise ValueError(f"max_device_buckets must be >= 2 (a shift touches P and Q at once), got {max_device}")
        self.router = router
        self.max_device = max_device
        self.device = router.accumulator.parts[0].device
        self.pin = self.device.type == "cuda"
        self._on_device: OrderedDict[int, GradVector] = OrderedDict()  # LRU order, oldest first
        self._on_host: dict[int, GradVector] = {}
        self.stats = OffloadStats()

    # ------------------------------------------------------------------ lifecycle
    def reserve(self, n: int, keep: tuple[GradVector, ...] = ()) -> None:
        """Evict least-recently-used idle vectors until ``n`` more fit on the device."""
        kept = {id(k) for k in keep} | {id(self.router.current)}
        excess = len(self._on_device) + n - self.max_device
        for vid in list(self._on_device):
            if excess <= 0:
                break
            if vid in kept:
                continue
            v = self._on_device.pop(vid)
            self._move(v, torch.device("cpu"))
            self._on_host[vid] = v
            self.stats.to_host += 1
            excess -= 1
        if excess > 0:
            raise AssertionError(f"cannot keep {self.max_device} bucket vectors on the device: all are in use")

    def admit(self, v: GradVector) -> None:
        """A vector fresh from the pool (allocated on the device after :meth:`reserve`)."""
        self._on_device[id(v)] = v
        self._count()

    def forget(self, v: GradVector) -> None:
        """The vector goes back to the pool (it was folded on the device)."""
        if id(v) in self._on_host:
            raise AssertionError("a bucket vector was released while offloaded")
        self._on_device.pop(id(v), None)
        self._count()

    def need(self, *vs: GradVector) -> None:
        """Make ``vs`` device-resident and most recently used, evicting others if needed."""
        for v in vs:
            if id(v) in self._on_device:
                self._on_device.move_to_end(id(v))
        missing = [v for v in vs if id(v) in self._on_host]
        if missing:
            self.reserve(len(missing), keep=vs)
            for v in missing:
                self._move(v, self.device)
                del self._on_host[id(v)]
                self._on_device[id(v)] = v
                self.stats.to_device += 1
        self._count()

    # ------------------------------------------------------------------ internals
    def _move(self, v: GradVector, device: torch.device) -> None:
        parts = []
        for p in v.parts:
            q = torch.empty(p.shape, dtype=p.dtype, device=device,
                            pin_memory=self.pin and device.type == "cpu")
            q.copy_(p)
            parts.append(q)
            self.stats.bytes_moved += p.numel() * p.element_size()
        v.parts = parts
        self.router.drop_views(v)

    def _count(self) -> None:
        s = self.stats
        s.device_in_use, s.host_in_use = len(self._on_device), len(self._on_host)
        s.peak_device = max(s.peak_device, s.device_in_use)
        s.peak_host = max(s.peak_host, s.host_in_use)


class ResidentVectors:
    """Gradient vectors from a pool, optionally under host offload: what ``GroupBuckets`` and ``CanonicalSum`` share.

    ``_acquire`` makes room on the device first (``keep``: vectors that must stay there), ``_need`` brings vectors
    back before use, ``_release`` returns one to the pool (and forgets the router's cached views of it: under offload
    the pool drops released vectors, and a new vector may reuse ``id(v)``)."""

    def __init__(self, router: GradRouter, pool: BucketPool, residency: Residency | None = None):
        self.router = router
        self.pool = pool
        self.residency = residency
        self.accumulator = router.accumulator

    def _acquire(self, tag: str, keep: tuple[GradVector, ...] = ()) -> GradVector:
        if self.residency is None:
            return self.pool.acquire(tag)
        self.residency.reserve(1, keep)
        v = self.pool.acquire(tag)
        self.residency.admit(v)
        return v

    def _need(self, *vs: GradVector) -> None:
        if self.residency is not None:
            self.residency.need(*vs)

    def _release(self, v: GradVector) -> None:
        if self.residency is not None:
            self.residency.forget(v)
            self.router.drop_views(v)
        self.pool.release(v)
