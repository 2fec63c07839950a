"""--deterministic at TP=2, PP=2 and DP=2 (two gloo processes, one torchrun for the module; 95 s on 2
idle cores, 3.5 min on shared ones).

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


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("det_parallel") / "report.json"
    torchrun(WORKER, ["--out", str(out), "--layouts", *LAYOUTS])
    with open(out) as f:
        return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bitwise_equal_across_modes_and_orders(report, layout):
    rep = report[layout]
    assert rep["tp"] * rep["pp"] * rep["dp"] == 2
    for case, row in rep["cases"].items():
        assert all(row["det"].values()), (layout, case, row["det"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_control_default_mode_differs(report, layout):
    for case, row in report[layout]["cases"].items():
        assert sum(not v for v in row["default"].values()) >= 3, (layout, case, row["default"])
