"""Row-split weight gradients: one backward of a packed microbatch whose token rows have different destinations.

Every parameter gradient of a dense GPT is a sum over token rows of a term linear in that row's output gradient g_t:
a linear layer's weight Σ_t g_t x_tᵀ (its bias Σ_t g_t), an RMSNorm weight Σ_t g_t ⊙ x̂_t, an embedding row v
Σ_{t: id_t = v} g_t. The segments of a packed microbatch do not interact (block-diagonal attention, RoPE restarting
per segment), so one backward's activation gradients are those of the segments' own backwards, and only the weight
gradients differ from "one microbatch per destination". Here they are computed per row span: for each
:class:`RowSpan` the same GEMM (or sum) over its rows only, added with each of its targets' coefficients straight
into those destinations' gradient views (the B/W split of zero-bubble pipelining, with the W part sent to k places at
once; a span with two targets, e.g. a group's Q and P, costs one GEMM). The spans are set by the caller before the
backward starts (:class:`RowPlan`), so they may depend on the loss.

Covered (:func:`install` refuses a model with any other trainable parameter, naming it): megatron's
``ColumnParallelLinear`` / ``RowParallelLinear`` weights (and a bias added inside the linear: QKV bias), torch
``RMSNorm`` weights (layer norms, Qwen3's per-head q/k norms), ``VocabParallelEmbedding`` (a tied output layer's
weight is the embedding's and gets both terms). Tensor parallelism: a column linear's input gradient is all-reduced
over TP as megatron does; sequence parallelism and deferred embedding wgrad are refused. Outside :func:`active` the
wrapped modules run megatron's own code unchanged.

Version-specific: wraps ``_forward_impl`` of megatron-core's linear layers (its keyword arguments as of 0.16) and
re-implements ``VocabParallelEmbedding.forward`` without sequence parallelism.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F


Target = tuple[Callable[[torch.nn.Parameter], torch.Tensor], float]


@dataclasses.dataclass
class RowSpan:
    """Token positions [start, end) of the microbatch whose weight-gradient terms go to ``targets``: (``grad_of``,
    coefficient) pairs, ``grad_of(param)`` being that destination's gradient tensor for a parameter (added into in
    place). One GEMM (or sum) per span and parameter: callers order segments so that rows with the same targets are
    adjacent, and merge them."""

    start: int
    end: int
    targets: list[Target]


class RowPlan:
    """One microbatch's row spans; ``spans`` is filled before its backward (by a pre-hook) and read during it."""

    def __init__(self) -> None:
        self.spans: list[RowSpan] | None = None

    def targets(self) -> list[RowSpan]:
        if self.spans is None:
            raise AssertionError("row-split backward without destinations: RowPlan.spans is set before the backward")
        return self.spans


_CURRENT: RowPlan | None = None


@contextlib.contextmanager
def active(plan: RowPlan):
    """The wrapped modules' forwards inside this block record ``plan`` for their backward."""
    global _CURRENT
    prev, _CURRENT = _CURRENT, plan
    try:
        yield plan
    finally:
        _CURRENT = prev


def _rows_first(t: torch.Tensor) -> torch.Tensor:
    """[s, b = 1, ...] activations as [s, m, last] (rows = sequence positions)."""
    if t.dim() >= 2 and t.shape[1] != 1:
        raise AssertionError(f"row-split needs micro-batch size 1 ([s, 1, ...] activations), got {tuple(t.shape)}")
    return t.reshape(t.shape[0], -1, t.shape[-1])


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan, tp_group):
        ctx.save_for_backward(x, weight)
        ctx.plan, ctx.tp_group, ctx.bias = plan, tp_group, bias
        out = torch.matmul(x, weight.t())
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx = g.matmul(weight)
        if ctx.tp_group is not None:
            torch.distributed.all_reduce(gx, group=ctx.tp_group)
        g3, x3 = _rows_first(g), _rows_first(x)
        for sp in ctx.plan.targets():
            gr = g3[sp.start:sp.end].reshape(-1, g3.shape[-1])
            xr = x3[sp.start:sp.end].reshape(-1, x3.shape[-1])
            first = sp.targets[0][0](weight)
            if len(sp.targets) == 1 and first.dtype == gr.dtype:  # straight into the one destination
                first.addmm_(gr.t(), xr, alpha=sp.targets[0][1])
            else:  # once, then into each (an fp32 main_grad of bf16 weights included)
                w = gr.t().matmul(xr)
                for grad_of, c in sp.targets:
                    grad_of(weight).add_(w, alpha=c)
            if ctx.bias is not None:
                gb = gr.sum(0)
                for grad_of, c in sp.targets:
                    grad_of(ctx.bias).add_(gb, alpha=c)
        return gx, None, None, None, None


class _SplitScale(torch.autograd.Function):
    """x̂ ⊙ w (an RMSNorm's affine part) with w's gradient split by rows."""

    @staticmethod
    def forward(ctx, xhat, weight, plan):
        ctx.save_for_backward(xhat, weight)
        ctx.plan = plan
        return (xhat * weight).to(xhat.dtype)  # as torch's rms_norm: the input's dtype, whatever the weight's

    @staticmethod
    def backward(ctx, g):
        xhat, weight = ctx.saved_tensors
        prod = _rows_first(g * xhat)
        for sp in ctx.plan.targets():
            part = prod[sp.start:sp.end].sum((0, 1))
            for grad_of, c in sp.targets:
                grad_of(weight).add_(part, alpha=c)
        return (g * weight).to(xhat.dtype), None, None


class _SplitEmbedding(torch.autograd.Function):
    """F.embedding(ids [b = 1, s], weight) with the weight's gradient split by rows (positions)."""

    @staticmethod
    def forward(ctx, ids, weight, plan):
        ctx.save_for_backward(ids)
        ctx.plan, ctx.weight = plan, weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise AssertionError(f"row-split embedding needs ids of shape [1, s], got {tuple(ids.shape)}")
        flat_ids, g2 = ids[0], g[0]  # [s], [s, h]
        for sp in ctx.plan.targets():
            rows, gr = flat_ids[sp.start:sp.end], g2[sp.start:sp.end]
            for grad_of, c in sp.targets:
                gw = grad_of(ctx.weight)
                gw.index_add_(0, rows, gr.to(gw.dtype), alpha=c)
        return None, None, None


# ---------------------------------------------------------------------------------------------------- install
def _wrap_linear(mod) -> None:
    orig = mod._forward_impl

    def impl(*args, **kw):
        plan, w = _CURRENT, kw.get("weight")
        if plan is None or (w is not None and not w.requires_grad):  # a frozen weight has no gradient to split
            return orig(*args, **kw)
        if args or w is None or "input" not in kw:
            raise AssertionError("row-split: megatron-core's linear layers no longer call _forward_impl(input=, "
                                 "weight=, ...) as in 0.16 (model/row_split.py is the version-specific place)")
        x, weight = kw.pop("input"), kw.pop("weight")
        if kw.get("sequence_parallel") or kw.get("grad_output_buffer") is not None:
            raise ValueError("row-split weight gradients: sequence parallelism / deferred embedding wgrad unsupported")
        tp_group = None
        if kw.get("allreduce_dgrad"):
            from megatron.core import parallel_state

            tp_group = kw.get("tp_group") or parallel_state.get_tensor_model_parallel_group()
        return _SplitLinear.apply(x, weight, kw.get("bias"), plan, tp_group)

    mod._forward_impl = impl


def _wrap_forward(split):
    """``mod.forward`` runs ``split(mod, x, plan)`` while a plan is active, megatron's/torch's own forward otherwise."""
    def wrap(mod) -> None:
        orig = mod.forward

        def forward(x):
            plan = _CURRENT
            return orig(x) if plan is None else split(mod, x, plan)

        mod.forward = forward

    return wrap


@_wrap_forward
def _wrap_norm(mod, x, plan):
    return _SplitScale.apply(F.rms_norm(x, mod.normalized_shape, None, mod.eps), mod.weight, plan)


@_wrap_forward
def _wrap_embedding(mod, input_, plan):
    """``VocabParallelEmbedding.forward`` (0.16) without sequence parallelism (``install`` refuses it)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp = mod.tp_group.size() > 1
    ids = input_
    if tp:
        mask = (input_ < mod.vocab_start_index) | (input_ >= mod.vocab_end_index)
        ids = input_.clone() - mod.vocab_start_index
        ids[mask] = 0
    out = _SplitEmbedding.apply(ids, mod.weight, plan)
    if tp:
        out = out.masked_fill(mask.unsqueeze(-1), 0.0)
    return reduce_from_tensor_model_parallel_region(out, group=mod.tp_group)


def install(model: torch.nn.Module) -> None:
    """Wrap ``model``'s layers for row-split gradients (idempotent). Raises ValueError naming any trainable parameter
    the wrappers would not split, or a configuration they do not support."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    if getattr(model, "_row_split_installed", False):
        return
    cfg = getattr(model, "config", None)
    if cfg is not None and (getattr(cfg, "sequence_parallel", False) or
                            getattr(cfg, "defer_embedding_wgrad_compute", False)):
        raise ValueError("row-split weight gradients do not support --sequence-parallel")
    covered: set[int] = set()
    wraps = []
    for name, mod in model.named_modules():
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
            if mod.weight is not None:
                covered.add(id(mod.weight))
            bias = getattr(mod, "bias", None)
            if bias is not None and isinstance(mod, ColumnParallelLinear) and not mod.skip_bias_add:
                covered.add(id(bias))  # added inside _forward_impl
            wraps.append((_wrap_linear, mod))
        elif isinstance(mod, torch.nn.RMSNorm) and mod.weight is not None:
            covered.add(id(mod.weight))
            wraps.append((_wrap_norm, mod))
        elif isinstance(mod, VocabParallelEmbedding):
            if getattr(mod, "reduce_scatter_embeddings", False):
                raise ValueError("row-split weight gradients: sequence-parallel embeddings are not supported")
            covered.add(id(mod.weight))
            wraps.append((_wrap_embedding, mod))
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
    if missing:
        raise ValueError(f"row-split weight gradients cannot split the gradient of {missing[:4]} "
                         f"({len(missing)} parameter(s)): dense GPTs with RMSNorm only (no MoE, no LayerNorm biases)")
    for wrap, mod in wraps:
        wrap(mod)
    model._row_split_installed = True
