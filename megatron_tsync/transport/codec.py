"""Signed frames: ``encode(event, key) -> bytes`` and ``decode(frame, key, ...) -> event``.

Frame layout (all integers little-endian)::

    offset  size  field
    0       4     magic b"TSYN"
    4       1     protocol version (1)
    5       1     kind code (1 trajectory, 3 turn, 16 ping, 17 ack; 2 and 4 are retired, never reuse them)
    6       1     auth scheme (1 = HMAC-SHA256; 0 = none, always rejected as ``Unsigned``)
    7       1     reserved (0)
    8       8     policy version, int64 (-1 for the version-free channel messages: ping, ack)
    16      8     sequence number, uint64 (per sender epoch, starts at 1; 0 for ping/ack)
    24      8     sender epoch, uint64 (random per EventSender instance; see below)
    32      4     payload length, uint32
    36      2     sender id length, uint16
    38      n     sender id, utf-8
    38+n    m     payload: msgpack map (arrays as [dtype, length, bin]; never pickle)
    38+n+m  32    HMAC-SHA256(key, header || sender id || payload)

``decode`` checks, in this order, and raises the first failure: size (``Oversize``, before anything is parsed),
fixed header / magic / protocol / declared lengths (``Malformed``), auth scheme (``Unsigned``), tag
(``BadSignature``, ``hmac.compare_digest``), replay (``Replayed``, when a :class:`ReplayGuard` is given), policy
version (``WrongVersion``), then the msgpack payload and the schema (``Malformed``; ``NonFinite`` for a NaN or an
infinity in the reward or ``meta``; ``BadLogprob`` for a log-prob no engine can produce, NaN included).  A schema
rejection of an authentic frame carries the ``(traj_id, group_id)`` its payload names in ``exc.event_ids`` (``None``
when the payload names none).  The version is checked from the authenticated header before the payload is parsed, and the payload's ``policy_version`` must equal the header's.

Deviation from the brief: the header carries a *sender epoch* besides the sender id.  Replay protection keys on
(sender id, epoch, seq), so a worker that restarts under the same id (new epoch, seq again from 1) is not mistaken
for a replay, while a replayed frame of a live epoch is.  Replays of an old epoch's frames are stopped by the version
check (the learner has moved on) — within one policy version a receiver remembers up to ``max_streams`` epochs.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import BadLogprob, BadSignature, Malformed, NonFinite, Oversize, Replayed, Unsigned, WrongVersion
from .schema import Ack, BadLogprobError, NonFiniteError, Ping, SchemaError, SchemaLimits, TrajectoryEvent, TurnEvent

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "FrameHeader",
    "ReplayGuard",
    "encode",
    "decode",
    "decode_frame",
    "check_key",
]

MAGIC = b"TSYN"
PROTOCOL_VERSION = 1
TAG_LEN = 32
_AUTH_NONE, _AUTH_HMAC_SHA256 = 0, 1
_FIXED = struct.Struct("<4sBBBBqQQIH")  # 38 bytes
_MAX_SENDER_LEN = 255

# codes 2 (a late reward) and 4 (worker control) were kinds no worker ever sent: retired, decoded as unknown
_KIND_TO_CODE: dict[type, int] = {TrajectoryEvent: 1, TurnEvent: 3, Ping: 16, Ack: 17}
_CODE_TO_KIND: dict[int, type] = {v: k for k, v in _KIND_TO_CODE.items()}
_VERSIONED = (TrajectoryEvent, TurnEvent)
_SEQUENCED = (TrajectoryEvent, TurnEvent)  # replay-protected, acked


def check_key(key: Any) -> bytes:
    """Returns ``key`` as bytes; raises ``ValueError`` unless it is at least 16 bytes long."""
    if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
        raise ValueError("HMAC key must be bytes of length >= 16 (see megatron_tsync.transport.secret.load_secret)")
    return bytes(key)


@dataclass(frozen=True)
class FrameHeader:
    """The authenticated header of a decoded frame."""

    kind: str
    policy_version: int | None
    seq: int
    epoch: int
    sender_id: str


class ReplayGuard:
    """Remembers which (sender id, epoch, seq) were processed.

    Per stream: a ``floor`` (every seq <= floor was seen) plus the set of seen seqs above it, so resends that arrive out
    of order are told apart from replays (a plain high-water mark would drop a resend overtaken by a later frame).  A
    sender never has more than its window in flight, so the set stays small; ``max_gap`` bounds it anyway (the floor
    then jumps, treating a never-filled gap as seen).  ``max_streams`` epochs are kept, least recently used evicted.
    """

    def __init__(self, max_streams: int = 65536, max_gap: int = 65536) -> None:
        self._streams: OrderedDict[tuple[str, int], list[Any]] = OrderedDict()
        self.max_streams, self.max_gap = max_streams, max_gap

    def seen(self, sender_id: str, epoch: int, seq: int) -> bool:
        st = self._streams.get((sender_id, epoch))
        return st is not None and (seq <= st[0] or seq in st[1])

    def mark(self, sender_id: str, epoch: int, seq: int) -> bool:
        """Records ``seq``; returns ``False`` if it had been seen (a duplicate)."""
        key = (sender_id, epoch)
        st = self._streams.get(key)
        if st is None:
            st = self._streams[key] = [0, set()]
            while len(self._streams) > self.max_streams:
                self._streams.popitem(last=False)
        else:
            self._streams.move_to_end(key)
        floor, above = st
        if seq <= floor or seq in above:
            return False
        above.add(seq)
        while floor + 1 in above:
            floor += 1
            above.discard(floor)
        if len(above) > self.max_gap:
            floor = min(above)
            above.difference_update({s for s in above if s <= floor})
        st[0] = floor
        return True

    def state(self) -> list[list[Any]]:
        """A msgpack/JSON-serialisable snapshot (to carry dedup across a receiver restart)."""
        return [[s, e, st[0], sorted(st[1])] for (s, e), st in self._streams.items()]

    @classmethod
    def from_state(cls, state: list[list[Any]], **kwargs: Any) -> ReplayGuard:
        g = cls(**kwargs)
        for s, e, floor, above in state:
            g._streams[(str(s), int(e))] = [int(floor), set(int(a) for a in above)]
        return g


def _seal(code: int, payload: bytes, key: bytes, *, sender_id: str, seq: int, epoch: int, policy_version: int,
          auth: int = _AUTH_HMAC_SHA256) -> bytes:
    """Frames and signs raw payload bytes (``auth=0``: no tag).  Tests use it to build hostile-but-signed frames."""
    sender = sender_id.encode("utf-8")
    if len(sender) > _MAX_SENDER_LEN:
        raise ValueError(f"sender_id longer than {_MAX_SENDER_LEN} bytes")
    head = _FIXED.pack(MAGIC, PROTOCOL_VERSION, code, auth, 0, policy_version, seq, epoch, len(payload), len(sender))
    if auth == _AUTH_NONE:
        return b"".join((head, sender, payload))
    mac = hmac.new(key, head, hashlib.sha256)
    mac.update(sender)
    mac.update(payload)
    return b"".join((head, sender, payload, mac.digest()))


def encode(event: Any, key: bytes, *, sender_id: str = "anonymous", seq: int = 1, epoch: int = 0,
           limits: SchemaLimits | None = None) -> bytes:
    """Validates ``event`` and returns one signed frame.  Raises ``SchemaError`` for an invalid event."""
    key = check_key(key)
    code = _KIND_TO_CODE.get(type(event))
    if code is None:
        raise TypeError(f"cannot encode {type(event).__name__}")
    event.validate(limits)
    version = int(event.policy_version) if isinstance(event, _VERSIONED) else -1
    payload = msgpack.packb(event.to_wire(), use_bin_type=True)
    return _seal(code, payload, key, sender_id=sender_id, seq=seq, epoch=epoch, policy_version=version)


def _version_ok(got: int, expected: int | Container[int] | None) -> bool:
    if expected is None:
        return True
    if isinstance(expected, int):
        return got == expected
    return got in expected


def _parse_header(frame: Any, key: bytes, max_bytes: int) -> tuple[FrameHeader, type, bytes]:
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise Malformed(f"frame must be bytes, got {type(frame).__name__}")
    n = len(frame)
    if n > max_bytes:
        raise Oversize(f"{n} bytes > max_bytes {max_bytes}")
    if n < _FIXED.size:
        raise Malformed(f"truncated: {n} bytes < fixed header {_FIXED.size}")
    frame = bytes(frame)
    magic, proto, code, auth, _, version, seq, epoch, plen, slen = _FIXED.unpack_from(frame)
    if magic != MAGIC:
        raise Malformed(f"bad magic {magic!r}")
    if proto != PROTOCOL_VERSION:
        raise Malformed(f"unsupported protocol version {proto} (this build speaks {PROTOCOL_VERSION})")
    if auth == _AUTH_NONE:
        raise Unsigned("frame carries no authentication tag")
    if auth != _AUTH_HMAC_SHA256:
        raise Malformed(f"unknown auth scheme {auth}")
    body_end = _FIXED.size + slen + plen
    if n != body_end + TAG_LEN:
        raise Malformed(f"length mismatch: frame has {n} bytes, header declares {body_end + TAG_LEN} "
                        "(truncated or padded)")
    mac = hmac.new(key, memoryview(frame)[:body_end], hashlib.sha256).digest()
    if not hmac.compare_digest(mac, frame[body_end:]):
        raise BadSignature("HMAC-SHA256 tag does not verify (wrong key or tampered frame)")
    try:
        sender = frame[_FIXED.size:_FIXED.size + slen].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Malformed(f"sender id is not utf-8: {exc}") from None
    cls = _CODE_TO_KIND.get(code)
    kind = cls.KIND if cls is not None else f"unknown({code})"
    header = FrameHeader(kind, version if cls in _VERSIONED else None, seq, epoch, sender)
    if cls is None:
        raise Malformed(f"unknown kind code {code}", header=header)
    if cls in _VERSIONED and version < 0:
        raise Malformed(f"{kind} frame without a policy version", header=header)
    if cls not in _VERSIONED and version != -1:
        raise Malformed(f"{kind} frame must not carry a policy version (got {version})", header=header)
    if cls in _SEQUENCED and seq < 1:
        raise Malformed(f"{kind} frame with sequence number {seq} < 1", header=header)
    return header, cls, frame[_FIXED.size + slen:body_end]


def _with_ids(exc: Malformed, obj: Any) -> Malformed:
    """Records the (traj_id, group_id) an authentic but invalid payload names, when both are bounded strings, in
    ``exc.event_ids``: the learner then accounts that trajectory as rejected instead of waiting for it."""
    ids = (obj.get("traj_id"), obj.get("group_id")) if isinstance(obj, dict) else (None, None)
    ok = all(isinstance(i, str) and 0 < len(i) <= 512 for i in ids)
    exc.event_ids = ids if ok else None  # type: ignore[attr-defined]
    return exc


def decode_frame(frame: Any, key: bytes, *, max_bytes: int, expected_version: int | Container[int] | None = None,
                 limits: SchemaLimits | None = None,
                 replay_guard: ReplayGuard | None = None) -> tuple[FrameHeader, Any]:
    """Like :func:`decode` but also returns the authenticated :class:`FrameHeader`.

    ``expected_version``: ``None`` accepts any version; an int accepts exactly that one; a container (e.g. a
    ``range`` for an async mode with bounded staleness) accepts its members.  Ping and ack frames carry no version and
    are never rejected for it.
    """
    key = check_key(key)
    header, cls, payload = _parse_header(frame, key, max_bytes)
    if replay_guard is not None and cls in _SEQUENCED:
        if not replay_guard.mark(header.sender_id, header.epoch, header.seq):
            raise Replayed(f"seq {header.seq} of sender {header.sender_id!r} epoch {header.epoch} already processed",
                           header=header)
    if header.policy_version is not None and not _version_ok(header.policy_version, expected_version):
        raise WrongVersion(f"{header.kind} of policy version {header.policy_version}, expected {expected_version}",
                           header=header, got=header.policy_version, expected=expected_version)
    try:
        obj = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise Malformed(f"payload is not msgpack: {type(exc).__name__}: {exc}", header=header) from None
    try:
        event = cls.from_wire(obj)
        event.validate(limits)
    except SchemaError as exc:
        err = NonFinite if isinstance(exc, NonFiniteError) else BadLogprob if isinstance(exc, BadLogprobError) \
            else Malformed
        raise _with_ids(err(f"schema: {exc}", header=header), obj) from None
    except (TypeError, ValueError) as exc:  # e.g. a payload whose value types break a check's arithmetic
        raise _with_ids(Malformed(f"schema: {type(exc).__name__}: {exc}", header=header), obj) from None
    if header.policy_version is not None and event.policy_version != header.policy_version:
        raise Malformed(f"payload policy_version {event.policy_version} != header {header.policy_version}",
                        header=header)
    return header, event


def decode(frame: Any, key: bytes, *, max_bytes: int, expected_version: int | Container[int] | None = None,
           limits: SchemaLimits | None = None, replay_guard: ReplayGuard | None = None) -> Any:
    """Verifies and parses one frame; raises a :class:`~.errors.TransportError` subclass on any rejection."""
    return decode_frame(frame, key, max_bytes=max_bytes, expected_version=expected_version, limits=limits,
                        replay_guard=replay_guard)[1]
