"""tools/validate_plan.py end to end at the smallest size: calibration on the real learner, measured runs of the three
modes, the simulator's predictions of the same release times, the README-ready table. (Its accuracy is a
measurement on a quiet machine, docs/planner.md; here only that every number is there and consistent.)"""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def test_smallest_run(megatron_single, tmp_path):
    import validate_plan

    out = validate_plan.main(["--quick", "--batches", "2x4", "--profiles", "uniform", "--out",
                              str(tmp_path / "v.json")])
    saved = json.loads((tmp_path / "v.json").read_text())
    assert [c["mode"] for c in saved["cells"]] == ["sync", "stream-trajectory", "async"]
    for c in saved["cells"]:
        assert c["measured_step_s"] > 0 and c["predicted_step_s"] > 0
        assert c["error"] == pytest.approx(c["predicted_step_s"] / c["measured_step_s"] - 1)
        assert [len(r) for r in c["predicted_steps_s"]] == [2]  # --quick: 1 repeat of 2 steps
    cal, = saved["calibration"]  # one calibration per repeat
    assert cal["per_token_s"] >= 0 and cal["barrier_s"] > 0  # (timings: no thresholds)
    assert "| uniform | 2x4 | stream-trajectory |" in out["markdown"]


def test_bad_batches_refused():
    import validate_plan

    with pytest.raises(SystemExit):
        validate_plan.main(["--batches", "4by4"])
