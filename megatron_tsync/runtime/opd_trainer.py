"""On-policy distillation run: ``python -m megatron_tsync.train --rl-algorithm opd --teacher-model DIR --rl-mode M``.

Same run as GRPO (``runtime.trainer.Trainer``: model, optimizer, rollout fleet, weight hand-off, checkpoints) with two
differences: the learner is ``training.opd_learner.OPDLearner`` (modes sync | stream-trajectory | stream-turn) and its
input is a stream of teacher-scored turns. The teacher is scored on the learner side: a ``rollout.teacher.TeacherScorer``
in the trainer process keeps a KV cache per open trajectory and scores each turn's new tokens the moment the turn
arrives (the workers send no teacher log-probs today). Turns arrive as ``TurnEvent`` s when the worker sends them;
otherwise a finished ``TrajectoryEvent`` is split at its ``turn_spans`` (same gradient, no overlap with generation).
``--opd-objective full-vocab``: the teacher also returns its full logits per predicted token (gathered over TP), which
the learner keeps until that turn's forward has run. Under PP every stage holds the whole teacher and scores every
chunk (the learner's last stage uses the scores; the first stage's copy is what ``--dump-rollouts`` records).
Rewards are logged, not trained on. Per step: TensorBoard ``opd/reverse_kl`` (mean over action tokens of
log π_student − log π_teacher on the sampled tokens, at the weights that produced them); at the end a summary line.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from megatron_tsync.runtime.fleet import TransportSource
from megatron_tsync.runtime.trainer import Trainer, _bar, save_history, write_scalars
from megatron_tsync.training.opd_learner import TurnChunk, chunks_from_sample

log = logging.getLogger("megatron_tsync")


class _TeacherChunks:
    """Teacher-scores chunks as they pass (one ``TeacherSession`` per open trajectory); no-op without a teacher.

    ``full_vocab``: also the teacher's full logits of the chunk's predicted tokens (``TurnChunk.teacher_logits``,
    (end − max(start, 1), V)) for ``--opd-objective full-vocab``.
    """

    def __init__(self, teacher, *, full_vocab: bool = False):
        if full_vocab and teacher is None:
            raise ValueError("--opd-objective full-vocab needs --teacher-model (full teacher logits)")
        self.teacher, self.full_vocab = teacher, full_vocab
        self.sessions: dict = {}
        self.busy_s = 0.0

    def score(self, c: TurnChunk) -> TurnChunk:
        if self.teacher is None:
            if c.teacher_logp is None:
                raise ValueError(f"trajectory {c.traj_id}: no teacher log-probs and no --teacher-model")
            return c
        t = time.perf_counter()
        sess = self.sessions.get(c.traj_id) or self.sessions.setdefault(
            c.traj_id, self.teacher.session(keep_logits=self.full_vocab))
        c.teacher_logp, logits = sess.extend(c.token_ids, c.start)
        if self.full_vocab:
            c.teacher_logits = logits  # (end − max(start, 1), V) float, on the CPU; None for an empty chunk
        if c.last:
            self.sessions.pop(c.traj_id, None)
        self.busy_s += time.perf_counter() - t
        return c


class OPDTransportSource(TransportSource):
    """Turn chunks of one step from the rollout plane: ``TurnEvent`` s as turns finish, the rest at the trajectory end."""

    def __init__(self, fleet, step: int, max_seq_len: int, teacher: _TeacherChunks | None):
        super().__init__(fleet, step, max_seq_len)
        self.teacher = teacher  # None: the chunks leave unscored (``_BroadcastChunks`` scores them on every rank)
        self.delivered: dict[str, TurnChunk] = {}

    def poll(self, timeout_s: float) -> list[TurnChunk]:
        out = []
        for ev in self.fleet.receiver.poll(int(timeout_s * 1000)):
            kind = getattr(ev, "KIND", "")
            if kind == "turn":
                out += self._turn(ev)
            elif kind == "trajectory":  # OPD does not wait for a late reward: it is only logged
                out += self._trajectory(ev)
        now = time.perf_counter()
        if out:
            self.last_event = now
        else:
            self.fleet.check_alive()
            if now - self.last_event > self.stall_timeout_s:
                raise TimeoutError(f"step {self.step}: no event for {self.stall_timeout_s:.0f}s; "
                                   f"{len(self.expected - self.seen)} trajectories missing")
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
        c = TurnChunk(ev.traj_id, start, torch.as_tensor(ev.token_ids.astype("int64")),
                      torch.as_tensor(ev.loss_mask.astype("float32")), None,
                      torch.as_tensor(ev.logprobs.astype("float64")))
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


def _record_teacher(samples, chunks: list[TurnChunk]) -> None:
    """Keep what the learner saw on the finished trajectories' Samples (for --dump-rollouts)."""
    by_id = {s.traj_id: s for s in samples}
    for c in chunks:
        s = by_id.get(c.traj_id)
        if c.last and s is not None and c.teacher_logp is not None and c.teacher_logp.shape == s.token_ids.shape:
            s.teacher_logp = c.teacher_logp


class _BroadcastChunks:
    """Several trainer ranks: global rank 0 owns the rollout plane; every poll it broadcasts the new (unscored)
    chunks, the newly finished Samples and whether the step is complete; every rank then teacher-scores the chunks
    with its own teacher (cheaper than sending full-vocab logits). All chunks of a trajectory go to data-parallel rank
    ``i mod DP``, i = the trajectory's arrival index; under PP all stages of a pipeline thus see the same stream."""

    def __init__(self, inner: OPDTransportSource | None, dp: int, scorer: _TeacherChunks):
        self.inner, self.dp, self.scorer = inner, dp, scorer
        self.samples: list = []
        self.dp_of: dict[str, int] = {}
        self._done = False

    def poll(self, timeout_s: float) -> list[TurnChunk]:
        import torch.distributed as dist

        if dist.get_rank() == 0:
            got = self.inner.poll(timeout_s)
            obj = [got, self.inner.samples[len(self.samples):], self.inner.exhausted()]
        else:
            obj = [None, None, None]
        dist.broadcast_object_list(obj, src=0)
        got, new, self._done = obj
        self.samples.extend(new)
        for c in got:
            c.dp_rank = self.dp_of.setdefault(c.traj_id, len(self.dp_of) % self.dp)
        for s in new:
            s.dp_rank = self.dp_of.get(s.traj_id, 0)
        got = [self.scorer.score(c) for c in got]
        _record_teacher(self.samples, got)
        return got

    def exhausted(self) -> bool:
        return self._done


class OPDTrainer(Trainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        from megatron_tsync.training.opd_learner import OPDLearner, OPDLearnerConfig

        lc = cfg.learner
        self.opd_learner = OPDLearner(
            self.ddp, self.opt, OPDLearnerConfig(mode=lc.mode, loss=lc.loss, poll_timeout_s=lc.poll_timeout_s,
                                                 objective=cfg.rl.opd_objective),
            dp_rank=self.dims.dp_rank, pp_size=self.dims.pp, dp_group=self.dims.dp_group(),
            pp_group=self.dims.pp_group())
        self.teacher = None
        if cfg.rollout.teacher_model:
            from megatron_tsync.training.teacher import TeacherScorer

            self.teacher = TeacherScorer.from_hf_dir(cfg.rollout.teacher_model, cfg.precision, seed=cfg.rl.seed)
            student_vocab = self.ddp.module.arch.vocab_size if hasattr(self.ddp.module, "arch") else None
            if student_vocab is not None and self.teacher.vocab_size not in (None, student_vocab):
                raise ValueError(f"teacher vocabulary {self.teacher.vocab_size} != student {student_vocab}: "
                                 "OPD needs one tokenizer")

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        from megatron_tsync.training.stream_fb import BatchShape

        cfg = self.cfg
        replay = cfg.logging.replay_rollouts
        fleet = None if replay else self._fleet()  # rank 0 only
        try:
            if not replay:
                self._publish(fleet, self.step)  # collective: every rank
            t_run, first = time.perf_counter(), self.step
            while self.step < cfg.rl.train_iters and not self.stop.stop:
                k = self.step
                scorer = _TeacherChunks(self.teacher, full_vocab=cfg.rl.opd_objective == "full-vocab")
                source, samples_of = self._source(k, fleet, scorer)
                n = cfg.rl.group_size * cfg.rl.groups_per_step
                res = self.opd_learner.train_step(source, BatchShape(num_sequences=n, max_len=cfg.rl.seq_length))
                self.step += 1
                samples = samples_of()
                if cfg.logging.dump_rollouts and self.dims.rank == 0:
                    from megatron_tsync.runtime.rollout_io import dump_rollouts

                    dump_rollouts(cfg.logging.dump_rollouts, k, samples, sorted({s.group_id for s in samples}))
                if not replay and self.step < cfg.rl.train_iters:
                    self._publish(fleet, self.step)
                self._log_opd(k, res, samples, fleet, scorer.busy_s, time.perf_counter() - t_run, self.step - first)
                si = cfg.checkpoint.save_interval
                if si and self.step % si == 0:
                    self.save()
            if cfg.checkpoint.save and (not cfg.checkpoint.save_interval or self.step % cfg.checkpoint.save_interval):
                self.save()
        finally:
            if fleet is not None:
                fleet.close()
            if self.tb is not None:
                self.tb.close()
        self._summary_opd()
        return self.history

    def _source(self, k: int, fleet, scorer: _TeacherChunks):
        """(chunk source, () -> the step's Samples with teacher log-probs) for live rollouts or a replayed dump."""
        if not self.cfg.logging.replay_rollouts:
            if self.dims.world_size == 1:
                src = OPDTransportSource(fleet, k, self.cfg.rl.seq_length, scorer)
            else:
                inner = OPDTransportSource(fleet, k, self.cfg.rl.seq_length, None) if fleet is not None else None
                src = _BroadcastChunks(inner, self.dims.dp, scorer)
            return src, lambda: src.samples
        from megatron_tsync.runtime.rollout_io import load_rollouts
        from megatron_tsync.training.opd_learner import ListChunkSource

        samples, _ = load_rollouts(self.cfg.logging.replay_rollouts, k)
        chunks = []
        for i, s in enumerate(samples):
            s.dp_rank = i % self.dims.dp
            chunks += [scorer.score(c) if s.teacher_logp is None or scorer.full_vocab else c
                       for c in chunks_from_sample(s, s.meta.get("turn_ends"))]
        return ListChunkSource(chunks), lambda: samples

    def _log_opd(self, k, res, samples, fleet, teacher_s, elapsed, done) -> None:
        rewards = [s.reward for s in samples]
        hi = self.task.reward_spec.hi
        row = {
            "step": k, "reverse_kl": res.reverse_kl, "full_vocab_kl": res.full_vocab_kl, "reward": sum(rewards) / max(len(rewards), 1),
            "success_rate": sum(r >= hi for r in rewards) / max(len(rewards), 1), "loss": res.loss_sum,
            "grad_norm": res.grad_norm, "step_time_s": res.step_s, "idle_frac": res.idle_frac,
            "tail_after_last_arrival_s": res.tail_s, "teacher_s": teacher_s, "mode": res.mode,
            "graph_peak_bytes": res.peak_graph_bytes, "chunks": res.num_chunks, "trajectories": res.num_trajectories,
            "events_rejected": fleet.receiver.rejected if fleet is not None else 0,
        }
        self.history.append(row)
        if self.tb is not None:
            write_scalars(self.tb, row, {
                "reverse_kl": "opd/reverse_kl", "full_vocab_kl": "opd/full_vocab_kl", "reward": "rollout/reward",
                "loss": "train/loss", "grad_norm": "train/grad_norm", "step_time_s": "perf/step_time_s",
                "tail_after_last_arrival_s": "perf/tail_s", "teacher_s": "opd/teacher_s",
                "graph_peak_bytes": "opd/graph_peak_bytes"}, k)
        if self.dims.is_logging_rank and k % max(self.cfg.logging.log_interval, 1) == 0:
            eta = elapsed / max(done, 1) * (self.cfg.rl.train_iters - self.step)
            bar = _bar(self.step, self.cfg.rl.train_iters) if self.cfg.logging.progress else f"step {self.step}"
            print(f"[tsync] {bar} reverse-KL {res.reverse_kl:.4f} reward {row['reward']:.3f} step {res.step_s:5.2f}s "
                  f"tail {res.tail_s:5.2f}s teacher {teacher_s:4.2f}s grad-norm {row['grad_norm'] or 0:.3f} "
                  f"ETA {eta:5.0f}s", flush=True)

    def _summary_opd(self) -> None:
        if not self.history or not self.dims.is_logging_rank:
            return
        h = self.history
        n = max(1, min(3, len(h) // 2))
        first = sum(r["reverse_kl"] for r in h[:n]) / n
        last = sum(r["reverse_kl"] for r in h[-n:]) / n
        print(f"[tsync] opd summary: mode {h[-1]['mode']}, {len(h)} steps, reverse KL {h[0]['reverse_kl']:.4f} → "
              f"{h[-1]['reverse_kl']:.4f} (mean of first/last {n}: {first:.4f} → {last:.4f}), reward "
              f"{h[0]['reward']:.3f} → {h[-1]['reward']:.3f}, mean step "
              f"{sum(r['step_time_s'] for r in h) / len(h):.2f}s, mean tail "
              f"{sum(r['tail_after_last_arrival_s'] for r in h) / len(h):.2f}s", flush=True)
        save_history(self.cfg, h)
