"""Qwen3-MoE through megatron-core's MoE layer (model/moe.py).

- config: ModelArch from a Qwen3MoeConfig config.json; refused layouts and refused exactness-breaking options;
- pure conversion: HF → (TP, PP, EP) shards → HF bit-identical per tensor, fused transformers-5 experts read;
- logits: Megatron vs transformers fp32 ≤ 1e-5 max abs at 1 process (default tier) and TP=2, EP=2, PP=2 with two
  gloo processes (slow), with the round trip through real models at each layout (measured 4.2e-7 everywhere);
- tools/convert_checkpoint.py: HF → Megatron (TP=2 | EP=2 | PP=2) → HF (PP=2 | EP=2) bit-identical (slow);
- float64 streaming: stream-trajectory and stream-group gradient vs sync ≤ 1e-12 relative on a tiny MoE (router and
  experts included, and they move), single process.
- control: megatron's per-sequence aux loss (what ``--moe-aux-loss-coeff`` would enable) breaks streaming (0.73
  relative), the reason it is refused.

Routing ties: the tiny models' routers get N(0, 0.5²) weights (``make_tiny_model``) or are scaled ×25 (the float64
model, built with megatron's 0.02-std init) so that top-k choices are decisive: a near-tie could flip between
transformers and megatron under float32 reassociation. Streamed and sync runs compute each trajectory's forward
with the same ops on the same microbatch, so their routing is identical either way.
"""

import json
import os

import pytest
import torch

from megatron_tsync.model import hf_conversion as hc
from megatron_tsync.model import moe
from megatron_tsync.model.builder import ModelArch, transformer_config, PrecisionConfig

LOGIT_TOL = 1e-5
TOL = 1e-12
WORKER = os.path.join(os.path.dirname(__file__), "_moe_worker.py")

QWEN3_MOE_JSON = dict(  # the keys of Qwen3-30B-A3B's config.json (sizes shrunk)
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=256, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
    attention_bias=False, decoder_sparse_step=1, moe_intermediate_size=32, num_experts_per_tok=2, num_experts=4,
    norm_topk_prob=True, mlp_only_layers=[], use_sliding_window=False, router_aux_loss_coef=0.001,
)


def _launcher(nproc, args, timeout=600):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "conv_common", os.path.join(os.path.dirname(__file__), "..", "training", "_workers", "conv_common.py"))
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    return common.run_isolated([WORKER, *args], nproc=nproc, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("moe") / "qwen3_moe"), family="qwen3_moe", seed=3)


# ---------------------------------------------------------------------------------------------- config
def test_arch_from_config_json():
    arch = ModelArch.from_hf_config(QWEN3_MOE_JSON)
    assert arch.family == "qwen3_moe" and arch.qk_layernorm and not arch.qkv_bias and arch.head_dim == 32
    assert (arch.num_experts, arch.moe_router_topk, arch.moe_ffn_hidden_size, arch.norm_topk_prob) == (4, 2, 32, True)
    alt = {k: v for k, v in QWEN3_MOE_JSON.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert ModelArch.from_hf_config(alt) == arch  # transformers >= 5 may write num_local_experts


@pytest.mark.parametrize("change,match", [
    (dict(decoder_sparse_step=2), "decoder_sparse_step"),
    (dict(mlp_only_layers=[0]), "mlp_only_layers"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(use_sliding_window=True), "sliding"),
])
def test_unsupported_layouts_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        ModelArch.from_hf_config({**QWEN3_MOE_JSON, **change})


@pytest.mark.parametrize("norm,pre_softmax", [(True, False), (False, True)])
def test_transformer_config_routing(norm, pre_softmax):
    arch = ModelArch.from_hf_config({**QWEN3_MOE_JSON, "norm_topk_prob": norm})
    cfg = transformer_config(arch, PrecisionConfig())
    assert cfg.num_moe_experts == 4 and cfg.moe_router_topk == 2 and cfg.moe_ffn_hidden_size == 32
    assert cfg.moe_router_pre_softmax is pre_softmax and cfg.moe_router_score_function == "softmax"
    assert cfg.moe_aux_loss_coeff == 0.0 and cfg.moe_expert_capacity_factor is None and cfg.moe_z_loss_coeff is None
    assert cfg.moe_router_load_balancing_type == "none" and not cfg.moe_grouped_gemm and cfg.qk_layernorm


@pytest.mark.parametrize("override,match", [
    (dict(moe_aux_loss_coeff=1e-3), "--moe-aux-loss-coeff"),
    (dict(moe_z_loss_coeff=1e-3), "z-loss"),
    (dict(moe_expert_capacity_factor=1.0), "token dropping"),
    (dict(num_moe_experts=8), "contradicts the checkpoint"),
    (dict(moe_router_topk=1), "contradicts the checkpoint"),
])
def test_exactness_breaking_options_are_refused(override, match):
    arch = ModelArch.from_hf_config(QWEN3_MOE_JSON)
    with pytest.raises(ValueError, match=match):
        transformer_config(arch, PrecisionConfig(), **override)
    transformer_config(arch, PrecisionConfig(), moe_aux_loss_coeff=0.0, num_moe_experts=4)  # agreeing: accepted


def test_experts_must_split_over_ep():
    arch = ModelArch.from_hf_config({**QWEN3_MOE_JSON, "num_experts": 6})
    with pytest.raises(ValueError, match="expert-model-parallel-size 4"):
        moe.transformer_config_fields(arch, tp=1, ep=4)


# ---------------------------------------------------------------------------------------------- pure conversion
def _gather(shards: dict, arch, pp_off: int, tp: int, ep: int) -> dict:
    """(tp_rank, ep_rank) -> megatron stage dict; reassemble as megatron_to_hf does, EP ranks' experts merged."""
    out = {}
    for q in range(ep):
        per_tp = [shards[(r, q)] for r in range(tp)]
        full = {}
        for name in per_tp[0]:
            parts = [s[name] for s in per_tp]
            if name.endswith("linear_fc1.weight"):
                full[name] = parts
            elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                full[name] = torch.cat(parts, dim=1)
            elif name.endswith(("norm.weight", "router.weight")):
                assert all(torch.equal(parts[0], p) for p in parts)
                full[name] = parts[0]
            else:
                full[name] = torch.cat(parts, dim=0)
        n_local = arch.num_experts // ep
        out.update(hc.megatron_full_to_hf(full, arch, pp_off, tp, expert_offset=q * n_local))
    return out


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 1, 2), (1, 2, 1), (2, 2, 2), (1, 1, 4)])
def test_pure_round_trip(tiny_moe, tp, pp, ep):
    arch, state = hc.load_hf_dir(tiny_moe)
    assert any(".mlp.experts.3.down_proj.weight" in k for k in state)  # checkpoint names, one tensor per expert
    back = {}
    for p in range(pp):
        shards = {(r, q): hc.hf_to_megatron(state, arch, tp_rank=r, tp_size=tp, pp_rank=p, pp_size=pp,
                                            ep_rank=q, ep_size=ep) for r in range(tp) for q in range(ep)}
        assert sum(".local_experts." in k for k in shards[(0, 0)]) == 2 * arch.num_experts // ep * (2 // pp)
        back.update(_gather(shards, arch, hc.stage_layers(arch, p, pp)[0], tp, ep))
    assert sorted(back) == sorted(state)
    for k in state:
        assert torch.equal(back[k], state[k]), k


def test_expert_layout(tiny_moe):
    """EP rank q holds global experts q·E/ep ...; expert-TP rank r holds [gate_r; up_r] and the r-th fc2 columns."""
    arch, state = hc.load_hf_dir(tiny_moe)
    local = hc.hf_to_megatron(state, arch, tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)
    f = arch.moe_ffn_hidden_size // 2
    e = "model.layers.0.mlp.experts.3."  # EP rank 1 of 2, local expert 1
    fc1 = local["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([state[e + "gate_proj.weight"][f:], state[e + "up_proj.weight"][f:]]))
    fc2 = local["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert torch.equal(fc2, state[e + "down_proj.weight"][:, f:])
    assert torch.equal(local["decoder.layers.0.mlp.router.weight"], state["model.layers.0.mlp.gate.weight"])


def test_fused_transformers_experts_are_read(tiny_moe):
    """transformers >= 5 keeps experts fused in memory (gate_up_proj (E, 2F, H), down_proj (E, H, F))."""
    from transformers import AutoModelForCausalLM

    arch, state = hc.load_hf_dir(tiny_moe)
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    fused = dict(hf.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    assert hc.hf_to_megatron(fused, arch).keys() == hc.hf_to_megatron(state, arch).keys()
    for k, v in hc.hf_to_megatron(fused, arch).items():
        assert torch.equal(v, hc.hf_to_megatron(state, arch)[k]), k
    unfused = moe.unfuse_hf_experts(fused, arch)
    assert sorted(unfused) == sorted(state) and all(torch.equal(unfused[k], state[k]) for k in state)


def test_tiny_moe_loads_in_transformers(tiny_moe):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_moe)
    assert cfg.model_type == "qwen3_moe" and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    assert cfg.norm_topk_prob and cfg.decoder_sparse_step == 1 and not cfg.mlp_only_layers
    assert ModelArch.from_hf_dir(tiny_moe).num_experts == 4


# ---------------------------------------------------------------------------------------------- real models
def _check(path, layouts):
    with open(path) as f:
        rep = json.load(f)
    assert {(r["tp"], r["pp"], r["ep"]) for r in rep} == layouts
    for r in rep:
        assert r["same_keys"] and not r["mismatched"], r
        print(f"qwen3_moe tp={r['tp']} pp={r['pp']} ep={r['ep']}: max |logit diff| = {r['max_abs_logit_diff']:.3g}")
        assert r["max_abs_logit_diff"] <= LOGIT_TOL, r
    return rep


def test_megatron_matches_transformers_1proc(tiny_moe, tmp_path):
    out = str(tmp_path / "rep.json")
    rc, log, _ = _launcher(1, ["--hf", tiny_moe, "--out", out])
    assert rc == 0, log[-4000:]
    _check(out, {(1, 1, 1)})


@pytest.mark.slow
def test_megatron_matches_transformers_tp2_ep2_pp2(two_procs):
    """Two gloo processes: TP=2, EP=2 (DP=2 for the dense part, 2 experts per rank), PP=2; round trip at each.
    Run in the two-process launch of ``two_procs`` (after the conversions)."""
    rep = _check(two_procs[1], {(2, 1, 1), (1, 1, 2), (1, 2, 1)})
    assert {r["ep"]: r["local_experts"] for r in rep}[2] == 2


# ---------------------------------------------------------------------------------------------- float64 streaming
TINY_MOE = ModelArch.from_hf_config(QWEN3_MOE_JSON)


@pytest.fixture(scope="module")
def moe64(megatron_single):
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    m = build_model(TINY_MOE, PrecisionConfig(params_dtype=torch.float64), seed=0)
    with torch.no_grad():
        for layer in m.decoder.layers:
            layer.mlp.router.weight.mul_(25.0)  # decisive routing (no near-ties), see the module docstring
    ddp = wrap_ddp(m)
    return ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))


def _gradient(model64, mode, samples, order, **kw):
    from megatron_tsync.streaming.ready_queue import ListSource
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for

    ddp, opt = model64
    learner = Learner(ddp, opt, LearnerConfig(mode=mode, **kw))
    got = {}

    def hook(d):
        got["g"] = torch.cat([b.grad_data.clone() for b in d.buffers])
        got["router"] = sum(p.main_grad.norm() for n, p in ddp.named_parameters() if n.endswith("router.weight"))
        got["experts"] = sum(p.main_grad.norm() for n, p in ddp.named_parameters() if ".local_experts." in n)

    learner.grad_hook = hook
    sizes, shape = shape_for(samples)
    res = learner.train_step(ListSource(order), sizes, shape)
    res.moe_grad_norms = (got["router"], got["experts"])
    return got["g"], res


@pytest.mark.parametrize("estimator,reward,old", [("grpo", "bounded", "trainer"), ("rloo", "binary", "trainer"),
                                                   ("dr_grpo", "continuous", "trainer"), ("grpo", "binary", "engine")])
def test_float64_stream_equals_sync(moe64, estimator, reward, old):
    """PPO clip; π_old from the trainer (ratio 1: every trajectory but a group's last is bucketed, its backward
    later scaled by the advantage coefficients) or the engine (ratio ≠ 1: the clip rule streams or defers).

    The bucketed cases need megatron's router softmax in float64 (compat._install_float64_routing): with its
    hard-coded float32 softmax they differed by 4.6e-9 relative."""
    from megatron_tsync.algorithms.policy_loss import PolicyLossConfig
    from megatron_tsync.training.stream_fb import LossConfig

    from ..training.stream_cases import arrival_order, make_samples, spec_for

    samples = make_samples(31, reward_kind=reward, vocab=TINY_MOE.vocab_size)
    kw = dict(estimator=estimator, reward_spec=spec_for(reward),
              loss=LossConfig(policy=PolicyLossConfig(), old_logprobs=old))
    g_sync, res = _gradient(moe64, "sync", samples, samples, **kw)
    router, experts = res.moe_grad_norms
    assert router > 0 and experts > 0  # the MoE parameters are trained, not skipped
    for seed in (1, 2):
        g, res = _gradient(moe64, "stream-trajectory", samples, arrival_order(samples, seed), **kw)
        rel = ((g - g_sync).norm() / g_sync.norm()).item()
        print(f"qwen3_moe float64 {estimator} stream-trajectory (order {seed}): rel diff {rel:.2g}")
        assert rel < TOL, (seed, rel)
        assert res.planner_stats["bucketed"] > 0 or old == "engine"
    g, _ = _gradient(moe64, "stream-group", samples, arrival_order(samples, 3), **kw)
    rel = ((g - g_sync).norm() / g_sync.norm()).item()
    print(f"qwen3_moe float64 {estimator} stream-group: rel diff {rel:.2g}")
    assert rel < TOL


CONVERSIONS = {  # id: (layout the checkpoint is written at, layout it is exported at)
    "tp2-to-pp2": (["--target-tensor-parallel-size", "2"], ["--target-pipeline-model-parallel-size", "2"]),
    "ep2-to-pp2": (["--target-expert-model-parallel-size", "2"], ["--target-pipeline-model-parallel-size", "2"]),
    "pp2-to-ep2": (["--target-pipeline-model-parallel-size", "2"], ["--target-expert-model-parallel-size", "2"]),
}


@pytest.fixture(scope="module")
def two_procs(tiny_moe, tmp_path_factory, request):
    """One torchrun of two gloo processes (tests/model/_convert_driver.py) for every two-process test here: each
    selected conversion of test_convert_checkpoint_tool_round_trip (the tool's main() under a launcher; all these
    layouts have two ranks), first each HF → Megatron save, then each export; then (when
    test_megatron_matches_transformers_tp2_ep2_pp2 is selected) _moe_worker.py at its two-process layouts.
    Returns ({id: exported HF folder}, the worker's report or None)."""
    import importlib.util

    from ..training._launch import item_param, selected_params

    ids = selected_params(request, lambda item: item_param(item, "conversion")
                          if item.name.startswith("test_convert_checkpoint_tool_round_trip") else None)
    spec = importlib.util.spec_from_file_location(
        "conv_common", os.path.join(os.path.dirname(__file__), "..", "training", "_workers", "conv_common.py"))
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    d = tmp_path_factory.mktemp("moe_convert")
    saves = [["--direction", "hf-to-megatron", "--load", tiny_moe, "--save", str(d / f"ck-{i}"), *CONVERSIONS[i][0]]
             for i in ids]
    exports = [["--direction", "megatron-to-hf", "--load", str(d / f"ck-{i}"), "--save", str(d / f"back-{i}"),
                *CONVERSIONS[i][1]] for i in ids]
    with open(d / "jobs.json", "w") as f:
        json.dump(saves + exports, f)
    driver = os.path.join(os.path.dirname(__file__), "_convert_driver.py")
    rep = str(d / "rep.json")
    logits = bool(selected_params(request, lambda item: item.name == "test_megatron_matches_transformers_tp2_ep2_pp2"
                                  or None))
    then = ["--then", WORKER, "--hf", tiny_moe, "--out", rep] if logits else []
    rc, log, _ = common.run_isolated([driver, "--jobs", str(d / "jobs.json"), *then], nproc=2, timeout=600)
    assert rc == 0, log[-4000:]
    return {i: str(d / f"back-{i}") for i in ids}, (rep if logits else None)


@pytest.mark.slow
@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_convert_checkpoint_tool_round_trip(tiny_moe, two_procs, conversion):
    """tools/convert_checkpoint.py: HF → Megatron checkpoint written at one layout → HF read back at another
    (TP=2, PP=2, EP=2: each EP rank writes / reads its half of the experts), bit-identical per tensor. The
    conversions of all cases run in one launch (``two_procs``)."""
    a, b = hc.load_hf_state(tiny_moe), hc.load_hf_state(two_procs[0][conversion])
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_control_per_sequence_aux_loss_breaks_streaming(megatron_single, monkeypatch):
    """Why --moe-aux-loss-coeff is refused: even megatron's per-sequence load-balancing loss (seq_aux_loss, one
    trajectory per microbatch) makes streamed gradients differ from sync ones, because its gradient is injected into
    the trajectory's own backward, which the buckets scale by the advantage coefficients. The same model and
    samples with coefficient 0 are exact (test_float64_stream_equals_sync)."""
    from megatron_tsync.algorithms.policy_loss import PolicyLossConfig
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from megatron_tsync.training.stream_fb import LossConfig

    from ..training.stream_cases import arrival_order, make_samples, spec_for

    monkeypatch.setattr(moe, "_REFUSED", {})  # the control bypasses the refusal
    m = build_model(TINY_MOE, PrecisionConfig(params_dtype=torch.float64), seed=0,
                    moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1)
    with torch.no_grad():
        for layer in m.decoder.layers:
            layer.mlp.router.weight.mul_(25.0)
    ddp = wrap_ddp(m)
    model = (ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0)))
    samples = make_samples(31, reward_kind="bounded", vocab=TINY_MOE.vocab_size)
    kw = dict(estimator="grpo", reward_spec=spec_for("bounded"), loss=LossConfig(policy=PolicyLossConfig()))
    g_sync, _ = _gradient(model, "sync", samples, samples, **kw)
    g, res = _gradient(model, "stream-trajectory", samples, arrival_order(samples, 1), **kw)
    rel = ((g - g_sync).norm() / g_sync.norm()).item()
    print(f"qwen3_moe float64 with seq_aux_loss 0.1: stream-trajectory vs sync rel diff {rel:.2g}")
    assert res.planner_stats["bucketed"] > 0 and rel > 1e-6
