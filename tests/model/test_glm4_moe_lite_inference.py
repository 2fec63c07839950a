"""GLM-4.7-Flash-style model (``glm4_moe_lite``, model/mla.py) where tokens are generated or scored turn by turn.

- the embedded engine (rollout/embedded_engine.py, float64) generates with megatron-core's ``MLASelfAttention`` and
  its static inference context (the up-projected K/V of every head cached; RoPE at the cache slots): greedy tokens =
  the trainer's argmax and log-probs = the trainer's ≤ 1e-12 with and without the KV cache, rows dropped from the
  cache as they finish, each position's experts recorded as the trainer's full forward picks them; sampled tokens
  depend only on the seeds (not on the batch) with log-probs = the trainer's at the temperature; a weight update
  in place gives the updated trainer's log-probs (and moves them: control);
- the KV-kept incremental forward (model/incremental.py: MLA's q/k/v from megatron's own projections, RoPE at the
  chunk's positions) = the full forward; OPD stream-turn / stream-trajectory = sync ≤ 1e-12 (the student a random
  tiny GLM, tests/training/_workers/opd_worker.py's cases), the turn-cut control is off.
"""

import os
import sys

import pytest
import torch

from megatron_tsync.model import hf_conversion as hc
from megatron_tsync.model.builder import PrecisionConfig, build_model

TOL = 1e-12
F64 = PrecisionConfig(params_dtype=torch.float64)


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("glmi") / "glm4_moe_lite"), family="glm4-moe-lite", seed=3)


def _state64(state):
    return {k: v if k.endswith("e_score_correction_bias") else v.double() for k, v in state.items()}


@pytest.fixture(scope="module")
def trainer64(tiny_glm, megatron_single):
    """The trainer's float64 model with the tiny GLM's weights (routing recordable)."""
    arch, state = hc.load_hf_dir(tiny_glm)
    model = build_model(arch, F64, seed=0, moe_enable_routing_replay=True)
    hc.load_hf_into_model(model, _state64(state))
    return model.eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(9, 500, (n,), generator=g).tolist() for n in (3, 17, 30)]


def _trainer_logits(model, seq):
    from megatron_tsync.model.logprobs import model_logits

    with torch.no_grad():
        return model_logits(model, torch.tensor([seq]))[0]  # (T, V)


@pytest.mark.parametrize("cache", [True, False], ids=["kv-cache", "no-cache"])
def test_engine_greedy_equals_trainer_and_records_experts(tiny_glm, trainer64, prompts, cache):
    """Prompts of 3/17/30 tokens in one left-padded batch, the first row stopping early (its 4th greedy token is a
    stop token): tokens = the trainer's argmax, log-probs = the trainer's ≤ 1e-12, the recorded (P, MoE layers, k)
    experts = the trainer's full forward's at each position."""
    from megatron_tsync.model import moe
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from megatron_tsync.rollout.engine import SamplingConfig

    engine = EmbeddedEngine.from_hf_dir(tiny_glm, F64, use_kv_cache=cache, record_routing=True)
    first = engine.generate(prompts[:1], SamplingConfig(top_k=1, max_new_tokens=4, seed=0))[0][0].token_ids
    out = engine.generate(prompts, SamplingConfig(top_k=1, max_new_tokens=12, seed=0, stop_token_ids=(first[3],)))
    worst, lengths = 0.0, []
    for p, (c,) in zip(prompts, out):
        seq = p + c.token_ids
        with moe.record_routing(trainer64) as rec:
            logits = _trainer_logits(trainer64, seq)[len(p) - 1 : -1]  # (n, V)
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert logits.argmax(-1).tolist() == c.token_ids
        worst = max(worst, (lp - torch.tensor(c.logprobs, dtype=lp.dtype)).abs().max().item())
        lengths.append(len(c.token_ids))
        mine = torch.stack(rec.indices, dim=1)[:-1].sort(-1).values  # (P, 2 MoE layers, k)
        assert c.routing.shape == tuple(mine.shape) == (len(seq) - 1, 2, 4)
        assert torch.equal(torch.from_numpy(c.routing).long().sort(-1).values, mine)
    print(f"glm4_moe_lite embedded engine (cache={cache}) vs trainer log-prob max |diff| = {worst:.3g}, {lengths}")
    assert worst <= TOL and lengths == [4, 12, 12]


def test_engine_seeds_and_weight_update(tiny_glm, trainer64, prompts):
    """Sampling (T = 0.8, top-p 0.9) with per-prompt seeds: a prompt's samples are the same alone and in a batch,
    log-probs = the trainer's log softmax(logits / T) ≤ 1e-12. Then a weight update in place (megatron names, every
    weight moved, the correction bias kept): log-probs = a trainer with the new weights ≤ 1e-12, ≠ the old ones."""
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from megatron_tsync.rollout.engine import SamplingConfig

    engine = EmbeddedEngine.from_hf_dir(tiny_glm, F64)
    samp = SamplingConfig(temperature=0.8, top_p=0.9, max_new_tokens=10)
    batch = engine.generate(prompts, samp, n=2, seeds=[5, 6, 7])
    alone = engine.generate(prompts[1:2], samp, n=2, seeds=[6])
    assert [c.token_ids for c in batch[1]] == [c.token_ids for c in alone[0]]
    assert batch[1][0].token_ids != batch[1][1].token_ids  # two samples of one prompt differ

    def worst(model, out, T):
        w = 0.0
        for p, comps in zip(prompts, out):
            for c in comps:
                logits = _trainer_logits(model, p + c.token_ids)[len(p) - 1 : -1] / T
                lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
                w = max(w, (lp - torch.tensor(c.logprobs, dtype=lp.dtype)).abs().max().item())
        return w

    assert worst(trainer64, batch, 0.8) <= TOL
    g = torch.Generator().manual_seed(9)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) if "expert_bias" not in k else v
           for k, v in engine.model.state_dict().items() if torch.is_tensor(v) and "_extra_state" not in k}
    updated = build_model(trainer64.arch, F64, seed=1)
    updated.load_state_dict(new, strict=False)
    updated.eval()
    engine.update_weights(new, 1)
    out = engine.generate(prompts, SamplingConfig(max_new_tokens=8, seed=1))
    w_new, w_old = worst(updated, out, 1.0), worst(trainer64, out, 1.0)
    print(f"glm4_moe_lite engine after a weight update: {w_new:.3g} vs the new trainer, {w_old:.3g} vs the old")
    assert out[0][0].policy_version == 1 and w_new <= TOL and w_old > 1e-3


# ---------------------------------------------------------------------------------------------- OPD
def test_incremental_forward_equals_full_forward(trainer64):
    """Chunks of 5, 1, 11, 6 tokens through the KV-kept forward (MLA's K/V: (T, 1, heads, nope + rope) and
    (T, 1, heads, v_head)) = one full forward ≤ 1e-12 relative, under torch.no_grad (the teacher scorer's use)."""
    from megatron_tsync.model.incremental import IncrementalGPT

    ids = torch.randint(0, 500, (23,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = trainer64(ids.unsqueeze(0), torch.arange(23).unsqueeze(0), None)  # (1, T, V)
        inc = IncrementalGPT(trainer64)
        parts = [inc.head(inc.extend(ids[a:b], a)) for a, b in ((0, 5), (5, 6), (6, 17), (17, 23))]
    rel = ((torch.cat(parts, dim=1) - full).abs().max() / full.abs().max()).item()
    a = trainer64.arch
    assert inc.kv[0][0].shape == (23, 1, a.num_attention_heads, a.qk_nope_head_dim + a.qk_rope_head_dim)
    assert inc.kv[0][1].shape == (23, 1, a.num_attention_heads, a.v_head_dim)
    assert rel <= TOL, rel


def test_opd_stream_turn_exact(tiny_glm, megatron_single, monkeypatch):
    """opd_worker's cases (token-mean; seq-mean with engine π_old and TIS) with a tiny GLM student: stream-trajectory
    and stream-turn (the KV-kept turn forward) = sync ≤ 1e-12; the turn-cut control (K/V detached) is off > 1e-3."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "training", "_workers"))
    import opd_worker as W

    arch, _ = hc.load_hf_dir(tiny_glm)
    monkeypatch.setattr(W, "TINY", arch)
    monkeypatch.setattr(W, "CASES", {k: W.CASES[k] for k in ("token-mean", "seq-mean-engine-tis")})
    report = W.run_cases(megatron_single, modes=("stream-trajectory", "stream-turn", "cut"))
    for case, row in report.items():
        print(f"glm4_moe_lite OPD {case}: " + ", ".join(f"{m} {r['rel']:.2g}" for m, r in row.items()))
        assert row["stream-trajectory"]["rel"] <= TOL and row["stream-turn"]["rel"] <= TOL, (case, row)
        assert row["cut"]["rel"] > 1e-3, (case, row)


def test_runtime_router_replay_takes_glm(tiny_glm):
    """--moe-router-replay with a GLM folder: pre-flight sees its routed experts (``n_routed_experts``), and the
    fleet expects routing of its MoE layers only (3 layers, the first dense: 2), top-4 of 16 — what the engine
    records (test_engine_greedy_equals_trainer_and_records_experts)."""
    import json
    from types import SimpleNamespace

    from megatron_tsync.runtime import fleet, preflight

    with open(os.path.join(tiny_glm, "config.json")) as f:
        hf = json.load(f)
    cfg = SimpleNamespace(model=SimpleNamespace(moe_router_replay=True, path=tiny_glm),
                          rollout=SimpleNamespace(engine="embedded"))
    preflight._check_router_replay(cfg, hf)
    assert fleet.routing_expect(tiny_glm) == (2, 4, 16)
    with pytest.raises(preflight.PreflightError, match="needs a MoE model"):
        preflight._check_router_replay(cfg, {k: v for k, v in hf.items() if k != "n_routed_experts"})


def test_cpu_recipe_is_tiny_qwen3_moe_without_packing_with_replay():
    """examples/tiny_glm: the tiny_qwen3_moe recipe on a GLM folder made by the tool (no --init-tiny-model for this
    family): the same task, RL, rollout and evaluation settings but sequence packing off (refused for MLA), router
    replay on and a longer warm start; its own folders."""
    from megatron_tsync.arguments import parse_args

    root = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
    glm = parse_args(["--config", os.path.join(root, "tiny_glm", "config.yaml")], world_size=1)
    moe = parse_args(["--config", os.path.join(root, "tiny_qwen3_moe", "config.yaml")], world_size=1)
    assert glm.model.path == "runs/tiny_glm/model" and glm.checkpoint.save == "runs/tiny_glm/ckpt"
    assert not glm.model.init_tiny_model and glm.model.moe_router_replay and not glm.learner.sequence_packing
    assert glm.model.sft_warmup_steps == 400  # tiny_qwen3_moe's 175 leave this model without signal (README.md)

    def same(c):
        d = {k: v for k, v in c.to_dict().items() if k not in ("model", "checkpoint")}
        d["learner"] = {k: v for k, v in d["learner"].items() if k not in ("sequence_packing", "max_packed_tokens")}
        return d

    assert same(glm) == same(moe)
