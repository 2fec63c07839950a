"""The optimizer-step barrier shared by the GRPO learner (``training.learner``) and the OPD learner.

In this order:

1. ``finalize_and_scale``: megatron's ``finalize_model_grads`` (the one DP reduction of the step — a sum, DDP is
   built from a model config with ``calculate_per_token_loss=True`` (``model.builder``) — plus the embedding /
   TP-norm all-reduces), then one division of the DDP grad buffers by the explicit denominator ``divisor``
   (``algorithms.aggregation.barrier_divisor``; 1 = no division);
2. ``grad_hook(ddp_model)`` if given: sees the normalised gradient before clipping (``--dump-grads``, the tests);
3. the finiteness check: the step's loss (``loss_finite``, the caller's) and every gradient element of this rank's
   DDP buffers; one all-reduce (MAX) of the verdict over every trainer rank, so all of them skip together;
4. ``optimizer.step()``: megatron's optimizer (grad-norm, clipping if configured, update) — not called when step 3
   found a NaN or an infinity anywhere: the update is **skipped** (``BarrierResult.skipped``), θ and the optimizer
   state (Adam's moments and step count) stay as they were;
5. ``ddp_model.zero_grad_buffer()`` and ``optimizer.zero_grad()``: the buffers are empty for the next accumulation
   (after a skip too: the poisoned gradient is dropped).

Why our own check: megatron-core 0.16.1's optimizer only skips on a loss scaler's overflow (fp16); without one
(float32 / float64 params: ``FP32Optimizer`` under ``ChainedOptimizer``; bf16 has no scaler either) ``step()``
returns ``update_successful=True`` with a NaN grad-norm and writes NaN into every parameter (checked on CPU, float32
Adam with and without clipping, float64 SGD). Its ``False`` is still honoured (``update_ok``). The grad-norm it
computes is not used for the decision: it comes after the update is already applied. After the DP reduction the
replicas' gradients are identical, and a NaN on one rank reaches every rank's sum, but the verdict is all-reduced
anyway (TP / PP stages hold different parameters, and the loss is per rank). Cost: one pass over the gradient
(``isfinite``) and a one-element all-reduce per optimizer step.

The caller computes the divisor (and publishes it, e.g. ``Learner.last_divisor``, before calling, so a hook can read
it); this module does not know the loss aggregation. Process groups are not passed: ``finalize_model_grads`` is called
without a ``pg_collection`` and megatron's optimizer reduces its grad-norm, so both use megatron's ``parallel_state``
groups (the ones the model and DDP were built with); the verdict uses the default group (every trainer rank).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch
import torch.distributed as dist

from megatron_tsync.training.optimizer import finalize_and_scale, grad_buffers


@dataclasses.dataclass(frozen=True)
class BarrierResult:
    update_ok: bool  # the update was applied (False: skipped — non-finite, or megatron's own skip)
    grad_norm: float | None  # the optimizer's grad-norm (before clipping), None when it reports none or skipped
    start_s: float  # time.perf_counter() when the barrier began (before the reduction)
    end_s: float  # time.perf_counter() after the grads were zeroed
    skipped: bool = False  # no update: the loss or a gradient was NaN / inf on some rank (all ranks agree)


def all_finite(ddp_model, loss_finite: bool = True) -> bool:
    """True when ``loss_finite`` and every element of the DDP grad buffers is finite, on every trainer rank."""
    bufs = grad_buffers(ddp_model)
    ok = loss_finite and all(bool(torch.isfinite(b).all()) for b in bufs)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    dev = bufs[0].device if bufs else torch.device("cpu")
    bad = torch.tensor([0.0 if ok else 1.0], device=dev)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad.item() == 0.0)


def barrier_step(ddp_model, optimizer, divisor: float, grad_hook: Callable[[object], None] | None = None, *,
                 loss_finite: bool = True) -> BarrierResult:
    """Reduce, divide by ``divisor``, hook, check, optimizer step unless non-finite, zero the grads (module
    docstring). One call per step, on every trainer rank; ``loss_finite``: this rank's loss of the step is finite."""
    t0 = time.perf_counter()
    finalize_and_scale(ddp_model, divisor)
    if grad_hook is not None:
        grad_hook(ddp_model)
    skipped = not all_finite(ddp_model, loss_finite)
    ok, gnorm = False, None
    if not skipped:
        ok, gnorm, _ = optimizer.step()
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    return BarrierResult(update_ok=bool(ok), grad_norm=None if gnorm is None else float(gnorm),
                         start_s=t0, end_s=time.perf_counter(), skipped=skipped)
