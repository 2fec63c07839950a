"""What the learner consumes: trajectories whose reward has landed, in arrival order.

A :class:`Sample` is one finished trajectory with its reward (tensors on CPU). An :class:`ArrivalSource`
hands samples to the learner as they become ready; :class:`ListSource` replays a fixed arrival order (tests,
``--replay-rollouts``, the benchmark); the live trainer's sources are in ``runtime/fleet.py`` and
``runtime/sources.py``. :class:`DataParallelAssigner` owns which DP rank trains each trajectory.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Iterable, Protocol

import torch


@dataclasses.dataclass
class Sample:
    """One trajectory ready for training.

    token_ids: (T,) long; loss_mask: (T,) 1 on action tokens (trained), 0 on prompt and tool output;
    behaviour_logp: (T,) engine log-probs of each token (entries where loss_mask = 0 are ignored) or None;
    ref_logp: (T,) reference-model log-probs (KL) or None; teacher_logp: (T,) for distillation or None.
    """

    traj_id: str
    group_id: str
    group_size: int
    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    reward: float
    policy_version: int = 0
    behaviour_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    teacher_logp: torch.Tensor | None = None
    arrival_s: float = 0.0  # when its reward landed (seconds since step start), for timelines
    dp_rank: int = 0
    meta: dict = dataclasses.field(default_factory=dict)
    routing: torch.Tensor | None = None
    """Router replay (MoE): (P, L, k) experts the engine chose at positions 0..P-1 (P ≤ T), or None."""

    def __post_init__(self):
        t = self.token_ids.shape[0]
        if self.token_ids.dim() != 1 or t < 2:
            raise ValueError(f"trajectory {self.traj_id}: token_ids must be 1-D with ≥ 2 tokens")
        for name in ("loss_mask", "behaviour_logp", "ref_logp", "teacher_logp"):
            v = getattr(self, name)
            if v is not None and v.shape != (t,):
                raise ValueError(f"trajectory {self.traj_id}: {name} has shape {tuple(v.shape)}, expected ({t},)")
        if self.routing is not None and (self.routing.dim() != 3 or self.routing.shape[0] > t):
            raise ValueError(f"trajectory {self.traj_id}: routing has shape {tuple(self.routing.shape)}, expected "
                             f"(P ≤ {t}, layers, topk)")
        if not math.isfinite(self.reward):
            raise ValueError(f"trajectory {self.traj_id}: reward {self.reward} is not finite")

    @property
    def num_action_tokens(self) -> int:
        """Trained tokens: positions t ≥ 1 with loss_mask = 1 (token 0 has no prediction)."""
        return int(self.loss_mask[1:].sum().item())


class ArrivalSource(Protocol):
    def poll(self, timeout_s: float) -> list[Sample]:
        """Samples that became ready since the last call (may block up to ``timeout_s``)."""

    def exhausted(self) -> bool:
        """True when every sample of the step has been returned."""


class Clock:
    """What the timed sources read and wait on: ``now()`` (s) and ``sleep(s)``; the wall clock by default, a
    virtual one in tests (no wall-clock thresholds)."""

    def __init__(self, now=time.perf_counter, sleep=time.sleep):
        self.now, self.sleep = now, sleep


WALL_CLOCK = Clock()


class ListSource:
    """Replays samples in a fixed order; ``release_times`` (s) makes arrivals wait on ``clock`` (the wall clock)."""

    def __init__(self, samples: Iterable[Sample], release_times: list[float] | None = None, batch: int = 1,
                 clock: Clock = WALL_CLOCK):
        self.clock = clock
        self.samples = list(samples)
        self.release = release_times
        self.batch = batch
        self.i = 0
        self.t0: float | None = None

    def poll(self, timeout_s: float = 0.0) -> list[Sample]:
        if self.t0 is None:
            self.t0 = self.clock.now()
        if self.release is None:
            out = self.samples[self.i : self.i + self.batch]
            self.i += len(out)
            return out
        now = self.clock.now() - self.t0
        if self.i < len(self.samples) and self.release[self.i] > now:
            self.clock.sleep(min(self.release[self.i] - now, max(timeout_s, 0.0)))
            now = self.clock.now() - self.t0
        out = []
        while self.i < len(self.samples) and self.release[self.i] <= now:
            s = self.samples[self.i]
            s.arrival_s = self.release[self.i]
            out.append(s)
            self.i += 1
        return out

    def exhausted(self) -> bool:
        return self.i >= len(self.samples)


class CoalescingSource:
    """``inner`` with arrivals coalesced, so trajectories landing close together reach the learner as one poll and
    share microbatches (packing, shared prefixes) instead of one microbatch each. Once a poll returns something, keep
    collecting

    - for up to ``window_s`` more seconds (``--stream-coalesce-ms``), and/or
    - until the collected trajectories hold ``min_tokens`` tokens (``--stream-coalesce-tokens``: a microbatch's worth,
      where one trajectory alone leaves the learner bound by per-microbatch overhead);

    both given: whichever comes first; only ``min_tokens``: no time bound. The step's last reward is never held (the
    step is complete). Wrap the receiving side only (trainer rank 0 before the broadcast): time decides here, and
    other ranks must not decide on their own clocks. Both 0: ``inner`` unchanged."""

    def __init__(self, inner: ArrivalSource, window_s: float, min_tokens: int = 0, poll_s: float = 0.05):
        if window_s < 0:
            raise ValueError(f"coalescing window must be >= 0 s, got {window_s}")
        if min_tokens < 0:
            raise ValueError(f"coalescing token target must be >= 0, got {min_tokens}")
        self.inner, self.window_s, self.min_tokens, self.poll_s = inner, float(window_s), int(min_tokens), poll_s
        self.clock: Clock = getattr(inner, "clock", WALL_CLOCK)  # the window on the clock the arrivals follow

    def __getattr__(self, name):  # the wrapped source's other attributes (samples, ...)
        return getattr(self.inner, name)

    def poll(self, timeout_s: float) -> list[Sample]:
        got = list(self.inner.poll(timeout_s))
        if not got or (self.window_s <= 0 and self.min_tokens <= 0):
            return got
        deadline = self.clock.now() + self.window_s if self.window_s > 0 else math.inf
        tokens = sum(s.token_ids.shape[0] for s in got)
        while not self.inner.exhausted() and (self.min_tokens <= 0 or tokens < self.min_tokens):
            left = deadline - self.clock.now()
            if left <= 0:
                break
            more = self.inner.poll(min(left, self.poll_s))
            tokens += sum(s.token_ids.shape[0] for s in more)
            got += more
        return got

    def exhausted(self) -> bool:
        return self.inner.exhausted()


class DataParallelAssigner:
    """The one owner of which data-parallel rank trains a trajectory: the i-th distinct trajectory to arrive (in the
    order rank 0 saw it, which every rank replays identically) goes to DP rank ``i mod dp``. Sticky: every later
    chunk of the same trajectory (turn-level OPD) gets the same rank. Arrival order, not group index, so the ranks'
    loads stay balanced however the rewards land.

    ``by_group`` (``--dp-assignment group``): every trajectory of a group goes to one rank, chosen when the group's
    first trajectory arrives: the rank with the fewest tokens assigned so far in this step (ties: the lowest rank).
    A rank then holds gradient buckets only for its own groups (about 1/DP of the open ones) instead of one per open
    group; the sum over ranks, and so the update, is the same. Balance is by tokens, so a group of long trajectories
    does not leave the other ranks idle at the barrier more than one group's worth.

    ``balanced`` (``--dp-assignment balanced``, with ``by_group``): the same affinity, but a new group goes to the rank
    with the least *predicted* work: each group counts as its landed members' mean tokens times its group size (its
    landed tokens once complete), so a rank whose groups have only begun to land is not mistaken for an idle one —
    greedy list scheduling on predicted group cost (a group's cost is unknown before its first member lands, so the
    groups cannot be sorted longest-first as LPT would). ``tokens`` keeps the landed tokens; ``predicted`` the loads.

    ``spill`` (``--dp-assignment spill``): affinity that does not let the ranks' work drift apart. A group's first
    member goes to the rank with the fewest landed tokens; each later member to the least-loaded rank already holding
    a member of its group, unless that rank's tokens plus the member's would exceed the least-loaded rank's by more
    than ``T``: then it spills to the least-loaded rank, which opens a bucket for the group too (exact: each rank that
    holds members of a group folds its own, as in arrival order, and the DP all-reduce sums the same terms).
    ``T = L × (1 + spill_taper × r)``: ``L`` the longest trajectory landed so far in the step (tokens), ``r`` the
    fraction of the step's ``step_trajectories`` yet to land (0 when not given). Early on a group may stay home up to
    three trajectories over the least-loaded rank (affinity, few open buckets); the last landings are placed within
    one trajectory of it (the barrier). Bound, by induction on landings (every rank but the chosen one keeps its load,
    the chosen one ends <= min + T, and min never falls): max(tokens) - min(tokens) <= the largest ``T`` of the step,
    <= (1 + spill_taper) × the longest trajectory; without the taper (``step_trajectories`` 0) one trajectory, the
    bound of greedy least-loaded list scheduling. Round-robin by arrival bounds only the trajectory *count* per
    rank; its tokens can drift apart by several long trajectories.

    ``group_order`` (the step's group ids in batch order; ``--deterministic``): group k's trajectories all go to rank
    ``k mod dp`` instead, whatever the arrival order, so each rank's partial gradient sum is the same in every run."""

    def __init__(self, dp: int, group_order: list[str] | None = None, by_group: bool = False,
                 balanced: bool = False, spill: bool = False, spill_taper: float = 2.0, step_trajectories: int = 0):
        if dp < 1:
            raise ValueError(f"data-parallel size must be >= 1, got {dp}")
        self.dp = dp
        self._rank: dict[str, int] = {}
        self._group_pos = None if group_order is None else {g: k for k, g in enumerate(group_order)}
        self.by_group = (by_group or balanced or spill) and group_order is None
        self.balanced = balanced and self.by_group and not spill
        self.spill = spill and self.by_group
        self._holders: dict[str, list[int]] = {}  # spill: group -> the ranks holding one of its members
        self.taper, self.total = spill_taper, step_trajectories
        self.longest = 0  # spill: the longest trajectory landed in this step (tokens), L
        self._group_rank: dict[str, int] = {}
        self._landed: dict[str, list[int]] = {}  # balanced: group -> [members landed, their tokens]
        self.tokens = [0] * dp  # tokens assigned per rank (by_group's balance)
        self.predicted = [0.0] * dp  # balanced: predicted tokens per rank (its groups' predicted totals)

    def assign(self, traj_id: str, group_id: str | None = None, tokens: int = 0, group_size: int = 0) -> int:
        r = self._rank.get(traj_id)
        if r is None:
            if self._group_pos is not None:
                if group_id not in self._group_pos:
                    raise ValueError(f"trajectory {traj_id}: group {group_id!r} is not in this step's group order")
                r = self._group_pos[group_id] % self.dp
            elif self.by_group:
                if group_id is None:
                    raise ValueError(f"trajectory {traj_id}: assignment by group needs its group id")
                r = self._spill(group_id, int(tokens)) if self.spill else self._group_rank.get(group_id)
                if r is None:
                    load = self.predicted if self.balanced else self.tokens
                    r = self._group_rank[group_id] = min(range(self.dp), key=lambda k: (load[k], k))
                if self.balanced:
                    self._predict(group_id, r, int(tokens), group_size)
            else:
                r = len(self._rank) % self.dp
            self._rank[traj_id] = r
            self.tokens[r] += int(tokens)
        return r

    def _spill(self, group_id: str, tokens: int) -> int:
        """``spill``'s rank for a new member of ``group_id`` with ``tokens`` (see the class docstring)."""
        self.longest = max(self.longest, tokens)
        low = min(range(self.dp), key=lambda k: (self.tokens[k], k))
        held = self._holders.setdefault(group_id, [])
        home = min(held, key=lambda k: (self.tokens[k], k)) if held else low
        r = home if self.tokens[home] + tokens <= self.tokens[low] + self._slack() * self.longest else low
        if r not in held:
            held.append(r)
        return r

    def _slack(self) -> float:
        """``T / L``: ``1 + spill_taper ×`` the fraction of the step's trajectories yet to land."""
        return 1.0 + self.taper * max(0.0, 1.0 - len(self._rank) / self.total) if self.total else 1.0

    def _predict(self, group_id: str, r: int, tokens: int, group_size: int) -> None:
        """Rank ``r``'s predicted load after one more member of ``group_id`` landed: the group's prediction (its
        landed members' mean tokens × max(group size, members landed)) replaces the one before."""
        n, t = self._landed.setdefault(group_id, [0, 0])
        old = t / n * max(group_size, n) if n else 0.0
        n, t = n + 1, t + tokens
        self._landed[group_id] = [n, t]
        self.predicted[r] += t / n * max(group_size, n) - old

    def rank_of(self, traj_id: str, default: int = 0) -> int:
        """The rank already assigned to ``traj_id`` (``default`` if it never arrived)."""
        return self._rank.get(traj_id, default)

    def assign_samples(self, samples: Iterable[Sample]) -> None:
        """Set ``dp_rank`` on each sample, in order."""
        for s in samples:
            s.dp_rank = self.assign(s.traj_id, s.group_id, int(s.token_ids.shape[0]), int(s.group_size or 0))
