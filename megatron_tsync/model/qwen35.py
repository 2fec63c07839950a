"""Qwen3.5-style dense hybrids (transformers ``qwen3_5`` / ``qwen3_5_text``): Gated DeltaNet linear-attention layers
mixed with gated full-attention layers — the config mapping, the layer spec, the weight conversion.

A layer is ``x + mixer(norm(x))`` then ``x + MLP(norm(x))`` (SwiGLU), where ``layer_types[i]`` picks the mixer:

- ``linear_attention`` — Gated DeltaNet (Yang et al. 2024): ``in_proj_qkv`` (H → 2·Hk·Dk + Hv·Dv), a causal
  depthwise ``conv1d`` (kernel ``linear_conv_kernel_dim``, no bias) + SiLU over [q; k; v], L2-normalised q/k, the
  gated delta rule (:mod:`megatron_tsync.model.gated_delta`) with ``g = −exp(A_log)·softplus(a + dt_bias)``,
  ``β = σ(b)`` from ``in_proj_a`` / ``in_proj_b`` (H → Hv), then ``RMSNorm(o)·SiLU(z)`` (``in_proj_z``, H → Hv·Dv;
  this norm is *not* zero-centred) and ``out_proj``. megatron-core's ``GatedDeltaNet`` module with this project's
  forward (:mod:`megatron_tsync.model.gdn_layer` says why).
- ``full_attention`` — GQA attention whose ``q_proj`` is twice as wide: per head [query; gate], the output is
  ``o·σ(gate)`` before ``o_proj`` (megatron's ``attention_output_gate``); per-head ``q_norm`` / ``k_norm``; RoPE on
  the first ``partial_rotary_factor · head_dim`` dims only (megatron's ``rotary_percent``). Qwen3.5's multimodal
  RoPE (``mrope_section``) gives three position streams (time, height, width) that are equal for text, where it is
  plain RoPE: text positions only here (no images or video).

``qwen3_5_moe`` (Qwen3.5-MoE): every layer's MLP is megatron-core's MoE layer — softmax router, top-k weights
renormalised (model/moe.py's Qwen3-MoE settings) — plus one shared expert scaled by ``σ(x·w_gate)``
(``moe_shared_expert_gate``). Expert parallelism works as for Qwen3-MoE; TP > 1 is refused (megatron's MoE layer
needs sequence parallelism there, which the linear-attention layers do not take).

Every RMSNorm but the gated one is zero-centred (``x/rms(x)·(1 + w)``, checkpoint weights around 0; megatron's
``layernorm_zero_centered_gamma``): the weights are copied bit for bit, never shifted by 1.

Weight layout (HF ``model.layers.i.`` → megatron ``decoder.layers.j.``; TP: column rows / row columns split):

=============================================================  =================================================
``self_attn.q_proj.weight`` (nh·2·hd, H), per head [q; gate]    ``self_attention.linear_qkv.weight``: per KV group
``self_attn.{k,v}_proj.weight``                                 [q heads; gate heads; k; v] (megatron's gated
                                                                layout), groups split by TP
``self_attn.{q,k}_norm.weight`` / ``o_proj.weight``              ``self_attention.{q,k}_layernorm`` / ``linear_proj``
``linear_attn.in_proj_{qkv,z,b,a}.weight``                      ``self_attention.in_proj.weight``: TP rank r holds
                                                                [q_r; k_r; v_r; z_r; b_r; a_r] (heads split by TP)
``linear_attn.conv1d.weight`` (C, 1, K)                         ``self_attention.conv1d.weight``: rank r [q_r; k_r; v_r]
``linear_attn.{A_log,dt_bias}`` (Hv,)                           ``self_attention.{A_log,dt_bias}`` split by TP
``linear_attn.norm.weight`` / ``out_proj.weight``                ``self_attention.out_norm`` (replicated) / ``out_proj``
``{input,post_attention}_layernorm.weight``, ``mlp.*``           as Llama (model/hf_conversion.py)
``mlp.gate.weight``, ``mlp.experts.{e}.*`` (MoE)                  as Qwen3-MoE (model/moe.py)
``mlp.shared_expert.{gate,up,down}_proj.weight``                 ``mlp.shared_experts.linear_fc{1,2}.weight``
``mlp.shared_expert_gate.weight`` (1, H)                         ``mlp.shared_experts.gate_weight``
=============================================================  =================================================

Checkpoints of the multimodal ``Qwen3_5ForConditionalGeneration`` (``model_type: qwen3_5``, the text config under
``text_config``, weights under ``model.language_model.``) are read as their text model (vision tower and MTP head
dropped); what is written back is the text-only ``Qwen3_5ForCausalLM`` folder (``model_type: qwen3_5_text``).

Not built (refused where asked): RoPE scaling, attention biases, sequence / context parallelism (so no TP > 1 for
``qwen3_5_moe``), FP8 and the Transformer Engine spec.
"""

from __future__ import annotations

from typing import Any

import torch

FAMILIES = ("qwen3_5", "qwen3_5_moe")
LINEAR, FULL = "linear_attention", "full_attention"

# TransformerConfig fields a caller may not set for this family (value allowed, why)
_REFUSED = {
    "sequence_parallel": (False, "sequence parallelism is not built for the linear-attention layers"),
    "context_parallel_size": (1, "context parallelism is not built for the linear-attention layers"),
}


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a ``qwen3_5`` / ``qwen3_5_moe`` (multimodal, ``text_config`` inside) or
    ``*_text`` dict."""
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{mt} config.json without a text_config object")
    tie = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return {**text, "model_type": mt + "_text", "tie_word_embeddings": tie}


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """``qwen3_5_moe``: every layer's MLP is softmax-routed experts (top-k renormalised) plus one shared expert
    scaled by a sigmoid gate (megatron's ``moe_shared_expert_gate``)."""
    experts, topk = int(cfg["num_experts"]), int(cfg["num_experts_per_tok"])
    if not 1 <= topk <= experts:
        raise ValueError(f"qwen3_5_moe num_experts_per_tok {topk} must be in [1, num_experts={experts}]")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if not shared:
        raise ValueError("qwen3_5_moe without shared_expert_intermediate_size is not supported")
    return dict(family="qwen3_5_moe", num_experts=experts, moe_router_topk=topk,
                moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=True,
                moe_shared_expert_ffn_hidden_size=shared,
                ffn_hidden_size=int(cfg.get("intermediate_size") or cfg["moe_intermediate_size"]))


def _layer_types(cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: every full_attention_interval-th layer is full attention
        interval = int(cfg.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    types = tuple(types)
    if len(types) != layers or set(types) - {LINEAR, FULL}:
        raise ValueError(f"qwen3_5 layer_types {list(types)} must name {layers} layers, each {LINEAR!r} or {FULL!r}")
    return types


def _rope(cfg: dict[str, Any], head_dim: int) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor); RoPE scaling refused."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ValueError(f"qwen3_5 rope_type {rope_type!r} is not supported (plain RoPE only)")
    theta = cfg.get("rope_theta", rp.get("rope_theta", 10000.0))
    factor = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    rot = int(head_dim * factor)
    if not 0 < rot <= head_dim or rot % 2:
        raise ValueError(f"qwen3_5 partial_rotary_factor {factor} gives {rot} rotary dims of head_dim {head_dim} "
                         "(must be even and > 0)")
    return float(theta), factor


def arch_fields_from_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every ModelArch field of a ``qwen3_5`` / ``qwen3_5_text`` config.json dict; refuses what is not built."""
    cfg = text_config(cfg)
    moe = cfg.get("model_type") == "qwen3_5_moe_text"
    if cfg.get("attention_bias"):
        raise ValueError("qwen3_5 with attention_bias=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"qwen3_5 hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    heads, layers = int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    theta, factor = _rope(cfg, head_dim)
    hk, hv = int(cfg.get("linear_num_key_heads", 16)), int(cfg.get("linear_num_value_heads", 32))
    if hv % hk:
        raise ValueError(f"qwen3_5 linear_num_value_heads {hv} must be a multiple of linear_num_key_heads {hk}")
    fields = dict(
        family="qwen3_5", vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        ffn_hidden_size=int(cfg.get("intermediate_size") or 0), num_layers=layers, num_attention_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)), qk_layernorm=True,
        layer_types=_layer_types(cfg, layers), partial_rotary_factor=factor,
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        linear_num_key_heads=hk, linear_num_value_heads=hv,
    )
    return {**fields, **(_moe_fields(cfg) if moe else {})}


def check_overrides(arch, overrides: dict[str, Any], precision=None) -> None:
    """Overrides and precisions this family cannot run: one-line ValueError."""
    if arch.num_experts:
        from megatron_tsync.model import moe

        moe.check_overrides(arch, overrides)
    if precision is not None and precision.fp8_format is not None:
        raise ValueError(f"--fp8-format {precision.fp8_format}: {arch.family} runs on megatron-core's local spec "
                         "(the Transformer Engine spec is not built for the Gated DeltaNet hybrid), which has no FP8")
    for name, (allowed, why) in _REFUSED.items():
        if name in overrides and overrides[name] != allowed:
            raise ValueError(f"{name}={overrides[name]!r} is refused for {arch.family}: {why} "
                             "(megatron_tsync/model/qwen35.py)")


def transformer_config_fields(arch, tp: int, ep: int = 1) -> dict[str, Any]:
    """TransformerConfig fields of a ``qwen3_5`` arch (megatron-core's gated-delta-net hybrid settings; with
    experts, model/moe.py's plus the gated shared expert)."""
    for what, n in (("linear_num_key_heads", arch.linear_num_key_heads),
                    ("linear_num_value_heads", arch.linear_num_value_heads),
                    ("num_key_value_heads", arch.num_kv_heads)):
        if n % tp:
            raise ValueError(f"qwen3_5 {what} {n} must be divisible by TP={tp}")
    moe_fields = {}
    if arch.num_experts:
        from megatron_tsync.model import moe

        if tp > 1:
            raise ValueError("qwen3_5_moe at TP > 1 is not built (megatron's MoE layer needs sequence parallelism, "
                             "which the linear-attention layers do not take): use expert parallelism")
        moe_fields = dict(moe.transformer_config_fields(arch, tp, ep),
                          moe_shared_expert_intermediate_size=arch.moe_shared_expert_ffn_hidden_size,
                          moe_shared_expert_gate=True, moe_shared_expert_overlap=False)
    return dict(
        moe_fields,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[1 if t == LINEAR else 0 for t in arch.layer_types],
        linear_conv_kernel_dim=arch.linear_conv_kernel_dim,
        linear_key_head_dim=arch.linear_key_head_dim,
        linear_value_head_dim=arch.linear_value_head_dim,
        linear_num_key_heads=arch.linear_num_key_heads,
        linear_num_value_heads=arch.linear_num_value_heads,
        attention_output_gate=True,
        layernorm_zero_centered_gamma=True,
        qk_layernorm=True,
    )


# --------------------------------------------------------------------------------------------------
# Layer spec
# --------------------------------------------------------------------------------------------------


def layer_spec(arch, precision, config):
    """(block spec of this pipeline stage, "local"): the local spec's full-attention layer with the output gate and
    zero-centred norms, and megatron's ``GatedDeltaNet`` (our forward) in the linear-attention layers."""
    import copy

    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_tsync.model import compat, gdn_layer

    check_overrides(arch, {"sequence_parallel": config.sequence_parallel,
                           "context_parallel_size": config.context_parallel_size}, precision)
    norm = gdn_layer.ZeroCenteredRMSNorm
    base = (compat.local_moe_layer_spec(arch.num_experts, qk_layernorm=True) if arch.num_experts
            else compat.local_layer_spec(qk_layernorm=True))
    full = copy.deepcopy(base)
    full.submodules.input_layernorm = full.submodules.pre_mlp_layernorm = norm
    attn = full.submodules.self_attention
    attn.module = gdn_layer.output_gated_self_attention_class()
    attn.submodules.q_layernorm = attn.submodules.k_layernorm = norm
    linear = copy.deepcopy(full)
    linear.submodules.self_attention = ModuleSpec(
        module=gdn_layer.GatedDeltaNetLayer,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=gdn_layer.PlainRMSNorm,
                                           out_proj=RowParallelLinear),
    )
    specs = [linear if t == LINEAR else full for t in arch.layer_types]
    offset = get_transformer_layer_offset(config)
    local = specs[offset:offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=norm), "local"


def finish_model(model, arch, dtype: torch.dtype) -> None:
    """float64 models: RoPE's inverse frequencies of the rotary dims computed in float64 (megatron: float32)."""
    from megatron_tsync.model import compat

    if dtype != torch.float32:
        compat.set_rope_inv_freq(model, compat.rope_inv_freq(rotary_dim(arch), arch.rope_theta, dtype))


def rotary_dim(arch) -> int:
    return int(arch.head_dim * arch.partial_rotary_factor)


# --------------------------------------------------------------------------------------------------
# Pure conversion (full HF tensors ⇄ one TP rank's megatron tensors of one layer)
# --------------------------------------------------------------------------------------------------


def _chunk(t: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    if t.shape[dim] % tp_size:
        raise ValueError(f"dimension {dim} of shape {tuple(t.shape)} is not divisible by TP={tp_size}")
    return t.chunk(tp_size, dim=dim)[tp_rank].clone()


def _gated_qkv_merge(q_gate, k, v, arch) -> torch.Tensor:
    """HF (nh·2·hd, H) per head [q; gate], (ng·hd, H), (ng·hd, H) → megatron (ng·(2·qpg + 2)·hd, H), per KV group
    [q heads; gate heads; k; v]."""
    nh, ng, hd = arch.num_attention_heads, arch.num_kv_heads, arch.head_dim
    rest = k.shape[1:]
    qg = q_gate.reshape(nh, 2, hd, *rest)
    q = qg[:, 0].reshape(ng, -1, *rest)  # (ng, qpg·hd, *r)
    gate = qg[:, 1].reshape(ng, -1, *rest)
    return torch.cat([q, gate, k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)], dim=1).reshape(-1, *rest)


def _gated_qkv_split(qkv, arch):
    """Inverse of :func:`_gated_qkv_merge`: (q_proj, k_proj, v_proj)."""
    nh, ng, hd = arch.num_attention_heads, arch.num_kv_heads, arch.head_dim
    qpg, rest = nh // ng, qkv.shape[1:]
    q, gate, k, v = torch.split(qkv.reshape(ng, (2 * qpg + 2) * hd, *rest), [qpg * hd, qpg * hd, hd, hd], dim=1)
    q_gate = torch.stack([q.reshape(nh, hd, *rest), gate.reshape(nh, hd, *rest)], dim=1)  # (nh, 2, hd, *r)
    return q_gate.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _in_proj_sizes(arch) -> list[int]:
    """Row counts of [q, k, v, z, b, a] in HF's full in_proj tensors."""
    kd = arch.linear_num_key_heads * arch.linear_key_head_dim
    vd = arch.linear_num_value_heads * arch.linear_value_head_dim
    hv = arch.linear_num_value_heads
    return [kd, kd, vd, vd, hv, hv]


def _linear_to_megatron(hf_state, arch, a: str, m: str, tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    sizes = _in_proj_sizes(arch)
    q, k, v = torch.split(hf_state[a + "in_proj_qkv.weight"], sizes[:3])
    parts = [q, k, v, hf_state[a + "in_proj_z.weight"], hf_state[a + "in_proj_b.weight"],
             hf_state[a + "in_proj_a.weight"]]
    conv = torch.split(hf_state[a + "conv1d.weight"], sizes[:3])
    s = m + "self_attention."
    return {
        s + "in_proj.weight": torch.cat([_chunk(p, 0, tp_rank, tp_size) for p in parts]),
        s + "conv1d.weight": torch.cat([_chunk(c, 0, tp_rank, tp_size) for c in conv]),
        s + "A_log": _chunk(hf_state[a + "A_log"], 0, tp_rank, tp_size),
        s + "dt_bias": _chunk(hf_state[a + "dt_bias"], 0, tp_rank, tp_size),
        s + "out_norm.weight": hf_state[a + "norm.weight"].clone(),
        s + "out_proj.weight": _chunk(hf_state[a + "out_proj.weight"], 1, tp_rank, tp_size),
    }


def hf_to_megatron_layer(hf_state, arch, layer: int, h: str, m: str, *, tp_rank: int = 0, tp_size: int = 1,
                         ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """One layer's tensors (norms, mixer, MLP) for this TP (and EP) rank; fresh copies."""
    out = {m + "input_layernorm.weight": hf_state[h + "input_layernorm.weight"].clone(),
           m + "pre_mlp_layernorm.weight": hf_state[h + "post_attention_layernorm.weight"].clone()}
    if arch.layer_types[layer] == LINEAR:
        out.update(_linear_to_megatron(hf_state, arch, h + "linear_attn.", m, tp_rank, tp_size))
    else:
        a, s = h + "self_attn.", m + "self_attention."
        qkv = _gated_qkv_merge(hf_state[a + "q_proj.weight"], hf_state[a + "k_proj.weight"],
                               hf_state[a + "v_proj.weight"], arch)
        out[s + "linear_qkv.weight"] = _chunk(qkv, 0, tp_rank, tp_size)
        out[s + "q_layernorm.weight"] = hf_state[a + "q_norm.weight"].clone()
        out[s + "k_layernorm.weight"] = hf_state[a + "k_norm.weight"].clone()
        out[s + "linear_proj.weight"] = _chunk(hf_state[a + "o_proj.weight"], 1, tp_rank, tp_size)
    if arch.num_experts:
        from megatron_tsync.model import moe

        out.update(moe.hf_to_megatron_layer(hf_state, arch, h, m, tp_rank=tp_rank, tp_size=tp_size,
                                            ep_rank=ep_rank, ep_size=ep_size))
        h, m = h + "mlp.shared_expert.", m + "mlp.shared_experts."
        out[m + "gate_weight"] = hf_state[h[:-len("shared_expert.")] + "shared_expert_gate.weight"].clone()
    else:
        h, m = h + "mlp.", m + "mlp."
    gate, up = hf_state[h + "gate_proj.weight"], hf_state[h + "up_proj.weight"]
    out[m + "linear_fc1.weight"] = torch.cat([_chunk(gate, 0, tp_rank, tp_size), _chunk(up, 0, tp_rank, tp_size)])
    out[m + "linear_fc2.weight"] = _chunk(hf_state[h + "down_proj.weight"], 1, tp_rank, tp_size)
    return out


def _per_rank(t: torch.Tensor, sizes: list[int], tp_size: int) -> list[torch.Tensor]:
    """A TP-gathered tensor whose every rank holds [part_0 / tp; part_1 / tp; ...] → the full parts."""
    local = [s // tp_size for s in sizes]
    ranks = [torch.split(r, local) for r in t.chunk(tp_size, dim=0)]
    return [torch.cat([r[i] for r in ranks]) for i in range(len(sizes))]


_LINEAR_PLAIN = {"A_log": "A_log", "dt_bias": "dt_bias", "out_norm.weight": "norm.weight",
                 "out_proj.weight": "out_proj.weight"}
_FULL_PLAIN = {"q_layernorm.weight": "q_norm.weight", "k_layernorm.weight": "k_norm.weight",
               "linear_proj.weight": "o_proj.weight"}


_MLP_PREFIX = {"mlp.": "mlp.", "mlp.shared_experts.": "mlp.shared_expert."}  # megatron → HF


def _mlp_to_hf(sub: str, t, h: str) -> dict[str, torch.Tensor] | None:
    """A dense MLP's or the shared expert's tensor (None for anything else)."""
    for mp, hp in _MLP_PREFIX.items():
        if sub == mp + "linear_fc1.weight":
            halves = [s.chunk(2, dim=0) for s in (t if isinstance(t, list) else [t])]
            return {h + hp + "gate_proj.weight": torch.cat([g for g, _ in halves]),
                    h + hp + "up_proj.weight": torch.cat([u for _, u in halves])}
        if sub == mp + "linear_fc2.weight":
            return {h + hp + "down_proj.weight": t}
    if sub == "mlp.shared_experts.gate_weight":
        return {h + "mlp.shared_expert_gate.weight": t}
    return None


def megatron_to_hf_layer(sub: str, t, h: str, arch, tp_size: int, expert_offset: int = 0) -> dict[str, torch.Tensor]:
    """HF tensors of one megatron tensor ``sub`` (the name below ``decoder.layers.j.``), TP-gathered
    (``linear_fc1``: the list of per-rank [gate_r; up_r] shards); ``expert_offset``: this EP rank's first expert."""
    if sub == "input_layernorm.weight":
        return {h + "input_layernorm.weight": t}
    if sub == "pre_mlp_layernorm.weight":
        return {h + "post_attention_layernorm.weight": t}
    mlp = _mlp_to_hf(sub, t, h)
    if mlp is not None:
        return mlp
    if arch.num_experts and sub.startswith(("mlp.router.", "mlp.experts.")):
        from megatron_tsync.model import moe

        return moe.megatron_to_hf_layer(sub, t, h, expert_offset)
    name = sub[len("self_attention."):] if sub.startswith("self_attention.") else None
    a, s = h + "linear_attn.", h + "self_attn."
    if name == "in_proj.weight":
        q, k, v, z, b, al = _per_rank(t, _in_proj_sizes(arch), tp_size)
        return {a + "in_proj_qkv.weight": torch.cat([q, k, v]), a + "in_proj_z.weight": z,
                a + "in_proj_b.weight": b, a + "in_proj_a.weight": al}
    if name == "conv1d.weight":
        return {a + "conv1d.weight": torch.cat(_per_rank(t, _in_proj_sizes(arch)[:3], tp_size))}
    if name in _LINEAR_PLAIN:
        return {a + _LINEAR_PLAIN[name]: t}
    if name == "linear_qkv.weight":
        q, k, v = _gated_qkv_split(t, arch)
        return {s + "q_proj.weight": q.contiguous(), s + "k_proj.weight": k.contiguous(),
                s + "v_proj.weight": v.contiguous()}
    if name in _FULL_PLAIN:
        return {s + _FULL_PLAIN[name]: t}
    raise KeyError(f"no Hugging Face name for megatron parameter {sub!r} of a qwen3_5 layer")


def text_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A multimodal checkpoint's text model: ``model.language_model.`` → ``model.``; the vision tower
    (``model.visual.``) and the multi-token-prediction head (``mtp.``) dropped. Text-only state: unchanged."""
    out = {}
    for k, v in state.items():
        if k.startswith(("model.visual.", "mtp.")):
            continue
        out["model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k] = v
    return out


def hf_config_dict(arch, *, dtype: torch.dtype = torch.float32, extra: dict | None = None) -> dict:
    """config.json content of a ``qwen3_5`` arch: transformers' Qwen3_5TextConfig (the text-only causal LM), or
    Qwen3_5MoeTextConfig."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    if arch.num_experts:
        cls, name = Qwen3_5MoeTextConfig, "Qwen3_5MoeForCausalLM"
        kw = dict(num_experts=arch.num_experts, num_experts_per_tok=arch.moe_router_topk,
                  moe_intermediate_size=arch.moe_ffn_hidden_size,
                  shared_expert_intermediate_size=arch.moe_shared_expert_ffn_hidden_size)
    else:
        cls, name, kw = Qwen3_5TextConfig, "Qwen3_5ForCausalLM", dict(intermediate_size=arch.ffn_hidden_size)
    cfg = cls(
        **kw, vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_kv_heads, head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps,
        tie_word_embeddings=arch.tie_word_embeddings, max_position_embeddings=arch.max_position_embeddings,
        linear_conv_kernel_dim=arch.linear_conv_kernel_dim, linear_key_head_dim=arch.linear_key_head_dim,
        linear_value_head_dim=arch.linear_value_head_dim, linear_num_key_heads=arch.linear_num_key_heads,
        linear_num_value_heads=arch.linear_num_value_heads, layer_types=list(arch.layer_types),
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta,
                         "partial_rotary_factor": arch.partial_rotary_factor},
    )
    d = cfg.to_dict()
    d["architectures"] = [name]
    d["torch_dtype"] = d["dtype"] = str(dtype).replace("torch.", "")
    d.pop("transformers_version", None)
    d.update(extra or {})
    return d
