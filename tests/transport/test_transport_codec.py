"""Codec: every rejection is a typed error with its reason; the checks run in the documented order."""

import os
import struct

import msgpack
import numpy as np
import pytest
from tsync_transport_helpers import KEY, make_small, make_traj

from megatron_tsync.transport import (
    BadLogprob,
    BadSignature,
    Malformed,
    NonFinite,
    Oversize,
    Replayed,
    ReplayGuard,
    TransportError,
    Unsigned,
    WrongVersion,
    decode,
    decode_frame,
    encode,
)
from megatron_tsync.transport.codec import _seal
from megatron_tsync.transport.schema import Ping

MAX = 1 << 20


def _raises(exc_type, frame, match=None, **kw):
    with pytest.raises(exc_type, match=match) as info:
        decode(frame, KEY, max_bytes=kw.pop("max_bytes", MAX), **kw)
    assert isinstance(info.value, TransportError)
    assert info.value.reason == exc_type.reason
    return info.value


def test_header_fields_are_authenticated_and_returned() -> None:
    frame = encode(make_traj(0, version=3), KEY, sender_id="worker-7", seq=11, epoch=99)
    h, ev = decode_frame(frame, KEY, max_bytes=MAX, expected_version=3)
    assert (h.kind, h.policy_version, h.seq, h.epoch, h.sender_id) == ("trajectory", 3, 11, 99, "worker-7")
    assert ev.traj_id == "traj-0"


def test_unsigned() -> None:
    payload = msgpack.packb(make_small(0).to_wire(), use_bin_type=True)
    frame = _seal(1, payload, KEY, sender_id="w", seq=1, epoch=1, policy_version=0, auth=0)
    _raises(Unsigned, frame, "no authentication tag")


def test_wrong_key_and_tampering() -> None:
    frame = encode(make_traj(0), KEY, seq=1)
    _raises(BadSignature, encode(make_traj(0), os.urandom(32), seq=1))
    for pos in (5, 8, 20, 40, len(frame) // 2, len(frame) - 40, len(frame) - 1):  # kind, version, seq, …, tag
        bad = bytearray(frame)
        bad[pos] ^= 0x01
        with pytest.raises((BadSignature, Malformed)):
            decode(bytes(bad), KEY, max_bytes=MAX)
    bad = bytearray(frame)
    bad[8:16] = struct.pack("<q", 1)  # claim another policy version
    _raises(BadSignature, bytes(bad))
    bad = bytearray(frame)
    bad[len(frame) // 2] ^= 0xFF  # tampered payload
    _raises(BadSignature, bytes(bad))


def test_malformed_frames() -> None:
    frame = encode(make_traj(0), KEY)
    _raises(Malformed, b"", "truncated")
    _raises(Malformed, os.urandom(10), "truncated")
    _raises(Malformed, b"XXXX" + os.urandom(300), "bad magic")
    _raises(Malformed, frame[:-10], "length mismatch")
    _raises(Malformed, frame + b"\0", "length mismatch")
    _raises(Malformed, frame[:4] + b"\x09" + frame[5:], "unsupported protocol version 9")
    _raises(Malformed, frame[:6] + b"\x07" + frame[7:], "unknown auth scheme")
    _raises(Malformed, 12345, "frame must be bytes")


@pytest.mark.parametrize("code, payload, match", [
    (1, b"\xc1\xc1", "payload is not msgpack"),
    (1, msgpack.packb([1, 2, 3]), "payload must be a map"),
    (1, msgpack.packb({"traj_id": 3}), "missing field"),
    (1, msgpack.packb({**make_small(0).to_wire(), "reward": None}, use_bin_type=True), "reward: expected float"),
    (3, msgpack.packb({**make_small(0).to_wire()}, use_bin_type=True), "unknown field"),  # a trajectory sent as a turn
    (1, msgpack.packb({**make_small(0).to_wire(), "policy_version": 4}, use_bin_type=True),
     "payload policy_version 4 != header 0"),
    (1, msgpack.packb({**make_traj(0).to_wire(), "token_ids": ["<i4", 10**6, b"\0" * 8]}), "bytes != length"),
    (2, msgpack.packb({}), "unknown kind code 2"),  # retired: a late reward (never sent by any worker)
    (4, msgpack.packb({}), "unknown kind code 4"),  # retired: worker control
    (99, msgpack.packb({}), "unknown kind code 99"),
])
def test_valid_hmac_but_bad_payload_is_malformed(code, payload, match) -> None:
    frame = _seal(code, payload, KEY, sender_id="w", seq=1, epoch=1, policy_version=0)
    err = _raises(Malformed, frame, match)
    assert err.header is not None and err.header.seq == 1  # authentic: the channel can tell the sender


def _nan_at(field: str, value: float = np.nan) -> bytes:
    wire = make_traj(0).to_wire()
    if field == "meta":
        wire["meta"] = {"latency_s": float("nan")}
    elif field == "reward":
        wire["reward"] = float("inf")
    else:  # an array: put the value on a trained token (index 40 is inside the first turn)
        a = getattr(make_traj(0), field).copy()
        a[40] = value
        wire[field] = ["<f4", a.size, a.tobytes()]
    return msgpack.packb(wire, use_bin_type=True)


@pytest.mark.parametrize("field", ["reward", "meta"])
def test_a_non_finite_number_anywhere_is_rejected_and_names_its_trajectory(field) -> None:
    frame = _seal(1, _nan_at(field), KEY, sender_id="w", seq=1, epoch=1, policy_version=0)
    err = _raises(NonFinite, frame, f"TrajectoryEvent.{field}")
    assert isinstance(err, Malformed) and err.reason == "non_finite"
    assert err.event_ids == ("traj-0", "group-0")  # authentic: the learner can account the trajectory
    control = _seal(1, msgpack.packb(make_traj(0).to_wire(), use_bin_type=True), KEY, sender_id="w", seq=1, epoch=1,
                    policy_version=0)
    assert decode(control, KEY, max_bytes=MAX).traj_id == "traj-0"


@pytest.mark.parametrize("field,value,match", [
    ("logprobs", np.nan, "non-finite value nan"), ("logprobs", -np.inf, "non-finite value -inf"),
    ("logprobs", -1e4, "below -126.0"), ("logprobs", 0.5, "must be <= 0"),
    ("teacher_logprobs", np.nan, "non-finite value nan"), ("teacher_logprobs", 0.5, "must be <= 0")])
def test_a_log_prob_no_engine_can_produce_is_bad_logprob(field, value, match) -> None:
    """NaN, ±inf, a behaviour log-prob below schema.LOGPROB_FLOOR (-1e4 overflowed the async ratio), or > 0: reason
    ``bad_logprob``, naming the trajectory so the learner accounts it as failed."""
    frame = _seal(1, _nan_at(field, value), KEY, sender_id="w", seq=1, epoch=1, policy_version=0)
    err = _raises(BadLogprob, frame, f"TrajectoryEvent.{field}: .*{match}")
    assert isinstance(err, Malformed) and err.reason == "bad_logprob"
    assert err.event_ids == ("traj-0", "group-0")


def test_log_probs_an_engine_can_produce_pass() -> None:
    """Controls of the floor and the tolerance: -125 (a sampled token's untruncated log-prob can be that low), a
    teacher log-prob far below the floor (the teacher did not sample it), and float rounding above 0."""
    for field, value in (("logprobs", -125.0), ("logprobs", 1e-7), ("teacher_logprobs", -1e4)):
        frame = _seal(1, _nan_at(field, value), KEY, sender_id="w", seq=1, epoch=1, policy_version=0)
        assert decode(frame, KEY, max_bytes=MAX).traj_id == "traj-0", (field, value)


def test_a_payload_naming_no_ids_carries_none() -> None:
    frame = _seal(1, msgpack.packb({"traj_id": 3}), KEY, sender_id="w", seq=1, epoch=1, policy_version=0)
    assert _raises(Malformed, frame, "missing field").event_ids is None


def test_oversize_checked_before_parsing() -> None:
    _raises(Oversize, os.urandom(5000), "5000 bytes > max_bytes 4999", max_bytes=4999)
    frame = encode(make_traj(0, T=4096), KEY)
    _raises(Oversize, frame, max_bytes=len(frame) - 1)
    decode(frame, KEY, max_bytes=len(frame))


def test_wrong_version() -> None:
    frame = encode(make_traj(0, version=4), KEY)
    err = _raises(WrongVersion, frame, "policy version 4, expected 5", expected_version=5)
    assert (err.got, err.expected, err.header.seq) == (4, 5, 1)
    assert decode(frame, KEY, max_bytes=MAX, expected_version=range(3, 6)).policy_version == 4  # bounded staleness
    assert decode(frame, KEY, max_bytes=MAX, expected_version=None).policy_version == 4
    # channel messages carry no version and are never rejected for it
    ping = decode(encode(Ping(epoch=1, ping_id=1), KEY, seq=0), KEY, max_bytes=MAX, expected_version=123)
    assert isinstance(ping, Ping) and ping.ping_id == 1


def test_signature_checked_before_version() -> None:
    """A forged frame is a forgery, not a stale rollout."""
    _raises(BadSignature, encode(make_traj(0, version=4), os.urandom(32)), expected_version=5)


def test_replay_guard() -> None:
    g = ReplayGuard()
    frames = [encode(make_small(i), KEY, sender_id="w", seq=i + 1, epoch=7) for i in range(5)]
    for f in (frames[0], frames[2], frames[1]):  # out of order (a resend overtaken by a later frame) is fine
        decode(f, KEY, max_bytes=MAX, replay_guard=g)
    for f in (frames[0], frames[1], frames[2]):
        _raises(Replayed, f, "already processed", replay_guard=g)
    other_epoch = encode(make_small(0), KEY, sender_id="w", seq=1, epoch=8)  # a restarted sender: new epoch
    decode(other_epoch, KEY, max_bytes=MAX, replay_guard=g)
    g2 = ReplayGuard.from_state(g.state())  # carried across a receiver restart
    _raises(Replayed, frames[2], replay_guard=g2)
    decode(frames[3], KEY, max_bytes=MAX, replay_guard=g2)
    assert {e: floor for _, e, floor, _ in g2.state()} == {7: 4, 8: 1}  # floor advanced over 1..4
    bad = bytearray(frames[4])
    bad[-1] ^= 1
    _raises(BadSignature, bytes(bad), replay_guard=g2)  # forged frames never touch the guard
    decode(frames[4], KEY, max_bytes=MAX, replay_guard=g2)


def test_replay_guard_bounds_memory() -> None:
    g = ReplayGuard(max_streams=2, max_gap=4)
    for s in (2, 3, 4, 5, 6):  # seq 1 never arrives
        assert g.mark("a", 1, s)
    assert g.seen("a", 1, 1) and len(g.state()[0][3]) <= 4
    g.mark("b", 1, 1)
    g.mark("c", 1, 1)
    assert [s[0] for s in g.state()] == ["b", "c"]


def test_sequence_zero_rejected_for_events() -> None:
    err = _raises(Malformed, encode(make_small(0), KEY, seq=0), "sequence number 0")
    assert err.header is not None


def test_encode_refuses_invalid_events_and_short_keys() -> None:
    ev = make_small(0)
    ev.reward = float("nan")
    with pytest.raises(ValueError, match="reward: must be finite"):
        encode(ev, KEY)
    with pytest.raises(ValueError, match="length >= 16"):
        encode(make_small(0), b"short")
