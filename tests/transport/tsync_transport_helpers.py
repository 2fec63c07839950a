"""Shared builders for the transport tests (imported by the tests and by the sender subprocess script)."""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import numpy as np

from megatron_tsync.transport import TrajectoryEvent, TurnEvent

KEY = bytes(range(32))
HERE = os.path.dirname(os.path.abspath(__file__))


def make_traj(i: int, version: int = 0, T: int = 256, *, seed: int | None = None, teacher: bool = True,
              mask_dtype: type = np.uint8, meta: dict | None = None) -> TrajectoryEvent:
    """A two-turn trajectory: prompt | turn 0 | tool output | turn 1."""
    rng = np.random.default_rng(i if seed is None else seed)
    p = max(1, T // 8)
    a = (T - p) // 3
    tool = (T - p) // 6
    spans = [(p, p + a), (p + a + tool, T)]
    mask = np.zeros(T, dtype=mask_dtype)
    for s, e in spans:
        mask[s:e] = 1
    logprobs = np.where(mask != 0, -rng.exponential(1.0, T), 0.0).astype(np.float32)  # (T,)
    return TrajectoryEvent(
        traj_id=f"traj-{i}", group_id=f"group-{i // 4}", group_size=4, policy_version=version,
        token_ids=rng.integers(0, 50000, T, dtype=np.int32), prompt_len=p, loss_mask=mask, logprobs=logprobs,
        reward=float(rng.random()), turn_spans=spans,
        teacher_logprobs=(-rng.exponential(1.0, T)).astype(np.float32) if teacher else None,
        meta=dict(meta or {"i": i, "task": "unit"}))


def make_turn(i: int, version: int = 0, end: int = 64) -> TurnEvent:
    rng = np.random.default_rng(1000 + i)
    start = end // 2
    mask = np.zeros(end, np.uint8)
    mask[start:] = 1
    lp = np.where(mask == 1, -rng.random(end), 0).astype(np.float32)
    return TurnEvent(traj_id=f"traj-{i}", group_id="g", policy_version=version, turn=1, start=start, end=end,
                     token_ids=rng.integers(0, 1000, end, dtype=np.int32), loss_mask=mask, logprobs=lp,
                     teacher_logprobs=(-rng.random(end)).astype(np.float32), meta={"x": 1.5})


def make_small(i: int, version: int = 0) -> TrajectoryEvent:
    """A cheap one-turn trajectory (16 tokens, no teacher log-probs): for tests about the channel, not the payload."""
    return make_traj(i, version, 16, teacher=False, meta={"i": i})


def short_tmpdir() -> str:
    """ipc:// paths are limited to ~107 bytes, pytest's tmp_path can be longer."""
    return tempfile.mkdtemp(prefix="tsync-", dir="/tmp")


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sender_cmd(*args: str) -> list[str]:
    return [sys.executable, os.path.join(HERE, "tsync_transport_sender.py"), *args]
