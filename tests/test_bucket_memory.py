"""examples/bucket_memory.py against real models: the parameter count of one rank (= one bucket vector, shaped like
the rank's grad buffer) for Qwen2 / Qwen3 dense / Qwen3-MoE.

- TP=1 / PP=1 / EP=1: the count equals the number of parameters of a tiny model built by the model builder (exactly);
- other layouts: the count equals what the built model's named parameters give when each is placed by the layout
  rules (embedding on stage 0, final norm and output layer on the last stage, layer i on stage i // (L/PP); norms,
  QK-norms and the router replicated over TP; other linears split over TP; a rank holds E/EP experts);
- the full-size configs of the recipes (examples/qwen3_*/config.json) give the published sizes, and ``main`` reads
  ``--ep``.
"""

import dataclasses
import os
import re

import pytest

from megatron_tsync.model.builder import ModelArch

from examples.bucket_memory import main, params_per_rank, stage_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=4096)
TINY = {
    "qwen2": ModelArch.from_hf_config({**_BASE, "model_type": "qwen2", "tie_word_embeddings": False}),
    "qwen3": ModelArch.from_hf_config({**_BASE, "model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": False}),
    "qwen3_tied": ModelArch.from_hf_config({**_BASE, "model_type": "qwen3", "head_dim": 32,
                                            "tie_word_embeddings": True}),
    "qwen3_moe": ModelArch.from_hf_config({**_BASE, "model_type": "qwen3_moe", "head_dim": 32,
                                           "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2,
                                           "moe_intermediate_size": 32, "norm_topk_prob": True}),
}
_REPLICATED = re.compile(r"(layernorm|layer_norm)[^.]*\.weight$|\.router\.weight$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


@pytest.fixture(scope="module")
def shapes(megatron_single):
    """{name: {param name: numel}} of the tiny models built at TP=1/PP=1/EP=1."""
    import torch

    from megatron_tsync.model.builder import build_model

    out = {}
    for name, arch in TINY.items():
        model = build_model(arch, seed=0)
        out[name] = {n: p.numel() for n, p in model.named_parameters()}
        assert all(p.dtype == torch.float32 for p in model.parameters())
    return out


def _placed(arch, numels, tp, pp, ep):
    """Per-stage parameters of one rank from the real parameter names (independent of the script's formula)."""
    stages = [0] * pp
    per_stage = arch.num_layers // pp
    for name, n in numels.items():
        m = _LAYER.match(name)
        if name.startswith("embedding."):
            stages[0] += n // tp
            if arch.tie_word_embeddings and pp > 1:  # megatron keeps a copy of the tied embedding on the last stage
                stages[-1] += n // tp
        elif name.startswith("output_layer."):
            stages[-1] += n // tp
        elif name.startswith("decoder.final_layernorm"):
            stages[-1] += n
        elif m:
            stage = int(m.group(1)) // per_stage
            e = _EXPERT.search(name)
            if e and int(e.group(1)) >= arch.num_experts // ep:
                continue  # held by another EP rank (EP rank 0 holds experts 0 .. E/EP - 1)
            stages[stage] += n if _REPLICATED.search(name) else n // tp
        else:
            raise AssertionError(f"unplaced parameter {name}")
    return stages


@pytest.mark.parametrize("name", list(TINY))
def test_count_equals_built_model(shapes, name):
    assert params_per_rank(TINY[name], 1, 1) == sum(shapes[name].values())
    assert stage_params(TINY[name], 1, 1) == [sum(shapes[name].values())]


def test_qk_norm_and_router_are_counted(shapes):
    """The Qwen3 terms: q/k norm weights 2·head_dim per layer, router H×E per layer (the difference to Qwen2/dense)."""
    qk = {n: v for n, v in shapes["qwen3"].items() if "q_layernorm" in n or "k_layernorm" in n}
    assert sum(qk.values()) == TINY["qwen3"].num_layers * 2 * TINY["qwen3"].head_dim
    router = {n: v for n, v in shapes["qwen3_moe"].items() if n.endswith("router.weight")}
    a = TINY["qwen3_moe"]
    assert sum(router.values()) == a.num_layers * a.hidden_size * a.num_experts
    experts = sum(v for n, v in shapes["qwen3_moe"].items() if "local_experts" in n)
    assert experts == a.num_layers * a.num_experts * 3 * a.hidden_size * a.moe_ffn_hidden_size


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 4, 1), (1, 1, 2), (1, 1, 4), (2, 2, 2),
                                      (1, 2, 4)])
@pytest.mark.parametrize("name", list(TINY))
def test_count_at_other_layouts(shapes, name, tp, pp, ep):
    arch = TINY[name]
    if ep > 1 and not arch.num_experts:
        with pytest.raises(ValueError, match="MoE"):
            stage_params(arch, tp, pp, ep)
        return
    expect = _placed(arch, shapes[name], tp, pp, ep)
    assert stage_params(arch, tp, pp, ep) == expect
    assert params_per_rank(arch, tp, pp, ep) == max(expect)


def test_experts_must_split_over_ep():
    with pytest.raises(ValueError, match="experts"):
        params_per_rank(dataclasses.replace(TINY["qwen3_moe"], num_experts=6), 1, 1, 4)


def test_recipe_configs_published_sizes_and_ep_flag(capsys):
    dense = os.path.join(ROOT, "examples", "qwen3_swe", "config.json")
    moe = os.path.join(ROOT, "examples", "qwen3_moe", "config.json")
    e = main(["--hf-config", dense, "--max-open-groups", "1"])
    assert round(e["params_per_rank"] / 1e9, 2) == 8.19  # Qwen3-8B: 8.2 B
    e = main(["--hf-config", moe, "--max-open-groups", "1"])
    assert round(e["params_per_rank"] / 1e9, 2) == 30.53  # Qwen3-30B-A3B: 30.5 B
    e8 = main(["--hf-config", moe, "--ep", "8", "--max-open-groups", "1"])
    experts = 48 * 128 * 3 * 2048 * 768
    assert e["params_per_rank"] - e8["params_per_rank"] == experts - experts // 8
    assert "params per rank" in capsys.readouterr().out
