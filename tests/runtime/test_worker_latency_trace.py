"""A training run's rollout workers write each trajectory's real latencies (``ROLLOUT_DIR/latency_trace/``), and the
trace replays as a ``--latency-profile``."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_training_run_writes_a_replayable_latency_trace(tiny_dir, tmp_path):
    from megatron_tsync.rollout.openai_server import main
    from megatron_tsync.runtime.latency import load_latency_profile
    from tests.conftest import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    plane = tmp_path / "plane"
    args = ["--model", tiny_dir, "--group-size", "2", "--global-batch-size", "4", "--rollout-workers", "2",
            "--max-turns", "2", "--max-new-tokens", "16", "--seq-length", "128", "--train-iters", "2",
            "--rollout-dir", str(plane), "--no-progress"]
    p = subprocess.run([sys.executable, "-m", "megatron_tsync.train", *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"train failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    files = sorted(os.listdir(plane / "latency_trace"))
    assert files == ["worker0.jsonl", "worker1.jsonl"]
    recs = [json.loads(line) for f in files for line in open(plane / "latency_trace" / f)]
    assert len(recs) == 8 and sorted(r["step"] for r in recs) == [0] * 4 + [1] * 4  # 2 steps x 4 trajectories
    for r in recs:
        assert r["rollout_s"] > 0 and r["verify_s"] >= 0 and r["status"] in ("ok", "error")
        assert 1 <= r["turns"] <= 2 and len(r["tool_s"]) <= r["turns"] and all(t >= 0 for t in r["tool_s"])
        assert r["policy_version"] == r["step"]
    assert len({r["group"] for r in recs}) == 4  # 2 groups per step
    out = tmp_path / "profile.json"
    assert main(["trace-to-profile", *(str(plane / "latency_trace" / f) for f in files), "--out", str(out)]) == 0
    profile = load_latency_profile(str(out))
    key = next(iter(json.loads(out.read_text())["groups"]))  # groups replay in first-seen order
    first = next(r for r in recs if r["group"] == key)
    assert profile.sample(0, 0, len(first["tool_s"])) == pytest.approx(first["verify_s"])
    # the benchmark replays the run's own latencies: sync vs streaming vs the ideal bound on this workload (the two
    # modes compared here at the reference makespan ratio; the other modes and ratios replay the same profile)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    bench = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, os.path.join(root, "tools", "bench_streaming.py"), "--quick", "--steps", "1",
                        "--modes", "sync,stream-trajectory", "--makespan-ratio", "1",
                        "--latency-profile", str(out), "--json", str(bench)],
                       env=dict(env, MASTER_PORT=str(free_port())), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(bench.read_text())
    assert r["ideal_step_s"] > 0 and all(r["modes"][m]["step_s"] > 0 for m in ("sync", "stream-trajectory"))
    assert r["reference_ratio"] == 1.0 and r["profile"] == str(out), (r["reference_ratio"], r["profile"])
