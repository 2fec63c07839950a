"""The endpoint's open-episode store (``rollout/episode_store.py``) on a fake clock: the cap evicts the least
recently used idle episode of the address holding the most, never one with a request in flight; idle episodes
expire; evicted and expired ids answer 410 with the reason; the memory estimate is summed and released."""

import threading
import types

import pytest

from megatron_tsync.rollout.episode_store import EpisodeStore
from megatron_tsync.rollout.openai_chat import ApiError


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _make(eid):
    return lambda: types.SimpleNamespace(id=eid, lock=threading.Lock())


def _open(store, eid, peer, nbytes=100):
    """Open ``eid`` and record its first completion (as the server does: with its request in flight)."""
    ep = store.open(eid, _make(eid), peer, continues=False)
    with ep.lock:
        store.touch(ep, nbytes)
    return ep


def test_cap_evicts_the_top_peers_least_recently_used():
    clock = _Clock()
    store = EpisodeStore(max_episodes=4, idle_s=None, clock=clock)
    _open(store, "a1", "10.0.0.1")
    for k in range(3):
        _open(store, f"b{k}", "10.0.0.2")
    store.touch(store.get("b0"))  # b0 used again: b1 is now the flooder's least recently used
    _open(store, "a2", "10.0.0.1")  # at the cap: 10.0.0.2 holds the most
    assert list(store.episodes) == ["a1", "b2", "b0", "a2"] and store.counts["episodes_evicted"] == 1
    assert store.per_peer == {"10.0.0.1": 2, "10.0.0.2": 2} and store.bytes == 400
    with pytest.raises(ApiError) as e:  # continuing the evicted episode: 410 with the reason
        store.open("b1", _make("b1"), "10.0.0.2", continues=True)
    assert e.value.status == 410 and e.value.code == "episode_evicted" and "max_episodes" in str(e.value.message)
    with store.lock:  # a new conversation under the same id opens a new episode
        assert store.open("b1", _make("b1"), "10.0.0.2", continues=False).id == "b1"
    store.check_gone("b1")  # no longer gone


def test_in_flight_episodes_are_never_evicted():
    store = EpisodeStore(max_episodes=2, idle_s=None, clock=_Clock())
    for eid in ("x", "y"):
        _open(store, eid, "p").lock.acquire()  # both have a request in flight
    _open(store, "z", "q")  # over the cap by the requests in flight: nothing evictable
    assert list(store.episodes) == ["x", "y", "z"] and store.counts["episodes_evicted"] == 0
    store.get("y").lock.release()
    _open(store, "w", "q")
    assert list(store.episodes) == ["x", "w"]  # y (idle; p and q tie) and then z (q's) went, though x is older
    assert store.counts["episodes_evicted"] == 2


def test_another_peers_episode_is_not_evicted_when_the_flooders_are_all_in_flight():
    store = EpisodeStore(max_episodes=2, idle_s=None, clock=_Clock())
    _open(store, "mine", "valid")
    for k in range(3):
        _open(store, f"f{k}", "flooder").lock.acquire()
    assert list(store.episodes) == ["mine", "f0", "f1", "f2"]  # over the cap by the flooder's requests in flight


def test_a_refused_first_request_evicts_nothing():
    store = EpisodeStore(max_episodes=1, idle_s=None, clock=_Clock())
    _open(store, "kept", "p")
    ep = store.open("refused", _make("refused"), "q", continues=False)
    assert len(store.episodes) == 2  # opened, not yet recorded: nobody evicted
    store.drop(ep.id)  # the server drops a new episode whose first request was refused
    assert list(store.episodes) == ["kept"] and store.counts["episodes_evicted"] == 0


def test_idle_episodes_expire():
    clock = _Clock()
    store = EpisodeStore(max_episodes=None, idle_s=60.0, clock=clock)
    _open(store, "old", "p", 500)
    busy = _open(store, "busy", "p", 500)
    clock.t += 30
    _open(store, "recent", "p", 500)
    busy.lock.acquire()
    clock.t += 31  # "old" and "busy" idle 61 s, "recent" 31 s
    assert store.expire() == 1 and list(store.episodes) == ["busy", "recent"]  # in flight: kept
    assert store.stats()["episodes_expired"] == 1 and store.bytes == 1000
    with pytest.raises(ApiError) as e:
        store.check_gone("old")
    assert e.value.status == 410 and e.value.code == "episode_expired" and "60 s" in e.value.message
    busy.lock.release()
    clock.t += 60
    stats = store.stats()  # the metrics expire too
    assert stats["episodes"] == 0 and stats["episode_bytes"] == 0 and stats["episodes_expired"] == 3


def test_finished_and_deleted_are_counted_not_remembered():
    store = EpisodeStore(max_episodes=8, idle_s=None, clock=_Clock())
    _open(store, "f", "p")
    _open(store, "d", "p")
    assert store.drop("f", "finished").id == "f" and store.drop("d", "deleted").id == "d"
    assert store.drop("f", "finished") is None
    store.check_gone("f")  # a finished id is not "gone": its next request is simply a new episode
    assert store.counts["episodes_finished"] == 1 and store.counts["episodes_deleted"] == 1 and store.bytes == 0


@pytest.mark.parametrize("kw", [dict(max_episodes=0), dict(max_episodes=True), dict(idle_s=0), dict(idle_s=-1.0)])
def test_bad_limits_refused(kw):
    with pytest.raises(ValueError):
        EpisodeStore(**kw)
