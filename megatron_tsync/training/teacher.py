"""Teacher log-probs for on-policy distillation, computable per finished turn.

A teacher engine is a megatron ``GPTModel`` built from a Hugging Face folder (``--teacher-model``), run without
gradients. ``TeacherScorer.score(token_ids, turn_spans)`` scores a whole trajectory; ``TeacherScorer.session()``
scores it turn by turn with a KV cache (``model.incremental.IncrementalGPT`` under ``no_grad``), so a turn costs
a forward over its new tokens only and can run while the next turn is generated or the tool runs.

Conventions (``streaming.ready_queue.Sample``): entry t of a (T,) log-prob array is log π_teacher(token t | tokens
< t); entry 0 (no prediction) is 0. Teacher and student must share the tokenizer (same vocabulary size is checked).
The teacher is one whole model on every rank whatever the learner's PP (every pipeline stage sees the same chunks
and scores them; only the last stage uses the scores); any TP (vocab-parallel log-softmax). Full-vocabulary teacher
logits (``session(keep_logits=True)``, for ``--opd-objective full-vocab``) are gathered over TP: (tokens, V).
"""

from __future__ import annotations

import time

import torch

from megatron_tsync.model.logprobs import gather_vocab_parallel_logits, vocab_parallel_logprobs
from megatron_tsync.training.opd_learner import TurnChunk

__all__ = ["TeacherChunks", "TeacherScorer", "TeacherSession"]


class TeacherScorer:
    def __init__(self, model, *, temperature: float = 1.0):
        from megatron_tsync.model.builder import unwrap

        m = unwrap(model)
        if not (m.pre_process and m.post_process):
            raise ValueError("the teacher must be a single pipeline stage (PP = 1)")
        self.model = model
        self.model.eval()
        self.temperature = temperature
        self.vocab_size = getattr(getattr(m, "arch", None), "vocab_size", None)

    @classmethod
    def from_hf_dir(cls, path: str, precision=None, *, temperature: float = 1.0, seed: int = 0) -> "TeacherScorer":
        """Build the teacher (this rank's TP shard, all layers) from a transformers folder. Parallel state must be
        initialised; under PP every stage holds the whole teacher (no pipeline: it only runs forward, without grad)."""
        from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
        from megatron_tsync.model.builder import build_model

        arch, state = load_hf_dir(path)
        model = build_model(arch, precision, pre_process=True, post_process=True, seed=seed,
                            pipeline_model_parallel_size=1)
        load_hf_into_model(model, state, whole_model=True)
        for p in model.parameters():
            p.requires_grad_(False)
        return cls(model, temperature=temperature)

    @torch.no_grad()
    def score(self, token_ids: torch.Tensor, turn_spans: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """(T,) token ids -> (T,) float64 teacher log-probs; with ``turn_spans``, 0 outside the generated turns."""
        dev = next(self.model.parameters()).device
        ids = token_ids.to(dev).long().unsqueeze(0)  # (1, T)
        pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0)
        logits = self.model(ids, pos, None)  # (1, T, V/tp)
        lp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], temperature=self.temperature)[0]  # (T-1,)
        out = torch.cat([lp.new_zeros(1), lp]).double().cpu()  # (T,)
        if turn_spans is not None:
            keep = torch.zeros_like(out, dtype=torch.bool)
            for a, b in turn_spans:
                keep[a:b] = True
            out = torch.where(keep, out, torch.zeros_like(out))
        return out

    def session(self, *, keep_logits: bool = False) -> "TeacherSession":
        return TeacherSession(self, keep_logits=keep_logits)


class TeacherSession:
    """One trajectory scored chunk by chunk; holds the teacher's K/V of the prefix until dropped."""

    def __init__(self, scorer: TeacherScorer, *, keep_logits: bool = False):
        from megatron_tsync.model.incremental import IncrementalGPT

        self.scorer = scorer
        self.inc = IncrementalGPT(scorer.model)
        self.keep_logits = keep_logits
        self.logp = torch.zeros(0, dtype=torch.float64)  # (end,) so far
        self._last = None  # (1, 1, V/tp) logits of the last seen position (predicts the next chunk's first token)

    @property
    def length(self) -> int:
        return self.inc.length

    @torch.no_grad()
    def extend(self, token_ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Score tokens [start, end) of the prefix ``token_ids`` (end,).

        Returns the teacher log-probs of the whole prefix (end,) float64 and, with ``keep_logits``, the full-vocab
        teacher logits (end − max(start, 1), V) that predict tokens [max(start, 1), end), else None.
        """
        end = int(token_ids.shape[0])
        if end <= start:
            return self.logp.clone(), None
        h = self.inc.extend(token_ids[start:end].long(), start)  # (s, 1, hid)
        logits = self.inc.head(h)  # (1, s, V/tp)
        both = logits if self._last is None else torch.cat([self._last, logits], dim=1)
        both = both[:, :-1]  # (1, end − lo, V/tp): predictions of tokens [lo, end)
        self._last = logits[:, -1:]
        lo = max(start, 1)
        tgt = token_ids[lo:end].to(both.device).long().unsqueeze(0)
        new = vocab_parallel_logprobs(both, tgt, temperature=self.scorer.temperature)[0].double().cpu()
        self.logp = torch.cat([self.logp, torch.zeros(lo - start, dtype=torch.float64), new])
        full = gather_vocab_parallel_logits(both)[0].cpu() if self.keep_logits else None
        return self.logp.clone(), full


class TeacherChunks:
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
