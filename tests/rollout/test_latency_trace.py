"""Latency traces: records of real trajectories, concurrent appends, and their replay as a --latency-profile."""

import json
import threading

import pytest

from megatron_tsync.rollout.agent_loop import ToolCallRecord, Trajectory
from megatron_tsync.rollout.latency_trace import LatencyTrace, latency_profile_from_trace, trace_record
from megatron_tsync.runtime.latency import load_latency_profile


def _traj(index, tool_s):
    calls = [ToolCallRecord(t, "bash", "ls", True, None, (0, 0), w) for t, w in enumerate(tool_s)]
    return Trajectory(index=index, token_ids=[1, 2, 3], prompt_len=1, loss_mask=[0, 1, 1], logprobs=[0, -1, -1],
                      turn_spans=[(1, 2), (2, 3)], tool_calls=calls, policy_version=4)


def test_records_replay_exactly(tmp_path):
    a = tmp_path / "w0.jsonl"
    LatencyTrace(str(a)).append(trace_record(_traj(0, [3.0, 0.5]), group="g-slow", rollout_s=9.0, verify_s=2.0))
    LatencyTrace(str(a)).append(trace_record(_traj(1, [4.0]), group="g-slow", rollout_s=8.0))
    LatencyTrace(str(tmp_path / "sub" / "w1.jsonl")).append(trace_record(_traj(0, []), group="g-fast", rollout_s=1.0,
                                                                         verify_s=0.1))
    rec = json.loads(a.read_text().splitlines()[0])
    assert rec == {"group": "g-slow", "index": 0, "policy_version": 4, "turns": 2, "rollout_s": 9.0,
                   "tool_s": [3.0, 0.5], "verify_s": 2.0}
    spec = latency_profile_from_trace([str(a), str(tmp_path / "sub" / "w1.jsonl")])
    assert spec == {"kind": "trace", "groups": {"g-slow": [[3.0, 0.5, 2.0], [4.0]], "g-fast": [[0.1]]}}
    assert latency_profile_from_trace(str(a), include_verify=False)["groups"]["g-slow"] == [[3.0, 0.5], [4.0]]
    out = tmp_path / "profile.json"
    out.write_text(json.dumps(spec))
    p = load_latency_profile(str(out))  # what --latency-profile FILE.json and the benchmark load
    assert [p.sample(0, 0, t) for t in range(3)] == [3.0, 0.5, 2.0]  # group 0 = first-seen group, row 0
    assert [p.sample(0, 1, 0), p.sample(1, 0, 0), p.sample(2, 1, 1)] == [4.0, 0.1, 4.0]  # rows/groups wrap


def test_concurrent_appends_and_bad_lines(tmp_path):
    path = tmp_path / "trace.jsonl"
    trace = LatencyTrace(str(path))

    def write(k):
        for i in range(50):
            trace.append({"group": f"g{k}", "tool_s": [0.001 * i] * 30, "rollout_s": 1.0, "pad": "x" * 500})

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(len(v) for v in latency_profile_from_trace(str(path))["groups"].values()) == 200  # no torn lines
    with pytest.raises(ValueError, match="lacks 'tool_s'"):
        trace.append({"group": "g", "rollout_s": 1.0})
    path.write_text(path.read_text() + '{"group": "g", "tool_s": [-1.0], "rollout_s": 1}\n')
    with pytest.raises(ValueError, match=r"trace.jsonl:201: latencies must be finite and >= 0"):
        latency_profile_from_trace(str(path))
    (tmp_path / "bad.jsonl").write_text('{"group": "g"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a latency trace line"):
        latency_profile_from_trace(str(tmp_path / "bad.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no trajectories"):
        latency_profile_from_trace(str(tmp_path / "empty.jsonl"))
