"""GRPO (and every group-affine estimator) in the one training loop: the learner, its event source per step, its log
row.

Per step ``k`` (zero staleness): the loop publishes weights version ``k`` → workers roll out step ``k`` with them and
stream trajectory events → :class:`~megatron_tsync.training.learner.Learner` consumes them as they land
(``--rl-mode``) → barrier and optimizer step → version ``k + 1``. ``async`` mode lets workers run up to
``--max-staleness`` versions ahead and trains each batch synchronously with engine log-probs as π_old and truncated
importance sampling (the off-policy baseline users would otherwise pick).
"""

from __future__ import annotations

import dataclasses
import random

import torch.distributed as dist

from megatron_tsync.config import reward_spec_conflict
from megatron_tsync.runtime.context import RunContext, grad_norm_text, progress_bar, skipped_text
from megatron_tsync.runtime.harness import HARNESS_TB_NAMES, harness_row
from megatron_tsync.runtime.fleet import LEDGER_TB_NAMES, RolloutFleet, TransportSource, ledger_row
from megatron_tsync.runtime.rollout_io import grad_dump_hook, load_rollouts
from megatron_tsync.runtime.spec import StepOutcome, TrainSpec
from megatron_tsync.runtime.validation import REJECTION_TB_NAMES, rejection_row
from megatron_tsync.streaming.host_accum import HOST_TB_NAMES
from megatron_tsync.streaming.offload import TB_NAMES as RESIDENCY_TB_NAMES
from megatron_tsync.streaming.ready_queue import CoalescingSource, DataParallelAssigner, ListSource, Sample
from megatron_tsync.training.learner import Learner, LearnerConfig
from megatron_tsync.training.reference import KL_SUM
from megatron_tsync.training.stream_fb import BatchShape
from megatron_tsync.transport.ids import group_ids

TB_NAMES = {"reward": "rollout/reward", "success_rate": "rollout/success_rate", "loss": "train/loss",
            "loss_surrogate": "train/loss_surrogate",
            "grad_norm": "train/grad_norm", "step_time_s": "perf/step_time_s", "idle_frac": "perf/learner_idle_frac",
            "open_groups_peak_vectors": "stream/bucket_vectors_peak", "bucket_peak_bytes": "stream/bucket_bytes_peak",
            "events_rejected": "transport/events_rejected", "staleness": "rollout/staleness",
            "kl_sum_mean": "train/kl_sum_mean"}
TB_NAMES |= REJECTION_TB_NAMES  # transport/rejected_<reason>
TB_NAMES |= HARNESS_TB_NAMES  # rollout/harness_<reason>: failed harness episodes (--harness-cmd / --harness-fn)
TB_NAMES |= {f"offload_{k}": tag for k, tag in RESIDENCY_TB_NAMES.items()}  # stream/*: bucket residency
TB_NAMES |= {f"offload_{k}": tag for k, tag in HOST_TB_NAMES.items()}  # ... and host accumulation


def learner_config(cfg, task) -> LearnerConfig:
    """The learner's section; ``async`` trains each batch synchronously on engine log-probs (the learner itself
    knows no async mode). Its reward spec is ``--reward-kind/--reward-range`` (default: what the verifier declares),
    checked against what the task declares (``config.reward_spec_conflict``: it may assume less, never more)."""
    lc = cfg.learner
    conflict = reward_spec_conflict(lc.reward_spec, task.reward_spec, f"task {task.name} (verifier {task.verifier})")
    if conflict is not None:
        raise ValueError(conflict.replace("learner.reward_spec", "--reward-kind/--reward-range", 1))
    mode, loss = lc.mode, lc.loss
    if mode == "async":
        mode = "sync"
        loss = dataclasses.replace(loss, old_logprobs="engine")
    return dataclasses.replace(lc, mode=mode, loss=loss)


def coalesced(source, lc: LearnerConfig):
    """Rank 0's arrival source with ``--stream-coalesce-ms`` / ``--stream-coalesce-tokens`` applied (streaming modes;
    ``sync`` waits for the whole batch anyway)."""
    if source is None or lc.mode not in ("stream-group", "stream-trajectory") or not (lc.coalesce_ms or
                                                                                   lc.coalesce_tokens):
        return source
    return CoalescingSource(source, lc.coalesce_ms / 1000.0, lc.coalesce_tokens)


def batch_shape(cfg, sizes: dict[str, int]) -> BatchShape:
    """The step's normaliser constants: B = trajectories of the step (every DP rank), L_max =
    ``cfg.rl.max_action_tokens`` (seq-mean-token-sum-norm's constant: the action-token budget of a trajectory)."""
    return BatchShape(num_sequences=sum(sizes.values()), max_len=cfg.rl.max_action_tokens)


def resolved_dp_assignment(cfg) -> str:
    """``--dp-assignment auto``: ``spill`` (group affinity that spills a member to the least-loaded rank when its
    group's rank runs ahead) for GRPO stream-trajectory, whose open groups hold bucket vectors on every rank that
    trains one of their members: in the planner it keeps arrival order's step (paper setting 712.3 -> 709.8 s
    Qwen3.5-27B, 744.4 -> 712.8 s GLM-4.7-Flash; swe-like DP 2 / 4 within 0.7 %) at 40-45 % fewer open groups per
    rank there (24 -> 14, 22 -> 12), where ``group`` / ``balanced`` cost 13-33 % of the step (docs/streaming.md).
    Otherwise ``arrival``: sync, stream-group and OPD hold no bucket vector, so affinity would save nothing. Exact
    either way: the DP all-reduce sums the same per-trajectory terms."""
    how = cfg.learner.dp_assignment
    if how != "auto":
        return how
    return "spill" if cfg.rl.algorithm != "opd" and cfg.learner.mode == "stream-trajectory" else "arrival"


def dp_assigner(cfg, dp: int, group_order: list[str], trajectories: int = 0) -> DataParallelAssigner:
    """Who trains which trajectory (``DataParallelAssigner``): by group in batch order with ``--deterministic``, by
    group on the least-loaded rank with ``--dp-assignment group`` (``balanced``: the least predicted work; ``auto``:
    :func:`resolved_dp_assignment`; ``spill``: by group unless the ranks' tokens would drift apart, its threshold
    tapering over the step's ``trajectories``), else round-robin by arrival."""
    how = resolved_dp_assignment(cfg)
    return DataParallelAssigner(dp, group_order if cfg.learner.deterministic else None,
                                by_group=how in ("group", "balanced", "spill"), balanced=how == "balanced",
                                spill=how == "spill", step_trajectories=trajectories)


class BroadcastSource:
    """Several trainer ranks: global rank 0 owns the receiver; every poll it broadcasts the newly landed samples (and
    whether the step is complete) to all ranks, which feed identical inputs to their planners; the DP rank of each
    sample is the :class:`DataParallelAssigner`'s. The broadcast is the trainer's own torch.distributed group (a
    trusted channel between trainer ranks), not a socket exposed to workers."""

    def __init__(self, inner: TransportSource | None, assigner: DataParallelAssigner):
        self.inner = inner
        self.assigner = assigner
        self._done = False
        self.samples: list[Sample] = []

    def poll(self, timeout_s: float) -> list[Sample]:
        obj = [self.inner.poll(timeout_s), self.inner.exhausted()] if dist.get_rank() == 0 else [None, None]
        dist.broadcast_object_list(obj, src=0)
        got, self._done = obj
        self.assigner.assign_samples(got)
        self.samples.extend(got)
        return got

    def exhausted(self) -> bool:
        return self._done


class GRPO:
    """The GRPO algorithm of the loop (``runtime.spec.Algorithm``)."""

    tb_names = TB_NAMES | LEDGER_TB_NAMES  # + the step's trajectory ledger (rollout/ledger_*, worker failures)

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.learner = Learner(ctx.ddp, ctx.opt, learner_config(ctx.cfg, ctx.task),
                               dp_rank=ctx.dims.dp_rank, pp_size=ctx.dims.pp, reference=ctx.reference)

    def _source(self, k: int, fleet: RolloutFleet | None):
        """(arrival source, group sizes in batch order, () -> the step's samples in arrival order)."""
        cfg, dims = self.ctx.cfg, self.ctx.dims
        if cfg.logging.replay_rollouts:
            samples, groups = load_rollouts(cfg.logging.replay_rollouts, k)
            if cfg.logging.replay_shuffle_seed is not None:
                random.Random(cfg.logging.replay_shuffle_seed * 1_000_003 + k).shuffle(samples)
            dp_assigner(cfg, dims.dp, list(groups), len(samples)).assign_samples(samples)
            return ListSource(samples), {g: samples[0].group_size for g in groups}, lambda: samples
        source = fleet.source(k, cfg.rl.seq_length) if fleet is not None else None
        source = coalesced(source, cfg.learner)  # rank 0, before the broadcast
        sizes = {g: cfg.rl.group_size for g in group_ids(k, cfg.rl.groups_per_step)}
        if dims.world_size > 1:
            source = BroadcastSource(source, dp_assigner(cfg, dims.dp, list(sizes), sum(sizes.values())))
        return source, sizes, lambda: source.samples

    def step(self, k: int, fleet: RolloutFleet | None) -> StepOutcome:
        cfg = self.ctx.cfg
        source, sizes, samples_of = self._source(k, fleet)
        if cfg.logging.dump_grads:  # one file per optimizer update (--num-minibatches × --ppo-epochs of them)
            lc = self.learner.cfg
            self.learner.grad_hook = grad_dump_hook(cfg.logging.dump_grads, k, self.learner,
                                                    write=self.ctx.dims.rank == 0, epochs=lc.epochs,
                                                    minibatches=lc.num_minibatches)
        shape = batch_shape(cfg, sizes)
        res = self.learner.train_step(source, sizes, shape)
        return StepOutcome(result=res, samples=samples_of(), group_order=list(sizes))

    def row(self, k: int, out: StepOutcome, fleet: RolloutFleet | None) -> dict:
        res, samples = out.result, out.samples
        rewards = [s.reward for s in samples]
        hi = self.ctx.task.reward_spec.hi
        return {
            "step": k, "reward": sum(rewards) / max(len(rewards), 1),
            "success_rate": sum(1.0 if r >= hi else 0.0 for r in rewards) / max(len(rewards), 1),
            "loss": res.objective, "loss_surrogate": res.loss_sum,  # true objective value / Σ backpropagated terms
            "grad_norm": res.grad_norm, "step_time_s": res.step_s, "idle_frac": res.idle_frac,
            "tail_after_last_arrival_s": res.work_after_last_arrival_s,
            "open_groups_peak_vectors": res.peak_bucket_vectors, "bucket_peak_bytes": res.peak_bucket_bytes,
            **ledger_row(fleet, k),  # used / re-dispatched / dropped trajectories, worker failures, recovery
            "events_rejected": fleet.receiver.rejected if fleet is not None else 0,
            **rejection_row(fleet),  # rejected_<reason>: the run's rejections so far, per reason
            **harness_row(samples, bool(self.ctx.cfg.rollout.harness_cmd or self.ctx.cfg.rollout.harness_fn)),
            "staleness": max((k - s.policy_version) for s in samples) if samples else 0,
            "trajectories": res.num_trajectories, "microbatches": res.microbatches,
            **{f"plan_{a}": b for a, b in res.planner_stats.items()},
            "theta0_forwards": getattr(getattr(self.learner, "theta0", None), "forwards", 0),
            **{f"offload_{a}": b for a, b in (res.offload or {}).items()},
            **_kl_row(self.learner, samples),
            **_speculation_row(samples, self.ctx.cfg.rollout.speculative),
        }

    def line(self, row: dict, done: int, total: int, eta_s: float) -> str:
        bar = progress_bar(done, total) if self.ctx.cfg.logging.progress else f"step {done}"
        return (f"[tsync] {bar} reward {row['reward']:.3f} success {row['success_rate']:.2f} "
                f"step {row['step_time_s']:5.2f}s idle {row['idle_frac']:4.0%} grad-norm {grad_norm_text(row)} "
                f"rejected {row['events_rejected']} failed {row.get('failed', 0)}{skipped_text(row)}{_residency_text(row)} "
                f"ETA {eta_s:5.0f}s")

    def summary(self, h: list[dict]) -> str:
        n = max(1, min(10, len(h) // 3))  # first / last third (≤ 10 steps): one step's batch is noisy

        def mean(key: str, rows: list[dict]) -> float:
            return sum(r[key] for r in rows) / len(rows)

        mode = self.ctx.cfg.learner.mode
        return (f"[tsync] summary: mode {mode}, {len(h)} steps, train success {mean('success_rate', h[:n]):.2f} → "
                f"{mean('success_rate', h[-n:]):.2f}, reward {mean('reward', h[:n]):.3f} → {mean('reward', h[-n:]):.3f} "
                f"(means of the first/last {n} steps), mean step {mean('step_time_s', h):.2f}s, learner idle "
                f"{mean('idle_frac', h):.0%}")


def _residency_text(row: dict) -> str:
    """Bucket residency in the progress line: peak bytes per tier, bytes moved, seconds waited on copies."""
    if "offload_bytes_moved" not in row:
        return ""
    mib = 2 ** 20
    dev, host = row["offload_peak_device_bytes"] / mib, row["offload_peak_host_bytes"] / mib
    moved = row["offload_bytes_moved"] / mib
    add = f" add {row['offload_host_add_s']:.2f}s" if "offload_host_add_s" in row else ""  # --accumulate-on-host
    return f" buckets dev {dev:.0f}/host {host:.0f} MiB moved {moved:.0f} MiB wait {row['offload_wait_s']:.2f}s{add}"


def _speculation_row(samples: list[Sample], on: bool) -> dict:
    """``--speculative-rollouts``: the step's drafted first turns — trajectories that had one, tokens drafted and
    kept (every kept token verified under the step's policy), the kept fraction, and the drafts rejected at some
    token (verification stops at the first rejection: at most one per trajectory)."""
    if not on:
        return {}
    had = [s.meta for s in samples if "spec_drafted" in s.meta]
    drafted, kept = sum(m["spec_drafted"] for m in had), sum(m["spec_kept"] for m in had)
    return {"spec_drafts": len(had), "spec_drafted_tokens": drafted, "spec_kept_tokens": kept,
            "spec_kept_frac": kept / drafted if drafted else None,
            "spec_rejections": sum(1 for m in had if m["spec_kept"] < m["spec_drafted"])}  # ≤ 1 per trajectory


def _kl_row(learner: Learner, samples: list[Sample]) -> dict:
    """Reference forwards of the step and, with --kl-mode reward, the mean Σ_t w_t kl_t at θ0 per trajectory."""
    if learner.reference is None:
        return {}
    sums = [s.meta[KL_SUM] for s in samples if KL_SUM in s.meta]
    return {"ref_forwards": learner.reference.forwards,
            "kl_sum_mean": sum(sums) / len(sums) if sums else None}


GRPO_SPEC = TrainSpec(name="grpo", build=GRPO)
