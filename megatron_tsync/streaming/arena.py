"""Preallocated slots for gradient-bucket vectors: a few large slabs, carved once into vector-sized slots.

A bucket vector (``buckets.GradVector``) is one flat tensor per DDP grad buffer of this rank. A :class:`SlotLayout`
places those parts one after the other inside a slot (each part's offset a multiple of ``ALIGN`` bytes); a
:class:`SlotArena` allocates its memory as slabs — uint8 tensors of at most ``slab_bytes`` (at least one slot each),
page-locked (pinned) on a host that feeds a CUDA device — and carves them into slots once. Slots are then handed out
and taken back; nothing is allocated per vector or per move: a vector offloaded to the host copies into a free host
slot, one brought back copies into a free device slot (``streaming.offload``).

Each :class:`Slot` remembers the copy that last touched it on the copy engine's side stream and the point of the
compute stream after its last use there (``streaming.mover``): the ordering a later user of the slot must respect,
since the slab's memory is never returned to the caching allocator (no ``record_stream`` is needed for it).
"""

from __future__ import annotations

import torch

ALIGN = 64  # bytes: every part of a slot starts on a 64-byte boundary (vectorised copies, cache lines)
GIB = 1 << 30


class ArenaFull(RuntimeError):
    """A fixed-size arena has no free slot."""


class SlotLayout:
    """Where the parts of one vector (shapes and dtypes of ``like``) sit inside a slot of ``slot_bytes``."""

    def __init__(self, like: list[torch.Tensor]):
        if not like:
            raise ValueError("a slot layout needs at least one part (the model has no DDP grad buffer)")
        self.shapes = tuple(tuple(p.shape) for p in like)
        self.dtypes = tuple(p.dtype for p in like)
        self.offsets: tuple[int, ...] = ()
        off = 0
        for p in like:
            self.offsets += (off,)
            off += _round_up(p.numel() * p.element_size(), ALIGN)
        self.slot_bytes = off
        self.vector_bytes = sum(p.numel() * p.element_size() for p in like)  # without the alignment padding

    def carve(self, slab: torch.Tensor, start: int) -> list[torch.Tensor]:
        """The parts of the slot at byte ``start`` of ``slab`` (views: no memory of their own)."""
        out = []
        for shape, dtype, off in zip(self.shapes, self.dtypes, self.offsets):
            n = _numel(shape) * dtype.itemsize
            out.append(slab[start + off: start + off + n].view(dtype).view(shape))
        return out


class Slot:
    """One vector's worth of arena memory: ``parts`` (views into a slab) and its pending orderings."""

    __slots__ = ("index", "parts", "raw", "side", "compute")

    def __init__(self, index: int, parts: list[torch.Tensor], raw: torch.Tensor):
        self.index = index
        self.parts = parts
        self.raw = raw  # (slot_bytes,) uint8: the whole slot, for swaps
        self.side = None  # CUDA event: the last side-stream copy that read or wrote this slot (None: idle / CPU)
        self.compute = None  # CUDA event: the compute stream after this slot's last use there (None: no wait)


class SlotArena:
    """``n_slots`` slots of ``layout`` on ``device`` in slabs of at most ``slab_bytes``; more slabs by :meth:`grow`.

    ``pin``: page-locked host memory (for asynchronous copies to and from a CUDA device)."""

    def __init__(self, layout: SlotLayout, n_slots: int, device: torch.device, *, pin: bool = False,
                 slab_bytes: int = GIB, name: str = "arena"):
        if n_slots < 0:
            raise ValueError(f"{name}: slot count must be >= 0, got {n_slots}")
        self.layout = layout
        self.device = torch.device(device)
        self.pin = pin
        self.slab_bytes = max(int(slab_bytes), layout.slot_bytes)
        self.name = name
        self.slabs: list[torch.Tensor] = []
        self.slots: list[Slot] = []
        self._free: list[Slot] = []
        self.grow(n_slots)

    @property
    def capacity(self) -> int:
        return len(self.slots)

    @property
    def in_use(self) -> int:
        return len(self.slots) - len(self._free)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes allocated by the arena (its slabs)."""
        return sum(s.numel() for s in self.slabs)

    def grow_within_host_memory(self, n_slots: int, what: str) -> None:
        """:meth:`grow` an automatic host arena by ``n_slots`` (nothing when ≤ 0), refused with one line naming
        ``what`` where that would take more than :data:`HOST_FRACTION` of the host memory available now."""
        if n_slots <= 0:
            return
        need = n_slots * self.layout.slot_bytes
        avail = host_available_bytes()
        if avail is not None and need > HOST_FRACTION * avail:
            raise ValueError(f"{what}: {n_slots} more vectors of {self.layout.slot_bytes / 2**20:.1f} MiB "
                             f"({need / GIB:.2f} GiB) needed for this step's open groups, {avail / GIB:.2f} GiB of "
                             "host memory available: cap --max-open-groups, or set --bucket-host-gib to a size that "
                             "fits (a step needing more then stops with an error)")
        self.grow(n_slots)

    def grow(self, n_slots: int) -> None:
        """Add ``n_slots`` slots in new slabs (never one allocation per slot unless a slot fills a slab)."""
        per_slab = max(1, self.slab_bytes // self.layout.slot_bytes)
        while n_slots > 0:
            m = min(per_slab, n_slots)
            slab = torch.empty(m * self.layout.slot_bytes, dtype=torch.uint8, device=self.device,
                               pin_memory=self.pin and self.device.type == "cpu")
            self.slabs.append(slab)
            for i in range(m):
                start = i * self.layout.slot_bytes
                slot = Slot(len(self.slots), self.layout.carve(slab, start), slab[start: start + self.layout.slot_bytes])
                self.slots.append(slot)
                self._free.append(slot)
            n_slots -= m
        self._free.sort(key=lambda s: -s.index)  # take() hands out the lowest index first

    def take(self) -> Slot:
        if not self._free:
            raise ArenaFull(f"{self.name}: all {self.capacity} slots of {self.layout.slot_bytes / 2**20:.1f} MiB "
                            "are in use")
        return self._free.pop()

    def give(self, slot: Slot) -> None:
        self._free.append(slot)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory lies inside one of this arena's slabs."""
        a = t.data_ptr()
        return any(s.data_ptr() <= a and a + t.numel() * t.element_size() <= s.data_ptr() + s.numel()
                   for s in self.slabs)


HOST_FRACTION = 0.8  # an automatic host arena may take at most this fraction of the available host memory


def host_available_bytes() -> int | None:
    """Host memory the kernel reports available (``MemAvailable``), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
