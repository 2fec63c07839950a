"""KV reuse across turns in the embedded engine: reuse on == reuse off (float64: identical tokens, log-probs ≤ 1e-12)
over multi-turn sessions with tool outputs, a weight update between turns, rows finishing at different times, a
released session and a new one mixed with cached ones; the session store's bounds; the agent loop's sessions.

Tiny Llama (hidden 128, 2 layers) built in float64, TP=1, gloo on CPU.
"""

import os

import pytest
import torch

torch.set_num_threads(1)

from megatron_tsync.rollout.engine import SamplingConfig  # noqa: E402
from megatron_tsync.rollout.kv_sessions import KVEntry, SessionKVStore, common_prefix  # noqa: E402

TOL = 1e-12


@pytest.fixture(scope="module")
def f64(megatron_single, tiny_dir):
    """(engine over a float64 tiny model, weights A, weights B)."""
    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine

    arch, _ = load_hf_dir(tiny_dir)
    model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=3)
    a = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    b = {k: v + 0.02 * torch.randn(v.shape, dtype=v.dtype, generator=torch.Generator().manual_seed(7))
         if v.is_floating_point() else v.clone() for k, v in a.items()}
    return EmbeddedEngine(model), a, b


def _rand(n, seed):
    return torch.randint(9, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _episode(engine, a, b, reuse: bool):
    """A scripted multi-turn episode of 5 sessions; returns every completion in order."""
    engine.update_weights(a, 0)
    samp = SamplingConfig(max_new_tokens=7, temperature=1.0, stop_token_ids=tuple(range(9, 120)),
                          tool_token_ids=tuple(range(120, 200)))
    ctx = {s: _rand(4 + 5 * s, s) for s in range(5)}
    out = []

    def turn(sessions, turn_no):
        seeds = [1000 * s + turn_no for s in sessions]
        res = engine.generate([ctx[s] for s in sessions], samp, seeds=seeds,
                              sessions=[("t", s) for s in sessions] if reuse else None)
        for s, (c,) in zip(sessions, res):
            out.append((s, turn_no, c))
            ctx[s] = ctx[s] + c.token_ids + _rand(8 + 11 * ((s + turn_no) % 4), 100 * s + turn_no)  # tool output

    turn([0, 1, 2, 3], 0)
    turn([0, 2], 1)
    turn([1, 3, 0], 1)  # 0 is on its turn 2: rows at different turns in one batch
    engine.update_weights(b, 1)  # new policy: every cached K/V is stale
    turn([2, 0], 2)
    turn([1, 2, 3, 4], 3)  # 4: a new session beside cached ones
    if reuse:
        engine.release_session(("t", 2))
    turn([0, 1, 2, 3, 4], 4)  # 2 was released: a full prefill again
    turn([3, 4], 5)
    return out


def test_reuse_equals_full_prefill_float64(f64):
    engine, a, b = f64
    full = _episode(engine, a, b, reuse=False)
    hits0 = engine.sessions.hits
    reused = _episode(engine, a, b, reuse=True)
    assert engine.sessions.hits - hits0 > 300, "the episode did not reuse the cache"
    lengths = {len(c.token_ids) for _, _, c in full}
    assert len(lengths) > 2 and {c.finish_reason for _, _, c in full} >= {"stop", "tool"}, "rows end alike"
    worst = 0.0
    for (s, t, f), (s2, t2, r) in zip(full, reused, strict=True):
        assert (s, t, f.token_ids, f.finish_reason, f.policy_version) == (s2, t2, r.token_ids, r.finish_reason,
                                                                            r.policy_version)
        worst = max(worst, max(abs(x - y) for x, y in zip(f.logprobs, r.logprobs)))
    assert worst <= TOL, worst


def test_stale_cache_would_differ(f64):
    """Control: K/V of other weights placed as a session's prefix do change the log-probs (what clear() prevents)."""
    engine, a, b = f64
    samp = SamplingConfig(max_new_tokens=3, temperature=1.0, seed=5)
    p = _rand(30, 42)
    engine.update_weights(a, 0)
    engine.generate([p], samp, sessions=["x"])
    stale = engine.sessions._entries["x"]
    engine.update_weights(b, 0)  # same version number, other weights: only clear() protects
    assert len(engine.sessions) == 0
    fresh = engine.generate([p + [50, 51]], samp)[0][0]
    engine.sessions.put("x", stale)  # force the stale entry back
    forced = engine.generate([p + [50, 51]], samp, sessions=["x"])[0][0]
    assert max(abs(x - y) for x, y in zip(fresh.logprobs, forced.logprobs)) > 1e-6


def test_session_store_bounds_and_prefix():
    kv = {1: (torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))}  # 16 bytes an entry
    st = SessionKVStore(40)
    st.put("a", KVEntry([1, 2, 3, 4], kv, 0))
    st.put("b", KVEntry([5, 6, 7, 8], kv, 0))
    assert st.lookup("a", [1, 2, 3, 4, 9], 0)[0] == 4
    assert st.lookup("a", [1, 2, 3, 4], 0)[0] == 3  # one prompt token always left to prefill
    assert st.lookup("a", [1, 2, 7, 4, 5], 0)[0] == 2  # a diverging prompt uses the common prefix
    assert st.lookup("a", [1, 2, 3, 4, 5], 1) == (0, None) and len(st) == 1  # another version: dropped
    st.put("c", KVEntry([1, 2, 3, 4], kv, 0))
    st.put("d", KVEntry([1, 2, 3], kv, 0))  # 48 > 40 bytes: the least recently used ("b") goes
    assert "b" not in st._entries and st.cached_tokens == 7 and st.cached_bytes == 32 and st.evictions == 1
    st.put("big", KVEntry([1], {1: (torch.zeros(3, 1, 2), torch.zeros(3, 1, 2))}, 0))  # over the bound: not kept
    assert "big" not in st._entries
    st.release("c")
    assert st.cached_tokens == 3 and st.cached_bytes == 16
    assert common_prefix([1, 2, 3], [1, 2, 4], 5) == 2
    with pytest.raises(ValueError, match="max_bytes"):
        SessionKVStore(-1)


def test_agent_loop_sessions_equal_full_prefill(f64, tiny_dir):
    """The agent loop over the engine with sessions (released at the end) == without, token for token."""
    from tokenizers import Tokenizer

    from megatron_tsync.model.tokenizer import TokenizerCodec
    from megatron_tsync.rollout.agent_loop import AgentConfig, AgentLoop, FunctionTools
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine

    engine, a, _ = f64
    engine.update_weights(a, 0)
    codec = TokenizerCodec(Tokenizer.from_file(os.path.join(tiny_dir, "tokenizer.json")))
    cfg = AgentConfig(sampling=SamplingConfig(max_new_tokens=6, stop_token_ids=tuple(range(9, 40)),
                                              tool_token_ids=tuple(range(40, 200)), seed=11),
                      max_turns=6, max_total_tokens=400)
    tools = FunctionTools({})  # every call is an error result: a tool output of ~20 tokens
    prompts = [_rand(6 + 3 * i, 60 + i) for i in range(4)]
    off = EmbeddedEngine(engine.model, kv_reuse_bytes=0)
    assert not off.supports_sessions and engine.supports_sessions
    ref = AgentLoop(off, codec, cfg, tools=tools).run(prompts)
    hits0 = engine.sessions.hits
    got = AgentLoop(engine, codec, cfg, tools=tools).run(prompts)
    assert engine.sessions.hits > hits0 and len(engine.sessions) == 0  # reused, then released
    assert sum(t.num_turns for t in ref) > len(ref) + 2
    for r, g in zip(ref, got):
        assert r.token_ids == g.token_ids and r.finish_reason == g.finish_reason
        assert max(abs(x - y) for x, y in zip(r.logprobs, g.logprobs)) <= TOL


def test_bad_sessions(f64):
    engine, a, _ = f64
    engine.update_weights(a, 0)
    samp = SamplingConfig(max_new_tokens=2, seed=1)
    with pytest.raises(ValueError, match="sessions: one per prompt"):
        engine.generate([[10, 11]], samp, sessions=["a", "b"])
    with pytest.raises(ValueError, match="n=1"):
        engine.generate([[10, 11]], samp, n=2, sessions=["a"])
