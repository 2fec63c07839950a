"""Rollout engines as a discrete-event (fluid) simulation: when does each trajectory's reward land?

Each engine (``rollout_tp`` GPUs) decodes the sequences it holds in one continuous batch: every decode step advances
each of them by one token and takes ``τ(b, C)`` seconds (``hardware.py``'s roofline: weights and KV cache read once
per step, a linear-attention layer's recurrent state read and written, at ``hbm_eff`` of the bandwidth, or
``2·N_act·b`` FLOPs at ``decode_mfu``, whichever is longer, plus a
fixed step overhead), b = sequences decoding, C = their summed context. Between events τ is constant (the contexts
are updated at every event). A turn's prefill (its prompt or the previous tool's output) takes
``2·N_act·tokens / (peak·decode_tp·prefill_mfu)`` and holds only that sequence; tool calls and the verifier hold no
engine. An engine decodes at most ``max_concurrency`` sequences; the others wait in arrival order, or with
``frontier_first`` (``--rollout-frontier-first``) earlier groups' first (admission only: no preemption). Trajectories are
spread over engines round-robin by group (a group's samples share a prompt and its prefix cache; by trajectory
when there are fewer groups than engines). An engine's worker serves one batch at a time: it starts batch j once its
share of batch j − 1 has landed and weights new enough for batch j were published (``simulate.py``).
"""

from __future__ import annotations

import heapq

from megatron_tsync.plan.hardware import Layout, ModelCost
from megatron_tsync.plan.workload import Traj


class EngineModel:
    def __init__(self, cost: ModelCost, layout: Layout):
        self.cost, self.layout = cost, layout
        tp = layout.rollout_tp
        self.bw = layout.hbm * tp * layout.hbm_eff
        self.flops = layout.peak * tp * layout.decode_mfu
        self.prefill_rate = layout.peak * tp * layout.prefill_mfu

    def step_s(self, batch: int, ctx_sum: float) -> float:
        mem = (self.cost.weight_bytes_read(batch) + self.cost.kv_bytes_per_token * ctx_sum
               + 2 * self.cost.state_bytes_per_seq * batch) / self.bw
        comp = 2.0 * self.cost.active_params * batch / self.flops
        return max(mem, comp) + self.layout.decode_overhead_s

    def prefill_s(self, tokens: int) -> float:
        return 2.0 * self.cost.active_params * tokens / self.prefill_rate


class _Seq:
    __slots__ = ("traj", "turn", "left", "ctx")

    def __init__(self, traj: Traj):
        self.traj, self.turn, self.left, self.ctx = traj, 0, 0.0, 0.0


def simulate_engine(model: EngineModel, jobs: list[tuple[float, Traj]]) -> dict[str, float]:
    """traj_id -> the time its reward lands, for the trajectories one engine serves (``jobs``: (start, traj))."""
    cap, frontier = model.layout.max_concurrency, model.layout.frontier_first
    away: list[tuple[float, int, _Seq]] = []  # (time it wants to decode, tiebreak, seq)
    done: dict[str, float] = {}
    n = 0
    for t0, traj in jobs:
        s = _Seq(traj)
        first = traj.turns[0]
        s.ctx, s.left = first.prefill_tokens, first.gen_tokens
        heapq.heappush(away, (t0 + model.prefill_s(first.prefill_tokens), n, s))
        n += 1
    decoding: list[_Seq] = []
    queue: list[_Seq] = []
    now = 0.0
    while away or decoding or queue:
        while away and away[0][0] <= now + 1e-12:
            queue.append(heapq.heappop(away)[2])
        if frontier and len(queue) > cap - len(decoding) > 0:
            queue.sort(key=lambda s: s.traj.group)  # stable: arrival order within a group
        while queue and len(decoding) < cap:
            decoding.append(queue.pop(0))
        if not decoding:
            now = away[0][0]
            continue
        tau = model.step_s(len(decoding), sum(s.ctx for s in decoding))
        dt = min(s.left for s in decoding) * tau
        if away and away[0][0] - now < dt:
            dt = away[0][0] - now
        now += dt
        steps = dt / tau
        still = []
        for s in decoding:
            s.left -= steps
            s.ctx += steps
            if s.left > 1e-9:
                still.append(s)
                continue
            turn = s.traj.turns[s.turn]
            s.turn += 1
            if s.turn == len(s.traj.turns):
                done[s.traj.traj_id] = now + s.traj.verify_s
                continue
            nxt = s.traj.turns[s.turn]
            s.ctx += nxt.prefill_tokens
            s.left = nxt.gen_tokens
            heapq.heappush(away, (now + turn.tool_s + model.prefill_s(nxt.prefill_tokens), n, s))
            n += 1
        decoding = still
    return done


def assign_engines(trajs: list[Traj], engines: int) -> list[list[Traj]]:
    """Each engine's share of a batch: round-robin by group (by trajectory when groups are fewer than engines)."""
    out: list[list[Traj]] = [[] for _ in range(engines)]
    by_group = len({tr.group for tr in trajs}) >= engines
    for k, tr in enumerate(trajs):
        out[(tr.group if by_group else k) % engines].append(tr)
    return out


def simulate_batch(model: EngineModel, trajs: list[Traj], starts: list[float]) -> tuple[dict[str, float], list[float]]:
    """One batch on the engines, engine e starting its share at ``starts[e]``: (traj_id -> reward landing time,
    each engine's last landing — when its worker moves on to the next batch)."""
    land: dict[str, float] = {}
    done = []
    for e, share in enumerate(assign_engines(trajs, len(starts))):
        got = simulate_engine(model, [(starts[e], tr) for tr in share])
        land.update(got)
        done.append(max(got.values(), default=starts[e]))
    return land, done
