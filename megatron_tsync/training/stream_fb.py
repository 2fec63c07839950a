"""The streaming forward-backward: planned work items through Megatron's schedules.

Each :class:`~megatron_tsync.streaming.planner.WorkItem` is one microbatch (one trajectory, micro-batch size 1)
of ``get_forward_backward_func()`` — no pipelining on one stage, 1F1B with variable sequence lengths under
pipeline parallelism. Every PP stage and TP rank runs the same items in the same order. With sequence packing
(``max_packed_tokens``) items that share their gradient destination (``training.packing.share_key``) are
concatenated into one microbatch: block-diagonal causal attention (a T×T mask on the local spec, THD
``PackedSeqParams`` on Transformer Engine), positions restarting per segment, one loss term per segment.

Where a microbatch's gradient lands is decided at *backward time*: ``forward_step`` registers a pre-hook on
its output's ``grad_fn``, which fires on every stage right before that microbatch's backward reaches the
stage's parameters. The hook moves the group's origin and points ``param.main_grad`` into the group's bucket
(:class:`GroupBuckets.enter`) or back at the DDP buffer (the batch accumulator). No scratch buffer, no copy — except
under host accumulation (``--accumulate-on-host``, ``streaming/host_accum.py``): there ``main_grad`` always views the
DDP buffer, used as each microbatch's scratch, the hook names its destinations on the host, and a forward's start
(:meth:`StreamExecutor._announce`) flushes the previous backward's scratch to the host while this forward runs.

Loss per trajectory i (B = trajectories in the batch, ν_i from ``algorithms.aggregation``):
  policy term, advantage known:  ν_i Σ_t w_t ℓ_t(A_i)     (reference PPO/PG loss)
  policy term, into a bucket:    ν_i Σ_t w_t s_t(sign)     (reward-free surrogate; A_i applied at close)
  aux terms (accumulator only):  ν_i Σ_t w_t (β_KL·kl_t − c_H·H_t)
The schedule is run with ``calculate_per_token_loss`` so it neither averages nor scales; the explicit
denominator is applied once at the barrier.

Deterministic mode (``canonical`` given, ``--deterministic``): every trajectory runs as one policy microbatch (the
surrogate with sign +1 when its ratios are sign-free, else the exact sign the planner gives; the advantage is applied
when its group is folded) and, with KL/entropy terms, one aux microbatch, each backward into a fresh vector of
``streaming.canonical.CanonicalSum``, in every mode (sync included), so the bits of each contribution and of their
sum do not depend on when it ran. No packing. Expert parallelism (``_lockstep_slots``): a slot holds ONE trajectory
part over the whole EP group (the other ranks run idle microbatches, whose gradient is exact zeros), and every rank
backpropagates the slot into a fresh vector under that trajectory's key — on a rank that does not train it, the
expert gradients its tokens left on this rank's experts — so each vector, and the canonical fold over the EP group's
trajectories (``Learner._plan_final``), has the same bits for any arrival order; whether a slot deferred (its
ratios, known on its own rank) is agreed over the group before its backward (``ExpertLockstep.any``).

Mixed microbatches (``mix_groups``, ``--pack-across-groups``): packed items need not share a destination. Such a
microbatch's forward runs under ``model.row_split.active``; its pre-hook (:meth:`StreamExecutor._before_mixed_backward`)
gives each segment its destinations — the accumulator, or its group's Q and P with coefficients 1 and r_i − ρ
(``GroupBuckets.destinations``) — and the one backward adds every weight gradient's rows into those places.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time

import torch

from megatron_tsync.algorithms.aggregation import sequence_weight
from megatron_tsync.algorithms.kl import kl_penalty
from megatron_tsync.algorithms.policy_loss import (PolicyLossConfig, importance_ratio, policy_loss, sign_free,
                                                   surrogate)
from megatron_tsync.streaming.accumulator import GroupBuckets
from megatron_tsync.streaming.canonical import CanonicalSum, canonical_key
from megatron_tsync.streaming.planner import Dest, StepPlanner, TrajMeta, WorkItem
from megatron_tsync.streaming.ready_queue import Sample
from megatron_tsync.model import compat, moe, row_split
from megatron_tsync.model.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs
from megatron_tsync.model.builder import unwrap
from megatron_tsync.model.parallel import ExpertLockstep
from megatron_tsync.training.objective import signed_policy_values
from megatron_tsync.training.packing import (PrefixLayout, layout_for, mix_key, plan_microbatches, plan_shared_prefix,
                                             share_key, uses_varlen_attention)

_IDLE_TOKENS = 2  # length of an expert-lockstep idle microbatch
THETA0_LOGP = "theta0_logp"  # Sample.meta key: (T-1,) trainer log-probs of tokens 1..T-1 at θ0
SHAPED_REWARD = "shaped_reward"  # Sample.meta key: r − β·KL (--kl-mode reward; training/reference.py)


def train_reward(s: Sample) -> float:
    """The reward the advantages are computed from: the KL-shaped one with ``--kl-mode reward``, else ``s.reward``."""
    return s.meta.get(SHAPED_REWARD, s.reward)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    policy: PolicyLossConfig = PolicyLossConfig()
    aggregation: str = "token-mean"
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    kl_mode: str = "none"  # "none" | "loss" (a loss term) | "reward" (folded into the reward on arrival)
    entropy_coef: float = 0.0
    temperature: float = 1.0
    old_logprobs: str = "trainer"  # "trainer": π_old = π_θ0 (ratio 1 at the first minibatch) | "engine"
    # (internal) "theta0": π_θ0 log-probs the learner kept in ``Sample.meta[THETA0_LOGP]`` (minibatches ≥ 2, epochs ≥ 2)

    @property
    def has_aux(self) -> bool:
        return (self.kl_mode == "loss" and self.kl_coef != 0.0) or self.entropy_coef != 0.0


@dataclasses.dataclass
class BatchShape:
    """Batch-level constants the normalisers need (known before the first trajectory)."""

    num_sequences: int
    max_len: int | None = None


class StreamExecutor:
    """Runs work items for one rank through megatron's schedule and routes each microbatch's gradient (module docstring).

    Per step it keeps the landed samples by id, the current minibatch's planner, batch shape and loss config, and
    its bookkeeping (busy intervals, per-trajectory loss terms, microbatch counts). It also writes into its inputs:
    π_θ0 into ``Sample.meta[THETA0_LOGP]`` (``keep_theta0``) and deferrals into the planner. Gradient memory is not
    its own: the DDP grad buffers and ``GroupBuckets`` hold it."""

    def __init__(self, ddp_model, buckets: GroupBuckets, loss_cfg: LossConfig, *, max_packed_tokens: int | None = None,
                 canonical: CanonicalSum | None = None, shared_prefix_tokens: int | None = None,
                 mix_groups: bool = False, full_microbatches: bool = False):
        """``max_packed_tokens``: pack items that share a gradient destination into microbatches of at most this many
        tokens (``training.packing``); None = one trajectory per microbatch. ``canonical``: the deterministic mode's
        gradient sum (module docstring); refuses packing. ``shared_prefix_tokens``: run members of one group that
        share a destination and a prompt as shared-prefix microbatches of at most this many tokens
        (``packing.PrefixLayout``: the prompt's forward and backward once); None = off. ``mix_groups``: packed
        microbatches may mix gradient destinations (module docstring; needs ``max_packed_tokens``).
        ``full_microbatches``: a packed microbatch that is not full waits for later items (:meth:`run`); a waiting
        bucket item of a group that closes becomes an accumulator item (:meth:`close`); ``run(..., final=True)`` runs
        everything."""
        if canonical is not None and (max_packed_tokens or shared_prefix_tokens):
            raise ValueError("deterministic mode runs one trajectory per microbatch: sequence packing and shared "
                             "prefixes are refused")
        self.canonical = canonical
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.model = ddp_model
        self.buckets = buckets
        self.cfg = loss_cfg
        self.fb = get_forward_backward_func()
        compat.install_backward_without_cpu_mode()
        self.max_packed_tokens = max_packed_tokens
        gpt = unwrap(ddp_model)
        self._gpt = gpt
        self.lockstep = ExpertLockstep(gpt.config)  # EP > 1: idle microbatches keep the expert all-to-alls matched
        self._thd = bool(max_packed_tokens) and uses_varlen_attention(gpt)
        self._align = 16 if self._thd and getattr(gpt.config, "fp8", None) else 1  # FP8 GEMMs want T % 16 == 0
        # MoE at TP > 1 (sequence parallelism): a microbatch is split over the TP ranks (model/moe.py)
        self._tp_align = gpt.config.tensor_model_parallel_size if gpt.config.sequence_parallel else 1
        self._align = math.lcm(self._align, self._tp_align)
        self.shared_prefix_tokens = shared_prefix_tokens
        if (max_packed_tokens or shared_prefix_tokens) and getattr(gpt.config, "multi_latent_attention", False):
            raise ValueError("--sequence-packing / --shared-prefix are not built for multi-latent attention "
                             "(glm4_moe_lite): megatron-core's MLA rotates positions 0..S-1 of the whole microbatch, "
                             "so a packed or shared-prefix segment would get the wrong RoPE positions "
                             "(megatron_tsync/model/mla.py)")
        if shared_prefix_tokens:
            cores = {type(m).__name__ for m in gpt.modules() if "DotProductAttention" in type(m).__name__
                     or type(m).__name__ == "SDPAttention"}
            if not cores or cores - {"SDPAttention", "DotProductAttention"}:
                raise ValueError(f"--shared-prefix needs the local layer spec's attention (a T×T mask), not {cores}")
        if (max_packed_tokens and not self._thd) or shared_prefix_tokens:
            compat.install_per_token_rope(gpt)
        self.mix_groups = mix_groups
        if mix_groups:
            why = ("it needs --sequence-packing" if not max_packed_tokens else "not with expert parallelism"
                   if self.lockstep.on else "not with --max-device-buckets" if buckets.residency is not None
                   else "not with --accumulate-on-host" if buckets.host is not None else None)  # --deterministic refuses packing above
            if why:
                raise ValueError(f"--pack-across-groups: {why}")
            row_split.install(gpt)
        if full_microbatches and not max_packed_tokens:
            raise ValueError("--stream-full-microbatches needs --sequence-packing")
        self.full_microbatches = full_microbatches
        self.waiting: list[WorkItem] = []  # items of packs that were not full (full_microbatches)
        self.samples: dict[str, Sample] = {}
        self.planner: StepPlanner | None = None
        self.shape: BatchShape | None = None
        self.busy: list[tuple[float, float]] = []  # (start, end) perf_counter of each schedule call
        self.losses: list[float] = []  # the value of each backpropagated term (surrogates included)
        self.values: dict[str, list] = {}  # traj_id -> [P, N, K] of this minibatch, read at the barrier (objective.py)
        self.microbatches = 0
        self.packed_items = 0  # items that shared a microbatch with others
        self.shared_prefix_items = 0  # items that ran as continuations of a shared prefix
        self.prefix_routing_split = 0  # members kept from their group's shared prefix: their prompt routes otherwise
        self._waited: set[tuple[str, bool]] = set()  # items that waited for a fuller microbatch (full_microbatches)
        self.keep_theta0 = False  # store π_θ0 of each forward at θ0 in Sample.meta[THETA0_LOGP]
        self._fw = 0  # index of the next forward in the running schedule call (bucket residency's plan)

    def begin_step(self, planner: StepPlanner, shape: BatchShape) -> None:
        self.planner, self.shape = planner, shape
        self.samples.clear()
        self.busy.clear()
        self.losses.clear()
        self.values.clear()
        self.microbatches = 0
        self.packed_items = 0
        self.shared_prefix_items = 0
        self.prefix_routing_split = 0
        self._waited.clear()

    def begin_phase(self, planner: StepPlanner, shape: BatchShape, loss_cfg: LossConfig) -> None:
        """A new minibatch/epoch of the same step: new planner, denominators and loss config; samples are kept."""
        self.planner, self.shape, self.cfg = planner, shape, loss_cfg
        self.values.clear()

    def add_sample(self, s: Sample) -> None:
        self.samples[s.traj_id] = s

    # ------------------------------------------------------------------ schedule
    def run(self, items: list[WorkItem], final: bool = False) -> None:
        """Run ``items`` (and any that waited). With ``full_microbatches`` and not ``final``, the packed microbatches
        that are not full wait for the next call."""
        if self.waiting:
            items, self.waiting = self.waiting + items, []
        if self.canonical is not None:  # canonical order within a call: sync / stream-group fold as they go
            items = _split_parts(sorted(items, key=lambda it: canonical_key(it.traj_id)), self.cfg.has_aux)
        if not items and not self.lockstep.on:
            return
        t0 = time.perf_counter()
        packs: list = []
        if self.shared_prefix_tokens and items:
            shared, items, split = plan_shared_prefix(
                items, lambda it: self.samples[it.traj_id].token_ids, lambda it: self.samples[it.traj_id].loss_mask,
                self.shared_prefix_tokens, routing=lambda it: self.samples[it.traj_id].routing)
            packs = [_PrefixPack(p, lay.aligned(self._tp_align)) for p, lay in shared]
            self.shared_prefix_items += sum(len(p) for p in packs)
            self.prefix_routing_split += split
        key = mix_key if self.mix_groups else share_key
        planned = plan_microbatches(items, self._length, self.max_packed_tokens, key=key)
        if self.full_microbatches and not final:
            planned = self._hold_partial(planned, key)
        # mixed: segments with the same destinations adjacent, one row span each (_before_mixed_backward)
        packs += [sorted(p, key=_dest_order) for p in planned] if self.mix_groups else planned
        if self.lockstep.on:  # the same slots on every expert-parallel rank
            packs = self._lockstep_slots(packs)
        if not packs:
            return
        self._note_direct(packs)
        self._plan_residency(packs)
        seq = max(max(self._pack_tokens(p) for p in packs), _IDLE_TOKENS)
        self.fb(
            forward_step_func=self._forward_step,
            data_iterator=iter(packs),
            model=[self.model],
            num_microbatches=len(packs),
            seq_length=seq,
            micro_batch_size=1,
            forward_only=False,
        )
        self.buckets.route_accumulator()
        self.microbatches += len(packs)
        self.packed_items += sum(len(p) for p in packs if len(p) > 1)
        self.busy.append((t0, time.perf_counter()))

    @property
    def waited_items(self) -> int:
        """Items of this step that waited for a fuller microbatch at least once."""
        return len(self._waited)

    def _length(self, it: WorkItem) -> int:
        return self.samples[it.traj_id].token_ids.shape[0]

    def _hold_partial(self, planned: list[list[WorkItem]], key) -> list[list[WorkItem]]:
        """The packs to run now; the others wait in ``self.waiting``. A pack waits when the shortest item of this
        call would still fit in it (it is not full), every item has a share key and none may defer (a deferral
        must reach the planner before its group closes)."""
        if not planned:
            return planned
        shortest = min(self._length(it) for p in planned for it in p)
        run = []
        for p in planned:
            fill = sum(self._length(it) for it in p)
            if (fill + shortest <= self.max_packed_tokens and key(p[0]) is not None
                    and not any(it.may_defer for it in p)):
                self.waiting += p
                self._waited.update((it.traj_id, it.policy) for it in p)
            else:
                run.append(p)
        return run

    def _note_direct(self, packs: list) -> None:
        """stream-trajectory: the trajectories trained straight into the accumulator with their advantage (the
        direct path), for the buckets' traffic accounting (``GroupBuckets.note_direct``)."""
        if self.planner.mode != "stream-trajectory" or self.canonical is not None:
            return
        for pack in packs:
            for it in () if isinstance(pack, _IdleSlot) else pack:
                if it.dest is Dest.ACCUM and it.policy:
                    self.buckets.note_direct(it.group_id, it.reward,
                                             self.planner.alpha_known(self.planner.groups[it.group_id].size))

    def _pack_tokens(self, pack: list[WorkItem]) -> int:
        if isinstance(pack, _PrefixPack):
            return pack.layout.total
        n = sum(self.samples[it.traj_id].token_ids.shape[0] for it in pack)
        return n if len(pack) == 1 else n + (-n) % self._align

    def close(self, closes) -> None:
        """Fold closed groups' buckets into the accumulator. Their waiting bucket items (``full_microbatches``)
        first become accumulator items with their advantage (``StepPlanner.redirect``): exact, no bucket work for
        them, and the bucket folds now."""
        t0 = time.perf_counter()
        closes = list(closes) + self._peer_bucket_closes(closes)
        closing = {op.group_id for op in closes}
        res = self.buckets.residency
        if res is not None and closes:  # the closes' vectors, in order (prefetched one close ahead)
            res.plan([op.group_id for op in closes] + self._queued_groups())
        if self.waiting and closing:
            self.waiting = [new for it in self.waiting for new in
                            (self.planner.redirect(it) if it.group_id in closing and it.dest is Dest.BUCKET
                             and it.policy else [it])]
        for i, op in enumerate(closes):
            self.buckets.close(op.group_id, op.alpha, op.q_coefficient)
            if res is not None:
                res.advance(i + 1)
        if closes:
            self.busy.append((t0, time.perf_counter()))

    def _peer_bucket_closes(self, closes) -> list:
        """EP > 1: an idle slot enters its bucket on every rank (``_lockstep_slots``), so this rank may hold the bucket
        of a group whose bucket items all ran on other ranks (its planner opened none): it closes with the group, by the
        same op (every rank's planner knows every reward)."""
        if not self.lockstep.on or self.planner is None:
            return []
        have = {op.group_id for op in closes}
        return [self.planner.close_op(gid) for gid in list(self.buckets.buckets)
                if gid not in have and self.planner.groups[gid].closed]

    def _forward_step(self, data_iterator, model):
        pack: list[WorkItem] = next(data_iterator)
        idx, self._fw = self._fw, self._fw + 1  # this microbatch's place in the schedule (_backward_hook)
        self._announce(pack)
        if isinstance(pack, _IdleSlot):
            return self._idle_forward(model, pack.key, idx)
        samples = [self.samples[it.traj_id] for it in pack]
        states = [{"deferred": False} for _ in pack]
        dev = _device()
        lengths = [s.token_ids.shape[0] for s in samples]
        if isinstance(pack, _PrefixPack):  # one prompt, several continuations (packing.PrefixLayout)
            layout = pack.layout
            ids = layout.token_ids([s.token_ids for s in samples]).to(dev).unsqueeze(0)  # (1, T)
            pos = layout.position_ids(dev)
            routing = moe.shared_prefix_routing([s.routing for s in samples], lengths, layout.prefix, layout.pad)
            with moe.replay_microbatch(model, routing), compat.rope_positions(self._gpt, pos), \
                    compat.forward_without_cpu_mode():
                out = model(ids, pos.unsqueeze(0), layout.mask(dev))
        elif len(pack) == 1:  # one trajectory: plain causal attention, as without packing
            ids = samples[0].token_ids.to(dev).unsqueeze(0)  # (1, T)
            pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0)
            with moe.replay_microbatch(model, moe.microbatch_routing([samples[0].routing], lengths)), \
                    compat.forward_without_cpu_mode():
                out = model(ids, pos, None)  # last stage: (1, T, V/tp) logits; other stages: hidden states
            layout = None
        else:
            layout = layout_for(lengths, align=self._align)
            parts = [s.token_ids for s in samples] + ([torch.zeros(layout.pad, dtype=torch.long)] if layout.pad else [])
            ids = torch.cat(parts).to(dev).unsqueeze(0)  # (1, T) all segments (+ padding)
            pos = layout.position_ids(dev)  # (T,) restarting per segment
            routing = moe.microbatch_routing([s.routing for s in samples], lengths, layout.pad)
            plan = row_split.RowPlan() if self.mix_groups and len({share_key(it) for it in pack}) > 1 else None
            with moe.replay_microbatch(model, routing), compat.forward_without_cpu_mode(), \
                    (row_split.active(plan) if plan is not None else contextlib.nullcontext()):
                if self._thd:
                    out = model(ids, pos.unsqueeze(0), None, packed_seq_params=layout.packed_seq_params(dev))
                else:
                    with compat.rope_positions(self._gpt, pos):
                        out = model(ids, pos.unsqueeze(0), layout.block_causal_mask(dev))
            if plan is not None and out.grad_fn is not None:
                out.grad_fn.register_prehook(functools.partial(self._before_mixed_backward, pack, states, layout, plan))
                return out, functools.partial(self._loss, pack, samples, states, layout)
        if out.grad_fn is not None:
            out.grad_fn.register_prehook(functools.partial(self._backward_hook, pack[0], states, idx))
        return out, functools.partial(self._loss, pack, samples, states, layout)

    def _announce(self, pack) -> None:
        """Host accumulation: the scratch's previous backward is complete; flush it now (overlapping this forward)
        unless this microbatch writes the same vector (``GroupBuckets.next_backward``)."""
        if self.buckets.host is None:
            return
        key = pack.key if isinstance(pack, _IdleSlot) else self._slot_key(pack)
        if key[0] == "bucket":
            self.buckets.next_backward(key[1], key[2])
        else:
            self.buckets.next_backward(None, None)

    def _slot_key(self, pack: list[WorkItem]) -> tuple:
        """Where a microbatch's gradient goes (``_before_backward``): a group's bucket at a reward, or the
        accumulator; deterministic mode: the trajectory part's own canonical vector (module docstring)."""
        it = pack[0]
        if self.canonical is not None:
            return "canon", it.traj_id, it.group_id, "policy" if it.policy else "aux", bool(it.may_defer and it.policy)
        return ("bucket", it.group_id, float(it.reward)) if it.dest is Dest.BUCKET and it.policy else ("accum",)

    def _lockstep_slots(self, packs: list[list[WorkItem]]) -> list[list[WorkItem]]:
        """EP > 1: the run point's slots, agreed over the expert-parallel group (``ExpertLockstep.schedule``): each
        slot has one gradient destination on every rank, because a rank's expert gradients hold the other ranks'
        tokens of that slot too; a rank with no microbatch for a slot runs an idle one routed there."""
        keys = [self._slot_key(p) for p in packs]
        queues: dict[tuple, list] = {}
        for p, k in zip(packs, keys):
            queues.setdefault(k, []).append(p)
        return [queues[k].pop(0) if queues.get(k) else _IdleSlot(k) for k in self.lockstep.schedule(keys)]

    def _route_slot(self, key: tuple, deferred: bool = False) -> None:
        """Route a lockstep slot's backward to its destination; ``deferred``: this rank's microbatch of the slot
        deferred (deterministic mode: agreed over the group, a deferred part adds exact zeros to the accumulator)."""
        if key[0] == "canon":
            _, tid, gid, part, may_defer = key
            if may_defer and self.lockstep.any(deferred):
                self.canonical.route_accumulator()
            else:
                self.canonical.enter(tid, gid, part)
        elif key[0] == "bucket":
            _, gid, reward = key
            self.buckets.enter(gid, reward, self.planner.alpha_known(self.planner.groups[gid].size))
        else:
            self.buckets.route_accumulator()

    def _idle_forward(self, model, key: tuple, idx: int):
        """An expert-lockstep idle microbatch (``_lockstep_slots``): 2 tokens through the model, loss 0·Σ logits;
        its backward runs the all-to-alls and brings the other ranks' tokens' expert gradients to its slot's
        destination (its own tokens add exact zeros)."""
        dev = _device()
        ids = torch.zeros(1, _IDLE_TOKENS, dtype=torch.long, device=dev)
        out = model(ids, torch.arange(_IDLE_TOKENS, device=dev).unsqueeze(0), None)
        if out.grad_fn is not None:
            out.grad_fn.register_prehook(functools.partial(self._before_idle_backward, key, idx))

        def loss(logits):
            zero = 0.0 * logits.sum()
            return zero, torch.tensor(0, dtype=torch.int), {"loss": zero.detach()}

        return out, loss

    def _before_idle_backward(self, key: tuple, idx: int, grad_outputs):
        self._route_slot(key)
        self.buckets.begin_backward()
        self._prefetch_after(idx)
        return None

    def _backward_hook(self, item: WorkItem, states: list[dict], idx: int, grad_outputs):
        """Route microbatch ``idx``'s gradient (:meth:`_before_backward`), then let bucket residency prefetch what the
        next microbatch writes, so the copy overlaps with this backward and the next forward."""
        self._before_backward(item, states, grad_outputs)
        self.buckets.begin_backward()
        self._prefetch_after(idx)
        return None

    def _plan_residency(self, packs: list) -> None:
        """Bucket residency (``streaming/offload.py``): the groups these microbatches write, in order, then the groups
        the planner still holds landed trajectories of: its eviction order and prefetches follow them."""
        self._fw = 0
        res = self.buckets.residency
        if res is not None:
            res.plan([self._dest_group(p) for p in packs] + self._queued_groups())

    def _queued_groups(self) -> list[str]:
        return self.planner.queued_groups() if self.planner is not None else []

    def _dest_group(self, pack) -> str | None:
        """The group whose vectors a microbatch writes (None: the accumulator)."""
        key = pack.key if isinstance(pack, _IdleSlot) else self._slot_key(pack)
        return key[2] if key[0] == "canon" else key[1] if key[0] == "bucket" else None

    def _prefetch_after(self, idx: int) -> None:
        if self.buckets.residency is not None:
            self.buckets.residency.advance(idx + 1)

    def _before_backward(self, item: WorkItem, states: list[dict], grad_outputs):
        """Route the microbatch's gradient. Items of one microbatch share the destination (``packing.share_key``):
        an accumulator pack, or bucket items of one group with one reward. A bucket pack whose items all deferred
        contributes zero and enters no bucket (as an unpacked deferred item). Deterministic mode: the trajectory's own
        vector for this part (a deferred item adds exact zeros to the accumulator)."""
        if self.canonical is not None and self.lockstep.on:  # agreed with the slot's idle ranks (_route_slot)
            self._route_slot(self._slot_key([item]), states[0]["deferred"])
            return None
        if self.canonical is not None:
            if states[0]["deferred"]:
                self.canonical.route_accumulator()
            else:
                self.canonical.enter(item.traj_id, item.group_id, "policy" if item.policy else "aux")
            return None
        if self.lockstep.on:  # the slot's destination on every EP rank, deferred or not (a deferred item adds 0)
            self._route_slot(self._slot_key([item]))
        elif item.dest is Dest.BUCKET and item.policy and not all(st["deferred"] for st in states):
            alpha = self.planner.alpha_known(self.planner.groups[item.group_id].size)
            self.buckets.enter(item.group_id, item.reward, alpha)
        else:
            self.buckets.route_accumulator()
        return None

    def _before_mixed_backward(self, pack: list[WorkItem], states: list[dict], layout, plan, grad_outputs):
        """A mixed microbatch's destinations (module docstring): each segment's (vector, coefficient) targets,
        adjacent segments with the same targets as one :class:`row_split.RowSpan` (one GEMM per parameter). A
        deferred item (last stage) contributes zero and goes nowhere; stages before the last do not know deferrals
        and add its zeros."""
        spans: list[tuple[int, int, list]] = []
        for it, st, (a, b) in zip(pack, states, layout.segments()):
            if st["deferred"]:
                continue
            if it.dest is Dest.BUCKET and it.policy:
                size = self.planner.groups[it.group_id].size
                targets = self.buckets.destinations(it.group_id, it.reward, self.planner.alpha_known(size))
            else:
                targets = [(self.buckets.accumulator, 1.0)]
            if spans and spans[-1][1] == a and spans[-1][2] == targets:  # same destinations: one span
                spans[-1] = (spans[-1][0], b, targets)
            else:
                spans.append((a, b, targets))
        grad_of = self.buckets.router.grad_of
        plan.spans = [row_split.RowSpan(a, b, [(grad_of(v), c) for v, c in targets]) for a, b, targets in spans]
        return None

    # ------------------------------------------------------------------ loss
    def _loss(self, pack: list[WorkItem], samples: list[Sample], states: list[dict], layout, logits: torch.Tensor):
        """Sum of the segments' loss terms; logits (1, T, V/tp) of the whole (packed) microbatch. Log-probs (and
        entropies) are computed once over the whole microbatch and cut per segment (the last position of each
        segment, which would "predict" the next segment's first token, is never used): no slice of the (T, V) logits,
        whose backward would fill a zero (T, V) gradient per segment."""
        with compat.forward_without_cpu_mode():  # our own torch code: no CUDA device requests to map
            return self._loss_terms(pack, samples, states, layout, logits)

    def _loss_terms(self, pack: list[WorkItem], samples: list[Sample], states: list[dict], layout,
                    logits: torch.Tensor):
        cfg = self.cfg
        need_ent = cfg.entropy_coef != 0.0 and any(it.aux for it in pack)
        segs = [(0, samples[0].token_ids.numel())] if layout is None else layout.segments()
        starts = [0] if layout is None else layout.starts()  # where each segment starts in its trajectory
        targets = torch.zeros(logits.shape[1], dtype=torch.long, device=logits.device)
        for s, (a, b), o in zip(samples, segs, starts):
            targets[a : b - 1] = s.token_ids[o + 1:].to(logits.device)  # position t predicts token t + 1
        logp = vocab_parallel_logprobs(logits, targets.unsqueeze(0), temperature=cfg.temperature)  # (1, T)
        ent = vocab_parallel_entropy(logits, temperature=cfg.temperature) if need_ent else None
        total, n_act = logits.new_zeros(()), 0
        for it, s, st, (a, b), o in zip(pack, samples, states, segs, starts):
            seg_ent = None if ent is None else ent[:, a : b - 1]
            term, n = self._segment_loss(it, s, st, logp[:, a : b - 1], seg_ent, o)
            total, n_act = total + term, n_act + n
        if not total.requires_grad:  # every term deferred: keep the graph alive, contribute exactly zero
            total = total + 0.0 * logits.sum()
        report = total.detach().clone()
        return total, torch.tensor(n_act, dtype=torch.int), {"loss": report}

    def _segment_loss(self, item: WorkItem, s: Sample, state: dict, logp: torch.Tensor, ent: torch.Tensor | None,
                      start: int = 0):
        """One trajectory's loss term from its log-probs (1, T_i - 1 - start) of tokens start + 1.. (entropies
        likewise, when an entropy term is on; ``start`` > 0: a shared-prefix continuation, whose tokens before
        ``start`` are prompt, loss mask 0); returns (term, action tokens)."""
        cfg = self.cfg
        o = start
        w = s.loss_mask[1 + o:].to(logp).unsqueeze(0)  # (1, T-1-o) action tokens
        n_act = int(s.loss_mask[1:].sum())
        nu = sequence_weight(
            cfg.aggregation, n_act, num_sequences=self.shape.num_sequences, max_len=self.shape.max_len
        )
        beh = None if s.behaviour_logp is None else s.behaviour_logp[1 + o:].to(logp).unsqueeze(0)
        if cfg.old_logprobs == "engine":
            if beh is None:
                raise ValueError(f"trajectory {s.traj_id}: --old-logprobs engine needs behaviour log-probs")
            old = beh
        elif cfg.old_logprobs == "theta0":  # π_θ0 kept by the learner (minibatches ≥ 2, later epochs; §5)
            old = s.meta.get(THETA0_LOGP)
            if old is None:
                raise AssertionError(f"trajectory {s.traj_id}: no θ0 log-probs were kept for it")
            old = old[o:].to(logp).unsqueeze(0)
        else:
            old = logp.detach()
            if self.keep_theta0:  # this forward runs at θ0: keep π_θ0 for later minibatches / epochs
                s.meta[THETA0_LOGP] = torch.cat([old.new_zeros(o), old[0]])  # (T-1,); the prompt's entries unread
        total = logp.new_zeros(())
        value = self.values.setdefault(s.traj_id, [0.0, 0.0, 0.0])  # the objective's scalars, for the log
        if item.policy:
            value[0], value[1] = signed_policy_values(logp, old, w, nu, cfg.policy, beh)
        if item.policy and self.canonical is not None:
            ratio = importance_ratio(logp.detach(), old)
            sign = 1 if sign_free(ratio, cfg.policy, w) else item.adv_sign
            if sign is None:  # clip mask depends on a sign only the group's close knows
                if not item.may_defer:
                    raise AssertionError(f"trajectory {s.traj_id}: no sign for a clipped surrogate")
                state["deferred"] = True
                self.planner.report_deferred(item, _meta(s))
            else:
                total = total + nu * (surrogate(logp, old, sign, cfg.policy, beh) * w).sum()
        elif item.policy:
            if item.advantage is not None:
                adv = torch.tensor([item.advantage], dtype=logp.dtype, device=logp.device)
                per = policy_loss(logp, old, adv, cfg.policy, beh)
                total = total + nu * (per * w).sum()
            else:
                ratio = importance_ratio(logp.detach(), old)
                if item.may_defer and not sign_free(ratio, cfg.policy, w):
                    state["deferred"] = True
                    self.planner.report_deferred(item, _meta(s))
                else:
                    per = surrogate(logp, old, item.adv_sign or 1, cfg.policy, beh)
                    total = total + nu * (per * w).sum()
        if item.aux:
            aux = 0.0
            if cfg.kl_mode == "loss" and cfg.kl_coef != 0.0:
                if s.ref_logp is None:
                    raise ValueError(f"trajectory {s.traj_id}: KL loss needs reference log-probs")
                ref = s.ref_logp[1 + o:].to(logp).unsqueeze(0)
                kl = nu * cfg.kl_coef * (kl_penalty(logp, ref, cfg.kl_kind) * w).sum()
                total, aux = total + kl, aux + kl.detach()
            if cfg.entropy_coef != 0.0:
                bonus = nu * cfg.entropy_coef * (ent * w).sum()
                total, aux = total - bonus, aux - bonus.detach()
            value[2] = aux
        self.losses.append(float(total.detach()))
        return total, n_act


def _dest_order(it: WorkItem) -> tuple:
    """Order of a mixed microbatch's segments: accumulator items, then each group's by reward."""
    return (0, "", 0.0) if it.dest is Dest.ACCUM else (1, it.group_id, float(it.reward))


def _split_parts(items: list[WorkItem], has_aux: bool) -> list[WorkItem]:
    """Deterministic mode: one microbatch per (trajectory, part): the policy term, then the aux terms if any."""
    out = []
    for it in items:
        if it.policy:
            out.append(dataclasses.replace(it, aux=False))
        if it.aux and has_aux:
            out.append(dataclasses.replace(it, policy=False, may_defer=False))
    return out


class _PrefixPack(list):
    """The work items of one shared-prefix microbatch and its ``packing.PrefixLayout``."""

    def __init__(self, items: list[WorkItem], layout: PrefixLayout):
        super().__init__(items)
        self.layout = layout


class _IdleSlot(list):
    """An empty microbatch of an expert-lockstep slot whose destination is ``key`` (``_lockstep_slots``)."""

    def __init__(self, key: tuple):
        super().__init__()
        self.key = key


def _meta(s: Sample) -> TrajMeta:
    return TrajMeta(s.traj_id, s.group_id, train_reward(s), s.num_action_tokens, s.dp_rank)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

