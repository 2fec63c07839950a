"""The modules of a Qwen3.5-style hybrid layer that megatron-core's local spec lacks (model/qwen35.py builds the spec).

- :class:`GatedDeltaNetLayer` — megatron-core's own ``ssm.gated_delta_net.GatedDeltaNet`` (its parameters, their TP
  sharding, initialisation and ``sharded_state_dict`` are used as they are) with a forward of ours. megatron-core
  0.16.1's forward cannot serve here as written: its constructor refuses to run without ``fla`` (GPU Triton
  kernels), and its forward casts the decay input (``alpha.float()``) and the output gate (``gate.float()``) to
  float32 whatever the model's dtype — float32 rounding in float64 logits (not measured: that forward cannot run
  here without ``fla``; transformers' equivalent casts give ~1e-7). The forward below computes
  the same layer (in_proj → causal depthwise conv1d + SiLU → L2-normalised q/k → gated delta rule → RMSNorm(o) ·
  SiLU(z) → out_proj) in ``promote(dtype, float32)``, with the rule from :mod:`megatron_tsync.model.gated_delta`
  (the chunked WY form; float64 in, float64 out) on CPU and in float64, and ``fla``'s Triton kernel on a GPU where
  it is importable (bf16/fp32; not run on a GPU yet). It also takes what megatron's refuses: a block-diagonal causal
  mask or THD ``PackedSeqParams`` (sequence packing: conv and recurrent state restart at every segment), left padding
  (the embedded engine's: pad positions are zeroed before in_proj, as transformers does, which leaves the state at
  exactly 0 until a row's first token) and megatron's inference context (generation).
- :class:`ZeroCenteredRMSNorm` — Qwen3.5's RMSNorm ``x / rms(x) · (1 + w)`` (weights stored around 0, as in the
  checkpoint: conversion copies them bit for bit); megatron's local ``WrappedTorchNorm`` refuses
  ``layernorm_zero_centered_gamma``.
- :class:`PlainRMSNorm` — the gated norm's ``x / rms(x) · w`` (Qwen3.5's ``RMSNormGated`` is not zero-centred).
- :class:`OutputGatedSelfAttention` — megatron's ``SelfAttention`` (``attention_output_gate``: q_proj carries a
  per-head gate, ``o · σ(gate)`` before ``linear_proj``) whose gate is computed in ``promote(dtype, float32)``
  instead of megatron's float32.

``extend(h, state)`` runs the layer on the next tokens of one sequence from a carried state (the last K − 1 conv
inputs and the recurrent state, both autograd tensors): the linear layers' counterpart of kept K/V, used by
``model.incremental.IncrementalGPT`` (OPD's turn-level streaming, the teacher scorer); with megatron's inference
context (the embedded engine) the same state is kept in the context's KV memory. Not here: context and sequence
parallelism (refused when the spec is built).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from megatron_tsync.model import gated_delta

__all__ = ["GatedDeltaNetLayer", "ZeroCenteredRMSNorm", "PlainRMSNorm", "output_gated_self_attention_class"]


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The compute dtype of gates and decays: float32 for bf16/fp16/fp32 models, float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)


class ZeroCenteredRMSNorm(torch.nn.Module):
    """``x · rsqrt(mean(x²) + eps) · (1 + w)`` over the last dim, w initialised to 0 (Qwen3.5's ``Qwen3_5RMSNorm``);
    computed in ``promote(dtype, float32)``, returned in the input dtype. Same constructor as megatron's norms."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_):
        super().__init__()
        dtype = config.params_dtype if config is not None else None
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(_wide(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(h.dtype))).to(x.dtype)


class PlainRMSNorm(torch.nn.Module):
    """``x · rsqrt(mean(x²) + eps) · w`` over the last dim, w initialised to 1 (the gated norm of the linear-attention
    layers); computed in ``promote(dtype, float32)``.

    ``grad_sum_group``: a TP group over which the weight's gradient is summed in the backward. The norm is applied
    per value head and each TP rank holds its own heads, so each rank's gradient of the replicated weight is a partial
    sum (megatron's ``finalize_model_grads`` sums only q/k layernorms and sequence-parallel norms over TP)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_):
        super().__init__()
        dtype = config.params_dtype if config is not None else None
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.grad_sum_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(_wide(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight
        if self.grad_sum_group is not None and torch.is_grad_enabled():
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

            w = copy_to_tensor_model_parallel_region(w, group=self.grad_sum_group)  # identity; backward: sum
        return (w.to(h.dtype) * h).to(x.dtype)


_GATED_ATTENTION = None


def output_gated_self_attention_class():
    """megatron's ``SelfAttention`` with the output gate ``o · σ(gate)`` in ``promote(dtype, float32)``."""
    global _GATED_ATTENTION
    if _GATED_ATTENTION is None:
        from megatron.core.transformer.attention import SelfAttention

        def _apply_output_gate(self, x, gate):
            wide = _wide(x.dtype)
            gate = gate.contiguous().view(*x.shape)
            return (x.to(wide) * torch.sigmoid(gate.to(wide))).to(x.dtype)

        _GATED_ATTENTION = type("OutputGatedSelfAttention", (SelfAttention,),
                                {"_apply_output_gate": _apply_output_gate, "__module__": __name__})
    return _GATED_ATTENTION


@contextlib.contextmanager
def _without_fla_check():
    """megatron-core's ``GatedDeltaNet.__init__`` raises ImportError when ``fla`` is missing (its forward imports the
    kernel); ours does not use that forward, so the check is passed for the constructor only."""
    import megatron.core.ssm.gated_delta_net as gdn

    saved = gdn.HAVE_FLA
    gdn.HAVE_FLA = True
    try:
        yield
    finally:
        gdn.HAVE_FLA = saved


def _fla_rule():
    """``fla``'s chunked kernel where it can run (a GPU and the package), else None."""
    if not torch.cuda.is_available():
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


_MASK_ERROR = ("qwen3_5 linear-attention layers take causal sequences: no mask, a block-diagonal causal (packed) "
               "mask, THD packing or left padding (the embedded engine's); another mask is refused")


def _left_padding(mask: torch.Tensor) -> torch.Tensor | None:
    """(B, S) True at pad positions when ``mask`` ((B, 1, S, S), True = masked) is causal with each row's first
    positions hidden as keys (the embedded engine's left-padded prompts); None for any other mask."""
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != mask.shape[3]:
        return None
    pad = mask[:, 0, -1, :]  # (B, S) keys the last query does not see: the padding
    s = mask.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).triu(1)
    if not torch.equal(mask[:, 0], causal[None] | pad[:, None, :]) or bool((pad[:, 1:] & ~pad[:, :-1]).any()):
        return None
    return pad


def _layout(attention_mask, packed_seq_params, length: int):
    """(lengths of the independent sequences along the sequence dim, left-padding (B, S) or None)."""
    if packed_seq_params is not None:
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        bounds = [int(x) for x in cu.tolist()]
        return [b - a for a, b in zip(bounds, bounds[1:]) if b > a], None
    if attention_mask is None:
        return [length], None
    from megatron_tsync.model.compat.attention import _causal_segments

    segs = _causal_segments(attention_mask)
    if segs is not None:
        return [b - a for a, b in segs], None
    pad = _left_padding(attention_mask)
    if pad is None:
        raise ValueError(_MASK_ERROR)
    return [length], pad


def _zero_padding(hidden_states, pad):
    """(S, B, H) with the pad positions zeroed: in_proj (no bias) and the conv then give exact zeros there, so q, k,
    v = 0 and the state stays exactly 0 until the row's first real token — as if the row started there."""
    if pad is None or not bool(pad.any()):
        return hidden_states
    return hidden_states * (~pad).t().unsqueeze(-1).to(hidden_states.dtype)


def _gdn_class():
    """The layer class, made on first use (importing megatron-core's module imports megatron)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    class GatedDeltaNetLayer(GatedDeltaNet):
        __doc__ = _LAYER_DOC
        chunk_size = 64

        def __init__(self, *args, **kwargs):
            with _without_fla_check():
                super().__init__(*args, **kwargs)
            if self.tp_size > 1:  # per-head norm over this rank's heads: its weight gradient summed over TP
                self.out_norm.grad_sum_group = self.pg_collection.tp

        forward = _forward
        extend = _extend
        _cached = _cached_forward
        _project, _output, _mix = _project, _output, _mix_segment

    GatedDeltaNetLayer.__module__ = __name__
    return GatedDeltaNetLayer


_LAYER_DOC = """megatron-core's ``GatedDeltaNet`` with this module's forward (module docstring): float64-exact, the
    torch rule on CPU, ``fla`` on a GPU, sequence packing. Parameters as megatron's: ``in_proj`` ([q; k; v; z; b; a]
    rows of this TP rank), ``conv1d`` (depthwise over [q; k; v]), ``A_log``, ``dt_bias``, ``out_norm``, ``out_proj``."""


def _forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
             attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None,
             **kwargs):
    """(S, B, H) → ((S, B, H), None). The recurrent state restarts at every packed segment; left-padded rows start
    at their first real token. With megatron's ``inference_context`` (the embedded engine) the layer's state lives
    in the context's ``key_value_memory_dict`` (:func:`_cached_forward`)."""
    ctx = inference_context if inference_context is not None else inference_params
    if ctx is not None:
        return self._cached(hidden_states, attention_mask, ctx)
    lengths, pad = _layout(attention_mask, packed_seq_params, hidden_states.shape[0])
    qkv, z, b, a = self._project(_zero_padding(hidden_states, pad))
    parts = zip(*(torch.split(t, lengths, dim=1) for t in (qkv, b, a)))
    o = torch.cat([self._mix(*p)[0] for p in parts], dim=1)  # (B, S, Hv_local, Dv)
    return self._output(o, z, hidden_states.dtype)


def _cached_forward(self, hidden_states, attention_mask, ctx):
    """The embedded engine's cached forward: the recurrent state is this layer's "KV cache". Prefill (no entry for
    this layer yet): left-padded prompts from a zero state; decode: each row continues from its entry. The entry
    is stored under the layer number in ``ctx.key_value_memory_dict`` with the rows in dim 1, the layout of
    megatron's K/V memory, so the engine's dropping of finished rows (``m[:, kept]``) re-indexes it too:
    (conv tail (C_local, B, K − 1), recurrent state (Hv_local, B, Dk, Dv))."""
    store = ctx.key_value_memory_dict
    entry = store.get(self.layer_number)
    state = None if entry is None else tuple(t.transpose(0, 1) for t in entry)
    if state is None and attention_mask is not None:
        pad = _left_padding(attention_mask)
        if pad is None:
            raise ValueError(_MASK_ERROR)
        hidden_states = _zero_padding(hidden_states, pad)
    qkv, z, b, a = self._project(hidden_states)
    o, state = self._mix(qkv, b, a, state)
    store[self.layer_number] = tuple(t.transpose(0, 1) for t in state)
    return self._output(o, z, hidden_states.dtype)


def _extend(self, hidden_states, state=None):
    """The layer on new tokens of one sequence continuing from ``state`` (None: the sequence starts here), the
    linear-attention counterpart of a KV cache, kept as autograd tensors (IncrementalGPT). (S, B, H) →
    ((S, B, H), new state); the state is (the last K − 1 conv inputs (B, C_local, K − 1), the recurrent state
    (B, Hv_local, Dk, Dv))."""
    qkv, z, b, a = self._project(hidden_states)
    o, state = self._mix(qkv, b, a, state)
    out, bias = self._output(o, z, hidden_states.dtype)
    return (out if bias is None else out + bias), state


def _project(self, hidden_states):
    """in_proj, split: qkv (B, S, C_local), z (B, S, v_dim / TP), b and a (B, S, Hv_local)."""
    proj, _ = self.in_proj(hidden_states)  # (S, B, in_dim / TP)
    proj = proj.transpose(0, 1)  # (B, S, ·)
    hv = self.num_v_heads_local_tp
    return torch.split(proj, [self.conv_dim_local_tp, self.v_dim // self.tp_size, hv, hv], dim=-1)


def _output(self, o, z, dtype):
    """RMSNorm(o) · SiLU(z), out_proj: o (B, S, Hv_local, Dv) → ((S, B, H), bias)."""
    batch, seq = o.shape[:2]
    wide = _wide(o.dtype)
    y = self.out_norm(o.to(wide)) * F.silu(z.reshape(o.shape).to(wide))  # (B, S, Hv_local, Dv)
    y = y.to(dtype).reshape(batch, seq, -1).transpose(0, 1).contiguous()  # (S, B, v_dim / TP)
    return self.out_proj(y)


def _mix_segment(self, qkv, b, a, state=None):
    """One sequence (or its next tokens, from ``state``): causal conv1d + SiLU, L2-normalised q/k, the gated delta
    rule. qkv (B, T, C_local), b / a (B, T, Hv_local) → (o (B, T, Hv_local, Dv), new state, see ``_extend``)."""
    batch, t = qkv.shape[:2]
    k_conv = self.conv_kernel_dim
    x = qkv.transpose(1, 2)  # (B, C, T)
    tail, m0 = state if state is not None else (x.new_zeros(batch, x.shape[1], k_conv - 1), None)
    x = torch.cat([tail, x], dim=-1)  # (B, C, K - 1 + T): the zero tail is the conv's causal padding
    conv = F.conv1d(x, self.conv1d.weight, self.conv1d.bias, groups=x.shape[1])  # (B, C, T)
    conv = F.silu(conv).transpose(1, 2)  # (B, T, C)
    qk = self.qk_dim // self.tp_size
    q, k, v = torch.split(conv, [qk, qk, self.v_dim // self.tp_size], dim=-1)
    q = gated_delta.l2norm(q.reshape(batch, t, -1, self.key_head_dim))  # (B, T, Hk_local, Dk)
    k = gated_delta.l2norm(k.reshape(batch, t, -1, self.key_head_dim))
    v = v.reshape(batch, t, -1, self.value_head_dim)  # (B, T, Hv_local, Dv)
    wide = _wide(v.dtype)
    g, beta = gated_delta.decay_and_beta(a.to(wide), b.to(wide), self.A_log.to(wide), self.dt_bias.to(wide))
    fla = _fla_rule() if v.dtype != torch.float64 else None
    if fla is not None:  # megatron's call: heads repeated to the value heads, q/k already normalised
        rep = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        o, m1 = fla(q.contiguous(), k.contiguous(), v.contiguous(), g=g, beta=beta.to(v.dtype),
                    initial_state=m0, output_final_state=True, use_qk_l2norm_in_kernel=False)
    else:
        o, m1 = gated_delta.chunk_gated_delta_rule(q.to(wide), k.to(wide), v.to(wide), g, beta,
                                                   chunk_size=self.chunk_size, initial_state=m0)
    return o.to(v.dtype), (x[..., x.shape[-1] - (k_conv - 1):], m1)


def __getattr__(name: str):
    if name == "GatedDeltaNetLayer":
        cls = _gdn_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
