"""The bitwise (``--deterministic``) gradient sum: a canonical-order reduction, independent of arrival order.

Floating-point addition is not associative, so the default streaming sum (every backward accumulating into
``param.main_grad`` as it lands, buckets (P, Q, ρ) with a moving origin) rounds differently for every arrival order.
Here the sum has one fixed shape, whatever the order in which trajectories run:

    accumulator = Σ_g C_g               groups g in batch order (the order of the step's ``group_sizes``)
    C_g         = Σ_i (A_i · h_i + k_i)  this rank's trajectories i of g in canonical id order (:func:`canonical_key`)

each sum a left fold, with h_i the trajectory's reward-free surrogate gradient (its own backward into a fresh zero
vector, so its bits depend on nothing but the trajectory and θ), A_i its advantage from the group's rewards in
canonical order, k_i its KL/entropy gradient (a second backward of its own, when those terms are on). A trajectory's
vectors are held from its backward until its group is complete; C_g is held until every earlier group has been
folded. Memory: one gradient-sized vector per trajectory that has run and whose group is open (two with KL/entropy
terms), plus one per complete group waiting for an earlier one — against 2 per open group (P, Q) in the default
mode. Bucket residency (``--max-device-buckets`` / ``--bucket-device-gib``) keeps at most N of them on the accelerator
and the rest in its host arena (``streaming/offload.py``); the moves are exact copies. Data parallelism: the DP rank
of a trajectory must not depend on arrival order either (``DataParallelAssigner(dp, group_order=...)``); each rank folds its own trajectories, then the one DP all-reduce
of the barrier adds the ranks' sums in a fixed order. Expert parallelism: a rank also holds and folds a vector for
each trajectory of its EP peers (the gradient its tokens left on this rank's experts, zeros elsewhere;
``training.stream_fb``), so the members of a group are those of every DP rank of the EP group; the barrier's dense
all-reduce then adds one non-zero contribution per trajectory, and the experts (expert-DP = DP / EP ranks, 1 at
DP = EP) hold every trajectory's tokens once.
"""

from __future__ import annotations

import dataclasses

from megatron_tsync.streaming.buckets import BucketPool, GradRouter, GradVector
from megatron_tsync.streaming.offload import Residency, ResidentVectors

PARTS = ("policy", "aux")


def canonical_key(traj_id: str) -> tuple[int, str]:
    """Order of trajectories inside a group: by length, then text (natural order of ids with a common prefix,
    ``g0t2`` before ``g0t10``). Any fixed total order would do; it must not depend on arrival."""
    return len(traj_id), traj_id


@dataclasses.dataclass
class _Plan:
    members: list[str]  # this rank's trajectories of the group, canonical order
    adv: dict[str, float]  # their advantages
    cursor: int = 0  # members[:cursor] are folded into c
    c: GradVector | None = None  # the partial C_g


@dataclasses.dataclass
class CanonicalStats:
    held_peak: int = 0  # trajectory + group vectors held at once (the pool's peak counts them too)
    folded_groups: int = 0


class CanonicalSum(ResidentVectors):
    """Per-trajectory gradient vectors folded in a canonical order (module docstring)."""

    def __init__(self, router: GradRouter, pool: BucketPool, residency: Residency | None = None):
        super().__init__(router, pool, residency)
        self.order: list[str] = []
        self._next = 0  # index in ``order`` of the first group not yet folded into the accumulator
        self._held: dict[str, dict[str, dict[str, GradVector]]] = {}  # group -> traj -> part -> vector
        self._closed: dict[str, GradVector | None] = {}  # complete groups waiting for an earlier one
        self._done: set[str] = set()
        self.parts: tuple[str, ...] = ("policy",)
        self._plans: dict[str, _Plan] = {}
        self.stats = CanonicalStats()

    def begin(self, group_order: list[str], parts: tuple[str, ...] = ("policy",)) -> None:
        """A new phase (minibatch) whose groups fold in ``group_order``; every trajectory has these ``parts``."""
        if self.pending():
            raise AssertionError("canonical sum: vectors of the previous phase are still held")
        if any(p not in PARTS for p in parts):
            raise ValueError(f"parts must be among {PARTS}, got {parts}")
        self.order = list(group_order)
        self.parts = tuple(parts)
        self._next = 0
        self._done = set()
        self._plans: dict[str, _Plan] = {}

    def pending(self) -> int:
        return (sum(len(p) for t in self._held.values() for p in t.values())
                + sum(v is not None for v in self._closed.values())
                + sum(p.c is not None for p in self._plans.values()))

    # ------------------------------------------------------------------ backward routing
    def enter(self, traj_id: str, group_id: str, part: str) -> None:
        """Route the next backward into a fresh zero vector for (trajectory, part). Every earlier backward is
        complete at this point, so what can be folded is folded first."""
        if part not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {part!r}")
        if group_id in self._done or group_id in self._closed:
            raise AssertionError(f"trajectory {traj_id}: group {group_id} is already closed")
        self._advance()
        parts = self._held.setdefault(group_id, {}).setdefault(traj_id, {})
        if part in parts:
            raise AssertionError(f"trajectory {traj_id}: its {part} gradient was already computed")
        v = parts[part] = self._acquire(f"{part}:{traj_id}", group_id)
        self.router.route(v)
        self._count()

    def route_accumulator(self) -> None:
        self.router.route_to_accumulator()

    # ------------------------------------------------------------------ folding
    def plan(self, group_id: str, members: list[str], advantages: dict[str, float]) -> None:
        """The group's advantages are final: its trajectories on this rank and their A_i. From now on each member is
        folded into C_g as soon as it and every member before it (canonical order) have run, so a group whose
        trajectories run in canonical order (sync, stream-group) holds about two vectors, not one per member."""
        if group_id in self._plans or group_id in self._closed or group_id in self._done:
            raise AssertionError(f"group {group_id} planned twice")
        if group_id not in self.order:
            raise AssertionError(f"group {group_id} is not in this phase's order")
        self._plans[group_id] = _Plan(sorted(members, key=canonical_key), {t: float(advantages[t]) for t in members})
        self._advance()
        self._count()

    def close_group(self, group_id: str, advantages: dict[str, float] | None = None) -> None:
        """Every local trajectory of ``group_id`` has run: C_g = Σ A_i h_i + k_i (canonical order) is complete; fold
        every complete group at the head of the batch order into the accumulator. ``advantages``: if not planned."""
        if group_id in self._done or group_id in self._closed:
            raise AssertionError(f"group {group_id} closed twice")
        if group_id not in self._plans:
            if advantages is None:
                raise AssertionError(f"group {group_id} closed without its advantages")
            self.plan(group_id, list(self._held.get(group_id, {})), advantages)
        self._advance()
        p = self._plans.pop(group_id)
        left = self._held.pop(group_id, {})
        if p.cursor != len(p.members) or left:
            raise AssertionError(f"group {group_id}: trajectories {p.members[p.cursor:] or sorted(left)} did not run "
                                 f"all of {self.parts}")
        self._closed[group_id] = p.c
        self._fold_ready()
        self._count()

    def _advance(self) -> None:
        """Fold, in every planned group, the members whose parts all exist and whose predecessors are folded."""
        self.router.route_to_accumulator()
        for gid, p in self._plans.items():
            held = self._held.get(gid, {})
            while p.cursor < len(p.members):
                tid = p.members[p.cursor]
                if any(x not in held.get(tid, {}) for x in self.parts):
                    break
                self._fold_member(p, held.pop(tid), p.adv[tid])
                p.cursor += 1

    def _fold_member(self, p: "_Plan", parts: dict[str, GradVector], a: float) -> None:
        h, k = parts["policy"], parts.get("aux")
        if p.c is None:  # the first term starts the fold: C = A·h, in h's own storage
            self._need(h)
            p.c = h.scale_(a)
        else:
            self._need(p.c, h)
            p.c.add_(h, alpha=a)
            self._release(h)
        if k is not None:
            self._need(p.c, k)
            p.c.add_(k)
            self._release(k)

    def _fold_ready(self) -> None:
        while self._next < len(self.order) and self.order[self._next] in self._closed:
            gid = self.order[self._next]
            c = self._closed.pop(gid)
            if c is not None:
                self._need(c)
                self.accumulator.add_(c)
                self._release(c)
            self._done.add(gid)
            self.stats.folded_groups += 1
            self._next += 1

    def finish(self) -> None:
        """At the barrier: every group of the phase must have been folded."""
        if self._next != len(self.order) or self.pending():
            missing = [g for g in self.order if g not in self._done]
            raise AssertionError(f"canonical sum: groups {missing} were not folded before the barrier")

    # ------------------------------------------------------------------ memory
    def _count(self) -> None:
        self.stats.held_peak = max(self.stats.held_peak, self.pending())
