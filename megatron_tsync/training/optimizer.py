"""Megatron DDP + optimizer: the learner's gradient buffers and step.

``DistributedDataParallel`` owns the contiguous grad buffers (``param.main_grad`` views) that the streaming
buckets mirror; ``get_megatron_optimizer`` owns the step (Adam, or SGD for verification runs), with the
distributed optimizer as an option. Gradient reduction is *not* overlapped with backward: the learners reduce once
per optimizer step, at the barrier (``training.barrier``), through :func:`finalize_and_scale`.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_tsync.model import compat


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    optimizer: str = "adam"  # "adam" | "sgd"
    lr: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    clip_grad: float = 1.0  # 0 disables clipping (required for float64 verification runs)
    use_distributed_optimizer: bool = False


def wrap_ddp(model, *, use_distributed_optimizer: bool = False, bucket_size: int | None = None):
    """Wrap a GPTModel stage in megatron's DDP (no overlap; fp32 grad reduction unless params are float64)."""
    from megatron.core.distributed import DistributedDataParallel

    params_dtype = next(model.parameters()).dtype
    cfg = model.config
    ddp_cfg = compat.make_ddp_config(
        grad_reduce_in_fp32=params_dtype != torch.float64,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
        average_in_collective=False,
    )
    ddp = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=model)
    cfg.no_sync_func = ddp.no_sync
    cfg.grad_scale_func = None
    # Reduction happens once, at the trainer's barrier (streaming) or after the schedule (sync); the
    # schedules must not finalize on their own.
    cfg.finalize_model_grads_func = None
    return ddp


def build_optimizer(ddp_model, oc: OptimConfig):
    params_dtype = next(ddp_model.parameters()).dtype
    if params_dtype == torch.float64 and oc.clip_grad > 0:
        raise ValueError("float64 verification runs need --clip-grad 0 (megatron's grad clipping is float32-only)")
    opt_cfg = compat.make_optimizer_config(
        optimizer=oc.optimizer,
        lr=oc.lr,
        min_lr=oc.lr,
        weight_decay=oc.weight_decay,
        adam_beta1=oc.adam_beta1,
        adam_beta2=oc.adam_beta2,
        adam_eps=oc.adam_eps,
        sgd_momentum=oc.sgd_momentum,
        clip_grad=oc.clip_grad,
        bf16=params_dtype == torch.bfloat16 or ddp_model.config.bf16,
        fp16=False,
        params_dtype=params_dtype,
        use_distributed_optimizer=oc.use_distributed_optimizer,
    )
    return compat.get_megatron_optimizer(opt_cfg, [ddp_model])


def grad_buffers(ddp_model) -> list[torch.Tensor]:
    """The flat gradient tensors of every DDP buffer (dense and expert-parallel), in a fixed order."""
    bufs = list(getattr(ddp_model, "buffers", [])) + list(getattr(ddp_model, "expert_parallel_buffers", []))
    return [b.grad_data for b in bufs]


def finalize_and_scale(ddp_model, divisor: float) -> None:
    """The barrier's reduction: ``finalize_model_grads`` (DP reduction, embedding/TP-norm syncs), then one division by
    the explicit denominator. The DP reduction is a sum when the model config has ``calculate_per_token_loss``
    (``model.builder`` sets it). It uses megatron's ``parallel_state`` groups (no ``pg_collection`` is passed)."""
    compat.finalize_model_grads([ddp_model], None)
    if divisor != 1.0:
        ddp_model.scale_gradients(1.0 / divisor)
