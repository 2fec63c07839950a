"""tools/bench_kv_reuse.py runs end to end on a small batch: both modes sample the same tokens (it exits otherwise)
and KV reuse does less engine work than the full re-prefill (counted in prefilled positions: its speed-up is
printed, not asserted, as a loaded machine's timings say little)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_kv_reuse_runs_and_reuse_does_less_work(tmp_path):
    out = tmp_path / "kv.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_kv_reuse.py"), "--trajectories", "2",
                        "--turns", "6", "--page-lines", "4", "--json", str(out)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["turns"] == 6 and len(res["full_s"]) == len(res["reuse_s"]) == 1
    assert res["longest_context"] > 6 * 100  # the pages were appended
    # the work: the full mode prefills each turn's whole context, reuse only what is new (a page and the turn's tokens)
    work = res["prefill_positions"]
    assert 0 < work["reuse"] * 2 < work["full"], work
    print(f"prefilled positions {work}, engine speed-up {res['speedup']:.2f}x (~1.8x at this size on an idle machine)")
