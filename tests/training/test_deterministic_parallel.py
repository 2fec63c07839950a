"""--deterministic at TP=2, PP=2 and DP=2 (two gloo processes, one torchrun per layout).

float32, 2 Adam steps: sync (a second order), stream-trajectory (three orders) and stream-group give weights
torch.equal to sync's on every rank's shard, for GRPO, ratio ≠ 1 with dual clip and a KL term, and Dr.GRPO with 2
minibatches × 2 epochs; DP ranks by group (``DataParallelAssigner(dp, group_order)``). Control: the same runs
without --deterministic (DP ranks by arrival, as the live sources assign them) differ in their bits.
"""

import json
import os

import pytest

from ._launch import torchrun

WORKER = os.path.join(os.path.dirname(__file__), "_workers", "deterministic_worker.py")
LAYOUTS = ["tp2", "pp2", "dp2"]


@pytest.fixture(scope="module", params=LAYOUTS)
def report(request, tmp_path_factory):
    """One torchrun per layout, shared by both tests of the layout (all three layouts in one launch: 92-157 s for
    one test on two busy cores, past the suite's 120 s per test)."""
    layout = request.param
    out = tmp_path_factory.mktemp(f"det_parallel_{layout}") / "report.json"
    torchrun(WORKER, ["--out", str(out), "--layouts", layout])
    with open(out) as f:
        return layout, json.load(f)[layout]


@pytest.mark.slow
def test_bitwise_equal_across_modes_and_orders(report):
    layout, rep = report
    assert rep["tp"] * rep["pp"] * rep["dp"] == 2
    for case, row in rep["cases"].items():
        assert all(row["det"].values()), (layout, case, row["det"])


@pytest.mark.slow
def test_control_default_mode_differs(report):
    layout, rep = report
    for case, row in rep["cases"].items():
        assert sum(not v for v in row["default"].values()) >= 3, (layout, case, row["default"])
