"""The benchmark runs end to end and writes the documented JSON keys (timings are reported, not asserted)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_bench_quick_json(tmp_path):
    from tests.conftest import free_port

    out = tmp_path / "b.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_streaming.py"), "--quick", "--steps", "1",
                        "--profile", "independent", "--json", str(out), "--plot", str(tmp_path / "t.png")],
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    for m in ("sync", "stream-group", "stream-trajectory", "async"):
        assert r["modes"][m]["step_s"] > 0 and 0 <= r["modes"][m]["idle_frac"] <= 1
        assert m in r["speedup_vs_sync"] and m in r["fraction_of_ideal"] and m in r["delta_k"]
    assert r["ideal_step_s"] > 0 and r["delta_k_permutation_control"] is not None
    assert r["delta_k"]["stream-trajectory"] < 1e-3  # streaming trains the same update as sync
    assert (tmp_path / "t.png").exists()
