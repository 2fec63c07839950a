"""The gated delta rule (megatron_tsync/model/gated_delta.py) against a recurrence written here, in float64.

The reference ``_paper_loop`` is the paper's Eq. 10 taken literally — S_t ∈ R^{Dv×Dk}, an explicit
``α_t (I − β_t k_t k_tᵀ)`` matrix, one head and one batch row at a time — so it shares no code and no layout trick with
the module (which keeps Sᵀ and never forms I − βkkᵀ). Checks:

- chunked == loop ≤ 1e-12 relative: several chunk sizes, T not a multiple of C, with/without an initial state, grouped
  value heads (Hv = 2·Hk), the final state too; and the module's own step-by-step path == loop;
- gradients (q, k, v, g, β, initial state) through the chunked form == through the loop ≤ 1e-12;
- prefill (chunked) then decode one token at a time with the carried state == the full sequence;
- transformers' ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` (qwen3_5) and megatron-core's
  ``torch_chunk_gated_delta_rule`` agree — they cast to float32 internally, so at float32 tolerance (skipped where not
  importable);
- controls that must move: a wrong decay convention (exp(g) applied after the update) and a dropped β are detected.
"""

import importlib

import pytest
import torch

from megatron_tsync.model.gated_delta import (
    chunk_gated_delta_rule,
    decay_and_beta,
    l2norm,
    recurrent_gated_delta_rule,
)

TOL = 1e-12


def _paper_loop(q, k, v, g, beta, scale=None, S0=None, decay_after=False, use_beta=True):
    """Eq. 10 literally. q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); S0 in the fla layout (B, Hv, Dk, Dv)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    scale = Dk**-0.5 if scale is None else scale
    eye = torch.eye(Dk, dtype=q.dtype)
    out = [[None] * Hv for _ in range(B)]
    final = [[None] * Hv for _ in range(B)]
    for b in range(B):
        for h in range(Hv):
            hk = h // (Hv // Hk)
            S = torch.zeros(Dv, Dk, dtype=q.dtype) if S0 is None else S0[b, h].T
            o_h = []
            for t in range(T):
                kt, vt, qt = k[b, t, hk], v[b, t, h], q[b, t, hk]
                alpha = torch.exp(g[b, t, h])
                bt = beta[b, t, h] if use_beta else 1.0
                if decay_after:
                    S = (S @ (eye - bt * torch.outer(kt, kt)) + bt * torch.outer(vt, kt)) * alpha
                else:
                    S = S @ (alpha * (eye - bt * torch.outer(kt, kt))) + bt * torch.outer(vt, kt)
                o_h.append(S @ (scale * qt))
            out[b][h] = torch.stack(o_h) if o_h else torch.zeros(0, Dv, dtype=q.dtype)
            final[b][h] = S.T
    o = torch.stack([torch.stack(row, dim=1) for row in out])  # (B, T, Hv, Dv)
    return o, torch.stack([torch.stack(row) for row in final])  # (B, Hv, Dk, Dv)


def _inputs(B=2, T=11, Hk=2, Hv=4, Dk=5, Dv=3, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = l2norm(r(B, T, Hk, Dk)), l2norm(r(B, T, Hk, Dk))
    v = r(B, T, Hv, Dv)
    g, beta = decay_and_beta(r(B, T, Hv), r(B, T, Hv), r(Hv) * 0.5, r(Hv))
    S0 = r(B, Hv, Dk, Dv)
    xs = [q, k, v, g, beta, S0]
    if requires_grad:
        xs = [x.detach().requires_grad_() for x in xs]
    return xs


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 16])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_paper_loop(chunk_size, with_state):
    q, k, v, g, beta, S0 = _inputs(T=11)  # 11 is a multiple of none of 3, 4, 16
    S0 = S0 if with_state else None
    o_ref, s_ref = _paper_loop(q, k, v, g, beta, S0=S0)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=S0)
    assert o.shape == o_ref.shape == (2, 11, 4, 3) and s.shape == (2, 4, 5, 3)
    assert _rel(o, o_ref) <= TOL and _rel(s, s_ref) <= TOL
    o2, s2 = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S0)
    assert _rel(o2, o_ref) <= TOL and _rel(s2, s_ref) <= TOL


def test_custom_scale_and_empty_sequence():
    q, k, v, g, beta, S0 = _inputs(T=6, Hk=3, Hv=3)
    o_ref, s_ref = _paper_loop(q, k, v, g, beta, scale=0.7, S0=S0)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, scale=0.7, initial_state=S0)
    assert _rel(o, o_ref) <= TOL and _rel(s, s_ref) <= TOL
    o, s = chunk_gated_delta_rule(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], initial_state=S0)
    assert o.shape == (2, 0, 3, 3) and torch.equal(s, S0)


def test_controls_move():
    """A wrong decay placement or a dropped β changes the loop's answer by far more than the tolerance."""
    q, k, v, g, beta, S0 = _inputs(T=7)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=S0)
    assert _rel(o, _paper_loop(q, k, v, g, beta, S0=S0, decay_after=True)[0]) > 1e-3
    assert _rel(o, _paper_loop(q, k, v, g, beta, S0=S0, use_beta=False)[0]) > 1e-3


@pytest.mark.parametrize("chunk_size", [3, 8])
def test_gradients_equal_paper_loop(chunk_size):
    xs = _inputs(B=1, T=9, Hk=1, Hv=2, Dk=4, Dv=3, seed=1, requires_grad=True)
    gen = torch.Generator().manual_seed(2)
    w_o = torch.randn(1, 9, 2, 3, generator=gen, dtype=torch.float64)
    w_s = torch.randn(1, 2, 4, 3, generator=gen, dtype=torch.float64)

    def grads(fn):
        o, s = fn(*xs)
        return torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), xs)

    ref = grads(lambda q, k, v, g, b, S0: _paper_loop(q, k, v, g, b, S0=S0))
    got = grads(lambda q, k, v, g, b, S0: chunk_gated_delta_rule(q, k, v, g, b, chunk_size=chunk_size,
                                                                 initial_state=S0))
    for name, a, b in zip(("q", "k", "v", "g", "beta", "S0"), got, ref):
        assert _rel(a, b) <= TOL, name


def test_prefill_then_decode_equals_full_sequence():
    q, k, v, g, beta, S0 = _inputs(T=13)
    o_full, s_full = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=S0)
    P = 6
    o_pre, state = chunk_gated_delta_rule(q[:, :P], k[:, :P], v[:, :P], g[:, :P], beta[:, :P], chunk_size=4,
                                          initial_state=S0)
    outs = [o_pre]
    for t in range(P, 13):
        sl = slice(t, t + 1)
        o_t, state = recurrent_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                                initial_state=state)
        outs.append(o_t)
    assert _rel(torch.cat(outs, dim=1), o_full) <= TOL and _rel(state, s_full) <= TOL


def test_bad_shapes_are_refused():
    q, k, v, g, beta, S0 = _inputs(Hk=3, Hv=4)
    with pytest.raises(ValueError, match="multiple of key heads"):
        chunk_gated_delta_rule(q, k, v, g, beta)
    q, k, v, g, beta, S0 = _inputs()
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=S0[:, :, :, :2])
    with pytest.raises(ValueError, match="beta must be"):
        recurrent_gated_delta_rule(q, k, v, g, beta[:, :-1])


def _transformers_qwen3_5():
    try:
        return importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    except ImportError:
        pytest.skip("transformers has no qwen3_5")


@pytest.mark.parametrize("with_state", [False, True])
def test_equals_transformers_torch_fallback(with_state):
    """transformers' fallbacks compute in float32 whatever the input dtype: float32 tolerance here."""
    m = _transformers_qwen3_5()
    q, k, v, g, beta, S0 = _inputs(T=21, Dk=8, Dv=6)
    S0 = S0 if with_state else None
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, initial_state=S0)
    kw = dict(g=g, beta=beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=False)
    for fn, extra in ((m.torch_chunk_gated_delta_rule, {"chunk_size": 8}), (m.torch_recurrent_gated_delta_rule, {})):
        o_hf, s_hf = fn(q, k, v, **kw, **extra)
        assert _rel(o_hf.double(), o) <= 1e-5 and _rel(s_hf.double(), s) <= 1e-5, fn.__name__
    # the layer's in-kernel L2 norm is the same formula as ours
    o_hf, _ = m.torch_chunk_gated_delta_rule(q * 3.0, k * 2.0, v, **{**kw, "use_qk_l2norm_in_kernel": True})
    assert _rel(o_hf.double(), o) <= 1e-5


def test_equals_megatron_core_torch_fallback():
    """megatron-core's deterministic-mode fallback (``ssm/gated_delta_net.py``; float32 inside, heads already repeated
    by its layer, so Hk = Hv here): float32 tolerance."""
    try:
        m = importlib.import_module("megatron.core.ssm.gated_delta_net")
    except ImportError as e:
        pytest.skip(f"megatron.core.ssm.gated_delta_net not importable ({e})")
    q, k, v, g, beta, S0 = _inputs(T=21, Hk=4, Hv=4, Dk=8, Dv=6)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, initial_state=S0)
    o_mc, s_mc = m.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, initial_state=S0,
                                                output_final_state=True)
    assert _rel(o_mc.double(), o) <= 1e-5 and _rel(s_mc.double(), s) <= 1e-5


def test_strong_decay_underflows_cleanly():
    """Per-step log decays down to −6000: exp of the in-chunk cumulative decay underflows to 0 (never overflows: every
    exponent the chunked form takes is ≤ 0), and the result still equals the loop."""
    q, k, v, g, beta, S0 = _inputs(T=40)
    o_ref, s_ref = _paper_loop(q, k, v, g * 1000, beta, S0=S0)
    o, s = chunk_gated_delta_rule(q, k, v, g * 1000, beta, chunk_size=16, initial_state=S0)
    assert o.isfinite().all() and _rel(o, o_ref) <= TOL and _rel(s, s_ref) <= TOL
