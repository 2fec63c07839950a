"""Qwen3-MoE on megatron-core's MoE layer: the config mapping, the layer spec and the expert weight conversion.

A Qwen3-MoE decoder (``model_type`` "qwen3_moe") is Qwen3 attention (QK-norm, no QKV bias, ``head_dim`` from the
config) with every MLP replaced by a sparse MoE block: a router ``mlp.gate`` (E, H) and E SwiGLU experts of width
``moe_intermediate_size``; each token goes to its top-k experts.

Routing, HF vs megatron (``TopKRouter``, score function softmax):

- HF: ``p = softmax(x W_gᵀ)`` over all E experts in float32, take the top-k of ``p``; with ``norm_topk_prob`` the k
  weights are renormalised to sum to 1, without it they are the raw softmax probabilities.
- ``norm_topk_prob=True``  → ``moe_router_pre_softmax=False``: megatron takes the top-k of the logits and softmaxes
  those k logits — ``exp(l_i) / Σ_topk exp(l_j) = p_i / Σ_topk p_j``, the renormalised weights (equal up to float32
  rounding; the top-k of logits and of softmax probabilities are the same set).
- ``norm_topk_prob=False`` → ``moe_router_pre_softmax=True``: softmax over all experts, then top-k, no renormalising.

Experts run sequentially from the local spec on CPU (``moe_grouped_gemm=False``, ``SequentialMLP``); the Transformer
Engine spec on GPU also uses ``SequentialMLP`` (TE linears, same parameter names), so one conversion serves both.
Grouped GEMM (``TEGroupedMLP``: ``experts.linear_fc1.weight{e}``) is not wired up yet. Token dispatch is the
all-to-all dispatcher (the allgather dispatcher rejects variable sequence lengths).

**What each MoE option does to exactness** (streaming_math.md: every trajectory is its own microbatch; its backward
runs when it arrives and is later scaled by its group's advantage coefficients):

- **No load-balancing loss (``moe_aux_loss_coeff = 0``): supported, the only choice.** The router then gets its
  gradient from the policy loss only, which streams exactly like any other parameter (tested in float64).
- **Megatron's aux losses (``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``) and the z-loss: refused.** The term is
  computed per microbatch (= per trajectory, so ``aux_loss`` and ``seq_aux_loss`` are per-sequence losses), but its
  gradient is injected by ``MoEAuxLossAutoScaler`` *inside the same backward* as the policy loss. A streamed
  trajectory's backward is the vector h_i that the (P, Q, ρ) buckets later multiply by the group's advantage
  coefficients (α_g r_i + β_g): the aux-loss gradient would be weighted by the trajectory's advantage instead of by 1
  (in sync mode it is added once per microbatch with weight ``main_loss_backward_scale``). Exact support needs the
  aux term's gradient in its own backward straight into the batch accumulator (the "second backward" of §4, for KL):
  not built. Measured (float64 control in tests/model/test_qwen3_moe.py): ``seq_aux_loss`` 0.1 makes the streamed
  gradient differ from sync by 0.73 relative. ``global_aux_loss`` additionally keeps a running token count over
  the microbatches seen so far (``global_tokens_per_expert`` / ``ga_steps``), so a trajectory's term depends on the
  arrival order — not exact in any streaming scheme.
- **Token dropping (``moe_expert_capacity_factor``): refused.** Capacity is per expert over all tokens of a
  microbatch/rank and drops by score across them, coupling tokens (and, with packing or EP, trajectories).
  Dropless routing only.
- **Aux-loss-free expert bias (``moe_router_enable_expert_bias``): not offered.** It would be exact (integer token
  counts summed over the step, bias updated at the barrier, order-independent), but megatron allows it only with the
  sigmoid score function, and Qwen3-MoE routes with softmax and has no bias in its checkpoint.

Weight layout (HF checkpoint names — transformers ≥ 5 keeps experts fused in memory, ``mlp.experts.gate_up_proj``
(E, 2F, H) and ``mlp.experts.down_proj`` (E, H, F); both forms are read, the per-expert one is written):

===============================================================  ==================================================
``model.layers.i.mlp.gate.weight`` (E, H)                         ``decoder.layers.j.mlp.router.weight`` (replicated)
``model.layers.i.mlp.experts.{e}.{gate,up}_proj.weight`` (F, H)   ``...mlp.experts.local_experts.{e_l}.linear_fc1
                                                                  .weight``: [gate_r; up_r] of expert-TP rank r
``model.layers.i.mlp.experts.{e}.down_proj.weight`` (H, F)        ``...local_experts.{e_l}.linear_fc2.weight`` cols
                                                                  split by expert-TP
===============================================================  ==================================================

**Tensor parallelism.** Forward passes and training at TP > 1 are exact (logits tested at TP=2; float64 training at
TP=2 equals one process to ~1e-15). megatron's MoE layer needs sequence parallelism at TP > 1 (without it every
TP rank dispatches the same tokens to the experts and the expert weight gradients come out TP times too large:
measured exactly 2× at TP=2), so a MoE model at TP > 1 is built with ``sequence_parallel=True``. Two consequences,
both handled in ``model.builder`` / ``model.compat``: sequences must be a multiple of TP long (the model pads its
input at the end — causal attention: the real positions do not see the padding — and drops the padded positions'
logits: :func:`~megatron_tsync.model.builder.pad_for_sequence_parallel`), and the norms on sequence shards need their
gradients summed over TP (Transformer Engine's norms mark their weights ``sequence_parallel``; on CPU the torch norm
wrapper, which refuses sequence parallelism, is built through ``compat.allow_sequence_parallel_torch_norm`` that
marks them the same way). With PP > 1 every stage pads alike (a later stage receives the padded, sequence-sharded
hidden states; the last cuts the logits); a packed or shared-prefix microbatch is padded to a multiple of TP by a
padding segment (``training.packing.layout_for``, ``PrefixLayout.pad``); router replay hands each TP rank the routing
of its sequence shard (:func:`sequence_shard`), and each pipeline stage its own layers'. float64, tiny model, against
one process's sync gradient (stream-trajectory and sync, ``tests/training/test_moe_tp_pp.py``): TP=2 with packing,
with a shared prefix, with replay; PP=2 with replay; TP=2 × PP=2 with packing and replay: all ≤ 4e-14. OPD's
KV-kept turn forward and the teacher's (``model.incremental.IncrementalGPT``) pad each chunk alike, keep only the
real tokens' keys/values and shard a chunk's replayed routing by :func:`sequence_shard`: OPD at TP=2 (sync,
stream-trajectory, stream-turn, with replay) and the teacher equal one process (``tests/training/test_moe_ep_opd.py``).

**Expert parallelism.** Conversion, forward passes and training at EP > 1 are exact (tested at EP=2: float64
streamed = sync = one process to ~1e-15, ``tests/training/test_moe_ep.py``). Each MoE layer's all-to-all is a
collective over the EP ranks, which are data-parallel replicas streaming different trajectories; and a rank's
expert gradients hold the tokens of *every* EP rank's microbatch of that moment. So the learner runs in lockstep
(``model.parallel.ExpertLockstep``, ``training.stream_fb``): at each schedule point the ranks agree on a list of
slots, each with one gradient destination (a group's bucket at a reward, or the accumulator), and a rank with no
microbatch for a slot runs an idle one (2 tokens, zero loss) routed to that destination. Without one destination
per slot the expert gradients came out 0.6-1.6 relative off in stream-trajectory mode (sync and stream-group were
already right: everything goes to the accumulator there). The KL reference's and π_θ0's forward-only passes run in
lockstep too (idle forwards). ``--deterministic``: one trajectory part per slot over the EP group, each rank's
backward of it into that trajectory's canonical vector (``training.stream_fb``), forward-only passes one real
microbatch per slot as well (a GEMM's rounding of a row may depend on its neighbours); bitwise for any arrival
order (tested, float64 and a live float32 pair). The OPD learner keeps them in lockstep too: idle microbatches in
``sync`` / ``stream-trajectory``, lanes of matched turn forwards and one backward per lane in ``stream-turn``
(``training.opd_lanes``; tested at EP=2, ``tests/training/test_moe_ep_opd.py``).

**Router replay** (``--moe-router-replay``; megatron-core's ``RouterReplay``, build with
``moe_enable_routing_replay=True``): the embedded engine records the experts of every position it computes, in the
forward that first computed it (prefill for the prompt, the decode step for each generated token; a tool result at
the next turn's prefill), the agent loop keeps them across turns, the trajectory event carries them, and the
learner's training and π_θ0 forwards (and the OPD learner's, turn by turn in ``stream-turn``; not the
teacher's, a different model) route every token to those experts (:func:`microbatch_routing`,
:class:`replay_microbatch`). Positions no engine computed (the last token, a final tool result) and packing padding
route to experts 0..k-1: no scored log-prob depends on them. With ``--shared-prefix`` the prompt, run once for the
group's members in its microbatch, replays the engine's prefill routing (:func:`shared_prefix_routing`), and each
continuation its own trajectory's; the engine prefills every member's prompt, and a member whose prompt routes
otherwise (float rounding of a differently composed batch can flip a near-tie: measured with a bf16 engine, 7 of 960
(position, layer) pairs when the same prompt was prefilled beside others) is kept out of that prefix
(``training.packing.plan_shared_prefix``; counted as ``shared_prefix_routing_split``) and runs unshared with its own
routing. The vLLM adapter records routing too (``record_routing``: vLLM's ``enable_return_routed_experts``, model
runner V2, on GPU; not run yet); vLLM's CPU build cannot (V2 needs Triton), so the adapter refuses there.

EP rank ``q`` of size ``ep`` holds the global experts ``e = q · E/ep + e_l`` (megatron's contiguous split); the expert
tensor-parallel size equals TP. Supported HF configs: ``decoder_sparse_step`` 1 and no ``mlp_only_layers`` (every
layer sparse, as in every released Qwen3-MoE), no sliding window.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megatron_tsync.model.wrappers import unwrap

# TransformerConfig fields whose non-default values break streaming exactness (see the module docstring).
_REFUSED = {
    "moe_aux_loss_coeff": (0.0, "the load-balancing loss's gradient rides on the policy-loss backward, which "
                                "streaming scales by the trajectory's advantage coefficients (not exact)"),
    "moe_z_loss_coeff": (None, "the router z-loss's gradient rides on the policy-loss backward (not exact)"),
    "moe_expert_capacity_factor": (None, "token dropping couples the tokens of a microbatch (dropless only)"),
    "moe_router_enable_expert_bias": (False, "Qwen3-MoE routes with softmax and has no expert bias"),
    "moe_input_jitter_eps": (None, "input jitter is random noise in the router (RL updates must be deterministic)"),
}
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


def arch_fields_from_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelArch's MoE fields from a Qwen3MoeConfig ``config.json`` dict; refuses layouts it cannot build."""
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not num_experts or num_experts < 1:
        raise ValueError("qwen3_moe config without num_experts")
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    if step != 1:
        raise ValueError(f"qwen3_moe decoder_sparse_step {step} is not supported (every layer sparse only)")
    if cfg.get("mlp_only_layers"):
        raise ValueError(f"qwen3_moe mlp_only_layers {cfg['mlp_only_layers']} is not supported (every layer sparse)")
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("shared experts are not supported (Qwen3-MoE has none)")
    topk = int(cfg.get("num_experts_per_tok", 0))
    if not 1 <= topk <= num_experts:
        raise ValueError(f"qwen3_moe num_experts_per_tok {topk} must be in [1, num_experts={num_experts}]")
    return dict(num_experts=int(num_experts), moe_router_topk=topk,
                moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def check_overrides(arch, overrides: dict[str, Any]) -> None:
    """``build_model`` / ``transformer_config`` overrides that contradict the checkpoint or break exactness."""
    for name, (allowed, why) in _REFUSED.items():
        if name in overrides and overrides[name] != allowed:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{name}={overrides[name]!r} ({flag}) is refused: {why}; see megatron_tsync/model/moe.py")
    for name, have in (("num_moe_experts", arch.num_experts), ("moe_router_topk", arch.moe_router_topk),
                       ("moe_ffn_hidden_size", arch.moe_ffn_hidden_size)):
        if name in overrides and overrides[name] != have:
            raise ValueError(f"{name}={overrides[name]} contradicts the checkpoint's config.json ({have})")


def transformer_config_fields(arch, tp: int, ep: int = 1) -> dict[str, Any]:
    """TransformerConfig fields of a MoE ``arch`` (dropless, no aux loss, sequential experts, expert-TP = TP)."""
    if arch.num_experts % ep:
        raise ValueError(f"{arch.num_experts} experts cannot be split evenly over --expert-model-parallel-size {ep}")
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.moe_router_topk,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
        moe_expert_capacity_factor=None,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall",
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_tensor_parallel_size=tp,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1,  # megatron's MoE layer needs it at TP > 1 (module docstring)
    )


def layer_spec(arch, precision):
    """(spec, name): Transformer Engine MoE spec where TE is usable (GPU), the local spec otherwise."""
    from megatron_tsync.model import compat

    te = compat.te_layer_spec(qk_layernorm=arch.qk_layernorm, num_experts=arch.num_experts)
    if precision.fp8_format is not None and te is None:
        raise ValueError(f"--fp8-format {precision.fp8_format} needs Transformer Engine on a GPU")
    if te is not None:
        return te, "transformer_engine"
    return compat.local_moe_layer_spec(arch.num_experts, qk_layernorm=arch.qk_layernorm), "local"


# --------------------------------------------------------------------------------------------------
# Pure conversion (full, unsharded HF tensors ⇄ one (TP, EP) rank's megatron tensors of one layer)
# --------------------------------------------------------------------------------------------------


def hf_expert(hf_state: dict[str, torch.Tensor], prefix: str, e: int, arch) -> tuple[torch.Tensor, ...]:
    """(gate (F, H), up (F, H), down (H, F)) of expert ``e`` under ``prefix`` = ``model.layers.i.``; reads the
    per-expert checkpoint names or transformers ≥ 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj``."""
    p = f"{prefix}mlp.experts."
    if f"{p}{e}.gate_proj.weight" in hf_state:
        return tuple(hf_state[f"{p}{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))
    gate_up = hf_state[p + "gate_up_proj"][e]  # (2F, H): gate rows first (transformers' Concatenate(dim=1))
    f = arch.moe_ffn_hidden_size
    return gate_up[:f], gate_up[f:], hf_state[p + "down_proj"][e]


def hf_to_megatron_layer(hf_state, arch, hf_prefix: str, m_prefix: str, *, tp_rank: int = 0, tp_size: int = 1,
                         ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """Router and this EP rank's experts of one layer, expert-TP-sharded like the dense MLP (fresh copies)."""
    if arch.num_experts % ep_size:
        raise ValueError(f"{arch.num_experts} experts cannot be split evenly over EP={ep_size}")
    n_local = arch.num_experts // ep_size
    out = {m_prefix + "mlp.router.weight": hf_state[hf_prefix + "mlp.gate.weight"].clone()}
    for e_local in range(n_local):
        gate, up, down = hf_expert(hf_state, hf_prefix, ep_rank * n_local + e_local, arch)
        for t, dim in ((gate, 0), (down, 1)):
            if t.shape[dim] % tp_size:
                raise ValueError(f"moe_ffn_hidden_size {t.shape[dim]} is not divisible by TP={tp_size}")
        q = f"{m_prefix}mlp.experts.local_experts.{e_local}."
        out[q + "linear_fc1.weight"] = torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]])
        out[q + "linear_fc2.weight"] = down.chunk(tp_size, 1)[tp_rank].clone()
    return out


def is_moe_param(sub: str) -> bool:
    """``sub`` (the name below ``decoder.layers.j.``) is a router or expert parameter."""
    return sub.startswith(("mlp.router.", "mlp.experts."))


def megatron_to_hf_layer(sub: str, t, hf_prefix: str, expert_offset: int = 0) -> dict[str, torch.Tensor]:
    """HF tensors of one router/expert parameter. ``t``: the full tensor, or for ``linear_fc1`` the list of its
    expert-TP shards; ``expert_offset``: the global index of this EP rank's first expert."""
    if sub == "mlp.router.weight":
        return {hf_prefix + "mlp.gate.weight": t}
    m = _EXPERT.match(sub)
    if m is None:
        raise KeyError(f"no Hugging Face name for megatron MoE parameter {sub!r}")
    q = f"{hf_prefix}mlp.experts.{expert_offset + int(m.group(1))}."
    if m.group(2) == "linear_fc2":
        return {q + "down_proj.weight": t}
    halves = [s.chunk(2, dim=0) for s in (t if isinstance(t, list) else [t])]
    return {q + "gate_proj.weight": torch.cat([g for g, _ in halves]),
            q + "up_proj.weight": torch.cat([u for _, u in halves])}


def unfuse_hf_experts(state: dict[str, torch.Tensor], arch) -> dict[str, torch.Tensor]:
    """transformers ≥ 5 in-memory state (fused 3-D experts) → checkpoint names (one tensor per expert and proj)."""
    out = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.down_proj"):
            continue
        if k.endswith("mlp.experts.gate_up_proj"):
            prefix = k[: -len("mlp.experts.gate_up_proj")]
            for e in range(arch.num_experts):
                for name, t in zip(("gate", "up", "down"), hf_expert(state, prefix, e, arch)):
                    out[f"{prefix}mlp.experts.{e}.{name}_proj.weight"] = t.contiguous().clone()
            continue
        out[k] = v
    return out


# --------------------------------------------------------------------------------------------------
# Model-level helpers (megatron's parallel state)
# --------------------------------------------------------------------------------------------------


def ep_coords() -> tuple[int, int]:
    """(EP rank, EP size) from megatron's parallel state; (0, 1) when it is not initialised."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()


def ep_allgather(local: dict[str, torch.Tensor], to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """Every EP rank sends the expert tensors it holds (global HF names) to the others; other tensors are
    replicated over EP already and kept as they are. Collective over the expert-model-parallel group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    _, ep_size = ep_coords()
    if ep_size == 1:
        return local
    group = ps.get_expert_model_parallel_group()
    mine = {k: v for k, v in local.items() if ".mlp.experts." in k}
    gathered: list = [None] * ep_size
    dist.all_gather_object(gathered, sorted((k, tuple(v.shape), v.dtype) for k, v in mine.items()), group=group)
    dev = next(iter(mine.values())).device if mine else torch.device("cpu")
    out = dict(local)
    rank = ps.get_expert_model_parallel_rank()
    ranks = dist.get_process_group_ranks(group)
    for src, meta in enumerate(gathered):
        for k, shape, dtype in meta:
            buf = mine[k].contiguous() if src == rank else torch.empty(shape, dtype=dtype, device=dev)
            dist.broadcast(buf, src=ranks[src], group=group)
            if src != rank:
                out[k] = buf.cpu() if to_cpu else buf
    return out


def expert_offset(arch) -> int:
    """Global index of this EP rank's first expert."""
    ep_rank, ep_size = ep_coords()
    return ep_rank * (arch.num_experts // ep_size)


def hf_config_dict(arch, *, dtype: torch.dtype = torch.float32, extra: dict | None = None) -> dict:
    """config.json content of a Qwen3-MoE ``arch`` (via transformers' Qwen3MoeConfig)."""
    from transformers import Qwen3MoeConfig

    if arch.rope_type != "default":
        raise ValueError(f"rope_type {arch.rope_type!r}: Qwen3-MoE configs carry plain RoPE only")
    cfg = Qwen3MoeConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_kv_heads, head_dim=arch.head_dim, rope_theta=arch.rope_theta,
        rms_norm_eps=arch.rms_norm_eps, tie_word_embeddings=arch.tie_word_embeddings,
        max_position_embeddings=arch.max_position_embeddings, attention_bias=arch.qkv_bias,
        num_experts=arch.num_experts, num_experts_per_tok=arch.moe_router_topk,
        moe_intermediate_size=arch.moe_ffn_hidden_size, norm_topk_prob=arch.norm_topk_prob,
        decoder_sparse_step=1, mlp_only_layers=[],
    )
    d = cfg.to_diff_dict()
    d["architectures"] = ["Qwen3MoeForCausalLM"]
    for k in ("head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers"):
        d[k] = getattr(cfg, k)
    d.pop("num_local_experts", None)
    d["rope_theta"] = arch.rope_theta
    d["torch_dtype"] = d["dtype"] = str(dtype).replace("torch.", "")
    d.pop("transformers_version", None)
    d.update(extra or {})
    return d


# --------------------------------------------------------------------------------------------------
# Router replay (megatron-core's RouterReplay; build the model with ``moe_enable_routing_replay=True``)
# --------------------------------------------------------------------------------------------------


def _moe_layers(model) -> list:
    """This stage's MoE layers in order: every layer with a router (a GLM-4.7-Flash-style model's first
    ``moe_first_k_dense`` layers are dense and have none, model/mla.py)."""
    return [layer for layer in unwrap(model).decoder.layers if getattr(layer.mlp, "router", None) is not None]


def _replays(model) -> list:
    """This stage's ``RouterReplay`` objects, one per local MoE layer in order (megatron also keeps a process-wide
    list of every router ever built; this reads the model's own, so several models in a process do not mix)."""
    if not getattr(unwrap(model).config, "num_moe_experts", None):
        raise ValueError("router replay needs a MoE model built with moe_enable_routing_replay=True")
    out = []
    for layer in _moe_layers(model):
        rr = getattr(layer.mlp.router, "router_replay", None)
        if rr is None:
            raise ValueError("router replay needs a MoE model built with moe_enable_routing_replay=True")
        out.append(rr)
    return out


def microbatch_routing(routings, lengths, pad: int = 0) -> list[torch.Tensor] | None:
    """Per global MoE layer (dense layers have no entry), the (T, k) experts of a microbatch of trajectories laid end
    to end (then ``pad``
    padding tokens): each trajectory's engine routing, a (P_i, L, k) tensor for its first P_i ≤ T_i positions.
    None when no trajectory carries routing (replay off); all or none must.

    Positions no engine computed (a trajectory's last token, a tool result after its last turn) and the padding
    get experts 0..k-1: no scored log-prob depends on them (causal attention; every scored token's context was
    computed by the engine call that sampled it)."""
    routings = list(routings)
    if all(r is None for r in routings):
        return None
    if any(r is None for r in routings):
        raise ValueError("router replay: some trajectories of a microbatch carry no routing")
    num_layers, topk = int(routings[0].shape[1]), int(routings[0].shape[2])
    parts = []
    for r, t in zip(routings, lengths):
        if r.dim() != 3 or r.shape[0] > t or tuple(r.shape[1:]) != (num_layers, topk):
            raise ValueError(f"routing of shape {tuple(r.shape)} for a trajectory of {t} tokens; expected "
                             f"(≤ {t}, {num_layers}, {topk})")
        parts.append(r.long())
        if t > r.shape[0]:
            parts.append(torch.arange(topk).expand(t - r.shape[0], num_layers, topk))
    if pad:
        parts.append(torch.arange(topk).expand(pad, num_layers, topk))
    full = torch.cat(parts)  # (T, L, k)
    return [full[:, layer] for layer in range(num_layers)]


def prompt_routing(routing, length: int, prefix: int) -> torch.Tensor | None:
    """(prefix, L, k) the experts a trajectory of ``length`` tokens replays at its first ``prefix`` positions (its
    engine routing ``routing`` (P, L, k), filled as :func:`microbatch_routing` fills), each position's k experts
    sorted: the replay scatters them into a routing map, their order is immaterial. None without routing."""
    if routing is None:
        return None
    return _prompt_sets(microbatch_routing([routing], [length]), prefix)


def _prompt_sets(per_layer: list[torch.Tensor], prefix: int) -> torch.Tensor:
    """(prefix, L, k) of a trajectory's per-layer (T, k) replay routing: its first ``prefix`` positions, each
    position's experts sorted."""
    return torch.stack([r[:prefix] for r in per_layer], 1).sort(-1).values


def shared_prefix_routing(routings, lengths, prefix: int, pad: int = 0) -> list[torch.Tensor] | None:
    """Per global MoE layer, the (T, k) experts of a shared-prefix microbatch (``training.packing.PrefixLayout``:
    the prompt's first ``prefix`` positions once, then each trajectory's positions ``prefix..T_i-1``, then ``pad``
    padding positions), each position's experts from its own trajectory's engine routing as in
    :func:`microbatch_routing`. The prompt's positions must route alike in every trajectory (the engine prefilled
    each member's prompt; :func:`prompt_routing` equal): the planner keeps members whose prompt routing differs
    out of the microbatch, and this raises rather than replay one member's routing for another's prompt."""
    routings, lengths = list(routings), [int(n) for n in lengths]
    per_traj = [microbatch_routing([r], [n]) for r, n in zip(routings, lengths)]
    if all(p is None for p in per_traj):
        return None
    if any(p is None for p in per_traj):
        raise ValueError("router replay: some trajectories of a microbatch carry no routing")
    head = _prompt_sets(per_traj[0], prefix)
    for p in per_traj[1:]:
        if not torch.equal(_prompt_sets(p, prefix), head):
            raise ValueError(f"router replay: the trajectories of a shared-prefix microbatch route their first "
                             f"{prefix} prompt positions differently (the planner must keep them apart)")
    topk = int(head.shape[-1])
    out = []
    for layer in range(len(per_traj[0])):
        parts = [per_traj[0][layer][:prefix]] + [p[layer][prefix:] for p in per_traj]
        if pad:
            parts.append(torch.arange(topk).expand(pad, topk))
        out.append(torch.cat(parts))  # (T, k)
    return out


class replay_microbatch:
    """``with replay_microbatch(model, per_layer):``: :class:`replay_routing` with this stage's layers picked out of
    ``per_layer`` (every global MoE layer, e.g. from :func:`microbatch_routing`) by their layer numbers; with
    ``per_layer`` None it does nothing (replay off)."""

    def __init__(self, model, per_layer):
        self.inner = None
        if per_layer is not None:
            gpt = unwrap(model)  # layer_number is global (1-based, pipeline offset included): a stage's own layers
            dense = getattr(getattr(gpt, "arch", None), "moe_first_k_dense", 0)  # MoE layer i is layer dense + i
            local = [sequence_shard(per_layer[layer.layer_number - 1 - dense], gpt.config)
                     for layer in _moe_layers(gpt)]
            self.inner = replay_routing(model, local)

    def __enter__(self):
        if self.inner is not None:
            self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return False if self.inner is None else self.inner.__exit__(*exc)


class record_routing:
    """``with record_routing(model) as rec: model(...)`` → ``rec.indices``: per local MoE layer the (S·B, k) expert
    indices the routers chose (token order of megatron's (S, B) flattening: for B = 1, position order)."""

    def __init__(self, model):
        self.model, self.indices = model, None

    def __enter__(self):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for rr in _replays(self.model):
            rr.clear_indices()
            rr.set_router_replay_action(RouterReplayAction.RECORD)
        return self

    def __exit__(self, *exc):
        replays = _replays(self.model)
        self.indices = [rr.get_recorded_indices() for rr in replays]
        for rr in replays:
            rr.clear_router_replay_action()
            rr.clear_indices()
        return False


class replay_routing:
    """``with replay_routing(model, indices): model(...)``: every local MoE layer routes each token to the given
    experts (list of (S·B, k) long tensors, one per local MoE layer) instead of its own top-k; the weights are the
    router's own scores of those experts (softmaxed over the k with ``norm_topk_prob``, as in HF; sigmoid routing:
    the plain sigmoid scores of those experts, normalised and scaled, the correction bias unused). One forward
    per context (the backward needs no replay: megatron does not recompute the router unless activation
    recomputation is on, which is refused with router replay: ``config.ModelConfig``, ``builder.transformer_config``)."""

    def __init__(self, model, indices):
        self.model, self.indices = model, list(indices)

    def __enter__(self):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replays = _replays(self.model)
        if len(replays) != len(self.indices):
            raise ValueError(f"{len(self.indices)} replay tensors for {len(replays)} local MoE layers")
        for rr, idx in zip(replays, self.indices):
            rr.clear_indices()
            rr.set_target_indices(idx.long())
            rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        return self

    def __exit__(self, *exc):
        for rr in _replays(self.model):
            rr.clear_router_replay_action()
            rr.clear_indices()
        return False


def sequence_shard(indices: torch.Tensor, config) -> torch.Tensor:
    """The rows of a microbatch's (T, k) routing that this TP rank's routers see. Under sequence parallelism a
    router gets its rank's contiguous 1/TP of the sequence, which the model padded at the end to a multiple of TP
    (``model.builder.pad_for_sequence_parallel``; packs come padded): pad the routing alike (experts 0..k-1, as
    :func:`microbatch_routing` routes padding) and take the rank's block. Without sequence parallelism: all rows."""
    tp = config.tensor_model_parallel_size
    if not config.sequence_parallel or tp == 1:
        return indices
    from megatron.core import parallel_state as ps

    n, k = (-indices.shape[0]) % tp, indices.shape[1]
    if n:
        indices = torch.cat([indices, torch.arange(k, dtype=indices.dtype).expand(n, k)])
    return indices.chunk(tp)[ps.get_tensor_model_parallel_rank()]
