"""tools/bench_streaming.py: the ideal bound is a true, tight lower bound (hand-computed schedules, with controls),
the makespan-ratio sweep and the bound fields are in the output, simulated rollouts burn CPU when asked.
Timings are reported, not asserted, except that no step beats its own bound."""

import importlib.util
import json
import os
import random
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ("sync", "stream-group", "stream-trajectory", "async")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_streaming", os.path.join(ROOT, "tools", "bench_streaming.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _greedy_makespan(jobs, barrier):
    """Independent check: run the jobs one at a time in release order, never idling while one is released."""
    t = 0.0
    for r, w in sorted(jobs):
        t = max(t, r) + w
    return t + barrier


def test_ideal_bound_hand_computed():
    b = _bench()
    # jobs (release, work): candidates r_j + Σ_{r_i ≥ r_j} w_i = 0 + 2.5, 0.5 + 1.5, 3 + 0.5 -> 3.5; + barrier 0.2
    jobs = [(0.0, 1.0), (0.5, 1.0), (3.0, 0.5)]
    assert b.ideal_bound(jobs, 0.2) == pytest.approx(3.7)
    # the maximum sits at the middle job: 0 + 3.2, 1 + 3, 1.5 + 1 -> 4.0; + 0.1
    jobs2 = [(0.0, 0.2), (1.0, 2.0), (1.5, 1.0)]
    assert b.ideal_bound(jobs2, 0.1) == pytest.approx(4.1)
    # tight: the greedy release-order schedule attains it (so it is not a too-small bound), on random cases too
    rnd = random.Random(0)
    for case in [jobs, jobs2] + [[(rnd.random() * 3, rnd.random()) for _ in range(rnd.randint(1, 12))]
                                 for _ in range(200)]:
        assert b.ideal_bound(case, 0.3) == pytest.approx(_greedy_makespan(case, 0.3))
    # control: a bound that forgets the release times (total work + barrier) is too small, and the check sees it
    assert sum(w for _, w in jobs) + 0.2 < _greedy_makespan(jobs, 0.2) - 0.5


def _res(intervals, step_s):
    busy = sum(b - a for a, b in intervals)
    return types.SimpleNamespace(busy_intervals=intervals, busy_s=busy, step_s=step_s, idle_frac=1 - busy / step_s,
                                 peak_bucket_vectors=0)


def test_step_row_bound_and_flag():
    b = _bench()
    # two trajectories released at 0 and 1.5, each 1 s of forward+backward, then a 0.2 s barrier:
    # the learner ran [0, 1], idled, [1.5, 2.5], barrier [2.5, 2.7] -> bound 1.5 + 1 + 0.2 = 2.7, fraction 1
    intervals = [(0.0, 1.0), (1.5, 2.5), (2.5, 2.7)]
    mb = [(["a"], 1.0), (["b"], 1.0)]
    row = b._step_row(_res(intervals, 2.7), mb, {"a": 0.0, "b": 1.5}, 0.0)
    assert row["ideal_step_s"] == pytest.approx(2.7) and row["fraction_of_ideal"] == pytest.approx(1.0)
    assert row["barrier_s"] == pytest.approx(0.2)
    assert b.bound_violations([row], 0.02) == []
    # control: a step reported faster than its own work allows (1.9 s) is flagged
    fast = b._step_row(_res(intervals, 1.9), mb, {"a": 0.0, "b": 1.5}, 0.0)
    assert b.bound_violations([fast], 0.02) == [fast] and fast["fraction_of_ideal"] > 1.4
    # control: work of a trajectory that was not timed (the bound would be too small) is refused
    with pytest.raises(RuntimeError, match="timed 1 trajectory"):
        b._step_row(_res(intervals, 2.7), mb[:1], {"a": 0.0, "b": 1.5}, 0.0)


def _run_tool(tmp_path, name, *extra):
    from tests.conftest import free_port

    out = tmp_path / f"{name}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_streaming.py"), *extra, "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout


@pytest.mark.slow  # a whole benchmark sweep (the tool end to end): the full suite
def test_bench_tiny_sweep(tmp_path):
    tiny = ["--groups", "2", "--group-size", "2", "--steps", "1", "--hidden", "32", "--layers", "1", "--min-len", "24",
            "--max-len", "40"]
    r, stdout = _run_tool(tmp_path, "sweep", *tiny, "--repeats", "2", "--rollout-cpu-frac", "0.5")
    assert r["makespan_ratios"] == [0.25, 1.0, 4.0] and set(r["sweep"]) == {"0.25", "1", "4"}
    assert r["rollout_cpu"]["frac"] == 0.5 and r["rollout_cpu"]["procs"] == 1
    for key, cell in r["sweep"].items():
        assert cell["makespan_s"] == pytest.approx(float(key) * r["startup_work_s"])
        assert set(cell["modes"]) == set(MODES)
        for m, c in cell["modes"].items():
            assert len(c["per_repeat_step_s"]) == 2 and c["step_s_spread"][0] <= c["step_s"] <= c["step_s_spread"][1]
            assert 0 < c["ideal_step_s"] and 0 < c["fraction_of_ideal"] <= c["fraction_of_ideal_max"]
            assert c["fraction_of_ideal_max"] <= 1 + r["bound_tolerance"]  # no mode beats its own bound
            assert c["learner_busy_s"] > 0 and "speedup_vs_sync" in c and "delta_k" in c
        assert cell["modes"]["stream-trajectory"]["delta_k"] < 1e-3  # streaming trains the same update as sync
        assert sum(c["rollout_cpu_s"] for c in cell["modes"].values()) > 0  # the simulated rollouts burned CPU
    assert r["bound_violations"] == [] and "no step beat its ideal bound" in stdout
    assert "rollout CPU: 1 busy worker process(es)" in stdout
    assert r["reference_ratio"] == 1.0 and r["modes"] == r["sweep"]["1"]["modes"] and r["ideal_step_s"] > 0
    # control: the default (sleeps) burns nothing and says so; one ratio sweeps one ratio
    r0, stdout0 = _run_tool(tmp_path, "sleeps", *tiny, "--repeats", "1", "--makespan-ratio", "4",
                            "--modes", "sync,stream-trajectory")
    assert set(r0["sweep"]) == {"4"} and r0["rollout_cpu"]["procs"] == 0 and "rollouts are sleeps" in stdout0
    assert all(c["rollout_cpu_s"] == 0 for c in r0["sweep"]["4"]["modes"].values())


def test_bench_bad_flags():
    for bad in (["--makespan-ratio", "1,x"], ["--makespan-ratio", "0"], ["--rollout-cpu-frac", "1.5"],
                ["--modes", "sync,streaming"], ["--min-len", "64", "--max-len", "32"]):
        p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_streaming.py"), *bad],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and bad[0] in p.stderr, p.stderr


@pytest.mark.slow
def test_bench_quick_json(tmp_path):
    r, _ = _run_tool(tmp_path, "b", "--quick", "--steps", "1", "--profile", "independent",
                     "--plot", str(tmp_path / "t.png"))
    for m in MODES:
        assert r["modes"][m]["step_s"] > 0 and 0 <= r["modes"][m]["idle_frac"] <= 1
        assert m in r["speedup_vs_sync"] and m in r["fraction_of_ideal"] and m in r["delta_k"]
    assert r["ideal_step_s"] > 0 and r["delta_k_permutation_control"] is not None
    assert r["delta_k"]["stream-trajectory"] < 1e-3
    assert r["bound_violations"] == []
    assert (tmp_path / "t.png").exists()


def test_quick_sets_defaults_and_explicit_flags_win():
    """``--quick`` sets the reduced sizes as defaults; ``--steps 1`` beside it is 1 step (it was overridden to 2)."""
    from tools.bench_streaming import _args

    a = _args(["--quick", "--steps", "1"])
    assert (a.groups, a.group_size, a.steps, a.max_len, a.repeats) == (4, 4, 1, 96, 2)
    assert (_args([]).groups, _args([]).steps, _args([]).repeats, _args(["--quick"]).steps) == (8, 3, 3, 2)
