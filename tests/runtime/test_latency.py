"""Tool-latency profiles: marginals, within-group correlation, determinism, JSON replay, and real delays in the
agent loop's sandboxed tool calls."""

import json
import math
import random
import statistics

import pytest

from megatron_tsync.runtime.latency import (
    BUILTIN_PROFILES, LatencyTools, LognormalLatency, TraceLatency, get_latency_profile, load_latency_profile,
    profile_from_spec, trajectory_latencies,
)


def quantile(xs, q):
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))]


def corr(a, b):
    return statistics.correlation(a, b)


def test_builtins_marginals():
    n = 20000
    assert all(get_latency_profile("none").sample(g, 0, 0) == 0.0 for g in range(10))
    u = [get_latency_profile("uniform", scale=2.0).sample(0, i, 0) for i in range(n)]
    assert min(u) >= 1.0 and max(u) <= 3.0 and statistics.fmean(u) == pytest.approx(2.0, abs=0.02)
    for name in ("swe-like", "independent"):
        p = get_latency_profile(name, scale=0.5)
        xs = [p.sample(g, i, 0) for g in range(n // 8) for i in range(8)]
        if name == "independent":  # i.i.d. draws: sample moments are tight
            assert statistics.fmean(xs) == pytest.approx(p.mean, rel=0.05)
        assert statistics.median(xs) == pytest.approx(p.quantile(0.5), rel=0.08 if name == "independent" else 0.25)
        assert quantile(xs, 0.9) == pytest.approx(p.quantile(0.9), rel=0.1 if name == "independent" else 0.3)
    lp = LognormalLatency(mu=0.0, sigma=1.0)
    assert lp.mean == pytest.approx(math.exp(0.5)) and lp.quantile(0.5) == pytest.approx(1.0)
    assert lp.quantile(0.99) == pytest.approx(math.exp(2.3263478740), rel=1e-6)


def test_within_group_correlation():
    groups = 3000
    for name, lo, hi in (("swe-like", 0.7, 0.9), ("independent", -0.06, 0.06)):
        p = get_latency_profile(name)
        logs = [[math.log(p.sample(g, i, 0)) for i in range(2)] for g in range(groups)]
        r = corr([a for a, _ in logs], [b for _, b in logs])
        assert lo < r < hi, (name, r)
    # per-trajectory totals keep the group structure (what the benchmark's arrival pattern uses)
    tot = trajectory_latencies(get_latency_profile("swe-like"), 2000, 4, calls_per_traj=3)
    assert len(tot) == 2000 and all(len(row) == 4 for row in tot)
    r = corr([math.log(row[0]) for row in tot], [math.log(row[1]) for row in tot])
    assert r > 0.6
    # trajectory correlation: calls of one trajectory share a factor
    p = LognormalLatency(group_corr=0.0, traj_corr=0.9)
    pairs = [(math.log(p.sample(g, 0, 0)), math.log(p.sample(g, 0, 1))) for g in range(groups)]
    assert corr(*zip(*pairs)) > 0.8


def test_determinism_and_scale():
    a = get_latency_profile("swe-like", seed=3)
    b = get_latency_profile("swe-like", seed=3)
    c = get_latency_profile("swe-like", seed=4)
    coords = [(g, i, t) for g in range(5) for i in range(4) for t in range(3)]
    va = [a.sample(*x) for x in coords]
    assert va == [b.sample(*x) for x in reversed(coords)][::-1], "draws must not depend on call order"
    assert va != [c.sample(*x) for x in coords]
    assert [a.with_scale(2.0).sample(*x) for x in coords] == pytest.approx([2 * v for v in va])
    # with an rng, per-call noise comes from it (reproducible by reseeding)
    r1 = [a.sample(0, i, 0, random.Random(9)) for i in range(3)]
    assert r1 == [a.sample(0, i, 0, random.Random(9)) for i in range(3)]
    s0, s1 = a.for_step(0), a.for_step(1)
    assert s0.sample(0, 0, 0) == a.for_step(0).sample(0, 0, 0) != s1.sample(0, 0, 0)
    assert sum(trajectory_latencies(a, 2, 3, calls_per_traj=[1, 0, 2, 1, 1, 1])[0]) == pytest.approx(
        a.sample(0, 0, 0) + a.sample(0, 2, 0) + a.sample(0, 2, 1))


def test_json_specs_and_replay(tmp_path):
    f = tmp_path / "dist.json"
    f.write_text(json.dumps({"kind": "lognormal", "mu": -2.0, "sigma": 0.5, "group_corr": 0.3, "scale": 2.0}))
    p = load_latency_profile(str(f), scale=0.5)
    assert isinstance(p, LognormalLatency) and p.scale == 1.0 and p.group_corr == 0.3 and p.mu == -2.0
    # a bare list: each call draws one entry of the trace, about uniformly
    f.write_text(json.dumps([0.1, 0.2, 5.0]))
    p = load_latency_profile(str(f))
    xs = [p.sample(g, i, 0) for g in range(300) for i in range(10)]
    assert set(xs) == {0.1, 0.2, 5.0}
    assert xs.count(5.0) / len(xs) == pytest.approx(1 / 3, abs=0.04)
    # groups: flat pools are bootstrapped within the group; lists of lists replay exactly
    spec = {"kind": "trace", "groups": {"slow": [[3.0, 4.0], [5.0]], "fast": [0.1, 0.3]}}
    p = profile_from_spec(spec)
    assert isinstance(p, TraceLatency)
    assert [p.sample(0, 0, t) for t in range(3)] == [3.0, 4.0, 3.0]
    assert p.sample(0, 1, 0) == 5.0 and p.sample(2, 3, 7) == 5.0  # group 2 -> key 0, traj 3 -> row 1
    assert {p.sample(1, i, 0) for i in range(50)} == {0.1, 0.3}
    assert profile_from_spec({"kind": "swe-like", "group_corr": 0.5}).group_corr == 0.5
    assert load_latency_profile("uniform").sample(0, 0, 0) > 0
    for bad in ({"kind": "gamma"}, {"kind": "uniform", "mu": 1}, {"kind": "uniform", "a": 2, "b": 1},
                {"kind": "trace", "latencies": []}, {"kind": "trace", "latencies": [-1]}, {"kind": "trace"},
                {"kind": "lognormal", "group_corr": 1.5}, "x"):
        with pytest.raises(ValueError):
            profile_from_spec(bad)
    with pytest.raises(FileNotFoundError):
        load_latency_profile(str(tmp_path / "missing.json"))
    assert set(BUILTIN_PROFILES) == {"none", "uniform", "swe-like", "independent"}


def test_latency_tools_delay_real_sandboxed_calls(tmp_path_factory):
    """In the agent loop every calculator call sleeps the profile's delay inside the sandbox, at the right
    (group, trajectory, turn) coordinates."""
    import os

    from tokenizers import Tokenizer

    from megatron_tsync.rollout.agent_loop import AgentConfig, AgentLoop
    from megatron_tsync.model.tokenizer import TokenizerCodec, tag_token_id
    from megatron_tsync.rollout.engine import SamplingConfig
    from megatron_tsync.runtime.tasks import ArithmeticCalculatorTask
    from tests.runtime.test_tasks import ScriptedEngine

    d = tmp_path_factory.getbasetemp() / "tiny_llama_rollout"
    if not (d / "config.json").exists():
        from megatron_tsync.model.tiny_model import make_tiny_model

        make_tiny_model(str(d), seed=0)
    codec = TokenizerCodec(Tokenizer.from_file(os.path.join(d, "tokenizer.json")))
    task = ArithmeticCalculatorTask()
    insts = task.sample_prompts(0, 2, seed=1)
    G = 2
    spec = {"kind": "trace", "groups": {"a": [[0.05]], "b": [[0.6], [0.3]]}}
    tools = LatencyTools(profile_from_spec(spec), group_size=G)
    sampling = SamplingConfig(max_new_tokens=32, stop_token_ids=(tag_token_id(codec, "</answer>"),),
                              tool_token_ids=(tag_token_id(codec, "</tool>"),), seed=0)
    loop = AgentLoop(ScriptedEngine(codec, task, insts), codec, AgentConfig(sampling=sampling, max_total_tokens=128),
                     tools=tools)
    trajs = loop.run([codec.encode(i.prompt_text) for i in insts for _ in range(G)])
    assert sorted(tools.delays) == [(0, 0, 0, 0.05), (0, 1, 0, 0.05), (1, 0, 0, 0.6), (1, 1, 0, 0.3)]
    for t, want in zip(trajs, [0.05, 0.05, 0.6, 0.3]):
        (call,) = t.tool_calls
        assert call.ok and call.wall_s >= want, (call.wall_s, want)
    assert trajs[2].tool_calls[0].wall_s > trajs[0].tool_calls[0].wall_s + 0.3
    # the same through RegistryTools(delay_fn=...) with coordinates from the trajectory metadata
    from megatron_tsync.rollout.agent_loop import RegistryTools
    from megatron_tsync.runtime.latency import profile_delay_fn

    seen = []
    fn = profile_delay_fn(profile_from_spec(spec), group_size=99)

    def delay_fn(traj, turn):
        seen.append((traj.metadata["group"], traj.metadata["index"], turn, fn(traj, turn)))
        return seen[-1][-1]

    loop = AgentLoop(ScriptedEngine(codec, task, insts), codec, AgentConfig(sampling=sampling, max_total_tokens=128),
                     tools=RegistryTools(delay_fn=delay_fn))
    meta = [{"group": g, "index": i} for g in range(2) for i in range(G)]
    loop.run([codec.encode(i.prompt_text) for i in insts for _ in range(G)], metadata=meta)
    assert sorted(seen) == sorted(tools.delays)
