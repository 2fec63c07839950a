"""Per-group gradient buckets with the moving origin (P, Q, ρ) of design note §1.

For an open group keep Q = Σ h_i (its trajectories' reward-free gradients) and P = Σ (r_i − ρ)·h_i, where ρ is
the reward of the group's most recent trajectory. Before trajectory i's backward: P += (ρ − r_i)·Q, ρ = r_i;
then the backward accumulates h_i *straight into Q* (``param.main_grad`` points into Q) and leaves P
unchanged. At close, with the group's final (α, β): accumulator += α·P + (α·ρ + β)·Q = Σ A_i h_i.

Buffers (gradient-sized vectors), k = open groups, the accumulator being Megatron's own grad buffer:
- α depends on the rewards (std-normalised GRPO): P and Q per group → 1 + 2k.
- α known in advance (Dr.GRPO, RLOO): α·P of every group is summed directly into the accumulator
  (accumulator += α(ρ − r_i)·Q before each backward) → only Q per group → 1 + k.
P is allocated lazily, the first time the origin moves (a zero-variance group never needs it).

Traffic accounting (:meth:`GroupBuckets.traffic_stats`, per step, in bytes of gradient vectors; V = one vector):
``bucket_bytes`` what the buckets moved — a vector's zero-fill when acquired (V), a shift (3V: read two, write one),
a fold at close (3V); ``saved_cohort_bytes`` what equal-reward cohorts saved — a group closed while its members all
had one reward shares Q and never allocates P: P's zero-fill and fold, 4V; ``saved_direct_bytes`` what the direct
path saved — a trajectory trained straight into the accumulator with its advantage in stream-trajectory
(:meth:`GroupBuckets.note_direct`) where a bucket would have taken it: the shift it would have needed (3V when its
reward is not the bucket's origin; P's 4V the first time, α unknown) and, for a group with no bucket at all, the Q
it would have opened and folded (4V). The counterfactual follows each group's own sequence of direct rewards.

Host accumulation (``host``: ``streaming.host_accum.HostAccumulation``, ``--accumulate-on-host``): the accumulator and
every P/Q live in the host arena; ``param.main_grad`` always views megatron's grad buffer (the scratch), and routing
names the scratch's destinations instead of re-pointing ``main_grad``; the shifts and closes are host ``add_`` calls in
the host worker's order.
"""

from __future__ import annotations

import dataclasses

from megatron_tsync.streaming.buckets import BucketPool, GradRouter, GradVector
from megatron_tsync.streaming.host_accum import HostAccumulation
from megatron_tsync.streaming.offload import Residency, ResidentVectors


@dataclasses.dataclass
class _Bucket:
    q: GradVector
    p: GradVector | None
    rho: float
    alpha_known: float | None


class GroupBuckets(ResidentVectors):
    """``residency``: optional device cache + host arena of the vectors (``streaming/offload.py``); None keeps all on
    the device. ``host``: host accumulation (module docstring; not with ``residency``)."""

    def __init__(self, router: GradRouter, pool: BucketPool, residency: Residency | None = None,
                 host: HostAccumulation | None = None):
        if host is not None and residency is not None:
            raise ValueError("--accumulate-on-host keeps every bucket vector on the host: it replaces the device "
                             "cache of --max-device-buckets / --bucket-device-gib")
        super().__init__(router, pool, residency)
        self.host = host
        if host is not None:
            self.accumulator = host.accumulator
        self.buckets: dict[str, _Bucket] = {}
        self._shadow: dict[str, list] = {}  # note_direct: group -> [origin, has P] of the bucket a direct path skips
        self.traffic = {"bucket_bytes": 0, "saved_cohort_bytes": 0, "saved_direct_bytes": 0}

    def _count(self, key: str, vectors: int) -> None:
        self.traffic[key] += vectors * self.pool.stats.bytes_per_vector

    def traffic_stats(self) -> dict:
        """This step's bucket traffic and the bytes the direct path and equal-reward cohorts saved (module
        docstring); resets the counters."""
        out, self.traffic = dict(self.traffic), dict.fromkeys(self.traffic, 0)
        self._shadow = {}
        return out

    def note_direct(self, group_id: str, reward: float, alpha_known: float | None) -> None:
        """A stream-trajectory trajectory of ``group_id`` trained straight into the accumulator with its advantage:
        count the bucket traffic it saved (module docstring)."""
        reward = float(reward)
        b = self.buckets.get(group_id)
        sh = self._shadow.get(group_id)
        if sh is None:
            if b is None:  # no bucket: one would have opened (Q's zero-fill, its fold)
                self._count("saved_direct_bytes", 4)
                sh = self._shadow[group_id] = [reward, False]
            else:
                sh = self._shadow[group_id] = [b.rho, b.p is not None]
        if reward != sh[0]:
            self._count("saved_direct_bytes", 3 + (4 if alpha_known is None and not sh[1] else 0))
            sh[0], sh[1] = reward, True

    @property
    def open_groups(self) -> int:
        return len(self.buckets)

    def _acquire(self, tag: str, group: str, keep: tuple[GradVector, ...] = ()) -> GradVector:
        if self.host is not None:
            return self.host.acquire(self.pool, tag)
        return super()._acquire(tag, group, keep)

    def _release(self, v: GradVector) -> None:
        if self.host is not None:
            self.host.release(v)
            self.pool.release(v)
            return
        super()._release(v)

    def _axpy(self, dst: GradVector, src: GradVector, alpha: float) -> None:
        """dst += alpha·src (on the host worker under host accumulation)."""
        if self.host is not None:
            self.host.axpy(dst, src, alpha)
        else:
            dst.add_(src, alpha=alpha)

    def _route(self, v: GradVector) -> None:
        """The next backward's gradient goes into ``v``."""
        if self.host is not None:
            self.host.route([(v, 1.0)])
        else:
            self.router.route(v)

    def next_backward(self, group_id: str | None, reward: float | None) -> None:
        """Host accumulation: a forward starts whose backward will write ``group_id``'s Q at ``reward`` (None: the
        accumulator): flush the scratch now unless it keeps accumulating for the same vector (``HostAccumulation
        .prepare``; a guess — routing at backward time decides)."""
        if self.host is None:
            return
        if group_id is None:
            self.host.prepare([(self.accumulator, 1.0)])
            return
        b = self.buckets.get(group_id)
        self.host.prepare([(b.q, 1.0)] if b is not None and b.rho == float(reward) else None)

    def begin_backward(self) -> None:
        """Right before a routed backward writes gradients (host accumulation: wait for the scratch)."""
        if self.host is not None:
            self.host.begin_backward()

    def _open(self, group_id: str, reward: float, alpha_known: float | None) -> _Bucket:
        """The group's bucket; a new one has Q and its origin at ``reward`` (P comes with :meth:`_p`)."""
        b = self.buckets.get(group_id)
        if b is None:
            b = _Bucket(q=self._acquire(f"Q:{group_id}", group_id), p=None, rho=float(reward), alpha_known=alpha_known)
            self.buckets[group_id] = b
            self._count("bucket_bytes", 1)
        return b

    def _p(self, group_id: str, b: _Bucket) -> GradVector:
        if b.p is None:
            b.p = self._acquire(f"P:{group_id}", group_id, keep=(b.q,))
            self._count("bucket_bytes", 1)
        return b.p

    def enter(self, group_id: str, reward: float, alpha_known: float | None) -> None:
        """Prepare for a backward of a trajectory of ``group_id`` with ``reward`` and route grads into Q."""
        if self.residency is not None:  # the previous backward is complete: the vector it wrote may move now
            self.router.route_to_accumulator()
        b = self._open(group_id, reward, alpha_known)
        if reward != b.rho:
            shift = b.rho - float(reward)
            if b.alpha_known is not None:
                self._need(b.q)
                self._axpy(self.accumulator, b.q, b.alpha_known * shift)
            else:
                self._p(group_id, b)
                self._need(b.p, b.q)
                self._axpy(b.p, b.q, shift)
            self._count("bucket_bytes", 3)
            b.rho = float(reward)
        self._need(b.q)
        self._route(b.q)

    def destinations(self, group_id: str, reward: float, alpha_known: float | None) -> list[tuple[GradVector, float]]:
        """Where one trajectory's reward-free gradient h_i goes when it shares a backward with other destinations
        (``model.row_split``; not under host accumulation): [(vector, coefficient)]. The origin ρ stays where it is:
        Q += h_i and P += (r_i − ρ)·h_i (α known: accumulator += α(r_i − ρ)·h_i), which keeps P = Σ (r_j − ρ)·h_j as
        :meth:`enter` does, so the two may alternate. Makes the vectors device-resident."""
        b = self._open(group_id, reward, alpha_known)
        out = [(b.q, 1.0)]
        shift = float(reward) - b.rho
        if shift != 0.0:
            out.append((self.accumulator, b.alpha_known * shift) if b.alpha_known is not None
                       else (self._p(group_id, b), shift))
        self._need(*(v for v, _ in out if v is not self.accumulator))
        return out

    def route_accumulator(self) -> None:
        if self.host is not None:
            self.host.route([(self.accumulator, 1.0)])
        else:
            self.router.route_to_accumulator()

    def close(self, group_id: str, alpha: float, q_coefficient) -> None:
        """accumulator += α·P + c·Q with c = q_coefficient(ρ); frees the group's vectors."""
        b = self.buckets.pop(group_id, None)
        if b is None:
            return  # every trajectory of the group went straight to the accumulator
        if self.router.current is b.q or self.host is not None:
            self.route_accumulator()
        if b.alpha_known is not None and alpha != b.alpha_known:
            raise AssertionError(f"group {group_id}: α changed from {b.alpha_known} to {alpha}")
        if b.p is not None:
            self._need(b.p)
            self._axpy(self.accumulator, b.p, alpha)
            self._release(b.p)
            self._count("bucket_bytes", 3)
        elif b.alpha_known is None:  # the members shared one reward: no P to zero or fold
            self._count("saved_cohort_bytes", 4)
        self._count("bucket_bytes", 3)
        self._need(b.q)
        self._axpy(self.accumulator, b.q, float(q_coefficient(b.rho)))
        self._release(b.q)

    def materialize(self) -> None:
        """Before the barrier: the batch gradient into megatron's grad buffer (a no-op unless on the host)."""
        if self.host is not None:
            self.host.materialize()

    def vectors_in_use(self) -> int:
        return self.pool.stats.in_use
