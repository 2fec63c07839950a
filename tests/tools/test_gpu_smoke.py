"""The GPU smoke script runs on a CPU-only machine in its skip mode and says why each check was skipped."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # a tool's end-to-end run
def test_gpu_smoke_skips_on_cpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("a GPU is present: run tools/gpu_smoke.py itself")
    from tests.conftest import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    out = tmp_path / "s.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_smoke.py"), "--json", str(out)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["device"] == "CPU only"
    assert {x["check"] for x in r["results"]} >= {"te-spec", "stream-exact-bf16", "stream-exact-fp8", "learner-mfu",
                                                  "vllm-cuda", "nccl-weight-sync", "packed-thd-bf16",
                                                  "packed-thd-fp8", "vllm-native-ipc", "vllm-native-nccl",
                                                  "vllm-native-sparse", "vllm-routing",
                                                  "gated-delta-fla"}
    assert all(x["status"] == "skip" and x["detail"] for x in r["results"])
