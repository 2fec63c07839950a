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


def test_advice_ranks_the_ways_to_fit_not_only_the_offload(capsys):
    """Qwen3-32B at TP 8 on H100s: the stream-trajectory bucket peak cannot fit. The advice lists what does fit,
    fastest first: stream-group (no buckets) before host residency, whose host RAM per node and transfer time per
    step are stated (it used to print only --max-device-buckets 0) where 2 vectors fit on the GPU."""
    out = main(["--prompts", "8", "--group-size", "4", "--steps", "2", "--model", "qwen3-32b", "--gpu", "h100",
                "--learner-gpus", "8", "--rollout-gpus", "8", "--tp", "8"])
    opts = out["options"]
    fits = [o for o in opts if o["fits"]]
    assert fits[0]["flags"] == "--rl-mode stream-group" and fits[0]["bucket_gib"] == 0
    assert [o["step_s"] for o in fits] == sorted(o["step_s"] for o in fits)
    assert any(not o["fits"] and o["flags"] == "--rl-mode stream-trajectory" for o in opts)
    # not 2 vectors fit next to the model state: residency (its device cache holds >= 2) does not fit either (it
    # used to be advised as --max-device-buckets 0, which the trainer refuses)
    res = next(o for o in opts if "--max-device-buckets" in o["flags"])
    assert not res["fits"] and res["flags"].endswith("--max-device-buckets 2") and "keeps 2 vectors" in res["why"]
    assert out["recommended"]["max_device_buckets"]["value"] is None
    host = next(o for o in opts if "--accumulate-on-host" in o["flags"])  # needs no GPU memory beyond the model
    assert not host["fits"] and "the model state leaves" in host["why"]  # state, which already does not fit here
    text = capsys.readouterr().out
    assert "options within memory, fastest predicted step first:\n  1. --rl-mode stream-group: step" in text
    assert "does not fit: --rl-mode stream-trajectory" in text
    out = main(["--prompts", "8", "--group-size", "4", "--steps", "2", "--model", "qwen3-32b", "--gpu", "h200",
                "--learner-gpus", "8", "--rollout-gpus", "8", "--tp", "8"])  # room for one open group's 2 vectors
    fits = [o for o in out["options"] if o["fits"]]
    flags = [o["flags"] for o in fits]
    assert flags[0] == "--rl-mode stream-group" and "--rl-mode stream-trajectory --max-open-groups 1" in flags
    res = next(o for o in fits if "--max-device-buckets" in o["flags"])
    assert res["host_gib_per_node"] > 0 and res["transfer_s"] >= 0
    host = next(o for o in fits if "--accumulate-on-host" in o["flags"])  # no bucket vector on the GPU
    assert host["bucket_gib"] == 0 and host["host_gib_per_node"] > res["host_gib_per_node"] and host["transfer_s"] > 0
    assert "GiB per 8-GPU node, " in capsys.readouterr().out
