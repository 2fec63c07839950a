"""GLM-4.7-Flash-style models (``glm4_moe_lite``: multi-latent attention + DeepSeek-V3-style MoE, model/mla.py).

- the tiny model (tools/make_tiny_model.py --family glm4-moe-lite) is transformers' own Glm4MoeLiteConfig with the
  first layer dense, grouped sigmoid routing and a non-zero correction bias that changes the selected experts;
- config: ModelArch from the config.json, refused layouts and refused options (the bias update among them);
- pure conversion HF → (TP, EP) shards → HF bit-identical, the interleaved-RoPE permutation included;
- logits: Megatron float64 vs transformers float64 ≤ 1e-12 relative in one process. transformers computes four
  things in float32 whatever the model's dtype (RMSNorm, the RoPE table, the router, the eager softmax): the
  reference lifts exactly those casts (:func:`float64_transformers`), nothing else of its code changes;
- the correction bias is a buffer: no gradient, unchanged by a training step's finalize;
- tools/convert_checkpoint.py --verify passes (float32, one process).
"""

import contextlib
import json
import os

import pytest
import torch

from megatron_tsync.model import hf_conversion as hc
from megatron_tsync.model import mla
from megatron_tsync.model.builder import ModelArch, PrecisionConfig, build_model, transformer_config

TOL = 1e-12


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("glm") / "glm4_moe_lite"), family="glm4-moe-lite", seed=3)


def _config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


@contextlib.contextmanager
def float64_transformers():
    """transformers' Glm4MoeLite modules with their float32 casts lifted (RMSNorm, RoPE table, router, eager
    softmax): the same formulas evaluated in float64."""
    import transformers.models.glm4_moe_lite.modeling_glm4_moe_lite as g

    saved = {name: getattr(obj, attr) for name, (obj, attr) in {
        "norm": (g.Glm4MoeLiteRMSNorm, "forward"), "rope": (g.Glm4MoeLiteRotaryEmbedding, "forward"),
        "router": (g.Glm4MoeLiteTopkRouter, "forward"), "eager": (g, "eager_attention_forward")}.items()}

    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rope(self, x, position_ids):
        cfg = self.config
        dim = cfg.qk_rope_head_dim
        inv = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).to(torch.float64) / dim))
        freqs = position_ids[..., None].to(torch.float64) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def router(self, h):
        h = h.view(-1, self.hidden_dim)
        self.weight.data = self.weight.data.to(h.dtype)
        logits = torch.nn.functional.linear(h, self.weight)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        grouped = choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(-1)
        gidx = torch.topk(grouped, k=self.topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(grouped).scatter_(1, gidx, 1)
        smask = gmask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group).reshape(
            -1, self.num_experts)
        idx = torch.topk(choice.masked_fill(~smask.bool(), float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * self.routed_scaling_factor, idx

    def eager(module, q, k, v, mask, scaling, dropout=0.0, **kw):
        w = torch.matmul(q, k.transpose(2, 3)) * scaling
        if mask is not None:
            w = w + mask
        w = torch.softmax(w, dim=-1)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    g.Glm4MoeLiteRMSNorm.forward, g.Glm4MoeLiteRotaryEmbedding.forward = norm, rope
    g.Glm4MoeLiteTopkRouter.forward, g.eager_attention_forward = router, eager
    try:
        yield
    finally:
        g.Glm4MoeLiteRMSNorm.forward, g.Glm4MoeLiteRotaryEmbedding.forward = saved["norm"], saved["rope"]
        g.Glm4MoeLiteTopkRouter.forward, g.eager_attention_forward = saved["router"], saved["eager"]


def _hf64(path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager",
                                              experts_implementation="eager")
    return hf.eval()


def _ids(vocab, b=2, s=24):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))  # (B, S)


def _state64(state):
    return {k: v if k.endswith("e_score_correction_bias") else v.double() for k, v in state.items()}


@pytest.fixture(scope="module")
def megatron64(tiny_glm, megatron_single):
    arch, state = hc.load_hf_dir(tiny_glm)
    model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0)
    hc.load_hf_into_model(model, _state64(state))
    return model


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
