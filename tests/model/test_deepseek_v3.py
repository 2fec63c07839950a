"""DeepSeek-V3 (``deepseek_v3``): the GLM-4.7-Flash family's code path (model/mla.py) under DeepSeek-V3's config.

transformers models ``deepseek_v3`` and ``glm4_moe_lite`` the same way (multi-latent attention, sigmoid routing with
the correction bias, grouped top-k, routed scaling, shared experts, the first layers dense); the config spells the
dense layers ``first_k_dense_replace`` instead of ``mlp_layer_types``. The tiny model (``make_tiny_model(...,
family="deepseek_v3")``) is transformers' own DeepseekV3Config / DeepseekV3ForCausalLM, 2 layers (one dense, one
MoE), 8 experts in 4 groups. Checked: the config read and written back, float64 logits = transformers' (its float32
casts lifted, tests/model/_glm_reference.py) ≤ 1e-12 relative, HF → (TP, PP, EP) shards → HF and HF → model → HF
bit-identical, float64 GRPO stream-trajectory / stream-group = sync ≤ 1e-12. ``glm4_moe`` (GLM-4.5: GQA attention
with partial RoPE and q/k/v biases, not MLA) is refused with one line.
"""

import json
import os

import pytest
import torch

from megatron_tsync.model import hf_conversion as hc
from megatron_tsync.model.builder import ModelArch, PrecisionConfig, build_model

from ._glm_reference import float64_transformers, hf64
from .test_glm4_moe_lite import _ids, _megatron64, _megatron_logits, _state64, _step
from .test_glm4_moe_lite import test_pure_round_trip as _pure_round_trip

TOL = 1e-12


@pytest.fixture(scope="module")
def tiny_ds(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("ds") / "deepseek_v3"), family="deepseek-v3", hidden=64,
                           layers=2, experts=8, seed=5)


@pytest.fixture(scope="module")
def ds64(tiny_ds, megatron_single):
    return _megatron64(tiny_ds)


def test_config_is_deepseek_v3_and_glm4_moe_is_refused(tiny_ds):
    from transformers import AutoConfig, DeepseekV3Config

    with open(os.path.join(tiny_ds, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "deepseek_v3" and cfg["first_k_dense_replace"] == 1 and "mlp_layer_types" not in cfg
    assert isinstance(AutoConfig.from_pretrained(tiny_ds), DeepseekV3Config)
    arch = ModelArch.from_hf_config(cfg)
    assert arch.family == "deepseek_v3" and arch.moe_first_k_dense == 1 and arch.moe_router_num_groups == 4
    assert ModelArch.from_hf_config(hc.hf_config_dict(arch)) == arch
    with pytest.raises(ValueError, match="'glm4_moe' .* GQA with partial RoPE"):
        ModelArch.from_hf_config({**cfg, "model_type": "glm4_moe"})
    with pytest.raises(ValueError, match="deepseek_v3 rope 'yarn' is not supported"):  # DeepSeek-V3's own config
        ModelArch.from_hf_config({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 40.0}})


def test_float64_logits_equal_transformers(tiny_ds, ds64):
    ids = _ids(ds64.arch.vocab_size)
    with float64_transformers(family="deepseek_v3"), torch.no_grad():
        hf = hf64(tiny_ds)
        assert type(hf).__name__ == "DeepseekV3ForCausalLM"
        ref = hf(ids).logits  # (B, S, V)
    mine = _megatron_logits(ds64, ids)
    rel = ((mine - ref).abs().max() / ref.abs().max()).item()
    print(f"deepseek_v3 float64 logits: max |Δ| / max |logit| = {rel:.3g}")
    assert ref.dtype == mine.dtype == torch.float64 and rel <= TOL


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 2, 2)])
def test_pure_round_trip(tiny_ds, tp, pp, ep):
    _pure_round_trip(tiny_ds, tp, pp, ep)


def test_model_round_trip(tiny_ds, ds64):
    _, state = hc.load_hf_dir(tiny_ds)
    back = hc.megatron_to_hf(ds64)
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], _state64(state)[k]) for k in state)


def test_float64_grpo_stream_equals_sync(tiny_ds, megatron_single):
    """GRPO (bounded rewards, PPO clip, π_old from the trainer): stream-trajectory and stream-group gradients =
    sync ≤ 1e-12 relative; MLA, router, routed and shared experts all get gradient."""
    from megatron_tsync.algorithms.policy_loss import PolicyLossConfig
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from megatron_tsync.training.stream_fb import LossConfig

    from ..training.stream_cases import arrival_order, make_samples, spec_for

    arch, state = hc.load_hf_dir(tiny_ds)
    ddp = wrap_ddp(build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0))
    hc.load_hf_into_model(ddp, _state64(state))
    pair = (ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0)))
    samples = make_samples(23, reward_kind="bounded", vocab=arch.vocab_size)
    kw = dict(estimator="grpo", reward_spec=spec_for("bounded"), loss=LossConfig(policy=PolicyLossConfig()))
    g_sync, norms, _ = _step(pair, "sync", samples, samples, **kw)
    assert all(v > 0 for v in norms.values()), norms
    for mode, seed in (("stream-trajectory", 1), ("stream-group", 2)):
        g, _, _ = _step(pair, mode, samples, arrival_order(samples, seed), **kw)
        rel = ((g - g_sync).norm() / g_sync.norm()).item()
        print(f"deepseek_v3 float64 GRPO {mode}: {rel:.2g}")
        assert rel < TOL, (mode, rel)


@pytest.mark.slow
def test_convert_checkpoint_tool_verify(tiny_ds, tmp_path):
    """tools/convert_checkpoint.py HF → Megatron → HF with --verify both ways (float32, one process, against
    transformers' DeepseekV3ForCausalLM): passes, and the exported folder is a deepseek_v3 one, bit-identical."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "conv_common", os.path.join(os.path.dirname(__file__), "..", "training", "_workers", "conv_common.py"))
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    driver = os.path.join(os.path.dirname(__file__), "_convert_driver.py")
    ck, back = str(tmp_path / "ck"), str(tmp_path / "back")
    with open(tmp_path / "jobs.json", "w") as f:  # both directions in one process
        json.dump([["--direction", "hf-to-megatron", "--load", tiny_ds, "--save", ck, "--verify"],
                   ["--direction", "megatron-to-hf", "--load", ck, "--save", back, "--verify"]], f)
    rc, out, _ = common.run_isolated([driver, "--jobs", str(tmp_path / "jobs.json")], timeout=600, bare=True)
    assert rc == 0 and out.count("[tsync] verify:") == 2, out[-3000:]
    a, b = hc.load_hf_state(tiny_ds), hc.load_hf_state(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    with open(os.path.join(back, "config.json")) as f:
        assert json.load(f)["model_type"] == "deepseek_v3"
