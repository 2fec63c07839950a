"""Event schema of the rollout → learner wire, and its validation.

Two public event kinds (plus two internal channel messages):

* :class:`TrajectoryEvent` — one finished (or failed) trajectory: the whole token sequence ``(T,)`` = prompt +
  generated turns + tool output, ``loss_mask`` ``(T,)`` (1 = action token trained on), behaviour ``logprobs`` ``(T,)``
  (0 where the mask is 0), optional ``teacher_logprobs`` ``(T,)``, the generated ``turn_spans`` and the reward (a
  finite float: a worker scores a trajectory before it sends it; a failed one carries the task's lowest reward).
* :class:`TurnEvent` — one generated turn for turn-level distillation.  Its arrays cover the *prefix* ``[0, end)`` of
  the sequence so the event is self-contained for a forward pass; the turn itself is ``[start, end)`` and ``loss_mask``
  is 0 outside it.

Ids (``traj_id``, ``group_id``) are written by :mod:`megatron_tsync.transport.ids` when workers send them; the schema
only checks that they are bounded non-empty strings.

Every data event carries ``policy_version``; the receiver rejects other versions (see ``codec.decode``).

Arrays travel as ``[dtype, length, raw little-endian bytes]`` (a msgpack array holding a bin), never pickle; the dtype
of each field is fixed (``token_ids`` int32, ``loss_mask`` uint8 or bool, log-probs float32), so a round trip is
bit-exact, dtype included.  Equality of events (``==``) is bit-exact equality of their wire form.

Log-probs are checked against what an engine can produce (:data:`LOGPROB_FLOOR`, :data:`LOGPROB_TOL`): a behaviour
log-prob (``logprobs`` where ``loss_mask`` is 1) must be finite and in ``[LOGPROB_FLOOR, LOGPROB_TOL]``; a teacher
log-prob finite and ``<= LOGPROB_TOL``.  A violation raises :class:`BadLogprobError` (the receiver's reason
``bad_logprob``), NaN and infinities included.

``validate(limits)`` raises :class:`SchemaError` naming the field and the violated rule.  Lists, tuples and torch
tensors given to the constructors are converted to the field's dtype when that is lossless; anything else is left for
``validate`` to reject.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

__all__ = [
    "SchemaError",
    "NonFiniteError",
    "BadLogprobError",
    "LOGPROB_FLOOR",
    "LOGPROB_TOL",
    "SchemaLimits",
    "TrajectoryEvent",
    "TurnEvent",
    "Ping",
    "Ack",
    "EVENT_TYPES",
]

_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1

# wire dtype strings (numpy ``dtype.str``), little-endian where byte order matters
_I32, _U8, _BOOL, _F32, _I16 = "<i4", "|u1", "|b1", "<f4", "<i2"
_MASK_DTYPES = (_U8, _BOOL)


class SchemaError(ValueError):
    """An event violates the schema; the message names the field and the rule."""


class NonFiniteError(SchemaError):
    """A float field (the reward, a ``meta`` value) is NaN or infinite."""


class BadLogprobError(SchemaError):
    """A log-prob an engine cannot produce: NaN or infinite, above ``LOGPROB_TOL``, or (behaviour log-probs) below
    ``LOGPROB_FLOOR``."""


LOGPROB_TOL = 1e-6
"""Largest log-prob accepted: log-probs are <= 0; this allows float rounding of an engine's log-softmax only."""

LOGPROB_FLOOR = -126.0
"""Smallest *behaviour* log-prob accepted: ``ln(2**-150 / 2**31) = -181·ln 2 ≈ -125.46``, rounded down.

A behaviour log-prob is the log-prob of a token the engine *sampled*, under the distribution it reports it for
(temperature applied; ``rollout/vllm_engine.py``).  Engines sample from float32 probabilities (vLLM: softmax in
float32, then an exponential race in which a probability of exactly 0 never wins), and a float32 probability below
2**-150 (half the smallest subnormal) rounds to 0: a sampled token has probability >= 2**-150 in the distribution it
was drawn from.  With top-k / top-p the protocol reports the *untruncated* log-prob, which is the truncated one plus
ln M (M: the kept mass, >= the largest probability >= 1/V); token ids are int32, so V <= 2**31 and the untruncated
log-prob is >= ln(2**-150) - ln(2**31).  (No truncation: >= ln(2**-150) ≈ -103.97.)  Log-softmax rounding is a few
ulps of ~100 (1e-5).  An engine that samples in float64 (the embedded engine's CDF) could in principle draw a token
below the floor, with probability < 2**-150 ≈ 7e-46 per token: never.  ``-(ln V + margin)`` would be wrong: a
log-prob is bounded by the sampling precision, not by the vocabulary (a peaked distribution puts most tokens far
below -ln V).  The floor exists because the learner exponentiates ``old − behaviour`` (TIS, the ratio of
``--rl-mode async``): a forged -1e4 overflowed it to inf and the step to NaN (the ratio is also clamped,
``algorithms/policy_loss.py``).  Teacher log-probs get no floor: the teacher *scores* a token it did not sample,
so any finite value <= 0 is one it can produce; OPD uses them linearly (``algorithms/opd.py``)."""


@dataclass(frozen=True)
class SchemaLimits:
    """Bounds enforced by ``validate``; the receiver configures them once."""

    max_seq_len: int = 131072
    """Longest token sequence accepted (prompt + generated + tool output)."""
    max_id_len: int = 512
    """Longest ``traj_id`` / ``group_id`` / meta key, in characters."""
    max_text_len: int = 65536
    """Longest free text (error message, meta string value)."""
    max_meta_items: int = 64
    """Most entries in ``meta``."""
    max_turns: int = 4096
    """Most entries in ``turn_spans``."""
    max_ack_items: int = 65536
    """Most sequence numbers in one internal ping/ack message."""


_DEFAULT_LIMITS = SchemaLimits()


# ---------------------------------------------------------------------------------------------------------------------
# field checks (python objects)
# ---------------------------------------------------------------------------------------------------------------------


def _fail(cls: str, name: str, msg: str) -> SchemaError:
    return SchemaError(f"{cls}.{name}: {msg}")


def _check_str(cls: str, name: str, value: Any, max_len: int, *, nonempty: bool = True) -> None:
    if not isinstance(value, str):
        raise _fail(cls, name, f"expected str, got {type(value).__name__}")
    if nonempty and not value:
        raise _fail(cls, name, "must be a non-empty string")
    if len(value) > max_len:
        raise _fail(cls, name, f"length {len(value)} exceeds limit {max_len}")


def _check_int(cls: str, name: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise _fail(cls, name, f"expected int, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise _fail(cls, name, f"{value} < minimum {lo}")
    if hi is not None and value > hi:
        raise _fail(cls, name, f"{value} > maximum {hi}")


def _check_finite_float(cls: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise _fail(cls, name, f"expected float, got {type(value).__name__}")
    if not math.isfinite(float(value)):
        raise NonFiniteError(f"{cls}.{name}: must be finite, got {value}")


def _check_array(cls: str, name: str, value: Any, dtypes: tuple[str, ...], length: int | None, max_len: int) -> int:
    """Checks a 1-D array of one of ``dtypes``; returns its length."""
    if not isinstance(value, np.ndarray):
        raise _fail(cls, name, f"expected numpy array, got {type(value).__name__}")
    if value.ndim != 1:
        raise _fail(cls, name, f"expected 1-D array, got shape {value.shape}")
    if value.dtype.str not in dtypes:
        raise _fail(cls, name, f"dtype {value.dtype.str} not in {dtypes}")
    n = int(value.shape[0])
    if n > max_len:
        raise _fail(cls, name, f"length {n} exceeds max_seq_len {max_len}")
    if length is not None and n != length:
        raise _fail(cls, name, f"length {n} != expected {length}")
    return n


def _check_mask(cls: str, name: str, mask: np.ndarray) -> None:
    if mask.dtype.str == _U8 and mask.size and int(mask.max()) > 1:
        raise _fail(cls, name, f"values must be 0 or 1, found {int(mask.max())}")


def _check_zero_where_unmasked(cls: str, name: str, values: np.ndarray, mask: np.ndarray) -> None:
    off = values[mask == 0] != 0
    if off.size and off.any():
        i = int(np.flatnonzero(mask == 0)[int(np.flatnonzero(off)[0])])
        raise _fail(cls, name, f"must be 0 where loss_mask is 0; index {i} holds {values[i]}")


def _check_logprobs(cls: str, name: str, values: np.ndarray, *, floor: float | None = LOGPROB_FLOOR) -> None:
    """Finite, ``<= LOGPROB_TOL`` and (``floor`` not None) ``>= floor``; else :class:`BadLogprobError`."""
    if not values.size:
        return
    bad = ~np.isfinite(values)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise BadLogprobError(f"{cls}.{name}: non-finite value {values[i]} at index {i} ({int(bad.sum())} "
                              "non-finite)")
    if float(values.max()) > LOGPROB_TOL:
        i = int(np.argmax(values))
        raise BadLogprobError(f"{cls}.{name}: log-probabilities must be <= 0; index {i} holds {values[i]}")
    if floor is not None and float(values.min()) < floor:
        i = int(np.argmin(values))
        raise BadLogprobError(f"{cls}.{name}: log-probability {values[i]} at index {i} is below {floor}, the least "
                              "an engine can report for a token it sampled (schema.LOGPROB_FLOOR)")


def _check_meta(cls: str, meta: Any, limits: SchemaLimits) -> None:
    if not isinstance(meta, dict):
        raise _fail(cls, "meta", f"expected dict, got {type(meta).__name__}")
    if len(meta) > limits.max_meta_items:
        raise _fail(cls, "meta", f"{len(meta)} items exceed limit {limits.max_meta_items}")
    for k, v in meta.items():
        _check_str(cls, "meta key", k, limits.max_id_len)
        if isinstance(v, str):
            _check_str(cls, f"meta[{k!r}]", v, limits.max_text_len, nonempty=False)
        elif isinstance(v, (bool, int)):
            _check_int(cls, f"meta[{k!r}]", int(v), _INT64_MIN, _UINT64_MAX)
        elif isinstance(v, float):
            _check_finite_float(cls, f"meta[{k!r}]", v)
        else:
            raise _fail(cls, f"meta[{k!r}]", f"value must be str, int or float, got {type(v).__name__}")


def _check_spans(cls: str, spans: Any, lo: int, hi: int, limits: SchemaLimits) -> list[tuple[int, int]]:
    if not isinstance(spans, list):
        raise _fail(cls, "turn_spans", f"expected list, got {type(spans).__name__}")
    if len(spans) > limits.max_turns:
        raise _fail(cls, "turn_spans", f"{len(spans)} turns exceed limit {limits.max_turns}")
    prev = lo
    for i, span in enumerate(spans):
        if not isinstance(span, (tuple, list)) or len(span) != 2:
            raise _fail(cls, f"turn_spans[{i}]", f"expected a (start, end) pair, got {span!r}")
        s, e = span
        _check_int(cls, f"turn_spans[{i}].start", s)
        _check_int(cls, f"turn_spans[{i}].end", e)
        if not (prev <= s < e <= hi):
            raise _fail(cls, f"turn_spans[{i}]", f"({s}, {e}) must satisfy {prev} <= start < end <= {hi} "
                        "(after prompt_len / the previous turn, within the sequence)")
        prev = e
    return spans


# ---------------------------------------------------------------------------------------------------------------------
# coercion (constructor convenience) and wire conversion
# ---------------------------------------------------------------------------------------------------------------------

_CANON = {"int32": np.dtype(_I32), "mask": np.dtype(_U8), "float32": np.dtype(_F32)}


def _coerce_array(value: Any, kind: str) -> Any:
    """Lossless conversion of lists / tuples / torch tensors to the canonical dtype; anything else unchanged."""
    if value is None or isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # torch.Tensor, without importing torch
        value = value.detach().cpu().numpy()
    elif isinstance(value, (list, tuple)):
        value = np.asarray(value) if len(value) else np.zeros(0, _CANON[kind])
    else:
        return value
    if kind == "mask" and value.dtype == np.bool_:
        return value
    if kind == "float32" and value.dtype.kind in "fiu":
        return value.astype(_F32)
    if kind in ("int32", "mask") and value.dtype.kind in "iub":
        cast = value.astype(_CANON[kind])
        return cast if np.array_equal(cast, value) else value
    return value


def _array_to_wire(a: np.ndarray) -> list[Any]:
    le = a.astype(a.dtype.newbyteorder("<"), copy=False) if a.dtype.byteorder == ">" else a
    return [le.dtype.str, int(le.shape[0]), np.ascontiguousarray(le).tobytes()]


def _array_from_wire(cls: str, name: str, obj: Any, dtypes: tuple[str, ...]) -> np.ndarray:
    if not (isinstance(obj, list) and len(obj) == 3):
        raise _fail(cls, name, "expected [dtype, length, bytes]")
    dt, n, raw = obj
    if dt not in dtypes:
        raise _fail(cls, name, f"dtype {dt!r} not in {dtypes}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise _fail(cls, name, f"bad length {n!r}")
    if not isinstance(raw, bytes):
        raise _fail(cls, name, f"expected bin data, got {type(raw).__name__}")
    itemsize = np.dtype(dt).itemsize
    if len(raw) != n * itemsize:
        raise _fail(cls, name, f"{len(raw)} bytes != length {n} x itemsize {itemsize}")
    return np.frombuffer(raw, dtype=np.dtype(dt)).copy()  # writable, owns its memory


# field codec kinds: "scalar" (str/int/float/None/dict as-is), ("array", dtypes), ("opt_array", dtypes), "spans", "list"
_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "token_ids": (_I32,),
    "loss_mask": _MASK_DTYPES,
    "logprobs": (_F32,),
    "teacher_logprobs": (_F32,),
    "routing": (_U8, _I16),
}
_ARRAY_KIND = {"token_ids": "int32", "loss_mask": "mask", "logprobs": "float32", "teacher_logprobs": "float32"}


class _WireMixin:
    """``to_wire`` / ``from_wire`` / bit-exact ``==`` shared by all kinds (dataclass fields drive the mapping)."""

    KIND: ClassVar[str]
    _OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        for name, kind in _ARRAY_KIND.items():
            if hasattr(self, name):
                setattr(self, name, _coerce_array(getattr(self, name), kind))
        if isinstance(getattr(self, "turn_spans", None), list):
            self.turn_spans = [tuple(s) if isinstance(s, list) else s for s in self.turn_spans]  # type: ignore

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if f.name in _ARRAY_FIELDS and v is not None:
                v = _array_to_wire(v)
            elif f.name == "turn_spans":
                v = [[int(s), int(e)] for s, e in v]
            elif f.name == "routing_shape":
                v = [int(x) for x in v] if isinstance(v, (tuple, list)) else v
            elif isinstance(v, np.integer):
                v = int(v)
            elif isinstance(v, np.floating):
                v = float(v)
            out[f.name] = v
        return out

    @classmethod
    def from_wire(cls, obj: Any) -> Any:
        name = cls.__name__
        if not isinstance(obj, dict):
            raise SchemaError(f"{name}: payload must be a map, got {type(obj).__name__}")
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(set(obj) - set(names), key=str)
        if unknown:
            raise SchemaError(f"{name}: unknown field(s) {unknown}")
        missing = [n for n in names if n not in obj]
        if missing:
            raise SchemaError(f"{name}: missing field(s) {missing}")
        kwargs = {}
        for n in names:
            v = obj[n]
            if n in _ARRAY_FIELDS and v is not None:
                v = _array_from_wire(name, n, v, _ARRAY_FIELDS[n])
            elif n in _ARRAY_FIELDS and n not in cls._OPTIONAL:
                raise _fail(name, n, "required array is null")
            elif n == "turn_spans" and isinstance(v, list):
                v = [tuple(s) if isinstance(s, list) else s for s in v]
            elif n == "routing_shape" and isinstance(v, list):
                v = tuple(v)
            kwargs[n] = v
        return cls(**kwargs)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.to_wire() == other.to_wire()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]


# ---------------------------------------------------------------------------------------------------------------------
# public event kinds
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class TrajectoryEvent(_WireMixin):
    """One trajectory, finished or failed; ``T`` = ``len(token_ids)``."""

    KIND: ClassVar[str] = "trajectory"
    _OPTIONAL: ClassVar[frozenset[str]] = frozenset({"teacher_logprobs", "routing"})

    traj_id: str
    group_id: str
    group_size: int
    policy_version: int
    token_ids: np.ndarray  # (T,) int32: prompt + generated + tool output
    prompt_len: int
    loss_mask: np.ndarray  # (T,) uint8|bool: 1 = action token trained on; 0 inside the prompt and tool output
    logprobs: np.ndarray  # (T,) float32: behaviour log-probs where loss_mask == 1, exactly 0 elsewhere
    reward: float  # finite; a failed trajectory carries the task's lowest reward
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each generated turn
    teacher_logprobs: np.ndarray | None = None  # (T,) float32, finite, <= 0
    status: str = "ok"  # "ok" | "error": a failed trajectory is still accounted for in its group
    error: str = ""  # the error message when status == "error", else ""
    meta: dict[str, str | int | float] = field(default_factory=dict)
    routing: np.ndarray | None = None  # (P·L·k,) uint8|int16: MoE experts per computed position, layer, slot
    routing_shape: tuple[int, int] = (0, 0)  # (L, k) of ``routing``: MoE layers and experts per token

    def validate(self, limits: SchemaLimits | None = None) -> None:
        lim, c = limits or _DEFAULT_LIMITS, "TrajectoryEvent"
        _check_str(c, "traj_id", self.traj_id, lim.max_id_len)
        _check_str(c, "group_id", self.group_id, lim.max_id_len)
        _check_int(c, "group_size", self.group_size, 1, 1 << 20)
        _check_int(c, "policy_version", self.policy_version, 0, 2**63 - 1)
        if self.status not in ("ok", "error"):
            raise _fail(c, "status", f"must be 'ok' or 'error', got {self.status!r}")
        _check_str(c, "error", self.error, lim.max_text_len, nonempty=self.status == "error")
        if self.status == "ok" and self.error:
            raise _fail(c, "error", "must be empty when status == 'ok'")
        t = _check_array(c, "token_ids", self.token_ids, (_I32,), None, lim.max_seq_len)
        if t == 0 and self.status == "ok":
            raise _fail(c, "token_ids", "empty sequence in an 'ok' trajectory")
        if t and int(self.token_ids.min()) < 0:
            raise _fail(c, "token_ids", f"negative token id {int(self.token_ids.min())}")
        _check_int(c, "prompt_len", self.prompt_len, 0, t)
        _check_array(c, "loss_mask", self.loss_mask, _MASK_DTYPES, t, lim.max_seq_len)
        _check_mask(c, "loss_mask", self.loss_mask)
        _check_array(c, "logprobs", self.logprobs, (_F32,), t, lim.max_seq_len)
        _check_logprobs(c, "logprobs", self.logprobs)
        _check_zero_where_unmasked(c, "logprobs", self.logprobs, self.loss_mask)
        if self.teacher_logprobs is not None:
            _check_array(c, "teacher_logprobs", self.teacher_logprobs, (_F32,), t, lim.max_seq_len)
            _check_logprobs(c, "teacher_logprobs", self.teacher_logprobs, floor=None)
        _check_finite_float(c, "reward", self.reward)
        spans = _check_spans(c, self.turn_spans, self.prompt_len, t, lim)
        covered = np.zeros(t, dtype=bool)
        for s, e in spans:
            covered[s:e] = True
        outside = (self.loss_mask != 0) & ~covered
        if outside.any():
            raise _fail(c, "loss_mask", f"is 1 at index {int(np.flatnonzero(outside)[0])}, outside every turn span "
                        "(only generated tokens may be trained on)")
        _check_meta(c, self.meta, lim)
        _check_routing(c, self.routing, self.routing_shape, t)


def _check_routing(c: str, routing: np.ndarray | None, shape: Any, t: int) -> None:
    """Router replay data: P·L·k expert indices for P ≤ T positions (``routing_shape`` = (L, k))."""
    if routing is None:
        return
    if not (isinstance(shape, (tuple, list)) and len(shape) == 2):
        raise _fail(c, "routing_shape", f"expected (layers, topk), got {shape!r}")
    for i, v in enumerate(shape):
        _check_int(c, f"routing_shape[{i}]", v, 1, 1 << 16)
    per = int(shape[0]) * int(shape[1])
    n = _check_array(c, "routing", routing, (_U8, _I16), None, per * max(t, 1))
    if n % per:
        raise _fail(c, "routing", f"length {n} is not a multiple of layers x topk = {per}")
    if n and int(routing.min()) < 0:
        raise _fail(c, "routing", f"negative expert index {int(routing.min())}")


@dataclass(eq=False)
class TurnEvent(_WireMixin):
    """One generated turn; arrays cover the prefix ``[0, end)``, the turn is ``[start, end)``."""

    KIND: ClassVar[str] = "turn"
    _OPTIONAL: ClassVar[frozenset[str]] = frozenset({"teacher_logprobs", "routing"})

    traj_id: str
    group_id: str
    policy_version: int
    turn: int
    start: int
    end: int
    token_ids: np.ndarray  # (end,) int32: context + this turn
    loss_mask: np.ndarray  # (end,) uint8|bool: 0 outside [start, end)
    logprobs: np.ndarray  # (end,) float32: behaviour log-probs where loss_mask == 1, 0 elsewhere
    teacher_logprobs: np.ndarray | None = None  # (end,) float32, finite, <= 0
    meta: dict[str, str | int | float] = field(default_factory=dict)
    routing: np.ndarray | None = None  # (P·L·k,) as TrajectoryEvent's, for the prefix's first P ≤ end positions
    routing_shape: tuple[int, int] = (0, 0)  # (L, k) of ``routing``

    def validate(self, limits: SchemaLimits | None = None) -> None:
        lim, c = limits or _DEFAULT_LIMITS, "TurnEvent"
        _check_str(c, "traj_id", self.traj_id, lim.max_id_len)
        _check_str(c, "group_id", self.group_id, lim.max_id_len)
        _check_int(c, "policy_version", self.policy_version, 0, 2**63 - 1)
        _check_int(c, "turn", self.turn, 0, lim.max_turns)
        _check_int(c, "end", self.end, 1, lim.max_seq_len)
        _check_int(c, "start", self.start, 0, self.end - 1)
        _check_array(c, "token_ids", self.token_ids, (_I32,), self.end, lim.max_seq_len)
        if int(self.token_ids.min()) < 0:
            raise _fail(c, "token_ids", f"negative token id {int(self.token_ids.min())}")
        _check_array(c, "loss_mask", self.loss_mask, _MASK_DTYPES, self.end, lim.max_seq_len)
        _check_mask(c, "loss_mask", self.loss_mask)
        if (self.loss_mask[: self.start] != 0).any():
            raise _fail(c, "loss_mask", f"must be 0 before start={self.start}")
        _check_array(c, "logprobs", self.logprobs, (_F32,), self.end, lim.max_seq_len)
        _check_logprobs(c, "logprobs", self.logprobs)
        _check_zero_where_unmasked(c, "logprobs", self.logprobs, self.loss_mask)
        if self.teacher_logprobs is not None:
            _check_array(c, "teacher_logprobs", self.teacher_logprobs, (_F32,), self.end, lim.max_seq_len)
            _check_logprobs(c, "teacher_logprobs", self.teacher_logprobs, floor=None)
        _check_meta(c, self.meta, lim)
        _check_routing(c, self.routing, self.routing_shape, self.end)


# ---------------------------------------------------------------------------------------------------------------------
# internal channel messages (see channel.py for the protocol)
# ---------------------------------------------------------------------------------------------------------------------


def _check_seq_list(c: str, name: str, seqs: Any, lim: SchemaLimits) -> None:
    if not isinstance(seqs, list) or len(seqs) > lim.max_ack_items:
        raise _fail(c, name, f"expected a list of at most {lim.max_ack_items} sequence numbers")
    for s in seqs:
        _check_int(c, name, s, 1, _UINT64_MAX)


@dataclass(eq=False)
class Ping(_WireMixin):
    """Sender → receiver: "which of these (sent before this ping) have you processed?"; also asks for credit."""

    KIND: ClassVar[str] = "ping"

    epoch: int
    ping_id: int  # 1, 2, … per sender epoch; echoed in the answering Ack
    seqs: list[int] = field(default_factory=list)

    def validate(self, limits: SchemaLimits | None = None) -> None:
        lim = limits or _DEFAULT_LIMITS
        _check_int("Ping", "epoch", self.epoch, 0, _UINT64_MAX)
        _check_int("Ping", "ping_id", self.ping_id, 1, _UINT64_MAX)
        _check_seq_list("Ping", "seqs", self.seqs, lim)


@dataclass(eq=False)
class Ack(_WireMixin):
    """Receiver → sender: processed seqs (``acked``: delivered or duplicate; ``rejected``: [seq, reason, detail]),
    seqs of ping ``ping_id`` the receiver never saw (``missing``: resend them; ``ping_id`` 0 = not a ping answer),
    and the sender's window (``credit``)."""

    KIND: ClassVar[str] = "ack"

    epoch: int
    credit: int
    ping_id: int = 0
    acked: list[int] = field(default_factory=list)
    rejected: list[list[Any]] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)

    def validate(self, limits: SchemaLimits | None = None) -> None:
        lim, c = limits or _DEFAULT_LIMITS, "Ack"
        _check_int(c, "epoch", self.epoch, 0, _UINT64_MAX)
        _check_int(c, "credit", self.credit, 0, 1 << 20)
        _check_int(c, "ping_id", self.ping_id, 0, _UINT64_MAX)
        _check_seq_list(c, "acked", self.acked, lim)
        _check_seq_list(c, "missing", self.missing, lim)
        if not isinstance(self.rejected, list) or len(self.rejected) > lim.max_ack_items:
            raise _fail(c, "rejected", "expected a bounded list")
        for r in self.rejected:
            if not (isinstance(r, list) and len(r) == 3 and isinstance(r[1], str) and isinstance(r[2], str)):
                raise _fail(c, "rejected", f"entries must be [seq, reason, detail], got {r!r}")
            _check_int(c, "rejected.seq", r[0], 1, _UINT64_MAX)


EVENT_TYPES: tuple[type, ...] = (TrajectoryEvent, TurnEvent)
