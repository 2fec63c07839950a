"""OPD turn-level streaming is exact (streaming_math.md §6-7), and cutting the gradient at turn boundaries is not.

float64, multi-turn trajectories with tool-output tokens (loss_mask 0) between turns, turns of different trajectories
interleaved: the gradient after the barrier of ``stream-turn`` (incremental forward, graph kept, one backward per
trajectory), ``stream-turn`` with ``head_first`` and ``stream-trajectory`` equals the batch (``sync``) gradient to
≤ 1e-12 relative; the control that detaches the prefix at each turn is off by ≫ 1e-12. One process, then TP=2,
PP=2 and TP=2 × PP=2 under torchrun. Under PP, stream-turn runs the per-chunk p2p path (``training.opd_pipeline``) on
every rank (no fallback: the mode that ran and the p2p message count are checked per rank), and each rank's own
gradient shard is exact, not only the whole.

Two launches serve the parallel tests (the ``parallel_reports`` fixture): 2 processes run tp2, then pp2 with
recomputation off, full-uniform-1 and selective (one sync reference per case for the three); 4 processes run tp2pp2.
"""

import json
import os
import sys

import pytest
import torch

from ._launch import item_param, selected_params, torchrun

WORKER = os.path.join(os.path.dirname(__file__), "_workers", "opd_worker.py")
sys.path.insert(0, os.path.dirname(WORKER))
import opd_worker as W  # noqa: E402

from megatron_tsync.model.incremental import IncrementalGPT  # noqa: E402
from megatron_tsync.training.opd_learner import (  # noqa: E402
    OPDLearnerConfig,
    TurnChunk,
    chunks_from_sample,
    simulate_opd_timeline,
)
from megatron_tsync.training.stream_fb import LossConfig  # noqa: E402

EXACT = 1e-12


def _check(report, *, pp=1):
    for case, row in report.items():
        for mode in ("stream-trajectory", "stream-turn", "stream-turn-head-first"):
            if mode in row:
                assert row[mode]["rel"] <= EXACT, (case, mode, row[mode])
                assert max(row[mode]["rel_this_rank"]) <= EXACT, (case, mode, row[mode])
        for mode in ("stream-turn", "stream-turn-head-first", "cut"):
            if mode in row:
                assert set(row[mode]["ran"]) == {"stream-turn"}, (case, mode, row[mode])  # no fallback, any rank
                msgs = row[mode]["p2p_messages"]
                assert (min(msgs) > 0) if pp > 1 else (max(msgs) == 0), (case, mode, msgs)  # the PP path ran
        assert row["cut"]["rel"] > 1e-3, (case, row["cut"])  # the control: not exact, so the test can fail


def test_stream_turn_exact_single_process(megatron_single):
    _check(W.run_cases(megatron_single))


def test_incremental_forward_matches_full_forward(megatron_single):
    from megatron_tsync.model.builder import PrecisionConfig, build_model

    model = build_model(W.TINY, PrecisionConfig(params_dtype=torch.float64), seed=1)
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(0))
    full = model(ids.unsqueeze(0), torch.arange(23).unsqueeze(0), None)  # (1, T, V)
    inc = IncrementalGPT(model)
    parts = [inc.head(inc.extend(ids[a:b], a)) for a, b in ((0, 5), (5, 6), (6, 17), (17, 23))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="starts at"):
        inc.extend(ids[:2], 3)


def test_chunks_and_config_checks():
    S, E = W.make_trajectories(5, n=1)
    cs = chunks_from_sample(S[0], E["t0"])
    assert [c.start for c in cs] == [0, *E["t0"]] and cs[-1].last and not cs[0].last
    assert sum(c.num_action_tokens for c in cs) == S[0].num_action_tokens
    with pytest.raises(ValueError, match="head_first"):
        OPDLearnerConfig(head_first=True, loss=LossConfig(aggregation="seq-mean-token-mean"))
    with pytest.raises(ValueError, match="mode"):
        OPDLearnerConfig(mode="stream-group")
    assert isinstance(cs[0], TurnChunk)


def test_timeline_model_orders_tails():
    arr = [[0.1 * (k + 1) + 0.05 * i for k in range(4)] for i in range(4)]
    fw = [[0.02] * 4 for _ in range(4)]
    bw = [[0.04] * 4 for _ in range(4)]
    r = simulate_opd_timeline(arr, fw, bw, barrier_s=0.01, head_fraction=0.3)
    assert r["sync"]["tail_s"] > r["stream-trajectory"]["tail_s"] > r["stream-turn"]["tail_s"]
    assert r["stream-turn-head-first"]["tail_s"] < r["stream-turn"]["tail_s"]
    assert abs(r["sync"]["tail_s"] - (4 * 0.24 + 0.01)) < 1e-9


def _run(item):
    """The worker run (LAYOUT[/RECOMPUTE]) a parallel test of this module reads, or None."""
    name = getattr(item, "originalname", item.name)
    if name == "test_stream_turn_exact_parallel":
        return item_param(item, "layout")
    if name == "test_stream_turn_exact_pp2_with_recompute":
        return f"pp2/{item_param(item, 'recompute')}"
    return None


@pytest.fixture(scope="module")
def parallel_reports(request, tmp_path_factory):
    """report(run): the worker's JSON for that run. Two launches for the module: one with 2 processes for every
    selected 2-process run (tp2, then pp2 with recomputation off and with each selected setting, which share each
    case's sync reference) and one with 4 processes for tp2pp2; a run asked for outside that plan gets its own."""
    out = tmp_path_factory.mktemp("opd_parallel")
    planned = selected_params(request, _run)
    launched: set[int] = set()

    def report(run):
        nproc = 4 if run.startswith("tp2pp2") else 2
        if nproc not in launched:
            launched.add(nproc)
            mine = [r for r in planned if (4 if r.startswith("tp2pp2") else 2) == nproc]
            if mine:
                torchrun(WORKER, ["--runs", *mine, "--out-dir", str(out)], nproc=nproc)
        path = out / (run.replace("/", "+") + ".json")
        if not path.exists():
            torchrun(WORKER, ["--runs", run, "--out-dir", str(out)], nproc=nproc)
        with open(path) as f:
            return json.load(f)

    return report


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2", "tp2pp2"])
def test_stream_turn_exact_parallel(layout, parallel_reports):
    pp = 2 if "pp2" in layout else 1
    rep = parallel_reports(layout)
    _check(rep, pp=pp)
    if pp > 1:  # the kept activations of each stage (stream-turn keeps all open trajectories' graphs)
        peak = rep["token-mean"]["stream-turn"]["peak_graph_bytes"]
        assert all(b > 0 for b in peak), peak


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["full-uniform-1", "selective"])
def test_stream_turn_exact_pp2_with_recompute(recompute, parallel_reports):
    """--recompute-granularity on the learner's model under PP 2: every streamed mode (stream-turn's per-chunk p2p
    path included) == sync without recomputation ≤ 1e-12 on every rank."""
    _check(parallel_reports(f"pp2/{recompute}"), pp=2)


def test_pp_stream_turn_without_group_falls_back(megatron_single, caplog):
    """The one remaining fallback: PP > 1 but no pipeline group to address the neighbour stages."""
    from megatron_tsync.training.opd_learner import OPDLearner

    with caplog.at_level("WARNING"):
        L = OPDLearner(None, None, OPDLearnerConfig(mode="stream-turn"), pp_size=2)
    assert L.mode == "stream-trajectory" and L.link is None and "pp_group" in caplog.text
