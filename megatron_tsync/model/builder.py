"""Llama-, Qwen2- and Qwen3-family models as Megatron ``GPTModel``.

RMSNorm, SwiGLU, RoPE (plain, or Llama-3.x ``rope_type: llama3`` scaling), GQA, tied or untied embeddings, optional
QKV bias (Qwen2), per-head RMSNorm on queries and keys (Qwen3's QK-norm), ``head_dim`` independent of hidden/heads.
The layer spec is chosen by
capability: Transformer Engine's spec (with FP8 when asked) where TE is importable on a GPU, megatron-core's
local spec otherwise (always on CPU). Asking for FP8 where it cannot run is a clear error, never a crash deep
inside TE.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
import torch.nn.functional as F

from megatron_tsync.model import compat
from megatron_tsync.model.wrappers import unwrap  # noqa: F401 - re-exported (model.builder.unwrap)


@dataclasses.dataclass(frozen=True)
class ModelArch:
    """Architecture of a Llama/Qwen2/Qwen3-family decoder (the fields of a Hugging Face config we use)."""

    family: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "glm4_moe_lite" | "deepseek_v3" | "qwen3_5" | "qwen3_5_moe"
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 4096
    qk_layernorm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3 q_norm / k_norm)
    rope_type: str = "default"  # "default" (plain RoPE) | "llama3" (Llama 3.1/3.2 frequency scaling)
    rope_factor: float = 1.0  # llama3 only: the four rope_scaling values of the HF config
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    num_experts: int = 0  # MoE (Qwen3-MoE, model/moe.py): experts per layer; 0 = dense MLP
    moe_router_topk: int = 0  # experts per token
    moe_ffn_hidden_size: int = 0  # one expert's SwiGLU width (HF moe_intermediate_size)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    # multi-latent attention + DeepSeek-V3-style MoE (GLM-4.7-Flash, model/mla.py); 0 / defaults elsewhere
    q_lora_rank: int = 0  # 0: queries by one projection (no low-rank q)
    kv_lora_rank: int = 0  # > 0 marks an MLA model
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0  # the decoupled RoPE head, shared by every head's key
    v_head_dim: int = 0
    rope_interleave: bool = False  # HF rotates interleaved pairs (conversion permutes the rope rows)
    moe_first_k_dense: int = 0  # the first k layers have a dense MLP
    moe_router_num_groups: int = 1  # sigmoid grouped top-k: n_group / topk_group
    moe_router_group_topk: int = 1
    moe_routed_scaling_factor: float = 1.0
    moe_shared_expert_ffn_hidden_size: int = 0  # n_shared_experts · moe_intermediate_size
    # Qwen3.5 Gated DeltaNet hybrid (model/qwen35.py); empty / defaults elsewhere
    layer_types: tuple[str, ...] = ()  # per layer "linear_attention" | "full_attention"
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim · factor dims (megatron's rotary_percent)
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # a checkpoint's JSON gives a list

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArch":
        """From a transformers ``config.json`` dict (LlamaConfig, Qwen2Config or Qwen3Config)."""
        mt = cfg.get("model_type", "llama")
        if mt in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):  # Gated DeltaNet hybrid (qwen35.py)
            from megatron_tsync.model import qwen35

            return cls(**qwen35.arch_fields_from_hf_config(cfg))
        if mt == "glm4_moe":
            raise ValueError("model_type 'glm4_moe' (GLM-4.5) is not supported: its MoE is DeepSeek-V3's but its "
                             "attention is GQA with partial RoPE and q/k/v biases, not multi-latent attention "
                             "(glm4_moe_lite and deepseek_v3 are)")
        if mt in ("glm4_moe_lite", "deepseek_v3"):  # multi-latent attention + DeepSeek-V3-style MoE (model/mla.py)
            from megatron_tsync.model import mla

            return cls(**mla.arch_fields_from_hf_config(cfg))
        if mt == "qwen3_moe":  # Qwen3 attention + an MoE MLP in every layer (model/moe.py)
            from megatron_tsync.model import moe

            dense = cls.from_hf_config({**cfg, "model_type": "qwen3"})
            return dataclasses.replace(dense, family="qwen3_moe", **moe.arch_fields_from_hf_config(cfg))
        if mt not in ("llama", "qwen2", "qwen3"):
            raise ValueError(f"unsupported model_type {mt!r}: megatron_tsync converts 'llama', 'qwen2' and 'qwen3'")
        if mt == "qwen3" and cfg.get("use_sliding_window"):
            raise ValueError("Qwen3 with use_sliding_window=true is not supported (full causal attention only)")
        if mt in ("llama", "qwen3") and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
            raise ValueError(f"{mt} with attention_bias/mlp_bias=true is not supported: transformers then puts a bias "
                             "on o_proj (or on the MLP) too, which megatron's GPTModel has no field for without "
                             "biases on every linear layer")
        heads = cfg["num_attention_heads"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers ≥ 5 keeps it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            **_rope_scaling_fields(cfg),
            qk_layernorm=mt == "qwen3",
            family=mt,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=hd,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", mt == "qwen2")),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> "ModelArch":
        """From ``path/config.json``; every error names that file (and the missing field, or the JSON position)."""
        fn = os.path.join(path, "config.json")
        if not os.path.isfile(fn):
            raise FileNotFoundError(f"{fn}: no such file (a Hugging Face model folder holds config.json and "
                                    "model.safetensors)")
        try:
            with open(fn) as f:
                cfg = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{fn}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{fn}: expected a JSON object, got {type(cfg).__name__}")
        text = cfg.get("text_config") if cfg.get("model_type") in ("qwen3_5", "qwen3_5_moe") else None  # multimodal
        moe35 = str(cfg.get("model_type", "")).startswith("qwen3_5_moe")  # experts only: no intermediate_size
        missing = [k for k in _REQUIRED_HF_FIELDS if k not in (text if isinstance(text, dict) else cfg)
                   and not (moe35 and k == "intermediate_size")]
        if missing:
            raise ValueError(f"{fn}: missing field(s) {missing} (a Llama/Qwen2/Qwen3 config.json needs "
                             f"{', '.join(_REQUIRED_HF_FIELDS)})")
        try:
            return cls.from_hf_config(cfg)
        except KeyError as e:
            raise ValueError(f"{fn}: missing field {e.args[0]!r} (a Llama/Qwen2/Qwen3 config.json needs "
                             f"{', '.join(_REQUIRED_HF_FIELDS)})") from None
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ValueError(f"{fn}: {e}") from None


_REQUIRED_HF_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _rope_scaling_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelArch's rope_* fields from ``rope_scaling`` (transformers < 5, most hub configs) or ``rope_parameters``
    (transformers ≥ 5). Plain RoPE and ``llama3`` are supported; other types are refused."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return {}
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling {scaling!r}: rope_type {rope_type!r} is not supported "
                         "(plain RoPE and 'llama3' only)")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
               if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling {scaling!r} (llama3) lacks {missing}")
    return dict(
        rope_type="llama3",
        rope_factor=float(scaling["factor"]),
        rope_low_freq_factor=float(scaling["low_freq_factor"]),
        rope_high_freq_factor=float(scaling["high_freq_factor"]),
        rope_original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def rope_inv_freq(arch: ModelArch, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """The inverse frequencies (head_dim/2,) in ``dtype`` that replace megatron's float32 plain ones, or None where
    megatron's are already right (plain RoPE in float32). float64 models get frequencies computed in float64 from
    the base (megatron-core computes them in float32 whatever the parameters' dtype)."""
    if arch.rope_type == "default":
        return None if dtype == torch.float32 else compat.rope_inv_freq(arch.head_dim, arch.rope_theta, dtype)
    return compat.llama3_inv_freq(
        arch.head_dim, arch.rope_theta, factor=arch.rope_factor, low_freq_factor=arch.rope_low_freq_factor,
        high_freq_factor=arch.rope_high_freq_factor,
        original_max_position_embeddings=arch.rope_original_max_position_embeddings, dtype=dtype,
    )


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Numerics of the learner. ``params_dtype`` float64 is for CPU verification runs."""

    params_dtype: torch.dtype = torch.float32
    bf16: bool = False
    fp8_format: str | None = None  # None | "e4m3" | "hybrid" (TE only)
    fp8_recipe: str = "delayed"  # "delayed" | "tensorwise" | "mxfp8" (TE/hardware dependent)


def choose_layer_spec(precision: PrecisionConfig, *, qk_layernorm: bool = False):
    """TE spec when TE is usable (GPU), local spec otherwise. Returns (spec, name)."""
    te = compat.te_layer_spec(qk_layernorm=qk_layernorm)
    if precision.fp8_format is not None and te is None:
        raise ValueError(
            f"--fp8-format {precision.fp8_format} needs Transformer Engine on a GPU; "
            "it is not importable here (CPU runs use the local layer spec without FP8)"
        )
    if te is not None:
        return te, "transformer_engine"
    return compat.local_layer_spec(qk_layernorm=qk_layernorm), "local"


def transformer_config(arch: ModelArch, precision: PrecisionConfig, *, tp: int = 1, pp: int = 1, ep: int = 1,
                       **extra):
    """Megatron ``TransformerConfig`` for ``arch``. Dropout is 0: RL updates must be deterministic."""
    dtype = torch.bfloat16 if precision.bf16 else precision.params_dtype
    kw = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision.bf16,
        fp16=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        calculate_per_token_loss=True,  # DP sums; the trainer divides by its explicit denominator
        variable_seq_lengths=True,  # PP p2p sends shapes: trajectories differ in length
        moe_token_dispatcher_type="alltoall",  # "allgather" (the default) rejects variable lengths
        init_method_std=0.02,
    )
    if precision.fp8_format is not None:
        kw.update(fp8=precision.fp8_format, fp8_recipe=precision.fp8_recipe)
    config_class = None
    if arch.family in ("qwen3_5", "qwen3_5_moe"):
        from megatron_tsync.model import qwen35

        qwen35.check_overrides(arch, extra, precision)
        kw.update(qwen35.transformer_config_fields(arch, tp, ep))
    elif arch.kv_lora_rank:
        from megatron_tsync.model import mla

        mla.check_overrides(arch, extra, precision)
        kw.update(mla.transformer_config_fields(arch, tp, ep))
        config_class = "mla"
    elif arch.num_experts:
        from megatron_tsync.model import moe

        moe.check_overrides(arch, extra)
        kw.update(moe.transformer_config_fields(arch, tp, ep))
    kw.update(extra)
    if kw.get("recompute_granularity") and kw.get("moe_enable_routing_replay"):
        raise ValueError("router replay with activation recomputation is refused: the recomputed forward in the "
                         "backward would route by the router's own top-k, not the replayed experts")
    n = kw.get("recompute_num_layers")
    if n is not None and not 1 <= n <= arch.num_layers // pp:
        raise ValueError(f"--recompute-num-layers {n} must be between 1 and the layers of one pipeline stage "
                         f"({arch.num_layers} layers / PP {pp} = {arch.num_layers // pp})")
    cfg, unknown = compat.make_transformer_config(config_class=config_class, **kw)
    if unknown:
        import logging

        logging.getLogger(__name__).warning("TransformerConfig ignores unknown fields: %s", unknown)
    return cfg


def build_model(
    arch: ModelArch,
    precision: PrecisionConfig | None = None,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    seed: int | None = None,
    **config_overrides,
):
    """Build this rank's ``GPTModel`` stage (unwrapped). Parallel state must be initialised.

    float64 runs: the model is built under ``torch.set_default_dtype(torch.float64)`` (megatron's torch norm
    wrapper ignores ``params_dtype``) and RoPE's inverse frequencies are recomputed in float64 from the base
    (megatron-core computes them in float32; cast afterwards they are ~6e-8 off, log-probs ~1e-8–1e-7).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    precision = precision or PrecisionConfig()
    tp = ps.get_tensor_model_parallel_world_size()
    pp = config_overrides.get("pipeline_model_parallel_size", ps.get_pipeline_model_parallel_world_size())
    if arch.vocab_size % tp != 0:
        raise ValueError(f"vocab size {arch.vocab_size} must be divisible by TP={tp} (vocab-parallel embedding)")
    if arch.num_layers % pp != 0:
        raise ValueError(f"{arch.num_layers} layers cannot be split evenly over PP={pp} stages")
    ep = ps.get_expert_model_parallel_world_size()
    cfg = transformer_config(arch, precision, tp=tp, pp=pp, ep=ep, **config_overrides)
    spec = _layer_spec(arch, precision, cfg)
    pre = ps.is_pipeline_first_stage() if pre_process is None else pre_process
    post = ps.is_pipeline_last_stage() if post_process is None else post_process
    if seed is not None:
        torch.manual_seed(seed)
        compat.model_parallel_seed(seed)
    old = torch.get_default_dtype()
    float64 = precision.params_dtype == torch.float64
    if float64:
        torch.set_default_dtype(torch.float64)
    try:
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=spec,
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=arch.rope_theta,
            rotary_percent=arch.partial_rotary_factor,
            parallel_output=True,
        )
    finally:
        torch.set_default_dtype(old)
    if arch.kv_lora_rank:  # one rotary module per MLA layer
        from megatron_tsync.model import mla

        mla.finish_model(model, arch, torch.float64 if float64 else torch.float32)
    elif arch.family in ("qwen3_5", "qwen3_5_moe"):  # RoPE on the rotary dims only
        from megatron_tsync.model import qwen35

        qwen35.finish_model(model, arch, torch.float64 if float64 else torch.float32)
    elif (inv_freq := rope_inv_freq(arch, torch.float64 if float64 else torch.float32)) is not None:
        compat.set_rope_inv_freq(model, inv_freq)
    if torch.cuda.is_available():
        model = model.cuda()
    if cfg.sequence_parallel:
        pad_for_sequence_parallel(model, tp)
    model.arch = arch  # for conversion and engines
    return model


def _layer_spec(arch: ModelArch, precision: PrecisionConfig, cfg):
    """The family's transformer layer spec: Qwen3.5 hybrids (``qwen35``), MLA (``mla``), MoE (``moe``), dense."""
    if arch.family in ("qwen3_5", "qwen3_5_moe"):
        from megatron_tsync.model import qwen35

        return qwen35.layer_spec(arch, precision, cfg)[0]
    if arch.kv_lora_rank:
        from megatron_tsync.model import mla

        return mla.layer_spec(arch, precision, cfg)[0]
    if arch.num_experts:
        from megatron_tsync.model import moe

        return moe.layer_spec(arch, precision)[0]
    return choose_layer_spec(precision, qk_layernorm=arch.qk_layernorm)[0]


def pad_for_sequence_parallel(model, tp: int) -> None:
    """Sequence parallelism splits the sequence over the TP ranks, so it must be a multiple of TP long: pad every
    input at the end (token 0, positions continuing) and drop the padded positions' logits on the way out. Causal
    attention keeps the real positions' outputs — and so every log-prob and gradient — as without padding (the
    padding's own outputs get no loss). Every pipeline stage pads its inputs alike (a later stage's hidden states
    arrive padded and sequence-sharded; its token ids and positions only size RoPE); only the last stage has logits
    to cut. Packed microbatches (a mask or THD params) come padded already (``training.packing.layout_for`` with
    ``align`` a multiple of TP: a padding segment)."""

    def pad(module, args, kwargs):
        ids, pos, mask = (list(args) + [None] * 3)[:3]
        n = (-ids.shape[1]) % tp
        module._tsync_len = None if n == 0 else ids.shape[1]
        if n == 0:
            return None
        if mask is not None or kwargs.get("packed_seq_params") is not None or kwargs.get("inference_context"):
            raise ValueError(f"sequence parallelism: a masked, packed or cached forward must be a multiple of TP={tp} "
                             f"long (got {ids.shape[1]}; packing pads with training.packing.layout_for(align=TP))")
        step = torch.arange(1, n + 1, device=ids.device)
        ids = torch.cat([ids, ids.new_zeros(ids.shape[0], n)], dim=1)
        pos = torch.cat([pos, pos[:, -1:] + step], dim=1) if pos is not None else None
        return (ids, pos, None) + tuple(args[3:]), kwargs

    def unpad(module, args, out):
        n, module._tsync_len = module._tsync_len, None
        return out if n is None else out[:, :n]  # (B, S, V/tp) logits

    model._tsync_len = None
    model.register_forward_pre_hook(pad, with_kwargs=True)
    if model.post_process:  # earlier stages return sequence-sharded hidden states, passed on as they are
        model.register_forward_hook(unpad)
