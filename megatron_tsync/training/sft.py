"""Supervised warm start on a task's demonstrations, through the Megatron learner (DDP grad buffers + optimizer).

A tiny random policy never calls the tool, so GRPO would see only zero rewards; a few hundred steps of next-token
training on correct transcripts (``task.demonstration_segments``) teach the format and leave the success rate well
below 100 % (the room RL then fills).

Loss of one step (per-token mean over the batch's loss tokens, all DP ranks together)::

    L = - Σ_{b,t} m[b,t] · log p(x[b,t+1] | x[b,:t+1])  /  Σ_{b,t} m[b,t]

``m`` is the agent loop's loss mask shifted by one (``loss_mask[1:]``): 1 on generated (action) tokens, 0 on the
prompt and on ``<result>...</result>`` tool output (``loss_on="actions"``, the default), so the warm start imitates
exactly the tokens RL later trains. ``loss_on="all"`` trains on every token after the first (an ablation). The
numerator is backpropagated unnormalised and the gradient is divided once at the barrier by the global denominator
(``finalize_and_scale``); with DP > 1 each rank takes its slice ``b ≡ dp_rank (mod dp)`` of the same batch.

Precision: the loss is taken in the log-probs' dtype (float64 stays float64; bf16 is summed in float32). The run's
warm-start optimizer (:data:`WARM_START_OPTIM`: Adam, lr 1e-3, gradient-norm clip 1.0) clips with megatron's rule
``g ← g · c / (‖g‖ + 1e-6)`` when that factor is < 1; megatron's clipping is float32-only, so in float64 runs
:func:`build_sft_optimizer` builds it without clipping and :func:`sft_warmup` applies the same rule in float64.

Deterministic: batch ``s`` is ``task.sample_prompts(s, batch_size, seed)`` (the same on every rank), and the
model's forward/backward on CPU is deterministic under a fixed thread count. Pass a ``seed`` different from the RL
run's so the warm start does not see the RL prompts (``sample_prompts`` is a pure function of its arguments).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import dataclasses
import math

import torch
import torch.distributed as dist

from megatron_tsync.model.builder import unwrap
from megatron_tsync.model.logprobs import token_logprobs
from megatron_tsync.model.tokenizer import Rendered, TokenizerCodec, encode_observation
from megatron_tsync.training.barrier import all_finite
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, finalize_and_scale

__all__ = ["demonstration_tokens", "collate", "sft_warmup", "as_codec", "WARM_START_OPTIM", "build_sft_optimizer"]

WARM_START_OPTIM = OptimConfig(optimizer="adam", lr=1e-3, clip_grad=1.0)
"""The optimizer of a run's supervised warm start (its own: the RL optimizer's state is not touched)."""


def as_codec(tokenizer_or_codec: Any):
    """A text codec (``encode(str) -> list[int]``, ``decode``): a ``TokenizerCodec`` is returned as is, a raw
    ``tokenizers.Tokenizer`` / transformers tokenizer is wrapped in one."""
    if isinstance(tokenizer_or_codec, TokenizerCodec):
        return tokenizer_or_codec
    probe = tokenizer_or_codec.encode("a")
    if isinstance(probe, list) and not hasattr(tokenizer_or_codec, "add_special_tokens"):
        return tokenizer_or_codec  # already a codec-like object
    return TokenizerCodec(tokenizer_or_codec)


def demonstration_tokens(codec, segments: Sequence[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """(token_ids, loss_mask) of a transcript given as ``(text, is_action)`` segments.

    Each segment is encoded on its own, as the agent loop does (prompt, generated turn, tool result, ...; a tool
    result that is a :class:`~megatron_tsync.model.tokenizer.Rendered` with its output as plain text), so the ids
    and the mask equal those of a :class:`~megatron_tsync.rollout.agent_loop.Trajectory` that generated the same
    actions: mask 1 on action tokens, 0 on prompt and tool output.
    """
    ids: list[int] = []
    mask: list[int] = []
    for text, is_action in segments:
        seg = encode_observation(codec, text) if isinstance(text, Rendered) else codec.encode(text)
        ids += seg
        mask += [int(is_action)] * len(seg)
    return ids, mask


def collate(examples: Sequence[tuple[list[int], list[int]]], pad_id: int, loss_on: str = "actions"):
    """Right-pad to the longest example. Returns ``input_ids`` (B, S) and the shifted loss mask (B, S-1) that
    weights ``token_logprobs(model, input_ids)``; padding never carries loss (causal attention: it cannot change
    the earlier positions either)."""
    if loss_on not in ("actions", "all"):
        raise ValueError(f"loss_on must be 'actions' or 'all', got {loss_on!r}")
    S = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), S), pad_id, dtype=torch.long)  # (B, S)
    mask = torch.zeros(len(examples), S, dtype=torch.float32)  # (B, S), mask of the *target* token
    for b, (ids, m) in enumerate(examples):
        input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[b, : len(ids)] = torch.tensor(m if loss_on == "actions" else [1] * len(ids), dtype=torch.float32)
    return input_ids, mask[:, 1:]  # (B, S), (B, S-1)


def _dp_coords(dp_group) -> tuple[int, int, Any]:
    if dp_group is None:
        return 0, 1, None
    return dist.get_rank(dp_group), dist.get_world_size(dp_group), dp_group


def build_sft_optimizer(ddp_model, oc: OptimConfig = WARM_START_OPTIM):
    """(megatron optimizer, ``clip_grad`` for :func:`sft_warmup`) of ``oc``. float32/bf16: megatron clips, the second
    item is 0. float64: megatron's clipping is float32-only, so the optimizer is built without it and the second
    item is ``oc.clip_grad`` (sft_warmup clips in float64 with megatron's rule). The distributed optimizer is used
    exactly when the DDP model was built for it (``oc.use_distributed_optimizer`` is overridden); float64 clipping
    with it is refused (each rank would see only its shard of the gradient norm)."""
    # the DDP's gradient reduction decides: a reduce-scatter (distributed optimizer) leaves each replica only its
    # shard reduced, which a plain optimizer would step on unreduced elsewhere (replicas drift apart)
    oc = dataclasses.replace(oc, use_distributed_optimizer=_distributed(ddp_model))
    if next(ddp_model.parameters()).dtype != torch.float64 or oc.clip_grad <= 0:
        return build_optimizer(ddp_model, oc), 0.0
    if oc.use_distributed_optimizer:
        raise ValueError("float64 warm start with gradient clipping and the distributed optimizer is not supported "
                         "(use --clip-grad 0 semantics: OptimConfig(clip_grad=0), or no distributed optimizer)")
    return build_optimizer(ddp_model, dataclasses.replace(oc, clip_grad=0.0)), float(oc.clip_grad)


def _distributed(ddp_model) -> bool:
    return bool(getattr(getattr(ddp_model, "ddp_config", None), "use_distributed_optimizer", False))


def _grad_norm(ddp_model) -> float:
    """‖g‖₂ over this model's gradient (``main_grad``, after the DP reduction), in its dtype: TP-duplicated
    parameters (norms) and shared copies counted once, summed over the tensor-parallel group (the warm start is
    single-stage) and, for MoE experts, over the expert-parallel group, as megatron's ``get_grad_norm_fp32`` counts
    them."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    sq = {True: None, False: None}  # dense, expert (megatron marks expert parameters allreduce=False)
    for p in ddp_model.parameters():
        g = getattr(p, "main_grad", None)
        if g is None or not param_is_not_shared(p) or not param_is_not_tensor_parallel_duplicate(p):
            continue
        part, dense = g.pow(2).sum(), getattr(p, "allreduce", True)
        sq[dense] = part if sq[dense] is None else sq[dense] + part
    dense, expert = (torch.zeros((), dtype=torch.float64) if v is None else v for v in (sq[True], sq[False]))
    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(dense, group=ps.get_tensor_model_parallel_group())
        dist.all_reduce(expert, group=ps.get_tensor_model_parallel_group())
    if ps.model_parallel_is_initialized() and ps.get_expert_model_parallel_world_size() > 1:
        dist.all_reduce(expert, group=ps.get_expert_model_parallel_group())  # each EP rank holds other experts
    return float((dense + expert).sqrt())


def _clip(ddp_model, max_norm: float) -> None:
    """megatron's clipping rule in the gradient's own dtype: scale by ``max_norm / (‖g‖ + 1e-6)`` when < 1."""
    coef = max_norm / (_grad_norm(ddp_model) + 1.0e-6)
    if coef < 1.0:
        ddp_model.scale_gradients(coef)


def _set_lr(optimizer, lr: float | None) -> list[float] | None:
    if lr is None:
        return None
    groups = optimizer.param_groups
    old = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = lr
    return old


def sft_warmup(
    ddp_model,
    optimizer,
    codec,
    task,
    steps: int,
    batch_size: int,
    seed: int,
    *,
    loss_on: str = "actions",
    lr: float | None = None,
    pad_id: int = 0,
    log: Callable[[int, float], None] | None = None,
    dp_group=None,
    clip_grad: float = 0.0,
) -> list[float]:
    """Train ``steps`` optimizer steps on ``task``'s demonstrations; returns the per-step loss (mean over loss tokens).

    Args:
        ddp_model: megatron DDP-wrapped single-stage ``GPTModel`` (``optimizer.wrap_ddp``); TP is fine, PP is not.
        optimizer: its megatron optimizer (``optimizer.build_optimizer``).
        codec: a ``TokenizerCodec`` (or a raw tokenizer, wrapped).
        task: a :class:`~megatron_tsync.runtime.tasks.Task`.
        steps, batch_size, seed: batch ``s`` is ``task.sample_prompts(s, batch_size, seed)``, or the task's
            ``warm_start_prompts(s, batch_size, seed)`` where it has one (a curriculum of the warm start only).
        loss_on: ``"actions"`` (agent-loop mask) or ``"all"``.
        lr: optional learning rate for the warm start only (restored afterwards).
        pad_id: right-padding id (never trained on).
        log: ``log(step, loss)`` after every step.
        dp_group: the data-parallel process group (``ParallelDims.dp_group()``); None = one replica. Each DP rank
            trains on rows ``dp_rank::dp`` of every batch.
        clip_grad: gradient-norm clipping done here, in the gradient's dtype (for an optimizer built without
            clipping: :func:`build_sft_optimizer` in float64); 0 = none here (the optimizer's own, if any).
    """
    if clip_grad > 0 and getattr(getattr(optimizer, "config", None), "clip_grad", 0.0) > 0:
        raise ValueError(f"sft_warmup(clip_grad={clip_grad}) with an optimizer that clips too "
                         f"(clip_grad {optimizer.config.clip_grad}): the gradient would be clipped twice")
    inner = unwrap(ddp_model)
    if getattr(inner, "pre_process", True) is False or getattr(inner, "post_process", True) is False:
        raise ValueError("sft_warmup needs a single-stage model (pipeline parallelism is not supported here)")
    codec = as_codec(codec)
    dp_rank, dp, dp_group = _dp_coords(dp_group)
    device = next(ddp_model.parameters()).device
    old_lr = _set_lr(optimizer, lr)
    losses: list[float] = []
    ddp_model.train()
    try:
        for step in range(steps):
            insts = getattr(task, "warm_start_prompts", task.sample_prompts)(step, batch_size, seed)
            examples = [demonstration_tokens(codec, task.demonstration_segments(i)) for i in insts]
            ids, mask = collate(examples, pad_id, loss_on)  # (B, S), (B, S-1)
            ids, mask = ids[dp_rank::dp].to(device), mask[dp_rank::dp].to(device)
            lp = token_logprobs(ddp_model, ids)  # (b, S-1)
            lp = lp if lp.dtype == torch.float64 else lp.float()  # float64 stays float64, bf16 sums in float32
            num = -(lp * mask.to(lp.dtype)).sum()
            stats = torch.stack([num.detach(), mask.sum().to(num.dtype)])  # global loss sum and token count, for logging/denominator
            if dp > 1:
                dist.all_reduce(stats, group=dp_group)
            num.backward()
            finalize_and_scale(ddp_model, float(stats[1]))
            loss = float(stats[0] / stats[1])
            if not all_finite(ddp_model, math.isfinite(loss)):  # every rank agrees: none applies the step
                ddp_model.zero_grad_buffer()
                optimizer.zero_grad()
                raise FloatingPointError(
                    f"supervised warm start step {step}: non-finite loss ({loss}) or gradient on some rank; the "
                    f"step was not applied ({step} steps were): lower --sft-warmup-lr, or check the model's "
                    "weights and the task's demonstrations")
            if clip_grad > 0:
                _clip(ddp_model, clip_grad)
            optimizer.step()
            ddp_model.zero_grad_buffer()
            optimizer.zero_grad()
            losses.append(loss)
            if log is not None:
                log(step, losses[-1])
    finally:
        if old_lr is not None:
            for g, v in zip(optimizer.param_groups, old_lr):
                g["lr"] = v
    return losses
