"""One optimizer step of the learner: consume ready trajectories, close groups, barrier, step.

The same code runs the three modes (``sync``, ``stream-group``, ``stream-trajectory``); only the planner's
decisions differ. The barrier is: fold what is still open, one DP reduction (``finalize_model_grads``),
divide by the explicit denominator, optional gradient dump, clip + optimizer step (megatron's optimizer).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from megatron_tsync.algorithms.advantages import get_advantage_estimator
from megatron_tsync.algorithms.aggregation import barrier_divisor
from megatron_tsync.algorithms.streamability import RewardSpec, describe_config
from megatron_tsync.streaming.accumulator import GroupBuckets
from megatron_tsync.streaming.buckets import BucketPool, GradRouter
from megatron_tsync.streaming.offload import Residency
from megatron_tsync.streaming.planner import StepPlanner, TrajMeta
from megatron_tsync.streaming.ready_queue import ArrivalSource, Sample
from megatron_tsync.training.old_logprobs import Theta0Logprobs
from megatron_tsync.training.optimizer import finalize_and_scale
from megatron_tsync.training.stream_fb import BatchShape, LossConfig, StreamExecutor

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
    max_device_buckets: int | None = None  # bucket vectors kept on the accelerator; idle ones beyond go to host memory
    poll_timeout_s: float = 0.05
    num_minibatches: int = 1  # optimizer steps per batch, minibatches fixed by group index (design note §5)
    epochs: int = 1  # passes over the batch; epochs after the first are synchronous
    sequence_packing: bool = False  # several trajectories per microbatch when their gradient destination agrees
    max_packed_tokens: int = 4096  # tokens per packed microbatch at most (with sequence_packing)


@dataclasses.dataclass
class StepResult:
    step_s: float
    busy_s: float
    idle_frac: float
    grad_norm: float | None
    update_ok: bool
    num_trajectories: int
    num_action_tokens: int
    microbatches: int
    loss_sum: float
    peak_bucket_vectors: int
    peak_bucket_bytes: int
    planner_stats: dict
    busy_intervals: list  # (start, end) seconds since step start
    last_arrival_s: float
    work_after_last_arrival_s: float
    offload: dict | None = None  # host offload of bucket vectors (--max-device-buckets): peaks and moves


class Learner:
    def __init__(self, ddp_model, optimizer, cfg: LearnerConfig, *, dp_rank: int = 0, pp_size: int = 1):
        self.model = ddp_model
        self.opt = optimizer
        self.cfg = cfg
        self.dp_rank = dp_rank
        self.pp_size = pp_size
        self.estimator = get_advantage_estimator(cfg.estimator, eps=cfg.estimator_eps)
        self.router = GradRouter(ddp_model)
        self.pool = BucketPool(self.router.accumulator, keep_free=cfg.max_device_buckets is None)
        residency = None if cfg.max_device_buckets is None else Residency(self.router, cfg.max_device_buckets)
        self.buckets = GroupBuckets(self.router, self.pool, residency)
        self.exec = StreamExecutor(ddp_model, self.buckets, cfg.loss,
                                   max_packed_tokens=cfg.max_packed_tokens if cfg.sequence_packing else None)
        self.theta0 = Theta0Logprobs(ddp_model, cfg.loss.temperature)
        self._described = False
        self.grad_hook = None  # callable(ddp_model) run after normalisation, before clipping (--dump-grads)
        self.sync_order: list[str] | None = None  # sync mode: microbatch order (permutation control)

    def _describe_once(self):
        if self._described:
            return
        self._described = True
        lc = self.cfg.loss
        kl_mode = {"none": "none", "loss": "loss", "reward": "in_reward"}[lc.kl_mode if lc.kl_coef else "none"]
        strategy = {"second-backward": "second_backward", "defer": "defer_to_close"}[self.cfg.aux_strategy]
        msg = describe_config(lc.policy, self.cfg.reward_spec, kl_mode, lc.entropy_coef, aux_strategy=strategy)
        log.warning("streamability: %s", msg) if self.cfg.mode == "stream-trajectory" else log.info("%s", msg)

    def _planner(self, sizes: dict[str, int], mode: str, lc: LossConfig) -> StepPlanner:
        cfg = self.cfg
        return StepPlanner(
            self.estimator,
            sizes,
            mode=mode,
            reward_spec=cfg.reward_spec,
            loss_kind=lc.policy.kind,
            aux_strategy=cfg.aux_strategy if lc.has_aux else "none",
            max_open_groups=cfg.max_open_groups,
            ratio_is_one=lc.old_logprobs == "trainer",
            ratio_known_before_backward=self.pp_size == 1,
            dp_rank=self.dp_rank,
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
        """
        self._describe_once()
        cfg = self.cfg
        M, E = cfg.num_minibatches, cfg.epochs
        gids = list(group_sizes)
        if M < 1 or E < 1 or M > len(gids):  # (flags: --num-minibatches, --ppo-epochs)
            raise ValueError(f"num_minibatches={M} / epochs={E}: need 1 ≤ minibatches ≤ groups ({len(gids)}), epochs ≥ 1")
        mb_of = {g: i % M for i, g in enumerate(gids)}
        theta0 = (M > 1 or E > 1) and cfg.loss.old_logprobs == "trainer"
        later_lc = dataclasses.replace(cfg.loss, old_logprobs="theta0" if theta0 else "engine")
        self.theta0.begin_batch()
        self.exec.keep_theta0 = theta0
        first_step = True
        expected = [sum(n for g, n in group_sizes.items() if mb_of[g] == j) for j in range(M)]
        buffered: list[list[Sample]] = [[] for _ in range(M)]
        seen: list[list[Sample]] = [[] for _ in range(M)]
        self.exec.begin_step(None, BatchShape(shape.num_sequences, shape.max_len))
        self.pool.reset_peak()
        t_start = time.perf_counter()
        last_arrival = t_start
        n_tok_all = 0
        stats: dict[str, int] = {}
        barrier_busy, gnorm, ok = [], None, True
        for e in range(E):
            for j in range(M):
                sizes = {g: group_sizes[g] for g in gids if mb_of[g] == j}
                lc = cfg.loss if (e == 0 and j == 0) else later_lc
                mode = cfg.mode if e == 0 else "sync"
                planner = self._planner(sizes, mode, lc)
                self.exec.begin_phase(planner, BatchShape(expected[j] if M > 1 else shape.num_sequences,
                                                          shape.max_len), lc)
                feed = seen[j] if e > 0 else buffered[j]
                buffered[j] = []
                while True:
                    self._feed(planner, feed)
                    if e > 0 or len(seen[j]) >= expected[j]:
                        break
                    if source.exhausted():
                        raise RuntimeError(f"step ended with {sum(map(len, seen))} trajectories, expected "
                                           f"{sum(expected)} (minibatch {j} has {len(seen[j])}/{expected[j]})")
                    feed = []
                    landed = source.poll(cfg.poll_timeout_s)
                    for s_ in landed:
                        last_arrival = time.perf_counter()
                        self.exec.add_sample(s_)
                        n_tok_all += s_.num_action_tokens
                        k = mb_of.get(s_.group_id)
                        if k is None:
                            raise ValueError(f"trajectory {s_.traj_id} of group {s_.group_id!r}: not in this batch")
                        seen[k].append(s_)
                        (feed if k == j else buffered[k]).append(s_)
                    if theta0:  # π_θ0 on arrival for everything outside minibatch 1 (its own forward keeps it)
                        self.theta0.score([s_ for s_ in landed if mb_of[s_.group_id] > 0 and s_.dp_rank == self.dp_rank])
                closes, held = planner.finish()
                if mode == "sync" and self.sync_order is not None:
                    rank = {tid: i for i, tid in enumerate(self.sync_order)}
                    held.sort(key=lambda it: rank[it.traj_id])
                self.exec.run(held)
                self.exec.close(closes)
                if self.buckets.open_groups:
                    raise AssertionError(f"{self.buckets.open_groups} buckets still open at the barrier")
                for k_, v in planner.stats.items():
                    stats[k_] = stats.get(k_, 0) + v
                # ---- barrier: one DP reduction, explicit denominator, clip, step
                t_b = time.perf_counter()
                if theta0 and first_step:
                    self.exec.keep_theta0 = False
                    self.theta0.before_first_step(all_scored=sum(map(len, seen)) == sum(expected))
                first_step = False
                n_tok = sum(s_.num_action_tokens for s_ in seen[j])
                self.last_divisor = barrier_divisor(lc.aggregation, n_tok)
                finalize_and_scale(self.model, self.last_divisor)
                if self.grad_hook is not None:
                    self.grad_hook(self.model)
                ok_j, gnorm, _ = self.opt.step()
                ok = ok and bool(ok_j)
                self.model.zero_grad_buffer()
                self.opt.zero_grad()
                barrier_busy.append((t_b, time.perf_counter()))
        self.theta0.end_batch()
        t_end = time.perf_counter()
        busy = [(a - t_start, b - t_start) for a, b in self.exec.busy + self.theta0.busy + barrier_busy]
        busy_s = sum(b - a for a, b in busy)
        step_s = t_end - t_start
        la = last_arrival - t_start
        return StepResult(
            step_s=step_s,
            busy_s=busy_s,
            idle_frac=max(0.0, 1.0 - busy_s / step_s) if step_s > 0 else 0.0,
            grad_norm=None if gnorm is None else float(gnorm),
            update_ok=ok,
            num_trajectories=sum(map(len, seen)),
            num_action_tokens=n_tok_all,
            microbatches=self.exec.microbatches,
            loss_sum=sum(self.exec.losses),
            peak_bucket_vectors=self.pool.stats.peak_in_use,
            peak_bucket_bytes=self.pool.stats.peak_bytes,
            planner_stats=stats,
            busy_intervals=busy,
            last_arrival_s=la,
            work_after_last_arrival_s=step_s - la,
            offload=None if self.buckets.residency is None else dataclasses.asdict(self.buckets.residency.stats),
        )

    def _feed(self, planner: StepPlanner, samples: list[Sample]) -> None:
        """Hand landed trajectories to the planner; run what it releases and what group closes release."""
        if samples:
            items = planner.on_ready_batch(
                [TrajMeta(s.traj_id, s.group_id, s.reward, s.num_action_tokens, s.dp_rank) for s in samples])
            self.exec.run(items)
        closes, held = planner.closable()
        self.exec.run(held)
        self.exec.close(closes)


def shape_for(samples: list[Sample]) -> tuple[dict[str, int], BatchShape]:
    """Group sizes and batch constants of a list of samples (a full step)."""
    sizes: dict[str, int] = {}
    for s in samples:
        sizes[s.group_id] = s.group_size
    max_len = max(s.num_action_tokens for s in samples)
    return sizes, BatchShape(num_sequences=len(samples), max_len=max_len)
