"""GLM-4.7-Flash-style models (``glm4_moe_lite``: multi-latent attention + DeepSeek-V3-style MoE, model/mla.py).

- the tiny model (tools/make_tiny_model.py --family glm4-moe-lite) is transformers' own Glm4MoeLiteConfig with the
  first layer dense, grouped sigmoid routing and a non-zero correction bias that changes the selected experts;
- config: ModelArch from the config.json, refused layouts and refused options (the bias update among them);
- pure conversion HF → (TP, EP) shards → HF bit-identical, the interleaved-RoPE permutation included;
- logits: Megatron float64 vs transformers float64 ≤ 1e-12 relative in one process. transformers computes four
  things in float32 whatever the model's dtype (RMSNorm, the RoPE table, the router, the eager softmax): the
  reference lifts exactly those casts (:func:`float64_transformers`), nothing else of its code changes;
- the correction bias is a buffer: no gradient, unchanged by a training step's finalize;
- tools/convert_checkpoint.py --verify passes (float32, one process; both directions in one process through
  tests/model/_convert_driver.py);
- one two-process launch (tests/model/_glm_worker.py) for every layout test (slow): TP = 2, EP = 2 and PP = 2
  (4-layer models, the dense/MoE boundary inside stage 0 and at the stage boundary) logits and round trips; GRPO /
  RLOO streaming, a KL loss, router replay, --deterministic and OPD at those layouts, each against one process.
"""

import json
import os

import pytest
import torch

from megatron_tsync.model import hf_conversion as hc
from megatron_tsync.model import mla
from megatron_tsync.model.builder import ModelArch, PrecisionConfig, build_model, transformer_config

from ._glm_reference import float64_transformers, hf64 as _hf64

TOL = 1e-12


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    # hidden 64 (the tool's default is 128): the two-process launches' cost grows with the width (the "tp-ep"
    # launch took 111 s at 128; measured by hand, see the commit)
    return make_tiny_model(str(tmp_path_factory.mktemp("glm") / "glm4_moe_lite"), family="glm4-moe-lite", hidden=64,
                           seed=3)


def _config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _ids(vocab, b=2, s=24):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))  # (B, S)


def _state64(state):
    return {k: v if k.endswith("e_score_correction_bias") else v.double() for k, v in state.items()}


def _megatron64(path):
    """The HF folder's model as a float64 megatron GPTModel (the correction bias kept in its own dtype)."""
    arch, state = hc.load_hf_dir(path)
    model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0)
    hc.load_hf_into_model(model, _state64(state))
    return model


@pytest.fixture(scope="module")
def megatron64(tiny_glm, megatron_single):
    return _megatron64(tiny_glm)


def _megatron_logits(model, ids):
    from megatron_tsync.model.logprobs import gather_vocab_parallel_logits, model_logits

    model.eval()
    with torch.no_grad():
        return gather_vocab_parallel_logits(model_logits(model, ids))  # (B, S, V)


def test_float64_logits_equal_transformers(tiny_glm, megatron64):
    ids = _ids(megatron64.arch.vocab_size)
    with float64_transformers(), torch.no_grad():
        ref = _hf64(tiny_glm)(ids).logits  # (B, S, V)
    mine = _megatron_logits(megatron64, ids)
    rel = ((mine - ref).abs().max() / ref.abs().max()).item()
    print(f"float64 logits: max |Δ| / max |logit| = {rel:.3g}")
    assert ref.dtype == mine.dtype == torch.float64 and rel <= TOL


# ---------------------------------------------------------------------------------------------- config
GLM_JSON = dict(  # the keys of GLM-4.7-Flash's config.json (sizes shrunk)
    architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", vocab_size=256, hidden_size=64,
    intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=1.8, kv_lora_rank=32,
    q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=32, n_group=1, topk_group=1,
    num_experts_per_tok=4, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=202752,
    rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=1000000.0, rope_scaling=None, rope_interleave=True,
    first_k_dense_replace=1, attention_bias=False, attention_dropout=0.0,
)


def test_arch_from_config_json():
    arch = ModelArch.from_hf_config(GLM_JSON)
    assert arch.family == "glm4_moe_lite" and arch.kv_lora_rank == 32 and arch.q_lora_rank == 48
    assert (arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim, arch.head_dim) == (32, 16, 24, 48)
    assert (arch.num_experts, arch.moe_router_topk, arch.moe_first_k_dense) == (8, 4, 1)
    assert arch.moe_shared_expert_ffn_hidden_size == 32 and arch.moe_routed_scaling_factor == 1.8
    types = {k: v for k, v in GLM_JSON.items() if k != "first_k_dense_replace"}
    assert ModelArch.from_hf_config({**types, "mlp_layer_types": ["dense", "sparse", "sparse"]}) == arch
    assert ModelArch.from_hf_config(hc.hf_config_dict(arch)) == arch  # config.json written back reads the same


@pytest.mark.parametrize("change,match", [
    (dict(n_group=2, topk_group=1), "top-2"),  # topk 4 != 2·topk_group: transformers' group score differs
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "YaRN"),
    (dict(first_k_dense_replace=None, mlp_layer_types=["sparse", "dense", "sparse"]), "mlp_layer_types"),
    (dict(num_key_value_heads=2), "GQA"),
])
def test_unsupported_layouts_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        ModelArch.from_hf_config({**GLM_JSON, **change})


def test_transformer_config_routing():
    arch = ModelArch.from_hf_config({**GLM_JSON, "n_group": 4, "topk_group": 2, "n_routed_experts": 16})
    cfg = transformer_config(arch, PrecisionConfig())
    assert type(cfg).__name__ == "MLATransformerConfig" and cfg.multi_latent_attention
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (
        48, 32, 32, 16, 24)
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias
    assert cfg.moe_router_bias_update_rate == 0.0 and cfg.moe_router_topk_scaling_factor == 1.8
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (4, 2) and cfg.moe_layer_freq == [0, 1, 1]
    assert cfg.moe_shared_expert_intermediate_size == 32 and cfg.rope_type == "rope"


@pytest.mark.parametrize("override,match", [
    (dict(moe_router_bias_update_rate=1e-3), "aux-loss-free expert-bias update"),
    (dict(moe_router_enable_expert_bias=False), "e_score_correction_bias"),
    (dict(moe_aux_loss_coeff=1e-3), "load-balancing loss"),
    (dict(moe_router_topk=2), "contradicts the checkpoint"),
])
def test_refused_options(override, match):
    arch = ModelArch.from_hf_config(GLM_JSON)
    with pytest.raises(ValueError, match=match):
        transformer_config(arch, PrecisionConfig(), **override)
    transformer_config(arch, PrecisionConfig(), moe_router_bias_update_rate=0.0)  # agreeing: accepted


def test_make_tiny_model_cli(tmp_path):
    """``tools/make_tiny_model.py --family glm4-moe-lite`` writes a folder ModelArch reads as glm4_moe_lite."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_tiny_model_tool", os.path.join(os.path.dirname(__file__), "..", "..", "tools", "make_tiny_model.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = str(tmp_path / "cli")
    tool.main(["--out", out, "--family", "glm4-moe-lite", "--hidden", "64", "--experts", "8"])
    arch = ModelArch.from_hf_dir(out)
    assert arch.family == "glm4_moe_lite" and arch.num_experts == 8 and arch.moe_first_k_dense == 1


def test_tiny_model_is_transformers_config(tiny_glm):
    """The tiny model is transformers' own Glm4MoeLiteConfig: grouped routing (4 groups, 2 kept, top-4), the
    first layer dense, a non-zero correction bias that changes which experts are selected."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_glm)
    assert type(cfg).__name__ == "Glm4MoeLiteConfig" and cfg.mlp_layer_types == ["dense", "sparse", "sparse"]
    assert (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, cfg.n_routed_experts) == (4, 2, 4, 16)
    assert cfg.rope_interleave and cfg.rms_norm_eps != mla.LATENT_NORM_EPS and cfg.n_shared_experts == 1
    hf = _hf64(tiny_glm)
    router = hf.model.layers[1].mlp.gate
    h = torch.randn(64, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with float64_transformers(), torch.no_grad():
        _, _, with_bias = router(h)
        bias = router.e_score_correction_bias.clone()
        router.e_score_correction_bias.zero_()
        _, _, without = router(h)
        router.e_score_correction_bias.copy_(bias)
    assert bias.abs().min() > 0
    changed = (with_bias.sort(-1).values != without.sort(-1).values).any(-1).float().mean().item()
    print(f"correction bias changes the selection of {changed:.0%} of the tokens")
    assert changed > 0.2, changed  # the bias matters for selection


# ---------------------------------------------------------------------------------------------- conversion
@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 1, 4), (2, 3, 2)])
def test_pure_round_trip(tiny_glm, tp, pp, ep):
    """HF → every (TP, PP, EP) rank's megatron tensors → gathered back → HF, bit-identical per tensor."""
    arch, state = hc.load_hf_dir(tiny_glm)
    back = {}
    for p in range(pp):
        shards = {(r, q): hc.hf_to_megatron(state, arch, tp_rank=r, tp_size=tp, pp_rank=p, pp_size=pp,
                                            ep_rank=q, ep_size=ep) for r in range(tp) for q in range(ep)}
        off = p * arch.num_layers // pp
        for q in range(ep):
            full = {}
            for name in shards[(0, q)]:
                parts = [shards[(r, q)][name] for r in range(tp)]
                if name.endswith("linear_fc1.weight"):
                    full[name] = parts
                elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                    full[name] = torch.cat(parts, dim=1)
                elif name.endswith(("norm.weight", "router.weight", "expert_bias", "_down_proj.weight")):
                    assert all(torch.equal(parts[0], x) for x in parts)  # replicated over TP (mla.py)
                    full[name] = parts[0]
                else:
                    full[name] = torch.cat(parts, dim=0)
            back.update(hc.megatron_full_to_hf(full, arch, off, tp, expert_offset=q * arch.num_experts // ep))
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_model_round_trip_and_bias_is_a_buffer(tiny_glm, megatron64):
    """Through the float64 model: every tensor back bit-identical; the correction bias is a float32 buffer of the
    router (no parameter, so no gradient and no optimizer state)."""
    _, state = hc.load_hf_dir(tiny_glm)
    back = hc.megatron_to_hf(megatron64)
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], _state64(state)[k]) for k in state)
    router = megatron64.decoder.layers[1].mlp.router
    assert router.expert_bias.dtype == torch.float32 and not router.expert_bias.requires_grad
    assert not any(n.endswith("expert_bias") for n, _ in megatron64.named_parameters())


def test_rope_not_interleaved(tiny_glm, tmp_path, megatron_single):
    """``rope_interleave: false`` (transformers' plain rotate-half): the conversion interleaves the rope rows so
    that megatron's MLA de-interleave restores them; logits still equal, round trip still bit-identical."""
    import shutil

    d = str(tmp_path / "plain")
    shutil.copytree(tiny_glm, d)
    cfg = _config(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**cfg, "rope_interleave": False}, f)
    arch, state = hc.load_hf_dir(d)
    assert not arch.rope_interleave
    model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0)
    hc.load_hf_into_model(model, _state64(state))
    ids = _ids(arch.vocab_size)
    with float64_transformers(), torch.no_grad():
        ref = _hf64(d)(ids).logits
    rel = ((_megatron_logits(model, ids) - ref).abs().max() / ref.abs().max()).item()
    assert rel <= TOL, rel
    back = hc.megatron_to_hf(model)
    assert all(torch.equal(back[k], _state64(state)[k]) for k in state)


def test_control_without_correction_bias_logits_differ(tiny_glm, megatron64):
    """Control: the same model with its correction bias zeroed routes otherwise, so the logits test above would
    catch a bias that is not converted (or not used for selection)."""
    ids = _ids(megatron64.arch.vocab_size)
    with float64_transformers(), torch.no_grad():
        ref = _hf64(tiny_glm)(ids).logits
    biases = [layer.mlp.router.expert_bias for layer in megatron64.decoder.layers[1:]]
    saved = [b.clone() for b in biases]
    try:
        for b in biases:
            b.zero_()
        rel = ((_megatron_logits(megatron64, ids) - ref).abs().max() / ref.abs().max()).item()
    finally:
        for b, s in zip(biases, saved):
            b.copy_(s)
    assert rel > 1e-3, rel


def test_training_step_leaves_bias_unchanged(tiny_glm, megatron_single):
    """forward + backward + megatron's finalize_model_grads (where the aux-loss-free update would run): the
    correction bias is bitwise the checkpoint's. Control: with a non-zero update rate and megatron's token
    counting restored it moves."""
    from megatron_tsync.model import compat
    from megatron_tsync.training.optimizer import wrap_ddp

    arch, state = hc.load_hf_dir(tiny_glm)
    ddp = wrap_ddp(build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0))
    hc.load_hf_into_model(ddp, _state64(state))
    ids = _ids(arch.vocab_size)
    bias = lambda: [l.mlp.router.expert_bias.clone() for l in ddp.module.decoder.layers[1:]]  # noqa: E731
    before = bias()
    for rate in (0.0, 1e-3):
        ddp.module.config.moe_router_bias_update_rate = rate  # the control bypasses the build-time refusal
        if rate:
            for layer in ddp.module.decoder.layers[1:]:
                del layer.mlp.router._apply_expert_bias  # megatron's own counting (mla.finish_model removed it)
        ddp.zero_grad_buffer()
        ddp.train()
        ddp(ids, torch.arange(ids.shape[1])[None].expand_as(ids), None).float().sum().backward()
        compat.finalize_model_grads([ddp], torch.tensor(ids.numel()))
        after = bias()
        if rate == 0.0:
            assert all(torch.equal(a, b) for a, b in zip(after, before))
        else:
            assert any(not torch.equal(a, b) for a, b in zip(after, before))
    ddp.module.config.moe_router_bias_update_rate = 0.0


@pytest.mark.slow
def test_convert_checkpoint_tool_verify(tiny_glm, tmp_path):
    """tools/convert_checkpoint.py HF → Megatron → HF with --verify both ways (float32, one process): passes, and
    the exported folder is bit-identical to the source."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "conv_common", os.path.join(os.path.dirname(__file__), "..", "training", "_workers", "conv_common.py"))
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    driver = os.path.join(os.path.dirname(__file__), "_convert_driver.py")
    ck, back = str(tmp_path / "ck"), str(tmp_path / "back")
    with open(tmp_path / "jobs.json", "w") as f:  # both directions in one process (the tool's one-process path)
        json.dump([["--direction", "hf-to-megatron", "--load", tiny_glm, "--save", ck, "--verify"],
                   ["--direction", "megatron-to-hf", "--load", ck, "--save", back, "--verify"]], f)
    rc, out, _ = common.run_isolated([driver, "--jobs", str(tmp_path / "jobs.json")], timeout=600, bare=True)
    assert rc == 0 and out.count("[tsync] verify:") == 2, out[-3000:]
    a, b = hc.load_hf_state(tiny_glm), hc.load_hf_state(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert _config(back)["model_type"] == "glm4_moe_lite"


# ---------------------------------------------------------------------------------------------- float64 streaming
@pytest.fixture(scope="module")
def glm_ddp(tiny_glm, megatron_single):
    """The tiny model in float64 (its checkpoint's routers and correction biases), DDP-wrapped, SGD lr 0."""
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    arch, state = hc.load_hf_dir(tiny_glm)
    ddp = wrap_ddp(build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0))
    hc.load_hf_into_model(ddp, _state64(state))
    return ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))


def _grad_norms(ddp) -> dict[str, float]:
    parts = {"router": "router.weight", "experts": ".local_experts.", "shared": ".shared_experts.",
             "mla": "self_attention.linear_kv_up_proj"}
    return {k: sum(p.main_grad.norm().item() for n, p in ddp.named_parameters() if s in n) for k, s in parts.items()}


def _step(glm_ddp, mode, samples, order, **kw):
    from megatron_tsync.streaming.ready_queue import ListSource
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for

    ddp, opt = glm_ddp
    learner = Learner(ddp, opt, LearnerConfig(mode=mode, **kw))
    got = {}

    def hook(d):
        got["g"] = torch.cat([b.grad_data.clone() for b in d.buffers])
        got["norms"] = _grad_norms(ddp)

    learner.grad_hook = hook
    sizes, shape = shape_for(samples)
    res = learner.train_step(ListSource(order), sizes, shape)
    return got["g"], got["norms"], res


@pytest.mark.parametrize("estimator,reward,old,terms", [
    ("grpo", "bounded", "trainer", {}),
    ("rloo", "binary", "trainer", {}),
    ("grpo", "binary", "engine", {}),
    ("grpo", "binary", "trainer", dict(kl_mode="loss", kl_coef=0.1, kl_kind="k3")),
])
def test_float64_stream_equals_sync(glm_ddp, estimator, reward, old, terms):
    """GRPO / RLOO with PPO clip (π_old from the trainer: bucketed trajectories; from the engine: the clip rule),
    and a KL loss term (second backward): stream-trajectory (two arrival orders) and stream-group gradients equal
    sync ≤ 1e-12 relative; MLA, router, routed and shared experts all get gradient; the correction bias does
    not move."""
    from megatron_tsync.algorithms.policy_loss import PolicyLossConfig
    from megatron_tsync.training.stream_fb import LossConfig

    from ..training.stream_cases import arrival_order, make_samples, spec_for

    ddp = glm_ddp[0]
    bias = [layer.mlp.router.expert_bias.clone() for layer in ddp.module.decoder.layers[1:]]
    samples = make_samples(31, reward_kind=reward, vocab=ddp.module.arch.vocab_size, with_ref=bool(terms))
    kw = dict(estimator=estimator, reward_spec=spec_for(reward),
              loss=LossConfig(policy=PolicyLossConfig(), old_logprobs=old, **terms))
    g_sync, norms, _ = _step(glm_ddp, "sync", samples, samples, **kw)
    assert all(v > 0 for v in norms.values()), norms
    worst = 0.0
    for mode, seed in (("stream-trajectory", 1), ("stream-trajectory", 2), ("stream-group", 3)):
        g, _, res = _step(glm_ddp, mode, samples, arrival_order(samples, seed), **kw)
        rel = ((g - g_sync).norm() / g_sync.norm()).item()
        worst = max(worst, rel)
        assert rel < TOL, (mode, seed, rel)
        if mode == "stream-trajectory" and old == "trainer":
            assert res.planner_stats["bucketed"] > 0
    print(f"glm4_moe_lite float64 {estimator} {reward} old={old} {terms or ''}: worst rel diff {worst:.2g}")
    assert all(torch.equal(a, layer.mlp.router.expert_bias)
               for a, layer in zip(bias, ddp.module.decoder.layers[1:]))


@pytest.mark.slow
def test_minibatches_and_epochs(tiny_glm, megatron_single):
    """Two minibatches × two epochs, PPO clip, SGD lr 0.05 (the experts and routers move between minibatches, the
    correction bias does not): weights after the step in stream-trajectory and stream-group equal sync's ≤ 1e-12
    relative to how far they moved."""
    from megatron_tsync.streaming.ready_queue import ListSource
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from megatron_tsync.training.stream_fb import LossConfig

    from ..training.stream_cases import arrival_order, make_samples, spec_for

    arch, state = hc.load_hf_dir(tiny_glm)
    samples = make_samples(21, num_groups=4, reward_kind="binary", vocab=arch.vocab_size)
    weights = {}
    for mode, order in (("sync", samples), ("stream-trajectory", arrival_order(samples, 3)),
                        ("stream-group", arrival_order(samples, 4))):
        ddp = wrap_ddp(build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0))
        hc.load_hf_into_model(ddp, _state64(state))
        opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.05, clip_grad=0))
        theta0 = torch.cat([p.detach().reshape(-1).clone() for p in ddp.parameters()])
        learner = Learner(ddp, opt, LearnerConfig(mode=mode, reward_spec=spec_for("binary"), num_minibatches=2,
                                                   epochs=2, loss=LossConfig()))
        sizes, shape = shape_for(samples)
        learner.train_step(ListSource(order), sizes, shape)
        weights[mode] = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
        bias = [state[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in range(1, arch.num_layers)]
        assert all(torch.equal(layer.mlp.router.expert_bias, b) for layer, b in zip(ddp.module.decoder.layers[1:], bias))
    moved = (weights["sync"] - theta0).norm()
    assert moved > 1e-6
    for mode in ("stream-trajectory", "stream-group"):
        rel = ((weights[mode] - weights["sync"]).norm() / moved).item()
        print(f"glm4_moe_lite minibatches×epochs {mode}: {rel:.2g}")
        assert rel < TOL, (mode, rel)


# ---------------------------------------------------------------------------------------------- TP = 2, EP = 2, PP = 2
@pytest.fixture(scope="module")
def glm_pp_dirs(tmp_path_factory):
    """Two 4-layer tiny GLMs for PP = 2 (two layers a stage): the first layer dense (the dense/MoE boundary inside
    stage 0) and the first two dense (the boundary at the stage boundary). {first_k_dense: folder}."""
    from megatron_tsync.model.tiny_model import make_tiny_model

    d = tmp_path_factory.mktemp("glm_pp")
    return {k: make_tiny_model(str(d / f"dense{k}"), family="glm4-moe-lite", layers=4, hidden=64, seed=7 + k,
                               mla=dict(first_k_dense=k)) for k in (1, 2)}


_STREAM_TESTS = ("test_streaming_ep2_tp2_equal_one_process", "test_streaming_pp2_equal_one_process",
                 "test_kl_replay_deterministic_at_layouts")


def _merge(a: dict, b: dict) -> dict:
    """Nested dicts of the launches' results, one dict."""
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture(scope="module")
def glm_launch(tiny_glm, glm_pp_dirs, tmp_path_factory, request):
    """``glm_launch(part)``: one launch of _glm_worker.py (two gloo processes) per part, made when a test first needs
    it: "tp" (TP = 2), "ep" (EP = 2), "pp" (PP = 2 with each of ``glm_pp_dirs``) and "opd" (OPD at EP = 2, TP = 2
    and PP = 2) — four launches, so that no test holds two (one launch of everything took 190 s on CI's two busy
    cores; TP and EP together 108 s). Each of "tp", "ep" and "pp": the float64 logits and round trip at its layouts
    and (when a streaming test is selected) the streaming cases of tests/training/_workers/moe_ep_worker.py at them.
    Returns (logits report, streaming results or None, OPD results or None)."""
    import importlib.util

    from ..training._launch import selected_params

    spec = importlib.util.spec_from_file_location(
        "conv_common", os.path.join(os.path.dirname(__file__), "..", "training", "_workers", "conv_common.py"))
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    stream = bool(selected_params(request, lambda item: item.name in _STREAM_TESTS or None))
    worker = os.path.join(os.path.dirname(__file__), "_glm_worker.py")
    pp_dirs = list(glm_pp_dirs.values())
    done: dict = {}

    def get(part: str):
        if part not in done:
            d = tmp_path_factory.mktemp(f"glm_{part}")
            out, stream_out, opd_out = str(d / "rep.json"), str(d / "stream.pt"), str(d / "opd.pt")
            args = {"tp": ["--layouts", "2:1:1", "--kl-ref", pp_dirs[-1]],
                    "ep": ["--layouts", "1:1:2", "--kl-ref", pp_dirs[-1]],
                    "pp": ["--layouts", "", "--pp-hf", ",".join(pp_dirs)],
                    "opd": ["--layouts", "", "--opd-pp-hf", pp_dirs[0], "--opd-out", opd_out]}[part]
            save_stream = stream and part != "opd"
            rc, log, _ = common.run_isolated([worker, "--hf", tiny_glm, "--out", out, *args,
                                              *(["--stream-out", stream_out] if save_stream else [])],
                                             nproc=2, timeout=600)
            assert rc == 0, log[-4000:]
            with open(out) as f:
                rep = json.load(f)
            done[part] = (rep, torch.load(stream_out) if save_stream else None,
                          torch.load(opd_out) if part == "opd" else None)
        return done[part]

    return get


@pytest.fixture
def glm_two_procs(glm_launch):
    """The layout launches' results merged: (logits rows of all, streaming results of all or None)."""
    parts = [glm_launch(part) for part in ("tp", "ep", "pp")]
    stream = None
    if parts[0][1] is not None:
        stream = parts[0][1]
        for part in parts[1:]:
            stream = _merge(stream, part[1])
    return [row for part in parts for row in part[0]], stream


@pytest.mark.slow
@pytest.mark.parametrize("part", ["tp", "ep"])
def test_float64_logits_tp2_ep2(glm_launch, part):
    """Two gloo processes: TP=2 (sequence parallel, as megatron's MoE layer needs), or EP=2 (8 experts a rank):
    float64 logits equal transformers' ≤ 1e-12 relative, and the round trip through the sharded model is
    bit-identical."""
    rep = [r for r in glm_launch(part)[0] if r["pp"] == 1]
    assert [(r["tp"], r["ep"]) for r in rep] == [{"tp": (2, 1), "ep": (1, 2)}[part]]
    r = rep[0]
    print(f"glm4_moe_lite tp={r['tp']} ep={r['ep']}: float64 logits rel diff {r['rel_logit_diff']:.3g}")
    assert r["same_keys"] and not r["mismatched"], r
    assert r["rel_logit_diff"] <= TOL, r
    if part == "ep":
        assert r["local_experts"] == 8
    else:
        assert r["sequence_parallel"]


@pytest.mark.slow
def test_float64_logits_pp2_dense_boundary(glm_launch):
    """PP = 2 (two gloo processes, the first stage's hidden states sent to the second) with 4-layer models whose
    dense/MoE boundary falls inside stage 0 (first_k_dense 1) and at the stage boundary (2): float64 logits =
    transformers' ≤ 1e-12 relative, the round trip through the stages bit-identical, each stage holds the MoE
    layers the split says."""
    rep = {r["dense"]: r for r in glm_launch("pp")[0] if r["pp"] == 2}
    assert sorted(rep) == [1, 2]
    for k, r in rep.items():
        print(f"glm4_moe_lite pp=2 first_k_dense={k}: float64 logits rel diff {r['rel_logit_diff']:.3g}")
        assert r["same_keys"] and not r["mismatched"] and r["rel_logit_diff"] <= TOL, r
    assert rep[1]["stage_layers"] == [[0, 1], [1, 1]] and rep[2]["stage_layers"] == [[0, 0], [1, 1]]


# ---------------------------------------------------------------------------------------------- router replay
def test_router_replay_fixes_experts_weights_from_scores(tiny_glm, megatron_single):
    """Record → replay reproduces the logits bitwise; replaying other experts (those the model picks without its
    correction bias) equals transformers forced to those experts with the weights from the sigmoid scores
    (normalised, × routed scaling; the bias unused) ≤ 1e-12 — and differs from the model's own routing."""
    from megatron_tsync.model import moe

    arch, state = hc.load_hf_dir(tiny_glm)
    model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0, moe_enable_routing_replay=True)
    hc.load_hf_into_model(model, _state64(state))
    ids = _ids(arch.vocab_size, b=1)  # B = 1: megatron's (S·B) token order is position order
    with moe.record_routing(model) as rec:
        own = _megatron_logits(model, ids)
    assert len(rec.indices) == arch.num_layers - arch.moe_first_k_dense  # MoE layers only
    with moe.replay_routing(model, rec.indices):
        assert torch.equal(_megatron_logits(model, ids), own)
    biases = [layer.mlp.router.expert_bias for layer in model.decoder.layers[1:]]
    saved = [b.clone() for b in biases]
    for b in biases:
        b.zero_()
    with moe.record_routing(model) as other:
        _megatron_logits(model, ids)
    for b, s in zip(biases, saved):
        b.copy_(s)
    assert any(not torch.equal(a.sort(-1).values, b.sort(-1).values) for a, b in zip(rec.indices, other.indices))
    with moe.replay_microbatch(model, [torch.cat([i]) for i in other.indices]):  # per global MoE layer
        replayed = _megatron_logits(model, ids)
    with float64_transformers(forced=[i.clone() for i in other.indices]), torch.no_grad():
        ref = _hf64(tiny_glm)(ids).logits
    rel = ((replayed - ref).abs().max() / ref.abs().max()).item()
    print(f"glm4_moe_lite replay vs transformers forced to the same experts: rel {rel:.3g}")
    assert rel <= TOL and ((replayed - own).abs().max() / own.abs().max()).item() > 1e-3


@pytest.mark.slow
def test_streaming_ep2_tp2_equal_one_process(tiny_glm, glm_two_procs, megatron_single):
    """tests/training/_workers/moe_ep_worker.py's cases on the tiny GLM model: GRPO (π_old from the trainer), RLOO
    with a dual clip (π_old from the engine) and its --deterministic variant, float64, in sync / stream-trajectory
    (two orders at EP = 2) / stream-group, at EP = 2 (expert lockstep) and TP = 2 (sequence parallelism; the
    down-projections duplicated, mla.py), run in the two-process launch of ``glm_two_procs``: every gradient
    ≤ 1e-12 from one process's sync gradient (computed in this process, as that worker's ``single`` layout)."""
    from ..training.stream_cases import rel_error
    from ._glm_worker import stream_grads

    got = glm_two_procs[1]
    one, _ = stream_grads(tiny_glm, megatron_single, "single", sync_only=True)
    for layout in ("ep2", "tp2"):
        assert set(got["grads"][layout]) == set(one) and (got["idle"][layout]["grpo-bounded-trainer"] > 0) == (
            layout == "ep2")  # lockstep idle microbatches at EP only
        for case, modes in got["grads"][layout].items():
            ref = one[case]["sync"]
            assert all(ref[k].abs().max() > 0 for k in ref if ".experts." in k)
            for mode, g in modes.items():
                r = rel_error(g, ref)
                print(f"glm4_moe_lite {layout} {case} {mode}: vs one process {r:.2g}")
                assert r < TOL, (layout, case, mode, r)


@pytest.mark.slow
def test_streaming_pp2_equal_one_process(glm_pp_dirs, glm_two_procs, megatron_single):
    """PP = 2 with both 4-layer models (dense/MoE boundary inside stage 0 and at the stage boundary), in the launch
    of ``glm_two_procs``: GRPO (π_old from the trainer; both) and RLOO with a dual clip (π_old from the engine; the
    boundary inside stage 0), float64,
    sync / stream-trajectory / stream-group gradients through megatron's pipeline schedule ≤ 1e-12 from one
    process's sync gradient (computed in this process); every expert gets gradient."""
    from ..training.stream_cases import rel_error
    from ._glm_worker import PP_STREAM_CASES, stream_grads

    got = glm_two_procs[1]
    for k, path in glm_pp_dirs.items():
        layout = f"pp2-dense{k}"
        one, _ = stream_grads(path, megatron_single, "single", sync_only=True, cases=PP_STREAM_CASES[:3 - k])
        assert set(got["grads"][layout]) == set(one)
        for case, modes in got["grads"][layout].items():
            ref = one[case]["sync"]
            assert all(ref[n].abs().max() > 0 for n in ref if ".experts." in n)
            assert set(modes) == {"sync", "stream-trajectory", "stream-group"}
            for mode, g in modes.items():
                r = rel_error(g, ref)
                print(f"glm4_moe_lite {layout} {case} {mode}: vs one process {r:.2g}")
                assert r < TOL, (layout, case, mode, r)


@pytest.mark.slow
def test_kl_replay_deterministic_at_layouts(tiny_glm, glm_pp_dirs, glm_two_procs, megatron_single):
    """In the launch of ``glm_two_procs``, each against one process's sync gradient (this process) ≤ 1e-12: a KL
    loss against a reference model (the other 4-layer GLM; moe_ep_worker's ``kl-loss-grpo-by-group``,
    stream-trajectory) at EP = 2, TP = 2 and PP = 2; GRPO replaying recorded random experts (moe_tp_pp_worker's
    ``replay``, sync and stream-trajectory) at the same layouts, every engine-computed (position, MoE layer) routed
    as given, the gradient ≠ without replay (control); ``--deterministic`` RLOO at PP = 2 (sync, two streamed
    orders) bitwise equal across modes."""
    import importlib.util

    from ..training.stream_cases import rel_error
    from ._glm_worker import KL_CASE, stream_grads

    spec = importlib.util.spec_from_file_location("_glm_tp_pp", os.path.join(
        os.path.dirname(__file__), "..", "training", "_workers", "moe_tp_pp_worker.py"))
    tp_pp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp_pp)
    got = glm_two_procs[1]
    policies = {"ep2": tiny_glm, "tp2": tiny_glm, "pp2-dense1": glm_pp_dirs[1]}
    refs = {}
    for path in dict.fromkeys(policies.values()):
        kl, _ = stream_grads(path, megatron_single, "single", sync_only=True, cases=(KL_CASE,),
                             ref_dir=glm_pp_dirs[2])
        one = tp_pp.run_layout(path, megatron_single, ["replay", "plain"], modes=tp_pp.MODES[:1])["grads"]
        assert rel_error(one["replay"]["sync"], one["plain"]["sync"]) > 1e-3  # replay changes the routing
        refs[path] = {"kl": kl[KL_CASE]["sync"], "replay": one["replay"]["sync"]}
    for layout, path in policies.items():
        for what, modes in (("kl", got["kl"][layout]), ("replay", got["replay"][layout]["grads"])):
            assert modes and set(modes) <= {"sync", "stream-trajectory"}
            for mode, g in modes.items():
                r = rel_error(g, refs[path][what])
                print(f"glm4_moe_lite {layout} {what} {mode}: vs one process {r:.2g}")
                assert r < TOL, (layout, what, mode, r)
        same, differ = got["replay"][layout]["agree"]
        assert same > 0 and differ == 0, (layout, same, differ)
    det = got["det"]["pp2-dense1"]["det-rloo-binary-engine"]
    ref = stream_grads(glm_pp_dirs[1], megatron_single, "single", sync_only=True,
                       cases=("det-rloo-binary-engine",))[0]["det-rloo-binary-engine"]["sync"]
    assert len(det) == 3 and all(all(torch.equal(g[k], det["sync"][k]) for k in g) for g in det.values())
    assert rel_error(det["sync"], ref) < TOL


@pytest.mark.slow
def test_opd_ep2_tp2_pp2_equal_one_process(tiny_glm, glm_pp_dirs, glm_launch, megatron_single):
    """OPD with a tiny GLM student (tests/training/_workers/moe_ep_opd_worker.py's run, in the "opd" launch of
    ``glm_launch``): token-mean in sync and stream-turn, and with router replay of recorded (random) experts in
    stream-turn
    (the KV-kept turn forward through MLA) at EP = 2 (each rank its own turn order, lanes of matched forwards),
    TP = 2 (sequence parallel) and PP = 2 (the per-chunk p2p path; the 4-layer model) — every gradient ≤ 1e-12 from
    one process's sync gradient; replay routes every computed (token, MoE layer) as recorded and changes the
    gradient (control); a GLM teacher at EP = 2 and TP = 2 scores as one process."""
    from ..training.stream_cases import rel_error
    from ._glm_worker import OPD_CASES, OPD_MODES, opd_worker

    got, w = glm_launch("opd")[2], opd_worker()
    for layout, path in (("ep2", tiny_glm), ("tp2", tiny_glm), ("pp2", glm_pp_dirs[1])):
        arch, _ = hc.load_hf_dir(path)
        S, E = w.trajectories(arch)
        ref = {case: w.run(path, case, "sync", S, E)[0] for case in OPD_CASES}
        assert rel_error(ref["replay"], ref["token-mean"]) > 1e-3  # the recorded experts are not the model's own
        for case in OPD_CASES:
            assert tuple(got[layout]["grads"][case]) == OPD_MODES[case]
            for mode, g in got[layout]["grads"][case].items():
                r = rel_error(g, ref[case])
                print(f"glm4_moe_lite OPD {layout} {case} {mode}: vs one process {r:.2g}")
                assert r < TOL, (layout, case, mode, r)
        checked, differ = got[layout]["replay"]["stream-turn"]
        moe_layers = arch.num_layers - arch.moe_first_k_dense
        assert checked == sum(s.routing.shape[0] for s in S) * moe_layers and differ == 0, (checked, differ)
        if layout != "pp2":
            teacher = w.teacher_scores(path, S, E)
            worst = max((got[layout]["teacher"][k] - v).abs().max().item() for k, v in teacher.items())
            assert worst <= TOL, (layout, worst)
    assert sum(sum(v) for v in got["ep2"]["idle"]["token-mean"].values()) > 0  # the ranks' turn orders differed


@pytest.mark.parametrize("flag", ["sequence_packing", "shared_prefix"])
def test_packing_and_shared_prefix_are_refused(glm_ddp, flag):
    """Not built for MLA (its RoPE takes positions 0..S-1 of the whole microbatch): one line at learner start."""
    from megatron_tsync.training.learner import Learner, LearnerConfig

    with pytest.raises(ValueError, match="not built for multi-latent attention"):
        Learner(glm_ddp[0], glm_ddp[1], LearnerConfig(mode="sync", **{flag: True}))


def test_fp8_is_refused(tiny_glm, megatron_single):
    arch, _ = hc.load_hf_dir(tiny_glm)
    with pytest.raises(ValueError, match="no FP8"):
        build_model(arch, PrecisionConfig(fp8_format="e4m3"))


def test_control_latent_norm_eps(tiny_glm, megatron64, monkeypatch):
    """Control: the latent norms at the config's rms_norm_eps (1e-5, megatron's default choice) instead of
    transformers' 1e-6 move the logits far above the tolerance."""
    ids = _ids(megatron64.arch.vocab_size)
    with float64_transformers(), torch.no_grad():
        ref = _hf64(tiny_glm)(ids).logits
    norms = [m for n, m in megatron64.named_modules() if n.endswith(("q_layernorm", "kv_layernorm"))]
    assert norms and all(m.eps == mla.LATENT_NORM_EPS for m in norms)
    for m in norms:
        monkeypatch.setattr(m, "eps", megatron64.arch.rms_norm_eps)
    rel = ((_megatron_logits(megatron64, ids) - ref).abs().max() / ref.abs().max()).item()
    assert rel > 1e-9, rel
