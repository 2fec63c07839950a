"""On-policy distillation of a tiny Qwen3-MoE student at expert parallelism 2 (gloo, 2 processes, one launch that
runs the TP 2 layout after it), and MoE router replay in the OPD learner.

At EP = 2 each rank holds half the experts and every MoE layer's all-to-all carries the other rank's tokens, while
the two data-parallel replicas learn different trajectories; here each rank also gets the turns in its own order.
The OPD learner keeps them in lockstep: ``stream-turn`` through lanes (``training.opd_lanes``: matched chunk
forwards, one backward per lane), ``sync`` / ``stream-trajectory`` with idle microbatches
(``ExpertLockstep.count``). float64: the gradient (HF names, experts gathered) of every mode at EP = 2 equals the
one-process ``sync`` gradient to ≤ 1e-12 relative, with router replay too (the learner's experts equal the recorded
ones for every token the engine computed); a MoE teacher scoring turn by turn at EP = 2 equals one process's.
The same at PP 2 × EP 2 (4 processes) for the streaming modes, and at TP 2 (sequence parallel: the incremental
forward pads each chunk to a multiple of TP; sync, stream-trajectory, stream-turn, with and without replay; the teacher
too). Controls: idle forwards ran (the ranks were out of step),
and without replay the gradient differs.
"""

import os
import sys

import pytest
import torch

from ._launch import torchrun
from .stream_cases import rel_error

WORKER = os.path.join(os.path.dirname(__file__), "_workers", "moe_ep_opd_worker.py")
sys.path.insert(0, os.path.dirname(WORKER))
import moe_ep_opd_worker as W  # noqa: E402

TOL = 1e-12




@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("opd_moe") / "moe"), family="qwen3_moe", seed=3)


@pytest.fixture(scope="module")
def data(model, megatron_single):
    from megatron_tsync.model.hf_conversion import load_hf_dir

    arch, _ = load_hf_dir(model)
    return W.trajectories(arch)


@pytest.fixture(scope="module")
def reference(model, data):
    """One process: the sync gradient of every case."""
    S, E = data
    return {case: W.run(model, case, "sync", S, E)[0] for case in W.CASES}


def _launch(model, tmp_path_factory, pp: int, tp=(1,)):
    out = tmp_path_factory.mktemp("opd_ep2") / f"pp{pp}.pt"
    torchrun(WORKER, ["--model", model, "--out", str(out), "--pp", str(pp), "--tp", *map(str, tp)],
             nproc=2 * pp)
    return torch.load(str(out))


@pytest.fixture(scope="module")
def two(model, tmp_path_factory):
    """EP 2, then TP 2 (sequence parallel, one data-parallel replica: every mode of W.TP_MODES and the teacher): one
    2-process launch."""
    return _launch(model, tmp_path_factory, 1, tp=(1, 2))


@pytest.fixture(scope="module")
def ep2(two):
    return two[1]


@pytest.fixture(scope="module")
def tp2(two):
    return two[2]


@pytest.fixture(scope="module")
def ep2pp2(model, tmp_path_factory):
    """PP 2 × EP 2 (4 processes): the streaming modes."""
    return _launch(model, tmp_path_factory, 2)


@pytest.fixture(scope="module")
def teacher_one(model, data):
    """The one-process MoE teacher's scores (the EP 2 and TP 2 tests' reference)."""
    S, E = data
    return W.teacher_scores(model, S, E)


def test_router_replay_stream_turn_one_process(model, data, reference):
    """stream-turn replays each turn's recorded experts: every computed token's experts are the recorded ones, the
    gradient equals sync's (which replays whole trajectories); the control without replay differs."""
    S, E = data
    check = [0, 0]
    g, _ = W.run(model, "replay", "stream-turn", S, E, check=check)
    ref = reference["replay"]
    assert check[0] == sum(s.routing.shape[0] * s.routing.shape[1] for s in S) and check[1] == 0, check
    r = rel_error(g, ref)
    control = rel_error(W.run(model, "replay", "stream-turn", S, E, replay=False)[0], ref)
    print(f"router replay stream-turn vs sync {r:.2g}; without replay {control:.2g}")
    assert r < TOL and control > 1e-3


def _check_grads(got, reference, layout, samples, lockstep=True):
    for case, modes in got["grads"].items():
        ref = reference[case]
        experts = [k for k in ref if ".experts." in k]
        assert experts and all(ref[k].abs().max() > 0 for k in experts)  # every expert is trained
        for mode, g in modes.items():
            assert set(g) == set(ref)
            r, r_moe = rel_error(g, ref), rel_error(g, ref, experts)
            idle = got["idle"][case][mode]
            print(f"opd {layout} {case} {mode}: vs one-process sync {r:.2g} (experts {r_moe:.2g}), idle forwards {idle}")
            assert r < TOL and r_moe < TOL, (case, mode, r, r_moe)
            if lockstep and mode.startswith("stream"):
                assert sum(idle) > 0, (case, mode, idle)  # the ranks were out of step: the lockstep mattered
    checked, differ = got["replay"]["stream-turn"]  # router replay at EP = 2: every computed token, every layer
    assert checked == sum(s.routing.shape[0] * s.routing.shape[1] for s in samples) and differ == 0, (checked, differ)


@pytest.mark.slow
def test_ep2_opd_equals_one_process_sync(ep2, reference, data):
    assert set(ep2["grads"]["token-mean"]) == {"sync", "stream-trajectory", "stream-turn", "stream-turn-head-first"}
    _check_grads(ep2, reference, "ep2", data[0])


@pytest.mark.slow
def test_ep2_pp2_streaming_equals_one_process_sync(ep2pp2, reference, data):
    """stream-turn: every stage runs the lanes with its own expert-parallel group; chunk outputs and input gradients
    go stage to stage as without EP (one message per trajectory at its lane's close). stream-trajectory: idle
    microbatches through megatron's 1F1B schedule."""
    assert set(ep2pp2["grads"]["token-mean"]) == {"stream-trajectory", "stream-turn", "stream-turn-head-first"}
    _check_grads(ep2pp2, reference, "ep2pp2", data[0])


@pytest.mark.slow
def test_ep2_moe_teacher(ep2, teacher_one):
    """A MoE teacher's turn-by-turn scores at EP = 2 (every rank scores every chunk in one order, as the OPD runtime
    does) equal one process's."""
    one = teacher_one
    err = max(float((one[k] - ep2["teacher"][k]).abs().max()) for k in one)
    print(f"MoE teacher at EP=2 vs one process: max |Δ log-prob| {err:.2g}")
    assert err < 1e-12


@pytest.mark.slow
def test_tp2_opd_and_teacher_equal_one_process(tp2, reference, teacher_one, data):
    """TP 2 with sequence parallelism (a MoE model at TP > 1 is built with it): the stream-turn forwards and the
    teacher go through ``IncrementalGPT``, which pads each chunk to a multiple of TP (its padding's K/V are not
    kept, its logits dropped) and shards the chunk's replayed routing alike; sync / stream-trajectory go through the
    builder's padded full forward. Every mode equals one process's sync gradient, with router replay too (every
    computed token's experts, over both TP ranks' sequence shards, are the recorded ones); the teacher's scores too."""
    assert {c: set(m) for c, m in tp2["grads"].items()} == {c: set(m) for c, m in W.TP_MODES.items()}
    _check_grads(tp2, reference, "tp2", data[0], lockstep=False)
    S, E = data
    sizes = {(c.end - c.start) % 2 for c in W.all_chunks(S, E, 11)}
    assert sizes == {0, 1}, sizes  # some chunks were padded to a multiple of TP, some not
    one = teacher_one
    err = max(float((one[k] - tp2["teacher"][k]).abs().max()) for k in one)
    print(f"MoE teacher at TP=2 vs one process: max |Δ log-prob| {err:.2g}")
    assert err < 1e-12
