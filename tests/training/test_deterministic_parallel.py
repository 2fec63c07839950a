"""--deterministic at TP=2, PP=2 and DP=2 (two gloo processes; one torchrun for TP=2, one for PP=2 then DP=2).

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
LAUNCHES = [("tp2",), ("pp2", "dp2")]  # the layouts of one torchrun, one after the other on its 2 processes


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """{layout: report}, filled a launch at a time (all three layouts in one launch: 92-157 s for one test on two
    busy cores, past the suite's 120 s per test; TP=2 costs about as much as PP=2 and DP=2 together)."""
    reports = {}

    def get(layout):
        if layout not in reports:
            group = next(g for g in LAUNCHES if layout in g)
            out = tmp_path_factory.mktemp(f"det_parallel_{'_'.join(group)}") / "report.json"
            torchrun(WORKER, ["--out", str(out), "--layouts", *group])
            with open(out) as f:
                reports.update(json.load(f))
        return reports[layout]

    return get


@pytest.fixture(scope="module", params=LAYOUTS)
def report(request, launched):
    """One layout's report, shared by both tests of the layout."""
    return request.param, launched(request.param)


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
