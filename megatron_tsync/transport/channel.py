"""Authenticated ZeroMQ event channel: rollout workers (``EventSender``, DEALER, connect) → learner
(``EventReceiver``, ROUTER, bind).  ``tcp://host:port`` and ``ipc://path`` endpoints both work; a receiver may bind
``tcp://127.0.0.1:*`` and report the chosen port in ``receiver.endpoint``.

Protocol (at-least-once delivery + dedup ⇒ each valid event is delivered once)
---------------------------------------------------------------------------
* Every event frame is signed (``codec``) and numbered: ``seq`` = 1, 2, … per sender *epoch* (a random id drawn
  when the ``EventSender`` is built).  The sender keeps every frame until the receiver acknowledges it.
* **Ack = delivered.**  The receiver acknowledges a frame when ``poll`` hands its event to the caller (or rejects it
  for good: wrong version / schema — the sender then drops it and records ``(seq, reason, detail)`` in
  ``sender.rejections``).  Acks for one ``poll`` call are batched: one small signed ``Ack`` frame per sender.
* **Credit = window.**  Each ``Ack`` carries ``credit``: how many unacknowledged events the receiver lets one sender
  have in flight (``EventReceiver(credit=…)``; it may be changed at run time, 0 pauses producers).  The sender's
  window is ``min(max_inflight, credit)``; before the first ``Ack`` the sender assumes ``initial_credit`` (8; 0 makes
  the first ``send`` wait for a handshake: a ``Ping`` answered by an ``Ack``).  ``send`` blocks whenever the window is
  full and raises ``BackpressureTimeout`` after ``timeout_s``.  A consumer that does not poll sends no acks, so
  producers stop after ``credit`` events: the receiver holds at most ``n_senders × max(credit, initial_credit)``
  frames (each ≤ ``max_bytes``) and nothing is dropped.  ZMQ high-water marks bound the sockets' queues as a
  second line.  Give senders a ``max_bytes`` no larger than the receiver's: an oversize frame is refused locally by
  ``send`` (``Oversize``), since the receiver cannot answer a frame it does not read.
* **Loss repair by ping.**  When a sender has unacknowledged frames and has heard nothing for ``ping_interval_s``, it
  sends a numbered ``Ping`` listing the seqs it has handed to ZeroMQ.  A connection delivers frames in order, so when
  the receiver reads the ping it has already read every frame sent before it on that connection: it answers with
  those it has processed (ack) and those it never saw (``missing``); the sender resends a missing frame unless it
  already resent it after that ping (pings queued during an outage are answered late, all at once).  That covers a
  receiver restart (the new receiver saw none of them), a dropped connection and a lost ack, without timers that
  would resend to a receiver that is merely slow.
* **Dedup.**  The receiver's ``ReplayGuard`` remembers processed (sender, epoch, seq); a resend or a replayed frame is
  dropped and counted under ``replayed`` (and re-acked, in case the first ack was lost).

Consumer restart: ``close()`` the receiver (acks already sent are flushed within ``linger_ms``), build a new one on
the same endpoint; the senders reconnect by themselves and resend what the old one never delivered.  Exactly-once
across a restart relies on the old receiver's acks reaching the senders; if it crashed instead, pass its
``replay_state()`` (a plain list) to the new receiver to drop what it had already delivered.

Runs.  A sender and receiver built with ``run_id`` sign with ``secret.run_key(key, run_id)`` instead of the shared
key, and the sender's wire id is ``name@run_id``.  A frame that fails the receiver's run key but verifies under the
key of the run its sender id names is another run's (a stale worker of an earlier run, a second job sharing the
secret file): rejected as ``wrong_run``, never answered, never delivered.  Without ``run_id`` both sides use the
shared key as before.

Rejections never raise out of ``poll``: each is counted in ``receiver.stats[reason]`` (reasons of ``errors.py``), the
last few are kept in ``receiver.recent_rejections``.  Accepted events are counted in ``stats["accepted"]``.

Threading: each object's socket is used only from the calling thread.  A frame handed to ZeroMQ is delivered by
its I/O thread while the caller does something else (generation); reading acks, pinging and resending happen inside
``send``/``flush``/``pump``.  A worker that stops sending calls ``flush()`` before exiting (it returns once every
event is acknowledged); ``close()`` alone drops what is unacknowledged.  Ping/ack frames carry no policy version and
are never rejected for it; data events of a version other than ``expected_version_fn()`` are rejected as
``wrong_version`` (the learner passes its ``versions.VersionWindow.accepted``).
"""

from __future__ import annotations

import errno
import logging
import math
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Container
from typing import Any

import zmq

from .codec import _FIXED, ReplayGuard, _SEQUENCED, _parse_header, check_key, decode_frame, encode
from .errors import REJECT_REASONS, BackpressureTimeout, BadSignature, Oversize, Replayed, TransportError, WrongRun
from .schema import Ack, Ping, SchemaLimits
from .secret import run_key

__all__ = ["EventSender", "EventReceiver", "DEFAULT_MAX_BYTES"]

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 << 20
_MIN_HARD_CAP = 1 << 30


def hard_cap_bytes(max_bytes: int) -> int:
    """The receiver's ZMQ-level cap for a ``max_bytes`` limit: ``max(16 × max_bytes, 1 GiB)`` (1 GiB by default).
    Frames up to it are read and counted as ``oversize``; larger ones make ZMQ drop the connection, uncounted."""
    return max(16 * max_bytes, _MIN_HARD_CAP)
_HANDSHAKE_INTERVAL_S = 0.02
_MAX_PING_SEQS = 65536


def _socket(ctx: zmq.Context | None, kind: int, hwm: int, linger_ms: int) -> zmq.Socket:
    sock = (ctx or zmq.Context.instance()).socket(kind)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, linger_ms)
    return sock


class _Pending:
    __slots__ = ("frame", "sent", "queued", "ping_mark")

    def __init__(self, frame: bytes) -> None:
        self.frame, self.sent, self.queued = frame, False, True
        self.ping_mark = 0  # pings sent before this frame's last transmission


class EventSender:
    """Worker side.  ``send(event)`` signs, numbers and sends one event; blocks while the credit window is full.

    Not thread-safe: use one sender per thread.
    """

    def __init__(self, endpoint: str, key: bytes, sender_id: str, hwm: int = 1024, *, max_inflight: int = 256,
                 initial_credit: int = 8, ping_interval_s: float = 0.5, max_bytes: int = DEFAULT_MAX_BYTES,
                 limits: SchemaLimits | None = None, context: zmq.Context | None = None,
                 run_id: str | None = None) -> None:
        # a run's sender signs with the run's key and names its run in its (signed) id: see "Runs" above
        self._key = check_key(key) if run_id is None else run_key(check_key(key), run_id)
        self.endpoint, self.sender_id = endpoint, sender_id if run_id is None else f"{sender_id}@{run_id}"
        self.epoch = secrets.randbits(63) | 1  # nonzero, fits uint64
        self.max_inflight, self.ping_interval_s, self.max_bytes, self.limits = max_inflight, ping_interval_s, \
            max_bytes, limits
        self.credit = initial_credit  # granted by the receiver in every Ack; assumed until the first one
        self.peer_epoch: int | None = None  # the receiver instance that answered last (diagnostics)
        self._seq = 0
        self._pings = 0
        self._unacked: OrderedDict[int, _Pending] = OrderedDict()
        self._unsent: deque[int] = deque()
        self._last_rx = self._last_ping = -math.inf
        self.stats: dict[str, float] = dict(sent=0, resent=0, acked=0, rejected=0, pings=0, replies=0,
                                            bad_replies=0, blocked_s=0.0)
        self.rejections: deque[tuple[int, str, str]] = deque(maxlen=1024)
        self._sock = _socket(context, zmq.DEALER, hwm, 0)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 20)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        self._sock.connect(endpoint)
        self._closed = False

    # -- public API ---------------------------------------------------------------------------------------------------

    @property
    def window(self) -> int:
        """Events that may be in flight now: ``min(max_inflight, credit)``."""
        return min(self.max_inflight, self.credit)

    @property
    def in_flight(self) -> int:
        """Events sent (or queued) and not yet acknowledged."""
        return len(self._unacked)

    def send(self, event: Any, timeout_s: float | None = 60.0) -> int:
        """Sends one event; returns its sequence number.

        Blocks while ``in_flight >= window`` (backpressure), serving acks/pings/resends meanwhile; raises
        ``BackpressureTimeout`` after ``timeout_s`` (``None``: wait forever), ``SchemaError`` for an invalid event
        and ``Oversize`` for a frame larger than ``max_bytes``.
        """
        if self._closed:
            raise RuntimeError("EventSender is closed")
        seq = self._seq + 1
        frame = encode(event, self._key, sender_id=self.sender_id, seq=seq, epoch=self.epoch, limits=self.limits)
        if len(frame) > self.max_bytes:
            raise Oversize(f"{type(event).__name__} frame of {len(frame)} bytes > max_bytes {self.max_bytes}")
        self._service(0.0)
        if len(self._unacked) >= self.window:
            self._wait(lambda: len(self._unacked) < self.window, timeout_s, "credit")
        self._seq = seq
        self._unacked[seq] = _Pending(frame)
        self._unsent.append(seq)
        self._flush_unsent()
        return seq

    def flush(self, timeout_s: float | None = 60.0) -> None:
        """Blocks until every sent event is acknowledged (delivered or rejected by the receiver)."""
        self._wait(lambda: not self._unacked, timeout_s, "acks of all in-flight events")

    def pump(self, timeout_s: float = 0.0) -> None:
        """Serves acks, pings and resends for up to ``timeout_s`` without sending a new event."""
        self._service(timeout_s)

    def close(self, flush_timeout_s: float | None = None) -> None:
        """Closes the socket; with ``flush_timeout_s`` first waits that long for all acks (raises on timeout).
        Events still unacknowledged at close are dropped here (a warning says how many): ``flush()`` first."""
        if self._closed:
            return
        try:
            if flush_timeout_s is not None:
                self.flush(flush_timeout_s)
        finally:
            self._closed = True
            if self._unacked:
                log.warning("sender %s: closing with %d unacknowledged events", self.sender_id, len(self._unacked))
            self._sock.close(linger=0)

    def __enter__(self) -> EventSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------------------------

    def _wait(self, done: Callable[[], bool], timeout_s: float | None, what: str) -> None:
        t0 = time.monotonic()
        deadline = math.inf if timeout_s is None else t0 + timeout_s
        try:
            while not done():
                now = time.monotonic()
                if now >= deadline:
                    hint = (" — no receiver has answered: is it running at this endpoint with the same key?"
                            if self.peer_epoch is None else "")
                    raise BackpressureTimeout(
                        f"waited {timeout_s:.3g}s for {what} from {self.endpoint} (in flight {len(self._unacked)}, "
                        f"window {self.window}, credit {self.credit}){hint}")
                self._service(deadline - now)
        finally:
            self.stats["blocked_s"] += time.monotonic() - t0

    def _service(self, wait_s: float) -> None:
        """Reads replies, sends what is queued, pings when due; waits up to ``wait_s`` only if nothing happened."""
        progressed = self._drain()
        self._flush_unsent()
        due = self._maybe_ping()
        if progressed or wait_s <= 0:
            return
        wait_ms = max(1, math.ceil(1000 * min(wait_s, due, 1.0)))
        if self._sock.poll(wait_ms, zmq.POLLIN | (zmq.POLLOUT if self._unsent else 0)):
            self._drain()
            self._flush_unsent()
        self._maybe_ping()

    def _drain(self) -> bool:
        n = 0
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return n > 0
            self._on_reply(frame)
            n += 1

    def _on_reply(self, frame: bytes) -> None:
        try:
            header, msg = decode_frame(frame, self._key, max_bytes=self.max_bytes)
        except TransportError as exc:
            self.stats["bad_replies"] += 1
            log.debug("sender %s: dropped bad reply: %s", self.sender_id, exc)
            return
        if not isinstance(msg, Ack) or msg.epoch != self.epoch:
            self.stats["bad_replies"] += 1
            return
        self.stats["replies"] += 1
        self._last_rx = time.monotonic()
        self.credit, self.peer_epoch = msg.credit, header.epoch
        for s in msg.acked:
            if self._unacked.pop(s, None) is not None:
                self.stats["acked"] += 1
        for s, reason, detail in msg.rejected:
            if self._unacked.pop(s, None) is not None:
                self.stats["rejected"] += 1
                self.rejections.append((s, reason, detail))
                log.warning("sender %s: event seq %d rejected by receiver: %s: %s", self.sender_id, s, reason, detail)
        for s in msg.missing:
            p = self._unacked.get(s)
            if p is not None and not p.queued and msg.ping_id > p.ping_mark:  # sent before that ping, never seen
                p.queued = True
                self._unsent.append(s)

    def _flush_unsent(self) -> None:
        while self._unsent:
            p = self._unacked.get(self._unsent[0])
            if p is not None:
                try:
                    self._sock.send(p.frame, zmq.NOBLOCK, copy=False)
                except zmq.Again:  # high-water mark reached: retry on the next service
                    return
                self.stats["resent" if p.sent else "sent"] += 1
                p.sent, p.queued, p.ping_mark = True, False, self._pings
            self._unsent.popleft()

    def _maybe_ping(self) -> float:
        """Pings if one is due; returns the seconds until the next one could be."""
        if self.credit > 0 and not self._unacked:
            return math.inf
        interval = _HANDSHAKE_INTERVAL_S if self.credit == 0 else self.ping_interval_s
        now = time.monotonic()
        wait = max(self._last_rx, self._last_ping) + interval - now
        if wait > 0:
            return wait
        seqs = [s for s, p in self._unacked.items() if p.sent][:_MAX_PING_SEQS]
        ping = Ping(self.epoch, self._pings + 1, seqs)
        frame = encode(ping, self._key, sender_id=self.sender_id, seq=0, epoch=self.epoch)
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            pass
        else:
            self._pings += 1
            self.stats["pings"] += 1
        self._last_ping = now
        return interval


class _Reply:
    __slots__ = ("epoch", "acked", "rejected", "missing", "ping_id")

    def __init__(self, epoch: int) -> None:
        self.epoch, self.acked, self.rejected, self.missing, self.ping_id = epoch, [], [], [], 0


class EventReceiver:
    """Learner side.  ``poll(timeout_ms)`` returns verified events; every rejection is counted, none raises.

    ``expected_version_fn()`` returns the policy version accepted now (an int; ``None`` = any; a container of ints for
    a bounded-staleness mode); it is called once per frame.  Not thread-safe: poll from one thread.
    """

    def __init__(self, endpoint: str, key: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 expected_version_fn: Callable[[], int | Container[int] | None] | None = None,
                 limits: SchemaLimits | None = None, credit: int = 64, hwm: int = 1024,
                 receiver_id: str = "learner", replay_state: list[list[Any]] | None = None, linger_ms: int = 2000,
                 bind_timeout_s: float = 5.0, context: zmq.Context | None = None,
                 hard_max_bytes: int | None = None, run_id: str | None = None) -> None:
        self._secret, self.run_id = check_key(key), run_id
        self.wrong_run_kinds: dict[str, int] = {}  # wrong_run rejections by frame kind (trajectory, turn, ping)
        self._key = self._secret if run_id is None else run_key(self._secret, run_id)
        self.max_bytes, self.limits, self.credit, self.receiver_id = max_bytes, limits, credit, receiver_id
        self._expected_version_fn = expected_version_fn
        self._guard = ReplayGuard.from_state(replay_state) if replay_state else ReplayGuard()
        self.epoch = secrets.randbits(63) | 1  # this receiver instance
        self.stats: dict[str, int] = {"accepted": 0, **{r: 0 for r in REJECT_REASONS},
                                      "pings": 0, "acks_sent": 0, "ack_send_failed": 0}
        self.recent_rejections: deque[tuple[str, str]] = deque(maxlen=128)
        # authentic trajectory events rejected for their content, as (traj_id, group_id, policy_version, reason,
        # detail): the learner accounts those trajectories instead of waiting for them (runtime/validation.py)
        self.rejected_events: deque[tuple[str, str, int, str, str]] = deque(maxlen=65536)
        self._sock = _socket(context, zmq.ROUTER, hwm, linger_ms)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # hard cap: ZMQ drops the connection of a peer sending more than this without telling us (libzmq 4.3 reports a
        # plain disconnect); frames between max_bytes and the cap reach decode() and are counted as "oversize"
        self.hard_max_bytes = hard_cap_bytes(max_bytes) if hard_max_bytes is None else hard_max_bytes
        self._sock.setsockopt(zmq.MAXMSGSIZE, self.hard_max_bytes)
        self._bind(endpoint, bind_timeout_s)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._closed = False

    def _bind(self, endpoint: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:  # a just-closed receiver's port / ipc file is released asynchronously by ZMQ's I/O thread
            try:
                self._sock.bind(endpoint)
                return
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                    self._sock.close(linger=0)
                    raise
                time.sleep(0.02)

    # -- public API ---------------------------------------------------------------------------------------------------

    @property
    def rejected(self) -> int:
        """Total rejected frames, all reasons."""
        return sum(self.stats[r] for r in REJECT_REASONS)

    def replay_state(self) -> list[list[Any]]:
        """Dedup state to hand to a replacement receiver (``EventReceiver(..., replay_state=...)``)."""
        return self._guard.state()

    def poll(self, timeout_ms: int = 0, max_events: int = 1024) -> list[Any]:
        """Waits up to ``timeout_ms`` for the first event, then returns it with every event already available (at most
        ``max_events``).  Events returned are acknowledged to their senders before ``poll`` returns."""
        if self._closed:
            raise RuntimeError("EventReceiver is closed")
        events: list[Any] = []
        replies: dict[tuple[bytes, int], _Reply] = {}
        deadline = time.monotonic() + max(0, timeout_ms) / 1000
        while len(events) < max_events:
            wait_ms = 0 if events else max(0, math.ceil(1000 * (deadline - time.monotonic())))
            if not self._sock.poll(wait_ms, zmq.POLLIN):
                break
            while len(events) < max_events:
                try:
                    parts = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(parts, events, replies)
        self._send_replies(replies)
        return events

    def close(self) -> None:
        """Closes the socket; acks already queued are flushed for up to ``linger_ms``."""
        if not self._closed:
            self._closed = True
            self._sock.close()

    def __enter__(self) -> EventReceiver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------------------------

    def _reject(self, exc: TransportError) -> None:
        self.stats[exc.reason] += 1
        self.recent_rejections.append((exc.reason, exc.detail[:512]))
        ids, h = getattr(exc, "event_ids", None), exc.header
        if ids is not None and h is not None and h.kind == "trajectory":
            self.rejected_events.append((ids[0], ids[1], h.policy_version, exc.reason, exc.detail[:512]))
        log.debug("receiver: rejected frame: %s", exc)

    def _handle(self, parts: list[bytes], events: list[Any], replies: dict[tuple[bytes, int], _Reply]) -> None:
        ident = parts[0]
        if len(parts) != 2:
            self.stats["malformed"] += 1
            self.recent_rejections.append(("malformed", f"{len(parts) - 1} message parts, expected 1"))
            return
        expected = self._expected_version_fn() if self._expected_version_fn is not None else None
        try:
            header, ev = decode_frame(parts[1], self._key, max_bytes=self.max_bytes, expected_version=expected,
                                      limits=self.limits, replay_guard=self._guard)
        except Replayed as exc:
            self._reject(exc)
            self._reply(replies, ident, exc.header.epoch).acked.append(exc.header.seq)
            return
        except TransportError as exc:
            if isinstance(exc, BadSignature) and self.run_id is not None:
                exc = self._other_run(parts[1]) or exc
            self._reject(exc)
            h = exc.header
            if h is not None and h.seq >= 1 and h.kind in {c.KIND for c in _SEQUENCED}:
                self._reply(replies, ident, h.epoch).rejected.append([h.seq, exc.reason, exc.detail[:512]])
            return
        if isinstance(ev, Ping):
            self.stats["pings"] += 1
            r = self._reply(replies, ident, header.epoch)
            if r.ping_id:  # two pings from one sender in one poll: answer the first now
                self._send_replies({(ident, header.epoch): r})
                r = replies[(ident, header.epoch)] = _Reply(header.epoch)
            r.ping_id = ev.ping_id
            for s in ev.seqs:
                (r.acked if self._guard.seen(header.sender_id, header.epoch, s) else r.missing).append(s)
        elif isinstance(ev, Ack):
            self.stats["malformed"] += 1
            self.recent_rejections.append(("malformed", "unexpected ack frame at the receiver"))
        else:
            self.stats["accepted"] += 1
            events.append(ev)
            self._reply(replies, ident, header.epoch).acked.append(header.seq)

    def _other_run(self, frame: bytes) -> WrongRun | None:
        """A frame that failed this run's key: ``WrongRun`` when it verifies under the key of the run its sender id
        names (``name@RUN``; a sender of no run: the bare secret), i.e. it is authentic but another run's. Never
        answered: its sender cannot verify this run's acks, and a stale worker has nothing to learn from us."""
        try:
            slen = _FIXED.unpack_from(frame)[-1]
            sender = bytes(frame[_FIXED.size:_FIXED.size + slen]).decode("utf-8")
            other = sender.rpartition("@")[2] if "@" in sender else None
            if other == self.run_id:
                return None
            kind = _parse_header(frame, self._secret if other is None else run_key(self._secret, other),
                                 self.max_bytes)[0].kind
        except Exception:  # struct, utf-8, key or tag failure: a forgery (or garbage), not another run's frame
            return None
        self.wrong_run_kinds[kind] = self.wrong_run_kinds.get(kind, 0) + 1
        return WrongRun(f"{kind} from sender {sender!r} signed for run {other or '(none)'}; this is run {self.run_id}")

    @staticmethod
    def _reply(replies: dict[tuple[bytes, int], _Reply], ident: bytes, epoch: int) -> _Reply:
        r = replies.get((ident, epoch))
        if r is None:
            r = replies[(ident, epoch)] = _Reply(epoch)
        return r

    def _send_replies(self, replies: dict[tuple[bytes, int], _Reply]) -> None:
        for (ident, _), r in replies.items():
            if not (r.acked or r.rejected or r.missing or r.ping_id):
                continue
            ack = Ack(epoch=r.epoch, credit=self.credit, ping_id=r.ping_id, acked=r.acked, rejected=r.rejected,
                      missing=r.missing)
            frame = encode(ack, self._key, sender_id=self.receiver_id, seq=0, epoch=self.epoch)
            try:
                self._sock.send_multipart([ident, frame], zmq.NOBLOCK)
                self.stats["acks_sent"] += 1
            except zmq.ZMQError as exc:  # peer gone (EHOSTUNREACH) or its queue full: its next ping repairs this
                self.stats["ack_send_failed"] += 1
                log.debug("receiver: ack to %r failed: %s", ident, exc)
