"""The copy engine of bucket residency: slot-to-slot copies, on CUDA on a side stream ordered by events.

On a CUDA device (:class:`Mover` with ``device.type == "cuda"``) a copy is issued on a side ``torch.cuda.Stream``:
the side stream first waits for the compute-stream events the two slots carry (``Slot.compute``: the point after
their last use there), copies every part ``non_blocking`` (asynchronous, since host slots are pinned), and records an
event that both slots keep (``Slot.side``). The compute stream waits for that event only when it uses the slot
(:meth:`Mover.ready`) — so a prefetch issued while a microbatch computes overlaps with it, and the learner stalls only
if the copy has not finished when the vector is needed. Such stalls are timed with a pair of timing events around the
wait on the compute stream (the GPU time the compute stream sat waiting), read at the end of the step.

On a CPU device the same calls copy synchronously (``Slot.side`` stays None); the time spent copying is the time the
learner waited on copies. The accounting (bytes moved, copies, seconds waited) is the same on both.

:meth:`Mover.swap` exchanges a device slot's and a host slot's contents when the host arena has no free slot to evict
into first (bringing a vector in while every other one is held): on CUDA through a small device staging buffer
(allocated once, ``staging_bytes``), chunk by chunk on the side stream; on CPU in place by three XORs of the slots'
bytes (no memory at all). So the host arena never needs a spare slot.
"""

from __future__ import annotations

import time

import torch

from megatron_tsync.streaming.arena import Slot


class Mover:
    """Copies between arena slots (module docstring)."""

    def __init__(self, device: torch.device, staging_bytes: int = 0):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.staging = (torch.empty(staging_bytes, dtype=torch.uint8, device=self.device)
                        if self.cuda and staging_bytes > 0 else None)  # swap's chunk buffer (CUDA)
        self.bytes_moved = 0
        self.copies = 0
        self._cpu_wait_s = 0.0
        self._stalls: list = []  # (start, end) timing events around compute-stream waits (CUDA)

    def copy(self, dst: Slot, src: Slot) -> None:
        """Issue dst ← src (every part). CUDA: asynchronous on the side stream (module docstring)."""
        n = sum(p.numel() * p.element_size() for p in src.parts)
        self.bytes_moved += n
        self.copies += 1
        if not self.cuda:
            t = time.perf_counter()
            for d, s in zip(dst.parts, src.parts):
                d.copy_(s)
            self._cpu_wait_s += time.perf_counter() - t
            return
        self._wait_compute(dst, src)
        with torch.cuda.stream(self.stream):
            for d, s in zip(dst.parts, src.parts):
                d.copy_(s, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.stream)
        dst.side = src.side = done

    def swap(self, dev: Slot, host: Slot) -> None:
        """Exchange the contents of ``dev`` (a device slot) and ``host`` (module docstring): two moves' worth of bytes."""
        n = sum(p.numel() * p.element_size() for p in dev.parts)
        self.bytes_moved += 2 * n
        self.copies += 2
        a, b = dev.raw, host.raw  # (slot_bytes,) uint8 each
        if not self.cuda:
            t = time.perf_counter()
            a.bitwise_xor_(b)
            b.bitwise_xor_(a)
            a.bitwise_xor_(b)
            self._cpu_wait_s += time.perf_counter() - t
            return
        self._wait_compute(dev, host)
        c = self.staging.numel()
        with torch.cuda.stream(self.stream):
            for i in range(0, a.numel(), c):
                j = min(i + c, a.numel())
                st = self.staging[: j - i]
                st.copy_(a[i:j])
                a[i:j].copy_(b[i:j], non_blocking=True)
                b[i:j].copy_(st, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.stream)
        dev.side = host.side = done

    def _wait_compute(self, *slots: Slot) -> None:
        for slot in slots:
            if slot.compute is not None:
                self.stream.wait_event(slot.compute)
                slot.compute = None

    def mark_used(self, slot: Slot) -> None:
        """The compute stream has used ``slot`` up to now (it is being freed or evicted): a later side-stream copy
        touching it waits for this point."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            slot.compute = ev

    def ready(self, slot: Slot) -> None:
        """Before the compute stream uses ``slot``: wait for the side-stream copy that last touched it (if any)."""
        ev, slot.side = slot.side, None
        if ev is None or ev.query():
            return
        cur = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(cur)
        cur.wait_event(ev)
        end.record(cur)
        self._stalls.append((start, end))

    def take_wait_s(self) -> float:
        """Seconds the learner waited on copies since the last call (CUDA: synchronises with the recorded stalls)."""
        s, self._cpu_wait_s = self._cpu_wait_s, 0.0
        for start, end in self._stalls:
            end.synchronize()
            s += start.elapsed_time(end) / 1000.0
        self._stalls = []
        return s
