"""Per-trajectory KV caches of the embedded engine, kept between the turns of a multi-turn rollout.

A trajectory's turn t+1 starts from its turn t's context plus the tool output and the next turn's prefix. With its
keys and values from turn t kept, the engine prefills only the appended tokens (``embedded_engine.py``). This module
owns the stored entries: one per session handle (the agent loop's per-trajectory id), each the token ids whose K/V it
holds and, per attention layer, the keys and values of those positions (pre-RoPE, as megatron's static inference
context stores them, so an entry can be placed at any slot of a later batch). An entry is valid only for the policy
version that computed it; :meth:`SessionKVStore.clear` drops everything when the weights change. Memory is bounded
by ``max_bytes`` of cached keys and values over all sessions, least recently used evicted first.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Hashable, Sequence

import torch


@dataclasses.dataclass
class KVEntry:
    """The cached positions 0..len(tokens)-1 of one session."""

    tokens: list[int]
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]]
    """layer number -> (keys, values), each (P, groups, head dim) for P = len(tokens)."""
    version: int

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers.values())


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    m = min(len(a), len(b), limit)
    if list(a[:m]) == list(b[:m]):
        return m
    i = 0
    while i < m and a[i] == b[i]:
        i += 1
    return i


class SessionKVStore:
    """Bounded, thread-safe map session -> :class:`KVEntry` (LRU eviction by bytes of K/V)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be ≥ 0 (0: no reuse), got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: collections.OrderedDict[Hashable, KVEntry] = collections.OrderedDict()
        self._bytes = 0
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0  # positions served from the cache (metrics, tests)
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def lookup(self, session: Hashable, prompt: Sequence[int], version: int) -> tuple[int, KVEntry | None]:
        """(c, entry): the entry's first ``c`` positions are the prompt's (c ≤ len(prompt) − 1, so at least one
        prompt token is left to prefill and give the next token's logits); (0, None) on a miss or an entry of
        another policy version (dropped)."""
        with self._lock:
            e = self._entries.get(session)
            if e is None:
                return 0, None
            if e.version != version:
                self._drop(session)
                return 0, None
            self._entries.move_to_end(session)
        c = common_prefix(e.tokens, prompt, len(prompt) - 1)
        if c > 0:
            self.hits += c
        return c, (e if c > 0 else None)

    def put(self, session: Hashable, entry: KVEntry) -> None:
        with self._lock:
            self._drop(session)
            n, b = len(entry.tokens), entry.nbytes
            if n == 0 or b > self.max_bytes:
                return
            self._entries[session] = entry
            self._tokens, self._bytes = self._tokens + n, self._bytes + b
            while self._bytes > self.max_bytes:
                old, _ = next(iter(self._entries.items()))
                self._drop(old)
                self.evictions += 1

    def release(self, session: Hashable) -> None:
        """Forget a session (its trajectory ended)."""
        with self._lock:
            self._drop(session)

    def clear(self) -> None:
        """Forget every session (new weights: every cached key and value is of the old policy)."""
        with self._lock:
            self._entries.clear()
            self._tokens = self._bytes = 0

    def _drop(self, session: Hashable) -> None:
        e = self._entries.pop(session, None)
        if e is not None:
            self._tokens -= len(e.tokens)
            self._bytes -= e.nbytes
