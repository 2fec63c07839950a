"""The learner never applies a non-finite update (issue 45 item 3), float64, one process, every mode.

- (a) the edge: a signed, otherwise valid trajectory whose behaviour log-prob is -1e4 (below ``schema.LOGPROB_FLOOR``:
  it made ``--rl-mode async``'s ratio inf and the step NaN) or NaN is rejected by the real receiver as ``bad_logprob``,
  counted, and counts in its group as failed: the weights after the step equal, bit for bit, those of the same step
  whose worker reported that trajectory failed — in sync, stream-group, stream-trajectory and async.
- (b) the barrier: a poison the edge cannot see (the loss of one microbatch made NaN inside the learner) skips the
  optimizer step: weights bitwise unchanged, grads zeroed, ``skipped_updates`` 1; the next clean step is bitwise the
  step a fresh learner takes (Adam's state untouched). GRPO in every mode, OPD in each of its modes. Control: the same
  step without the poison moves the weights.
- the loop: ``--max-consecutive-skipped-steps N`` skipped steps in a row stop the run (``runtime/stop.py``) before
  any checkpoint; 0 never stops (``tests/runtime/test_stop.py`` tests the counter itself).
"""

from __future__ import annotations

import copy
import os
import sys
import time
import types

import msgpack
import pytest
import torch

from megatron_tsync.algorithms.streamability import RewardSpec
from megatron_tsync.model.builder import PrecisionConfig, build_model
from megatron_tsync.runtime.grpo import learner_config
from megatron_tsync.streaming.ready_queue import ListSource
from megatron_tsync.training import opd_learner, stream_fb
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, grad_buffers, wrap_ddp
from megatron_tsync.transport.codec import _seal
from tests.runtime.test_validation import _drain, _fleet, _sender, _traj, plane  # noqa: F401 - fixture used by name

from .stream_cases import TINY, arrival_order, make_samples

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_workers"))
import opd_worker as W  # noqa: E402

MODES = ["sync", "stream-group", "stream-trajectory", "async"]
SPEC = RewardSpec.bounded(-1.0, 1.0)  # the edge fleet's failed trajectories get its reward floor, -1


def _config(mode: str, spec: RewardSpec = SPEC) -> LearnerConfig:
    """The learner's section as the runtime builds it (``runtime.grpo.learner_config``: async = synchronous batches
    on the engine's log-probs as π_old)."""
    task = types.SimpleNamespace(reward_spec=spec, name="t", verifier="v")
    return learner_config(types.SimpleNamespace(learner=LearnerConfig(mode=mode, reward_spec=spec)), task)


def _flat(ddp) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in ddp.parameters()])


def _model(optimizer: str = "sgd", lr: float = 0.05):
    ddp = wrap_ddp(build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0))
    return ddp, build_optimizer(ddp, OptimConfig(optimizer=optimizer, lr=lr, clip_grad=0))


def _step(learner: Learner, samples, order=None):
    samples = copy.deepcopy(samples)
    by_id = {s.traj_id: s for s in samples}
    sizes, shape = shape_for(samples)
    order = samples if order is None else [by_id[s.traj_id] for s in order]
    return learner.train_step(ListSource(order), sizes, shape)


# ------------------------------------------------------------------------------------------------------- (a) the edge
POISONED = "s0g1t0"
TRAJS = (("s0g0t0", (3, 4, 5, 6, 7, 8), 1.0), ("s0g0t1", (3, 4, 9, 10, 11), 0.0),
         (POISONED, (12, 13, 14, 15, 16, 17), 1.0), ("s0g1t1", (12, 13, 20, 21), 0.0))


def _received(plane_dir: str, poison: float | None):
    """The step's samples as the learner gets them from a real receiver and edge (sorted by id), and the receiver's
    counters. ``poison`` None: the worker reports ``POISONED`` failed; else its third log-prob is ``poison`` (a raw
    frame signed with the run's key: the sender's own schema check would refuse it)."""
    fleet = _fleet(plane_dir)
    try:
        src = fleet.source(0, max_seq_len=8)
        with _sender(fleet) as tx:
            for tid, ids, reward in TRAJS:
                ev = _traj(tid, ids=ids, reward=reward)
                if tid != POISONED:
                    tx.send(ev, timeout_s=5)
                elif poison is None:
                    ev.status, ev.error = "error", "the engine failed"
                    tx.send(ev, timeout_s=5)
                else:
                    wire = ev.to_wire()
                    lp = ev.logprobs.copy()
                    lp[2] = poison
                    wire["logprobs"] = ["<f4", lp.size, lp.tobytes()]
                    tx._sock.send(_seal(1, msgpack.packb(wire, use_bin_type=True), tx._key, sender_id=tx.sender_id,
                                        seq=1 << 20, epoch=tx.epoch, policy_version=0))
            got = _drain(src, tx)
            deadline = time.monotonic() + 10
            while not src.exhausted() and time.monotonic() < deadline:
                got += src.poll(0.05)
        assert src.exhausted() and sorted(s.traj_id for s in got) == sorted(t[0] for t in TRAJS)
        return sorted(got, key=lambda s: s.traj_id), dict(fleet.receiver.stats)
    finally:
        fleet.close()


@pytest.mark.parametrize("poison", [-1e4, float("nan")])
def test_a_bad_log_prob_is_rejected_at_the_edge_and_the_step_is_the_one_without_it(megatron_single, plane, poison):
    ref, _ = _received(plane, None)
    got, stats = _received(plane, poison)
    assert stats["bad_logprob"] == 1 and stats["accepted"] == 3
    stand_in = next(s for s in got if s.traj_id == POISONED)
    assert stand_in.reward == -1.0 and float(stand_in.loss_mask.sum()) == 0  # failed: lowest reward, no gradient
    for mode in MODES:
        weights = {}
        for name, samples in (("poisoned", got), ("reference", ref)):
            ddp, opt = _model()
            before = _flat(ddp)
            res = _step(Learner(ddp, opt, _config(mode)), samples)
            assert res.skipped_updates == 0 and res.update_ok, (mode, name)
            weights[name] = _flat(ddp)
        assert torch.isfinite(weights["poisoned"]).all() and (weights["poisoned"] - before).norm() > 0, mode
        assert torch.equal(weights["poisoned"], weights["reference"]), mode


# ---------------------------------------------------------------------------------------------------- (b) the barrier
def _nan_on_call(monkeypatch, module, n: int) -> list:
    """``module.vocab_parallel_logprobs`` returns NaN log-probs (keeping the graph) on its n-th call only."""
    real, calls = module.vocab_parallel_logprobs, []

    def poisoned(*a, **kw):
        out = real(*a, **kw)
        calls.append(1)
        return out * float("nan") if len(calls) == n else out

    monkeypatch.setattr(module, "vocab_parallel_logprobs", poisoned)
    return calls


@pytest.mark.parametrize("mode", MODES)
def test_a_non_finite_loss_skips_the_update_and_the_next_step_is_clean(megatron_single, monkeypatch, mode):
    samples = make_samples(5, reward_kind="bounded")
    order = arrival_order(samples, 1)
    cfg = _config(mode, RewardSpec.bounded(0.0, 1.0))
    ddp, opt = _model("adam", 1e-3)
    theta0 = _flat(ddp)
    learner = Learner(ddp, opt, cfg)
    calls = _nan_on_call(monkeypatch, stream_fb, 2)
    res = _step(learner, samples, order)
    assert len(calls) > 2  # the poisoned microbatch was not the last: the others ran and were dropped too
    assert res.skipped_updates == 1 and not res.update_ok and res.grad_norm is None
    assert torch.equal(_flat(ddp), theta0)  # no update, bit for bit
    assert all(float(b.abs().sum()) == 0.0 for b in grad_buffers(ddp))  # the poisoned gradient is gone
    monkeypatch.undo()
    res = _step(learner, samples, order)  # the same learner, a clean step ...
    assert res.skipped_updates == 0 and res.update_ok and res.grad_norm > 0
    ddp2, opt2 = _model("adam", 1e-3)
    _step(Learner(ddp2, opt2, cfg), samples, order)  # ... is the first step of a fresh one (Adam's state untouched)
    assert torch.equal(_flat(ddp), _flat(ddp2)) and not torch.equal(_flat(ddp), theta0)


@pytest.mark.parametrize("mode", ["sync", "stream-trajectory", "stream-turn"])
def test_opd_a_non_finite_loss_skips_the_update(megatron_single, monkeypatch, mode):
    samples, ends = W.make_trajectories(3, n=3)
    case = W.CASES["seq-mean-engine-tis"]
    shape = opd_learner.BatchShape(num_sequences=3, max_len=max(s.token_ids.shape[0] for s in samples))
    weights = {}
    for poisoned in (True, False):
        ddp, opt = _model()
        theta0 = _flat(ddp)
        L = opd_learner.OPDLearner(ddp, opt, opd_learner.OPDLearnerConfig(mode=mode, **case))
        if poisoned:
            calls = _nan_on_call(monkeypatch, opd_learner, 2)
        res = L.train_step(opd_learner.ListChunkSource(W.all_chunks(samples, ends, 7)), shape)
        monkeypatch.undo()
        weights[poisoned] = _flat(ddp)
        assert res.skipped_updates == int(poisoned) and res.update_ok != poisoned, (mode, poisoned)
        if poisoned:
            assert len(calls) > 2 and all(float(b.abs().sum()) == 0.0 for b in grad_buffers(ddp))
    assert torch.equal(weights[True], theta0)
    assert torch.isfinite(weights[False]).all() and not torch.equal(weights[False], theta0)  # control


@pytest.mark.slow
def test_data_parallel_ranks_agree_to_skip(tmp_path):
    """DP = 2: a non-finite loss on one rank only, or a NaN in one rank's local gradient, skips the update on both
    (the verdict is all-reduced); control: a clean step updates both, identically finite."""
    from ._launch import torchrun

    out = str(tmp_path / "r.json")
    rep = torchrun(os.path.join(os.path.dirname(__file__), "_workers", "skip_worker.py"), ["--out", out], nproc=2,
                   out_json=out)
    assert rep["clean"] == [{"skipped": False, "moved": True, "finite": True}] * 2, rep
    for name in ("loss", "grad"):
        assert rep[name] == [{"skipped": True, "moved": False, "finite": True}] * 2, (name, rep)
