"""On-policy distillation (OPD) learner: ``sync``, ``stream-trajectory`` and exact ``stream-turn`` (streaming_math.md §6).

Input is a stream of :class:`TurnChunk` s: tokens ``[start, end)`` of a trajectory became available with their teacher
log-probs (tool output of the previous turn + the next generated turn). The per-token loss is ``algorithms.opd.opd_loss``
(sampled reverse KL, detached advantage a_t = −(log π_old − log π_teacher), importance ratio ρ_t = exp(logp − old_logp),
optional TIS to the engine) or, with teacher logits, the full-vocabulary reverse KL. Aggregation and the barrier divisor
come from ``algorithms.aggregation`` (ν_i before backward, divisor once at the barrier).

* ``sync``: when the last trajectory has arrived, every trajectory is one microbatch of megatron's
  ``get_forward_backward_func`` (one backward each), then the barrier.
* ``stream-trajectory``: a trajectory's forward-backward runs (same schedule) the moment its last chunk arrives.
* ``stream-turn``: each chunk's forward runs as it arrives, incrementally over the new tokens only
  (:class:`IncrementalGPT`): the K/V of earlier chunks are kept *with autograd*, so the per-turn loss tensors share one
  graph; one backward at the end of the trajectory gives exactly the batch gradient. ``head_first=True`` also runs
  the LM-head backward (final norm + output layer + loss) per chunk and the body backward once at the end (exact too;
  the chunk's logits are freed right away). Cutting the graph at turn boundaries would NOT be exact (the control in
  ``tests/training/test_opd_exactness.py``). With PP > 1 every stage runs its layers' incremental forward per chunk
  (one p2p of the chunk's hidden states (s, 1, h) per stage boundary) and keeps its own graph; at the trajectory's
  end the last stage's backward sends its received inputs' gradients down, one message per stage boundary, and each
  stage backprops all its chunk outputs at once (``training.opd_pipeline``). ``head_first`` works under PP too (the
  head is on the last stage).

MoE: with ``--moe-router-replay`` every forward (a chunk's, a trajectory's) routes each token to the experts the
engine recorded for it (``TurnChunk.routing``, ``model.moe.replay_microbatch``). At expert parallelism > 1 every
MoE all-to-all is a collective over data-parallel replicas that learn different trajectories: each poll of the
source is a schedule point of the expert-parallel group; ``sync`` / ``stream-trajectory`` pad their microbatches
with idle ones (``model.parallel.ExpertLockstep.count``), ``stream-turn`` runs lanes of matched chunk forwards with
one backward per lane (``training.opd_lanes``; under PP too). At TP > 1 a MoE model runs sequence parallel: the
incremental forward pads each chunk to a multiple of TP and hands back full, unpadded hidden states
(``model.incremental``), the replayed routing is sharded alike; TP 2 and TP 2 × PP 2 equal one process's sync.

Every gradient lands in megatron DDP's grad buffers (``main_grad``); the barrier is the one the GRPO learner uses
(``training.barrier.barrier_step``: DP reduction, explicit divisor, grad hook, optimizer step, zeroed grads; a
non-finite loss or gradient skips the update, ``OPDStepResult.skipped_updates``).

Deviations / limits:

* ``stream-turn`` under PP needs the pipeline group (``OPDLearner(pp_group=...)``) to address its neighbours;
  with PP > 1 and no group it falls back to ``stream-trajectory`` (logged, ``OPDStepResult.mode`` says so). Virtual
  pipeline (interleaved model chunks) is not supported by this learner in any mode (it takes one model chunk).
* Under PP the per-chunk p2p is blocking and in chunk order, so a stage waits for the previous one per chunk (no
  overlap of stages within a chunk: the tokens of one turn are one microbatch). Stages > 0 need every chunk of a
  trajectory, so all ranks of a pipeline must see the same chunk stream: the caller gives every rank the same source
  (this learner does not check it).
* The incremental forward re-implements the layer wiring (norm → qkv → RoPE → attention → proj → residual → norm →
  MLP → residual) from megatron's own submodules; attention itself is plain torch (rectangular causal mask over the
  cached keys). Exactness against megatron's full forward is what the tests check.
* ``seq-mean-token-mean`` needs T_i before the backward: fine for one backward at the end, refused with ``head_first``.
* Memory: every exact streaming scheme keeps the trajectory's activations alive through its tool calls; counted as
  ``peak_graph_bytes`` (tensors saved for backward, parameters excluded, deduplicated by storage; under PP per
  stage, this rank's own layers plus the chunk outputs it keeps for the pipeline backward). An estimate: storages are
  told apart by address (``SavedBytes``), so the figure can move by a few KiB from run to run with the allocator.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_tsync.algorithms.aggregation import barrier_divisor, sequence_weight
from megatron_tsync.algorithms.opd import opd_loss
from megatron_tsync.algorithms.policy_loss import PolicyLossConfig
from megatron_tsync.model import moe
from megatron_tsync.model.builder import unwrap
from megatron_tsync.model.incremental import IncrementalGPT
from megatron_tsync.model.parallel import ExpertLockstep
from megatron_tsync.streaming.ready_queue import Sample
from megatron_tsync.model.logprobs import _AllReduceSum, _tp_group_and_size, vocab_parallel_logprobs
from megatron_tsync.training.barrier import barrier_step
from megatron_tsync.training.opd_lanes import IDLE_TOKENS, TurnLanes, idle_forward
from megatron_tsync.training.opd_pipeline import StageGraph, StageLink, stage_backward, stage_forward
from megatron_tsync.training.stream_fb import BatchShape, LossConfig

log = logging.getLogger(__name__)

OPD_MODES = ("sync", "stream-trajectory", "stream-turn")
OPD_OBJECTIVES = ("sampled", "full-vocab")


@dataclasses.dataclass(frozen=True)
class OPDLearnerConfig:
    mode: str = "stream-turn"
    """"sync" | "stream-trajectory" | "stream-turn" (module docstring)."""
    loss: LossConfig = LossConfig(policy=PolicyLossConfig(kind="none"))
    """Policy loss (ratio / clipping / TIS), aggregation, temperature, old_logprobs ("trainer" | "engine")."""
    objective: str = "sampled"
    """"sampled": per-token sampled reverse KL (opd_loss); "full-vocab": Σ_v p_s (log p_s − log p_t) (teacher logits)."""
    head_first: bool = False
    """stream-turn only: LM-head backward per chunk, one body backward at the end of the trajectory."""
    poll_timeout_s: float = 0.05

    def __post_init__(self):
        if self.mode not in OPD_MODES:
            raise ValueError(f"OPD mode must be one of {OPD_MODES}, got {self.mode!r}")
        if self.objective not in OPD_OBJECTIVES:
            raise ValueError(f"OPD objective must be one of {OPD_OBJECTIVES}, got {self.objective!r}")
        if self.head_first and self.loss.aggregation == "seq-mean-token-mean":
            raise ValueError("head_first needs ν_i before the trajectory ends; seq-mean-token-mean needs T_i "
                             "(use token-mean / seq-mean-token-sum[-norm], or head_first=False)")


# ---------------------------------------------------------------------------------------------------- input stream
@dataclasses.dataclass
class TurnChunk:
    """Tokens ``[start, end)`` of trajectory ``traj_id`` became available; arrays cover the prefix ``[0, end)``.

    token_ids / loss_mask / teacher_logp / behaviour_logp: (end,) with the ``Sample`` conventions (entry t is about
    token t; t = 0 has no prediction). teacher_logits: (end − max(start, 1), V) full-vocabulary teacher logits that
    predict tokens [max(start, 1), end), or None (stream-turn sets it to None once the chunk's forward ran).
    ``last``: the trajectory ends with this chunk (it may add no tokens).
    """

    traj_id: str
    start: int
    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    teacher_logp: torch.Tensor | None
    behaviour_logp: torch.Tensor | None = None
    last: bool = False
    teacher_logits: torch.Tensor | None = None
    dp_rank: int = 0
    arrival_s: float = 0.0
    routing: torch.Tensor | None = None
    """``--moe-router-replay``: the engine's experts (P ≤ end, L, k) of the prefix's first P positions
    (``Sample.routing`` conventions, ``model.moe.microbatch_routing``); None: the student routes by itself."""

    @property
    def end(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def lo(self) -> int:
        """First predicted token of the chunk."""
        return max(self.start, 1)

    @property
    def num_action_tokens(self) -> int:
        return int(self.loss_mask[self.lo : self.end].sum().item())


def chunks_from_sample(s: Sample, turn_ends: list[int] | None = None, *, start: int = 0) -> list[TurnChunk]:
    """Split a finished trajectory at its turn ends: chunk k = tool output before turn k + turn k. (T,) arrays.

    ``start``: tokens [0, start) were already delivered as chunks; the first chunk begins there (it may be empty).
    """
    T = s.token_ids.shape[0]
    ends = sorted({e for e in (turn_ends or []) if start < e < T}) + [max(T, start)]
    out = []
    for i, e in enumerate(ends):
        sl = slice(0, e)
        out.append(TurnChunk(s.traj_id, start, s.token_ids[sl], s.loss_mask[sl],
                             None if s.teacher_logp is None else s.teacher_logp[sl],
                             None if s.behaviour_logp is None else s.behaviour_logp[sl],
                             last=i == len(ends) - 1, dp_rank=s.dp_rank,
                             routing=None if s.routing is None else s.routing[sl]))
        start = e
    return out


class ChunkSource(Protocol):
    def poll(self, timeout_s: float) -> list[TurnChunk]: ...

    def exhausted(self) -> bool: ...


class ListChunkSource:
    """Replays chunks in a fixed order; ``release_times`` (s since the first poll) make them wait on the wall clock."""

    def __init__(self, chunks: list[TurnChunk], release_times: list[float] | None = None):
        self.chunks, self.release, self.i, self.t0 = list(chunks), release_times, 0, None

    def poll(self, timeout_s: float = 0.0) -> list[TurnChunk]:
        if self.t0 is None:
            self.t0 = time.perf_counter()
        if self.release is None:
            self.i += 1
            return self.chunks[self.i - 1 : self.i]
        now = time.perf_counter() - self.t0
        if self.i < len(self.chunks) and self.release[self.i] > now:
            time.sleep(min(self.release[self.i] - now, max(timeout_s, 0.0)))
            now = time.perf_counter() - self.t0
        out = []
        while self.i < len(self.chunks) and self.release[self.i] <= now:
            self.chunks[self.i].arrival_s = self.release[self.i]
            out.append(self.chunks[self.i])
            self.i += 1
        return out

    def exhausted(self) -> bool:
        return self.i >= len(self.chunks)


def vocab_parallel_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *,
                              temperature: float = 1.0, tp_group=None) -> torch.Tensor:
    """KL(π_s ‖ π_t) per position for vocab-sharded student logits (B, S, V/tp) and FULL teacher logits (B, S, V).

    Same value as ``algorithms.opd.full_vocab_reverse_kl`` on gathered logits; differentiable in the student. -> (B, S).
    ``tp_group``: the group the vocabulary is sharded over; None = megatron's tensor-parallel group.
    """
    group, tp, rank = (_tp_group_and_size() if tp_group is None
                       else (tp_group, dist.get_world_size(tp_group), dist.get_rank(tp_group)))
    vs = student_logits.shape[-1]
    t = teacher_logits[..., rank * vs : (rank + 1) * vs].to(student_logits)
    log_ps = _vp_log_softmax(student_logits / temperature, group, tp)
    with torch.no_grad():
        log_pt = _vp_log_softmax(t / temperature, group, tp)
    part = (log_ps.exp() * (log_ps - log_pt)).sum(-1)  # (B, S) this shard's share
    return _AllReduceSum.apply(part, group) if tp > 1 else part


def _vp_log_softmax(x, group, tp):
    with torch.no_grad():
        mx = x.max(dim=-1, keepdim=True).values
        if tp > 1:
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    shifted = x - mx
    z = shifted.exp().sum(-1, keepdim=True)
    if tp > 1:
        z = _AllReduceSum.apply(z, group)
    return shifted - z.log()


# ---------------------------------------------------------------------------------------------------- memory
class SavedBytes:
    """Bytes autograd saves for backward inside the context (parameters excluded, one count per storage).

    Storages are keyed by address and never removed: one freed inside the context (e.g. a dropped graph branch) still
    counts until another is allocated at its address and replaces it, so the total depends on the allocator's
    reuse; an estimate, not an exact count."""

    def __init__(self, params):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.param_ptrs:
            self.storages[ptr] = st.nbytes()
        return t

    def __call__(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


# ---------------------------------------------------------------------------------------------------- learner
@dataclasses.dataclass
class OPDStepResult:
    mode: str  # the mode actually run (stream-turn falls back to stream-trajectory under PP without a pp_group)
    step_s: float
    busy_s: float
    idle_frac: float
    grad_norm: float | None
    update_ok: bool
    num_trajectories: int
    num_action_tokens: int
    num_chunks: int
    loss_sum: float
    reverse_kl: float  # mean over action tokens of log π_θ − log π_teacher (the sampled reverse KL, detached)
    full_vocab_kl: float | None
    last_arrival_s: float
    tail_s: float  # work after the last chunk arrived, barrier included
    peak_graph_bytes: int  # activations kept alive at once on this rank (stream-turn: all open trajectories)
    max_traj_graph_bytes: int
    busy_intervals: list
    p2p_messages: int = 0  # stream-turn under PP: per-chunk p2p messages this stage sent/received (0: no PP path)
    skipped_updates: int = 0  # 1: the optimizer step was skipped for a non-finite loss / gradient (training/barrier)


@dataclasses.dataclass
class _Traj:
    chunks: list[TurnChunk] = dataclasses.field(default_factory=list)
    end: int = 0
    n_act: int = 0
    inc: IncrementalGPT | None = None
    stage: StageGraph | None = None  # PP: received inputs / sent outputs per chunk (opd_pipeline)
    terms: list = dataclasses.field(default_factory=list)  # per-chunk loss sums (graph kept) | head-first bodies
    last_h: torch.Tensor | None = None
    mem: SavedBytes | None = None
    lane: int | None = None  # stream-turn at EP > 1: the lockstep lane (training.opd_lanes)
    outs: list = dataclasses.field(default_factory=list)  # ... and its chunks' body outputs (backward roots)

    @property
    def ended(self) -> bool:
        return bool(self.chunks) and self.chunks[-1].last


class OPDLearner:
    """One optimizer step per ``train_step``: gradients into megatron DDP's grad buffers, then the barrier shared with
    ``training.learner.Learner`` (``training.barrier``)."""

    def __init__(self, ddp_model, optimizer, cfg: OPDLearnerConfig, *, dp_rank: int = 0, pp_size: int = 1,
                 dp_group=None, pp_group=None, tp_group=None):
        """``dp_group``: the loss statistics are summed over it (None: this rank's own). ``pp_group``: stream-turn's
        per-chunk p2p under PP (its size overrides ``pp_size``). ``tp_group``: the vocabulary shards of the loss
        (None: megatron's tensor-parallel group). The model's own layers and the barrier use megatron's groups."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.model, self.opt, self.cfg = ddp_model, optimizer, cfg
        self.tp_group = tp_group
        if pp_group is not None:
            pp_size = dist.get_world_size(pp_group)
        self.dp_rank, self.pp_size, self.dp_group = dp_rank, pp_size, dp_group
        self.mode = cfg.mode
        self.link: StageLink | None = None  # stream-turn under PP: this stage's p2p (opd_pipeline)
        if cfg.mode == "stream-turn" and pp_size > 1:
            if pp_group is None:
                log.warning("stream-turn with PP=%d needs the pipeline group (OPDLearner(pp_group=...)) for its "
                            "per-chunk p2p; none given: falling back to stream-trajectory", pp_size)
                self.mode = "stream-trajectory"
            else:
                self.link = StageLink(pp_group)
        # EP > 1: every forward/backward is matched over the expert-parallel ranks (module docstring)
        self.lockstep = ExpertLockstep(unwrap(ddp_model).config) if ddp_model is not None else None
        if self.lockstep is not None and not self.lockstep.on:
            self.lockstep = None
        self.lanes = None
        if self.lockstep is not None and self.mode == "stream-turn":
            self.lanes = TurnLanes(self, self.lockstep)
        self.fb = get_forward_backward_func()
        self.grad_hook = None  # callable(ddp_model) after normalisation, before clipping
        self.sync_order: list[str] | None = None  # sync mode: microbatch order (permutation control)
        self.last_divisor = 1.0

    # ------------------------------------------------------------------ step
    def train_step(self, source: ChunkSource, shape: BatchShape) -> OPDStepResult:
        """One optimizer step over every chunk of ``source``: :meth:`_consume` (each chunk's work as its mode allows),
        :meth:`_drain` (check every trajectory ended; ``sync`` runs them all now), then the shared barrier
        (``training.barrier.barrier_step``) with this step's divisor, and the loss statistics summed over DP."""
        self._begin_step(shape)
        msgs0 = self.link.messages if self.link is not None else 0
        t0 = time.perf_counter()
        pending, n_chunks, last = self._consume(source, t0)
        self._drain(pending)
        # ---- barrier
        tb = time.perf_counter()
        n_tok = sum(tr.n_act for tr in self._trajs.values())
        self.last_divisor = barrier_divisor(self.cfg.loss.aggregation, n_tok)
        finite = math.isfinite(float(self._stats[0]))  # this rank's loss of the step (before the DP sum)
        bar = barrier_step(self.model, self.opt, self.last_divisor, self.grad_hook, loss_finite=finite)
        if bar.skipped:
            log.warning("optimizer step skipped: non-finite %s; weights unchanged", "gradient" if finite else "loss")
        stats = self._stats
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(stats, group=self.dp_group)
        t_end = time.perf_counter()
        busy = [(a - t0, b - t0) for a, b in self._busy] + [(tb - t0, t_end - t0)]
        busy_s = sum(b - a for a, b in busy)
        step_s = t_end - t0
        ntok_seen = max(float(stats[2]), 1.0)
        return OPDStepResult(
            mode=self.mode, step_s=step_s, busy_s=busy_s,
            idle_frac=max(0.0, 1.0 - busy_s / step_s) if step_s > 0 else 0.0,
            grad_norm=bar.grad_norm, update_ok=bar.update_ok,
            num_trajectories=len(self._trajs), num_action_tokens=n_tok, num_chunks=n_chunks,
            loss_sum=float(stats[0]), reverse_kl=float(stats[1]) / ntok_seen,
            full_vocab_kl=float(stats[3]) / ntok_seen if self._full_kl_seen else None,
            last_arrival_s=last - t0, tail_s=t_end - last, peak_graph_bytes=self._peak_bytes,
            max_traj_graph_bytes=self._max_traj_bytes, busy_intervals=busy,
            p2p_messages=(self.link.messages - msgs0) if self.link is not None else 0,
            skipped_updates=int(bar.skipped),
        )

    def _begin_step(self, shape: BatchShape) -> None:
        self._shape = shape
        self._trajs: dict[str, _Traj] = {}
        self._stats = torch.zeros(4, dtype=torch.float64)  # loss, Σ(logp − teacher), n tokens, Σ full KL
        self._busy: list[tuple[float, float]] = []
        self._open_bytes = self._peak_bytes = self._max_traj_bytes = 0
        self._full_kl_seen = False

    def _consume(self, source: ChunkSource, t0: float) -> tuple[list[_Traj], int, float]:
        """Poll until the source is exhausted. -> (trajectories held for ``sync``, chunks seen, last arrival time).

        EP > 1: every poll is a schedule point of the expert-parallel group (their sources may differ in order and
        timing), and the loop ends when every rank's source is exhausted: :meth:`_lockstep_point`."""
        pending: list[_Traj] = []
        n_chunks = 0
        last = t0
        more = True
        while more if self.lockstep is not None else not source.exhausted():
            ready = source.poll(self.cfg.poll_timeout_s) if not source.exhausted() else []
            if ready:
                last = time.perf_counter()
            n_chunks += len(ready)
            if self.lockstep is not None:
                more = self._lockstep_point(ready, pending, source.exhausted())
                continue
            for c in ready:
                self._on_chunk(c, pending)
        return pending, n_chunks, last

    def _lockstep_point(self, ready: list[TurnChunk], pending: list[_Traj], exhausted: bool) -> bool:
        """EP > 1, one poll's chunks: stream-turn runs them through the lanes (``training.opd_lanes``);
        stream-trajectory runs the trajectories that ended here with idle microbatches up to the group's most
        (``ExpertLockstep.count``); sync holds them. -> whether any rank's source has more."""
        mine = []
        for c in ready:
            tr = self._accept(c)
            if c.dp_rank == self.dp_rank:
                mine.append((tr, c))
        if self.lanes is not None:
            return self._timed(self.lanes.point, mine, exhausted)
        ended = [tr for tr, c in mine if c.last]
        if self.mode == "stream-trajectory":
            self._timed(self._run_schedule, ended)
        else:
            pending += ended
        return self.lockstep.count(0 if exhausted else 1) > 0

    def _on_chunk(self, c: TurnChunk, pending: list[_Traj]) -> None:
        """Append the chunk to its trajectory; on this DP rank run what the mode allows now (module docstring)."""
        tr = self._accept(c)
        if c.dp_rank != self.dp_rank:
            return
        if self.mode == "stream-turn":
            self._timed(self._turn_forward, tr, c)
            if c.last:
                self._timed(self._turn_backward, tr)
        elif c.last:
            if self.mode == "stream-trajectory":
                self._timed(self._run_schedule, [tr])
            else:
                pending.append(tr)

    def _drain(self, pending: list[_Traj]) -> None:
        """Every trajectory must have ended; ``sync`` runs its held trajectories (in ``sync_order`` when set)."""
        open_ = [tid for tid, tr in self._trajs.items() if not tr.chunks or not tr.chunks[-1].last]
        if open_:
            raise RuntimeError(f"step ended with unfinished trajectories: {open_[:5]}")
        if pending or (self.lockstep is not None and self.mode == "sync"):
            if self.sync_order is not None:
                rank = {tid: i for i, tid in enumerate(self.sync_order)}
                pending.sort(key=lambda tr: rank[tr.chunks[0].traj_id])
            self._timed(self._run_schedule, pending)

    def _accept(self, c: TurnChunk) -> _Traj:
        tr = self._trajs.setdefault(c.traj_id, _Traj())
        if tr.chunks and tr.chunks[-1].last:
            raise ValueError(f"trajectory {c.traj_id}: chunk after its last one")
        if c.start != tr.end or c.end < c.start:
            raise ValueError(f"trajectory {c.traj_id}: chunk [{c.start}, {c.end}) does not continue at {tr.end}")
        tr.chunks.append(c)
        tr.end = c.end
        tr.n_act += c.num_action_tokens
        return tr

    def _timed(self, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        self._busy.append((t, time.perf_counter()))
        return out

    def _nu(self, n_act: int) -> float:
        sh = self._shape
        return sequence_weight(self.cfg.loss.aggregation, n_act, num_sequences=sh.num_sequences, max_len=sh.max_len)

    # ------------------------------------------------------------------ loss
    def _terms(self, logits: torch.Tensor, c: TurnChunk, lo: int, hi: int, t_logits: torch.Tensor | None):
        """Unnormalised Σ_t w_t ℓ_t over predicted tokens [lo, hi); logits (1, hi − lo, V/tp) predict them."""
        lc = self.cfg.loss
        dev = logits.device
        tgt = c.token_ids[lo:hi].to(dev).unsqueeze(0)  # (1, n)
        logp = vocab_parallel_logprobs(logits, tgt, temperature=lc.temperature, tp_group=self.tp_group)  # (1, n)
        w = c.loss_mask[lo:hi].to(logp).unsqueeze(0)  # (1, n)
        teacher = None if c.teacher_logp is None else c.teacher_logp[lo:hi].to(logp).unsqueeze(0)
        beh = None if c.behaviour_logp is None else c.behaviour_logp[lo:hi].to(logp).unsqueeze(0)
        if self.cfg.objective == "full-vocab":
            if t_logits is None:
                raise ValueError(f"trajectory {c.traj_id}: the full-vocab objective needs teacher logits")
            kl = vocab_parallel_reverse_kl(logits, t_logits.to(dev).unsqueeze(0), temperature=lc.temperature,
                                           tp_group=self.tp_group)
            per = kl * w  # (1, n)
            self._stats[3] += float((kl.detach() * w).sum())
            self._full_kl_seen = True
        else:
            if teacher is None:
                raise ValueError(f"trajectory {c.traj_id}: no teacher log-probs")
            if lc.old_logprobs == "engine":
                if beh is None:
                    raise ValueError(f"trajectory {c.traj_id}: old_logprobs=engine needs behaviour log-probs")
                old = beh
            else:
                old = logp.detach()
            per = opd_loss(logp, old, teacher, w, cfg=lc.policy, behaviour_logp=beh)  # (1, n)
        if teacher is not None:
            self._stats[1] += float(((logp.detach() - teacher) * w).sum())
        self._stats[2] += float(w.sum())
        return per.sum()

    # ------------------------------------------------------------------ trajectory modes (megatron schedule)
    def _run_schedule(self, trajs: list[_Traj]) -> None:
        """The trajectories as microbatches of megatron's schedule; EP > 1: idle ones (None) up to the most any
        expert-parallel rank runs here (collective over the group; every rank calls it at every point)."""
        n = self.lockstep.count(len(trajs)) if self.lockstep is not None else len(trajs)
        if n == 0:
            return
        todo = list(trajs) + [None] * (n - len(trajs))
        self.fb(forward_step_func=self._forward_step, data_iterator=iter(todo), model=[self.model],
                num_microbatches=n, seq_length=max([tr.end for tr in trajs] + [IDLE_TOKENS]), micro_batch_size=1,
                forward_only=False)
        if not trajs:
            return
        # one microbatch's graph is alive at a time on one stage (1F1B under PP keeps up to PP of them)
        per = max(tr.mem.bytes for tr in trajs)
        self._max_traj_bytes = max(self._max_traj_bytes, per)
        self._peak_bytes = max(self._peak_bytes, per * min(self.pp_size, len(trajs)))

    def _forward_step(self, data_iterator, model):
        tr: _Traj | None = next(data_iterator)
        if tr is None:  # an expert-lockstep idle microbatch: its loss is 0 · Σ logits
            out = idle_forward(model)
            return out, lambda o: (0.0 * o.sum(), torch.tensor(0, dtype=torch.int), {"loss": o.new_zeros(())})
        c = tr.chunks[-1]  # its arrays cover the whole trajectory
        dev = _device()
        ids = c.token_ids.to(dev).unsqueeze(0)  # (1, T)
        pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0)
        tr.mem = SavedBytes(self.model.parameters())
        with tr.mem(), moe.replay_microbatch(model, moe.microbatch_routing([c.routing], [c.end])):
            out = model(ids, pos, None)  # last stage: (1, T, V/tp); other stages: hidden states
        return out, functools.partial(self._traj_loss, tr)

    def _traj_loss(self, tr: _Traj, logits: torch.Tensor):
        with tr.mem():
            return self._traj_loss_inner(tr, logits)

    def _traj_loss_inner(self, tr: _Traj, logits: torch.Tensor):
        c = tr.chunks[-1]
        t_logits = None
        if self.cfg.objective == "full-vocab":
            parts = [ch.teacher_logits for ch in tr.chunks if ch.end > ch.lo]
            t_logits = None if any(p is None for p in parts) else torch.cat(parts)
        total = self._nu(tr.n_act) * self._terms(logits[:, :-1], c, 1, c.end, t_logits)
        self._stats[0] += float(total.detach())
        return total, torch.tensor(tr.n_act, dtype=torch.int), {"loss": total.detach().clone()}

    # ------------------------------------------------------------------ stream-turn (incremental forward)
    def _turn_forward(self, tr: _Traj, c: TurnChunk) -> None:
        if tr.inc is None:
            tr.inc, tr.mem = IncrementalGPT(self.model, whole=self.link is None), SavedBytes(self.model.parameters())
            tr.stage = StageGraph()
        before = tr.mem.bytes + tr.stage.output_bytes
        if c.end > c.start:
            with tr.mem(), moe.replay_microbatch(self.model, _chunk_routing(c)):
                if self.link is None:
                    h = tr.inc.extend(c.token_ids[c.start : c.end], c.start)  # (s, 1, hid)
                else:  # PP: receive from the previous stage, run this stage's layers, send on
                    h = stage_forward(tr.inc, self.link, tr.stage, c.token_ids[c.start : c.end], c.start)
            if self.lanes is not None:
                tr.outs.append(h)  # a backward root with gradient 0: every forward's all-to-alls are reached
            if self.link is None or self.link.is_last:
                self._turn_head(tr, c, h)
        c.teacher_logits = None  # (tokens, V): used by the head above, or never needed on this stage
        self._open_bytes += tr.mem.bytes + tr.stage.output_bytes - before
        self._peak_bytes = max(self._peak_bytes, self._open_bytes)

    def _turn_head(self, tr: _Traj, c: TurnChunk, h: torch.Tensor) -> None:
        """Last stage: the chunk's loss terms (kept in the graph), or with head_first the head backward now."""
        body = h
        if self.cfg.head_first:
            h = h.detach().requires_grad_()
            tr.terms.append((body, h))
        # head positions [lo − 1, end − 1) predict tokens [lo, end)
        hin = h[:-1] if tr.last_h is None else torch.cat([tr.last_h, h[:-1]])
        tr.last_h = h[-1:]
        if hin.shape[0] > 0:
            head_mem = SavedBytes(self.model.parameters()) if self.cfg.head_first else tr.mem
            with head_mem():  # head-first: freed by the head backward below, not counted as kept
                term = self._terms(tr.inc.head(hin), c, c.lo, c.end, c.teacher_logits)
            if self.cfg.head_first:
                head = self._nu(0) * term  # ν_i does not depend on T_i here (config check)
                self._stats[0] += float(head.detach())
                head.backward()  # LM head → main_grad now; the body's gradient waits in h.grad
            else:
                tr.terms.append(term)

    def _turn_backward(self, tr: _Traj) -> None:
        kept = self._kept_bytes(tr)
        if self.link is None or self.link.is_last:
            roots = self._turn_roots(tr)
            if roots:
                torch.autograd.backward([r for r, _ in roots], [g for _, g in roots])
        if self.link is not None:  # PP: the gradients of each stage's received inputs go down, stage by stage
            stage_backward(self.link, tr.stage)
        self._turn_done(tr, kept)

    def _turn_roots(self, tr: _Traj) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tensor, gradient) pairs of a finished trajectory's backward on the last stage: its summed loss, or
        with head_first its bodies with the heads' gradients; under lockstep also every chunk output with 0."""
        roots = []
        if self.cfg.head_first:
            roots = [(b, h.grad) for b, h in tr.terms if h.grad is not None]
        elif tr.terms:
            total = self._nu(tr.n_act) * torch.stack(tr.terms).sum()
            self._stats[0] += float(total.detach())
            if total.requires_grad:
                roots = [(total, torch.ones_like(total))]
        return roots + [(h, torch.zeros_like(h)) for h in tr.outs if h.requires_grad]

    @staticmethod
    def _kept_bytes(tr: _Traj) -> int:
        """What a trajectory's graph holds on this stage (before its backward)."""
        return (tr.mem.bytes if tr.mem is not None else 0) + (tr.stage.output_bytes if tr.stage is not None else 0)

    def _turn_done(self, tr: _Traj, kept: int) -> None:
        """After a trajectory's backward: its ``kept`` bytes counted out, its graph's remains freed."""
        self._max_traj_bytes = max(self._max_traj_bytes, kept)
        self._open_bytes -= kept
        tr.inc = tr.terms = tr.last_h = tr.stage = None  # frees the graph's remains
        tr.outs = []


def _chunk_routing(c: TurnChunk) -> list[torch.Tensor] | None:
    """Per MoE layer the (s, k) experts of the chunk's new tokens [start, end) (router replay), or None."""
    if c.routing is None:
        return None
    return moe.microbatch_routing([c.routing[c.start : c.end]], [c.end - c.start])


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ---------------------------------------------------------------------------------------------------- timeline model
def simulate_opd_timeline(turn_arrivals: list[list[float]], turn_forward_s: list[list[float]],
                          turn_backward_s: list[list[float]], *, barrier_s: float = 0.0,
                          head_fraction: float = 0.0) -> dict[str, dict[str, float]]:
    """Step time and tail (work after the last turn's tokens exist) per mode for one serial learner.

    turn_arrivals[i][k]: when turn k of trajectory i is available (teacher-scored), seconds; turn_forward_s /
    turn_backward_s[i][k]: learner work for that turn's tokens (a trajectory's full forward-backward costs the sums;
    the backward of turn k runs through the whole prefix, so it belongs at the trajectory's end in every exact scheme).
    head_fraction: share of each turn's backward that is LM-head work (moved to the turn with ``head_first``).
    Returns {mode: {"step_s", "tail_s", "busy_s"}} for sync, stream-trajectory, stream-turn, stream-turn-head-first.
    """
    last = max(max(a) for a in turn_arrivals)
    out = {}
    for mode in ("sync", "stream-trajectory", "stream-turn", "stream-turn-head-first"):
        items = []  # (ready time, order, cost)
        for i, (arr, fw, bw) in enumerate(zip(turn_arrivals, turn_forward_s, turn_backward_s)):
            if mode == "sync":
                items.append((last, i, sum(fw) + sum(bw)))
            elif mode == "stream-trajectory":
                items.append((arr[-1], i, sum(fw) + sum(bw)))
            else:
                hf = head_fraction if mode.endswith("head-first") else 0.0
                for k, (a, f, b) in enumerate(zip(arr, fw, bw)):
                    items.append((a, i, f + hf * b))
                items.append((arr[-1], i + 0.5, (1.0 - hf) * sum(bw)))
        t = 0.0
        busy = 0.0
        for ready, _, cost in sorted(items):
            t = max(t, ready) + cost
            busy += cost
        t += barrier_s
        out[mode] = {"step_s": t, "tail_s": t - last, "busy_s": busy + barrier_s}
    return out
