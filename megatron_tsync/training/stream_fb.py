"""The streaming forward-backward: planned work items through Megatron's schedules.

Each :class:`~megatron_tsync.streaming.planner.WorkItem` is one microbatch (one trajectory, micro-batch size 1)
of ``get_forward_backward_func()`` — no pipelining on one stage, 1F1B with variable sequence lengths under
pipeline parallelism. Every PP stage and TP rank runs the same items in the same order.

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
from megatron_tsync.training.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs


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

    @property
    def has_aux(self) -> bool:
        return (self.kl_mode == "loss" and self.kl_coef != 0.0) or self.entropy_coef != 0.0


@dataclasses.dataclass
class BatchShape:
    """Batch-level constants the normalisers need (known before the first trajectory)."""

    num_sequences: int
    max_len: int | None = None


class StreamExecutor:
    """Runs work items for one rank; owns nothing but the per-step bookkeeping of busy time."""

    def __init__(self, ddp_model, buckets: GroupBuckets, loss_cfg: LossConfig):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.model = ddp_model
        self.buckets = buckets
        self.cfg = loss_cfg
        self.fb = get_forward_backward_func()
        self.samples: dict[str, Sample] = {}
        self.planner: StepPlanner | None = None
        self.shape: BatchShape | None = None
        self.busy: list[tuple[float, float]] = []  # (start, end) perf_counter of each schedule call
        self.losses: list[float] = []
        self.microbatches = 0

    def begin_step(self, planner: StepPlanner, shape: BatchShape) -> None:
        self.planner, self.shape = planner, shape
        self.samples.clear()
        self.busy.clear()
        self.losses.clear()
        self.microbatches = 0

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
        seq = max(self.samples[it.traj_id].token_ids.shape[0] for it in items)
        self.fb(
            forward_step_func=self._forward_step,
            data_iterator=iter(items),
            model=[self.model],
            num_microbatches=len(items),
            seq_length=seq,
            micro_batch_size=1,
            forward_only=False,
        )
        self.buckets.route_accumulator()
        self.microbatches += len(items)
        self.busy.append((t0, time.perf_counter()))

    def close(self, closes) -> None:
        t0 = time.perf_counter()
        for op in closes:
            self.buckets.close(op.group_id, op.alpha, op.q_coefficient)
        if closes:
            self.busy.append((t0, time.perf_counter()))

    def _forward_step(self, data_iterator, model):
        item: WorkItem = next(data_iterator)
        s = self.samples[item.traj_id]
        ids = s.token_ids.to(_device()).unsqueeze(0)  # (1, T)
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        out = model(ids, pos, None)  # last stage: (1, T, V/tp) logits; other stages: hidden states
        state = {"deferred": False}
        if out.grad_fn is not None:
            out.grad_fn.register_prehook(functools.partial(self._before_backward, item, state))
        return out, functools.partial(self._loss, item, s, state)

    def _before_backward(self, item: WorkItem, state: dict, grad_outputs):
        if item.dest is Dest.BUCKET and item.policy and not state["deferred"]:
            alpha = self.planner.alpha_known(self.planner.groups[item.group_id].size)
            self.buckets.enter(item.group_id, item.reward, alpha)
        else:
            self.buckets.route_accumulator()
        return None

    # ------------------------------------------------------------------ loss
    def _loss(self, item: WorkItem, s: Sample, state: dict, logits: torch.Tensor):
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
        else:
            old = logp.detach()
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
        if not total.requires_grad:  # deferred: keep the graph alive, contribute exactly zero
            total = total + 0.0 * logits.sum()
        report = total.detach().clone()
        self.losses.append(float(report))
        return total, torch.tensor(n_act, dtype=torch.int), {"loss": report}


def _meta(s: Sample) -> TrajMeta:
    return TrajMeta(s.traj_id, s.group_id, s.reward, s.num_action_tokens, s.dp_rank)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
