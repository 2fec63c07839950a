"""On-policy distillation run: ``python -m megatron_tsync.train --rl-algorithm opd --teacher-model DIR --rl-mode M``.

The same loop as GRPO (``runtime/loop.py``: model, optimizer, rollout fleet, weight hand-off, checkpoints) with two
differences: the learner is ``training.opd_learner.OPDLearner`` (modes sync | stream-trajectory | stream-turn) and its
input is a stream of teacher-scored turns. The teacher is scored on the learner side: a
``training.teacher.TeacherScorer`` in the trainer process keeps a KV cache per open trajectory and scores each turn's
new tokens the moment the turn arrives (the workers send no teacher log-probs today). Turns arrive as ``TurnEvent`` s when the worker sends them;
otherwise a finished ``TrajectoryEvent`` is split at its ``turn_spans`` (same gradient, no overlap with generation).
``--moe-router-replay``: every turn and trajectory event carries the engine's routing of its positions, and the
student's forwards replay it (``TurnChunk.routing``); the teacher, another model, routes by itself.
``--opd-objective full-vocab``: the teacher also returns its full logits per predicted token (gathered over TP), which
the learner keeps until that turn's forward has run. Under PP every stage holds the whole teacher and scores every
chunk (the learner's last stage uses the scores; the first stage's copy is what ``--dump-rollouts`` records).
Rewards are logged, not trained on. Per step: TensorBoard ``opd/reverse_kl`` (mean over action tokens of
log π_student − log π_teacher on the sampled tokens, at the weights that produced them); at the end a summary line.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
import torch.distributed as dist

from megatron_tsync.runtime.context import RunContext, grad_norm_text, progress_bar, skipped_text
from megatron_tsync.runtime.fleet import LEDGER_TB_NAMES, RolloutFleet, TransportSource, _event_routing, ledger_row
from megatron_tsync.runtime.rollout_io import grad_dump_hook, load_rollouts
from megatron_tsync.runtime.spec import StepOutcome, TrainSpec
from megatron_tsync.runtime.validation import REJECTION_TB_NAMES, rejection_row
from megatron_tsync.streaming.ready_queue import DataParallelAssigner
from megatron_tsync.training.opd_learner import (ListChunkSource, OPDLearner, OPDLearnerConfig, TurnChunk,
                                                 chunks_from_sample)
from megatron_tsync.training.stream_fb import BatchShape
from megatron_tsync.training.teacher import TeacherChunks, TeacherScorer
from megatron_tsync.transport.errors import BadTurn

log = logging.getLogger("megatron_tsync")

TB_NAMES = {"reverse_kl": "opd/reverse_kl", "full_vocab_kl": "opd/full_vocab_kl", "reward": "rollout/reward",
            "loss": "train/loss", "grad_norm": "train/grad_norm", "step_time_s": "perf/step_time_s",
            "tail_after_last_arrival_s": "perf/tail_s", "teacher_s": "opd/teacher_s",
            "graph_peak_bytes": "opd/graph_peak_bytes"}
TB_NAMES |= REJECTION_TB_NAMES  # transport/rejected_<reason>


class OPDTransportSource(TransportSource):
    """Turn chunks of one step from the rollout plane: ``TurnEvent`` s as turns finish, the rest at the trajectory
    end."""

    def __init__(self, fleet, step: int, max_seq_len: int, teacher: TeacherChunks | None):
        super().__init__(fleet, step, max_seq_len)
        self.teacher = teacher  # None: the chunks leave unscored (``BroadcastChunks`` scores them on every rank)
        self.delivered: dict[str, TurnChunk] = {}

    def poll(self, timeout_s: float) -> list[TurnChunk]:
        out = []
        for ev in self._events(timeout_s):  # early ones (async mode) first
            kind = getattr(ev, "KIND", "")
            if kind == "turn":
                out += self._turn(ev)
            elif kind == "trajectory":  # its reward is only logged: OPD trains on the teacher's scores
                out += self._trajectory(ev)
        self._progress(bool(out))
        if self.teacher is not None:
            out = [self.teacher.score(c) for c in out]
            _record_teacher(self.samples, out)
        return out

    def _turn(self, ev) -> list[TurnChunk]:
        if ev.traj_id not in self.expected or ev.traj_id in self.seen or ev.end > self.max_seq_len:
            return []
        prev = self.delivered.get(ev.traj_id)
        start = 0 if prev is None else prev.end
        if ev.end <= start:
            return []
        if prev is not None and not np.array_equal(ev.token_ids[:start], prev.token_ids.numpy()[:start]):
            _count(self.fleet.receiver, BadTurn(f"{ev.traj_id}: turn {ev.turn} rewrites tokens before {start} that "
                                                 "earlier turns delivered"))
            return []
        routing = None
        if self.fleet.routing_expect is not None:  # --moe-router-replay: the turn's prefix routing, or wait
            routing, why = _event_routing(ev, self.fleet.routing_expect, ev.end)
            if routing is None:  # its tokens come with the trajectory event (whose routing is checked there)
                log.warning("turn %d of %s: %s (--moe-router-replay): learned at the trajectory's end", ev.turn,
                            ev.traj_id, why)
                return []
        c = TurnChunk(ev.traj_id, start, torch.as_tensor(ev.token_ids.astype("int64")),
                      torch.as_tensor(ev.loss_mask.astype("float32")), None,
                      torch.as_tensor(ev.logprobs.astype("float64")), routing=routing)
        self.delivered[ev.traj_id] = c
        return [c]

    def _trajectory(self, ev) -> list[TurnChunk]:
        s = self._to_sample(ev)
        if s is None:
            return []
        ends = [int(b) for _, b in ev.turn_spans][:-1]
        s.meta["turn_ends"] = ends
        prev = self.delivered.pop(s.traj_id, None)
        start = 0 if prev is None else prev.end
        if prev is not None and (s.token_ids.shape[0] < start or not torch.equal(s.token_ids[:start], prev.token_ids)):
            log.warning("trajectory %s changed after its turns were streamed (error/truncation): nothing more from it",
                        s.traj_id)
            return [dataclasses.replace(prev, start=prev.end, last=True)]
        return chunks_from_sample(s, ends, start=start)


def _count(receiver, err) -> None:
    """One content rejection, counted by reason like the edge's (``runtime/validation.py``)."""
    receiver.stats[err.reason] = receiver.stats.get(err.reason, 0) + 1
    receiver.recent_rejections.append((err.reason, err.detail[:512]))
    log.warning("rejected turn event: %s: %s", err.reason, err.detail)


def _record_teacher(samples, chunks: list[TurnChunk]) -> None:
    """Keep what the learner saw on the finished trajectories' Samples (for --dump-rollouts)."""
    by_id = {s.traj_id: s for s in samples}
    for c in chunks:
        s = by_id.get(c.traj_id)
        if c.last and s is not None and c.teacher_logp is not None and c.teacher_logp.shape == s.token_ids.shape:
            s.teacher_logp = c.teacher_logp


class BroadcastChunks:
    """Several trainer ranks: global rank 0 owns the rollout plane; every poll it broadcasts the new (unscored)
    chunks, the newly finished Samples and whether the step is complete; every rank then teacher-scores the chunks
    with its own teacher (cheaper than sending full-vocab logits). All chunks of a trajectory go to the data-parallel
    rank the :class:`DataParallelAssigner` gives it (by arrival); under PP all stages of a pipeline see the same
    stream."""

    def __init__(self, inner: OPDTransportSource | None, dp: int, scorer: TeacherChunks):
        self.inner, self.scorer = inner, scorer
        self.assigner = DataParallelAssigner(dp)
        self.samples: list = []
        self._done = False

    def poll(self, timeout_s: float) -> list[TurnChunk]:
        if dist.get_rank() == 0:
            got = self.inner.poll(timeout_s)
            obj = [got, self.inner.samples[len(self.samples):], self.inner.exhausted()]
        else:
            obj = [None, None, None]
        dist.broadcast_object_list(obj, src=0)
        got, new, self._done = obj
        self.samples.extend(new)
        for c in got:
            c.dp_rank = self.assigner.assign(c.traj_id)
        for s in new:
            s.dp_rank = self.assigner.rank_of(s.traj_id)
        got = [self.scorer.score(c) for c in got]
        _record_teacher(self.samples, got)
        return got

    def exhausted(self) -> bool:
        return self._done


class OPD:
    """The on-policy distillation algorithm of the loop (``runtime.spec.Algorithm``)."""

    tb_names = TB_NAMES | LEDGER_TB_NAMES  # + the step's trajectory ledger (rollout/ledger_*, worker failures)

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        cfg, dims, lc = ctx.cfg, ctx.dims, ctx.cfg.learner
        self.learner = OPDLearner(
            ctx.ddp, ctx.opt, OPDLearnerConfig(mode=lc.mode, loss=lc.loss, poll_timeout_s=lc.poll_timeout_s,
                                               objective=cfg.rl.opd_objective),
            dp_rank=dims.dp_rank, pp_size=dims.pp, dp_group=dims.dp_group(), pp_group=dims.pp_group(),
            tp_group=dims.tp_group())
        self.teacher = None
        if cfg.rollout.teacher_model:
            self.teacher = TeacherScorer.from_hf_dir(cfg.rollout.teacher_model, cfg.precision, seed=cfg.rl.seed)
            student_vocab = getattr(getattr(ctx.ddp.module, "arch", None), "vocab_size", None)
            if student_vocab is not None and self.teacher.vocab_size not in (None, student_vocab):
                raise ValueError(f"teacher vocabulary {self.teacher.vocab_size} != student {student_vocab}: "
                                 "OPD needs one tokenizer")

    def step(self, k: int, fleet: RolloutFleet | None) -> StepOutcome:
        cfg = self.ctx.cfg
        scorer = TeacherChunks(self.teacher, full_vocab=cfg.rl.opd_objective == "full-vocab")
        source, samples_of = self._source(k, fleet, scorer)
        if cfg.logging.dump_grads:  # one optimizer update per OPD step: grad_step_{k:07d}
            self.learner.grad_hook = grad_dump_hook(cfg.logging.dump_grads, k, self.learner,
                                                    write=self.ctx.dims.rank == 0)
        n = cfg.rl.group_size * cfg.rl.groups_per_step
        res = self.learner.train_step(source, BatchShape(num_sequences=n, max_len=cfg.rl.max_action_tokens))
        samples = samples_of()
        return StepOutcome(result=res, samples=samples, group_order=sorted({s.group_id for s in samples}),
                           extra={"teacher_s": scorer.busy_s})

    def _source(self, k: int, fleet: RolloutFleet | None, scorer: TeacherChunks):
        """(chunk source, () -> the step's Samples with teacher log-probs) for live rollouts or a replayed dump."""
        cfg, dims = self.ctx.cfg, self.ctx.dims
        if not cfg.logging.replay_rollouts:
            if dims.world_size == 1:
                src = OPDTransportSource(fleet, k, cfg.rl.seq_length, scorer)
            else:
                inner = OPDTransportSource(fleet, k, cfg.rl.seq_length, None) if fleet is not None else None
                src = BroadcastChunks(inner, dims.dp, scorer)
            return src, lambda: src.samples
        samples, _ = load_rollouts(cfg.logging.replay_rollouts, k)
        DataParallelAssigner(dims.dp).assign_samples(samples)
        chunks = []
        for s in samples:
            chunks += [scorer.score(c) if s.teacher_logp is None or scorer.full_vocab else c
                       for c in chunks_from_sample(s, s.meta.get("turn_ends"))]
        return ListChunkSource(chunks), lambda: samples

    def row(self, k: int, out: StepOutcome, fleet: RolloutFleet | None) -> dict:
        res, samples = out.result, out.samples
        rewards = [s.reward for s in samples]
        hi = self.ctx.task.reward_spec.hi
        return {
            "step": k, "reverse_kl": res.reverse_kl, "full_vocab_kl": res.full_vocab_kl,
            "reward": sum(rewards) / max(len(rewards), 1),
            "success_rate": sum(r >= hi for r in rewards) / max(len(rewards), 1), "loss": res.loss_sum,
            "grad_norm": res.grad_norm, "step_time_s": res.step_s, "idle_frac": res.idle_frac,
            "tail_after_last_arrival_s": res.tail_s, "teacher_s": out.extra["teacher_s"], "mode": res.mode,
            "graph_peak_bytes": res.peak_graph_bytes, "chunks": res.num_chunks, "trajectories": res.num_trajectories,
            **ledger_row(fleet, k),  # used / re-dispatched / dropped trajectories, worker failures, recovery
            "events_rejected": fleet.receiver.rejected if fleet is not None else 0,
            **rejection_row(fleet),  # rejected_<reason>: the run's rejections so far, per reason
        }

    def line(self, row: dict, done: int, total: int, eta_s: float) -> str:
        bar = progress_bar(done, total) if self.ctx.cfg.logging.progress else f"step {done}"
        return (f"[tsync] {bar} reverse-KL {row['reverse_kl']:.4f} reward {row['reward']:.3f} "
                f"step {row['step_time_s']:5.2f}s tail {row['tail_after_last_arrival_s']:5.2f}s "
                f"teacher {row['teacher_s']:4.2f}s grad-norm {grad_norm_text(row)} rejected {row['events_rejected']} "
                f"failed {row.get('failed', 0)}{skipped_text(row)} ETA {eta_s:5.0f}s")

    def summary(self, h: list[dict]) -> str:
        n = max(1, min(3, len(h) // 2))
        first = sum(r["reverse_kl"] for r in h[:n]) / n
        last = sum(r["reverse_kl"] for r in h[-n:]) / n
        return (f"[tsync] opd summary: mode {h[-1]['mode']}, {len(h)} steps, reverse KL {h[0]['reverse_kl']:.4f} → "
                f"{h[-1]['reverse_kl']:.4f} (mean of first/last {n}: {first:.4f} → {last:.4f}), reward "
                f"{h[0]['reward']:.3f} → {h[-1]['reward']:.3f}, mean step "
                f"{sum(r['step_time_s'] for r in h) / len(h):.2f}s, mean tail "
                f"{sum(r['tail_after_last_arrival_s'] for r in h) / len(h):.2f}s")


OPD_SPEC = TrainSpec(name="opd", build=OPD)
