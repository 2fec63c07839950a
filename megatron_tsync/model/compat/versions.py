"""Version differences between megatron-core 0.16.1 (the newest on Python 3.11, what CI runs) and the 0.17–0.19
releases clusters run (concern 2 of :mod:`megatron_tsync.model.compat`): every call whose signature differs goes
through a helper here, and the fixes of megatron-core bugs the runs hit (MoE without TE, float64 routing, the torch
norm under sequence parallelism, per-token RoPE, RoPE frequencies in the model's dtype, distributed-optimizer loads).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from torch.overrides import TorchFunctionMode

from megatron_tsync.model.compat.attention import use_sdpa_attention
from megatron_tsync.model.compat.cpu import (_install_cpu_moe_splits, _install_gloo_uneven_sequence_collectives,
                                             cuda_available)


def megatron_core_version() -> tuple[int, ...]:
    """The installed megatron-core version as an int tuple, e.g. (0, 16, 1)."""
    import megatron.core

    parts = []
    for p in str(getattr(megatron.core, "__version__", "0")).split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


# --------------------------------------------------------------------------------------------------
# Version differences. Each helper filters keyword arguments by the installed signature so that one call
# site works on 0.16.1 and on newer releases.
# --------------------------------------------------------------------------------------------------


def _accepted(fn, kwargs: dict) -> dict:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def model_parallel_seed(seed: int) -> None:
    """``model_parallel_cuda_manual_seed`` (tensor-parallel RNG streams) on any version, CPU or GPU."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def rng_tracker_states() -> dict:
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker().get_states()


def set_rng_tracker_states(states: dict) -> None:
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().set_states(states)


def make_transformer_config(config_class: str | None = None, **kwargs):
    """``TransformerConfig`` (``config_class`` "mla": ``MLATransformerConfig``) dropping fields the installed
    version does not know (logged by the caller)."""
    import dataclasses

    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    cls = MLATransformerConfig if config_class == "mla" else TransformerConfig
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - names)
    return cls(**{k: v for k, v in kwargs.items() if k in names}), unknown


def make_ddp_config(**kwargs):
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig

    names = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    return DistributedDataParallelConfig(**{k: v for k, v in kwargs.items() if k in names})


def make_optimizer_config(**kwargs):
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig

    names = {f.name for f in dataclasses.fields(OptimizerConfig)}
    return OptimizerConfig(**{k: v for k, v in kwargs.items() if k in names})


def get_megatron_optimizer(opt_config, model_chunks):
    from megatron.core.optimizer import get_megatron_optimizer as _get

    from megatron_tsync.model.compat.startup import defer_optimizer_dynamo_import

    defer_optimizer_dynamo_import()  # torch.optim's wrappers stop importing torch._dynamo (compat/startup.py)
    return _get(opt_config, model_chunks)


def local_layer_spec(*, qk_layernorm: bool = False, sdpa: bool = True):
    """megatron-core's local layer spec with RMSNorm; ``qk_layernorm``: per-head RMSNorm on queries and keys
    (Qwen3's ``q_norm`` / ``k_norm``: ``self_attention.{q,k}_layernorm``). ``sdpa``: core attention by torch SDPA
    (:class:`SDPAttention`); False: megatron's unfused ``DotProductAttention``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    kw = {"normalization": "RMSNorm", "qk_layernorm": qk_layernorm}
    return use_sdpa_attention(get_gpt_layer_local_spec(**_accepted(get_gpt_layer_local_spec, kw)), sdpa)


def te_layer_spec(*, qk_layernorm: bool = False, num_experts: int = 0):
    """Transformer Engine layer spec, or None when TE is not importable (always None on CPU). ``num_experts`` > 0:
    the MoE spec with sequential experts (same parameter names as the local spec; no grouped GEMM)."""
    if not cuda_available():
        return None
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    except Exception:
        return None
    fn = get_gpt_layer_with_transformer_engine_spec
    kw = {"qk_layernorm": qk_layernorm}
    if num_experts:
        kw.update(num_experts=num_experts, moe_grouped_gemm=False)
    return fn(**_accepted(fn, kw))


def _fix_moe_without_te() -> None:
    """megatron-core 0.16.1's ``moe_utils`` reads ``te_general_gemm`` in the router's gating linear but defines it
    only when Transformer Engine imports (NameError without TE): define it as None (the torch matmul path)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not cuda_available():
        _install_cpu_moe_splits()
        _install_gloo_uneven_sequence_collectives()
    _install_float64_routing()
    _skip_idle_expert_bias()


def _skip_idle_expert_bias() -> None:
    """megatron-core's ``TopKRouter._apply_expert_bias`` is a ``jit_fuser`` (``torch.compile``) function called at
    every routing; its body does something only with ``moe_router_enable_expert_bias`` (``if
    self.enable_expert_bias and torch.is_grad_enabled(): ...``). Without expert bias the call is skipped here: the same
    nothing it computed, but a MoE process no longer imports torch._dynamo / torch._inductor and traces the function
    at its first forward (CPU seconds per MoE trainer, rank and rollout worker). With expert bias the compiled
    function runs as before. Idempotent."""
    from megatron.core.transformer.moe.router import TopKRouter

    original = TopKRouter.__dict__.get("_apply_expert_bias")
    if original is None or getattr(original, "_tsync_skip_idle", False):
        return

    @functools.wraps(original)
    def _apply_expert_bias(self, *args, **kwargs):
        if not self.enable_expert_bias:
            return None
        return original(self, *args, **kwargs)

    _apply_expert_bias._tsync_skip_idle = True
    TopKRouter._apply_expert_bias = _apply_expert_bias


class _Float64Softmax(TorchFunctionMode):
    """Inside megatron's top-k routing: a softmax of float64 scores asked for in float32 stays float64, and so
    does the sigmoid router's ``logits.float()`` (``score_function="sigmoid"``, model/mla.py)."""

    _SOFTMAX = (torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._SOFTMAX and kwargs.get("dtype") == torch.float32 and args and args[0].dtype == torch.float64:
            kwargs = {**kwargs, "dtype": torch.float64}
        if func is torch.Tensor.float and args and args[0].dtype == torch.float64 and len(args) == 1 and not kwargs:
            return args[0]
        return func(*args, **kwargs)


def _install_float64_routing() -> None:
    """float64 verification runs: megatron-core's ``topk_routing_with_score_function`` softmaxes the router scores
    with ``dtype=torch.float32`` (0.16–0.19), whatever the model's dtype. The routing weights then carry float32
    rounding, and a backward scaled by a constant (a streamed trajectory's, later multiplied by its advantage) no
    longer equals the backward of the scaled loss: streamed vs sync float64 gradients differed by 4.6e-9 relative.
    For float64 logits the softmax runs in float64 instead (bf16/fp32 models are unchanged: the router's float32
    softmax is megatron's design there)."""
    import megatron.core.transformer.moe.router as router

    original = router.topk_routing_with_score_function
    if getattr(original, "_tsync_float64", False):
        return

    def topk_routing_with_score_function(logits, *args, **kwargs):
        if logits.dtype != torch.float64:
            return original(logits, *args, **kwargs)
        with _Float64Softmax():
            return original(logits, *args, **kwargs)

    topk_routing_with_score_function._tsync_float64 = True
    router.topk_routing_with_score_function = topk_routing_with_score_function


def allow_sequence_parallel_torch_norm() -> None:
    """megatron's ``WrappedTorchNorm`` (the local spec's norm, used on CPU) asserts ``not sequence_parallel``. Under
    sequence parallelism a norm sees its rank's shard of the sequence, so its weight gradient is a partial sum that
    ``finalize_model_grads`` must add over TP — which it does for parameters marked ``sequence_parallel`` (what
    Transformer Engine's norms set). Build the torch norm from a config copy without the flag and mark its
    parameters. Idempotent."""
    import copy

    import megatron.core.transformer.torch_norm as tn

    if getattr(tn.WrappedTorchNorm, "_tsync_sp", False):
        return
    orig = tn.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kw):
        if not config.sequence_parallel:
            return orig(cls, config, hidden_size, eps, **kw)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = orig(cls, plain, hidden_size, eps, **kw)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    tn.WrappedTorchNorm.__new__ = staticmethod(__new__)
    tn.WrappedTorchNorm._tsync_sp = True


def local_moe_layer_spec(num_experts: int, *, qk_layernorm: bool = False, sdpa: bool = True):
    """Local layer spec with a MoE MLP of ``num_experts`` sequential experts (no grouped GEMM), RMSNorm; ``sdpa``
    as in :func:`local_layer_spec`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    _fix_moe_without_te()
    allow_sequence_parallel_torch_norm()  # MoE at TP > 1 runs with sequence parallelism (model/moe.py)
    kw = {"normalization": "RMSNorm", "qk_layernorm": qk_layernorm, "num_experts": num_experts,
          "moe_grouped_gemm": False}
    return use_sdpa_attention(get_gpt_layer_local_spec(**_accepted(get_gpt_layer_local_spec, kw)), sdpa)


def rope_inv_freq(head_dim: int, theta: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Plain RoPE inverse frequencies θ^(-2i/d), i = 0 .. d/2 - 1, computed in ``dtype``: (head_dim/2,).

    float32 is megatron-core's ``RotaryEmbedding`` formula (bitwise its ``inv_freq``). megatron-core (0.16–0.19)
    always computes in float32, so a float64 model would otherwise rotate by frequencies ~6e-8 off (relative).
    """
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=dtype) / head_dim))


def llama3_inv_freq(head_dim: int, theta: float, *, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """RoPE inverse frequencies of ``rope_type: llama3`` (Llama 3.1/3.2), computed in ``dtype``, (head_dim/2,).

    In float32: the same operations in the same order as transformers' ``_compute_llama3_parameters`` (bitwise
    equal). megatron-core's ``RotaryEmbedding(rope_scaling=True)`` takes only ``factor`` and hard-codes the other
    three (1, 4, 8192), so models whose config differs would get other frequencies there; this reads them all.
    """
    import math

    base = rope_inv_freq(head_dim, theta, dtype)
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / base
    inv = torch.where(wavelen > low_freq_wavelen, base / factor, base)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv / factor + smooth * inv
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv)


def set_rope_inv_freq(gpt_model, inv_freq: torch.Tensor) -> bool:
    """Give the model's megatron ``RotaryEmbedding`` these inverse frequencies ((head_dim/2,)), before any forward.

    In megatron-core 0.16–0.19 ``inv_freq`` is a plain attribute (not a buffer: not in the state dict) read by
    ``get_freqs_non_repeated``, which also makes the positions in its dtype; ``forward`` is ``lru_cache``d per
    (module, length), so the cache is cleared. The frequencies keep their dtype (float64 models get float64 ones).
    Returns False when this stage has no rotary module.
    """
    rope = getattr(gpt_model, "rotary_pos_emb", None)
    if rope is None:
        return False
    old = rope.inv_freq
    if tuple(old.shape) != tuple(inv_freq.shape):
        raise ValueError(f"inv_freq shape {tuple(inv_freq.shape)} != the rotary module's {tuple(old.shape)}")
    rope.inv_freq = inv_freq.to(device=old.device)
    clear = getattr(type(rope).forward, "cache_clear", None)
    if clear is not None:
        clear()
    return True


def finalize_model_grads(model_chunks, num_tokens=None):
    from megatron.core.distributed import finalize_model_grads as _fin

    return _fin(model_chunks, num_tokens)


def dist_checkpointing_save(sharded_state_dict, directory: str):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.save(sharded_state_dict, directory)


def dist_checkpointing_load(sharded_state_dict, directory: str):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(sharded_state_dict, directory)


def install_per_token_rope(gpt_model) -> bool:
    """Let the executor give RoPE explicit per-token positions (sequence packing on the local layer spec).

    megatron-core 0.16's ``RotaryEmbedding`` ignores ``position_ids``: ``GPTModel`` asks it for the frequencies of
    positions 0..S-1 of the whole (packed) sequence. For a packed microbatch each segment must restart at 0. This
    wraps the model's rotary module once: while ``rope_positions(gpt_model, pos)`` is active it returns the rows
    ``emb[pos]`` ((S, 1, 1, D), bitwise the rows an unpacked sequence gets); otherwise it is the original. The
    Transformer Engine path does not need it (THD ``PackedSeqParams`` restart RoPE per segment). Returns False when
    the model has no rotary module on this stage.
    """
    rope = getattr(gpt_model, "rotary_pos_emb", None)
    if rope is None:
        return False
    if getattr(rope, "_tsync_positions", "absent") != "absent":
        return True  # already installed
    original = rope.forward
    rope._tsync_positions = None

    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        pos = rope._tsync_positions
        if pos is None:
            return original(max_seq_len, offset, packed_seq, cp_group)
        if int(max_seq_len) != pos.numel():
            raise RuntimeError(f"per-token RoPE: sequence length {max_seq_len} != {pos.numel()} positions")
        emb = original(int(pos.max()) + 1, offset, packed_seq, cp_group)  # (P, 1, 1, D)
        return emb[pos.to(emb.device)]  # (S, 1, 1, D)

    rope.forward = forward
    return True


@contextlib.contextmanager
def rope_positions(gpt_model, positions: torch.Tensor | None):
    """Within the block, RoPE of ``gpt_model`` uses ``positions`` ((S,) long) when installed (see above)."""
    rope = getattr(gpt_model, "rotary_pos_emb", None)
    if rope is None or positions is None or not hasattr(rope, "_tsync_positions"):
        yield
        return
    rope._tsync_positions = positions
    try:
        yield
    finally:
        rope._tsync_positions = None


# ---------------------------------------------------------------------------------------------------------------------
# Distributed optimizer + torch Adam (no TE/apex: CPU) checkpoint loading, megatron-core 0.16


def prepare_distributed_optimizer_load(optimizer) -> None:
    """Before ``DistributedOptimizer.sharded_state_dict(is_loading=True)`` / ``load_state_dict``."""
    _init_empty_distributed_adam_state(optimizer)
    _skip_step_in_fully_reshardable_load(optimizer)


def _skip_step_in_fully_reshardable_load(optimizer) -> None:
    """The fully_reshardable load copies every key of the torch Adam state from the checkpoint's tensors, which
    skip ``step`` (it lives in the param groups): KeyError 'step'. Hide ``step`` during that copy (restored after;
    :func:`fix_loaded_adam_steps` sets its value)."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if type(sub).__name__ != "DistributedOptimizer" or getattr(sub, "_tsync_step_patch", False):
            continue
        original = sub._set_main_param_and_optimizer_states

        def setter(model_param, tensors, _orig=original, _sub=sub):
            if "step" in tensors or getattr(_sub.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
                return _orig(model_param, tensors)
            group_index, group_order = _sub.model_param_group_index_map[model_param]
            state = _sub.optimizer.state[_sub.optimizer.param_groups[group_index]["params"][group_order]]
            step = state.pop("step", None)
            try:
                return _orig(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        sub._set_main_param_and_optimizer_states = setter
        sub._tsync_step_patch = True


def _init_empty_distributed_adam_state(optimizer) -> None:
    """megatron-core 0.16's ``DistributedOptimizer.state_dict`` asserts that every torch Adam state has a
    ``step`` when neither apex nor TE is installed (CPU), but its ``init_state_fn`` creates only the moments:
    loading into a fresh distributed optimizer failed. Give empty states zero moments and step 0 (the loaded
    checkpoint overwrites them). No-op with TE/apex optimizers or once a step has run."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if type(sub).__name__ != "DistributedOptimizer" or not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if len(st) == 0:
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)
                    st["step"] = torch.tensor(0.0)


def fix_loaded_adam_steps(optimizer) -> None:
    """megatron-core 0.16's ``DistributedOptimizer.load_state_dict`` (no apex/TE) gives every torch Adam state
    the *same* ``step`` tensor; torch increments it in place once per parameter, so the bias correction went
    wrong from the second step after a resume. And the value it leaves there is not the checkpoint's: the
    dp_reshardable parameter-state load skips ``step`` ("read from param_groups") and the states keep the 0 of
    :func:`prepare_distributed_optimizer_load` — the resumed Adam restarted its bias correction (updates ≈ lr·sign,
    measured 1e-3 parameter drift at DP=2). The checkpoint's step is in each loaded param group's ``step``: give
    every state its own tensor of that value."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        distributed = type(sub).__name__ == "DistributedOptimizer"
        for group in inner.param_groups:
            group_step = group.get("step") if distributed else None
            for p in group["params"]:
                st = inner.state.get(p)
                if not st or not torch.is_tensor(st.get("step")):
                    continue
                if group_step is not None:
                    st["step"] = torch.tensor(float(group_step), dtype=st["step"].dtype, device=st["step"].device)
                else:
                    st["step"] = st["step"].clone()
