"""The gated delta rule (Yang, Kautz & Hatamizadeh, "Gated Delta Networks", 2024, arXiv:2412.06464) in plain torch.

This is the sequence mixer of the linear-attention layers of a Qwen3.5-style hybrid (``transformers`` model type
``qwen3_5``, ``Qwen3_5GatedDeltaNet``; megatron-core's ``ssm/gated_delta_net.py``). It is pure tensor math: no
Megatron, no ``fla``, no dtype casts — float64 in, float64 out, so it serves as the CPU path and as the reference the
exactness tests compare against. (transformers' and megatron-core's own torch fallbacks cast to float32 internally.)

**The rule** (paper Eq. 10; per batch row and value head, S_t ∈ R^{Dv×Dk}):

    S_t = S_{t-1} · α_t (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,      α_t = exp(g_t) ∈ (0, 1],  β_t ∈ (0, 1)
    o_t = S_t (s · q_t),                                          s = scale, Dk^{-1/2} by default

**State layout.** The state is stored as ``M_t = S_tᵀ`` with shape (B, Hv, Dk, Dv), the layout of ``fla`` and of
transformers' cache, so a state from either can be passed in and ours handed back. In that layout

    M_t = α_t M_{t-1} + k_t u_tᵀ,   u_t = β_t (v_t − α_t M_{t-1}ᵀ k_t)        (the "delta": new value minus prediction)
    o_t = M_tᵀ (s q_t)

**Chunked form** (paper §3.3 / DeltaNet's WY representation, Yang et al. 2024b, with the UT transform). Split the
sequence into chunks of C steps; inside a chunk let c_t = Σ_{j≤t} g_j (cumulative log decay from the chunk start),
Γ_t = exp(c_t), M_0 the state entering the chunk. Unrolling the recurrence,

    M_t = Γ_t M_0 + Σ_{j≤t} (Γ_t/Γ_j) k_j u_jᵀ,
    u_t = β_t v_t − β_t Γ_t M_0ᵀ k_t − Σ_{j<t} β_t (Γ_t/Γ_j)(k_tᵀ k_j) u_j,

i.e. (I + A) U = diag(β) V − diag(βΓ) K M_0 with A strictly lower triangular, A_tj = β_t (Γ_t/Γ_j) k_tᵀk_j. With
T = (I + A)^{-1} (the UT transform, one unit-triangular solve per chunk, independent of the state):

    U   = T diag(β) V − (T diag(βΓ) K) M_0                       (C, Dv)
    O   = diag(Γ) (sQ) M_0 + ((sQ Kᵀ) ⊙ D) U,   D_tj = Γ_t/Γ_j for j ≤ t, else 0
    M_C = Γ_C M_0 + (diag(Γ_C/Γ) K)ᵀ U

All intra-chunk terms are computed for every chunk at once; only the C-to-C state hand-off is a Python loop
(T/C steps). A sequence whose length is not a multiple of C is padded with steps that have k = v = 0, β = 0, g = 0,
which leave the state unchanged, so the final state is exact too.

**Heads.** ``q``/``k`` have Hk heads, ``v``/``g``/``beta`` Hv = r·Hk heads; value head h reads key head h // r
(``repeat_interleave``, as transformers and megatron-core do).

**Deviations / not here.** The layer around the rule (the short causal conv1d, q/k L2 normalisation, the gated
RMSNorm output, the projections) is not in this module except for the two small helpers ``l2norm`` and
``decay_and_beta`` whose formulas the layer uses. No variable-length (``cu_seqlens``) packing: one sequence per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["l2norm", "decay_and_beta", "recurrent_gated_delta_rule", "chunk_gated_delta_rule"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim — the q/k normalisation of ``fla`` and transformers (eps inside)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def decay_and_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """The Qwen3.5 / megatron-core gate parametrisation: ``g = −exp(A_log) · softplus(a + dt_bias)``, ``β = σ(b)``.

    a, b: (B, T, Hv) projections of the hidden states; A_log, dt_bias: (Hv,). Returns (g, beta), each (B, T, Hv), in
    the dtype of ``a`` (no float32 cast). g ≤ 0 is the log of the per-step decay α_t.
    """
    g = -A_log.exp() * F.softplus(a + dt_bias)  # (B, T, Hv)
    return g, torch.sigmoid(b)


def _check(q, k, v, g, beta, initial_state):
    B, T, Hk, Dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape (B, T, Hk, Dk)")
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be (B={B}, T={T}, Hv, Dv), got {tuple(v.shape)}")
    Hv, Dv = v.shape[2], v.shape[3]
    if Hv % Hk:
        raise ValueError(f"value heads Hv={Hv} must be a multiple of key heads Hk={Hk}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, Hv):
            raise ValueError(f"{name} must be (B={B}, T={T}, Hv={Hv}), got {tuple(t.shape)}")
    if initial_state is not None and initial_state.shape != (B, Hv, Dk, Dv):
        raise ValueError(f"initial_state must be (B={B}, Hv={Hv}, Dk={Dk}, Dv={Dv}), got {tuple(initial_state.shape)}")
    return Hv // Hk


def _heads_first(q, k, v, g, beta, rep, scale):
    """(B, T, H, D) → (B, Hv, T, D), key heads repeated to the value heads, q scaled."""
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return (q.transpose(1, 2) * scale, k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2))


def recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None):
    """The rule one step at a time — the decode path (T is usually 1) and a readable reference.

    q, k: (B, T, Hk, Dk); v: (B, T, Hv, Dv); g (log decay, ≤ 0), beta: (B, T, Hv);
    initial_state: (B, Hv, Dk, Dv) or None (zeros). Returns (o (B, T, Hv, Dv), final_state (B, Hv, Dk, Dv)).
    """
    rep = _check(q, k, v, g, beta, initial_state)
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, rep, scale)  # (B, Hv, T, ·)
    B, Hv, T, Dk = k.shape
    M = v.new_zeros(B, Hv, Dk, v.shape[-1]) if initial_state is None else initial_state  # (B, Hv, Dk, Dv)
    outs = []
    for t in range(T):
        M = M * g[:, :, t, None, None].exp()
        kt = k[:, :, t]  # (B, Hv, Dk)
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", M, kt))  # (B, Hv, Dv)
        M = M + kt[..., :, None] * u[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", M, q[:, :, t]))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, Hv, v.shape[-1])  # (B, T, Hv, Dv)
    return o, M


def chunk_gated_delta_rule(q, k, v, g, beta, *, chunk_size=64, scale=None, initial_state=None):
    """The chunked (WY / UT-transform) form — the training path; equal to ``recurrent_gated_delta_rule``.

    Same arguments and returns as ``recurrent_gated_delta_rule`` plus ``chunk_size`` C ≥ 1 (any T; the tail is padded
    with identity steps). Cost O(T·C·(Dk+Dv) + T·Dk·Dv) per head, T/C sequential state hand-offs.
    """
    rep = _check(q, k, v, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, rep, scale)  # (B, Hv, T, ·)
    B, Hv, T, Dk = k.shape
    Dv, C = v.shape[-1], chunk_size
    pad = (-T) % C
    if pad:  # identity steps: k = v = 0, β = 0, g = 0
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    N = (T + pad) // C
    if N == 0:  # empty sequence: no output, the state passes through
        M = q.new_zeros(B, Hv, Dk, Dv) if initial_state is None else initial_state
        return v.new_zeros(B, 0, Hv, Dv), M
    q, k, v = (x.reshape(B, Hv, N, C, x.shape[-1]) for x in (q, k, v))  # (B, Hv, N, C, D)
    g, beta = g.reshape(B, Hv, N, C), beta.reshape(B, Hv, N, C)

    c = g.cumsum(dim=-1)  # (B, Hv, N, C) log Γ_t within each chunk
    diff = c[..., :, None] - c[..., None, :]  # (B, Hv, N, C, C) log Γ_t/Γ_j
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D = diff.masked_fill(~lower, float("-inf")).exp()  # Γ_t/Γ_j for j ≤ t, 0 above (no overflow)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    kk = k @ k.transpose(-1, -2)  # (B, Hv, N, C, C)
    I_plus_A = eye + (beta[..., None] * kk * D) * (1 - eye)  # unit lower triangular
    U0 = torch.linalg.solve_triangular(I_plus_A, beta[..., None] * v, upper=False, unitriangular=True)  # (.., C, Dv)
    W = torch.linalg.solve_triangular(I_plus_A, (beta * c.exp())[..., None] * k, upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * D  # (B, Hv, N, C, C)
    q_dec = q * c.exp()[..., None]  # diag(Γ) sQ
    k_dec = k * (c[..., -1:] - c).exp()[..., None]  # diag(Γ_C/Γ) K
    chunk_decay = c[..., -1].exp()[..., None, None]  # (B, Hv, N, 1, 1) Γ_C

    M = q.new_zeros(B, Hv, Dk, Dv) if initial_state is None else initial_state  # (B, Hv, Dk, Dv)
    outs = []
    for n in range(N):
        U = U0[:, :, n] - W[:, :, n] @ M  # (B, Hv, C, Dv)
        outs.append(q_dec[:, :, n] @ M + attn[:, :, n] @ U)
        M = chunk_decay[:, :, n] * M + k_dec[:, :, n].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2).reshape(B, Hv, N * C, Dv)[:, :, :T]  # (B, Hv, T, Dv)
    return o.transpose(1, 2), M
