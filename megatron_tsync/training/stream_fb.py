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
(:class:`GroupBuckets.enter`) or back at the DDP buffer (the batch accumulator). No scratch buffer, no copy.

Loss per trajectory i (B = trajectories in the batch, ν_i from ``algorithms.aggregation``):
  policy term, advantage known:  ν_i Σ_t w_t ℓ_t(A_i)     (reference PPO/PG loss)
  policy term, into a bucket:    ν_i Σ_t w_t s_t(sign)     (reward-free surrogate; A_i applied at close)
  aux terms (accumulator only):  ν_i Σ_t w_t (β_KL·kl_t − c_H·H_t)
The schedule is run with ``calculate_per_token_loss`` so it neither averages nor scales; the explicit
denominator is applied once at the barrier.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

from megatron_tsync.algorithms.aggregation import sequence_weight
from megatron_tsync.algorithms.kl import kl_penalty
from megatron_tsync.algorithms.policy_loss import PolicyLossConfig, policy_loss, sign_free, surrogate
from megatron_tsync.streaming.accumulator import GroupBuckets
from megatron_tsync.streaming.planner import Dest, StepPlanner, TrajMeta, WorkItem
from megatron_tsync.streaming.ready_queue import Sample
from megatron_tsync.model import compat
from megatron_tsync.model.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs
from megatron_tsync.model.builder import unwrap
from megatron_tsync.training.packing import layout_for, plan_microbatches, uses_te_attention

THETA0_LOGP = "theta0_logp"  # Sample.meta key: (T-1,) trainer log-probs of tokens 1..T-1 at θ0


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

    def __init__(self, ddp_model, buckets: GroupBuckets, loss_cfg: LossConfig, *, max_packed_tokens: int | None = None):
        """``max_packed_tokens``: pack items that share a gradient destination into microbatches of at most this many
        tokens (``training.packing``); None = one trajectory per microbatch."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.model = ddp_model
        self.buckets = buckets
        self.cfg = loss_cfg
        self.fb = get_forward_backward_func()
        self.max_packed_tokens = max_packed_tokens
        gpt = unwrap(ddp_model)
        self._gpt = gpt
        self._thd = bool(max_packed_tokens) and uses_te_attention(gpt)
        self._align = 16 if self._thd and getattr(gpt.config, "fp8", None) else 1  # FP8 GEMMs want T % 16 == 0
        if max_packed_tokens and not self._thd:
            compat.install_per_token_rope(gpt)
        self.samples: dict[str, Sample] = {}
        self.planner: StepPlanner | None = None
        self.shape: BatchShape | None = None
        self.busy: list[tuple[float, float]] = []  # (start, end) perf_counter of each schedule call
        self.losses: list[float] = []
        self.microbatches = 0
        self.packed_items = 0  # items that shared a microbatch with others
        self.keep_theta0 = False  # store π_θ0 of each forward at θ0 in Sample.meta[THETA0_LOGP]

    def begin_step(self, planner: StepPlanner, shape: BatchShape) -> None:
        self.planner, self.shape = planner, shape
        self.samples.clear()
        self.busy.clear()
        self.losses.clear()
        self.microbatches = 0
        self.packed_items = 0

    def begin_phase(self, planner: StepPlanner, shape: BatchShape, loss_cfg: LossConfig) -> None:
        """A new minibatch/epoch of the same step: new planner, denominators and loss config; samples are kept."""
        self.planner, self.shape, self.cfg = planner, shape, loss_cfg

    def add_sample(self, s: Sample) -> None:
        self.samples[s.traj_id] = s

    # ------------------------------------------------------------------ schedule
    def run(self, items: list[WorkItem]) -> None:
        if not items:
            return
        t0 = time.perf_counter()
        packs = plan_microbatches(items, lambda it: self.samples[it.traj_id].token_ids.shape[0],
                                  self.max_packed_tokens)
        seq = max(self._pack_tokens(p) for p in packs)
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

    def _pack_tokens(self, pack: list[WorkItem]) -> int:
        n = sum(self.samples[it.traj_id].token_ids.shape[0] for it in pack)
        return n if len(pack) == 1 else n + (-n) % self._align

    def close(self, closes) -> None:
        t0 = time.perf_counter()
        for op in closes:
            self.buckets.close(op.group_id, op.alpha, op.q_coefficient)
        if closes:
            self.busy.append((t0, time.perf_counter()))

    def _forward_step(self, data_iterator, model):
        pack: list[WorkItem] = next(data_iterator)
        samples = [self.samples[it.traj_id] for it in pack]
        states = [{"deferred": False} for _ in pack]
        dev = _device()
        if len(pack) == 1:  # one trajectory: plain causal attention, as without packing
            ids = samples[0].token_ids.to(dev).unsqueeze(0)  # (1, T)
            pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0)
            out = model(ids, pos, None)  # last stage: (1, T, V/tp) logits; other stages: hidden states
            layout = None
        else:
            layout = layout_for([s.token_ids.shape[0] for s in samples], align=self._align)
            parts = [s.token_ids for s in samples] + ([torch.zeros(layout.pad, dtype=torch.long)] if layout.pad else [])
            ids = torch.cat(parts).to(dev).unsqueeze(0)  # (1, T) all segments (+ padding)
            pos = layout.position_ids(dev)  # (T,) restarting per segment
            if self._thd:
                out = model(ids, pos.unsqueeze(0), None, packed_seq_params=layout.packed_seq_params(dev))
            else:
                with compat.rope_positions(self._gpt, pos):
                    out = model(ids, pos.unsqueeze(0), layout.block_causal_mask(dev))
        if out.grad_fn is not None:
            out.grad_fn.register_prehook(functools.partial(self._before_backward, pack[0], states))
        return out, functools.partial(self._loss, pack, samples, states, layout)

    def _before_backward(self, item: WorkItem, states: list[dict], grad_outputs):
        """Route the microbatch's gradient. Items of one microbatch share the destination (``packing.share_key``):
        an accumulator pack, or bucket items of one group with one reward. A bucket pack whose items all deferred
        contributes zero and enters no bucket (as an unpacked deferred item)."""
        if item.dest is Dest.BUCKET and item.policy and not all(st["deferred"] for st in states):
            alpha = self.planner.alpha_known(self.planner.groups[item.group_id].size)
            self.buckets.enter(item.group_id, item.reward, alpha)
        else:
            self.buckets.route_accumulator()
        return None

    # ------------------------------------------------------------------ loss
    def _loss(self, pack: list[WorkItem], samples: list[Sample], states: list[dict], layout, logits: torch.Tensor):
        """Sum of the segments' loss terms; logits (1, T, V/tp) of the whole (packed) microbatch."""
        if layout is None:
            total, n_act = self._segment_loss(pack[0], samples[0], states[0], logits)
        else:
            total, n_act = logits.new_zeros(()), 0
            for it, s, st, (a, b) in zip(pack, samples, states, layout.segments()):
                term, n = self._segment_loss(it, s, st, logits[:, a:b])  # (1, T_k, V/tp): this segment only
                total, n_act = total + term, n_act + n
        if not total.requires_grad:  # every term deferred: keep the graph alive, contribute exactly zero
            total = total + 0.0 * logits.sum()
        report = total.detach().clone()
        return total, torch.tensor(n_act, dtype=torch.int), {"loss": report}

    def _segment_loss(self, item: WorkItem, s: Sample, state: dict, logits: torch.Tensor):
        """One trajectory's loss term from its own logits (1, T_i, V/tp); returns (term, action tokens)."""
        cfg = self.cfg
        ids = s.token_ids.to(logits.device).unsqueeze(0)
        logp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], temperature=cfg.temperature)  # (1, T-1)
        w = s.loss_mask[1:].to(logp).unsqueeze(0)  # (1, T-1) action tokens
        n_act = int(s.loss_mask[1:].sum())
        nu = sequence_weight(
            cfg.aggregation, n_act, num_sequences=self.shape.num_sequences, max_len=self.shape.max_len
        )
        beh = None if s.behaviour_logp is None else s.behaviour_logp[1:].to(logp).unsqueeze(0)
        if cfg.old_logprobs == "engine":
            if beh is None:
                raise ValueError(f"trajectory {s.traj_id}: --old-logprobs engine needs behaviour log-probs")
            old = beh
        elif cfg.old_logprobs == "theta0":  # π_θ0 kept by the learner (minibatches ≥ 2, later epochs; §5)
            old = s.meta.get(THETA0_LOGP)
            if old is None:
                raise AssertionError(f"trajectory {s.traj_id}: no θ0 log-probs were kept for it")
            old = old.to(logp).unsqueeze(0)
        else:
            old = logp.detach()
            if self.keep_theta0:  # this forward runs at θ0: keep π_θ0 for later minibatches / epochs
                s.meta[THETA0_LOGP] = old[0].clone()
        total = logits.new_zeros(())
        if item.policy:
            if item.advantage is not None:
                adv = torch.tensor([item.advantage], dtype=logp.dtype, device=logp.device)
                per = policy_loss(logp, old, adv, cfg.policy, beh)
                total = total + nu * (per * w).sum()
            else:
                ratio = torch.exp(logp.detach() - old)
                if item.may_defer and not sign_free(ratio, cfg.policy, w):
                    state["deferred"] = True
                    self.planner.report_deferred(item, _meta(s))
                else:
                    per = surrogate(logp, old, item.adv_sign or 1, cfg.policy, beh)
                    total = total + nu * (per * w).sum()
        if item.aux:
            if cfg.kl_mode == "loss" and cfg.kl_coef != 0.0:
                if s.ref_logp is None:
                    raise ValueError(f"trajectory {s.traj_id}: KL loss needs reference log-probs")
                ref = s.ref_logp[1:].to(logp).unsqueeze(0)
                total = total + nu * cfg.kl_coef * (kl_penalty(logp, ref, cfg.kl_kind) * w).sum()
            if cfg.entropy_coef != 0.0:
                ent = vocab_parallel_entropy(logits[:, :-1], temperature=cfg.temperature)  # (1, T-1)
                total = total - nu * cfg.entropy_coef * (ent * w).sum()
        self.losses.append(float(total.detach()))
        return total, n_act


def _meta(s: Sample) -> TrajMeta:
    return TrajMeta(s.traj_id, s.group_id, s.reward, s.num_action_tokens, s.dp_rank)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
