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

The package, one module per concern (every name re-exported here: ``from megatron_tsync.model import compat``,
``compat.install_cpu_support()``):

- :mod:`.cpu`: concern 1, the CPU support (the function mode, ``torch.cuda`` stand-ins, the CPU RNG tracker, the
  forward / backward outside the mode, the MoE dispatcher's split sizes on CPU);
- :mod:`.versions`: concern 2, the version differences and the fixes of megatron-core bugs (layer specs, configs,
  MoE without TE, float64 routing, RoPE, distributed-optimizer loads);
- :mod:`.attention`: ``SDPAttention``, the local layer spec's core attention by torch SDPA (the CPU path);
- :mod:`.startup`: torch.optim's optimizers without importing ``torch._dynamo`` while nothing compiles (a torch
  version detail: 0.5-0.7 CPU-s per process that builds an optimizer).

Nothing outside this package may patch megatron or test ``megatron.core.__version__``. Its modules import one
another by their own path, never this ``__init__``.
"""

from __future__ import annotations

from megatron_tsync.model.compat import attention as _attention
from megatron_tsync.model.compat.attention import (_causal_segments, PREFIX_TREE_ATTR, _sdpa_attention_class,
                                                   use_sdpa_attention)
from megatron_tsync.model.compat.cpu import (cuda_available, ensure_cpu_mode_in_thread, forward_without_cpu_mode,
                                             install_backward_without_cpu_mode, install_cpu_support)
from megatron_tsync.model.compat.startup import defer_optimizer_dynamo_import
from megatron_tsync.model.compat.versions import (allow_sequence_parallel_torch_norm, dist_checkpointing_load,
                                                  dist_checkpointing_save, finalize_model_grads, fix_loaded_adam_steps,
                                                  get_megatron_optimizer, _install_float64_routing,
                                                  install_per_token_rope, llama3_inv_freq, local_layer_spec,
                                                  local_moe_layer_spec, make_ddp_config, make_optimizer_config,
                                                  make_transformer_config, megatron_core_version, model_parallel_seed,
                                                  prepare_distributed_optimizer_load, rng_tracker_states, rope_inv_freq,
                                                  rope_positions, set_rng_tracker_states, set_rope_inv_freq,
                                                  te_layer_spec)

__all__ = ["PREFIX_TREE_ATTR", "allow_sequence_parallel_torch_norm", "cuda_available", "dist_checkpointing_load",
           "defer_optimizer_dynamo_import", "dist_checkpointing_save", "ensure_cpu_mode_in_thread",
           "finalize_model_grads", "fix_loaded_adam_steps", "forward_without_cpu_mode", "get_megatron_optimizer",
           "install_backward_without_cpu_mode", "install_cpu_support", "install_per_token_rope", "llama3_inv_freq",
           "local_layer_spec", "local_moe_layer_spec", "make_ddp_config", "make_optimizer_config",
           "make_transformer_config", "megatron_core_version", "model_parallel_seed",
           "prepare_distributed_optimizer_load", "rng_tracker_states", "rope_inv_freq", "rope_positions",
           "set_rng_tracker_states", "set_rope_inv_freq", "te_layer_spec", "use_sdpa_attention", "SDPAttention"]


def __getattr__(name: str):
    """``compat.SDPAttention``: the class once made (``attention._sdpa_attention_class``), else None, as before."""
    if name == "SDPAttention":
        return _attention.SDPAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
