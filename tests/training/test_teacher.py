"""The OPD teacher (training/teacher.py): chunked scoring with full-vocabulary logits, their use by
``--opd-objective full-vocab`` through the trainer's scorer, and the whole teacher on every pipeline stage (PP=2)."""

import os
import sys

import pytest
import torch

from tests.training._launch import torchrun

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "training", "_workers"))
import _teacher_pp_worker as TW  # noqa: E402


@pytest.fixture(scope="module")
def teacher(megatron_single, tiny_dir):
    from megatron_tsync.training.teacher import TeacherScorer
    from megatron_tsync.model.builder import PrecisionConfig

    return TeacherScorer.from_hf_dir(tiny_dir, PrecisionConfig(params_dtype=torch.float64))


def _full_logits(model, ids):  # (T,) -> (T, V)
    return model(ids.unsqueeze(0), torch.arange(ids.shape[0]).unsqueeze(0), None)[0]


def test_session_full_logits_match_full_forward(teacher):
    ids = TW.token_ids()
    lp, lg = TW.chunked(teacher, ids)
    with torch.no_grad():
        full = _full_logits(teacher.model, ids)  # (T, V)
    torch.testing.assert_close(lp, teacher.score(ids), rtol=0, atol=1e-12)
    torch.testing.assert_close(lg, full[:-1], rtol=0, atol=1e-12)


def _grad(model_fn, cfg, chunks, shape):
    from megatron_tsync.training.opd_learner import ListChunkSource, OPDLearner
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    ddp = wrap_ddp(model_fn())
    L = OPDLearner(ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0)), cfg)
    got = {}
    L.grad_hook = lambda d: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
    res = L.train_step(ListChunkSource(chunks), shape)
    return got["g"], res


def test_full_vocab_objective_from_teacher_chunks(teacher, tiny_dir):
    """The trainer's scorer fills ``TurnChunk.teacher_logits`` from the teacher; the learner's full-vocab reverse KL
    (stream-turn, turns of 3 trajectories interleaved) equals the KL of full forwards, and its gradient equals sync."""
    import opd_worker as W

    from megatron_tsync.training.teacher import TeacherChunks
    from megatron_tsync.model.builder import ModelArch, PrecisionConfig, build_model
    from megatron_tsync.training.opd_learner import OPDLearnerConfig
    from megatron_tsync.training.stream_fb import BatchShape

    arch = ModelArch.from_hf_dir(tiny_dir)
    S, E = W.make_trajectories(21, n=3, vocab=300)
    shape = BatchShape(num_sequences=3, max_len=max(s.token_ids.shape[0] for s in S))

    def student():
        return build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=3)

    def chunks():
        sc = TeacherChunks(teacher, full_vocab=True)
        return [sc.score(c) for c in W.all_chunks(S, E, seed=4)]

    cs = chunks()
    for c in cs:
        assert c.teacher_logits is None if c.end <= c.start else c.teacher_logits.shape == (c.end - c.lo, 512)
    out = {}
    for mode in ("sync", "stream-turn"):
        cfg = OPDLearnerConfig(mode=mode, objective="full-vocab")
        cs = chunks()
        out[mode] = _grad(student, cfg, cs, shape)
        if mode == "stream-turn":
            assert all(c.teacher_logits is None for c in cs)  # freed once the turn's forward ran
    g_sync, res = out["sync"]
    g_turn, res_turn = out["stream-turn"]
    assert float((g_turn - g_sync).norm() / g_sync.norm()) <= 1e-12
    # the KL it optimised, from full forwards of student and teacher
    from megatron_tsync.algorithms.opd import full_vocab_reverse_kl

    m = student()
    num = den = 0.0
    with torch.no_grad():
        for s in S:
            kl = full_vocab_reverse_kl(_full_logits(m, s.token_ids)[:-1], _full_logits(teacher.model, s.token_ids)[:-1])
            num += float((kl * s.loss_mask[1:]).sum())
            den += float(s.loss_mask[1:].sum())
    assert abs(res.full_vocab_kl - num / den) <= 1e-10 * abs(num / den)
    assert abs(res_turn.full_vocab_kl - num / den) <= 1e-10 * abs(num / den)


def test_full_vocab_needs_a_teacher():
    from megatron_tsync.training.teacher import TeacherChunks

    with pytest.raises(ValueError, match="teacher-model"):
        TeacherChunks(None, full_vocab=True)


@pytest.mark.slow
def test_whole_teacher_on_every_pipeline_stage(teacher, tiny_dir, tmp_path):
    """PP=2: each stage builds all the teacher's layers and scores exactly as one process does (1e-12, float64)."""
    ids = TW.token_ids()
    lp, lg = TW.chunked(teacher, ids)
    torchrun(os.path.join(HERE, "_teacher_pp_worker.py"), [tiny_dir, str(tmp_path / "t")])
    for r in range(2):
        got = torch.load(tmp_path / f"t.{r}.pt")
        assert got["layers"] == len(teacher.model.decoder.layers)
        torch.testing.assert_close(got["logp"], teacher.score(ids), rtol=0, atol=1e-12)
        torch.testing.assert_close(got["session_logp"], lp, rtol=0, atol=1e-12)
        torch.testing.assert_close(got["session_logits"], lg, rtol=0, atol=1e-12)
