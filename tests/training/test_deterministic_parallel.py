"""--deterministic at TP=2, PP=2 and DP=2 (two gloo processes; three torchruns: TP=2's first two cases, TP=2's third
case then DP=2, PP=2).

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
# a part: a layout with all or some of the worker's cases. The worker's seconds for all three cases (one run, load
# 30-50): TP=2 83.7, PP=2 32.2, DP=2 22.8, plus ~25 s of start-up a launch: TP=2's cases split over two launches
PARTS = ["tp2:grpo-bounded,engine-dual-clip-kl", "tp2:dr_grpo-minibatches", "dp2", "pp2"]
LAUNCHES = [(PARTS[0],), (PARTS[1], "dp2"), ("pp2",)]  # the parts of one torchrun, one after the other


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """{part: report}, filled a launch at a time (the test that triggers a launch holds it: all three layouts in one
    launch took 92-157 s on two busy cores, TP=2 alone 103 s; the suite's aim is 90 s per test)."""
    reports = {}

    def get(layout):
        if layout not in reports:
            group = next(g for g in LAUNCHES if layout in g)
            out = tmp_path_factory.mktemp(f"det_parallel_{LAUNCHES.index(group)}") / "report.json"
            torchrun(WORKER, ["--out", str(out), "--layouts", *group])
            with open(out) as f:
                reports.update(json.load(f))
        return reports[layout]

    return get


@pytest.fixture(scope="module", params=PARTS, ids=["tp2-a", "tp2-b", "dp2", "pp2"])
def report(request, launched):
    """One part's report, shared by both tests of the part."""
    return request.param, launched(request.param)


@pytest.mark.slow
def test_bitwise_equal_across_modes_and_orders(report):
    layout, rep = report
    assert rep["tp"] * rep["pp"] * rep["dp"] == 2
    assert len(rep["cases"]) == (len(layout.split(":")[1].split(",")) if ":" in layout else 3), rep["cases"].keys()
    for case, row in rep["cases"].items():
        assert all(row["det"].values()), (layout, case, row["det"])


@pytest.mark.slow
def test_control_default_mode_differs(report):
    layout, rep = report
    for case, row in rep["cases"].items():
        assert sum(not v for v in row["default"].values()) >= 3, (layout, case, row["default"])
