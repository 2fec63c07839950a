"""The open episodes of the OpenAI-compatible endpoint (``rollout/openai_server.py``), bounded in number and in idle
time, so that clients who open episodes and never finish them cannot grow the server without bound (an episode
holds its tokens, log-probs and conversation: 0.3-0.7 MB at a 4,096-token context).

- ``max_episodes``: once a new episode's first completion is recorded beyond the cap, an idle episode (none with a
  request in flight) is evicted: the least recently used one of the client address (``:peer``) holding the most open
  episodes, so one client flooding the server with episodes evicts its own, never the others'. A refused request
  evicts nothing; episodes with a request in flight are never evicted (if all of that client's are in flight, none
  is), so the count can exceed the cap by at most the requests in flight (the transport's ``max_inflight``).
- ``idle_s``: an episode without a request for this long is dropped (checked on every request, so an idle server
  frees them at its next request).

Dropped episodes are counted (``episodes_evicted``, ``episodes_expired`` in :meth:`EpisodeStore.stats`) and their
ids remembered (a bounded record): a later request that continues such an episode, its ``/finish`` or ``DELETE``,
gets 410 with the reason (``episode_evicted`` / ``episode_expired``) instead of a silent new episode. A new
conversation under the same id opens a new episode.

Items are any objects with ``id``, ``lock`` (a ``threading.Lock``, held while a request is in flight), ``peer``,
``t_used`` and ``approx_bytes`` (:class:`~megatron_tsync.rollout.openai_server.Episode`). Every method but
:meth:`stats` expects the caller to hold :attr:`EpisodeStore.lock`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from megatron_tsync.rollout.openai_chat import ApiError

__all__ = ["EpisodeStore", "BYTES_PER_TOKEN", "EPISODE_IDLE_S", "MAX_EPISODES", "approx_bytes"]

MAX_EPISODES = 1024
"""Default cap on open episodes (0.3-0.7 GB at a 4,096-token context)."""
EPISODE_IDLE_S = 600.0
"""Default idle expiry, seconds (twice the harness' default episode timeout)."""

BYTES_PER_TOKEN = 80
"""Python memory per context token of an episode: an id (pointer + int), a mask entry, a log-prob (pointer + float).
An upper bound: ids below 257 and the prompt's 0.0 log-probs are shared objects (tracemalloc: 40 bytes a token for
the tiny test model's small vocabulary, ~70 expected for a real one)."""


def approx_bytes(n_tokens: int, text_chars: int, n_messages: int) -> int:
    """The approximate memory of an episode of ``n_tokens`` tokens whose conversation has ``text_chars`` characters
    of JSON in ``n_messages`` messages (a dict and its strings each)."""
    return BYTES_PER_TOKEN * n_tokens + text_chars + 400 * n_messages + 1024


class EpisodeStore:
    """Open episodes by id, in least recently used order (see the module docstring)."""

    def __init__(self, max_episodes: int | None = MAX_EPISODES, idle_s: float | None = EPISODE_IDLE_S,
                 clock: Callable[[], float] = time.monotonic):
        if max_episodes is not None and (not isinstance(max_episodes, int) or isinstance(max_episodes, bool)
                                         or max_episodes < 1):
            raise ValueError(f"max_episodes must be an integer >= 1 (or None: no cap), got {max_episodes!r}")
        if idle_s is not None and not idle_s > 0:
            raise ValueError(f"the episode idle timeout must be > 0 seconds (or None: never), got {idle_s!r}")
        self.max_episodes, self.idle_s, self.clock = max_episodes, idle_s, clock
        self.lock = threading.Lock()
        self.episodes: OrderedDict[str, Any] = OrderedDict()
        """Open episodes, least recently used first."""
        self.per_peer: dict[str, int] = {}
        self.bytes = 0
        self.counts = {"episodes_opened": 0, "episodes_finished": 0, "episodes_deleted": 0, "episodes_evicted": 0,
                       "episodes_expired": 0}
        self._gone: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (code, message), bounded
        self._gone_cap = max(1024, max_episodes or 0)

    # ------------------------------------------------------------------ lookups
    def get(self, episode_id: str):
        return self.episodes.get(episode_id)

    def check_gone(self, episode_id: str) -> None:
        """410 with the reason if ``episode_id`` was evicted or expired (and not reopened since)."""
        gone = self._gone.get(episode_id)
        if gone is not None:
            raise ApiError(410, gone[1], None, gone[0])

    # ------------------------------------------------------------------ changes
    def open(self, episode_id: str, make: Callable[[], Any], peer: str, continues: bool):
        """A new episode ``make()`` under ``episode_id`` (not open). ``continues``: the request carries earlier
        assistant turns, so an evicted or expired ``episode_id`` is refused (410)."""
        if continues:
            self.check_gone(episode_id)
        self._gone.pop(episode_id, None)
        ep = make()
        ep.peer, ep.t_used, ep.approx_bytes = peer, self.clock(), 0
        self.episodes[episode_id] = ep
        self.per_peer[peer] = self.per_peer.get(peer, 0) + 1
        self.counts["episodes_opened"] += 1
        return ep

    def touch(self, ep, nbytes: int | None = None) -> None:
        """``ep`` was just used (now the most recently used); ``nbytes``: its approximate memory now, after a
        completion was recorded (then episodes beyond the cap are evicted)."""
        ep.t_used = self.clock()
        if self.episodes.get(ep.id) is ep:
            self.episodes.move_to_end(ep.id)
            if nbytes is not None:
                self.bytes += nbytes - ep.approx_bytes
                ep.approx_bytes = nbytes
                while self.max_episodes is not None and len(self.episodes) > self.max_episodes and self._evict():
                    pass

    def drop(self, episode_id: str, why: str | None = None, message: str = ""):
        """Remove ``episode_id`` (None if not open). ``why``: ``finished``/``deleted``/``evicted``/``expired``
        (counted; evicted and expired ids are remembered with ``message``); None: a refused first request."""
        ep = self.episodes.pop(episode_id, None)
        if ep is None:
            return None
        self.bytes -= ep.approx_bytes
        left = self.per_peer[ep.peer] - 1
        if left:
            self.per_peer[ep.peer] = left
        else:
            del self.per_peer[ep.peer]
        if why is not None:
            self.counts[f"episodes_{why}"] += 1
        if why in ("evicted", "expired"):
            self._gone[episode_id] = (f"episode_{why}", message)
            while len(self._gone) > self._gone_cap:
                self._gone.popitem(last=False)
        return ep

    def expire(self) -> int:
        """Drop the episodes idle for longer than ``idle_s``; how many."""
        if self.idle_s is None:
            return 0
        cutoff, stale = self.clock() - self.idle_s, []
        for eid, ep in self.episodes.items():  # least recently used first: stop at the first recent one
            if ep.t_used > cutoff:
                break
            if not ep.lock.locked():
                stale.append(eid)
        for eid in stale:
            self.drop(eid, "expired", f"episode {eid!r} expired after {self.idle_s:g} s without a request (the "
                                      f"server's episode idle timeout); its tokens are gone: start a new episode")
        return len(stale)

    def _evict(self) -> bool:
        """Evict one episode: the least recently used idle episode of the peers with the most episodes; False if each
        of theirs has a request in flight."""
        top = max(self.per_peer.values())
        peers = {peer for peer, n in self.per_peer.items() if n == top}
        victim = next((eid for eid, ep in self.episodes.items() if ep.peer in peers and not ep.lock.locked()), None)
        if victim is None:
            return False
        self.drop(victim, "evicted", f"episode {victim!r} was evicted: the server holds at most {self.max_episodes} "
                                     f"open episodes (max_episodes) and evicts the least recently used one of the "
                                     f"client holding the most; its tokens are gone: start a new episode")
        return True

    # ------------------------------------------------------------------ metrics
    def stats(self) -> dict:
        with self.lock:
            self.expire()
            return {"episodes": len(self.episodes), "episode_bytes": self.bytes, "max_episodes": self.max_episodes,
                    "episode_idle_timeout_s": self.idle_s, "episode_peers": len(self.per_peer), **self.counts}
