"""KL estimators, entropy and on-policy distillation identities."""

import math

import pytest
import torch

from megatron_tsync.algorithms import (
    PolicyLossConfig,
    entropy_from_logits,
    full_vocab_reverse_kl,
    kl_penalty,
    opd_advantages,
    opd_loss,
    policy_loss,
)


def _two_dists(seed: int, v: int = 8):
    gen = torch.Generator().manual_seed(seed)
    zp = torch.randn(v, generator=gen, dtype=torch.float64)
    zq = zp + 0.5 * torch.randn(v, generator=gen, dtype=torch.float64)
    return torch.log_softmax(zp, -1), torch.log_softmax(zq, -1), gen


def test_k1_and_k3_are_unbiased_kl_estimates():
    log_p, log_q, gen = _two_dists(0)
    kl_exact = float((log_p.exp() * (log_p - log_q)).sum())
    samples = torch.multinomial(log_p.exp(), 200_000, replacement=True, generator=gen)  # a ~ π_θ
    logp, ref = log_p[samples][None], log_q[samples][None]  # (1, S)
    for kind in ("k1", "k3", "kl", "low_var_kl"):
        est = float(kl_penalty(logp, ref, kind).mean())
        assert est == pytest.approx(kl_exact, rel=0.05), kind
    # exact expectations (no sampling noise)
    p = log_p.exp()
    for kind in ("k1", "k3"):
        assert float((p * kl_penalty(log_p, log_q, kind)).sum()) == pytest.approx(kl_exact, rel=1e-12)


def test_k2_k3_nonnegative_and_values():
    gen = torch.Generator().manual_seed(1)
    logp = torch.randn(4, 50, generator=gen) * 3
    ref = torch.randn(4, 50, generator=gen) * 3
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert (kl_penalty(logp, ref, "k2") >= 0).all()
    assert (kl_penalty(logp, logp, "k3") == 0).all()
    d = torch.tensor([[0.5]])
    assert float(kl_penalty(d, torch.zeros_like(d), "k1")) == pytest.approx(0.5)
    assert float(kl_penalty(d, torch.zeros_like(d), "k2")) == pytest.approx(0.125)
    assert float(kl_penalty(d, torch.zeros_like(d), "k3")) == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    with pytest.raises(ValueError, match="unknown kl kind"):
        kl_penalty(d, d, "k4")


def test_sequence_kl_is_the_masked_token_sum():
    from megatron_tsync.algorithms.kl import sequence_kl

    gen = torch.Generator().manual_seed(3)
    logp, ref = -torch.rand(3, 9, generator=gen, dtype=torch.float64) * 4, -torch.rand(3, 9, generator=gen,
                                                                                      dtype=torch.float64) * 4
    mask = (torch.rand(3, 9, generator=gen) < 0.6).double()
    for kind in ("k1", "k2", "k3"):
        got = sequence_kl(logp, ref, mask, kind)
        assert got.shape == (3,)
        want = [sum(float(kl_penalty(logp[b, t:t + 1], ref[b, t:t + 1], kind)) for t in range(9) if mask[b, t])
                for b in range(3)]
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-14, atol=1e-15)
    assert float(sequence_kl(logp, ref, torch.zeros_like(mask), "k3").abs().sum()) == 0.0


def test_kl_gradients_at_the_reference():
    """At log π = log π_ref: k2 and k3 have zero gradient, k1's is 1 per token whatever the reference — why a
    frozen initial reference moves the loss-mode gradient at θ0 only through k1."""
    gen = torch.Generator().manual_seed(4)
    ref = -torch.rand(2, 7, generator=gen, dtype=torch.float64) * 3
    for kind, want in (("k1", 1.0), ("k2", 0.0), ("k3", 0.0)):
        logp = ref.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(kl_penalty(logp, ref, kind).sum(), logp)
        assert torch.equal(g, torch.full_like(g, want)), kind
    logp = (ref + 0.3).requires_grad_(True)
    for other in (ref, ref - 1.0):
        (g,) = torch.autograd.grad(kl_penalty(logp, other, "k1").sum(), logp)
        assert torch.equal(g, torch.ones_like(g))


def test_entropy():
    for v in (2, 7, 4096):
        assert float(entropy_from_logits(torch.zeros(v))) == pytest.approx(math.log(v), rel=1e-6)
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 9, generator=gen, dtype=torch.float64) * 4  # (B, T, V)
    log_p = torch.log_softmax(logits, -1)
    h = entropy_from_logits(logits)
    assert h.shape == (3, 5)
    torch.testing.assert_close(h, -(log_p.exp() * log_p).sum(-1))
    torch.testing.assert_close(entropy_from_logits(logits + 100.0), h)
    one_hot = torch.full((9,), -1e4, dtype=torch.float64)
    one_hot[3] = 0.0
    assert float(entropy_from_logits(one_hot)) == pytest.approx(0.0, abs=1e-12)


def test_full_vocab_reverse_kl():
    gen = torch.Generator().manual_seed(3)
    s = torch.randn(4, 6, 17, generator=gen, dtype=torch.float64)
    t = torch.randn(4, 6, 17, generator=gen, dtype=torch.float64)
    kl = full_vocab_reverse_kl(s, t)
    assert kl.shape == (4, 6) and (kl >= 0).all()
    torch.testing.assert_close(full_vocab_reverse_kl(s, s), torch.zeros(4, 6, dtype=torch.float64))
    torch.testing.assert_close(full_vocab_reverse_kl(s, s + 3.0), torch.zeros(4, 6, dtype=torch.float64))
    ps, pt = torch.softmax(s, -1), torch.softmax(t, -1)
    torch.testing.assert_close(kl, (ps * (ps.log() - pt.log())).sum(-1))
    assert not torch.allclose(kl, full_vocab_reverse_kl(t, s))  # reverse, not forward, KL


def test_opd_advantages_and_loss():
    gen = torch.Generator().manual_seed(4)
    student = torch.randn(3, 8, generator=gen, dtype=torch.float64).requires_grad_()
    teacher = torch.randn(3, 8, generator=gen, dtype=torch.float64)
    mask = (torch.rand(3, 8, generator=gen) > 0.3).double()
    a = opd_advantages(student, teacher)
    assert not a.requires_grad
    torch.testing.assert_close(a, teacher - student.detach())
    # at ρ = 1 the per-token gradient is −w·a = w·(log π_s − log π_t)
    loss = opd_loss(student, student.detach(), teacher, mask)
    assert (loss[mask == 0] == 0).all()
    (g,) = torch.autograd.grad(loss.sum(), student)
    torch.testing.assert_close(g, mask * (student.detach() - teacher))
    # with a clipping config it is exactly the PPO loss with per-token advantages
    cfg = PolicyLossConfig(kind="ppo_clip", clip_low=0.2, clip_high=0.28)
    old = student.detach() + 0.4 * torch.randn(3, 8, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(opd_loss(student, old, teacher, mask, cfg=cfg),
                               policy_loss(student, old, opd_advantages(old, teacher), cfg) * mask)


def test_opd_gradient_is_the_reverse_kl_gradient_in_expectation():
    """Σ_a π_s(a) · ∇ℓ_OPD(a) at ρ = 1 equals ∇ KL(π_s ‖ π_t) exactly (score-function identity)."""
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(12, generator=gen, dtype=torch.float64).requires_grad_()
    zt = torch.randn(12, generator=gen, dtype=torch.float64)
    log_ps, log_pt = torch.log_softmax(z, -1), torch.log_softmax(zt, -1)
    per_action = opd_loss(log_ps[None], log_ps.detach()[None], log_pt[None], torch.ones(1, 12))  # (1, V)
    (g_opd,) = torch.autograd.grad((log_ps.detach().exp() * per_action[0]).sum(), z)
    (g_kl,) = torch.autograd.grad(full_vocab_reverse_kl(z, zt), z)
    torch.testing.assert_close(g_opd, g_kl, rtol=1e-12, atol=1e-14)


def test_k3_of_a_far_reference_is_finite():
    """k3 = exp(log r) − log r − 1 with log r = 1e4 overflowed to inf; its exponent is clamped (kl.py docstring).
    Control: near the reference it is the formula, bit for bit."""
    logp = torch.tensor([[-1e4, -1.0]], dtype=torch.float32, requires_grad=True)
    ref = torch.tensor([[-1.0, -1.2]], dtype=torch.float32)
    k3 = kl_penalty(logp, ref, "k3")
    (g,) = torch.autograd.grad(k3.sum(), logp)
    assert torch.isfinite(k3).all() and torch.isfinite(g).all() and float(k3[0, 0]) > 1e8
    lr = ref[0, 1] - logp[0, 1]
    assert torch.equal(k3[0, 1], torch.exp(lr) - lr - 1.0)
