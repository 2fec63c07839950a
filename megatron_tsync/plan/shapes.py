"""A model's shape as the planner counts it: parameters per layer and per rank, attention and recurrent-state sizes.

The planner needs parameter counts (memory, the weight sync, FLOPs), the softmax-attention layers' widths (the T²
term and the KV cache) and, for linear-attention layers, their recurrent state. :func:`shape_of` builds one from a
:class:`~megatron_tsync.model.builder.ModelArch` (the families the learner builds) or straight from a Hugging Face
``config.json`` dict, which also covers families the learner cannot build yet (the planner only counts):

- ``llama`` / ``qwen2`` / ``qwen3`` / ``qwen3_moe``: GQA attention ``H × (q + 2·kv) + q × H`` (+ Qwen2's QKV bias,
  Qwen3's QK-norm ``2·head_dim``); SwiGLU ``3·H·ffn``; MoE experts ``E × 3·H·moe_ffn`` and a router ``H × E``.
- ``glm4_moe_lite`` / ``deepseek_v3`` (multi-latent attention): q ``H × q_lora + q_lora + q_lora × n·(nope+rope)``
  (or ``H × n·(nope+rope)`` without a q LoRA), kv ``H × (kv_lora + rope) + kv_lora + kv_lora × n·(nope + v)``,
  output ``n·v × H``; the first ``first_k_dense_replace`` layers dense; shared experts ``3·H·n_shared·moe_ffn``.
  The
  KV cache holds the latent and the RoPE key, ``kv_lora + rope`` bf16 values per token and layer (vLLM's MLA cache).
- ``qwen3_5`` / ``qwen3_5_text`` (Gated DeltaNet hybrid, ``layer_types``): full-attention layers GQA with an output
  gate (q projection ``2·q``) and QK-norm; linear-attention layers ``H × (2·nk·dk + 2·nv·dv + 2·nv)`` in,
  ``nv·dv × H`` out, a depthwise convolution ``(2·nk·dk + nv·dv) × kernel``, ``2·nv`` decay parameters and a
  ``dv`` gated norm; no KV cache, a recurrent state of ``nv·dk·dv`` fp32 values per sequence and layer (plus the
  convolution's last ``kernel − 1`` inputs).

Checked against ``transformers``' own parameter counts of the real configs (tests/plan/test_shapes.py).
Split over TP: the projections; over EP: the routed experts (then over TP); replicated: norms, routers, biases.
"""

from __future__ import annotations

import dataclasses
from typing import Any

GDN_CHUNK = 64  # the chunked gated delta rule's chunk (fla's and megatron-core's default)


@dataclasses.dataclass(frozen=True)
class LayerShape:
    kind: str  # "attention" | "mla" | "linear"
    split: int  # parameters split over TP (attention / linear mixer projections, dense MLP, shared experts)
    replicated: int  # norms, router, small vectors: on every TP rank
    experts: int = 0  # routed experts' parameters (a rank holds E/EP of them, each split over TP)
    num_experts: int = 0
    attn_width: float = 0.0  # softmax attention: FLOPs of its T² term per token pair = 4·attn_width (fwd)
    kv_bytes_per_token: int = 0  # bf16 cache per token
    state_bytes: int = 0  # linear attention: recurrent state per sequence
    mixer_flops_per_token: float = 0.0  # linear attention: the recurrence's forward FLOPs per token

    def params(self, tp: int = 1, ep: int = 1) -> int:
        if self.num_experts and self.num_experts % ep:
            raise ValueError(f"{self.num_experts} experts do not split over EP={ep}")
        experts = self.experts // ep if self.num_experts else 0
        return (self.split + experts) // tp + self.replicated


@dataclasses.dataclass(frozen=True)
class ModelShape:
    family: str
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    layers: tuple[LayerShape, ...]
    topk: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_experts(self) -> int:
        return max((ly.num_experts for ly in self.layers), default=0)

    def stage_params(self, tp: int, pp: int, ep: int = 1) -> list[int]:
        """One rank of each pipeline stage (embedding on stage 0, final norm and output layer on the last)."""
        if self.num_layers % pp:
            raise ValueError(f"{self.num_layers} layers do not split over PP={pp}")
        if ep != 1 and not self.num_experts:
            raise ValueError("--ep > 1 needs a MoE model")
        per = self.num_layers // pp
        emb = self.vocab_size * self.hidden_size // tp
        stages = [sum(ly.params(tp, ep) for ly in self.layers[s * per:(s + 1) * per]) for s in range(pp)]
        stages[0] += emb
        stages[-1] += self.hidden_size + (emb if not self.tie_word_embeddings or pp > 1 else 0)
        return stages


def _gqa(h: int, heads: int, kv_heads: int, hd: int, *, bias: bool, qk_norm: bool, gate: bool = False) -> LayerShape:
    q, kv = heads * hd, kv_heads * hd
    split = h * ((2 if gate else 1) * q + 2 * kv) + (q + 2 * kv if bias else 0) + q * h
    return LayerShape("attention", split=split, replicated=2 * hd if qk_norm else 0, attn_width=float(q),
                      kv_bytes_per_token=2 * 2 * kv)


def _mla(cfg: dict[str, Any], h: int) -> LayerShape:
    n = int(cfg["num_attention_heads"])
    nope, rope, v = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    ql, kvl = int(cfg.get("q_lora_rank") or 0), int(cfg["kv_lora_rank"])
    q = h * ql + ql * n * (nope + rope) if ql else h * n * (nope + rope)
    kv = h * (kvl + rope) + kvl * n * (nope + v)
    # scores are n·(nope+rope) wide, the weighted sum n·v: their mean is the width of one "T² matmul pair"
    return LayerShape("mla", split=q + kv + n * v * h, replicated=ql + kvl, attn_width=n * (nope + rope + v) / 2,
                      kv_bytes_per_token=2 * (kvl + rope))


def _gdn(cfg: dict[str, Any], h: int) -> LayerShape:
    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    dk, dv, kern = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"]), int(cfg["linear_conv_kernel_dim"])
    conv = 2 * nk * dk + nv * dv
    split = h * (2 * nk * dk + 2 * nv * dv + 2 * nv) + nv * dv * h + conv * kern + 2 * nv
    # forward per token: state update and read-out (2 · 2·nv·dk·dv) and the chunk's intra-chunk products
    flops = 4.0 * nv * dk * dv + 2.0 * GDN_CHUNK * nv * (dk + dv)
    return LayerShape("linear", split=split, replicated=dv, state_bytes=4 * nv * dk * dv + 2 * conv * (kern - 1),
                      mixer_flops_per_token=flops)


def _mlp(h: int, ffn: int) -> LayerShape:
    return LayerShape("_", split=3 * h * ffn, replicated=0)


def _moe(h: int, experts: int, moe_ffn: int, shared_ffn: int = 0, shared_gate: bool = False) -> LayerShape:
    return LayerShape("_", split=3 * h * shared_ffn, replicated=h * experts + (h if shared_gate else 0),
                      experts=experts * 3 * h * moe_ffn, num_experts=experts)


def _layer(mixer: LayerShape, mlp: LayerShape, h: int) -> LayerShape:
    return dataclasses.replace(mixer, split=mixer.split + mlp.split, replicated=mixer.replicated + mlp.replicated + 2 * h,
                               experts=mlp.experts, num_experts=mlp.num_experts)


def _from_arch(arch) -> ModelShape:
    """The families :class:`ModelArch` describes (the learner builds them)."""
    h = arch.hidden_size
    if arch.kv_lora_rank:
        cfg = dict(num_attention_heads=arch.num_attention_heads, qk_nope_head_dim=arch.qk_nope_head_dim,
                   qk_rope_head_dim=arch.qk_rope_head_dim, v_head_dim=arch.v_head_dim, q_lora_rank=arch.q_lora_rank,
                   kv_lora_rank=arch.kv_lora_rank)
        mixer = _mla(cfg, h)
    else:
        mixer = _gqa(h, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim, bias=arch.qkv_bias,
                     qk_norm=arch.qk_layernorm)
    layers = []
    for i in range(arch.num_layers):
        if arch.num_experts and i >= arch.moe_first_k_dense:
            mlp = _moe(h, arch.num_experts, arch.moe_ffn_hidden_size, arch.moe_shared_expert_ffn_hidden_size)
        else:
            mlp = _mlp(h, arch.ffn_hidden_size)
        layers.append(_layer(mixer, mlp, h))
    return ModelShape(arch.family, h, arch.vocab_size, arch.tie_word_embeddings, tuple(layers), arch.moe_router_topk)


def _qwen3_5(cfg: dict[str, Any]) -> ModelShape:
    cfg = {**cfg, **(cfg.get("text_config") or {})}
    h, n = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or set(types) - {"full_attention", "linear_attention"}:
        raise ValueError(f"qwen3_5 layer_types must list {n} of 'full_attention' / 'linear_attention'")
    heads = int(cfg["num_attention_heads"])
    hd = int(cfg.get("head_dim") or h // heads)
    full = _gqa(h, heads, int(cfg.get("num_key_value_heads") or heads), hd, bias=bool(cfg.get("attention_bias")),
                qk_norm=True, gate=bool(cfg.get("attn_output_gate", True)))
    lin = _gdn(cfg, h)
    experts = int(cfg.get("num_experts") or 0)
    if experts:
        mlp = _moe(h, experts, int(cfg["moe_intermediate_size"]), int(cfg.get("shared_expert_intermediate_size") or 0),
                   shared_gate=bool(cfg.get("shared_expert_intermediate_size")))
    else:
        mlp = _mlp(h, int(cfg["intermediate_size"]))
    layers = tuple(_layer(full if t == "full_attention" else lin, mlp, h) for t in types)
    return ModelShape(cfg.get("model_type", "qwen3_5"), h, int(cfg["vocab_size"]),
                      bool(cfg.get("tie_word_embeddings", False)), layers, int(cfg.get("num_experts_per_tok") or 0))


def _deepseek_v3(cfg: dict[str, Any]) -> ModelShape:
    """``deepseek_v3`` (MLA + MoE; ``glm4_moe_lite`` goes through ModelArch, which the learner builds)."""
    h, n = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    k = int(cfg.get("first_k_dense_replace", 1))
    types = cfg.get("mlp_layer_types") or ["dense"] * k + ["sparse"] * (n - k)
    e, moe_ffn = int(cfg["n_routed_experts"]), int(cfg["moe_intermediate_size"])
    shared = moe_ffn * int(cfg.get("n_shared_experts") or 0)
    mixer = _mla(cfg, h)
    layers = tuple(_layer(mixer, _moe(h, e, moe_ffn, shared) if t == "sparse" else _mlp(h, int(cfg["intermediate_size"])),
                          h) for t in types)
    return ModelShape(cfg["model_type"], h, int(cfg["vocab_size"]), bool(cfg.get("tie_word_embeddings", False)), layers,
                      int(cfg["num_experts_per_tok"]))


def shape_of(model) -> ModelShape:
    """A :class:`ModelShape` from a ModelShape, a ModelArch or a Hugging Face config dict."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, dict):
        mt = model.get("model_type", "llama")
        if mt in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):
            return _qwen3_5(model)
        if mt == "deepseek_v3":
            return _deepseek_v3(model)
        from megatron_tsync.model.builder import ModelArch

        return _from_arch(ModelArch.from_hf_config(model))
    return _from_arch(model)
