"""Trainer → engine weight sync by collective broadcast: one code path, gloo on CPU, NCCL on GPU.

The trainer's global rank 0 (the only rank holding the full Hugging Face state after ``megatron_to_hf``) and every
rollout receiver (a worker process; for vLLM the engine's own worker process, through its worker extension) form a
**standalone** process group, built from a ``TCPStore`` hosted by the trainer (``PrefixStore`` namespaces) and a
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` backend object used directly: no ``init_process_group``, so the trainer's
default group and a receiver's own groups (the embedded engine's single-process Megatron group, vLLM's) are never
touched. Rank 0 is the sender; receivers are ranks ``1 .. world_size - 1``.

Per version (message ``seq`` = 0, 1, 2, ... counted by both sides):

1. every receiver sets ``ctl/ready/<seq>/<rank>`` in the store and waits for ``ctl/announce/<seq>`` (a store poll:
   the long wait for the trainer's step happens here, bounded by the caller's ``timeout_s``; if the trainer dies the
   store connection breaks and the receiver gets :class:`WeightSyncError` at once);
2. the sender waits until every receiver is ready (bounded by ``op_timeout_s``, calling ``poll_fn`` meanwhile: the
   fleet passes its dead-worker check), announces, then broadcasts
3. a header ``int64[6]`` = (magic, protocol, manifest bytes, total bytes, bucket bytes, seq);
4. the manifest, ``uint8[manifest bytes]`` = canonical JSON || HMAC-SHA256(key, domain || JSON)::

       {"format": "megatron_tsync.weights-broadcast/1", "version": 7, "total_bytes": N, "bucket_bytes": B,
        "align": 16, "tensors": [[name, dtype, shape, offset], ...]}

   The tensors are laid out back to back (offsets aligned to 16 bytes) in one virtual byte stream of ``total_bytes``;
5. that stream cut into buckets ``[kB, min((k+1)B, N))``, broadcast one ``uint8`` bucket at a time. A tensor inside
   one bucket arrives as a zero-copy view of that bucket's buffer (a fresh buffer per bucket); a tensor spanning
   buckets (e.g. larger than one) is assembled into its own buffer. Bytes are reinterpreted with ``Tensor.view``:
   bit-identical for every dtype (bf16, fp8, bool, ints).

The receiver verifies the HMAC, the manifest's consistency with the header, and the version **before** it yields a
single tensor (so before any engine is touched). It expects exactly the version it waits for: an authentic older
version is drained, counted (``rejected["wrong_version"]``) and the next message awaited; a newer one (the awaited
version can no longer come) is drained, counted and raised as :class:`WrongVersion`; a forged, tampered or unsigned
manifest is drained by the header's framing, counted (``rejected["bad_signature"]`` / ``["malformed"]``) and raised
as :class:`BadSignature` / :class:`Malformed`. Draining keeps the group in step, so the next right version still
arrives. A header whose framing is itself implausible leaves the stream unusable (:class:`WeightSyncError`).

Trust model: the HMAC covers names, shapes, dtypes, layout and version; the tensor bytes ride the process group
unauthenticated (hashing them would cost a full pass over the weights on the sender, on GPU a device-to-host copy).
torch.distributed groups are not authenticated either: whoever can reach the store's port during the rendezvous can
disturb it. Run it on the cluster's private network, as the trainer's own groups are.

What is real and what is GPU-only: the **gloo** backend (CPU tensors) is what this machine runs and tests
(tests/transport/test_weight_broadcast.py, 2 receivers, forged/wrong-version/dead-peer cases, the embedded engine,
vLLM's CPU build through its worker extension). The **NCCL** backend is the same code with ``backend="nccl"`` and CUDA
bucket buffers; it has **not been run** (no GPU here). Known NCCL differences, unverified: ``work.wait()`` orders
the current CUDA stream after the collective rather than blocking the host; a timeout is detected by NCCL's watchdog,
which by default aborts the process (``TORCH_NCCL_ASYNC_ERROR_HANDLING``) instead of raising.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .codec import check_key
from .errors import BadSignature, Malformed, TransportError, WrongVersion

__all__ = ["BROADCAST_FORMAT", "BACKENDS", "WeightSyncError", "WeightSyncGroup", "BroadcastWeightPublisher",
           "BroadcastWeightSubscriber", "WeightLayout", "plan_layout", "sign_manifest", "verify_manifest"]

log = logging.getLogger(__name__)

BROADCAST_FORMAT = "megatron_tsync.weights-broadcast/1"
BACKENDS = ("gloo", "nccl")
ALIGN = 16
_MAGIC = 0x7453_796E_6357_7431  # an arbitrary constant that marks the header tensor of this protocol
_PROTOCOL = 1
_HEADER_LEN = 6
_TAG_LEN = 32
_DOMAIN = b"megatron_tsync.weights-broadcast\x00"  # a file manifest's tag can never verify here, nor the reverse
MAX_MANIFEST_BYTES = 64 << 20
MAX_BUCKET_BYTES = 16 << 30
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
}


class WeightSyncError(RuntimeError):
    """The weight-sync group failed: a peer is gone or stuck, the rendezvous is unreachable, or the stream is out of
    step. The group cannot be used afterwards."""


# ----------------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # in the virtual byte stream

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class WeightLayout:
    """Where every tensor's bytes lie in the stream, and how the stream is cut into buckets."""

    tensors: tuple[TensorSlot, ...]
    total_bytes: int
    bucket_bytes: int

    def buckets(self) -> list[tuple[int, int]]:
        """``[(start, end)]`` of every bucket in stream offsets."""
        step, n = self.bucket_bytes, self.total_bytes
        return [(s, min(s + step, n)) for s in range(0, n, step)]

    def pieces(self) -> list[list[tuple[int, int, int]]]:
        """Per bucket: ``(tensor index, start, end)`` with stream offsets, in stream order (empty tensors omitted)."""
        out: list[list[tuple[int, int, int]]] = [[] for _ in self.buckets()]
        for i, t in enumerate(self.tensors):
            lo, hi = t.offset, t.offset + t.nbytes
            while lo < hi:
                b = lo // self.bucket_bytes
                end = min(hi, (b + 1) * self.bucket_bytes)
                out[b].append((i, lo, end))
                lo = end
        return out


def _bucket_bytes(bucket_bytes: int) -> int:
    if not _is_count(bucket_bytes) or not ALIGN <= bucket_bytes <= MAX_BUCKET_BYTES:
        raise ValueError(f"bucket_bytes must be an int in [{ALIGN}, {MAX_BUCKET_BYTES}], got {bucket_bytes!r}")
    return bucket_bytes - bucket_bytes % ALIGN


def plan_layout(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> WeightLayout:
    """Back-to-back layout of ``state`` (insertion order), offsets aligned to 16 bytes."""
    bucket_bytes = _bucket_bytes(bucket_bytes)
    slots, pos = [], 0
    for name, t in state.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"state entries must be str -> Tensor, got {name!r}: {type(t).__name__}")
        dname = str(t.dtype).removeprefix("torch.")
        if dname not in _DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} cannot be broadcast (supported: {sorted(_DTYPES)})")
        slot = TensorSlot(name, dname, tuple(int(s) for s in t.shape), pos)
        slots.append(slot)
        pos += slot.nbytes
        pos += -pos % ALIGN
    last = max((s.offset + s.nbytes for s in slots), default=0)
    return WeightLayout(tuple(slots), last, bucket_bytes)


# ----------------------------------------------------------------------------------------------------- manifest
def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign_manifest(layout: WeightLayout, version: int, key: bytes) -> bytes:
    """Canonical JSON of the manifest followed by its 32-byte HMAC-SHA256 tag."""
    body = {"format": BROADCAST_FORMAT, "version": version, "total_bytes": layout.total_bytes,
            "bucket_bytes": layout.bucket_bytes, "align": ALIGN,
            "tensors": [[t.name, t.dtype, list(t.shape), t.offset] for t in layout.tensors]}
    raw = _canonical(body)
    return raw + hmac.new(check_key(key), _DOMAIN + raw, hashlib.sha256).digest()


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def verify_manifest(raw: bytes, key: bytes) -> tuple[int, WeightLayout]:
    """``(version, layout)`` of a signed manifest; :class:`BadSignature` when its tag does not verify (forged, tampered,
    unsigned, other key), :class:`Malformed` when an authentic manifest is inconsistent."""
    if len(raw) <= _TAG_LEN:
        raise BadSignature(f"manifest of {len(raw)} bytes carries no tag")
    body_raw, tag = raw[:-_TAG_LEN], raw[-_TAG_LEN:]
    if not hmac.compare_digest(tag, hmac.new(check_key(key), _DOMAIN + body_raw, hashlib.sha256).digest()):
        raise BadSignature("weight manifest HMAC does not verify (wrong key, tampered or unsigned manifest)")
    try:
        body = json.loads(body_raw)
        if not isinstance(body, dict) or body.get("format") != BROADCAST_FORMAT or body.get("align") != ALIGN:
            raise ValueError(f"format/align {body.get('format')!r}/{body.get('align')!r}")
        version, total, bucket = body["version"], body["total_bytes"], body["bucket_bytes"]
        if not (_is_count(version) and _is_count(total) and _is_count(bucket)) or _bucket_bytes(bucket) != bucket:
            raise ValueError("version/total_bytes/bucket_bytes")
        slots, end, names = [], 0, set()
        for name, dtype, shape, offset in body["tensors"]:
            if not isinstance(name, str) or name in names or dtype not in _DTYPES:
                raise ValueError(f"tensor {name!r}: duplicate name or dtype {dtype!r}")
            if not (isinstance(shape, list) and all(_is_count(s) for s in shape) and _is_count(offset)):
                raise ValueError(f"tensor {name!r}: shape {shape!r} / offset {offset!r}")
            slot = TensorSlot(name, dtype, tuple(shape), offset)
            if offset % ALIGN or offset < end or offset + slot.nbytes > total:
                raise ValueError(f"tensor {name!r}: offset {offset} overlaps, is unaligned or exceeds the stream")
            names.add(name)
            slots.append(slot)
            end = offset + slot.nbytes
    except (ValueError, KeyError, TypeError) as exc:
        raise Malformed(f"authentic weight manifest is inconsistent: {exc}") from None
    return version, WeightLayout(tuple(slots), total, bucket)


# ----------------------------------------------------------------------------------------------------- group
def _wait_keys(store: Any, keys: list[str], timeout_s: float, what: str,
               poll_fn: Callable[[], None] | None = None) -> None:
    """Until every key exists in the store. Without ``poll_fn``: one blocking ``store.wait`` (wakes the moment the
    key is set; raises at once if the store's host dies). With it: polls, running ``poll_fn`` (which may raise)
    between polls."""
    if poll_fn is None:
        try:
            store.wait(keys, datetime.timedelta(seconds=max(timeout_s, 0.001)))
            return
        except dist.DistStoreError as exc:
            if "timeout" not in str(exc).lower():
                raise WeightSyncError(f"weight-sync store failed while waiting for {what}: {exc}") from None
            raise TimeoutError(f"weight sync: {what} did not happen within {timeout_s:.0f}s") from None
        except (RuntimeError, dist.DistError) as exc:
            raise WeightSyncError(f"lost the weight-sync rendezvous store while waiting for {what} (is the trainer "
                                  f"still alive?): {exc}") from None
    deadline, sleep = time.monotonic() + timeout_s, 0.002
    while True:
        try:
            if store.check(keys):
                return
        except (RuntimeError, dist.DistError) as exc:
            raise WeightSyncError(f"lost the weight-sync rendezvous store while waiting for {what}: {exc}") from None
        poll_fn()
        if time.monotonic() >= deadline:
            missing = [k for k in keys if not store.check([k])]
            raise TimeoutError(f"weight sync: {what} did not happen within {timeout_s:.0f}s (missing {missing[:8]})")
        time.sleep(sleep)
        sleep = min(sleep * 2, 0.05)


class WeightSyncGroup:
    """The standalone group: the trainer side :meth:`host` s the store, receivers :meth:`join` it.

    ``backend``: "gloo" (CPU tensors; tested here) or "nccl" (CUDA tensors; not run on this machine).
    ``op_timeout_s`` bounds every collective and the sender's wait for ready receivers; ``connect_timeout_s`` bounds
    the rendezvous (workers may take minutes to load an engine).
    """

    def __init__(self, store: Any, rank: int, world_size: int, backend: str, device: torch.device,
                 op_timeout_s: float, where: str):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} / world size {world_size}: need a sender and at least one receiver")
        self.store, self.rank, self.world_size, self.backend = store, rank, world_size, backend
        self.device, self.op_timeout_s, self.where = device, float(op_timeout_s), where
        self.ctl = dist.PrefixStore("ctl/", store)
        self.pg: Any = None
        self.broken: str | None = None

    @property
    def port(self) -> int:
        return int(self.store.port)

    @classmethod
    def host(cls, world_size: int, *, host: str = "127.0.0.1", port: int = 0, backend: str = "gloo",
             device: torch.device | str | None = None, op_timeout_s: float = 600.0) -> "WeightSyncGroup":
        """Rank 0 (the trainer): starts the TCPStore (``port`` 0: the OS picks one; :attr:`port` tells which). The
        process group itself is built by :meth:`connect` once every receiver has joined."""
        store = dist.TCPStore(host, port, None, True, timeout=datetime.timedelta(seconds=op_timeout_s),
                              wait_for_workers=False)
        return cls(store, 0, world_size, backend, _device(backend, device), op_timeout_s, f"{host}:{store.port}")

    @classmethod
    def join(cls, host: str, port: int, rank: int, world_size: int, *, backend: str = "gloo",
             device: torch.device | str | None = None, connect_timeout_s: float = 3600.0,
             op_timeout_s: float = 600.0) -> "WeightSyncGroup":
        """A receiver: connects to the trainer's store, registers ``rank``, waits for the trainer's go (every rank
        joined), then builds the process group."""
        if not 0 < rank < world_size:
            raise ValueError(f"receiver rank must be in 1..{world_size - 1}, got {rank}")
        try:
            store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=connect_timeout_s))
        except (RuntimeError, dist.DistError) as exc:
            raise WeightSyncError(f"cannot reach the weight-sync store at {host}:{port} within "
                                  f"{connect_timeout_s:.0f}s: {exc}") from None
        g = cls(store, rank, world_size, backend, _device(backend, device), op_timeout_s, f"{host}:{port}")
        if g.ctl.add(f"joined/{rank}", 1) != 1:
            raise WeightSyncError(f"weight-sync rank {rank} joined twice at {g.where} (two workers with one id?)")
        _wait_keys(g.ctl, ["go"], connect_timeout_s, f"the trainer's go at {g.where}")
        g._build()
        return g

    def connect(self, timeout_s: float = 3600.0, poll_fn: Callable[[], None] | None = None) -> None:
        """Sender: waits (``poll_fn`` between polls) until every receiver has joined, then builds the group."""
        if self.pg is not None:
            return
        keys = [f"joined/{r}" for r in range(1, self.world_size)]
        _wait_keys(self.ctl, keys, timeout_s, f"{self.world_size - 1} weight receivers joining {self.where}", poll_fn)
        self.ctl.set("go", "1")
        self._build()

    def _build(self) -> None:
        td = datetime.timedelta(seconds=self.op_timeout_s)
        pstore = dist.PrefixStore("pg/", self.store)
        try:
            if self.backend == "gloo":
                self.pg = dist.ProcessGroupGloo(pstore, self.rank, self.world_size, td)
            else:  # GPU only; not run on this machine
                opts = dist.ProcessGroupNCCL.Options()
                opts.is_high_priority_stream = False
                opts._timeout = td
                opts.group_name = "tsync_weight_sync"
                self.pg = dist.ProcessGroupNCCL(pstore, self.rank, self.world_size, opts)
        except (RuntimeError, dist.DistError) as exc:
            raise WeightSyncError(f"building the {self.backend} weight-sync group at {self.where} failed: "
                                  f"{exc}") from None

    def broadcast(self, t: torch.Tensor, what: str) -> None:
        """In-place broadcast of a contiguous tensor from rank 0; any failure leaves the group broken."""
        if self.broken:
            raise WeightSyncError(f"weight-sync group unusable: {self.broken}")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        try:
            self.pg.broadcast([t], opts).wait()
        except (RuntimeError, dist.DistError) as exc:
            self.broken = (f"broadcast of {what} failed on rank {self.rank} ({self.backend}, {self.where}; a peer died "
                           f"or did not take part within {self.op_timeout_s:.0f}s): {exc}")
            raise WeightSyncError(self.broken) from None

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass


def _device(backend: str, device: torch.device | str | None) -> torch.device:
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("weight-sync backend nccl needs CUDA, and this process sees no GPU: use gloo")
    if device is not None:
        device = torch.device(device)
    elif backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if (backend == "nccl") != (device.type == "cuda"):
        raise ValueError(f"backend {backend} needs {'CUDA' if backend == 'nccl' else 'CPU'} buffers, got {device}")
    return device


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (a contiguous copy first if it is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# ----------------------------------------------------------------------------------------------------- sender
class BroadcastWeightPublisher:
    """:class:`~megatron_tsync.transport.weights.WeightPublisher` over a :class:`WeightSyncGroup` (rank 0).

    ``publish(state, version)``: tensors may live on any device; their bytes are copied into a bucket buffer on the
    group's device (CPU for gloo, the current CUDA device for NCCL) unless a bucket is exactly one contiguous slice of
    one tensor already there (sent without a copy). ``poll_fn`` runs while waiting for receivers (the fleet's
    dead-worker check). ``last_stats`` holds the seconds and bytes of the latest publish.
    """

    def __init__(self, group: WeightSyncGroup, key: bytes, *, bucket_bytes: int = 256 << 20,
                 poll_fn: Callable[[], None] | None = None, connect_timeout_s: float = 3600.0):
        if group.rank != 0:
            raise ValueError("only rank 0 of the weight-sync group sends")
        self.group, self._key, self.bucket_bytes = group, check_key(key), _bucket_bytes(bucket_bytes)
        self.poll_fn, self.connect_timeout_s = poll_fn, connect_timeout_s
        self.seq, self.last_version = 0, -1
        self.last_stats: dict[str, float] = {}
        self._buf: torch.Tensor | None = None

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version <= self.last_version:
            raise ValueError(f"version must be an int > the last published {self.last_version}, got {version!r}")
        t0 = time.perf_counter()
        g = self.group
        g.connect(self.connect_timeout_s, self.poll_fn)
        layout = plan_layout(state_dict, self.bucket_bytes)
        manifest = self._sign(layout, version)
        self._handshake()
        header = torch.tensor([_MAGIC, _PROTOCOL, len(manifest), layout.total_bytes, layout.bucket_bytes, self.seq],
                              dtype=torch.int64)
        g.broadcast(header.to(g.device), f"v{version} header")
        g.broadcast(torch.frombuffer(bytearray(manifest), dtype=torch.uint8).to(g.device), f"v{version} manifest")
        flats = [_bytes_of(t) for t in state_dict.values()]  # views (a copy only for a non-contiguous tensor)
        for b, ((start, end), pieces) in enumerate(zip(layout.buckets(), layout.pieces())):
            g.broadcast(self._pack(layout, flats, start, end, pieces), f"v{version} bucket {b}")
        if g.device.type == "cuda":  # GPU only: the host must not reuse the bucket before the collective ran
            torch.cuda.current_stream(g.device).synchronize()
        self.seq += 1
        self.last_version = version
        self.last_stats = {"seconds": time.perf_counter() - t0, "bytes": layout.total_bytes,
                           "buckets": len(layout.buckets()), "tensors": len(layout.tensors)}

    def _sign(self, layout: WeightLayout, version: int) -> bytes:  # tests override it to forge manifests
        return sign_manifest(layout, version, self._key)

    def _handshake(self) -> None:
        g, seq = self.group, self.seq
        keys = [f"ready/{seq}/{r}" for r in range(1, g.world_size)]
        _wait_keys(g.ctl, keys, g.op_timeout_s, f"weight receivers ready for message {seq}", self.poll_fn)
        g.ctl.set(f"announce/{seq}", "1")
        for k in keys:
            g.ctl.delete_key(k)
        if seq >= 2:  # every receiver is past message seq - 2 (it announced readiness for seq - 1 before seq)
            g.ctl.delete_key(f"announce/{seq - 2}")

    def _pack(self, layout: WeightLayout, flats: list[torch.Tensor], start: int, end: int,
              pieces: list[tuple[int, int, int]]) -> torch.Tensor:
        g = self.group
        if len(pieces) == 1 and pieces[0][1:] == (start, end):  # a slice of one tensor: send it as is
            i, lo, hi = pieces[0]
            if flats[i].device == g.device:
                o = layout.tensors[i].offset
                return flats[i][lo - o: hi - o]
        n = end - start
        if self._buf is None or self._buf.numel() < n or self._buf.device != g.device:
            self._buf = torch.empty(min(layout.bucket_bytes, layout.total_bytes), dtype=torch.uint8, device=g.device)
        buf, pos = self._buf[:n], start
        for i, lo, hi in pieces:
            if lo > pos:
                buf[pos - start: lo - start].zero_()  # alignment padding
            o = layout.tensors[i].offset
            buf[lo - start: hi - start].copy_(flats[i][lo - o: hi - o])
            pos = hi
        if pos < end:
            buf[pos - start:].zero_()
        return buf

    def close(self) -> None:
        self.group.close()


# ----------------------------------------------------------------------------------------------------- receiver
class BroadcastWeightSubscriber:
    """Receiver side (rank ≥ 1). ``wait_for(version, timeout_s)`` → ``(version, {name: tensor})`` like the file
    :class:`~megatron_tsync.transport.weights.WeightSubscriber`, but it returns exactly ``version`` or raises.
    ``receive(version, timeout_s)`` returns a :class:`Receipt` that yields ``(name, tensor)`` pairs while buckets
    arrive (for loaders that stream, like vLLM's ``load_weights``). ``rejected`` counts rejections by reason."""

    def __init__(self, group: WeightSyncGroup, key: bytes):
        if group.rank == 0:
            raise ValueError("rank 0 of the weight-sync group is the sender")
        self.group, self._key = group, check_key(key)
        self.seq = 0
        self._t_announced = 0.0
        self.rejected: dict[str, int] = {}
        self.last_stats: dict[str, float] = {}

    def wait_for(self, version: int, timeout_s: float) -> tuple[int, dict[str, torch.Tensor]]:
        receipt = self.receive(version, timeout_s)
        return receipt.version, dict(receipt)

    def receive(self, version: int, timeout_s: float) -> "Receipt":
        """Waits (up to ``timeout_s`` in all) for the message of ``version``; older authentic versions are drained and
        counted on the way. Raises :class:`WrongVersion` (a newer version came), :class:`BadSignature` /
        :class:`Malformed` (manifest rejected; the stream stays usable), :class:`TimeoutError`,
        :class:`WeightSyncError` (sender gone, group broken)."""
        deadline = time.monotonic() + timeout_s
        while True:
            header, raw = self._next(max(deadline - time.monotonic(), 0.0))
            t0 = self._t_announced
            try:
                got, layout = verify_manifest(raw, self._key)
                if (layout.total_bytes, layout.bucket_bytes) != (header[3], header[4]):
                    raise Malformed(f"header framing {header[3]}/{header[4]} disagrees with the signed manifest")
            except TransportError as exc:
                self._reject(exc.reason, header)
                raise
            if got == version:
                return Receipt(self, got, layout, t0)
            self._reject(WrongVersion.reason, header)
            if got > version:
                raise WrongVersion(f"expected weights v{version}, the trainer sent v{got} (v{version} can no longer "
                                   "arrive: versions only increase)", got=got, expected=version)
            log.warning("weight sync: rejected stale weights v%d while waiting for v%d (%d rejected so far)", got,
                        version, self.rejected[WrongVersion.reason])

    def _next(self, timeout_s: float) -> tuple[list[int], bytes]:
        g, seq = self.group, self.seq
        g.ctl.set(f"ready/{seq}/{g.rank}", "1")
        _wait_keys(g.ctl, [f"announce/{seq}"], timeout_s, f"weights message {seq} from the trainer at {g.where}")
        self._t_announced = time.perf_counter()  # transfer time is measured from here (not the wait for the step)
        h = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=g.device)
        g.broadcast(h, f"header of message {seq}")
        header = [int(x) for x in h.cpu().tolist()]
        magic, proto, mlen, total, bucket, hseq = header
        if (magic, proto, hseq) != (_MAGIC, _PROTOCOL, seq) or not 0 < mlen <= MAX_MANIFEST_BYTES or total < 0 \
                or not ALIGN <= bucket <= MAX_BUCKET_BYTES:
            g.broken = f"message {seq}: implausible header {header} (stream out of step or not this protocol)"
            raise WeightSyncError(g.broken)
        m = torch.empty(mlen, dtype=torch.uint8, device=g.device)
        g.broadcast(m, f"manifest of message {seq}")
        self.seq += 1
        return header, m.cpu().numpy().tobytes()

    def _reject(self, reason: str, header: list[int]) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        total, bucket = header[3], header[4]
        buf = torch.empty(min(bucket, total), dtype=torch.uint8, device=self.group.device) if total else None
        for start in range(0, total, bucket):  # drain by the header's framing: the group stays in step
            self.group.broadcast(buf[: min(bucket, total - start)], f"drained bucket at {start}")


class Receipt:
    """The tensors of one accepted version, in manifest order, as ``(name, tensor)`` while the buckets arrive.

    Iterate it once (or ``dict(receipt)``); :meth:`drain` receives whatever was not consumed (call it in a
    ``finally`` when a loader may stop early: the sender broadcasts every bucket regardless)."""

    def __init__(self, sub: BroadcastWeightSubscriber, version: int, layout: WeightLayout, t0: float):
        self.sub, self.version, self.layout, self.t0 = sub, version, layout, t0
        self._it = self._stream()
        self.done = False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._it

    def drain(self) -> None:
        for _ in self._it:
            pass

    def _stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        g, lay = self.sub.group, self.layout
        for t in lay.tensors:
            if t.nbytes == 0:
                yield t.name, torch.empty(t.shape, dtype=_DTYPES[t.dtype], device=g.device)
        partial: dict[int, torch.Tensor] = {}
        for b, ((start, end), pieces) in enumerate(zip(lay.buckets(), lay.pieces())):
            buf = torch.empty(end - start, dtype=torch.uint8, device=g.device)  # fresh: yielded views stay valid
            g.broadcast(buf, f"v{self.version} bucket {b}")
            for i, lo, hi in pieces:
                t = lay.tensors[i]
                whole = lo == t.offset and hi == t.offset + t.nbytes
                if whole:
                    data = buf[lo - start: hi - start]
                else:
                    if i not in partial:
                        partial[i] = torch.empty(t.nbytes, dtype=torch.uint8, device=g.device)
                    partial[i][lo - t.offset: hi - t.offset].copy_(buf[lo - start: hi - start])
                    if hi != t.offset + t.nbytes:
                        continue
                    data = partial.pop(i)
                yield t.name, data.view(_DTYPES[t.dtype]).reshape(t.shape)
        self.done = True
        self.sub.last_stats = {"seconds": time.perf_counter() - self.t0, "bytes": lay.total_bytes,
                               "buckets": len(lay.buckets()), "tensors": len(lay.tensors)}
