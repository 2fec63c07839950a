"""The wire between rollout workers and the learner.

* ``schema``  — event dataclasses (trajectory, turn) and their validation;
* ``ids``     — the group / trajectory id format (``s{step}g{g}``, ``{group_id}t{i}``);
* ``versions`` — the accepted-version window (``VersionWindow``), one rule for the learner and the workers;
* ``codec``   — signed msgpack frames (HMAC-SHA256), typed rejections, replay guard;
* ``channel`` — ZeroMQ ROUTER/DEALER channel with credit-based backpressure, acks and resend (at-least-once + dedup);
* ``weights`` — signed safetensors weight hand-off through a directory (imported lazily: it pulls in torch);
* ``weight_broadcast`` — the same hand-off as a collective broadcast, gloo on CPU / NCCL on GPU (lazy, torch);
* ``secret``  — where the shared key comes from.

Imports nothing from megatron or from the training / rollout packages.
"""

from __future__ import annotations

from typing import Any

from .channel import DEFAULT_MAX_BYTES, EventReceiver, EventSender
from .codec import FrameHeader, ReplayGuard, decode, decode_frame, encode
from .errors import (
    REJECT_REASONS,
    BackpressureTimeout,
    BadGroup,
    BadLogprob,
    BadSignature,
    Malformed,
    NonFinite,
    OutOfVocab,
    Oversize,
    Replayed,
    TooLong,
    TransportError,
    Unsigned,
    WrongVersion,
)
from .schema import BadLogprobError, NonFiniteError, SchemaError, SchemaLimits, TrajectoryEvent, TurnEvent
from .secret import SecretError, generate_secret, load_secret, write_secret_file
from .versions import VersionWindow

_LAZY = {"publish_weights", "WeightSubscriber", "WeightPublisher", "FileWeightPublisher"}
_LAZY_BROADCAST = {"BroadcastWeightPublisher", "BroadcastWeightSubscriber", "WeightSyncGroup", "WeightSyncError"}

__all__ = [
    "BackpressureTimeout", "BadGroup", "BadLogprob", "BadLogprobError", "BadSignature", "DEFAULT_MAX_BYTES", "EventReceiver",
    "EventSender", "FrameHeader", "Malformed", "NonFinite", "NonFiniteError", "OutOfVocab", "Oversize", "TooLong", "REJECT_REASONS", "Replayed", "ReplayGuard",
    "SchemaError", "SchemaLimits", "SecretError", "TrajectoryEvent", "TransportError", "TurnEvent",
    "Unsigned", "VersionWindow", "WrongVersion", "decode", "decode_frame", "encode", "generate_secret", "load_secret",
    "write_secret_file", *sorted(_LAZY), *sorted(_LAZY_BROADCAST),
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import weights

        return getattr(weights, name)
    if name in _LAZY_BROADCAST:
        from . import weight_broadcast

        return getattr(weight_broadcast, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
