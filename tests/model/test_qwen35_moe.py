"""Qwen3.5-MoE-style hybrids (``qwen3_5_moe``: the qwen3_5 layers with every MLP softmax-routed experts plus a
sigmoid-gated shared expert; model/qwen35.py on megatron-core's MoE layer with ``moe_shared_expert_gate``).

- config: ModelArch from the text and the multimodal config.json, refusals (no shared expert, TP > 1);
- the tiny model (tools/make_tiny_model.py --family qwen3.5-moe) is transformers' own Qwen3_5MoeTextConfig;
- conversion HF → (PP, EP) shards → HF bit-identical, and through the float64 model;
- float64 logits = transformers' (float32 casts lifted, the router's softmax among them) ≤ 1e-12; the shared
  expert's gate matters (control);
- float64 GRPO streamed (stream-trajectory, stream-group) = sync ≤ 1e-12 in one process;
- the embedded engine generates with it (greedy tokens and log-probs = the trainer's).
"""

import pytest
import torch

from megatron_tsync.model import hf_conversion as hc
from megatron_tsync.model.builder import ModelArch, PrecisionConfig, build_model, transformer_config

from ._qwen35_reference import float64_transformers, hf_model
from .test_qwen35 import TEXT_JSON, _ids, _logits, _rel

TOL = 1e-12
MOE_JSON = {**{k: v for k, v in TEXT_JSON.items() if k != "intermediate_size"}, "model_type": "qwen3_5_moe_text",
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("q35moe") / "m"), family="qwen3.5-moe", hidden=64, seed=3)


@pytest.fixture(scope="module")
def moe64(tiny_moe, megatron_single):
    arch, state = hc.load_hf_dir(tiny_moe)
    model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0)
    hc.load_hf_into_model(model, {k: v.double() for k, v in state.items()})
    return model


def test_arch_and_refusals():
    arch = ModelArch.from_hf_config(MOE_JSON)
    assert arch.family == "qwen3_5_moe" and (arch.num_experts, arch.moe_router_topk) == (8, 2)
    assert arch.moe_shared_expert_ffn_hidden_size == 48 and arch.norm_topk_prob
    assert ModelArch.from_hf_config(hc.hf_config_dict(arch)) == arch
    assert ModelArch.from_hf_config({"model_type": "qwen3_5_moe", "text_config": MOE_JSON}) == arch
    cfg = transformer_config(arch, PrecisionConfig())
    assert cfg.moe_shared_expert_gate and cfg.moe_shared_expert_intermediate_size == 48 and cfg.num_moe_experts == 8
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        ModelArch.from_hf_config({**MOE_JSON, "shared_expert_intermediate_size": 0})
    with pytest.raises(ValueError, match="TP > 1 is not built"):
        transformer_config(arch, PrecisionConfig(), tp=2)


def test_tiny_model_is_transformers_model(tiny_moe):
    hf = hf_model(tiny_moe, torch.float32)
    assert type(hf).__name__ == "Qwen3_5MoeForCausalLM" and type(hf.config).__name__ == "Qwen3_5MoeTextConfig"
    assert type(hf.model.layers[0].mlp).__name__ == "Qwen3_5MoeSparseMoeBlock"


@pytest.mark.parametrize("pp,ep", [(1, 1), (2, 2)])
def test_pure_round_trip(tiny_moe, pp, ep):
    arch, state = hc.load_hf_dir(tiny_moe)
    back = {}
    for p in range(pp):
        for q in range(ep):
            full = hc.hf_to_megatron(state, arch, pp_rank=p, pp_size=pp, ep_rank=q, ep_size=ep)
            full = {k: [v] if k.endswith("linear_fc1.weight") else v for k, v in full.items()}
            back.update(hc.megatron_full_to_hf(full, arch, p * arch.num_layers // pp, 1,
                                               expert_offset=q * arch.num_experts // ep))
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_model_round_trip(tiny_moe, moe64):
    _, state = hc.load_hf_dir(tiny_moe)
    back = hc.megatron_to_hf(moe64)
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k].double()) for k in state)


def test_float64_logits_equal_transformers_and_gate_control(tiny_moe, moe64):
    ids = _ids(512)
    with float64_transformers("qwen3_5_moe"), torch.no_grad():
        ref = hf_model(tiny_moe)(ids).logits  # (B, S, V)
    rel = _rel(_logits(moe64, ids), ref)
    print(f"qwen3_5_moe float64 logits: {rel:.3g}")
    assert rel <= TOL
    gates = [layer.mlp.shared_experts.gate_weight for layer in moe64.decoder.layers]
    saved = [g.detach().clone() for g in gates]
    with torch.no_grad():
        for g in gates:
            g.zero_()  # σ(0) = 1/2 instead of the checkpoint's gate
    try:
        assert _rel(_logits(moe64, ids), ref) > 1e-6
    finally:
        with torch.no_grad():
            for g, s in zip(gates, saved):
                g.copy_(s)


def test_float64_stream_equals_sync(tiny_moe, moe64):
    from megatron_tsync.streaming.ready_queue import ListSource
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    from ..training.stream_cases import arrival_order, make_samples, spec_for

    arch, state = hc.load_hf_dir(tiny_moe)
    ddp = wrap_ddp(build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0))
    hc.load_hf_into_model(ddp, {k: v.double() for k, v in state.items()})
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))
    samples = make_samples(33, reward_kind="bounded", vocab=256)
    grads, gate = {}, {}

    def hook(d, mode):
        grads[mode] = torch.cat([b.grad_data.clone() for b in d.buffers])
        gate[mode] = sum(float(p.main_grad.norm()) for n, p in ddp.named_parameters() if n.endswith("gate_weight"))

    for mode, order in (("sync", samples), ("stream-trajectory", arrival_order(samples, 1)),
                        ("stream-group", arrival_order(samples, 2))):
        learner = Learner(ddp, opt, LearnerConfig(mode=mode, reward_spec=spec_for("bounded")))
        learner.grad_hook = lambda d, m=mode: hook(d, m)
        sizes, shape = shape_for(samples)
        learner.train_step(ListSource(order), sizes, shape)
    assert grads["sync"].norm() > 0 and gate["sync"] > 0  # the shared expert's gate is trained
    for mode in ("stream-trajectory", "stream-group"):
        rel = ((grads[mode] - grads["sync"]).norm() / grads["sync"].norm()).item()
        print(f"qwen3_5_moe float64 grpo {mode}: {rel:.2g}")
        assert rel < TOL, (mode, rel)


def test_embedded_engine_generates_with_the_trainers_logprobs(tiny_moe, moe64):
    """The embedded engine on the MoE variant (float64, left-padded prompts of 3 and 17 tokens): greedy tokens = the
    trainer's argmax, log-probs = the trainer's ≤ 1e-12."""
    from megatron_tsync.model.logprobs import token_logprobs
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from megatron_tsync.rollout.engine import SamplingConfig

    engine = EmbeddedEngine.from_hf_dir(tiny_moe, PrecisionConfig(params_dtype=torch.float64))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(9, 512, (n,), generator=g).tolist() for n in (3, 17)]
    worst = 0.0
    for p, (c,) in zip(prompts, engine.generate(prompts, SamplingConfig(top_k=1, max_new_tokens=8, seed=0))):
        ids = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            assert _logits(moe64, ids)[0, len(p) - 1 : -1].argmax(-1).tolist() == c.token_ids
            lp = token_logprobs(moe64, ids)[0, len(p) - 1 :]
        worst = max(worst, (lp - torch.tensor(c.logprobs, dtype=lp.dtype)).abs().max().item())
    print(f"qwen3_5_moe embedded engine vs trainer: {worst:.3g}")
    assert worst <= TOL
