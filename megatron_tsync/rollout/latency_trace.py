"""Latency traces: what each trajectory's rollout and verification really took, one JSON line per trajectory, and the
``--latency-profile`` file that replays them (``runtime/latency.py``'s ``trace`` kind), so a user can measure the
speed-up streaming would give on their own workload (``tools/bench_streaming.py --latency-profile FILE.json``).

A line (JSONL, appended as each trajectory finishes; several writers may append to one file, each line is one
``write`` under ``O_APPEND``)::

    {"group": "s3-g5", "index": 2, "policy_version": 3, "turns": 4, "rollout_s": 12.5,
     "generate_s": [0.4, 0.3, 0.5, 0.2], "tool_s": [3.1, 0.2, 7.9], "verify_s": 1.8, ...}

``tool_s`` are the seconds between turns (a tool call of the agent loop, or everything a user's harness did between
two completions of the OpenAI endpoint); ``verify_s`` the verifier's seconds (null when not measured).

Replay (:func:`latency_profile_from_trace`): ``{"kind": "trace", "groups": {group: [row, ...]}}`` with one row per
trajectory, ``tool_s`` followed by ``verify_s`` (the verifier is the last wait before the reward lands; leave it out
with ``include_verify=False``). The trace kind replays rows exactly: trajectory i of group g uses row i mod R of the
g-th group (mod the number of groups), call t its entry t mod len(row). Generation time is not part of the replay:
the replaying run generates for itself. Standard library only.
"""

from __future__ import annotations

import json
import math
import os
import threading
from typing import Any, Sequence

__all__ = ["LatencyTrace", "trace_record", "latency_profile_from_trace"]


def trace_record(traj, *, group: str, rollout_s: float, verify_s: float | None = None, **extra: Any) -> dict:
    """The trace line of an agent-loop :class:`Trajectory` (``tool_s`` from its tool calls' wall seconds)."""
    return {"group": str(group), "index": int(traj.index), "policy_version": int(traj.policy_version),
            "turns": len(traj.turn_spans), "rollout_s": float(rollout_s),
            "tool_s": [float(c.wall_s) for c in traj.tool_calls],
            "verify_s": None if verify_s is None else float(verify_s), **extra}


class LatencyTrace:
    """Appends trace lines to ``path`` (created with its directory on first use); thread-safe."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()

    def append(self, record: dict) -> None:
        for key in ("group", "tool_s", "rollout_s"):
            if key not in record:
                raise ValueError(f"latency trace record lacks {key!r}: {sorted(record)}")
        data = (json.dumps(record) + "\n").encode()
        with self._lock:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)


def read_trace(path: str) -> dict[str, list[dict]]:
    """The trace's trajectories per group (first-seen order), each ``{"tool_s": [...], "verify_s": float | None,
    "gen_tokens": [...]}``; a bad line is an error naming the file and line, and so is a trace with none."""
    groups: dict[str, list[dict]] = {}
    with open(path) as f:
        for k, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                v = rec.get("verify_s")
                row = {"tool_s": [float(x) for x in rec["tool_s"]], "verify_s": None if v is None else float(v),
                       "gen_tokens": [int(x) for x in rec.get("gen_tokens") or []]}
                group = str(rec["group"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{k}: not a latency trace line ({type(e).__name__}: {e})") from None
            if any(not (x >= 0 and math.isfinite(x)) for x in row["tool_s"] + [row["verify_s"] or 0.0]):
                raise ValueError(f"{path}:{k}: latencies must be finite and >= 0, got {row['tool_s']}, "
                                 f"verify {row['verify_s']}")
            groups.setdefault(group, []).append(row)
    if not groups:
        raise ValueError(f"{path}: no trajectories in the trace")
    return groups


def latency_profile_from_trace(paths: str | Sequence[str], *, include_verify: bool = True) -> dict:
    """A ``--latency-profile`` JSON object replaying one or more JSONL traces (groups in first-seen order; see the
    module docstring). Bad lines are errors naming the file and line."""
    groups: dict[str, list[list[float]]] = {}
    for path in [paths] if isinstance(paths, str) else list(paths):
        for group, rows in read_trace(path).items():
            for r in rows:
                row = r["tool_s"] + ([r["verify_s"]] if include_verify and r["verify_s"] is not None else [])
                groups.setdefault(group, []).append(row or [0.0])
    return {"kind": "trace", "groups": groups}
