"""Schema: bit-exact round trips of every kind, and precise validation errors."""

import math

import msgpack
import numpy as np
import pytest
from tsync_transport_helpers import KEY, make_small, make_traj, make_turn

from megatron_tsync.transport import (
    BadLogprobError,
    SchemaError,
    SchemaLimits,
    TrajectoryEvent,
    TurnEvent,
    decode,
    encode,
)
from megatron_tsync.transport.schema import LOGPROB_FLOOR


def _bits(a: np.ndarray) -> tuple[str, bytes]:
    return a.dtype.str, a.tobytes()


def _assert_bit_exact(a, b) -> None:
    assert type(a) is type(b)
    for name in ("token_ids", "loss_mask", "logprobs", "teacher_logprobs"):
        if hasattr(a, name):
            x, y = getattr(a, name), getattr(b, name)
            if x is None:
                assert y is None
            else:
                assert _bits(x) == _bits(y), name
                assert y.flags.writeable and y.flags.owndata
    assert a == b


@pytest.mark.parametrize("make", [
    lambda: make_traj(3, version=7, T=2048),
    lambda: make_traj(4, version=0, T=17, teacher=False, mask_dtype=np.bool_),
    lambda: make_turn(5, version=2),
    lambda: make_small(6, version=9),
])
def test_round_trip_every_kind_bit_exact(make) -> None:
    ev = make()
    out = decode(encode(ev, KEY, sender_id="w", seq=1, epoch=5), KEY, max_bytes=1 << 20)
    _assert_bit_exact(ev, out)
    again = type(ev).from_wire(msgpack.unpackb(msgpack.packb(ev.to_wire(), use_bin_type=True), raw=False))
    _assert_bit_exact(ev, again)


def test_round_trip_preserves_special_float_bits() -> None:
    ev = make_traj(1, T=64)
    special = np.array([-0.0, 0.0, np.finfo(np.float32).tiny / 4, -np.finfo(np.float32).max, 1e-45, -1e-45],
                       dtype=np.float32)
    ev.teacher_logprobs[: len(special)] = special  # subnormals, signed zeros, extremes
    ev.token_ids[:3] = [0, np.iinfo(np.int32).max, 1]
    out = decode(encode(ev, KEY), KEY, max_bytes=1 << 20)
    _assert_bit_exact(ev, out)
    assert math.copysign(1.0, float(out.teacher_logprobs[0])) == -1.0


def test_failed_trajectory_is_valid_and_every_trajectory_has_a_reward() -> None:
    ev = TrajectoryEvent("t", "g", 2, 1, np.zeros(0, np.int32), 0, np.zeros(0, np.uint8), np.zeros(0, np.float32),
                         reward=0.0, status="error", error="tool sandbox crashed: exit 137")
    ev.validate()
    assert decode(encode(ev, KEY), KEY, max_bytes=4096) == ev
    with pytest.raises(TypeError, match="reward"):  # no pending rewards: a worker scores before it sends
        TrajectoryEvent("t", "g", 2, 1, np.zeros(0, np.int32), 0, np.zeros(0, np.uint8), np.zeros(0, np.float32))
    ev.reward = None
    with pytest.raises(SchemaError, match="TrajectoryEvent.reward: expected float, got NoneType"):
        ev.validate()


def test_constructor_converts_lists_and_tensors_losslessly() -> None:
    torch = pytest.importorskip("torch")
    ev = TrajectoryEvent("t", "g", 1, 0, [5, 6, 7, 8], 2, [0, 0, 1, 1], torch.tensor([0, 0, -0.5, -0.25]),
                         reward=1, turn_spans=[[2, 4]])
    ev.validate()
    assert ev.token_ids.dtype == np.int32 and ev.loss_mask.dtype == np.uint8 and ev.logprobs.dtype == np.float32
    assert ev.turn_spans == [(2, 4)]
    with pytest.raises(SchemaError, match="token_ids: dtype"):
        TrajectoryEvent("t", "g", 1, 0, [0.5, 1.5], 0, [0, 0], [0.0, 0.0], 1.0).validate()


def _bad(**changes):
    ev = make_traj(0, T=32)
    for k, v in changes.items():
        setattr(ev, k, v)
    return ev


@pytest.mark.parametrize("ev, match", [
    (_bad(traj_id=""), r"traj_id: must be a non-empty string"),
    (_bad(group_id=3), r"group_id: expected str, got int"),
    (_bad(group_size=0), r"group_size: 0 < minimum 1"),
    (_bad(policy_version=True), r"policy_version: expected int, got bool"),
    (_bad(policy_version=-1), r"policy_version: -1 < minimum 0"),
    (_bad(token_ids=np.zeros(32, np.int64)), r"token_ids: dtype <i8"),
    (_bad(token_ids=np.zeros((2, 16), np.int32)), r"token_ids: expected 1-D"),
    (_bad(token_ids=np.full(32, -3, np.int32)), r"token_ids: negative token id -3"),
    (_bad(loss_mask=np.zeros(31, np.uint8)), r"loss_mask: length 31 != expected 32"),
    (_bad(loss_mask=np.full(32, 2, np.uint8)), r"loss_mask: values must be 0 or 1"),
    (_bad(logprobs=np.zeros(33, np.float32)), r"logprobs: length 33 != expected 32"),
    (_bad(logprobs=np.zeros(32, np.float64)), r"logprobs: dtype <f8"),
    (_bad(prompt_len=-1), r"prompt_len: -1 < minimum 0"),
    (_bad(prompt_len=33), r"prompt_len: 33 > maximum 32"),
    (_bad(reward=float("nan")), r"reward: must be finite"),
    (_bad(reward=float("inf")), r"reward: must be finite"),
    (_bad(reward="1"), r"reward: expected float"),
    (_bad(turn_spans=[(4, 40)]), r"turn_spans\[0\]"),
    (_bad(turn_spans=[(10, 20), (15, 30)]), r"turn_spans\[1\]"),
    (_bad(turn_spans=[(4, 10)]), r"loss_mask: is 1 at index \d+, outside every turn span"),
    (_bad(teacher_logprobs=np.full(32, np.nan, np.float32)), r"teacher_logprobs: non-finite value nan at index 0"),
    (_bad(status="maybe"), r"status: must be 'ok' or 'error'"),
    (_bad(status="error"), r"error: must be a non-empty string"),
    (_bad(error="boom"), r"error: must be empty when status == 'ok'"),
    (_bad(meta={"k": [1]}), r"meta\['k'\]: value must be str, int or float, got list"),
    (_bad(meta={1: "x"}), r"meta key: expected str, got int"),
])
def test_validation_errors_are_precise(ev, match) -> None:
    with pytest.raises(SchemaError, match=match):
        ev.validate()


def test_non_finite_and_positive_logprobs_rejected() -> None:
    ev = make_traj(0, T=32)
    i = int(np.flatnonzero(ev.loss_mask)[0])
    ev.logprobs[i] = np.inf
    with pytest.raises(SchemaError, match=rf"logprobs: non-finite value inf at index {i}"):
        ev.validate()
    ev.logprobs[i] = 0.5
    with pytest.raises(BadLogprobError, match="log-probabilities must be <= 0"):
        ev.validate()
    ev.logprobs[i] = -1e4  # finite, schema-valid before: overflowed exp(old − behaviour) in the async learner
    with pytest.raises(BadLogprobError, match=rf"logprobs: log-probability -10000.0 at index {i} is below -126.0"):
        ev.validate()
    ev.logprobs[i] = LOGPROB_FLOOR  # control: the floor itself, and float rounding above 0, pass
    ev.validate()
    ev.logprobs[i] = 1e-7
    ev.validate()
    ev = make_traj(0, T=32)
    ev.logprobs[0] = -1.0  # a prompt position: must be exactly 0
    with pytest.raises(SchemaError, match="logprobs: must be 0 where loss_mask is 0; index 0"):
        ev.validate()


def test_sequence_length_limit() -> None:
    ev = make_traj(0, T=512)
    ev.validate(SchemaLimits(max_seq_len=512))
    with pytest.raises(SchemaError, match="token_ids: length 512 exceeds max_seq_len 511"):
        ev.validate(SchemaLimits(max_seq_len=511))


def test_turn_validation() -> None:
    t = make_turn(0)
    t.loss_mask[0] = 1
    t.logprobs[0] = -0.1
    with pytest.raises(SchemaError, match="TurnEvent.loss_mask: must be 0 before start"):
        t.validate()
    t = make_turn(0)
    t.end = 65
    with pytest.raises(SchemaError, match="TurnEvent.token_ids: length 64 != expected 65"):
        t.validate()


def test_from_wire_missing_and_unknown_fields() -> None:
    wire = make_small(1).to_wire()
    del wire["reward"]
    with pytest.raises(SchemaError, match=r"missing field\(s\) \['reward'\]"):
        TrajectoryEvent.from_wire(wire)
    wire = make_small(1).to_wire() | {"extra": 1}
    with pytest.raises(SchemaError, match=r"unknown field\(s\) \['extra'\]"):
        TrajectoryEvent.from_wire(wire)
    wire = make_traj(1, T=8).to_wire()
    wire["logprobs"][2] = wire["logprobs"][2][:-1]
    with pytest.raises(SchemaError, match=r"logprobs: 31 bytes != length 8 x itemsize 4"):
        TrajectoryEvent.from_wire(wire)
    wire = make_traj(1, T=8).to_wire()
    wire["token_ids"][0] = "<i8"
    with pytest.raises(SchemaError, match=r"token_ids: dtype '<i8' not in"):
        TrajectoryEvent.from_wire(wire)
    wire = make_turn(1).to_wire()
    wire["loss_mask"] = None
    with pytest.raises(SchemaError, match="loss_mask: required array is null"):
        TurnEvent.from_wire(wire)


def _routed(n_pos: int = 31, layers: int = 2, k: int = 2, dtype=np.uint8):
    ev = make_traj(0, T=32)
    ev.routing = np.arange(n_pos * layers * k, dtype=dtype) % 8
    ev.routing_shape = (layers, k)
    return ev


@pytest.mark.parametrize("dtype", [np.uint8, np.int16])
def test_router_replay_routing_round_trips(dtype) -> None:
    ev = _routed(dtype=dtype)
    ev.validate()
    out = decode(encode(ev, KEY), KEY, max_bytes=1 << 20)
    assert out.routing.dtype == ev.routing.dtype and np.array_equal(out.routing, ev.routing)
    assert out.routing_shape == (2, 2) and out == ev


@pytest.mark.parametrize("ev, match", [
    (_routed(n_pos=33), r"routing: length 132 exceeds"),
    (_routed(layers=3, k=2), None),
    (_routed(dtype=np.int32), r"routing: dtype <i4"),
])
def test_router_replay_routing_validated(ev, match) -> None:
    if match is None:  # 31 positions × 3 × 2 is consistent; a shape that does not divide the length is not
        ev.validate()
        ev.routing_shape = (4, 2)
        match = r"routing: length 186 is not a multiple of layers x topk = 8"
    with pytest.raises(SchemaError, match=match):
        ev.validate()
    bad = _routed()
    bad.routing_shape = (0, 2)
    with pytest.raises(SchemaError, match=r"routing_shape\[0\]: 0 < minimum 1"):
        bad.validate()


def test_turn_event_routing_round_trips_and_is_validated() -> None:
    """A turn event carries the routing of its prefix (``--moe-router-replay`` with OPD stream-turn): at most ``end``
    positions."""
    t = make_turn(2, end=16)
    t.routing, t.routing_shape = np.arange(15 * 2 * 2, dtype=np.uint8) % 4, (2, 2)
    t.validate()
    out = decode(encode(t, KEY), KEY, max_bytes=1 << 20)
    assert np.array_equal(out.routing, t.routing) and out.routing_shape == (2, 2) and out == t
    t.routing = np.zeros(17 * 2 * 2, dtype=np.uint8)
    with pytest.raises(SchemaError, match=r"TurnEvent.routing: length 68 exceeds"):
        t.validate()
