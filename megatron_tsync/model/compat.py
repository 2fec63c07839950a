"""The one place that knows about megatron-core versions and about running it without CUDA.

Two concerns live here and nowhere else:

1. **CPU support.** megatron-core hard-codes CUDA in many places (``torch.cuda.current_device()`` in the
   global memory buffer, RoPE and the grad buffers; ``device="cuda"`` in the causal mask and the schedules;
   ``Tensor.cuda()``; the ``'torch.cuda.FloatTensor'`` type assertion in ``clip_grads``;
   ``torch.cuda.synchronize`` in dist_checkpointing; the CUDA RNG tracker used for tensor-parallel init).
   :func:`install_cpu_support` redirects those to the CPU. It is a **no-op when CUDA is available**, so the
   same code path runs unchanged on GPU clusters. What it does on a CPU-only torch:

   - a process-wide ``TorchFunctionMode`` that maps ``device="cuda"`` keyword arguments, ``Tensor.cuda()`` and
     ``Tensor.to("cuda")`` to the CPU, and reports ``Tensor.type()`` with the ``torch.cuda.`` prefix that
     megatron's assertions expect;
   - ``torch.cuda.current_device`` → ``"cpu"``, ``torch.cuda.synchronize`` → no-op, ``torch.cuda.Event`` → a
     wall-clock stand-in (used by megatron.core.inference timers);
   - a CPU subclass of megatron's ``CudaRNGStatesTracker`` so that ``model_parallel_cuda_manual_seed`` and the
     tensor-parallel RNG forks work with ``torch``'s CPU generator.

2. **Version differences** between megatron-core 0.16.1 (the newest on Python 3.11, what CI runs) and the
   0.17–0.19 releases clusters run. Every call whose signature differs goes through a helper here.

Nothing else in the package may patch megatron or test ``megatron.core.__version__``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_LOCK = threading.Lock()
_INSTALLED = False


def megatron_core_version() -> tuple[int, ...]:
    """The installed megatron-core version as an int tuple, e.g. (0, 16, 1)."""
    import megatron.core

    parts = []
    for p in str(getattr(megatron.core, "__version__", "0")).split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _is_cuda(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device requests to the CPU (installed only when CUDA is unavailable)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = dict(kwargs)
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and any(_is_cuda(a) for a in args[1:]):
            args = tuple("cpu" if (i and _is_cuda(a)) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event`` with ``enable_timing`` semantics on the wall clock."""

    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, *args, **kwargs):
        self._t = time.perf_counter()

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, *args, **kwargs):
        pass

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return (end._t - self._t) * 1000.0


_MODE: _CudaToCpuMode | None = None


def install_cpu_support() -> bool:
    """Make megatron-core usable on a CPU-only torch. Idempotent; returns True when it installed anything.

    Must run before megatron builds models or process groups; :func:`megatron_tsync.model.parallel.
    initialize_parallel` calls it. The function mode is per-thread in torch: megatron code that runs in other
    threads (none of the paths we use) would not see it.
    """
    global _INSTALLED, _MODE
    if cuda_available():
        return False
    with _LOCK:
        if _INSTALLED:
            return False
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.Event = _CpuEvent
        _MODE = _CudaToCpuMode()
        _MODE.__enter__()  # stays active for the life of the process
        _install_cpu_rng_tracker()
        _install_cpu_streams()
        _INSTALLED = True
    return True


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream`` (megatron's MoE all-to-all dispatcher makes a device-to-host stream)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        event = event or _CpuEvent()
        event.record()
        return event


_CPU_STREAM = _CpuStream()


def _install_cpu_streams() -> None:
    """``torch.cuda.Stream`` / ``current_stream`` / ``stream(...)`` as no-ops (everything runs in program order)."""
    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = lambda *a, **k: _CPU_STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


@contextlib.contextmanager
def forward_without_cpu_mode():
    """A model forward outside the CUDA→CPU function mode, which costs a Python call per torch function (a
    100-token forward+backward of the tiny model: 11.0 ms with it, 9.4 ms without). Megatron's layers on CPU need
    only ``torch.cuda.current_device`` (patched to "cpu", not the mode); its schedules (``device="cuda"``) stay
    inside the mode. No-op with CUDA, or when another function mode is on top of ours."""
    top = None
    if _MODE is not None and torch._C._len_torch_function_stack() > 0:
        top = torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1)
    if not isinstance(top, _CudaToCpuMode):
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


_FAST_BACKWARD = False


def install_backward_without_cpu_mode() -> None:
    """megatron's ``schedules.backward_step`` outside the CUDA→CPU function mode, as :func:`forward_without_cpu_mode`
    does for forwards: the Python-side backwards it runs (megatron's linear layers, row-split weight gradients) then
    dispatch torch functions without a Python call each. Idempotent; no-op with CUDA or without the mode."""
    global _FAST_BACKWARD
    if _FAST_BACKWARD or _MODE is None:
        return
    from megatron.core.pipeline_parallel import schedules

    orig = schedules.backward_step

    @functools.wraps(orig)
    def backward_step(*args, **kwargs):
        with forward_without_cpu_mode():
            return orig(*args, **kwargs)

    schedules.backward_step = backward_step
    _FAST_BACKWARD = True


def ensure_cpu_mode_in_thread() -> None:
    """Enter the CUDA→CPU function mode in the calling thread (torch keeps mode stacks per thread)."""
    if _MODE is not None and not cuda_available():
        _CudaToCpuMode().__enter__()


def _install_cpu_rng_tracker() -> None:
    import megatron.core.tensor_parallel.random as mrand

    base = mrand.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):
        """Megatron's RNG tracker on torch's CPU generator (fork() swaps the CPU RNG state)."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrand._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    mrand.CudaRNGStatesTracker = CpuRNGStatesTracker


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


def make_transformer_config(**kwargs):
    """``TransformerConfig`` dropping fields the installed version does not know (logged by the caller)."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(kwargs) - names)
    return TransformerConfig(**{k: v for k, v in kwargs.items() if k in names}), unknown


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
    _install_float64_routing()


class _Float64Softmax(TorchFunctionMode):
    """Inside megatron's top-k routing: a softmax of float64 scores asked for in float32 stays float64."""

    _SOFTMAX = (torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._SOFTMAX and kwargs.get("dtype") == torch.float32 and args and args[0].dtype == torch.float64:
            kwargs = {**kwargs, "dtype": torch.float64}
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


def _install_cpu_moe_splits() -> None:
    """CPU: the all-to-all dispatcher's split sizes as numpy arrays, as on GPU. megatron converts them with
    ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which only acts on CUDA tensors; a CPU tensor was passed on
    to ``all_to_all_single`` as split sizes and gloo rejected it (EP > 1)."""
    import megatron.core.transformer.moe.token_dispatcher as td

    if getattr(td.maybe_move_tensor_to_cpu, "_tsync_cpu", False):
        return

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    maybe_move_tensor_to_cpu._tsync_cpu = True
    td.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


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


# ---------------------------------------------------------------------------------------------------------------------
# Fused core attention for the local layer spec (CPU): torch SDPA instead of megatron's unfused baddbmm + softmax.

_SEGMENT_CACHE: list = [None, -1, None]  # [weakref to the last mask, its _version, its segments or None]
_MAX_SEGMENTS = 4096  # more segments than this: not searched for (the generic masked SDPA, still exact)


def _causal_segments(mask: torch.Tensor) -> list[tuple[int, int]] | None:
    """Segments ``[(a, b), ...]`` when ``mask`` ((1, 1, T, T) bool, True = masked) is exactly block-diagonal causal
    (query i sees key j iff j ≤ i in the same segment: ``training.packing``'s packed mask; one segment = plain
    causal); None otherwise. Segment starts are read off the subdiagonal (query i sees key i − 1 iff both lie in
    one segment), then every entry is checked (one read of the mask, no T×T temporaries); cached for the mask object
    that every layer of a forward receives."""
    import weakref

    ref, version, segs = _SEGMENT_CACHE
    if ref is not None and ref() is mask and version == mask._version:
        return segs
    segs = None
    if mask.dim() == 4 and mask.shape[0] == 1 and mask.shape[1] == 1 and mask.shape[2] == mask.shape[3] > 0:
        m = mask[0, 0]  # (T, T)
        n = m.shape[0]
        heads = [0] + (torch.diagonal(m, -1).nonzero().flatten() + 1).tolist()  # (i, i-1) masked: i starts one
        if len(heads) <= _MAX_SEGMENTS:
            bounds = list(zip(heads, heads[1:] + [n]))
            tri = {}
            ok = True
            for a, b in bounds:
                if b - a not in tri:
                    tri[b - a] = torch.ones(b - a, b - a, dtype=torch.bool, device=m.device).triu(1)
                ok = (torch.equal(m[a:b, a:b], tri[b - a]) and bool(m[a:b, :a].all()) and bool(m[a:b, b:].all()))
                if not ok:
                    break
            segs = bounds if ok else None
    _SEGMENT_CACHE[:] = [weakref.ref(mask), mask._version, segs]
    return segs


def _sdpa_masked(q, k, v, mask, scale, gqa):
    """SDPA with an explicit boolean mask (True = masked, broadcastable to (b, np, sq, sk)). A query that sees no
    key gets megatron's result there (all scores filled with −10000: the uniform average of the values) instead of
    SDPA's zeros, so every row equals :class:`DotProductAttention`'s."""
    full = mask.all(dim=-1, keepdim=True)  # (.., sq, 1) queries that see nothing
    any_full = bool(full.any())
    visible = ~(mask & ~full) if any_full else ~mask
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)
    if any_full:
        vmean = v.mean(dim=2, keepdim=True)  # (b, ng, 1, hn)
        if gqa:
            vmean = vmean.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out = torch.where(full, vmean, out)
    return out


class _SDPAForward:
    """The forward of :class:`SDPAttention` (mixed into megatron's ``DotProductAttention`` by
    :func:`_sdpa_attention_class`, so that this module imports no megatron)."""

    def _fallback(self, attention_bias, packed_seq_params) -> bool:
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        return (attention_bias is not None or (packed_seq_params is not None and not thd)
                or self.softmax_offset is not None or self.scale_mask_softmax.window_size is not None
                or self.config.apply_query_key_layer_scaling or (self.training and self.attention_dropout.p > 0))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """(sq, b, np, hn) queries, (sk, b, ng, hn) keys/values -> (sq, b, hp); THD: (t, ·, hn) -> (t, hp). Like
        megatron's, the mask type is the one the module was built with (``attn_mask_type`` is not read)."""
        from megatron.core.transformer.enums import AttnMaskType

        if self._fallback(attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        if packed_seq_params is not None:
            return self._thd(query, key, value, packed_seq_params)
        sq, b, sk = query.shape[0], query.shape[1], key.shape[0]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads, s, hn)
        gqa = q.shape[1] != k.shape[1]
        sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, scale=self.softmax_scale,
                                 enable_gqa=gqa)
        if attention_mask is None:
            causal = self.attn_mask_type == AttnMaskType.causal and sq > 1
            if causal and sq != sk:
                raise ValueError(f"causal attention without a mask needs sq == sk (got {sq}, {sk})")
            out = sdpa(q, k, v, is_causal=causal)
        else:
            if attention_mask.dtype != torch.bool:
                raise TypeError(f"attention_mask must be boolean (True = masked), got {attention_mask.dtype}")
            tree = getattr(attention_mask, PREFIX_TREE_ATTR, None)  # (prefix, continuation lengths) or None
            segs = _causal_segments(attention_mask) if sq == sk and tree is None else None
            if tree is not None and sq == sk == tree[0] + sum(tree[1]):
                out = _prefix_tree(sdpa, q, k, v, *tree)
            elif segs is not None and len(segs) == 1:
                out = sdpa(q, k, v, is_causal=True)
            elif segs is not None:
                out = _per_segment(sdpa, q, k, v, [e - a for a, e in segs], is_causal=True)
            else:
                out = _sdpa_masked(q, k, v, attention_mask, self.softmax_scale, gqa)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)  # (sq, b, hp)

    def _thd(self, query, key, value, psp):
        """THD packing (``PackedSeqParams``, query (t, np, hn)): one causal SDPA per segment -> (t, hp)."""
        from megatron.core.transformer.enums import AttnMaskType

        cu_q, cu_k = psp.cu_seqlens_q, psp.cu_seqlens_kv
        padded = (psp.cu_seqlens_q_padded, psp.cu_seqlens_kv_padded)
        if not torch.equal(cu_q, cu_k) or any(c is not None and not torch.equal(c, cu_q) for c in padded):
            raise ValueError("SDPAttention (THD): cu_seqlens_q, cu_seqlens_kv and their padded forms must agree")
        if self.attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention (THD) supports causal self-attention only, not {self.attn_mask_type}")
        q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))  # (1, heads, t, hn)
        bounds = cu_q.tolist()
        sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, scale=self.softmax_scale,
                                 enable_gqa=q.shape[1] != k.shape[1], is_causal=True)
        out = _per_segment(sdpa, q, k, v, [e - a for a, e in zip(bounds, bounds[1:])])  # (1, np, t, hn)
        return out[0].permute(1, 0, 2).reshape(query.shape[0], self.hidden_size_per_partition)


PREFIX_TREE_ATTR = "tsync_prefix_tree"  # set on a shared-prefix mask (training.packing.PrefixLayout.mask)


def _prefix_tree(sdpa, q, k, v, prefix: int, lengths: list[int]):
    """A shared-prefix mask's attention by blocks: the prefix causally, then each continuation over the prefix's
    keys and its own (causal), never another continuation's; the mask's own result (every query sees at least
    itself), without a (T, T) score matrix: time and memory prefix² + Σ_k s_k·(prefix + s_k)."""
    qs, ks, vs = (torch.split(t, [prefix, *lengths], dim=2) for t in (q, k, v))
    parts = [sdpa(qs[0], ks[0], vs[0], is_causal=True)]
    for qi, ki, vi in zip(qs[1:], ks[1:], vs[1:]):
        s = qi.shape[2]
        seen = torch.ones(s, prefix + s, dtype=torch.bool, device=q.device)
        seen[:, prefix:] = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        parts.append(sdpa(qi, torch.cat([ks[0], ki], dim=2), torch.cat([vs[0], vi], dim=2), attn_mask=seen))
    return torch.cat(parts, dim=2)


def _per_segment(sdpa, q, k, v, lengths: list[int], **kw):
    """One SDPA per segment along dim 2, concatenated. ``torch.split``, not slicing: a slice's backward fills a zero
    tensor of the whole pack per segment (64 segments: 1,188 fills, a third of a quickstart sync step); split's
    backward is one concatenation."""
    if sum(lengths) != q.shape[2]:
        raise ValueError(f"segments cover {sum(lengths)} positions of a {q.shape[2]}-token pack")
    parts = zip(*(torch.split(t, lengths, dim=2) for t in (q, k, v)))
    return torch.cat([sdpa(qs, ks, vs, **kw) for qs, ks, vs in parts], dim=2)


_SDPA_DOC = """megatron's ``DotProductAttention`` (same constructor, forward signature, softmax scale, mask convention
    True = masked, and state) computed by ``torch.nn.functional.scaled_dot_product_attention``: no (b·np, sq, sk)
    score buffer, memory linear in the length.

    - no mask: ``is_causal`` for causal self-attention (sq == sk > 1), else unmasked (decode steps, sq = 1);
    - a block-diagonal causal mask (sequence packing, ``training.packing.block_causal_mask``): one causal SDPA per
      segment (exact; the pack's attention costs the sum of its segments' instead of the whole pack's);
    - THD ``PackedSeqParams`` (``cu_seqlens``): the same per-segment SDPA, no T×T mask at all;
    - any other boolean mask (left-padding, KV-cache decode): SDPA with that mask; a query that sees no key gets
      megatron's result there (the uniform average of the values), not SDPA's zeros;
    - GQA: SDPA's ``enable_gqa`` (no repeated keys/values).

    Falls back to megatron's computation where SDPA would differ: sliding windows, softmax offsets (off-by-one,
    learnable), query-key layer scaling, attention dropout while training, attention bias, non-THD packed params.
    """


def _sdpa_attention_class():
    """:class:`SDPAttention`, made on first use (megatron imports only when a spec is built)."""
    global SDPAttention
    if SDPAttention is None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        SDPAttention = type("SDPAttention", (_SDPAForward, DotProductAttention),
                            {"__doc__": _SDPA_DOC, "__module__": __name__})
    return SDPAttention


SDPAttention = None  # the class, once _sdpa_attention_class() ran


def use_sdpa_attention(spec, enabled: bool = True):
    """``spec`` (a local layer spec) with :class:`SDPAttention` as its core attention (in place); returned."""
    if enabled:
        spec.submodules.self_attention.submodules.core_attention = _sdpa_attention_class()
    return spec


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
