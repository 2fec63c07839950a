"""VersionWindow: the accepted-version rule of the learner's receiver and of the workers."""

import time

import pytest
from tsync_transport_helpers import KEY, make_small

from megatron_tsync.transport import EventReceiver, EventSender, VersionWindow


def test_zero_staleness_accepts_exactly_the_current_version() -> None:
    w = VersionWindow(3)
    assert w.accepted() == 3 and w.oldest == 3
    assert 3 in w and 2 not in w and 4 not in w
    w.advance(3)  # publish(3) then begin_step(3): the same version twice is fine
    w.advance(4)
    assert w.accepted() == 4 and 3 not in w


def test_async_window_and_its_floor_at_zero() -> None:
    w = VersionWindow(1, max_staleness=2)
    assert w.accepted() == range(0, 2) and w.oldest == 0  # never below version 0
    w.advance(5)
    assert w.accepted() == range(3, 6) and [v in w for v in range(2, 7)] == [False, True, True, True, False]
    assert repr(w) == "VersionWindow(v3..v5)"


def test_never_moves_back_and_rejects_bad_arguments() -> None:
    w = VersionWindow(4)
    with pytest.raises(ValueError, match="cannot move back from v4 to v3"):
        w.advance(3)
    with pytest.raises(ValueError):
        VersionWindow(-1)
    with pytest.raises(ValueError):
        VersionWindow(0, max_staleness=-1)


def _collect(rx, n, timeout_s=10.0):
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += rx.poll(50)
    return out


@pytest.mark.timeout(60)
def test_the_receiver_asks_the_window(endpoint) -> None:
    w = VersionWindow(0, max_staleness=1)
    with EventReceiver(endpoint, KEY, expected_version_fn=w.accepted) as rx, EventSender(rx.endpoint, KEY, "w0") as tx:
        tx.send(make_small(0, version=0), timeout_s=5)
        assert [e.policy_version for e in _collect(rx, 1)] == [0]
        w.advance(2)  # the learner moved on: v1 and v2 accepted, v0 refused (and counted)
        for i, v in enumerate((0, 1, 2), start=1):
            tx.send(make_small(i, version=v), timeout_s=5)
        got = _collect(rx, 2)
        tx.flush(5)
    assert [e.policy_version for e in got] == [1, 2] and rx.stats["wrong_version"] == 1
