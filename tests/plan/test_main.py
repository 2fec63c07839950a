"""``python -m megatron_tsync.plan``: the report (JSON), the PNG timeline, an HF config.json as the model, a recorded
endpoint trace as the latency source, and bad input refused with one line."""

import json
import os

import pytest

from megatron_tsync.plan.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--prompts", "4", "--group-size", "4", "--steps", "2"]


def test_report_plot_and_hf_config(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"group": f"r{g}", "index": i, "tool_s": [0.5 * (g + 1), 2.0 * i], "verify_s": 0.3, "rollout_s": 9.0}
            for g in range(3) for i in range(4)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = main(SMALL + ["--model", os.path.join(ROOT, "examples", "qwen3_swe", "config.json"), "--tp", "2",
                        "--profile", str(trace), "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png")])
    saved = json.loads((tmp_path / "p.json").read_text())
    assert set(saved["modes"]) == {"sync", "stream-group", "stream-trajectory", "async"}
    for m in saved["modes"].values():
        assert m["step_s"] >= m["bound_s"] > 0
    assert saved["modes"]["stream-trajectory"]["speedup_vs_sync"] > 1.0
    assert 7e9 < saved["model"]["total_params"] < 9e9  # Qwen3-8B's shape
    mem = saved["bucket_memory"]
    assert mem["bucket_vectors"] == 2 * mem["peak_open_groups"] > 0
    assert set(out["recommended"]) == {"stream_coalesce_tokens", "sequence_packing", "max_device_buckets"}
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_input_is_one_line():
    with pytest.raises(SystemExit, match="unknown"):
        main(SMALL + ["--modes", "sync,fast"])
    with pytest.raises(ValueError, match="neither a named size"):
        main(SMALL + ["--model", "no-such-model"])
    with pytest.raises(ValueError, match="do not split"):
        main(SMALL + ["--learner-gpus", "4", "--tp", "3"])
    with pytest.raises(SystemExit, match="drop --gpu"):
        main(["--scenario", "paper", "--gpu", "a100"])
    with pytest.raises(SystemExit, match="has its own"):
        main(SMALL + ["--profile", "run/trace.jsonl", "--calls", "2"])
