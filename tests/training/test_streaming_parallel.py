"""Streaming exactness under TP=2, PP=2 and DP=2 (two gloo processes each).

float64: streamed vs sync gradient ≤ 1e-12 relative on every layout (estimators, aggregations, clip with
ratio ≠ 1, KL/entropy strategies; see ``_workers/stream_worker.py``). float32, 3 Adam steps: Δ_k of each
streaming mode against sync is reported next to the permutation control, and every float32 run's distance to
the float64 run from the same θ0 is asserted: streaming is as close to the exact update as float32 sync is.
"""

import os

import pytest

from ._launch import torchrun

WORKER = os.path.join(os.path.dirname(__file__), "_workers", "stream_worker.py")
LAYOUTS = {"tp2": ["--tp", "2"], "pp2": ["--pp", "2"], "dp2": []}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float64_stream_equals_sync(layout, tmp_path):
    rep = torchrun(WORKER, [*LAYOUTS[layout], "--check", "f64", "--out", str(tmp_path / "r.json")],
                   out_json=str(tmp_path / "r.json"))
    assert rep["tp"] * rep["pp"] * rep["dp"] == 2
    for row in rep["result"]:
        assert row["stream-trajectory"] < 1e-12, row
        assert row["stream-group"] < 1e-12, row


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float64_packed_equals_unpacked_sync(layout, tmp_path):
    """Sequence packing on: sync, stream-trajectory and stream-group vs the unpacked sync gradient ≤ 1e-12."""
    rep = torchrun(WORKER, [*LAYOUTS[layout], "--check", "packed", "--out", str(tmp_path / "p.json")],
                   out_json=str(tmp_path / "p.json"))
    for row in rep["result"]:
        for mode in ("sync", "stream-trajectory", "stream-group"):
            assert row[mode] < 1e-12, (mode, row)
        mb = row["microbatches"]
        assert mb["sync"] < mb["sync-unpacked"], row  # packing really packed


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float32_three_steps(layout, tmp_path):
    """SGD (momentum 0.9), 3 steps: streaming is as close to the exact float64 update as float32 sync is.

    A reordering control leaves each microbatch's backward bit-identical; streaming backprops h_i and applies
    A_i later, so its rounding differs the way any other float32 implementation's would. The fair check is the
    distance to the float64 run from the same θ0.
    """
    rep = torch_run_f32(layout, tmp_path, "sgd")
    err = rep["error_vs_float64"]
    base = max(err["sync"], err["sync-permuted"])
    assert err["stream-trajectory"] <= 2.0 * base, err
    assert err["stream-group"] <= 2.0 * base, err
    assert rep["delta_k_permutation_control"] > 0  # the control really reorders


def test_float32_adam_delta_k_report(tmp_path):
    """Adam, 3 steps, DP=2: Δ_k next to the permutation control (reported; Adam amplifies rounding of
    near-zero coordinates, so the figures are noisy: see the issue note). Sanity bound only."""
    rep = torch_run_f32("dp2", tmp_path, "adam")
    print("adam", rep)
    assert rep["delta_k"]["stream-trajectory"] < 1e-3
    assert rep["error_vs_float64"]["stream-trajectory"] < 1e-3


def torch_run_f32(layout, tmp_path, optimizer):
    out = str(tmp_path / f"{layout}-{optimizer}.json")
    return torchrun(WORKER, [*LAYOUTS[layout], "--check", "f32", "--optimizer", optimizer, "--out", out],
                    out_json=out)["result"]
