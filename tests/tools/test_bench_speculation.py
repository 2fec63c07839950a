"""tools/bench_speculation.py runs end to end on a tiny setting and writes every field; with a perturbed θ_{k+1}
some drafted tokens are rejected (kept < 100 %), with θ_{k+1} = θ_k all are kept."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tmp_path, noise):
    out = tmp_path / f"spec{noise}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_speculation.py"), "--settings", "8x6",
                        "--rows", "8", "--repeats", "1", "--noise", str(noise), "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())["results"][0]


@pytest.mark.slow  # the tool end to end: the full suite
def test_tool_reports_ratio_and_kept_fraction(tmp_path):
    same, perturbed = _run(tmp_path, 0), _run(tmp_path, 2.0)
    assert set(same) == {"prompt", "turn", "plain_ms", "verify_ms", "kept_frac", "ratio"}
    assert same["kept_frac"] == 1.0 and perturbed["kept_frac"] < 1.0
    assert same["plain_ms"] > 0 and same["verify_ms"] > 0
