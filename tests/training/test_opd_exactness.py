"""OPD turn-level streaming is exact (streaming_math.md §6-7), and cutting the gradient at turn boundaries is not.

float64, multi-turn trajectories with tool-output tokens (loss_mask 0) between turns, turns of different trajectories
interleaved: the gradient after the barrier of ``stream-turn`` (incremental forward, graph kept, one backward per
trajectory), ``stream-turn`` with ``head_first`` and ``stream-trajectory`` equals the batch (``sync``) gradient to
≤ 1e-12 relative; the control that detaches the prefix at each turn is off by ≫ 1e-12. One process, then TP=2 and
PP=2 under torchrun (PP: stream-turn falls back to stream-trajectory, which must say so and stay exact).
"""

import os
import sys

import pytest
import torch

from ._launch import torchrun

WORKER = os.path.join(os.path.dirname(__file__), "_workers", "opd_worker.py")
sys.path.insert(0, os.path.dirname(WORKER))
import opd_worker as W  # noqa: E402

from megatron_tsync.training.opd_learner import (  # noqa: E402
    IncrementalGPT,
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
        if pp > 1:
            assert row["stream-turn"]["ran"] == "stream-trajectory", row
        else:
            assert row["stream-turn"]["ran"] == "stream-turn", row
            assert row["cut"]["rel"] > 1e-3, (case, row["cut"])  # the control: not exact, so the test can fail


def test_stream_turn_exact_single_process(megatron_single):
    _check(W.run_cases(megatron_single))


def test_incremental_forward_matches_full_forward(megatron_single):
    from megatron_tsync.training.model import PrecisionConfig, build_model

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


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_stream_turn_exact_parallel(layout, tmp_path):
    args = {"tp2": ["--tp", "2"], "pp2": ["--pp", "2"]}[layout]
    rep = torchrun(WORKER, [*args, "--out", str(tmp_path / "r.json")], out_json=str(tmp_path / "r.json"))
    _check(rep, pp=2 if layout == "pp2" else 1)
