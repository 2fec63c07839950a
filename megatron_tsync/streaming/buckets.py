"""Gradient buckets over Megatron's DDP grad buffers.

Megatron's DDP accumulates every backward into ``param.main_grad``, a view into one flat ``grad_data`` tensor
per buffer. A :class:`GradVector` is a set of flat tensors shaped exactly like those buffers (so it is sharded
exactly like them under TP/PP and the distributed optimizer: it is this rank's local grad buffer).
:class:`GradRouter` re-points every ``param.main_grad`` at the matching view of a chosen vector, so a
backward accumulates *directly* into a group's bucket, with no scratch copy; pointing back at the DDP buffer
makes the backward land in the batch accumulator. :class:`BucketPool` hands out vectors, recycles them and
keeps the accounting (vectors in use, peak, bytes) that shows the buffer minimum is met.
"""

from __future__ import annotations

import dataclasses

import torch


class GradVector:
    """A gradient-sized vector: one flat tensor per DDP buffer."""

    __slots__ = ("parts", "tag")

    def __init__(self, parts: list[torch.Tensor], tag: str = ""):
        self.parts = parts
        self.tag = tag

    def zero_(self) -> "GradVector":
        for p in self.parts:
            p.zero_()
        return self

    def add_(self, other: "GradVector", alpha: float = 1.0) -> "GradVector":
        """self += alpha · other."""
        if alpha == 0.0:
            return self
        for a, b in zip(self.parts, other.parts):
            a.add_(b, alpha=alpha)
        return self

    def scale_(self, a: float) -> "GradVector":
        """self *= a (in place)."""
        for p in self.parts:
            p.mul_(a)
        return self

    def numel(self) -> int:
        return sum(p.numel() for p in self.parts)

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts)

    def flat(self) -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in self.parts])


@dataclasses.dataclass
class BucketStats:
    in_use: int = 0
    peak_in_use: int = 0
    allocated: int = 0
    bytes_per_vector: int = 0

    @property
    def peak_bytes(self) -> int:
        return self.peak_in_use * self.bytes_per_vector


class BucketPool:
    """Allocates and recycles gradient-sized vectors like the DDP buffers of ``ddp_model``.

    ``in_use`` counts bucket vectors only; the batch accumulator is the DDP buffer itself (the "1" of the
    1 + 2k / 1 + k minimum).
    """

    def __init__(self, accumulator: GradVector, *, keep_free: bool = True):
        self.accumulator = accumulator
        self.keep_free = keep_free  # False under residency: released vectors' slots go back to its arenas
        self._free: list[GradVector] = []
        self.stats = BucketStats(bytes_per_vector=accumulator.nbytes())

    def acquire(self, tag: str = "", parts: list[torch.Tensor] | None = None) -> GradVector:
        """A zero vector: recycled, newly allocated, or over ``parts`` (a residency slot the caller zeroed; nothing
        is allocated then)."""
        if parts is not None:
            v = GradVector(parts)
        elif self._free:
            v = self._free.pop().zero_()
        else:
            v = GradVector([torch.zeros_like(p) for p in self.accumulator.parts])
            self.stats.allocated += 1
        v.tag = tag
        self.stats.in_use += 1
        self.stats.peak_in_use = max(self.stats.peak_in_use, self.stats.in_use)
        return v

    def release(self, v: GradVector) -> None:
        self.stats.in_use -= 1
        if self.keep_free:
            self._free.append(v)

    def reset_peak(self) -> None:
        self.stats.peak_in_use = self.stats.in_use


class GradRouter:
    """Points ``param.main_grad`` of every DDP-managed parameter at a chosen :class:`GradVector`.

    The accumulator vector *is* the DDP buffers' ``grad_data``; routing to it restores Megatron's own views.
    """

    def __init__(self, ddp_model):
        self.buffers = list(getattr(ddp_model, "buffers", [])) + list(
            getattr(ddp_model, "expert_parallel_buffers", [])
        )
        self.accumulator = GradVector([b.grad_data for b in self.buffers], tag="accumulator")
        # (param, buffer index, start, end, shape) for every param, from megatron's own index map
        self._slots = []
        for bi, buf in enumerate(self.buffers):
            for param, (start, end, _bucket_id) in buf.param_index_map.items():
                self._slots.append((param, bi, start, end, param.data.shape))
        self._slot_of = {id(param): i for i, (param, *_) in enumerate(self._slots)}
        self._views: dict[int, tuple[tuple[int, ...], list[torch.Tensor]]] = {}
        self.current: GradVector = self.accumulator

    def _views_for(self, v: GradVector) -> list[torch.Tensor]:
        """Cached by id(v) and checked against the parts' storage: a new vector may reuse a dropped one's id (the
        cached views keep the old storage alive, so an address match means the same storage)."""
        key = tuple(p.data_ptr() for p in v.parts)
        hit = self._views.get(id(v))
        if hit is None or hit[0] != key:
            hit = self._views[id(v)] = (key, [v.parts[bi][s:e].view(shape) for (_, bi, s, e, shape) in self._slots])
        return hit[1]

    def grad_of(self, v: GradVector):
        """``param -> its gradient view in v`` (what ``route(v)`` would make ``param.main_grad``), without routing."""
        views, slot = self._views_for(v), self._slot_of
        return lambda param: views[slot[id(param)]]

    def drop_views(self, v: GradVector) -> None:
        """Forget the cached ``main_grad`` views of ``v`` (its parts moved to new storage)."""
        if v is self.current:
            raise AssertionError("cannot move the vector gradients are routed into")
        self._views.pop(id(v), None)

    def route(self, v: GradVector) -> None:
        if v is self.current:
            return
        for (param, *_), view in zip(self._slots, self._views_for(v)):
            param.main_grad = view
        self.current = v

    def route_to_accumulator(self) -> None:
        self.route(self.accumulator)
