"""Per-token log-probs from a Megatron model: the single source of truth for trainer log-probs.

Every loss, every engine check and every exactness test takes its log-probs from :func:`token_logprobs`.
Logits are vocab-parallel (each TP rank holds V/TP columns); the log-softmax is computed across TP ranks
without gathering the vocabulary, in the logits' own dtype (float64 stays float64 — megatron's
``vocab_parallel_cross_entropy`` casts to float32 in its max step, which is why it is not used here).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllReduceSum(torch.autograd.Function):
    """Sum over the TP group in forward; identity in backward (each rank's partial sum feeds the total)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _tp_group_and_size():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None, 1, 0
    return (
        ps.get_tensor_model_parallel_group(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
    )


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0, tp_group=None
) -> torch.Tensor:
    """log softmax(logits / T)[target] for vocab-sharded logits.

    Args:
        logits: (B, S, V/tp) this rank's vocabulary shard (rank r holds columns [r·V/tp, (r+1)·V/tp)).
        targets: (B, S) global token ids.
    Returns:
        (B, S) log-probs, differentiable w.r.t. ``logits``.
    """
    group, tp, tp_rank = _tp_group_and_size() if tp_group is None else (tp_group, dist.get_world_size(tp_group), dist.get_rank(tp_group))
    if temperature != 1.0:
        logits = logits / temperature
    vshard = logits.shape[-1]
    with torch.no_grad():
        mx = logits.max(dim=-1, keepdim=True).values  # (B, S, 1), a stabiliser only
        if tp > 1:
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - mx
    sumexp = shifted.exp().sum(dim=-1)  # (B, S)
    lo = tp_rank * vshard
    local = targets - lo
    in_shard = (local >= 0) & (local < vshard)
    picked = shifted.gather(-1, local.clamp(0, vshard - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(in_shard, picked, torch.zeros_like(picked))
    if tp > 1:
        sumexp = _AllReduceSum.apply(sumexp, group)
        picked = _AllReduceSum.apply(picked, group)
    return picked - sumexp.log()


def vocab_parallel_entropy(logits: torch.Tensor, *, temperature: float = 1.0, tp_group=None) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position for vocab-sharded logits: (B, S, V/tp) -> (B, S)."""
    group, tp, _ = _tp_group_and_size() if tp_group is None else (tp_group, dist.get_world_size(tp_group), 0)
    if temperature != 1.0:
        logits = logits / temperature
    with torch.no_grad():
        mx = logits.max(dim=-1, keepdim=True).values
        if tp > 1:
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - mx
    e = shifted.exp()
    z = e.sum(-1)
    ez = (e * shifted).sum(-1)
    if tp > 1:
        z = _AllReduceSum.apply(z, group)
        ez = _AllReduceSum.apply(ez, group)
    return z.log() - ez / z


def model_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Forward of a last-stage (or single-stage) GPTModel without labels: (B, S) -> (B, S, V/tp)."""
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
    return model(input_ids, position_ids, None)


def token_logprobs(
    model, input_ids: torch.Tensor, *, temperature: float = 1.0, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Log-probs of each next token under ``model`` (single stage, any TP).

    Args:
        input_ids: (B, S) token ids.
    Returns:
        (B, S-1): entry t is log p(input_ids[:, t+1] | input_ids[:, :t+1]).
    """
    logits = model_logits(model, input_ids, position_ids)  # (B, S, V/tp)
    return vocab_parallel_logprobs(logits[:, :-1], input_ids[:, 1:], temperature=temperature)


def gather_vocab_parallel_logits(logits: torch.Tensor) -> torch.Tensor:
    """All-gather (B, S, V/tp) shards into full (B, S, V) logits (for checks against Hugging Face)."""
    group, tp, _ = _tp_group_and_size()
    if tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)
