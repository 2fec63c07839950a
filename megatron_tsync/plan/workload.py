"""The simulated batch: per trajectory its turns (prompt/tool-output tokens, generated tokens, the tool call after
each turn), its verifier time and its reward.

Tool and verifier seconds come from a latency profile (``runtime/latency.py``: a built-in name or a JSON file,
``trace-to-profile``'s output included) or straight from the endpoint's JSONL trace (``rollout/latency_trace.py``:
each line's ``tool_s`` and ``verify_s``, replayed like the trace kind: trajectory i of simulated group g uses row
i mod R of trace group g mod K). Generated tokens per turn: lognormal with median ``gen_tokens`` and log-sd
``gen_sigma`` (a trace line's ``gen_tokens`` list, when present, is used as is). Rewards: each group draws a success
probability p ~ U(0, 1), each trajectory a Bernoulli(p) (binary verifier, as ``tools/bench_streaming.py`` does), so
some groups are all-equal and their work is skipped in every mode, as the learner does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random

from megatron_tsync.runtime.latency import LatencyProfile, load_latency_profile
from megatron_tsync.transport.ids import group_id, traj_id


@dataclasses.dataclass(frozen=True)
class Turn:
    prefill_tokens: int  # prompt (turn 0) or the previous tool's output
    gen_tokens: int
    tool_s: float  # the tool call after this turn (0 after the last)


@dataclasses.dataclass(frozen=True)
class Traj:
    group: int
    index: int
    turns: tuple[Turn, ...]
    verify_s: float
    reward: float
    step: int = 0

    @functools.cached_property
    def tokens(self) -> int:
        """Tokens the learner trains on (the whole conversation)."""
        return sum(t.prefill_tokens + t.gen_tokens for t in self.turns)

    @property
    def traj_id(self) -> str:
        return traj_id(self.group_id, self.index)

    @property
    def group_id(self) -> str:
        return group_id(self.step, self.group)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    prompts: int = 32
    group_size: int = 8
    calls: int = 3  # tool calls per trajectory (turns = calls + 1); the median when calls_sigma > 0
    calls_sigma: float = 0.0  # log-sd of the tool calls per trajectory (lognormal, per trajectory; 0 = fixed)
    max_calls: int = 0  # at most this many tool calls (0: no cap)
    max_context: int = 0  # a trajectory ends when its next turn would pass this many tokens (0: no cap)
    prompt_tokens: int = 512
    gen_tokens: int = 256  # median generated tokens per turn
    gen_sigma: float = 0.5
    tool_output_tokens: int = 128
    verify_s: float = 0.0  # added to the profile's draws (a trace carries its own)
    profile: str = "swe-like"  # runtime/latency.py name or JSON, or a .jsonl endpoint trace
    latency_scale: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.prompts < 1 or self.group_size < 1 or self.calls < 0:
            raise ValueError("prompts and group size must be >= 1, tool calls >= 0")
        if min(self.prompt_tokens, self.gen_tokens) < 1 or self.tool_output_tokens < 0 or self.gen_sigma < 0:
            raise ValueError("token counts must be >= 1 (tool output >= 0), gen_sigma >= 0")
        if self.calls_sigma < 0 or self.max_calls < 0 or self.max_context < 0:
            raise ValueError("calls_sigma, max_calls and max_context must be >= 0")


def _trace_rows(path: str) -> list[list[dict]]:
    """The endpoint's JSONL trace (``rollout/latency_trace.py``'s reader) as rows per group, verify 0 when absent."""
    from megatron_tsync.rollout.latency_trace import read_trace

    return [[dict(r, verify_s=r["verify_s"] or 0.0) for r in rows] for rows in read_trace(path).values()]


def build_batch(spec: WorkloadSpec, step: int = 0) -> list[Traj]:
    """Step ``step``'s trajectories (fresh draws per step; group-major order)."""
    rnd = random.Random(spec.seed * 1_000_003 + step)
    rows = _trace_rows(spec.profile) if spec.profile.endswith(".jsonl") else None
    prof: LatencyProfile | None = None
    if rows is None:
        prof = load_latency_profile(spec.profile, scale=spec.latency_scale, seed=spec.seed).for_step(step)
    out = []
    for g in range(spec.prompts):
        p = rnd.random()
        for i in range(spec.group_size):
            if rows is not None:
                grp = rows[g % len(rows)]
                row = grp[i % len(grp)]
                tools = [x * spec.latency_scale for x in row["tool_s"]]
                verify = row["verify_s"] * spec.latency_scale
                given = row["gen_tokens"]
            else:
                tools = [prof.sample(g, i, t) for t in range(_calls(spec, rnd))]
                verify, given = spec.verify_s, []
            n = len(tools) + 1
            gens = given if len(given) == n else [
                max(1, round(spec.gen_tokens * math.exp(spec.gen_sigma * rnd.gauss(0.0, 1.0)))) for _ in range(n)]
            turns = _cap(spec, tuple(Turn(spec.prompt_tokens if t == 0 else spec.tool_output_tokens, gens[t],
                                          tools[t] if t < n - 1 else 0.0) for t in range(n)))
            out.append(Traj(g, i, turns, verify, float(rnd.random() < p), step))
    return out


def _calls(spec: WorkloadSpec, rnd: random.Random) -> int:
    """Tool calls of one trajectory: ``calls``, or lognormal around it (``calls_sigma``), at most ``max_calls``."""
    n = spec.calls if spec.calls_sigma == 0 else round(spec.calls * math.exp(spec.calls_sigma * rnd.gauss(0.0, 1.0)))
    return min(n, spec.max_calls) if spec.max_calls else n


def _cap(spec: WorkloadSpec, turns: tuple[Turn, ...]) -> tuple[Turn, ...]:
    """The turns that fit in ``max_context`` tokens (at least the first); the last kept turn calls no tool."""
    if not spec.max_context:
        return turns
    total, keep = 0, 0
    for t in turns:
        total += t.prefill_tokens + t.gen_tokens
        if keep and total > spec.max_context:
            break
        keep += 1
    if keep == len(turns):
        return turns
    return turns[:keep - 1] + (dataclasses.replace(turns[keep - 1], tool_s=0.0),)
