"""The optimizer-step barrier shared by the GRPO learner (``training.learner``) and the OPD learner.

In this order:

1. ``finalize_and_scale``: megatron's ``finalize_model_grads`` (the one DP reduction of the step — a sum, DDP is
   built from a model config with ``calculate_per_token_loss=True`` (``model.builder``) — plus the embedding /
   TP-norm all-reduces), then one division of the DDP grad buffers by the explicit denominator ``divisor``
   (``algorithms.aggregation.barrier_divisor``; 1 = no division);
2. ``grad_hook(ddp_model)`` if given: sees the normalised gradient before clipping (``--dump-grads``, the tests);
3. ``optimizer.step()``: megatron's optimizer (grad-norm, clipping if configured, update);
4. ``ddp_model.zero_grad_buffer()`` and ``optimizer.zero_grad()``: the buffers are empty for the next accumulation.

The caller computes the divisor (and publishes it, e.g. ``Learner.last_divisor``, before calling, so a hook can read
it); this module does not know the loss aggregation. Process groups are not passed: ``finalize_model_grads`` is called
without a ``pg_collection`` and megatron's optimizer reduces its grad-norm, so both use megatron's ``parallel_state``
groups (the ones the model and DDP were built with).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from megatron_tsync.training.optimizer import finalize_and_scale


@dataclasses.dataclass(frozen=True)
class BarrierResult:
    update_ok: bool  # the success flag of megatron's optimizer.step() (False: it skipped the update)
    grad_norm: float | None  # the optimizer's grad-norm (before clipping), None when it reports none
    start_s: float  # time.perf_counter() when the barrier began (before the reduction)
    end_s: float  # time.perf_counter() after the grads were zeroed


def barrier_step(ddp_model, optimizer, divisor: float,
                 grad_hook: Callable[[object], None] | None = None) -> BarrierResult:
    """Reduce, divide by ``divisor``, hook, optimizer step, zero the grads (module docstring). One call per step."""
    t0 = time.perf_counter()
    finalize_and_scale(ddp_model, divisor)
    if grad_hook is not None:
        grad_hook(ddp_model)
    ok, gnorm, _ = optimizer.step()
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    return BarrierResult(update_ok=bool(ok), grad_norm=None if gnorm is None else float(gnorm),
                         start_s=t0, end_s=time.perf_counter())
