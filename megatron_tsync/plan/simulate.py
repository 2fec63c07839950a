"""A whole training run, step by step, per mode: sync, stream-group, stream-trajectory, async(K).

Rollout engines and learner are disjoint GPUs (the seed paper's 4 + 4 layout). Step k starts at s_k and publishes
weights version k + 1 at s_{k+1} (its barrier plus the weight sync ``sync_s``; version 0 at 0). Engine e starts its
share of batch j at max(s_{j−K}, its last landing of batch j − 1), K = 0 except in async (``--max-staleness K``, the
worker's version window: weights at most K versions old) — so in the sync modes batch k starts with step k, and in
async(K) the next batches generate while the learner trains. The learner follows its planner while rewards land
(async: the planner's ``sync`` mode on the landed batch, as the async trainer trains each batch synchronously).

Per step: ``step_s`` (start to the next step's start: the learner's step plus the weight sync), the rollout makespan
(the longest of the engines' times from starting their share of batch k to its last reward), the learner's busy seconds (the
slowest simulated rank), idle = step − busy, the tail (learner end − last reward; async: its whole step), the sync,
and ``bound_s``: max(last reward − step start, max over ranks of max_j (r_j + Σ_{r_i ≥ r_j} w_i)) + barrier + sync
with w = each trajectory's token work (no per-microbatch overhead, no pipeline bubble) of the trajectories some rank
must train (all-equal groups skipped when the planner skips them): no schedule of that work can end earlier. With
DP above 16 only 16 ranks are simulated (``learner.ranks_to_simulate``); the others enter the step with their
bound, so no rank's work is left out of the step.
Summaries average the steps after the first (async's first step waits for its batch like sync; every mode is
averaged alike).
"""

from __future__ import annotations

import dataclasses
import statistics

from megatron_tsync.plan.hardware import Layout, ModelCost
from megatron_tsync.plan.learner import (LearnerCost, PlannerSettings, dp_ranks, lower_bound, ranks_to_simulate,
                                         simulate_rank)
from megatron_tsync.plan.rollout import EngineModel, simulate_batch
from megatron_tsync.plan.workload import Traj

MODES = ("sync", "stream-group", "stream-trajectory", "async")


@dataclasses.dataclass(frozen=True)
class Scenario:
    cost: ModelCost
    layout: Layout
    learner: LearnerCost
    settings: PlannerSettings
    sync_s: float = 0.0
    async_k: int = 1
    opd: bool = False  # on-policy distillation: every trajectory's loss is known on landing (no group coupling)


@dataclasses.dataclass
class StepRow:
    step: int
    start_s: float
    step_s: float
    makespan_s: float
    last_reward_s: float
    busy_s: float
    tail_s: float
    sync_s: float
    bound_s: float
    peak_open_groups: int
    busy: list  # rank 0's busy intervals, relative to the step's start
    landed: list  # every reward's landing, relative to the step's start
    stats: dict
    peak_host_vectors: int = 0  # bucket residency (PlannerSettings.device_vectors), the busiest simulated rank
    moved_vectors: int = 0
    copy_wait_s: float = 0.0

    @property
    def idle_s(self) -> float:
        return max(0.0, self.step_s - self.sync_s - self.busy_s)


def _planner_groups(arrivals: list[tuple[float, Traj]], opd: bool, mode: str) -> list[tuple[float, Traj]]:
    """OPD in stream-trajectory: each trajectory its own group (its loss is final on landing)."""
    if not opd or mode != "stream-trajectory":
        return arrivals
    return [(t, dataclasses.replace(tr, group=tr.group * 100_000 + tr.index, index=0)) for t, tr in arrivals]


def _rank_bounds(sc: Scenario, arrivals: list[tuple[float, Traj]], dp: int) -> dict[int, float]:
    """rank -> max_j (r_j + Σ_{r_i ≥ r_j} w_i) over the trajectories it must train (module docstring)."""
    lc, settings = sc.learner, sc.settings
    arr = sorted(((max(0.0, t), tr) for t, tr in arrivals), key=lambda x: x[0])
    groups: dict[str, set] = {}
    for _, tr in arr:
        groups.setdefault(tr.group_id, set()).add(tr.reward)
    skip = settings.skip_zero_advantage and not sc.opd
    per_rank: dict[int, list] = {}
    rank = dp_ranks(settings, arr, dp)
    for t, tr in arr:
        if skip and len(groups[tr.group_id]) == 1:
            continue
        w = lc.per_token_s * tr.tokens + lc.per_token2_s * tr.tokens ** 2
        per_rank.setdefault(rank[tr.traj_id], []).append((t, w))
    return {r: lower_bound(j, 0.0) for r, j in per_rank.items()}


def simulate_mode(sc: Scenario, mode: str, batches: list[list[Traj]]) -> list[StepRow]:
    """Every step of one mode (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    lay = sc.layout
    k_async = sc.async_k if mode == "async" else 0
    engine = EngineModel(sc.cost, lay)
    starts: list[float] = []  # s_k
    free = [0.0] * lay.engines  # each engine's last landing of the previous batch
    rows, t = [], 0.0
    ranks = ranks_to_simulate(lay.dp)
    for k, batch in enumerate(batches):
        s_k = t
        starts.append(s_k)
        published = starts[k - k_async] if k - k_async >= 0 else 0.0
        begin = [max(published, f) for f in free]
        land, free = simulate_batch(engine, batch, begin)
        arrivals = _planner_groups([(land[tr.traj_id] - s_k, tr) for tr in batch], sc.opd, mode)
        plan_mode = "sync" if mode == "async" else mode
        settings = dataclasses.replace(sc.settings, skip_zero_advantage=False) if sc.opd else sc.settings
        tls = [simulate_rank(sc.learner, settings, arrivals, plan_mode, r, lay.dp) for r in ranks]
        last = max(t_ for t_, _ in arrivals)
        work = _rank_bounds(sc, arrivals, lay.dp)
        after = sc.learner.barrier_s
        bound = max([max(0.0, last)] + list(work.values())) + after + sc.sync_s
        # ranks not simulated (DP > 16) count with their bound: the step is never shorter than any rank's work
        learner_s = max([tl.end_s for tl in tls] + [w + after for r, w in work.items() if r not in ranks])
        slow = max(tls, key=lambda tl: tl.end_s)
        busy = sum(b - a for a, b in slow.busy)
        step_s = learner_s + sc.sync_s
        rows.append(StepRow(step=k, start_s=s_k, step_s=step_s, makespan_s=max(f - b for f, b in zip(free, begin)),
                            last_reward_s=max(0.0, last), busy_s=busy, tail_s=learner_s - max(0.0, last),
                            sync_s=sc.sync_s, bound_s=bound,
                            peak_open_groups=max(tl.peak_open_groups for tl in tls), busy=tls[0].busy,
                            landed=sorted(max(0.0, t_) for t_, _ in arrivals), stats=tls[0].stats,
                            peak_host_vectors=max(tl.peak_host_vectors for tl in tls),
                            moved_vectors=max(tl.moved_vectors for tl in tls),
                            copy_wait_s=max(tl.copy_wait_s for tl in tls)))
        t = s_k + step_s
    return rows


def summarize(rows: list[StepRow]) -> dict:
    steady = rows[1:] or rows
    mean = lambda f: statistics.mean(f(r) for r in steady)  # noqa: E731
    return {"step_s": mean(lambda r: r.step_s), "makespan_s": mean(lambda r: r.makespan_s),
            "learner_busy_s": mean(lambda r: r.busy_s), "idle_s": mean(lambda r: r.idle_s),
            "idle_frac": mean(lambda r: r.idle_s / r.step_s if r.step_s else 0.0),
            "tail_s": mean(lambda r: r.tail_s), "sync_s": mean(lambda r: r.sync_s),
            "bound_s": mean(lambda r: r.bound_s), "peak_open_groups": max(r.peak_open_groups for r in rows),
            "steps": len(rows), "first_step_s": rows[0].step_s,
            "peak_host_vectors": max(r.peak_host_vectors for r in rows), "moved_vectors": mean(lambda r: r.moved_vectors),
            "copy_wait_s": mean(lambda r: r.copy_wait_s)}


def simulate(sc: Scenario, batches: list[list[Traj]], modes=MODES) -> dict:
    """mode -> {"rows": [StepRow], "summary": {...}}; speedups against sync when it is among the modes."""
    out = {m: {"rows": simulate_mode(sc, m, batches)} for m in modes}
    for m in modes:
        out[m]["summary"] = summarize(out[m]["rows"])
    if "sync" in out:
        base = out["sync"]["summary"]["step_s"]
        for m in modes:
            out[m]["summary"]["speedup_vs_sync"] = base / out[m]["summary"]["step_s"]
    return out
