"""GLM-4.7-Flash-style models (``model_type`` "glm4_moe_lite"): multi-latent attention and DeepSeek-V3-style MoE
on megatron-core's ``MLASelfAttention`` and MoE layer — the config mapping, the layer spec, the weight conversion.

A ``glm4_moe_lite`` decoder layer is

- **multi-latent attention** (DeepSeek-V2/V3): queries through a low-rank ``q_a_proj`` (H → q_lora_rank), an
  RMSNorm ``q_a_layernorm`` and ``q_b_proj`` (→ heads × (qk_nope_head_dim + qk_rope_head_dim)); keys and values
  from one compressed latent ``kv_a_proj_with_mqa`` (H → kv_lora_rank + qk_rope_head_dim), whose first part goes
  through ``kv_a_layernorm`` and ``kv_b_proj`` (→ heads × (qk_nope_head_dim + v_head_dim)) and whose last
  ``qk_rope_head_dim`` columns are a single rotary key shared by every head (the decoupled RoPE head). Softmax
  scale 1/√(qk_nope + qk_rope).
- an MLP: dense SwiGLU (``intermediate_size``) in the first layers (``mlp_layer_types`` "dense", transformers'
  spelling of DeepSeek's ``first_k_dense_replace``), else a MoE block: sigmoid router scores
  ``s = σ(x W_gᵀ)``; the selection uses ``s + b`` with ``b`` the per-expert ``e_score_correction_bias`` (selection
  only: the weights are the plain ``s`` of the chosen experts), first ``topk_group`` of ``n_group`` expert groups
  by the sum of each group's top-2 ``s + b``, then the top-k experts inside them; the k weights are normalised to
  sum to 1 and multiplied by ``routed_scaling_factor``; plus ``n_shared_experts`` shared experts (one SwiGLU of
  width ``n_shared_experts · moe_intermediate_size``) that every token goes through.

megatron-core 0.16.1 has each piece (``MLATransformerConfig``, ``moe_router_score_function="sigmoid"``,
``moe_router_enable_expert_bias``, ``moe_router_num_groups`` / ``moe_router_group_topk``,
``moe_router_topk_scaling_factor``, shared experts, ``moe_layer_freq`` as a 0/1 list); the local spec builds MLA
from megatron-core modules only (no Transformer Engine needed: ``get_gpt_layer_local_spec(multi_latent_attention=
True)``), with this module's two adjustments, made here and nowhere else:

- **Latent norms' epsilon.** transformers (and DeepSeek's reference code) build ``q_a_layernorm`` and
  ``kv_a_layernorm`` with the RMSNorm default ε = 1e-6, not the config's ``rms_norm_eps`` (GLM-4.7-Flash: 1e-5);
  megatron builds them with ``layernorm_epsilon``. :func:`layer_spec` gives them a norm that keeps ε = 1e-6.
- **Down-projections duplicated over TP.** The local spec makes ``linear_q_down_proj`` / ``linear_kv_down_proj``
  column-parallel; MLA then gathers their outputs over TP and uses the shared rope key (the last
  ``qk_rope_head_dim`` columns) at every rank for its own heads, but the gather's backward only splits: the rope
  key's gradient from the other ranks' heads is lost (float64 GRPO gradient at TP = 2: 4.5e-3 relative off one
  process, every parameter). :func:`layer_spec` gives them megatron's plain ``Linear``
  (``post_training.modelopt.layers``: replicated weights marked ``sequence_parallel``, so ``finalize_model_grads``
  sums their gradients over TP), the layout MLA takes with Transformer Engine's duplicated ``TELinear``; the rope
  key then comes through ``gather_from_sequence_parallel_region``, whose backward sums over TP. Conversion copies
  them whole on every TP rank.
- **RoPE layout.** With ``rope_interleave: true`` (GLM-4.7-Flash's and DeepSeek-V3's) transformers rotates the
  pairs (x0, x1), (x2, x3), ... and writes the result de-interleaved ([rotated evens; rotated odds]); megatron's
  MLA does the same (``multi_latent_attention`` in ``rope_utils``: de-interleave, then rotate-half), so the weights
  copy as they are. A config with ``rope_interleave: false`` (plain rotate-half in transformers) gets the rope rows
  of ``q_b_proj`` (per head) and ``kv_a_proj_with_mqa`` interleaved by the conversion, so that megatron's
  de-interleave restores transformers' order (the inverse on the way back: round trip bit-identical).

Routing, HF vs megatron: megatron's group score is the sum of each group's top ``topk // group_topk`` scores, HF's
of its top 2 — equal when ``topk = 2 · topk_group`` (DeepSeek-V3: 8 = 2 · 4), else refused; megatron always
normalises the sigmoid top-k weights (k > 1), so ``norm_topk_prob: false`` is refused. GLM-4.7-Flash
(``n_group`` 1) is ungrouped.

**The correction bias** is megatron's ``router.expert_bias``, a float32 buffer (not a parameter: it gets no
gradient and no optimizer state), converted both ways. DeepSeek-V3's aux-loss-free balancing moves it between steps
by ``±rate`` from the step's token counts per expert; megatron does that in ``finalize_model_grads`` with
``moe_router_bias_update_rate``. **Refused for now** (the rate is 0: the bias stays the checkpoint's): the update
itself is outside the loss and would be exact (integer counts summed over the step), but the counts are taken in
every grad-enabled forward, which the streaming learner also runs for trajectories it later drops, idle lockstep
microbatches and recomputation, so the counts would not be the step's tokens. Asking for a non-zero rate
(``moe_router_bias_update_rate``) is a one-line error at model build.

Weight layout (HF → megatron local spec, layer ``i`` → stage-local ``j``; TP: column-parallel rows / row-parallel
columns split as for the dense model; down-projections, latent norms and router replicated):

===========================================================  =================================================
``self_attn.q_a_proj.weight`` (q_lora, H)                     ``self_attention.linear_q_down_proj.weight``
``self_attn.q_a_layernorm.weight``                            ``self_attention.q_layernorm.weight``
``self_attn.q_b_proj.weight`` (n·(nope+rope), q_lora)         ``self_attention.linear_q_up_proj.weight`` (rope
                                                              rows permuted without rope_interleave)
``self_attn.q_proj.weight`` (no q_lora_rank)                  ``self_attention.linear_q_proj.weight`` (same)
``self_attn.kv_a_proj_with_mqa.weight`` (kv_lora+rope, H)     ``self_attention.linear_kv_down_proj.weight`` (same)
``self_attn.kv_a_layernorm.weight``                           ``self_attention.kv_layernorm.weight``
``self_attn.kv_b_proj.weight`` (n·(nope+v), kv_lora)          ``self_attention.linear_kv_up_proj.weight``
``self_attn.o_proj.weight``                                   ``self_attention.linear_proj.weight``
``mlp.gate.weight`` / ``mlp.gate.e_score_correction_bias``    ``mlp.router.weight`` / ``mlp.router.expert_bias``
``mlp.experts.{e}.*``                                         as Qwen3-MoE (model/moe.py)
``mlp.shared_experts.{gate,up,down}_proj.weight``             ``mlp.shared_experts.linear_fc{1,2}.weight``
``mlp.{gate,up,down}_proj.weight`` (dense layers)             ``mlp.linear_fc{1,2}.weight`` (as Llama)
===========================================================  =================================================

Not built yet (refused where a config asks): YaRN RoPE scaling, attention biases, a ``mlp_layer_types`` that is not
dense-then-sparse; packing / the KV-cached engine forward with MLA (megatron's MLA rotates positions 0..S-1 of the
microbatch: one unpacked sequence per forward is right), the TE spec (GPU runs take the local spec: not run on a
GPU yet; FP8 refused), grouped GEMM.
"""

from __future__ import annotations

from typing import Any

import torch

FAMILIES = ("glm4_moe_lite", "deepseek_v3")  # transformers' two modelings differ only in the config's spelling
LATENT_NORM_EPS = 1e-6  # transformers' Glm4MoeLiteRMSNorm(q_lora_rank) / (kv_lora_rank): the RMSNorm default

# TransformerConfig fields a caller may not change for an MLA family (beside moe.py's list).
_REFUSED = {
    "moe_router_bias_update_rate": (0.0, "the aux-loss-free expert-bias update (DeepSeek-V3 balancing) is not "
                                         "supported: its token counts would include the streaming learner's "
                                         "dropped, idle and recomputed forwards (the bias stays the checkpoint's)"),
    "moe_aux_loss_coeff": (0.0, "the load-balancing loss's gradient rides on the policy-loss backward, which "
                                "streaming scales by the trajectory's advantage coefficients (not exact)"),
    "moe_z_loss_coeff": (None, "the router z-loss's gradient rides on the policy-loss backward (not exact)"),
    "moe_expert_capacity_factor": (None, "token dropping couples the tokens of a microbatch (dropless only)"),
    "moe_input_jitter_eps": (None, "input jitter is random noise in the router (RL updates must be deterministic)"),
    "moe_router_enable_expert_bias": (True, "the checkpoint routes with its e_score_correction_bias"),
}


def is_mla(arch) -> bool:
    return arch.family in FAMILIES


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


def _rope_theta(cfg: dict[str, Any]) -> float:
    mt = cfg.get("model_type", "glm4_moe_lite")
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ValueError(f"{mt} rope {rope_type!r} is not supported (plain RoPE only; YaRN not built)")
    theta = cfg.get("rope_theta", rp.get("rope_theta"))
    return float(theta if theta is not None else 10000.0)


def _first_k_dense(cfg: dict[str, Any], layers: int) -> int:
    mt = cfg.get("model_type", "glm4_moe_lite")
    types = cfg.get("mlp_layer_types")
    if types is None:  # DeepSeek-V3's spelling
        k = int(cfg.get("first_k_dense_replace", 1))
        types = ["dense"] * k + ["sparse"] * (layers - k)
    types = list(types)
    k = types.count("dense")
    if len(types) != layers or types != ["dense"] * k + ["sparse"] * (layers - k):
        raise ValueError(f"{mt} mlp_layer_types {types} is not supported (the first k layers dense, "
                         "the rest sparse)")
    return k


def arch_fields_from_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every ModelArch field of a ``glm4_moe_lite`` or ``deepseek_v3`` config.json dict (transformers models both
    the same way: DeepSeek-V3 spells the dense layers ``first_k_dense_replace``); refuses what megatron cannot
    match."""
    mt = cfg.get("model_type", "glm4_moe_lite")
    if mt not in FAMILIES:
        raise ValueError(f"model_type {mt!r} is not a multi-latent-attention family {FAMILIES}")
    if cfg.get("attention_bias"):
        raise ValueError(f"{mt} with attention_bias=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{mt} hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    heads, layers = int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
    if int(cfg.get("num_key_value_heads") or heads) != heads:
        raise ValueError(f"{mt} num_key_value_heads must equal num_attention_heads (MLA has no GQA)")
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    topk, groups, topk_groups = int(cfg["num_experts_per_tok"]), int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1))
    if experts < 1 or not 1 <= topk <= experts:
        raise ValueError(f"{mt} num_experts_per_tok {topk} must be in [1, n_routed_experts={experts}]")
    if experts % groups or not 1 <= topk_groups <= groups:
        raise ValueError(f"{mt} n_group {groups} / topk_group {topk_groups} do not fit {experts} experts")
    if groups > 1 and topk != 2 * topk_groups:
        raise ValueError(f"{mt} grouped routing with num_experts_per_tok {topk} != 2·topk_group "
                         f"({topk_groups}): transformers scores a group by its top-2 experts, megatron by its "
                         "top topk/topk_group")
    if not cfg.get("norm_topk_prob", True) and topk > 1:
        raise ValueError(f"{mt} with norm_topk_prob=false is not supported (megatron's sigmoid router "
                         "always normalises the top-k weights)")
    nope, rope, v = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    if rope % 2:
        raise ValueError(f"{mt} qk_rope_head_dim {rope} must be even")
    moe_ffn = int(cfg["moe_intermediate_size"])
    return dict(
        family=mt, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        ffn_hidden_size=int(cfg["intermediate_size"]), num_layers=layers, num_attention_heads=heads,
        num_kv_heads=heads, head_dim=nope + rope, rope_theta=_rope_theta(cfg),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), tie_word_embeddings=bool(cfg.get("tie_word_embeddings")),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn, norm_topk_prob=True,
        q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v,
        rope_interleave=bool(cfg.get("rope_interleave", True)), moe_first_k_dense=_first_k_dense(cfg, layers),
        moe_router_num_groups=groups, moe_router_group_topk=topk_groups,
        moe_routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        moe_shared_expert_ffn_hidden_size=moe_ffn * int(cfg.get("n_shared_experts") or 0),
    )


def check_overrides(arch, overrides: dict[str, Any], precision=None) -> None:
    """Overrides that contradict the checkpoint or break exactness, and FP8: one-line ValueError."""
    if precision is not None and precision.fp8_format is not None:
        raise ValueError(f"--fp8-format {precision.fp8_format}: {arch.family} runs on megatron-core's local spec "
                         "(the Transformer Engine spec is not built yet for multi-latent attention), which has no FP8")
    for name, (allowed, why) in _REFUSED.items():
        if name in overrides and overrides[name] != allowed:
            raise ValueError(f"{name}={overrides[name]!r} is refused for {arch.family}: {why}; see "
                             "megatron_tsync/model/mla.py")
    for name, have in (("num_moe_experts", arch.num_experts), ("moe_router_topk", arch.moe_router_topk),
                       ("moe_ffn_hidden_size", arch.moe_ffn_hidden_size)):
        if name in overrides and overrides[name] != have:
            raise ValueError(f"{name}={overrides[name]} contradicts the checkpoint's config.json ({have})")


def transformer_config_fields(arch, tp: int, ep: int = 1) -> dict[str, Any]:
    """MLATransformerConfig fields of an MLA ``arch`` (plain RoPE, sigmoid grouped routing with a frozen bias)."""
    from megatron_tsync.model import moe

    fields = moe.transformer_config_fields(arch, tp, ep)
    k = arch.moe_first_k_dense
    fields.update(
        multi_latent_attention=True,
        q_lora_rank=arch.q_lora_rank or None,
        kv_lora_rank=arch.kv_lora_rank,
        qk_head_dim=arch.qk_nope_head_dim,
        qk_pos_emb_head_dim=arch.qk_rope_head_dim,
        v_head_dim=arch.v_head_dim,
        rope_type="rope",
        rotary_base=arch.rope_theta,
        rotary_scaling_factor=1.0,  # no YaRN: mscale 1, softmax scale 1/sqrt(nope + rope) as in transformers
        mscale=1.0,
        mscale_all_dim=0.0,
        qk_layernorm=True,  # builds MLA's q/kv latent norms (the local spec's IdentityOp otherwise)
        moe_layer_freq=[0] * k + [1] * (arch.num_layers - k),
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=arch.moe_router_num_groups if arch.moe_router_num_groups > 1 else None,
        moe_router_group_topk=arch.moe_router_group_topk if arch.moe_router_num_groups > 1 else None,
        moe_router_topk_scaling_factor=arch.moe_routed_scaling_factor,
        moe_shared_expert_intermediate_size=arch.moe_shared_expert_ffn_hidden_size or None,
        moe_shared_expert_overlap=False,
    )
    return fields


# --------------------------------------------------------------------------------------------------
# Layer spec
# --------------------------------------------------------------------------------------------------


def _latent_norm_class():
    """megatron's local RMSNorm (``WrappedTorchNorm``) with ε fixed at :data:`LATENT_NORM_EPS` (MLA builds its
    latent norms with ``eps=config.layernorm_epsilon``; transformers with the RMSNorm default)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    class LatentRMSNorm(WrappedTorchNorm):
        def __new__(cls, config, hidden_size, eps=LATENT_NORM_EPS, **kw):
            return WrappedTorchNorm.__new__(WrappedTorchNorm, config, hidden_size, LATENT_NORM_EPS, **kw)

    return LatentRMSNorm


_MLA_CORE_ATTENTION = None


def _core_attention_class():
    """SDPA core attention (``compat.attention.SDPAttention``) that accepts MLA's ``k_channels`` / ``v_channels``:
    megatron-core's local ``DotProductAttention`` takes neither (its MLA runs only with Transformer Engine's core
    attention), and its output width is heads × ``kv_channels``, where MLA's is heads × ``v_head_dim``. SDPA itself
    takes keys wider than values. This is the one local stand-in MLA needs on CPU."""
    global _MLA_CORE_ATTENTION
    if _MLA_CORE_ATTENTION is None:
        from megatron_tsync.model.compat.attention import _sdpa_attention_class

        base = _sdpa_attention_class()

        def __init__(self, *args, k_channels=None, v_channels=None, **kw):
            base.__init__(self, *args, **kw)
            if v_channels is not None:  # (sq, b, heads · v_head_dim / TP) out
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

        _MLA_CORE_ATTENTION = type("MLASDPAttention", (base,), {"__init__": __init__, "__module__": __name__})
    return _MLA_CORE_ATTENTION


def _fix_mla_without_te() -> None:
    """megatron-core 0.16.1's ``multi_latent_attention`` sets ``HAVE_TE = True`` when its import of
    ``megatron.core.extensions.transformer_engine`` succeeds, which it does without TE (``TELinear`` is then a
    placeholder, not a class), and then calls ``isinstance(linear_proj, TELinear)``: a TypeError at build. Without
    TE the flag is set False (the branch is TE's FP8 input saving)."""
    import megatron.core.transformer.multi_latent_attention as mla_mod

    if not isinstance(mla_mod.TELinear, type):
        mla_mod.HAVE_TE = False


def layer_spec(arch, precision, config):
    """(block spec, name) of the local spec, on CPU and (not run there yet) on GPU — the Transformer Engine spec is
    not built for MLA: one layer spec per global layer (dense first, then MoE),
    megatron-core's MLA with duplicated down-projections, the latent norms of :func:`_latent_norm_class` and the
    core attention of :func:`_core_attention_class`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.post_training.modelopt.layers import Linear

    from megatron_tsync.model import compat
    from megatron_tsync.model.compat.versions import _fix_moe_without_te

    check_overrides(arch, {}, precision)
    _fix_moe_without_te()
    _fix_mla_without_te()
    compat.allow_sequence_parallel_torch_norm()
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    norm, core = _latent_norm_class(), _core_attention_class()
    seen = set()
    for spec in block.layer_specs:
        if id(spec) in seen:  # dense and MoE layers share their spec objects
            continue
        seen.add(id(spec))
        attn = spec.submodules.self_attention.submodules
        attn.q_layernorm = attn.kv_layernorm = norm
        attn.core_attention = core
        attn.linear_q_down_proj = attn.linear_kv_down_proj = Linear  # duplicated over TP (module docstring)
    return block, "local"


def finish_model(model, arch, dtype: torch.dtype) -> None:
    """After ``GPTModel`` is built: float64 RoPE frequencies in every MLA layer's own rotary module (megatron-core
    computes them in float32), and the frozen correction bias's token counting switched off (:func:`_no_count`)."""
    from megatron_tsync.model import compat

    for layer in model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if getattr(router, "expert_bias", None) is not None:
            router._apply_expert_bias = _no_count
    if dtype == torch.float32:
        return
    inv = compat.rope_inv_freq(arch.qk_rope_head_dim, arch.rope_theta, dtype)
    for layer in model.decoder.layers:
        compat.set_rope_inv_freq(layer.self_attention, inv)


def _no_count(routing_map, padding_mask=None) -> None:
    """The router's ``_apply_expert_bias`` (per-expert token counts for the bias update) while the bias is frozen
    (update rate 0: the counts would move nothing). Skipping it also skips megatron's ``torch.compile`` of that
    function, ~10 s at a process's first training forward on CPU."""
    return None


# --------------------------------------------------------------------------------------------------
# Pure conversion (full HF tensors ⇄ one (TP, EP) rank's megatron tensors of one layer)
# --------------------------------------------------------------------------------------------------


def _rope_perm(arch) -> torch.Tensor:
    """Index of the HF rope row that each megatron rope row holds: identity for interleaved RoPE (megatron's MLA
    de-interleaves as transformers does); else the inverse of megatron's de-interleave (evens first, then odds)."""
    r = arch.qk_rope_head_dim
    if arch.rope_interleave:
        return torch.arange(r)
    return torch.argsort(torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)]))


def _permute_rope_rows(w: torch.Tensor, arch, *, per_head: bool, inverse: bool = False) -> torch.Tensor:
    """``w``'s rope rows in megatron's order (``inverse``: back to HF's). ``per_head``: (n·(nope+rope), ·) q
    rows, the last ``rope`` of each head; else (kv_lora + rope, ·), the last ``rope``."""
    perm = _rope_perm(arch)
    if inverse:
        perm = torch.argsort(perm)
    nope, r = arch.qk_nope_head_dim, arch.qk_rope_head_dim
    if per_head:
        x = w.reshape(arch.num_attention_heads, nope + r, *w.shape[1:])
        return torch.cat([x[:, :nope], x[:, nope:][:, perm]], dim=1).reshape(w.shape).contiguous()
    keep = w.shape[0] - r
    return torch.cat([w[:keep], w[keep:][perm]]).contiguous()


_ATTN = {  # megatron sub-name under self_attention. -> (HF name under self_attn., TP split: "col" | "row" | None)
    "linear_q_down_proj.weight": ("q_a_proj.weight", None),  # duplicated over TP (module docstring)
    "q_layernorm.weight": ("q_a_layernorm.weight", None),
    "linear_q_up_proj.weight": ("q_b_proj.weight", "col"),
    "linear_q_proj.weight": ("q_proj.weight", "col"),
    "linear_kv_down_proj.weight": ("kv_a_proj_with_mqa.weight", None),
    "kv_layernorm.weight": ("kv_a_layernorm.weight", None),
    "linear_kv_up_proj.weight": ("kv_b_proj.weight", "col"),
    "linear_proj.weight": ("o_proj.weight", "row"),
}
_ROPE_ROWS = {"linear_q_up_proj.weight": True, "linear_q_proj.weight": True, "linear_kv_down_proj.weight": False}


def _split(t: torch.Tensor, how: str | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    if how is None or tp_size == 1:
        return t.clone()
    dim = 0 if how == "col" else 1
    if t.shape[dim] % tp_size:
        raise ValueError(f"dimension {dim} of shape {tuple(t.shape)} is not divisible by TP={tp_size}")
    return t.chunk(tp_size, dim=dim)[tp_rank].clone()


def hf_to_megatron_layer(hf_state, arch, layer: int, h: str, m: str, *, tp_rank: int = 0, tp_size: int = 1,
                         ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """One layer's attention and MLP tensors (norms included) for this (TP, EP) rank; fresh copies."""
    from megatron_tsync.model import moe

    out = {m + "input_layernorm.weight": hf_state[h + "input_layernorm.weight"].clone(),
           m + "pre_mlp_layernorm.weight": hf_state[h + "post_attention_layernorm.weight"].clone()}
    skip = {"linear_q_proj.weight"} if arch.q_lora_rank else {"linear_q_down_proj.weight", "q_layernorm.weight",
                                                               "linear_q_up_proj.weight"}
    for sub, (hf_name, how) in _ATTN.items():
        if sub in skip:
            continue
        t = hf_state[h + "self_attn." + hf_name]
        if sub in _ROPE_ROWS:
            t = _permute_rope_rows(t, arch, per_head=_ROPE_ROWS[sub])
        out[m + "self_attention." + sub] = _split(t, how, tp_rank, tp_size)
    if layer < arch.moe_first_k_dense:
        gate, up = hf_state[h + "mlp.gate_proj.weight"], hf_state[h + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([_split(gate, "col", tp_rank, tp_size),
                                                      _split(up, "col", tp_rank, tp_size)])
        out[m + "mlp.linear_fc2.weight"] = _split(hf_state[h + "mlp.down_proj.weight"], "row", tp_rank, tp_size)
        return out
    out.update(moe.hf_to_megatron_layer(hf_state, arch, h, m, tp_rank=tp_rank, tp_size=tp_size,
                                        ep_rank=ep_rank, ep_size=ep_size))
    out[m + "mlp.router.expert_bias"] = hf_state[h + "mlp.gate.e_score_correction_bias"].clone()
    if arch.moe_shared_expert_ffn_hidden_size:
        s = h + "mlp.shared_experts."
        out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [_split(hf_state[s + "gate_proj.weight"], "col", tp_rank, tp_size),
             _split(hf_state[s + "up_proj.weight"], "col", tp_rank, tp_size)])
        out[m + "mlp.shared_experts.linear_fc2.weight"] = _split(hf_state[s + "down_proj.weight"], "row",
                                                                 tp_rank, tp_size)
    return out


def megatron_to_hf_layer(sub: str, t, h: str, arch, expert_offset: int = 0) -> dict[str, torch.Tensor]:
    """HF tensors of one megatron tensor ``sub`` (the name below ``decoder.layers.j.``) of an MLA layer; ``t`` is
    TP-gathered (``linear_fc1``: the list of per-rank [gate_r; up_r] shards)."""
    from megatron_tsync.model import moe

    if sub == "input_layernorm.weight":
        return {h + "input_layernorm.weight": t}
    if sub == "pre_mlp_layernorm.weight":
        return {h + "post_attention_layernorm.weight": t}
    if sub.startswith("self_attention."):
        name = sub[len("self_attention."):]
        if name not in _ATTN:
            raise KeyError(f"no Hugging Face name for megatron MLA parameter {sub!r}")
        if name in _ROPE_ROWS:
            t = _permute_rope_rows(t, arch, per_head=_ROPE_ROWS[name], inverse=True)
        return {h + "self_attn." + _ATTN[name][0]: t}
    if sub == "mlp.router.expert_bias":
        return {h + "mlp.gate.e_score_correction_bias": t}
    if sub in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
        p = h + ("mlp." if sub == "mlp.linear_fc1.weight" else "mlp.shared_experts.")
        halves = [s.chunk(2, dim=0) for s in (t if isinstance(t, list) else [t])]
        return {p + "gate_proj.weight": torch.cat([g for g, _ in halves]),
                p + "up_proj.weight": torch.cat([u for _, u in halves])}
    if sub == "mlp.linear_fc2.weight":
        return {h + "mlp.down_proj.weight": t}
    if sub == "mlp.shared_experts.linear_fc2.weight":
        return {h + "mlp.shared_experts.down_proj.weight": t}
    if moe.is_moe_param(sub):
        return moe.megatron_to_hf_layer(sub, t, h, expert_offset)
    raise KeyError(f"no Hugging Face name for megatron parameter {sub!r} of an MLA layer")


def drop_extra_layers(state: dict[str, torch.Tensor], arch) -> dict[str, torch.Tensor]:
    """Without the tensors of layers ≥ ``num_layers`` (GLM-4.7-Flash ships its multi-token-prediction layer as
    ``model.layers.47``; transformers ignores it too)."""
    def keep(k: str) -> bool:
        if not k.startswith("model.layers."):
            return True
        return int(k.split(".", 3)[2]) < arch.num_layers
    return {k: v for k, v in state.items() if keep(k)}


def hf_config_dict(arch, *, dtype: torch.dtype = torch.float32, extra: dict | None = None) -> dict:
    """config.json content of a ``glm4_moe_lite`` / ``deepseek_v3`` ``arch`` (via transformers' Glm4MoeLiteConfig /
    DeepseekV3Config)."""
    from transformers import DeepseekV3Config, Glm4MoeLiteConfig

    k, deepseek = arch.moe_first_k_dense, arch.family == "deepseek_v3"
    layer_kw = (dict(first_k_dense_replace=k) if deepseek else
                dict(mlp_layer_types=["dense"] * k + ["sparse"] * (arch.num_layers - k)))
    cfg = (DeepseekV3Config if deepseek else Glm4MoeLiteConfig)(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.ffn_hidden_size,
        moe_intermediate_size=arch.moe_ffn_hidden_size, num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_attention_heads,
        n_shared_experts=arch.moe_shared_expert_ffn_hidden_size // arch.moe_ffn_hidden_size,
        n_routed_experts=arch.num_experts, routed_scaling_factor=arch.moe_routed_scaling_factor,
        kv_lora_rank=arch.kv_lora_rank, q_lora_rank=arch.q_lora_rank or None,
        qk_rope_head_dim=arch.qk_rope_head_dim, v_head_dim=arch.v_head_dim, qk_nope_head_dim=arch.qk_nope_head_dim,
        n_group=arch.moe_router_num_groups, topk_group=arch.moe_router_group_topk,
        num_experts_per_tok=arch.moe_router_topk, norm_topk_prob=True,
        max_position_embeddings=arch.max_position_embeddings, rms_norm_eps=arch.rms_norm_eps,
        tie_word_embeddings=arch.tie_word_embeddings, rope_interleave=arch.rope_interleave,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta},
        **layer_kw,
    )
    d = cfg.to_diff_dict()
    d["architectures"] = ["DeepseekV3ForCausalLM" if deepseek else "Glm4MoeLiteForCausalLM"]
    for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group",
                "routed_scaling_factor", "n_shared_experts", "norm_topk_prob", "rope_interleave", "q_lora_rank",
                "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", *layer_kw):
        d[key] = getattr(cfg, key)
    d["first_k_dense_replace"] = k  # DeepSeek's spelling, for readers that expect it (vLLM)
    d["rope_theta"] = arch.rope_theta
    d["torch_dtype"] = d["dtype"] = str(dtype).replace("torch.", "")
    d.pop("transformers_version", None)
    d.pop("qk_head_dim", None)
    d.update(extra or {})
    return d
