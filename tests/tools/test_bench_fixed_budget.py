"""tools/bench_fixed_budget.py: which checkpoint a budget credits (never a step that ended after it), the curves,
table and PNG from known runs (fast); one tiny real run of the tool (one mode, one seed, a few held-out prompts;
slow) whose JSON holds the fields and whose PNG is written."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
SPEC = importlib.util.spec_from_file_location("bench_fixed_budget",
                                              os.path.join(ROOT, "tools", "bench_fixed_budget.py"))
fb = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(fb)


def test_checkpoint_at_credits_only_steps_ended_within_the_budget():
    run = {"cum_rl_s": [4.0, 6.0, 9.5, 12.0]}
    assert fb.checkpoint_at(run, 3.9) == 0  # nothing finished: the warm start
    assert fb.checkpoint_at(run, 6.0) == 2  # steps 0, 1 ended → the checkpoint after step 1 is iteration 2
    assert fb.checkpoint_at(run, 11.9) == 3 and fb.checkpoint_at(run, 100) == 4


def test_curves_table_and_plot(tmp_path):
    runs = [{"mode": "sync", "seed": 1, "ckpt": "A", "cum_rl_s": [5.0, 10.0]},
            {"mode": "async", "seed": 1, "ckpt": "B", "cum_rl_s": [3.0, 6.0, 9.0]}]
    evals = {("W", 0): {"success_rate": 0.3, "stderr": 0.1}, ("A", 1): {"success_rate": 0.4, "stderr": 0.1},
             ("A", 2): {"success_rate": 0.5, "stderr": 0.1}, ("B", 1): {"success_rate": 0.6, "stderr": 0.1},
             ("B", 3): {"success_rate": 0.7, "stderr": 0.1}}
    cs = fb.curves(runs, "W", evals, [0.0, 5.0, 10.0])
    assert [p["success_rate"] for p in cs[0]["points"]] == [0.3, 0.4, 0.5]
    assert [p["steps"] for p in cs[1]["points"]] == [0, 1, 3]
    assert [p["success_rate"] for p in cs[1]["points"]] == [0.3, 0.6, 0.7]
    text = fb.table(cs, dict(fb.bl.machine(), load_before=(1.0,), load_after=(2.0,)), [], 10.0)
    assert "budget 10s" in text and "async" in text and "0.700" in text
    pytest.importorskip("matplotlib")
    assert fb.plot(cs, str(tmp_path / "p.png"), "t") and (tmp_path / "p.png").stat().st_size > 1000


def test_curves_need_every_point_evaluated():
    runs = [{"mode": "sync", "seed": 1, "ckpt": "A", "cum_rl_s": [5.0]}]
    with pytest.raises(KeyError):  # control: a point whose checkpoint was not evaluated is not silently skipped
        fb.curves(runs, "W", {("W", 0): {"success_rate": 0.3, "stderr": 0.1}}, [0.0, 5.0])


@pytest.mark.slow
def test_tool_trains_for_the_budget_and_evaluates(tmp_path):
    out = tmp_path / "r.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_fixed_budget.py"), "--modes", "sync",
                        "--seeds", "1", "--budget", "3", "--eval-prompts", "4", "--eval-points", "1", "--sft-steps",
                        "1", "--warm-dir", str(tmp_path / "warm"), "--work-dir", str(tmp_path / "runs"), "--out",
                        str(out), "--train-args", "--global-batch-size 8 --max-turns 2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    (c,) = r["curves"]
    assert c["mode"] == "sync" and [q["budget_s"] for q in c["points"]] == [0.0, 3.0]
    assert all(0.0 <= q["success_rate"] <= 1.0 for q in c["points"]) and r["runs"][0]["steps"] >= 1
    assert all(t <= 3.0 for t in r["runs"][0]["cum_rl_s"][:c["points"][-1]["steps"]])
    assert (tmp_path / "r.png").exists() and "held-out success" in p.stdout and "machine:" in p.stdout
