"""The planner's parameter counts (``plan/shapes.py``) equal transformers' own for the real configs of every family it
names, the seed paper's two models included, and the families the learner builds keep their earlier per-rank counts."""

import pytest
import torch

from megatron_tsync.plan.hardware import MODELS, ModelCost, load_arch
from megatron_tsync.plan.memory import layer_params, stage_params
from megatron_tsync.plan.shapes import shape_of


def _transformers_params(cfg: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: a 30 B model costs no memory
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["glm-4.7-flash", "qwen3.5-27b", "qwen3-30b-a3b", "qwen3-8b"])
def test_total_params_equal_transformers(name):
    assert ModelCost.of(load_arch(name)).total_params == _transformers_params(MODELS[name])


def test_deepseek_v3_shape_equals_transformers():
    cfg = dict(MODELS["glm-4.7-flash"], model_type="deepseek_v3", num_hidden_layers=5, first_k_dense_replace=2,
               n_shared_experts=2, q_lora_rank=None, vocab_size=1000)
    assert sum(shape_of(cfg).stage_params(1, 1)) == _transformers_params(cfg)


@pytest.mark.parametrize("name,tp,pp,ep", [("qwen3-8b", 2, 2, 1), ("dense-27b", 4, 1, 1), ("qwen3-30b-a3b", 2, 2, 4),
                                           ("qwen3-32b", 8, 4, 1)])
def test_uniform_families_keep_their_counts(name, tp, pp, ep):
    arch = load_arch(name)
    h, emb = arch.hidden_size, arch.vocab_size * arch.hidden_size // tp
    old = [arch.num_layers // pp * layer_params(arch, tp, ep)] * pp
    old[0] += emb
    old[-1] += h + (emb if not arch.tie_word_embeddings or pp > 1 else 0)
    assert stage_params(arch, tp, pp, ep) == old


def test_paper_models_costs():
    glm, q35 = ModelCost.of(load_arch("glm-4.7-flash")), ModelCost.of(load_arch("qwen3.5-27b"))
    # MLA caches the latent and the RoPE key: (512 + 64) bf16 values per token and layer
    assert glm.kv_bytes_per_token == 47 * 576 * 2 and glm.state_bytes_per_seq == 0
    assert glm.num_experts == 64 and glm.topk == 4 and 3.0e9 < glm.active_params < 3.5e9
    # the hybrid: a KV cache in its 16 full-attention layers only, a recurrent state in the 48 others
    assert q35.layers == 16 and q35.kv_bytes_per_token == 16 * 2 * 2 * 4 * 256
    assert q35.state_bytes_per_seq > 48 * 48 * 128 * 128 * 4
    per_rank = stage_params(load_arch("glm-4.7-flash"), 1, 1, 4)
    assert sum(stage_params(load_arch("glm-4.7-flash"), 1, 1)) - per_rank[0] == glm.expert_params * 3 // 4
