"""One batch of the learner: consume ready trajectories, close groups, barrier, step — per minibatch and epoch.

The same code runs the three modes (``sync``, ``stream-group``, ``stream-trajectory``); the planner decides what runs
when (``sync`` also takes its microbatch order from ``sync_order`` when set). Per minibatch (``train_step``): consume
(feed landed trajectories to the planner, run what it releases, poll for more, π_θ0 forward-only scoring on
arrival where needed), drain (run what the planner still holds, close every group: nothing may stay open), then the
barrier shared with the OPD learner (``training.barrier.barrier_step``): one DP reduction (``finalize_model_grads``),
division by the explicit denominator, optional gradient hook, megatron's optimizer step (clipping if configured),
zeroed grads. A non-finite loss or gradient skips the update (``BarrierResult.skipped``: θ unchanged, grads dropped;
``StepResult.skipped_updates`` counts them; the loop stops the run after ``--max-consecutive-skipped-steps``).

``deterministic`` (``--deterministic``): the bitwise mode. The gradient sum is the canonical-order reduction of
``streaming.canonical`` in every mode, statistics use the rewards in canonical order, torch's deterministic
algorithms are switched on, and a group's trajectories must all be on one DP rank (``DataParallelAssigner`` with
``group_order``), so sync, stream-group and stream-trajectory give bitwise-identical weights for any arrival order.
At EP > 1 each rank also folds the vectors of its expert-parallel peers' trajectories (their tokens' gradients of
this rank's experts; ``training.stream_fb``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import torch

from megatron_tsync.algorithms.advantages import get_advantage_estimator
from megatron_tsync.algorithms.aggregation import barrier_divisor
from megatron_tsync.algorithms.streamability import RewardSpec, describe_config
from megatron_tsync.streaming.accumulator import GroupBuckets
from megatron_tsync.streaming.buckets import BucketPool, GradRouter
from megatron_tsync.streaming.canonical import CanonicalSum
from megatron_tsync.streaming.host_accum import HostAccumulation
from megatron_tsync.streaming.offload import Residency, ResidencyConfig
from megatron_tsync.streaming.planner import StepPlanner, TrajMeta
from megatron_tsync.streaming.ready_queue import ArrivalSource, Sample
from megatron_tsync.training.barrier import barrier_step
from megatron_tsync.training.objective import objective_value, sum_over_replicas
from megatron_tsync.training.old_logprobs import Theta0Logprobs
from megatron_tsync.training.reference import ReferenceModel, shape_rewards
from megatron_tsync.training.stream_fb import (SHAPED_REWARD, THETA0_LOGP, BatchShape, LossConfig, StreamExecutor,
                                              train_reward)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    mode: str = "stream-trajectory"
    estimator: str = "grpo"
    estimator_eps: float = 1e-6
    loss: LossConfig = LossConfig()
    reward_spec: RewardSpec = RewardSpec.binary()
    aux_strategy: str = "second-backward"  # how KL/entropy loss terms stream: "second-backward" | "defer"
    max_open_groups: int | None = None
    max_device_buckets: int | None = None  # bucket residency (streaming/offload.py): device cache slots; the vectors
    # beyond go to the host arena
    bucket_device_gib: float | None = None  # bucket residency: device cache size in GiB (with the above: the smaller)
    bucket_host_gib: float | None = None  # bucket residency: host arena size in GiB (None: sized per step)
    accumulate_on_host: bool = False  # host accumulation (streaming/host_accum.py): accumulator and every bucket
    # vector in pinned host memory, megatron's grad buffer as each microbatch's scratch (0 extra device vectors)
    poll_timeout_s: float = 0.05
    num_minibatches: int = 1  # optimizer steps per batch, minibatches fixed by group index (design note §5)
    epochs: int = 1  # passes over the batch; epochs after the first are synchronous
    sequence_packing: bool = False  # several trajectories per microbatch when their gradient destination agrees
    max_packed_tokens: int = 4096  # tokens per packed microbatch at most (with sequence_packing)
    deterministic: bool = False  # bitwise arrival-order-invariant gradient sum (streaming/canonical.py); no packing
    dp_assignment: str = "auto"  # which DP rank trains a trajectory (DataParallelAssigner): "arrival" (i-th arrival →
    # rank i mod DP), "group" (a group's members on one rank, the one with the fewest landed tokens), "balanced" (by
    # group, the least predicted work), "spill" (by group, a member to the least-loaded rank when its group's rank
    # runs ahead by more than a trajectory or so) or "auto": spill in GRPO stream-trajectory, else arrival. Every
    # assignment gives the same update (runtime.grpo.resolved_dp_assignment)
    skip_zero_advantage: bool = True  # no work for trajectories of advantage exactly 0 (streaming/planner.py)
    wait_for_variance: bool = True  # stream-trajectory + skip: a group's trajectories wait until its rewards differ
    shared_prefix: bool = False  # a group's prompt forwarded/backpropagated once per microbatch (packing.PrefixLayout)
    coalesce_ms: float = 0.0  # streaming modes: arrivals within this window reach the learner together (the runtime's
    # source, streaming.ready_queue.CoalescingSource), so they can share microbatches
    coalesce_tokens: int = 0  # streaming modes: ... and arrivals are collected until they hold this many tokens
    pack_across_groups: bool = False  # packed microbatches mix gradient destinations (model/row_split.py)
    full_microbatches: bool = False  # streaming + packing: a packed microbatch runs once full (or at the step's end)


@dataclasses.dataclass
class StepResult:
    step_s: float
    busy_s: float
    idle_frac: float
    grad_norm: float | None  # the mean over the step's applied optimizer steps (minibatches × epochs): 0 only when
    # every one had a zero gradient (the last one alone said "no signal" for a step whose last minibatch had none);
    # None when none was applied
    update_ok: bool
    num_trajectories: int
    num_action_tokens: int
    microbatches: int
    loss_sum: float  # Σ of the backpropagated terms' values (surrogates included: mode and order dependent)
    peak_bucket_vectors: int
    peak_bucket_bytes: int
    planner_stats: dict
    busy_intervals: list  # (start, end) seconds since step start
    last_arrival_s: float
    work_after_last_arrival_s: float
    offload: dict | None = None  # bucket residency (streaming/offload.OffloadStats): bytes per tier, moves, waits
    objective: float | None = None  # the objective's true value, mean over the step's optimizer steps
    # (training/objective.py): the same in every mode and arrival order
    skipped_updates: int = 0  # optimizer steps of this batch skipped for a non-finite loss / gradient (training/barrier)


@dataclasses.dataclass
class _Batch:
    """Bookkeeping of one ``Learner.train_step`` (M minibatches × E epochs of one batch)."""

    group_sizes: dict[str, int]
    mb_of: dict[str, int]  # group id → minibatch (group i of the batch → i mod M)
    expected: list[int]  # trajectories per minibatch
    theta0: bool  # π_θ0 is needed after the first step (M > 1 or E > 1 with trainer old log-probs)
    later_lc: LossConfig  # loss config of every minibatch/epoch but the first (π_old = θ0 or the engine's)
    buffered: list[list[Sample]]  # per minibatch: landed, not fed yet (its minibatch has not started)
    seen: list[list[Sample]]  # per minibatch: every trajectory that landed
    t_start: float  # perf_counter at the start of the step
    last_arrival: float  # perf_counter of the last landed trajectory
    n_tok_all: int = 0  # action tokens of every landed trajectory
    stats: dict[str, int] = dataclasses.field(default_factory=dict)  # planner stats summed over minibatches/epochs
    barrier_busy: list = dataclasses.field(default_factory=list)  # (start, end) perf_counter of each barrier
    grad_norms: list = dataclasses.field(default_factory=list)  # of each applied optimizer step (minibatch × epoch)
    ok: bool = True  # every optimizer step succeeded
    skipped: int = 0  # optimizer steps skipped for a non-finite loss / gradient
    loss_mark: int = 0  # entries of the executor's losses that belong to earlier optimizer steps
    first_step: bool = True  # no optimizer step of this batch has run yet
    objective: list = dataclasses.field(default_factory=list)  # J of each optimizer step (training/objective.py)
    group_rank: dict = dataclasses.field(default_factory=dict)  # deterministic mode: group id -> its DP rank

    def sizes(self, j: int) -> dict[str, int]:
        """Group sizes of minibatch j, in batch order."""
        return {g: n for g, n in self.group_sizes.items() if self.mb_of[g] == j}


class Learner:
    def __init__(self, ddp_model, optimizer, cfg: LearnerConfig, *, dp_rank: int = 0, pp_size: int = 1,
                 reference: ReferenceModel | None = None):
        """``reference``: π_ref of the KL term (``training.reference``), scored on arrival; None = the samples carry
        ``ref_logp`` (recorded rollouts) or there is no KL term."""
        self.model = ddp_model
        self.opt = optimizer
        self.cfg = cfg
        self.dp_rank = dp_rank
        self.pp_size = pp_size
        self.estimator = get_advantage_estimator(cfg.estimator, eps=cfg.estimator_eps)
        self.router = GradRouter(ddp_model)
        rc = ResidencyConfig(max_device_vectors=cfg.max_device_buckets, device_gib=cfg.bucket_device_gib,
                             host_gib=cfg.bucket_host_gib)
        if cfg.bucket_host_gib is not None and not rc.on and not cfg.accumulate_on_host:
            raise ValueError("--bucket-host-gib sizes the host arena of bucket residency: it needs "
                             "--max-device-buckets, --bucket-device-gib or --accumulate-on-host")
        host = _host_accumulation(cfg, self.router, rc)
        self.pool = BucketPool(self.router.accumulator, keep_free=not rc.on and host is None)
        residency = Residency(self.router, rc) if rc.on else None
        self.buckets = GroupBuckets(self.router, self.pool, residency, host)
        self.canonical = _deterministic_sum(cfg, self.router, self.pool, residency)
        self.exec = StreamExecutor(ddp_model, self.buckets, cfg.loss,
                                   max_packed_tokens=cfg.max_packed_tokens if cfg.sequence_packing else None,
                                   canonical=self.canonical,
                                   shared_prefix_tokens=cfg.max_packed_tokens if cfg.shared_prefix else None,
                                   mix_groups=cfg.pack_across_groups, full_microbatches=cfg.full_microbatches)
        self.theta0 = Theta0Logprobs(ddp_model, cfg.loss.temperature)
        self.reference = reference
        for ls in [self.theta0.lockstep] + ([reference.lockstep] if reference is not None else []):
            ls.one_per_slot = cfg.deterministic  # EP > 1: a forward's bits must not depend on its partners
        lc = cfg.loss
        self.kl_active = lc.kl_mode != "none" and lc.kl_coef != 0.0
        self.kl_reward = self.kl_active and lc.kl_mode == "reward"
        # KL in the reward: shaped rewards r − β·KL are unbounded (k1 either way; k2/k3 below), so the clip rule's
        # sign certainty uses no bounds (exact, only more deferral); raw rewards are still checked on arrival
        self.train_spec = RewardSpec.continuous() if self.kl_reward else cfg.reward_spec
        self._described = False
        self.grad_hook = None  # callable(ddp_model) run after normalisation, before clipping (--dump-grads)
        self.sync_order: list[str] | None = None  # sync mode: microbatch order (permutation control)
        self.last_divisor = 1.0  # the explicit denominator of the latest barrier (set before its grad hook runs)
        self.last_update = (0, 0)  # (epoch, minibatch) of the latest barrier (set before its grad hook runs)

    def _describe_once(self):
        if self._described:
            return
        self._described = True
        lc = self.cfg.loss
        kl_mode = {"none": "none", "loss": "loss", "reward": "in_reward"}[lc.kl_mode if lc.kl_coef else "none"]
        strategy = {"second-backward": "second_backward", "defer": "defer_to_close"}[self.cfg.aux_strategy]
        msg = describe_config(lc.policy, self.train_spec, kl_mode, lc.entropy_coef, aux_strategy=strategy)
        log.warning("streamability: %s", msg) if self.cfg.mode == "stream-trajectory" else log.info("%s", msg)

    def _planner(self, sizes: dict[str, int], mode: str, lc: LossConfig) -> StepPlanner:
        cfg = self.cfg
        return StepPlanner(
            self.estimator,
            sizes,
            mode=mode,
            reward_spec=self.train_spec,
            loss_kind=lc.policy.kind,
            aux_strategy=cfg.aux_strategy if lc.has_aux else "none",
            max_open_groups=cfg.max_open_groups,
            ratio_is_one=lc.old_logprobs == "trainer",
            ratio_known_before_backward=self.pp_size == 1,
            dp_rank=self.dp_rank,
            deterministic=cfg.deterministic,
            skip_zero_advantage=cfg.skip_zero_advantage,
            wait_for_variance=cfg.wait_for_variance,
        )

    def train_step(self, source: ArrivalSource, group_sizes: dict[str, int], shape: BatchShape) -> StepResult:
        """One batch: ``num_minibatches`` × ``epochs`` optimizer steps (design note §5).

        Minibatch membership is fixed by group index (group i of the batch → minibatch i mod M), never by arrival
        order. Minibatch 1 of epoch 1 streams at θ0 (ratio 1 with trainer log-probs); minibatch j streams after step
        j − 1: its trajectories that already arrived run at once, later ones as they land, with the exact clip rule.
        π_old after the first step: with ``old_logprobs="trainer"`` the trainer's π_θ0 — kept from minibatch 1's own
        forward, or a forward-only pass on arrival (under a θ0 snapshot if it lands after the first step;
        ``training/old_logprobs.py``); with ``"engine"`` the engine's log-probs. Later epochs are ordinary synchronous
        passes. Each minibatch has its own denominators (its sequences / tokens). With M = E = 1 this is the
        single-step streaming update.

        Per minibatch and epoch: :meth:`_consume` (feed what landed, poll until the minibatch is complete),
        :meth:`_drain` (what the planner still holds, close every group), :meth:`_barrier` (one optimizer step).
        """
        self._describe_once()
        cfg = self.cfg
        st = self._begin_batch(group_sizes, shape)
        for e in range(cfg.epochs):
            for j in range(cfg.num_minibatches):
                self.last_update = (e, j)
                lc = cfg.loss if (e == 0 and j == 0) else st.later_lc
                mode = cfg.mode if e == 0 else "sync"
                planner = self._planner(st.sizes(j), mode, lc)
                n_seq = st.expected[j] if cfg.num_minibatches > 1 else shape.num_sequences
                self.exec.begin_phase(planner, BatchShape(n_seq, shape.max_len), lc)
                if self.canonical is not None:
                    self.canonical.begin(list(st.sizes(j)), ("policy", "aux") if lc.has_aux else ("policy",))
                    self._folded: set[str] = set()
                    self._planned: set[str] = set()
                self._consume(st, source, planner, j, replay=e > 0)
                self._drain(st, planner, mode)
                self._barrier(st, j, lc)
        self.theta0.end_batch()
        return self._result(st)

    def _kl_on_arrival(self, st: "_Batch", landed: list[Sample]) -> None:
        """π_ref for this replica's landed trajectories; with ``--kl-mode reward`` also π_θ0 and the shaped rewards
        r − β·KL (every rank). Runs while the learner would otherwise wait for rewards (``training.reference``)."""
        if not self.kl_reward:
            for s in landed:  # a sample may have met a KL-in-reward learner before (benchmarks replay samples)
                s.meta.pop(SHAPED_REWARD, None)
        if not self.kl_active or not landed:
            return
        own = [s for s in landed if s.dp_rank == self.dp_rank]
        if self.reference is not None:
            self.reference.score(own)
        if not self.kl_reward:
            return
        for s in landed:
            self.cfg.reward_spec.check(s.reward)  # the verifier's reward, before shaping
        self.theta0.score(own)
        lc = self.cfg.loss
        shape_rewards(landed, dp_rank=self.dp_rank, coef=lc.kl_coef, kind=lc.kl_kind)
        if not st.theta0:  # π_θ0 is not needed again this batch (and Sample.meta is dumped as JSON)
            for s in own:
                s.meta.pop(THETA0_LOGP, None)

    def _begin_batch(self, group_sizes: dict[str, int], shape: BatchShape) -> _Batch:
        """Check the minibatch/epoch counts, assign groups to minibatches, reset the per-step bookkeeping."""
        cfg = self.cfg
        M, E = cfg.num_minibatches, cfg.epochs
        gids = list(group_sizes)
        if M < 1 or E < 1 or M > len(gids):  # (flags: --num-minibatches, --ppo-epochs)
            raise ValueError(f"num_minibatches={M} / epochs={E}: need 1 ≤ minibatches ≤ groups ({len(gids)}), epochs ≥ 1")
        mb_of = {g: i % M for i, g in enumerate(gids)}
        theta0 = (M > 1 or E > 1) and cfg.loss.old_logprobs == "trainer"
        later_lc = dataclasses.replace(cfg.loss, old_logprobs="theta0" if theta0 else "engine")
        self.theta0.begin_batch()
        if self.reference is not None:
            self.reference.begin_batch()
        self.exec.keep_theta0 = theta0
        expected = [sum(n for g, n in group_sizes.items() if mb_of[g] == j) for j in range(M)]
        self.exec.begin_step(None, BatchShape(shape.num_sequences, shape.max_len))
        self.pool.reset_peak()
        if self.buckets.residency is not None:
            self.buckets.residency.begin_step(self._vector_bound(group_sizes, mb_of))
        if self.buckets.host is not None:
            self.buckets.host.begin_step(self._vector_bound(group_sizes, mb_of))
        t_start = time.perf_counter()
        return _Batch(group_sizes=group_sizes, mb_of=mb_of, expected=expected, theta0=theta0, later_lc=later_lc,
                      buffered=[[] for _ in range(M)], seen=[[] for _ in range(M)],
                      t_start=t_start, last_arrival=t_start)

    def _vector_bound(self, group_sizes: dict[str, int], mb_of: dict[str, int]) -> int:
        """Bucket vectors this rank can hold at once in this step (what bucket residency's automatic host arena is
        sized for): per minibatch, 2 per open group (1 when α is known in advance: Dr.GRPO, RLOO), open groups capped
        by ``max_open_groups``; deterministic mode: one per trajectory part and one partial sum per group (EP peers'
        trajectories included, so every trajectory of the minibatch)."""
        cfg = self.cfg
        bound = 0
        for j in range(cfg.num_minibatches):
            sizes = [n for g, n in group_sizes.items() if mb_of[g] == j]
            if self.canonical is not None:
                n = sum(sizes) * (2 if cfg.loss.has_aux else 1) + len(sizes)
            else:
                coupled = getattr(self.estimator, "needs_batch_rewards", False)
                per = max((1 if not coupled and self.estimator.alpha_known_in_advance(G) is not None else 2)
                          for G in sizes) if sizes else 0
                n = per * min(len(sizes), cfg.max_open_groups or len(sizes))
            bound = max(bound, n)
        return bound

    def _consume(self, st: _Batch, source: ArrivalSource, planner: StepPlanner, j: int, *, replay: bool) -> None:
        """Minibatch j: feed what already landed for it, then poll until all its trajectories have landed.

        ``replay`` (epochs after the first): feed every trajectory of the minibatch once, no polling.
        """
        feed = st.seen[j] if replay else st.buffered[j]
        st.buffered[j] = []
        while True:
            self._feed(planner, feed)
            if replay or len(st.seen[j]) >= st.expected[j]:
                return
            if source.exhausted():
                raise RuntimeError(f"step ended with {sum(map(len, st.seen))} trajectories, expected "
                                   f"{sum(st.expected)} (minibatch {j} has {len(st.seen[j])}/{st.expected[j]})")
            feed = self._route(st, source.poll(self.cfg.poll_timeout_s), j)

    def _route(self, st: _Batch, landed: list[Sample], j: int) -> list[Sample]:
        """Register landed trajectories; return minibatch j's, buffer the others'. π_θ0 on arrival where needed."""
        feed: list[Sample] = []
        for s in landed:
            st.last_arrival = time.perf_counter()
            self.exec.add_sample(s)
            st.n_tok_all += s.num_action_tokens
            k = st.mb_of.get(s.group_id)
            if k is None:
                raise ValueError(f"trajectory {s.traj_id} of group {s.group_id!r}: not in this batch")
            st.seen[k].append(s)
            if self.canonical is not None:
                _check_group_rank(st, s)
            (feed if k == j else st.buffered[k]).append(s)
        self._kl_on_arrival(st, landed)
        if st.theta0 and not self.kl_reward:  # π_θ0 on arrival outside minibatch 1 (its own forward keeps it)
            self.theta0.score([s for s in landed if st.mb_of[s.group_id] > 0 and s.dp_rank == self.dp_rank])
        return feed

    def _drain(self, st: _Batch, planner: StepPlanner, mode: str) -> None:
        """All of the minibatch has landed: run what the planner still holds, close every group, add its stats."""
        closes, held = planner.finish()
        if self.canonical is not None:
            self._plan_final(planner)
        if mode == "sync" and self.sync_order is not None:
            rank = {tid: i for i, tid in enumerate(self.sync_order)}
            held.sort(key=lambda it: rank[it.traj_id])
        if self.canonical is not None:  # group by group, so sync holds one group's vectors at a time, not the batch's
            for gid in planner.groups:
                self.exec.run([it for it in held if it.group_id == gid])
                self._fold_closed(planner, only=gid)
            self._fold_closed(planner)
            self.canonical.finish()
        else:
            self.exec.run(held, final=True)
            self.exec.close(closes)
        if self.exec.waiting:
            raise AssertionError(f"{len(self.exec.waiting)} items still waiting at the barrier")
        if self.buckets.open_groups:
            raise AssertionError(f"{self.buckets.open_groups} buckets still open at the barrier")
        for k, v in planner.stats.items():
            st.stats[k] = st.stats.get(k, 0) + v
        st.stats["shared_prefix_items"] = self.exec.shared_prefix_items
        st.stats["shared_prefix_routing_split"] = self.exec.prefix_routing_split
        st.stats["waited_for_full_microbatch"] = self.exec.waited_items

    def _barrier(self, st: _Batch, j: int, lc: LossConfig) -> None:
        """Minibatch j's optimizer step: release θ0 bookkeeping before the first one, then the shared barrier."""
        t_b = time.perf_counter()
        if st.theta0 and st.first_step:
            self.exec.keep_theta0 = False
            self.theta0.before_first_step(all_scored=sum(map(len, st.seen)) == sum(st.expected))
        st.first_step = False
        n_tok = sum(s.num_action_tokens for s in st.seen[j])
        self.last_divisor = barrier_divisor(lc.aggregation, n_tok)
        st.objective.append(self._objective(st, j))
        losses, st.loss_mark = self.exec.losses[st.loss_mark:], len(self.exec.losses)
        finite = math.isfinite(st.objective[-1]) and all(math.isfinite(x) for x in losses)
        self.buckets.materialize()  # host accumulation: the batch gradient into the grad buffer
        res = barrier_step(self.model, self.opt, self.last_divisor, self.grad_hook, loss_finite=finite)
        st.ok = st.ok and res.update_ok
        st.skipped += int(res.skipped)
        if res.skipped:
            log.warning("optimizer step skipped (minibatch %d): non-finite %s; weights unchanged", j,
                        "loss" if not finite else "gradient")
        if res.grad_norm is not None:
            st.grad_norms.append(res.grad_norm)
        st.barrier_busy.append((t_b, res.end_s))

    def _objective(self, st: _Batch, j: int) -> float:
        """Minibatch j's objective value J_j (``training.objective``): its groups' rewards, this rank's scalars,
        summed over replicas and stages (a collective: every rank reaches the barrier)."""
        rewards: dict[str, dict[str, float]] = {g: {} for g in st.sizes(j)}
        for s in st.seen[j]:
            rewards[s.group_id][s.traj_id] = train_reward(s)
        return sum_over_replicas(objective_value(rewards, self.estimator, self.exec.values, self.last_divisor))

    def _result(self, st: _Batch) -> StepResult:
        t_end = time.perf_counter()
        t_start = st.t_start
        ref_busy = self.reference.busy if self.reference is not None else []
        busy = [(a - t_start, b - t_start) for a, b in self.exec.busy + self.theta0.busy + ref_busy + st.barrier_busy]
        busy_s = sum(b - a for a, b in busy)
        step_s = t_end - t_start
        la = st.last_arrival - t_start
        return StepResult(
            step_s=step_s,
            busy_s=busy_s,
            idle_frac=max(0.0, 1.0 - busy_s / step_s) if step_s > 0 else 0.0,
            grad_norm=sum(st.grad_norms) / len(st.grad_norms) if st.grad_norms else None,
            update_ok=st.ok,
            num_trajectories=sum(map(len, st.seen)),
            num_action_tokens=st.n_tok_all,
            microbatches=self.exec.microbatches,
            loss_sum=sum(self.exec.losses),
            peak_bucket_vectors=self.pool.stats.peak_in_use,
            peak_bucket_bytes=self.pool.stats.peak_bytes,
            planner_stats={**st.stats, **self.buckets.traffic_stats()},
            busy_intervals=busy,
            last_arrival_s=la,
            work_after_last_arrival_s=step_s - la,
            offload=(self.buckets.residency.step_stats() if self.buckets.residency is not None else
                     self.buckets.host.step_stats() if self.buckets.host is not None else None),
            objective=sum(st.objective) / len(st.objective) if st.objective else None,
            skipped_updates=st.skipped,
        )

    def _feed(self, planner: StepPlanner, samples: list[Sample]) -> None:
        """Hand landed trajectories to the planner; run what it releases and what group closes release."""
        if samples:
            items = planner.on_ready_batch(
                [TrajMeta(s.traj_id, s.group_id, train_reward(s), s.num_action_tokens, s.dp_rank) for s in samples])
            if self.canonical is not None:
                self._plan_final(planner)
            self.exec.run(items)
        closes, held = planner.closable()
        self.exec.run(held)
        self.exec.close(closes)
        if self.canonical is not None:
            self._fold_closed(planner)

    def _plan_final(self, planner: StepPlanner) -> None:
        """Deterministic mode: groups whose advantages became final tell the canonical sum their local members, so it
        folds them as they run (``CanonicalSum.plan``)."""
        for gid in planner.final_groups():
            if gid not in self._planned:
                self._planned.add(gid)
                ranks = self.exec.lockstep.dp_ranks | {self.dp_rank}  # EP > 1: the group's trajectories (stream_fb)
                members = [t for t, s in self.exec.samples.items() if s.group_id == gid and s.dp_rank in ranks]
                self.canonical.plan(gid, members, planner.canonical_advantages(gid))

    def _fold_closed(self, planner: StepPlanner, only: str | None = None) -> None:
        """Deterministic mode: fold every group whose work has all run (canonical order, ``streaming.canonical``);
        ``only``: just that group, if closed."""
        for gid in planner.closed_groups():
            if gid not in self._folded and only in (None, gid):
                self._folded.add(gid)
                self.canonical.close_group(gid, planner.canonical_advantages(gid))


def _host_accumulation(cfg: LearnerConfig, router, rc: ResidencyConfig) -> HostAccumulation | None:
    """``--accumulate-on-host`` (``streaming/host_accum.py``), refused with the options it cannot serve."""
    if not cfg.accumulate_on_host:
        return None
    why = ("it replaces the device cache of --max-device-buckets / --bucket-device-gib" if rc.on else
           "--deterministic folds per-trajectory vectors (streaming/canonical.py)" if cfg.deterministic else
           "--pack-across-groups writes several destinations in one backward" if cfg.pack_across_groups else None)
    if why:
        raise ValueError(f"--accumulate-on-host: {why}")
    return HostAccumulation(router, cfg.bucket_host_gib)


def _deterministic_sum(cfg: LearnerConfig, router, pool, residency) -> CanonicalSum | None:
    """The bitwise mode's gradient sum, with torch's deterministic kernels (None in the default mode)."""
    if not cfg.deterministic:
        return None
    if cfg.sequence_packing:
        raise ValueError("--deterministic runs one trajectory per microbatch: --sequence-packing is refused")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS reproducibility (before its first use)
    torch.use_deterministic_algorithms(True)
    return CanonicalSum(router, pool, residency)


def _check_group_rank(st: _Batch, s: Sample) -> None:
    """Deterministic mode: a group's trajectories share one DP rank (``DataParallelAssigner(dp, group_order=...)``);
    an arrival-order assignment would make each rank's partial sum depend on the order."""
    r = st.group_rank.setdefault(s.group_id, s.dp_rank)
    if r != s.dp_rank:
        raise ValueError(f"--deterministic: trajectory {s.traj_id} is on DP rank {s.dp_rank} but its group "
                         f"{s.group_id} is on rank {r}: assign DP ranks by group (DataParallelAssigner group_order)")


def shape_for(samples: list[Sample]) -> tuple[dict[str, int], BatchShape]:
    """Group sizes and batch constants of a list of samples (a full step: tests, benchmarks). L_max (``max_len``)
    is the batch's most action tokens, which bounds every T_i as seq-mean-token-sum-norm needs; a live run uses
    its budget ``RLConfig.max_action_tokens`` instead (``runtime.grpo.batch_shape``)."""
    sizes: dict[str, int] = {}
    for s in samples:
        sizes[s.group_id] = s.group_size
    max_len = max(s.num_action_tokens for s in samples)
    return sizes, BatchShape(num_sequences=len(samples), max_len=max_len)
