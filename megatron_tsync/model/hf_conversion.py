"""Hugging Face (Llama / Qwen2 / Qwen3) ⇄ Megatron ``GPTModel`` weight conversion, exact (pure copies, no arithmetic).

Name and layout map (transformers → megatron-core local spec; verified against megatron-core 0.16.1):

==========================================================  =======================================================
``model.embed_tokens.weight`` (V, H)                         ``embedding.word_embeddings.weight`` rows split by TP
``model.layers.i.input_layernorm.weight``                    ``decoder.layers.j.input_layernorm.weight``
``model.layers.i.self_attn.{q,k,v}_proj.{weight,bias}``      ``decoder.layers.j.self_attention.linear_qkv.*`` fused
                                                             per KV group: [ng, (q_per_group + 2)·hd, H] =
                                                             q heads of group g, then k_g, then v_g; rows split by TP
``model.layers.i.self_attn.{q,k}_norm.weight`` (hd,)         ``...self_attention.{q,k}_layernorm.weight`` (Qwen3
                                                             QK-norm, per head: replicated over TP)
``model.layers.i.self_attn.o_proj.weight`` (H, nh·hd)        ``...self_attention.linear_proj.weight`` cols split by TP
``model.layers.i.post_attention_layernorm.weight``           ``decoder.layers.j.pre_mlp_layernorm.weight``
``model.layers.i.mlp.{gate,up}_proj.weight`` (F, H)          ``...mlp.linear_fc1.weight``: TP rank r holds
                                                             [gate_r; up_r] (each of gate/up split by rows)
``model.layers.i.mlp.down_proj.weight`` (H, F)               ``...mlp.linear_fc2.weight`` cols split by TP
``model.norm.weight``                                        ``decoder.final_layernorm.weight`` (last stage)
``lm_head.weight`` (absent when tied)                        ``output_layer.weight`` rows split by TP (last stage;
                                                             with tied embeddings it exists only when PP > 1 and
                                                             then holds a copy of the embedding)
==========================================================  =======================================================

``j`` is the stage-local layer index: with PP, stage ``p`` holds global layers ``offset .. offset + n - 1``
(``offset`` = ``layer_number - 1`` of its first layer). With the Transformer Engine spec (GPU) the two
pre-norms are fused into the following linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``);
:func:`load_hf_into_model` and :func:`megatron_to_hf` follow whichever names the model has.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from megatron_tsync.model.builder import ModelArch, unwrap

_LOCAL_TO_TE = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


# --------------------------------------------------------------------------------------------------
# Pure layout helpers (full, unsharded tensors)
# --------------------------------------------------------------------------------------------------


def _qkv_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """(nh·hd, *r), (ng·hd, *r), (ng·hd, *r) -> (ng·(q_per_group + 2)·hd, *r), grouped per KV head."""
    ng, hd = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    q = q.reshape(ng, -1, *rest)  # (ng, qpg·hd, *r)
    k = k.reshape(ng, hd, *rest)
    v = v.reshape(ng, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _qkv_split(qkv: torch.Tensor, arch: ModelArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_qkv_merge`."""
    ng, hd = arch.num_kv_heads, arch.head_dim
    qpg = arch.num_attention_heads // ng
    rest = qkv.shape[1:]
    g = qkv.reshape(ng, (qpg + 2) * hd, *rest)
    q, k, v = torch.split(g, [qpg * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _chunk(t: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    if t.shape[dim] % tp_size:
        raise ValueError(f"dimension {dim} of shape {tuple(t.shape)} is not divisible by TP={tp_size}")
    return t.chunk(tp_size, dim=dim)[tp_rank].clone()


def stage_layers(arch: ModelArch, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """(offset, count) of the global layers held by an evenly split pipeline stage."""
    if arch.num_layers % pp_size:
        raise ValueError(f"{arch.num_layers} layers cannot be split evenly over PP={pp_size}")
    n = arch.num_layers // pp_size
    return pp_rank * n, n


def hf_to_megatron(
    hf_state: dict[str, torch.Tensor],
    arch: ModelArch,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    layer_offset: int | None = None,
    num_local_layers: int | None = None,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> dict[str, torch.Tensor]:
    """This (TP, PP[, EP]) rank's megatron local-spec state dict from a full transformers state dict.

    ``layer_offset``/``num_local_layers`` override the even pipeline split (pass them from the model when it
    uses an uneven layout). Tensors are fresh copies in the dtype of ``hf_state``.
    """
    off, n = stage_layers(arch, pp_rank, pp_size)
    off = off if layer_offset is None else layer_offset
    n = n if num_local_layers is None else num_local_layers
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: dict[str, torch.Tensor] = {}
    col = lambda t: _chunk(t, 0, tp_rank, tp_size)  # noqa: E731  column-parallel / vocab-parallel rows
    row = lambda t: _chunk(t, 1, tp_rank, tp_size)  # noqa: E731  row-parallel input columns
    if first:
        out["embedding.word_embeddings.weight"] = col(hf_state["model.embed_tokens.weight"])
    for j in range(n):
        h, m = f"model.layers.{off + j}.", f"decoder.layers.{j}."
        if arch.family in ("qwen3_5", "qwen3_5_moe"):  # Gated DeltaNet hybrid (model/qwen35.py)
            from megatron_tsync.model import qwen35

            out.update(qwen35.hf_to_megatron_layer(hf_state, arch, off + j, h, m, tp_rank=tp_rank, tp_size=tp_size,
                                                   ep_rank=ep_rank, ep_size=ep_size))
            continue
        if arch.kv_lora_rank:  # multi-latent attention + its MLP (model/mla.py)
            from megatron_tsync.model import mla

            out.update(mla.hf_to_megatron_layer(hf_state, arch, off + j, h, m, tp_rank=tp_rank, tp_size=tp_size,
                                                ep_rank=ep_rank, ep_size=ep_size))
            continue
        out[m + "input_layernorm.weight"] = hf_state[h + "input_layernorm.weight"].clone()
        a = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = col(
            _qkv_merge(hf_state[a + "q_proj.weight"], hf_state[a + "k_proj.weight"], hf_state[a + "v_proj.weight"], arch)
        )
        if arch.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = col(
                _qkv_merge(hf_state[a + "q_proj.bias"], hf_state[a + "k_proj.bias"], hf_state[a + "v_proj.bias"], arch)
            )
        if arch.qk_layernorm:
            out[m + "self_attention.q_layernorm.weight"] = hf_state[a + "q_norm.weight"].clone()
            out[m + "self_attention.k_layernorm.weight"] = hf_state[a + "k_norm.weight"].clone()
        out[m + "self_attention.linear_proj.weight"] = row(hf_state[a + "o_proj.weight"])
        out[m + "pre_mlp_layernorm.weight"] = hf_state[h + "post_attention_layernorm.weight"].clone()
        if arch.num_experts:  # router + this EP rank's experts (model/moe.py)
            from megatron_tsync.model import moe

            out.update(moe.hf_to_megatron_layer(hf_state, arch, h, m, tp_rank=tp_rank, tp_size=tp_size,
                                                ep_rank=ep_rank, ep_size=ep_size))
            continue
        gate, up = hf_state[h + "mlp.gate_proj.weight"], hf_state[h + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([col(gate), col(up)], dim=0)
        out[m + "mlp.linear_fc2.weight"] = row(hf_state[h + "mlp.down_proj.weight"])
    if last:
        out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"].clone()
        if not arch.tie_word_embeddings:
            out["output_layer.weight"] = col(hf_state["lm_head.weight"])
        elif pp_size > 1:  # the last stage keeps its own copy of the tied embedding
            out["output_layer.weight"] = col(hf_state["model.embed_tokens.weight"])
    return out


def megatron_full_to_hf(full: dict[str, torch.Tensor], arch: ModelArch, layer_offset: int, tp_size: int,
                        expert_offset: int = 0):
    """TP-gathered stage tensors -> HF names. ``full['...linear_fc1.weight']`` is the list of per-rank shards.
    ``expert_offset``: global index of this EP rank's first expert (MoE)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        elif name == "output_layer.weight":
            if not arch.tie_word_embeddings:
                out["lm_head.weight"] = t
        elif name.startswith("decoder.layers."):
            j, sub = name[len("decoder.layers.") :].split(".", 1)
            h = f"model.layers.{int(j) + layer_offset}."
            if arch.family in ("qwen3_5", "qwen3_5_moe"):  # model/qwen35.py
                from megatron_tsync.model import qwen35

                out.update(qwen35.megatron_to_hf_layer(sub, t, h, arch, tp_size, expert_offset))
            elif arch.kv_lora_rank:  # model/mla.py
                from megatron_tsync.model import mla

                out.update(mla.megatron_to_hf_layer(sub, t, h, arch, expert_offset))
            elif sub == "input_layernorm.weight":
                out[h + "input_layernorm.weight"] = t
            elif sub == "pre_mlp_layernorm.weight":
                out[h + "post_attention_layernorm.weight"] = t
            elif sub.startswith("self_attention.linear_qkv."):
                kind = sub.rsplit(".", 1)[1]  # weight | bias
                q, k, v = _qkv_split(t, arch)
                for p, x in zip("qkv", (q, k, v)):
                    out[h + f"self_attn.{p}_proj.{kind}"] = x.contiguous()
            elif sub == "self_attention.linear_proj.weight":
                out[h + "self_attn.o_proj.weight"] = t
            elif sub in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
                out[h + f"self_attn.{sub[len('self_attention.')]}_norm.weight"] = t
            elif sub == "mlp.linear_fc1.weight":
                halves = [s.chunk(2, dim=0) for s in t]  # per TP rank: [gate_r; up_r]
                out[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves], dim=0)
                out[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves], dim=0)
            elif sub == "mlp.linear_fc2.weight":
                out[h + "mlp.down_proj.weight"] = t
            elif arch.num_experts and sub.startswith(("mlp.router.", "mlp.experts.")):
                from megatron_tsync.model import moe

                out.update(moe.megatron_to_hf_layer(sub, t, h, expert_offset))
            else:
                raise KeyError(f"no Hugging Face name for megatron parameter {name!r}")
        else:
            raise KeyError(f"no Hugging Face name for megatron parameter {name!r}")
    return out


# --------------------------------------------------------------------------------------------------
# Model-level API (uses megatron's parallel state)
# --------------------------------------------------------------------------------------------------


def _parallel_coords() -> tuple[int, int, int, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, 0, 1
    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
    )


def _ep_coords(arch: ModelArch) -> dict[str, int]:
    if not arch.num_experts:
        return {}
    from megatron_tsync.model import moe

    ep_rank, ep_size = moe.ep_coords()
    return {"ep_rank": ep_rank, "ep_size": ep_size}


def _converted_tensors(model):
    """(name, tensor) of everything conversion covers: the parameters and the routers' expert-bias buffers (the
    correction bias of sigmoid routing, model/mla.py: part of the checkpoint, not trained)."""
    yield from model.named_parameters()
    for n, b in model.named_buffers():
        if n.endswith("router.expert_bias"):
            yield n, b


def _local_param_names(model) -> dict[str, str]:
    """local-spec name -> the model's actual parameter name (TE fuses the pre-norms into the linears)."""
    names = {n for n, _ in _converted_tensors(model)}
    mapping = {}
    for n in names:
        canon = n
        for local, te in _LOCAL_TO_TE.items():
            if n.endswith(te):
                canon = n[: -len(te)] + local
        mapping[canon] = n
    return mapping


def _layer_offset(model) -> int:
    layers = model.decoder.layers
    return int(layers[0].layer_number) - 1 if len(layers) else 0


def load_hf_into_model(model, hf_state: dict[str, torch.Tensor], *, whole_model: bool = False) -> None:
    """Copy a full transformers state dict into this rank's (possibly DDP-wrapped) ``GPTModel`` stage.

    Uses the current megatron parallel state for the TP/PP coordinates and ``model.arch`` for the layout.
    Every parameter of the stage must be covered. Call it before building the optimizer: mixed-precision
    optimizers keep fp32 master copies that would not see the new values. ``whole_model``: the model holds every
    layer whatever the PP size (built with ``pipeline_model_parallel_size=1``, e.g. the OPD teacher); TP still applies.
    """
    m = unwrap(model)
    arch: ModelArch = m.arch
    tp_rank, tp_size, pp_rank, pp_size = _parallel_coords()
    if whole_model:
        pp_rank, pp_size = 0, 1
    local = hf_to_megatron(
        hf_state, arch, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
        layer_offset=_layer_offset(m), num_local_layers=len(m.decoder.layers),
        **_ep_coords(arch),
    )
    names = _local_param_names(m)
    params = dict(_converted_tensors(m))
    missing = sorted(set(names) - set(local))
    extra = sorted(set(local) - set(names))
    if missing or extra:
        raise KeyError(f"HF→megatron mismatch: model parameters without a source {missing}, unused {extra}")
    with torch.no_grad():
        for canon, t in local.items():
            p = params[names[canon]]
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"{names[canon]}: model shape {tuple(p.shape)} != converted {tuple(t.shape)}")
            p.copy_(t)


def _tp_gather(p: torch.Tensor, tp_size: int, group) -> torch.Tensor | list[torch.Tensor]:
    """Full tensor of a TP-sharded parameter (list of shards for fused gate/up)."""
    if tp_size == 1 or not getattr(p, "tensor_model_parallel", False):
        return p.detach()
    parts = [torch.empty_like(p) for _ in range(tp_size)]
    dist.all_gather(parts, p.detach().contiguous(), group=group)
    return parts


def megatron_to_hf(model, *, to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """The full transformers state dict of a (possibly TP/PP-sharded, DDP-wrapped) ``GPTModel``.

    Collective over the tensor- and pipeline-parallel groups: **every rank** must call it, and every rank
    returns the complete dict (TP shards are all-gathered, then each PP stage broadcasts its tensors to the
    other stages). Data-parallel replicas do not communicate (they already hold equal weights). Tensors
    keep the model's dtype and are moved to the CPU unless ``to_cpu=False``. No ``lm_head.weight`` when the
    embeddings are tied.
    """
    from megatron.core import parallel_state as ps

    m = unwrap(model)
    arch: ModelArch = m.arch
    tp_rank, tp_size, pp_rank, pp_size = _parallel_coords()
    tp_group = ps.get_tensor_model_parallel_group() if tp_size > 1 else None
    inverse = {v: k for k, v in _local_param_names(m).items()}
    full: dict[str, Any] = {}
    for name, p in _converted_tensors(m):
        canon = inverse[name]
        t = _tp_gather(p, tp_size, tp_group)
        if isinstance(t, list):
            dim = getattr(p, "partition_dim", 0)
            t = t if canon.endswith("linear_fc1.weight") else torch.cat(t, dim=dim)
        elif canon.endswith("linear_fc1.weight"):  # dense or expert fc1: [gate_r; up_r] per TP rank
            t = [t]
        full[canon] = t
    expert_offset = 0
    if arch.num_experts:
        from megatron_tsync.model import moe

        expert_offset = moe.expert_offset(arch)
    local_hf = megatron_full_to_hf(full, arch, _layer_offset(m), tp_size, expert_offset)
    local_hf = {k: (v.cpu() if to_cpu else v).clone() for k, v in local_hf.items()}
    if arch.num_experts:  # every EP rank gets the other ranks' experts
        local_hf = moe.ep_allgather(local_hf, to_cpu)
    if pp_size == 1:
        return local_hf
    return _pp_allgather(local_hf, pp_rank, pp_size, to_cpu)


def _pp_allgather(local: dict[str, torch.Tensor], pp_rank: int, pp_size: int, to_cpu: bool):
    """Every PP stage broadcasts its tensors to the others (metadata first, then one broadcast per tensor)."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    out = dict(local)
    for src_stage in range(pp_size):
        meta = [[(k, tuple(v.shape), v.dtype) for k, v in local.items()] if src_stage == pp_rank else None]
        dist.broadcast_object_list(meta, src=ranks[src_stage], group=group)
        for k, shape, dtype in meta[0]:
            buf = local[k].to(dev) if src_stage == pp_rank else torch.empty(shape, dtype=dtype, device=dev)
            dist.broadcast(buf, src=ranks[src_stage], group=group)
            if src_stage != pp_rank:
                out[k] = buf.cpu() if to_cpu else buf
    return out


# --------------------------------------------------------------------------------------------------
# HF folders
# --------------------------------------------------------------------------------------------------


def load_hf_state(path: str) -> dict[str, torch.Tensor]:
    """All tensors of ``path/model.safetensors`` or of the shards listed in ``model.safetensors.index.json``."""
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise ValueError(f"{index}: not a safetensors index (a JSON object with a 'weight_map' of tensor "
                             f"name -> shard file): {type(e).__name__}: {e}") from None
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for fn in files:
        full = os.path.join(path, fn)
        if not os.path.isfile(full):
            listed = f" (listed in {index})" if os.path.exists(index) else ""
            raise FileNotFoundError(f"{full}: no such file{listed}")
        try:
            state.update(load_file(full))
        except Exception as e:  # safetensors raises its own SafetensorError (not an OSError) on a bad header
            raise ValueError(f"{full}: not a valid safetensors file ({type(e).__name__}: {e})") from None
    return state


def load_hf_dir(path: str) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    """(architecture, full state dict) of a transformers Llama/Qwen2/Qwen3 folder. Tied checkpoints that still
    store ``lm_head.weight`` have it dropped."""
    arch = ModelArch.from_hf_dir(path)
    state = load_hf_state(path)
    if arch.family in ("qwen3_5", "qwen3_5_moe"):  # a multimodal checkpoint's text model (model/qwen35.py)
        from megatron_tsync.model import qwen35

        state = qwen35.text_state(state)
    if arch.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if arch.kv_lora_rank:  # GLM-4.7-Flash ships its MTP layer as one more model.layers.N
        from megatron_tsync.model import mla

        state = mla.drop_extra_layers(state, arch)
    if arch.num_experts:  # fused 3-D experts (transformers >= 5 save_original_format=False) -> per expert
        from megatron_tsync.model import moe

        state = moe.unfuse_hf_experts(state, arch)
    return arch, state


def hf_config_dict(arch: ModelArch, *, dtype: torch.dtype = torch.float32, extra: dict | None = None) -> dict:
    """config.json content for ``arch`` (via transformers' LlamaConfig / Qwen2Config / Qwen3Config).

    Llama-3.x RoPE scaling is written both as ``rope_scaling`` (what transformers < 5, vLLM and hub checkpoints
    read) and as transformers ≥ 5's ``rope_parameters``, with the same values.
    """
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if arch.family in ("qwen3_5", "qwen3_5_moe"):  # Gated DeltaNet hybrid (model/qwen35.py)
        from megatron_tsync.model import qwen35

        return qwen35.hf_config_dict(arch, dtype=dtype, extra=extra)
    if arch.kv_lora_rank:  # GLM-4.7-Flash style (model/mla.py)
        from megatron_tsync.model import mla

        return mla.hf_config_dict(arch, dtype=dtype, extra=extra)
    if arch.num_experts:  # Qwen3-MoE (model/moe.py)
        from megatron_tsync.model import moe

        return moe.hf_config_dict(arch, dtype=dtype, extra=extra)
    kw = dict(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        rope_theta=arch.rope_theta,
        rms_norm_eps=arch.rms_norm_eps,
        tie_word_embeddings=arch.tie_word_embeddings,
        max_position_embeddings=arch.max_position_embeddings,
    )
    if arch.qk_layernorm != (arch.family == "qwen3"):
        raise ValueError(f"{arch.family}: qk_layernorm={arch.qk_layernorm} has no Hugging Face config (Qwen3 only)")
    scaling = None
    if arch.rope_type == "llama3":
        if arch.family != "llama":
            raise ValueError(f"rope_type llama3 is a Llama-3.x scaling; {arch.family} configs do not carry it")
        scaling = {"rope_type": "llama3", "factor": arch.rope_factor, "low_freq_factor": arch.rope_low_freq_factor,
                   "high_freq_factor": arch.rope_high_freq_factor,
                   "original_max_position_embeddings": arch.rope_original_max_position_embeddings}
        kw["rope_scaling"] = dict(scaling)
    elif arch.rope_type != "default":
        raise ValueError(f"unsupported rope_type {arch.rope_type!r}")
    if arch.family in ("llama", "qwen3") and arch.qkv_bias:
        raise ValueError(f"{arch.family} has no q/k/v-only bias in transformers (attention_bias also biases o_proj)")
    if arch.family == "llama":
        cfg, cls_name = LlamaConfig(attention_bias=arch.qkv_bias, **kw), "LlamaForCausalLM"
    elif arch.family == "qwen2":
        if not arch.qkv_bias:
            raise ValueError("Qwen2 checkpoints always have q/k/v biases (arch.qkv_bias=False)")
        cfg, cls_name = Qwen2Config(**kw), "Qwen2ForCausalLM"
    elif arch.family == "qwen3":
        cfg, cls_name = Qwen3Config(attention_bias=arch.qkv_bias, **kw), "Qwen3ForCausalLM"
    else:
        raise ValueError(f"unsupported family {arch.family!r}")
    d = cfg.to_diff_dict()  # without the generic PretrainedConfig defaults (id2label, ...)
    d["architectures"] = [cls_name]
    d["head_dim"] = arch.head_dim
    d["rope_theta"] = arch.rope_theta  # transformers < 5 reads it here; ≥ 5 reads rope_parameters
    if scaling is not None:
        d["rope_scaling"] = scaling
    d["torch_dtype"] = d["dtype"] = str(dtype).replace("torch.", "")
    d.pop("transformers_version", None)
    d.update(extra or {})
    return d


_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def save_hf_dir(
    path: str,
    state: dict[str, torch.Tensor],
    arch: ModelArch,
    tokenizer_src: str | None = None,
    *,
    extra_config: dict | None = None,
    max_shard_bytes: int = 4 << 30,
) -> None:
    """Write a transformers folder: safetensors (sharded with an index above ``max_shard_bytes``), config.json
    and, from ``tokenizer_src``, the tokenizer files plus the special-token ids of its config.json."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
    if arch.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    extra = {}
    if tokenizer_src:
        src_cfg = os.path.join(tokenizer_src, "config.json")
        if os.path.exists(src_cfg):
            with open(src_cfg) as f:
                c = json.load(f)
            extra = {k: c[k] for k in _TOKEN_ID_KEYS if k in c}
        for fn in TOKENIZER_FILES:
            if os.path.exists(os.path.join(tokenizer_src, fn)) and os.path.abspath(tokenizer_src) != os.path.abspath(path):
                shutil.copyfile(os.path.join(tokenizer_src, fn), os.path.join(path, fn))
    extra.update(extra_config or {})
    dtype = next(iter(state.values())).dtype
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_dict(arch, dtype=dtype, extra=extra), f, indent=2, sort_keys=True)
    names = sorted(state)
    shards, cur, size = [], [], 0
    for k in names:
        nbytes = state[k].numel() * state[k].element_size()
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += nbytes
    shards.append(cur)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(state, os.path.join(path, "model.safetensors"), metadata=meta)
        return
    weight_map, total = {}, 0
    for i, keys in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: state[k] for k in keys}, os.path.join(path, fn), metadata=meta)
        for k in keys:
            weight_map[k] = fn
            total += state[k].numel() * state[k].element_size()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def transformers_logits(path: str, input_ids: torch.Tensor) -> torch.Tensor:
    """Reference logits of the HF folder ``path`` from ``transformers`` itself (AutoModelForCausalLM, float32, eager
    attention, CPU): (B, S) -> (B, S, V). What the conversion checks compare Megatron's logits with."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    with torch.no_grad():
        return hf(input_ids.cpu()).logits  # (B, S, V)
