"""Host accumulation (``--accumulate-on-host``): the batch accumulator and every bucket vector in pinned host memory.

The seed paper's memory layout. Megatron's own grad buffer (``grad_data``, what ``param.main_grad`` views) is each
microbatch's *scratch*: a backward accumulates into it as usual; afterwards the scratch is copied device→host and added
into its destination(s) on the host — the batch accumulator with coefficient 1, or the group's Q (design note §1) —
and zeroed. The origin shifts (P += (ρ − r)·Q; α known: accumulator += α(ρ − r)·Q) and the closes
(accumulator += α·P + c·Q) are host ``add_`` calls. Before the barrier the host accumulator is copied into the grad
buffer (:meth:`HostAccumulation.materialize`) and megatron's ``finalize_model_grads`` / optimizer run unchanged. The
device holds no gradient vector besides the grad buffer; the host holds the accumulator and 2k bucket vectors
(k open groups; k for Dr.GRPO / RLOO): ≤ 4(2k+1)P bytes per rank in fp32, plus two staging chunks.

**Flushing.** The scratch holds the sum of consecutive backwards into the *same* destinations with no host operation
on them in between (sync mode: every microbatch of a step into the accumulator, one flush at the barrier). It is
flushed when the destinations change (:meth:`route`), before any host operation (:meth:`axpy`, :meth:`release`), at
the barrier, and — to overlap with compute — when the next microbatch's forward starts and it will write elsewhere
(``StreamExecutor._forward_step`` → :meth:`prepare`).

**Copy engine and overlap (choice).** One flush copies the scratch in chunks of ``chunk_bytes`` into two pinned
staging chunks (double buffering): chunk c+2's copy is issued once chunk c has been added on the host, so the D2H copy
and the host add run as a pipeline, and the staging costs 2 chunks of host memory instead of a whole vector. On CUDA a
worker thread does it: the copies run on a side stream after an event recorded on the compute stream when the flush
was requested (the end of the backward); the add of a chunk waits on that chunk's copy event; after the last copy the
scratch is zeroed on the side stream and an event is recorded. The compute stream waits on that event (and the
learner's thread until the worker has issued it) only in :meth:`begin_backward`, right before the next backward
writes the scratch — so the copy and the add overlap with the next microbatch's *forward* (and with whatever the host
does before its backward). A second device scratch would let them overlap with the next backward as well, but costs a
gradient-sized device vector — the memory this mode exists to save — so it is not used. Host operations (shifts,
closes) go through the same FIFO worker, so every add to a vector happens in program order; the learner's thread
waits for them only at the barrier (:meth:`materialize`) and when it needs a free arena slot.

On a CPU-only machine the same calls run synchronously in the caller (``threaded=False``, the default there): the
"D2H copy" is a memcpy into the staging chunk, then the add; ``threaded=True`` runs the worker thread on CPU too (the
ordering is the same; tests use it). The host add is torch's ``add_`` on CPU tensors: its speed depends on
``OMP_NUM_THREADS`` / ``torch.get_num_threads()`` (memory bandwidth needs several threads per rank on a real host).

Accounting (the residency statistics, ``offload.OffloadStats``; the learner's ``StepResult.offload``): host vectors
now / peak (bytes), arena size, bytes moved D2H and H2D, flushes, host add seconds, D2H copy seconds (CPU: the memcpy;
CUDA: the worker's wait on copy events), and the seconds the learner waited for the scratch (``wait_s``).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

import torch

from megatron_tsync.streaming.arena import GIB, ArenaFull, SlotArena, SlotLayout
from megatron_tsync.streaming.buckets import BucketPool, GradRouter, GradVector

CHUNK_BYTES = 64 << 20  # one staging chunk (two of them per rank, pinned on CUDA)


@dataclasses.dataclass
class HostAccumStats:
    host_in_use: int = 0  # host vectors now (accumulator + buckets)
    peak_host: int = 0
    host_bytes: int = 0  # their bytes (without slot padding)
    peak_host_bytes: int = 0
    host_slots: int = 0  # the host arena: slots, bytes allocated, slabs
    host_arena_bytes: int = 0
    host_slabs: int = 0
    staging_bytes: int = 0  # the two staging chunks
    flushes: int = 0  # scratch → host flushes this step
    d2h_bytes: int = 0  # bytes copied device → host this step (scratch flushes)
    h2d_bytes: int = 0  # bytes copied host → device this step (the accumulator into the grad buffer)
    d2h_s: float = 0.0  # seconds copying (CPU: memcpy time; CUDA: the worker's wait on copy events)
    host_add_s: float = 0.0  # seconds of host adds (flushes, shifts, closes)
    wait_s: float = 0.0  # seconds the learner waited for the scratch / the worker
    device_bytes: int = 0  # bucket-vector bytes on the device: always 0 (keys shared with residency's OffloadStats)
    peak_device_bytes: int = 0
    bytes_moved: int = 0  # d2h_bytes + h2d_bytes


HOST_TB_NAMES = {"d2h_bytes": "stream/host_d2h_bytes", "host_add_s": "stream/host_add_s",
                 "d2h_s": "stream/host_d2h_s", "flushes": "stream/host_flushes"}
"""TensorBoard tags of host accumulation's own statistics (the shared ones: ``offload.TB_NAMES``)."""


@dataclasses.dataclass
class _Flush:
    dests: list  # [(GradVector on the host, coefficient)]
    done: object  # CUDA event at the end of the backward (None on CPU)


@dataclasses.dataclass
class _Op:
    fn: object  # callable run on the worker in FIFO order


class HostAccumulation:
    """The host arena of the accumulator and bucket vectors, the scratch flushes and their worker (module docstring)."""

    def __init__(self, router: GradRouter, host_gib: float | None = None, *, threaded: bool | None = None,
                 chunk_bytes: int | None = None, slab_gib: float = 1.0):
        if host_gib is not None and host_gib <= 0:
            raise ValueError(f"--bucket-host-gib must be > 0, got {host_gib}")
        self.router = router
        self.scratch = router.accumulator  # megatron's grad buffers: each microbatch's scratch
        self.device = self.scratch.parts[0].device
        self.cuda = self.device.type == "cuda"
        layout = SlotLayout(self.scratch.parts)
        self.fixed = host_gib is not None
        n = int(host_gib * GIB // layout.slot_bytes) if host_gib is not None else 1
        if n < 1:
            raise ValueError(f"--bucket-host-gib {host_gib:g} holds no vector of {layout.slot_bytes / 2**20:.1f} MiB "
                             "(the accumulator needs one)")
        self.arena = SlotArena(layout, n, torch.device("cpu"), pin=self.cuda, slab_bytes=int(slab_gib * GIB),
                               name="host accumulation arena")
        self._lock = threading.Lock()  # the arena's free list (the worker gives slots back)
        self._slot_of: dict[int, object] = {}
        self.accumulator = self._take("accumulator")
        self.accumulator.zero_()
        cb = max(64, min(int(chunk_bytes or CHUNK_BYTES), layout.slot_bytes) // 64 * 64)
        self.staging = [torch.empty(cb, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.dests: list = [(self.accumulator, 1.0)]  # where the scratch's content belongs
        self.dirty = False  # a backward may have written the scratch since its last flush
        self.stats = HostAccumStats(staging_bytes=2 * cb)
        self._scratch_free = threading.Event()
        self._scratch_free.set()
        self._zero_ev = None  # CUDA: the side-stream event after the scratch's last zeroing
        self._error: BaseException | None = None
        self.threaded = self.cuda if threaded is None else bool(threaded)
        self._q: queue.Queue = queue.Queue()
        self._thread = None
        if self.threaded:
            self._thread = threading.Thread(target=self._work, name="host-accumulation", daemon=True)
            self._thread.start()
        self._count()

    # ------------------------------------------------------------------ vectors
    def _take(self, tag: str) -> GradVector:
        with self._lock:
            slot = self.arena.take()
        v = GradVector(slot.parts, tag)
        self._slot_of[id(v)] = slot
        return v

    def acquire(self, pool: BucketPool, tag: str) -> GradVector:
        """A zero host vector from the arena (zeroed on the worker, in order), counted by ``pool``."""
        try:
            v = self._take(tag)
        except ArenaFull:
            self.drain()  # releases may still be queued
            try:
                v = self._take(tag)
            except ArenaFull:
                if self.fixed:
                    raise ArenaFull(f"host accumulation arena full: --bucket-host-gib holds {self.arena.capacity} "
                                    "vectors (the accumulator included) and this step needs more; raise it, or leave "
                                    "it unset (sized from the step's open groups)") from None
                self._grow(1)
                v = self._take(tag)
        self._submit(_Op(v.zero_))
        out = pool.acquire(tag, parts=v.parts)
        self._slot_of[id(out)] = self._slot_of.pop(id(v))
        self._count()
        return out

    def release(self, v: GradVector) -> None:
        """``v`` goes back to the arena once every queued operation on it has run."""
        slot = self._slot_of.pop(id(v))
        self.flush()

        def give():
            with self._lock:
                self.arena.give(slot)

        self._submit(_Op(give))
        self._count()

    def begin_step(self, max_vectors: int) -> None:
        """A step holding at most ``max_vectors`` bucket vectors: an automatic arena grows to them + the accumulator;
        the step's counters restart."""
        if not self.fixed:
            self.drain()
            self._grow(max_vectors + 1 - self.arena.capacity)
        s = self.stats
        s.flushes = s.d2h_bytes = s.h2d_bytes = 0
        s.d2h_s = s.host_add_s = s.wait_s = 0.0
        s.peak_host, s.peak_host_bytes = s.host_in_use, s.host_bytes
        self._count()

    def _grow(self, n: int) -> None:
        with self._lock:
            self.arena.grow_within_host_memory(n, "host accumulation")

    # ------------------------------------------------------------------ routing and flushing
    def route(self, dests: list) -> None:
        """The next backward's gradient belongs to ``dests`` ([(host vector, coefficient)]); the scratch is flushed
        first if it holds a gradient of other destinations."""
        if not _same(dests, self.dests):
            self.flush()
            self.dests = list(dests)

    def prepare(self, dests: list | None) -> None:
        """A microbatch's forward starts; its backward will write ``dests`` (None: unknown): flush now (overlapping
        this forward) unless the scratch keeps accumulating for the same destinations."""
        if dests is None or not _same(dests, self.dests):
            self.flush()

    def begin_backward(self) -> None:
        """Right before a backward writes the scratch: wait until its last flush has emptied it."""
        if self.dirty:
            return
        t = time.perf_counter()
        self._scratch_free.wait()
        self._raise()
        if self._zero_ev is not None:
            torch.cuda.current_stream(self.device).wait_event(self._zero_ev)
            self._zero_ev = None
        self.stats.wait_s += time.perf_counter() - t
        self.dirty = True

    def flush(self) -> None:
        """If a backward wrote the scratch: copy it to the host and add it to its destinations, then zero it."""
        if not self.dirty:
            return
        self.dirty = False
        done = None
        if self.cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        self._scratch_free.clear()
        self.stats.flushes += 1
        self.stats.d2h_bytes += self.scratch.nbytes()
        self._submit(_Flush(list(self.dests), done))

    def axpy(self, dst: GradVector, src: GradVector, alpha: float) -> None:
        """dst += alpha·src on the host, after everything queued (the scratch flushed first)."""
        if alpha == 0.0:
            return
        self.flush()

        def add():
            t = time.perf_counter()
            dst.add_(src, alpha=alpha)
            self.stats.host_add_s += time.perf_counter() - t

        self._submit(_Op(add))

    def drain(self) -> None:
        """Wait until every queued flush and host operation has run (the learner's thread; timed as a wait)."""
        t = time.perf_counter()
        if self.threaded:
            self._q.join()
        self._raise()
        self.stats.wait_s += time.perf_counter() - t

    def materialize(self) -> None:
        """Before the barrier: the host accumulator → the grad buffer (what ``finalize_model_grads`` reduces), and
        the accumulator zeroed for the next step."""
        self.flush()
        self.drain()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._zero_ev) if self._zero_ev is not None else None
            self._zero_ev = None
        for d, s in zip(self.scratch.parts, self.accumulator.parts):
            d.copy_(s)  # pinned → device, synchronous: the accumulator may be zeroed right after
        self.accumulator.zero_()
        self.stats.h2d_bytes += self.scratch.nbytes()
        self.dests = [(self.accumulator, 1.0)]

    def close(self) -> None:
        """Stop the worker thread (tests; the learner's process exits otherwise)."""
        if self._thread is not None:
            self._raise()
            self._q.put(None)
            self._thread.join()
            self._thread = None

    def step_stats(self) -> dict:
        self._count()
        self.stats.bytes_moved = self.stats.d2h_bytes + self.stats.h2d_bytes
        return dataclasses.asdict(self.stats)

    # ------------------------------------------------------------------ worker
    def _submit(self, job) -> None:
        if self.threaded:
            self._raise()
            self._q.put(job)
        else:
            self._run(job)

    def _work(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)  # this thread's current device: the rank's
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                if self._error is None:
                    self._run(job)
            except BaseException as e:  # noqa: BLE001 (re-raised in the learner's thread)
                self._error = e
                self._scratch_free.set()
            finally:
                self._q.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"host accumulation worker failed: {self._error!r}") from self._error

    def _run(self, job) -> None:
        if isinstance(job, _Op):
            job.fn()
        else:
            self._flush_now(job)

    def _flush_now(self, job: _Flush) -> None:
        """Chunked scratch → staging → destinations pipeline (module docstring), then zero the scratch."""
        chunks = [(pi, a, min(a + n, p.numel())) for pi, p in enumerate(self.scratch.parts)
                  for n in [self.staging[0].numel() // p.element_size()] for a in range(0, p.numel(), n)]
        events: list = [None, None]
        if self.cuda:
            self.stream.wait_event(job.done)

        def issue(c: int) -> None:
            pi, a, b = chunks[c]
            src = self.scratch.parts[pi].view(-1)[a:b]
            dst = self.staging[c % 2][: (b - a) * src.element_size()].view(src.dtype)
            if not self.cuda:
                t = time.perf_counter()
                dst.copy_(src)
                self.stats.d2h_s += time.perf_counter() - t
                return
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            events[c % 2] = ev

        issued = 0
        if not chunks:
            self._zero_scratch()
        for c in range(min(2, len(chunks))):
            issue(c)
            issued += 1
        if issued == len(chunks):  # every copy is issued: the scratch can be zeroed (stream order on CUDA)
            self._zero_scratch()
        for c, (pi, a, b) in enumerate(chunks):
            if events[c % 2] is not None:
                t = time.perf_counter()
                events[c % 2].synchronize()
                self.stats.d2h_s += time.perf_counter() - t
            src_dtype = self.scratch.parts[pi].dtype
            stage = self.staging[c % 2][: (b - a) * src_dtype.itemsize].view(src_dtype)
            t = time.perf_counter()
            for v, coef in job.dests:
                v.parts[pi].view(-1)[a:b].add_(stage, alpha=coef)
            self.stats.host_add_s += time.perf_counter() - t
            if c + 2 < len(chunks):
                issue(c + 2)
                issued += 1
                if issued == len(chunks):
                    self._zero_scratch()

    def _zero_scratch(self) -> None:
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.scratch.zero_()
                ev = torch.cuda.Event()
                ev.record(self.stream)
            self._zero_ev = ev
        else:
            self.scratch.zero_()
        self._scratch_free.set()

    # ------------------------------------------------------------------ accounting
    def _count(self) -> None:
        s, vb = self.stats, self.arena.layout.vector_bytes
        s.host_in_use = len(self._slot_of)
        s.host_bytes = s.host_in_use * vb
        s.peak_host = max(s.peak_host, s.host_in_use)
        s.peak_host_bytes = max(s.peak_host_bytes, s.host_bytes)
        s.host_slots, s.host_arena_bytes, s.host_slabs = self.arena.capacity, self.arena.nbytes, len(self.arena.slabs)

    def owns(self, v: GradVector) -> bool:
        """Whether every part of ``v`` lies in the host arena."""
        return all(self.arena.owns(p) for p in v.parts)



def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y and c == d for (x, c), (y, d) in zip(a, b))
