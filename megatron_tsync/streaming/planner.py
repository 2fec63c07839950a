"""Step planner: decides, for every trajectory as its reward lands, where its gradient goes and when.

Bookkeeping — no model tensors, no Megatron (rewards go to the advantage estimator as small float64 CPU tensors,
one entry per trajectory). The executor (``megatron_tsync.training.stream_fb``) runs the
:class:`WorkItem` s it emits through Megatron's schedules and calls back into :class:`GroupBuckets` at
backward time. The three modes of one trainer:

- ``sync``: nothing runs before the barrier; then every trajectory goes straight into the accumulator with its
  advantage from the batch reference ``estimator.advantages`` (the baseline).
- ``stream-group``: a group's trajectories run when the group's last reward lands (per-group streaming, what
  the best existing systems do).
- ``stream-trajectory``: a trajectory runs the moment its reward lands (with ``wait_for_variance``, below: once its
  group's rewards differ). While its group is incomplete its
  reward-free surrogate is backpropagated into the group's bucket (P, Q, ρ) (design note §1); when every other
  reward of the group is known its advantage is final and it goes straight into the accumulator (no bucket).
  Trajectories whose clip mask depends on an unknown sign are deferred to group close (§3).

Groups close (bucket folded into the accumulator with two scalars) when all their rewards are known and their
bucket items have run; with an estimator that needs batch statistics, at the barrier. A cap on open groups
degrades the overflow to per-group streaming.

``skip_zero_advantage`` (``--skip-zero-advantage``, the default): a trajectory whose advantage is exactly 0 (every
member of an all-equal group under GRPO-style estimators) contributes an exactly zero policy gradient at any ratio
(every policy loss is A times a finite factor), so it gets no work item when no KL/entropy term needs it (counted in
``stats["skipped_zero_advantage"]``; its tokens still count in the denominators, which the learner takes from every
landed trajectory). In stream-trajectory a group that turns out zero-variance after some of its trajectories ran into
its bucket closes with α = 0 and c = 0 (the exact fold: every A_i is 0), instead of α = 1/ε times a cancelling sum;
that bucket work is reported as wasted (``stats["wasted_bucket_items"]``). Off in deterministic mode.

``wait_for_variance`` (``--stream-wait-for-variance``, the default; only with ``skip_zero_advantage``): in
stream-trajectory a trajectory whose group's known rewards are so far all equal waits (``stats["waited_for_variance"]``)
until a reward of the group differs: until then every advantage of the group may still turn out exactly 0. When one
differs, the waiting trajectories go to the bucket together (one destination: they share microbatches); when the group
completes all-equal, they are skipped like in sync. So no bucket work is ever wasted, at the price of starting a group's
work at its first differing reward instead of its first reward.

``deterministic`` (``--deterministic``, the bitwise mode of ``streaming/canonical.py``): every statistic is computed
from the rewards in canonical order (groups in batch order, trajectories by ``canonical_key``), the advantage of
every trajectory comes from the affine coefficients in every mode (sync included), and a trajectory's reward-free
surrogate uses sign +1 when its ratios are sign-free, else the exact sign of r_i − m_g (rational arithmetic, known at
group close): a trajectory whose clip mask depends on the sign is deferred to its group's close instead of being
streamed with a sign the rule 2 certainty gives (which could disagree with sync when A_i rounds to ±0).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable

from fractions import Fraction

import torch

from megatron_tsync.algorithms.streamability import RewardSpec, decide
from megatron_tsync.streaming.canonical import canonical_key

MODES = ("sync", "stream-group", "stream-trajectory")


class Dest(enum.Enum):
    ACCUM = "accum"
    BUCKET = "bucket"


@dataclasses.dataclass(frozen=True)
class TrajMeta:
    """What the planner needs to know about a trajectory (its tensors stay with the executor)."""

    traj_id: str
    group_id: str
    reward: float
    num_action_tokens: int
    dp_rank: int = 0  # the data-parallel rank that runs its backward


@dataclasses.dataclass(frozen=True)
class WorkItem:
    """One forward/backward of one trajectory.

    ``advantage`` set: loss uses the reference policy loss with this advantage, routed to the accumulator.
    ``advantage`` None: the surrogate with ``adv_sign`` is routed to the group's bucket; at backward time the
    executor calls ``GroupBuckets.enter(group_id, reward)`` first.
    ``aux``: include the KL / entropy terms in this pass (they always go to the accumulator).
    ``policy``: include the policy-gradient term.
    """

    traj_id: str
    group_id: str
    reward: float
    dest: Dest
    advantage: float | None = None
    adv_sign: int | None = None
    policy: bool = True
    aux: bool = False
    may_defer: bool = False  # the executor may still defer it after its forward (ratio outside the band)


@dataclasses.dataclass(frozen=True)
class CloseOp:
    """Fold a group's bucket into the accumulator: accum += α·P + q_coefficient(ρ)·Q."""

    group_id: str
    alpha: float
    q_coefficient: Callable[[float], float]  # origin ρ -> α·ρ + β, computed without cancellation


@dataclasses.dataclass
class _Group:
    size: int
    rewards: dict[str, float] = dataclasses.field(default_factory=dict)
    local_pending: list[TrajMeta] = dataclasses.field(default_factory=list)  # held (sync / group / overflow)
    deferred: list[tuple[TrajMeta, bool]] = dataclasses.field(default_factory=list)  # (meta, needs aux pass)
    equal_held: list[TrajMeta] = dataclasses.field(default_factory=list)  # waiting for the rewards to differ
    bucket_items: int = 0
    bucket_open: bool = False
    closed: bool = False
    overflow: bool = False


class StepPlanner:
    """Plans one optimizer step (one batch of groups) for this rank.

    Args:
        estimator: advantage estimator (``algorithms.advantages``).
        group_sizes: group_id -> G for every group of the batch.
        mode: one of :data:`MODES`.
        reward_spec, loss_kind: inputs of the exact clip rule.
        aux_strategy: how KL / entropy loss terms are trained when the trajectory goes to a bucket:
            ``"none"`` (no such terms), ``"second-backward"`` (a separate pass into the accumulator) or
            ``"defer"`` (the whole trajectory waits for group close).
        max_open_groups: cap on groups holding buckets (None = unlimited); overflow groups stream per group.
        ratio_known_before_backward: the executor can test rule 1 (ratios in band) after the forward and defer
            (single pipeline stage). With pipeline parallelism it cannot, and the planner decides from rewards
            only unless ``ratio_is_one`` (first minibatch with trainer old log-probs: ratio ≡ 1, always in band).
        dp_rank: this rank's data-parallel index; only trajectories assigned to it produce work here.
    """

    def __init__(
        self,
        estimator,
        group_sizes: dict[str, int],
        *,
        mode: str,
        reward_spec: RewardSpec,
        loss_kind: str,
        aux_strategy: str = "none",
        max_open_groups: int | None = None,
        ratio_is_one: bool = True,
        ratio_known_before_backward: bool = True,
        dp_rank: int = 0,
        deterministic: bool = False,
        skip_zero_advantage: bool = False,
        wait_for_variance: bool = True,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if aux_strategy not in ("none", "second-backward", "defer"):
            raise ValueError(f"aux_strategy {aux_strategy!r}")
        self.est = estimator
        self.mode = mode
        self.spec = reward_spec
        self.loss_kind = loss_kind
        self.aux_strategy = aux_strategy
        self.max_open_groups = max_open_groups
        self.ratio_is_one = ratio_is_one
        self.ratio_known_before_backward = ratio_known_before_backward
        self.dp_rank = dp_rank
        self.deterministic = deterministic
        self.skip_zero = skip_zero_advantage and not deterministic and aux_strategy == "none"
        self.wait_for_variance = self.skip_zero and wait_for_variance and mode == "stream-trajectory"
        self.groups = {g: _Group(size=n) for g, n in group_sizes.items()}
        self.batch_coupled = bool(getattr(estimator, "needs_batch_rewards", False))
        self.open_groups = 0
        self.stats = {"direct": 0, "bucketed": 0, "deferred": 0, "second_backward": 0, "overflow_groups": 0,
                      "skipped_zero_advantage": 0, "wasted_bucket_items": 0, "waited_for_variance": 0, "redirected": 0}

    # ---------------------------------------------------------------- arrivals
    def on_ready(self, t: TrajMeta) -> list[WorkItem]:
        """A trajectory's reward has landed (anywhere in DP). Returns the work this rank can do now."""
        return self.on_ready_batch([t])

    def on_ready_batch(self, ts: list[TrajMeta]) -> list[WorkItem]:
        """Several rewards landed together: record them all first, then plan, so that a group completed by this
        batch sends every one of its trajectories straight to the accumulator instead of through a bucket (when
        everything arrives at once, stream-trajectory degenerates to sync with no bucket traffic)."""
        for t in ts:
            g = self._group(t.group_id)
            if t.traj_id in g.rewards:
                raise ValueError(f"trajectory {t.traj_id!r} of group {t.group_id!r} arrived twice")
            if len(g.rewards) >= g.size:
                raise ValueError(f"group {t.group_id!r} already has its {g.size} trajectories; {t.traj_id!r} is extra")
            self.spec.check(t.reward)
            g.rewards[t.traj_id] = float(t.reward)
        items: list[WorkItem] = []
        touched: dict[str, None] = {}
        for t in ts:
            g = self.groups[t.group_id]
            local = t.dp_rank == self.dp_rank
            complete = len(g.rewards) == g.size
            if self.mode == "sync" or self.mode == "stream-group" or g.overflow:
                if local:
                    g.local_pending.append(t)
                touched[t.group_id] = None
                continue
            # stream-trajectory
            if self.wait_for_variance:
                if local:
                    g.equal_held.append(t)
                items.extend(self._release_if_varied(g))
                if local and g.equal_held and g.equal_held[-1] is t:  # it waits (counted once: it arrives once)
                    self.stats["waited_for_variance"] += 1
                continue
            if not local:
                continue
            if complete and not self.batch_coupled:
                items.extend(self._directs([t], g))
            else:
                items.extend(self._stream(t, g))
        if self.mode != "sync" and not self.batch_coupled:
            for gid in touched:  # per-group streaming (mode or overflow): release completed groups whole
                g = self.groups[gid]
                if (self.mode == "stream-group" or g.overflow) and len(g.rewards) == g.size and not g.closed:
                    items.extend(self._release_group(gid))
        # priority: work whose advantage is known first; bucket work (wasted if its group turns out zero-variance)
        # after it. Stable, so each group's items keep their arrival order.
        items.sort(key=lambda it: it.dest is Dest.BUCKET)
        return items

    def _release_if_varied(self, g: _Group) -> list[WorkItem]:
        """``wait_for_variance``: the group's waiting trajectories once its advantages can no longer all be 0 (its
        known rewards differ), straight to the accumulator if the group is complete; none while they may still be."""
        if not g.equal_held or g.closed:
            return []
        if len(g.rewards) == g.size and not self.batch_coupled:  # advantages known (all 0: skipped)
            out = self._directs(g.equal_held, g)
        elif self._may_turn_zero(g):
            return []
        else:
            out = [it for t in g.equal_held for it in self._stream(t, g)]
        g.equal_held = []
        return out

    def _may_turn_zero(self, g: _Group) -> bool:
        """Every known reward of the group is equal, and a group all of that reward has every advantage exactly 0
        under this estimator (asked of the estimator, with the batch's known rewards when it needs them)."""
        vals = set(g.rewards.values())
        if len(vals) != 1:
            return False
        rewards = torch.full((g.size,), vals.pop(), dtype=torch.float64)
        batch = self._batch_rewards()
        coeffs = self.est.coefficients(rewards, batch_rewards=None if batch is None else torch.cat([batch, rewards]))
        return coeffs.advantage(float(rewards[0])) == 0.0

    def _stream(self, t: TrajMeta, g: _Group) -> list[WorkItem]:
        if not g.bucket_open:
            if self.max_open_groups is not None and self.open_groups >= self.max_open_groups:
                g.overflow = True
                self.stats["overflow_groups"] += 1
                g.local_pending.append(t)
                return []
            g.bucket_open = True
            self.open_groups += 1
        in_band = self.ratio_is_one or self.loss_kind == "none"
        if self.deterministic and not in_band:  # no rule-2 sign: sign-free now (executor) or the exact sign at close
            return self._stream_or_defer(t, g)
        d = decide(
            ratio_in_band=in_band,
            reward=t.reward,
            known_rewards=list(g.rewards.values()),
            group_size=g.size,
            spec=self.spec,
            loss_kind=self.loss_kind,
        )
        may_defer = False
        if not d.stream:
            if self.ratio_known_before_backward:
                # rule 1 may still hold once the executor has the ratios; it defers if not
                may_defer = True
                sign = None
            else:
                g.deferred.append((t, True))
                self.stats["deferred"] += 1
                return []
        else:
            sign = d.adv_sign
        if self.aux_strategy == "defer":
            g.deferred.append((t, True))
            self.stats["deferred"] += 1
            return []
        return self._bucket(t, g, sign, may_defer)

    def _stream_or_defer(self, t: TrajMeta, g: _Group) -> list[WorkItem]:
        """Deterministic mode, ratio ≠ 1: stream only if the executor finds the ratios sign-free (single stage), else
        wait for the group's close."""
        if not self.ratio_known_before_backward or self.aux_strategy == "defer":
            g.deferred.append((t, True))
            self.stats["deferred"] += 1
            return []
        return self._bucket(t, g, None, True)

    def _bucket(self, t: TrajMeta, g: _Group, sign, may_defer: bool) -> list[WorkItem]:
        """Stream ``t`` into its group's bucket (and its aux terms by a second backward into the accumulator)."""
        g.bucket_items += 1
        self.stats["bucketed"] += 1
        items = [WorkItem(t.traj_id, t.group_id, t.reward, Dest.BUCKET, adv_sign=sign, may_defer=may_defer)]
        if self.aux_strategy == "second-backward":
            self.stats["second_backward"] += 1
            items.append(WorkItem(t.traj_id, t.group_id, t.reward, Dest.ACCUM, policy=False, aux=True))
        return items

    def report_deferred(self, item: WorkItem, meta: TrajMeta) -> None:
        """The executor found the item's ratios outside the sign-free band: keep it for group close.

        Its aux pass (second-backward), if any, already ran or is still scheduled, so the close-time pass is
        policy-only in that case.
        """
        g = self._group(item.group_id)
        g.bucket_items -= 1
        self.stats["bucketed"] -= 1
        self.stats["deferred"] += 1
        g.deferred.append((meta, self.aux_strategy != "second-backward"))

    # ---------------------------------------------------------------- closing
    def closable(self) -> tuple[list[CloseOp], list[WorkItem]]:
        """Groups whose rewards are all known: their close ops and their deferred/held work (accumulator)."""
        if self.batch_coupled or self.mode == "sync":
            return [], []
        return self._close_where(lambda g: len(g.rewards) == g.size)

    def finish(self) -> tuple[list[CloseOp], list[WorkItem]]:
        """At the barrier (every reward known): everything still open or held."""
        for gid, g in self.groups.items():
            if len(g.rewards) != g.size:
                raise RuntimeError(f"barrier reached but group {gid!r} has {len(g.rewards)}/{g.size} rewards")
        if self.mode == "sync":
            return [], self._det_sync_items() if self.deterministic else self._sync_items()
        return self._close_where(lambda g: True)

    def _det_sync_items(self) -> list[WorkItem]:
        """Deterministic sync: every trajectory with its advantage from the canonical coefficients (as in every
        mode)."""
        out = []
        for g in self.groups.values():
            out += self._directs(g.local_pending, g)
            g.local_pending = []
            g.closed = True
        return out

    def _sync_items(self) -> list[WorkItem]:
        """The baseline: advantages from the estimator's batch reference (not from its affine coefficients)."""
        ids, rewards, gidx = [], [], []
        for k, g in enumerate(self.groups.values()):
            for tid, r in g.rewards.items():
                ids.append(tid)
                rewards.append(r)
                gidx.append(k)
        a = self.est.advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(gidx, dtype=torch.long))
        adv = dict(zip(ids, a.tolist()))
        out = []
        for g in self.groups.values():
            out += [WorkItem(t.traj_id, t.group_id, t.reward, Dest.ACCUM, advantage=adv[t.traj_id], aux=True)
                    for t in g.local_pending]
            g.local_pending = []
            g.closed = True
        return self._count_direct(out)

    def _close_where(self, pred) -> tuple[list[CloseOp], list[WorkItem]]:
        closes, items = [], []
        for gid, g in self.groups.items():
            if g.closed or not pred(g):
                continue
            g.closed = True
            if g.bucket_open:
                closes.append(self._close_op(gid, g))
                self.open_groups -= 1
            items.extend(self._held_items(gid, g))
        return closes, items

    def close_op(self, gid: str) -> CloseOp:
        """The close op of a closed group whose bucket this rank's planner did not open (expert-parallel lockstep:
        an idle slot of another rank's bucket item fills this rank's bucket of the group, ``training.stream_fb``)."""
        g = self._group(gid)
        if not g.closed:
            raise AssertionError(f"group {gid!r} is not closed")
        return self._close_op(gid, g)

    def _close_op(self, gid: str, g: _Group) -> CloseOp:
        rewards = torch.tensor(self._rewards(g), dtype=torch.float64)
        coeffs = self.est.coefficients(rewards, batch_rewards=self._batch_rewards())
        zero = self.skip_zero and self.alpha_known(g.size) is None
        if zero and all(coeffs.advantage(r) == 0.0 for r in g.rewards.values()):
            self.stats["wasted_bucket_items"] += g.bucket_items  # every A_i = 0: the exact fold adds nothing
            return CloseOp(gid, 0.0, lambda origin: 0.0)
        return CloseOp(gid, coeffs.alpha, lambda origin: self.est.close_coefficient(coeffs, origin, rewards))

    def alpha_known(self, group_size: int) -> float | None:
        if self.batch_coupled:
            return None
        return self.est.alpha_known_in_advance(group_size)

    def _held_items(self, gid: str, g: _Group) -> list[WorkItem]:
        out = self._count_direct([self._direct(t, g) for t in g.local_pending + g.equal_held]
                                 + [self._direct(t, g, aux=needs_aux) for t, needs_aux in g.deferred])
        g.local_pending, g.deferred, g.equal_held = [], [], []
        return out

    def _release_group(self, gid: str) -> list[WorkItem]:
        g = self.groups[gid]
        g.closed = True
        items = self._directs(g.local_pending, g)
        g.local_pending = []
        return items

    def _directs(self, ts: list[TrajMeta], g: _Group) -> list[WorkItem]:
        return self._count_direct([self._direct(t, g) for t in ts])

    def _count_direct(self, items: list[WorkItem]) -> list[WorkItem]:
        """Count accumulator items; drop those of advantage exactly 0 when skipping (module docstring)."""
        if self.skip_zero:
            kept = [it for it in items if not (it.policy and it.advantage == 0.0)]
            self.stats["skipped_zero_advantage"] += len(items) - len(kept)
            items = kept
        self.stats["direct"] += len(items)
        return items

    def _direct(self, t: TrajMeta, g: _Group, aux: bool = True) -> WorkItem:
        return self._accum_item(t.traj_id, t.group_id, t.reward, g, aux)

    def _accum_item(self, traj_id: str, group_id: str, reward: float, g: _Group, aux: bool) -> WorkItem:
        rewards = torch.tensor(self._rewards(g), dtype=torch.float64)
        coeffs = self.est.coefficients(rewards, batch_rewards=self._batch_rewards())
        a = coeffs.advantage(reward)
        sign = exact_sign(reward, g.rewards.values()) if self.deterministic else None
        return WorkItem(traj_id, group_id, reward, Dest.ACCUM, advantage=a, adv_sign=sign, aux=aux)

    def redirect(self, item: WorkItem) -> list[WorkItem]:
        """A bucket item that has not run yet, of a group whose close op was issued (every reward known): the
        accumulator item it is now, its advantage known — [] when skip-zero drops it. The group's bucket can then
        fold without it (``StreamExecutor`` with ``full_microbatches``: an item waiting for a fuller microbatch)."""
        g = self._group(item.group_id)
        if item.dest is not Dest.BUCKET or not item.policy or item.aux or not g.closed:
            raise AssertionError(f"redirect: {item} is not a bucket item of a closed group")
        g.bucket_items -= 1
        self.stats["bucketed"] -= 1
        self.stats["redirected"] += 1
        return self._count_direct([self._accum_item(item.traj_id, item.group_id, item.reward, g, aux=False)])

    def _rewards(self, g: _Group) -> list[float]:
        """The group's rewards: arrival order, or canonical order in deterministic mode."""
        if not self.deterministic:
            return list(g.rewards.values())
        return [g.rewards[tid] for tid in sorted(g.rewards, key=canonical_key)]

    def _batch_rewards(self):
        if not self.batch_coupled:
            return None
        vals = [r for g in self.groups.values() for r in self._rewards(g)]
        return torch.tensor(vals, dtype=torch.float64)

    def queued_groups(self) -> list[str]:
        """Open groups with landed trajectories of this rank that the planner still holds (waiting for variance, for
        their group, or deferred): their buckets will be written again (bucket residency keeps them on the device)."""
        return [gid for gid, g in self.groups.items()
                if not g.closed and (g.local_pending or g.deferred or g.equal_held)]

    # ---------------------------------------------------------------- deterministic mode
    def closed_groups(self) -> list[str]:
        """Groups whose work has all been released (their held items run before the caller folds them)."""
        return [gid for gid, g in self.groups.items() if g.closed]

    def final_groups(self) -> list[str]:
        """Groups whose advantages are final: complete (and, with batch statistics, every group complete)."""
        done = [gid for gid, g in self.groups.items() if len(g.rewards) == g.size]
        return done if not self.batch_coupled or len(done) == len(self.groups) else []

    def canonical_advantages(self, group_id: str) -> dict[str, float]:
        """traj_id -> A_i of a complete group, from its rewards in canonical order (deterministic mode)."""
        g = self._group(group_id)
        if len(g.rewards) != g.size:
            raise AssertionError(f"group {group_id!r} is not complete ({len(g.rewards)}/{g.size})")
        rewards = torch.tensor(self._rewards(g), dtype=torch.float64)
        coeffs = self.est.coefficients(rewards, batch_rewards=self._batch_rewards())
        return {tid: coeffs.advantage(r) for tid, r in g.rewards.items()}

    def _group(self, gid: str) -> _Group:
        try:
            return self.groups[gid]
        except KeyError:
            raise ValueError(f"trajectory of unknown group {gid!r} (not in this step's batch)") from None


def exact_sign(reward: float, group_rewards) -> int:
    """sign(r − mean(group)) in exact rational arithmetic (+1 for 0: with A = 0 every sign gives the same zero)."""
    rs = [Fraction(float(r)) for r in group_rewards]
    d = Fraction(float(reward)) * len(rs) - sum(rs)
    return -1 if d < 0 else 1
