"""Typed errors of the wire layer.

Every rejection the receiver can make is one subclass of :class:`TransportError` with a stable ``reason`` string; the
receiver counts rejections under exactly these strings (``receiver.stats[reason]``), so a dashboard, a test and a log
line all speak the same vocabulary.  ``detail`` is the human-readable precise cause.

``header`` is set only when the frame's HMAC tag was verified (the header is then authentic): the channel uses it to
tell the sender that its event was rejected for good (``WrongVersion``, a schema error) so that the sender stops
resending it.  Unauthenticated rejections (``Unsigned``, ``BadSignature``, ``Oversize``, most ``Malformed``) carry no
header and get no reply: nothing in them can be trusted.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "TransportError",
    "Unsigned",
    "BadSignature",
    "Malformed",
    "NonFinite",
    "BadLogprob",
    "OutOfVocab",
    "TooLong",
    "BadGroup",
    "BadReward",
    "FarFuture",
    "BadTurn",
    "Oversize",
    "WrongVersion",
    "WrongRun",
    "Replayed",
    "BackpressureTimeout",
    "REJECT_REASONS",
]


class TransportError(Exception):
    """Base class; ``reason`` is the counter key, ``detail`` the precise cause."""

    reason: str = "transport_error"

    def __init__(self, detail: str = "", *, header: Any = None) -> None:
        super().__init__(f"{self.reason}: {detail}" if detail else self.reason)
        self.detail = detail
        self.header = header  # FrameHeader when the tag was verified, else None


class Unsigned(TransportError):
    """The frame declares no authentication tag."""

    reason = "unsigned"


class BadSignature(TransportError):
    """The HMAC tag (or a weight manifest's tag / file digest) does not verify."""

    reason = "bad_signature"


class Malformed(TransportError):
    """Not a frame of this protocol, truncated, unparseable payload, or a payload that fails schema validation."""

    reason = "malformed"


class NonFinite(Malformed):
    """An authentic event whose payload holds a NaN or an infinity (the reward, a ``meta`` value)."""

    reason = "non_finite"


class BadLogprob(Malformed):
    """An authentic event with a log-prob no engine can produce (``schema.BadLogprobError``): NaN or infinite, above
    0 (beyond float rounding), or a behaviour log-prob below ``schema.LOGPROB_FLOOR``. The trajectory counts as
    failed in its group (``runtime/validation.py``)."""

    reason = "bad_logprob"


class OutOfVocab(TransportError):
    """An authentic, schema-valid trajectory with a token id outside the model's vocabulary (the learner's edge)."""

    reason = "out_of_vocab"


class TooLong(TransportError):
    """An authentic, schema-valid trajectory longer than the learner's ``--seq-length`` (the learner's edge)."""

    reason = "too_long"


class BadGroup(TransportError):
    """An authentic event whose group id or group size contradicts the step's (the learner's edge)."""

    reason = "bad_group"


class BadReward(TransportError):
    """An authentic trajectory whose reward is outside what the learner assumes (``--reward-kind/--reward-range``:
    not exactly lo or hi for binary, outside [lo, hi] for bounded). The exact clip rule relies on it, so the
    trajectory counts as failed (the task's lowest reward) instead of stopping the run (the learner's edge)."""

    reason = "bad_reward"


class FarFuture(TransportError):
    """An authentic trajectory of a step the run cannot use yet (beyond the next step, or ``--max-staleness`` steps
    ahead in async mode), or one more early trajectory than the parking byte cap holds: dropped and counted."""

    reason = "far_future"


class BadTurn(TransportError):
    """An authentic turn event (OPD) whose tokens do not extend the turns already delivered for its trajectory (its
    prefix differs): dropped and counted; the trajectory's final event still delivers the rest (or, if it also
    disagrees, ends the trajectory where the streamed turns stopped)."""

    reason = "bad_turn"


class Oversize(TransportError):
    """The frame is larger than the receiver's ``max_bytes``; rejected before any parsing."""

    reason = "oversize"


class WrongVersion(TransportError):
    """An authentic event produced by a policy version the receiver does not accept (stale or future weights)."""

    reason = "wrong_version"

    def __init__(self, detail: str = "", *, header: Any = None, got: int | None = None, expected: Any = None) -> None:
        super().__init__(detail, header=header)
        self.got = got
        self.expected = expected


class WrongRun(TransportError):
    """A frame signed with the shared secret but for another run (``secret.run_key`` of another run id): a stale
    worker of an earlier run, or another job sharing the secret file. Authentic, but not this run's: dropped."""

    reason = "wrong_run"


class Replayed(TransportError):
    """An authentic frame whose (sender, epoch, seq) was already processed: a resend or a replay; dropped."""

    reason = "replayed"


class BackpressureTimeout(TransportError, TimeoutError):
    """``EventSender.send``/``flush`` waited ``timeout_s`` for credit (acks) from the receiver and got none."""

    reason = "backpressure_timeout"


REJECT_REASONS: tuple[str, ...] = (
    Unsigned.reason,
    BadSignature.reason,
    Malformed.reason,
    NonFinite.reason,
    BadLogprob.reason,
    Oversize.reason,
    WrongVersion.reason,
    WrongRun.reason,
    Replayed.reason,
    OutOfVocab.reason,
    TooLong.reason,
    BadGroup.reason,
    BadReward.reason,
    FarFuture.reason,
    BadTurn.reason,
)
