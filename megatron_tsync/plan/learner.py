"""The learner's side of a simulated step: the project's own :class:`StepPlanner` decides the order of work.

Per simulated data-parallel rank, the loop follows ``training/learner.py`` (``_consume`` / ``_feed`` / ``_drain``):
when the learner is free it takes every reward that has landed (all of them while it was busy), hands them to the
planner in one ``on_ready_batch`` (each rank's planner sees every arrival, trains only its own: the i-th arrival
goes to rank i mod DP, or by group with ``--dp-assignment group``: ``DataParallelAssigner``), runs the items, then
``closable()``'s held items and group closes;
when nothing is pending it waits for the next arrival. At the end, ``finish()``'s held items and closes, then the
barrier (gradient all-reduce and the optimizer). Items cost :class:`LearnerCost` seconds each (one microbatch per
trajectory, or packed microbatches of at most ``max_packed_tokens``); one schedule call on PP stages pays the
pipeline's fill and drain once, (PP − 1)/PP of its mean microbatch. ``coalesce_tokens`` (``--stream-coalesce-tokens``)
holds a poll until the landed trajectories hold that many tokens or the step's rewards are all in.

Ranks simulated: every rank up to ``max_ranks`` (16), else 16 spread evenly (the others are statistically alike);
the step waits for the slowest.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict

from megatron_tsync.algorithms.advantages import get_advantage_estimator
from megatron_tsync.algorithms.streamability import RewardSpec
from megatron_tsync.plan.memory import PER_GROUP
from megatron_tsync.streaming.planner import Dest, StepPlanner, TrajMeta, WorkItem
from megatron_tsync.streaming.ready_queue import DataParallelAssigner
from megatron_tsync.plan.workload import Traj


@dataclasses.dataclass(frozen=True)
class LearnerCost:
    """Seconds of learner work: ``overhead_s + per_token_s·T + per_token2_s·T²`` per microbatch of T tokens (from
    FLOPs at an MFU, or fitted to measured microbatch times), ``call_s`` per schedule call, ``fold_s`` per group
    close, ``barrier_s`` per step. ``planner_time``: also count the real planner's own CPU seconds, as timed while
    the simulation runs it (the trainer pays them on any hardware; off by default, so a simulation is deterministic)."""

    overhead_s: float
    per_token_s: float
    per_token2_s: float = 0.0
    fold_s: float = 0.0
    barrier_s: float = 0.0
    pp: int = 1
    call_s: float = 0.0
    planner_time: bool = False
    vector_copy_s: float = 0.0  # one bucket vector host <-> GPU, one way, at the host link's bandwidth
    host_add_s: float = 0.0  # host accumulation: one vector's host add (read two, write one) at host memory bandwidth
    forward_share: float = 1.0 / 3.0  # of a microbatch's seconds, its forward (2 of its 6 FLOPs per parameter-token)

    def microbatch_s(self, tokens: int) -> float:
        return self.overhead_s + self.per_token_s * tokens + self.per_token2_s * tokens * tokens


@dataclasses.dataclass(frozen=True)
class PlannerSettings:
    estimator: str = "grpo"
    skip_zero_advantage: bool = True
    wait_for_variance: bool = True
    max_open_groups: int | None = None
    sequence_packing: bool = False
    max_packed_tokens: int = 4096
    coalesce_tokens: int = 0
    dp_assignment: str = "arrival"  # --dp-assignment: "arrival", "group", "balanced", "spill"
    device_vectors: int | None = None  # bucket residency's device cache (--max-device-buckets); None: all on the GPU
    host_accumulation: bool = False  # --accumulate-on-host: accumulator and buckets on the host, grad buffer scratch


def dp_ranks(settings: PlannerSettings, arrivals: list[tuple[float, Traj]], dp: int) -> dict[str, int]:
    """traj_id -> the DP rank that trains it, as the trainer's :class:`DataParallelAssigner` decides in landing order
    (``arrivals`` sorted by landing time)."""
    how, sizes = settings.dp_assignment, {}
    for _, tr in arrivals:  # the group sizes the trainer's samples carry
        sizes[tr.group_id] = sizes.get(tr.group_id, 0) + 1
    a = DataParallelAssigner(dp, by_group=how in ("group", "balanced", "spill"), balanced=how == "balanced",
                             spill=how == "spill", step_trajectories=len(arrivals))
    return {tr.traj_id: a.assign(tr.traj_id, tr.group_id, tr.tokens, sizes.get(tr.group_id, 0))
            for _, tr in arrivals}


@dataclasses.dataclass
class RankTimeline:
    end_s: float = 0.0
    busy: list = dataclasses.field(default_factory=list)  # (start, end) of each schedule call / close / barrier
    order: list = dataclasses.field(default_factory=list)  # ("run", traj_id) / ("close", group_id), in order
    jobs: list = dataclasses.field(default_factory=list)  # (release, seconds) of every microbatch (the bound)
    peak_open_groups: int = 0
    stats: dict = dataclasses.field(default_factory=dict)
    peak_host_vectors: int = 0  # bucket residency: vectors in the host arena at the peak
    moved_vectors: int = 0  # vectors copied host <-> GPU, both ways
    copy_wait_s: float = 0.0  # copy time not hidden behind the previous microbatch


def make_planner(settings: PlannerSettings, sizes: dict[str, int], mode: str, rank: int) -> StepPlanner:
    """The planner the learner builds (``Learner._planner``) for the default loss (PPO clip, trainer log-probs)."""
    est = get_advantage_estimator(settings.estimator, eps=1e-6)
    return StepPlanner(est, sizes, mode=mode, reward_spec=RewardSpec.binary(), loss_kind="ppo_clip",
                       aux_strategy="none", max_open_groups=settings.max_open_groups, ratio_is_one=True,
                       ratio_known_before_backward=True, dp_rank=rank,
                       skip_zero_advantage=settings.skip_zero_advantage, wait_for_variance=settings.wait_for_variance)


class _Residency:
    """Bucket residency in the timeline (``streaming/offload.py``): at most ``cap`` vectors on the GPU, a group's
    vectors (``per_group``) brought in before a backward writes into it or its close folds it, the least recently
    used other groups' vectors sent to the host to make room (the trainer's policy, which keeps groups with queued
    work, moves less: LRU is the conservative stand-in). Each move is a vector copy over the host link; the copies for
    a microbatch run on a side stream during the previous one, so only what exceeds it is waited for."""

    def __init__(self, cap: int, per_group: int, tl: RankTimeline):
        self.cap, self.per_group, self.tl = cap, per_group, tl
        self.device: OrderedDict[str, int] = OrderedDict()  # group -> vectors, LRU first
        self.host: dict[str, int] = {}

    def need(self, gid: str) -> int:
        """Vectors moved so that ``gid``'s bucket is on the GPU (opened there if new)."""
        if gid in self.device:
            self.device.move_to_end(gid)
            return 0
        n = self.host.pop(gid, 0)
        moved = n
        want = n or self.per_group
        while self.device and sum(self.device.values()) + want > self.cap:
            old, k = self.device.popitem(last=False)
            self.host[old] = k
            moved += k
        self.device[gid] = want
        self.tl.peak_host_vectors = max(self.tl.peak_host_vectors, sum(self.host.values()))
        self.tl.moved_vectors += moved
        return moved

    def drop(self, gid: str) -> None:
        self.device.pop(gid, None)


class _HostAccum:
    """Host accumulation in the timeline (``streaming/host_accum.py``): one FIFO host worker. A microbatch whose
    destination (its group's Q, or the accumulator) differs from the scratch's flushes it when its forward starts:
    the D2H copy and the host add run as a chunk pipeline, ``max(copy, add)`` seconds on the worker once it is free;
    the backward waits for it only beyond the forward. Origin shifts (one add per bucket microbatch, counted for every
    one: conservative) and closes (``per_group`` adds) queue on the worker without stopping the learner; the barrier
    waits for the worker, then copies the accumulator to the GPU (one vector over the host link)."""

    def __init__(self, cost: LearnerCost, per_group: int, tl: RankTimeline):
        self.cost, self.per_group, self.tl = cost, per_group, tl
        self.flush_s = max(cost.vector_copy_s, cost.host_add_s)
        self.worker_free = 0.0
        self.dest: str | None = None  # the scratch's destination ("" : the accumulator)
        self.dirty = False

    def _queue(self, t: float, secs: float) -> float:
        self.worker_free = max(self.worker_free, t) + secs
        return self.worker_free

    def flush(self, t: float) -> float:
        """Flush at ``t`` if the scratch holds a gradient; returns when the scratch is free again."""
        if not self.dirty:
            return t
        self.dirty = False
        self.tl.moved_vectors += 1
        return self._queue(t, self.flush_s)

    def microbatch(self, t: float, dest: str, fwd: float) -> float:
        """A microbatch (its forward starts at ``t``) writing ``dest``: the seconds its backward waits."""
        free = self.flush(t) if dest != self.dest or dest else t  # a bucket microbatch: a new group or a shift
        self.dest, self.dirty = dest, True
        wait = max(0.0, free - (t + fwd))
        if dest:
            self._queue(t + fwd + wait, self.cost.host_add_s)  # the origin shift (P += shift·Q)
        return wait

    def close(self, t: float) -> None:
        self.flush(t)  # the close's adds flush the scratch first; then it routes to the accumulator
        self.dest = ""
        self._queue(t, self.per_group * self.cost.host_add_s)

    def barrier(self, t: float) -> float:
        """Seconds the barrier waits: the worker drains, then the accumulator goes to the GPU."""
        self.tl.moved_vectors += 1
        return max(0.0, self.flush(t) - t, self.worker_free - t) + self.cost.vector_copy_s


class _Rank:
    def __init__(self, cost: LearnerCost, settings: PlannerSettings, trajs: dict[str, Traj], release: dict[str, float]):
        self.cost, self.settings, self.trajs, self.release = cost, settings, trajs, release
        self.tl = RankTimeline()
        self.now = 0.0
        cap = settings.device_vectors
        self.res = None if cap is None else _Residency(cap, PER_GROUP.get(settings.estimator, 2), self.tl)
        self.host = _HostAccum(cost, PER_GROUP.get(settings.estimator, 2), self.tl) if settings.host_accumulation \
            else None

    def _copies_s(self, mbs: list[list[WorkItem]], secs: list[float]) -> float:
        """Copy seconds waited for in one schedule call: microbatch k's vectors move during microbatch k − 1."""
        if self.res is None:
            return 0.0
        wait = 0.0
        for k, mb in enumerate(mbs):
            moved = sum(self.res.need(it.group_id) for it in mb if it.dest is Dest.BUCKET)
            wait += max(0.0, moved * self.cost.vector_copy_s - (secs[k - 1] if k else 0.0))
        self.tl.copy_wait_s += wait
        return wait

    def _host_waits(self, mbs: list[list[WorkItem]], secs: list[float]) -> float:
        """Host accumulation: seconds the backwards of one schedule call wait for the scratch (``_HostAccum``)."""
        if self.host is None:
            return 0.0
        t, wait = self.now + self.cost.call_s, 0.0
        for mb, s in zip(mbs, secs):
            dest = next((it.group_id for it in mb if it.dest is Dest.BUCKET), "")
            w = self.host.microbatch(t, dest, s * self.cost.forward_share)
            wait, t = wait + w, t + s + w
        self.tl.copy_wait_s += wait
        return wait

    def run(self, items: list[WorkItem]) -> None:
        """One schedule call (``StreamExecutor.run``): the items' microbatches back to back, plus the PP bubble."""
        if not items:
            return
        mbs: list[list[WorkItem]] = []
        cap = self.settings.max_packed_tokens if self.settings.sequence_packing else 0
        for it in items:
            tok = self.trajs[it.traj_id].tokens
            if mbs and cap and sum(self.trajs[x.traj_id].tokens for x in mbs[-1]) + tok <= cap:
                mbs[-1].append(it)
            else:
                mbs.append([it])
        secs = [self.cost.microbatch_s(sum(self.trajs[x.traj_id].tokens for x in mb)) for mb in mbs]
        total = self.cost.call_s + sum(secs) + (self.cost.pp - 1) / self.cost.pp * (sum(secs) / len(secs))
        total += self._copies_s(mbs, secs) + self._host_waits(mbs, secs)
        t0 = self.now
        for mb, s in zip(mbs, secs):
            self.tl.jobs.append((max(self.release[x.traj_id] for x in mb), s))
        self.tl.order += [("run", it.traj_id) for it in items]
        self.now += total
        self.tl.busy.append((t0, self.now))

    def plan_s(self, t0: float) -> None:
        """The planner's own seconds since ``t0`` (``LearnerCost.planner_time``)."""
        if self.cost.planner_time:
            dt = time.perf_counter() - t0
            self.tl.busy.append((self.now, self.now + dt))
            self.tl.jobs.append((0.0, dt))
            self.now += dt

    def close(self, closes) -> None:
        for c in closes:
            self.tl.order.append(("close", c.group_id))
            fold = self.cost.fold_s
            if self.host is not None:  # the fold is host adds on the worker: the learner goes on
                self.host.close(self.now)
                continue
            if self.res is not None and (c.group_id in self.res.device or c.group_id in self.res.host):
                # the fold reads the group's vectors on the GPU: brought back if they were sent out, not hidden
                wait = self.res.need(c.group_id) * self.cost.vector_copy_s
                self.res.drop(c.group_id)
                self.tl.copy_wait_s += wait
                fold += wait
            if fold > 0:
                self.tl.busy.append((self.now, self.now + fold))
                self.tl.jobs.append((0.0, fold))
                self.now += fold


def simulate_rank(cost: LearnerCost, settings: PlannerSettings, arrivals: list[tuple[float, Traj]], mode: str,
                  rank: int, dp: int, start: float = 0.0) -> RankTimeline:
    """One rank's step. ``arrivals``: (landing time, trajectory), times relative to the step's start (clamped at
    0: an async batch may have landed before its step began)."""
    arr = sorted(((max(0.0, t), tr) for t, tr in arrivals), key=lambda x: x[0])
    trajs = {tr.traj_id: tr for _, tr in arr}
    sizes: dict[str, int] = {}
    for _, tr in arr:
        sizes[tr.group_id] = sizes.get(tr.group_id, 0) + 1
    planner = make_planner(settings, sizes, mode, rank)
    ranks = dp_ranks(settings, arr, dp)
    R = _Rank(cost, settings, trajs, {tr.traj_id: t for t, tr in arr})
    R.now = 0.0
    i, n = 0, len(arr)
    while i < n:
        R.now = max(R.now, arr[i][0])
        j = i
        while j < n and arr[j][0] <= R.now:
            j += 1
        if settings.coalesce_tokens and mode != "sync":
            while j < n and sum(tr.tokens for _, tr in arr[i:j]) < settings.coalesce_tokens:
                R.now = max(R.now, arr[j][0])
                j += 1
        metas = [TrajMeta(tr.traj_id, tr.group_id, tr.reward, tr.tokens, ranks[tr.traj_id]) for _, tr in arr[i:j]]
        i = j
        t0 = time.perf_counter()
        items = planner.on_ready_batch(metas)
        R.tl.peak_open_groups = max(R.tl.peak_open_groups, planner.open_groups)
        R.plan_s(t0)
        R.run(items)
        t0 = time.perf_counter()
        closes, held = planner.closable()
        R.plan_s(t0)
        R.run(held)
        R.close(closes)
    t0 = time.perf_counter()
    closes, held = planner.finish()
    R.plan_s(t0)
    R.run(held)
    R.close(closes)
    barrier = cost.barrier_s
    if R.host is not None:
        wait = R.host.barrier(R.now)
        R.tl.copy_wait_s += wait
        barrier += wait
        R.tl.peak_host_vectors = 1 + PER_GROUP.get(settings.estimator, 2) * R.tl.peak_open_groups
    if barrier > 0:
        R.tl.busy.append((R.now, R.now + barrier))
        R.now += barrier
    R.tl.end_s = R.now
    R.tl.stats = dict(planner.stats)
    R.tl.busy = [(a + start, b + start) for a, b in R.tl.busy]
    R.tl.end_s += start
    return R.tl


def ranks_to_simulate(dp: int, max_ranks: int = 16) -> list[int]:
    if dp <= max_ranks:
        return list(range(dp))
    return sorted({k * dp // max_ranks for k in range(max_ranks)})


def lower_bound(jobs: list[tuple[float, float]], barrier_s: float) -> float:
    """max_j (r_j + Σ_{r_i ≥ r_j} w_i) + barrier: a one-machine schedule of these jobs (release r, work w) ends no
    earlier (``tools/bench_streaming.py``'s per-step bound, the same formula)."""
    best, suffix = 0.0, 0.0
    for r, w in sorted(jobs, reverse=True):
        suffix += w
        best = max(best, r + suffix)
    return best + barrier_s
