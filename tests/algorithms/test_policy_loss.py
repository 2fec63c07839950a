"""Policy loss reference, gradient masks and the reward-free surrogate: ∇ℓ(A) == A·∇s(sign A)."""

import pytest
import torch

from megatron_tsync.algorithms import (
    PolicyLossConfig,
    gradient_mask,
    importance_ratio,
    policy_loss,
    sign_free,
    surrogate,
    tis_weight,
)

CONFIGS = {
    "ppo_sym": PolicyLossConfig(kind="ppo_clip", clip_low=0.2, clip_high=0.2),
    "ppo_asym": PolicyLossConfig(kind="ppo_clip", clip_low=0.2, clip_high=0.28),
    "ppo_dual": PolicyLossConfig(kind="ppo_clip", clip_low=0.2, clip_high=0.28, dual_clip=1.6),
    "ppo_dual_tight": PolicyLossConfig(kind="ppo_clip", clip_low=0.1, clip_high=0.3, dual_clip=1.2),
    "none": PolicyLossConfig(kind="none"),
    "none_tis": PolicyLossConfig(kind="none", tis_cap=1.5),
    "ppo_tis": PolicyLossConfig(kind="ppo_clip", clip_low=0.2, clip_high=0.28, dual_clip=3.0, tis_cap=1.5),
}


def _inputs(seed: int, b: int = 6, t: int = 40):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(b, t, generator=gen, dtype=torch.float64) - 2.0  # (B, T)
    logp = (old + 0.5 * torch.randn(b, t, generator=gen, dtype=torch.float64)).requires_grad_()  # ratios ~ e^N(0,.25)
    behaviour = old + 0.4 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    return logp, old, behaviour


def _grad(f, logp):
    (g,) = torch.autograd.grad(f.sum(), logp)
    return g


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("adv", [1.7, -0.9, 3e-3, -250.0])
def test_surrogate_gradient_scalar_advantage(name, adv):
    cfg = CONFIGS[name]
    logp, old, behaviour = _inputs(seed=len(name))
    if cfg.clipped:
        assert not sign_free(importance_ratio(logp, old), cfg)  # ratios really leave the band
    sign = 1 if adv > 0 else -1
    a = torch.full((logp.shape[0],), adv, dtype=torch.float64)
    g_loss = _grad(policy_loss(logp, old, a, cfg, behaviour), logp)
    g_sur = _grad(surrogate(logp, old, sign, cfg, behaviour), logp)
    torch.testing.assert_close(g_loss, adv * g_sur, rtol=1e-13, atol=1e-15)
    if cfg.clipped:  # the wrong sign's mask gives a different gradient: the test can fail
        g_wrong = _grad(surrogate(logp, old, -sign, cfg, behaviour), logp)
        assert (g_loss - adv * g_wrong).abs().max() > 1e-3 * min(1.0, abs(adv))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_surrogate_gradient_per_row_signs(name):
    cfg = CONFIGS[name]
    logp, old, behaviour = _inputs(seed=100 + len(name))
    a = torch.tensor([2.0, -1.0, 0.5, -3.0, 0.0, 1.0], dtype=torch.float64)  # (B,)
    signs = torch.sign(a).long().unsqueeze(-1)  # (B, 1)
    g_loss = _grad(policy_loss(logp, old, a, cfg, behaviour), logp)
    g_sur = _grad(surrogate(logp, old, signs, cfg, behaviour), logp)
    torch.testing.assert_close(g_loss, a.unsqueeze(-1) * g_sur, rtol=1e-13, atol=1e-15)


def test_policy_loss_hand_values():
    cfg = PolicyLossConfig(kind="ppo_clip", clip_low=0.2, clip_high=0.3, dual_clip=2.0)
    ratio = torch.tensor([[0.5, 1.0, 1.5, 3.0]], dtype=torch.float64)
    old = torch.zeros_like(ratio)
    logp = ratio.log()
    pos = policy_loss(logp, old, torch.tensor([2.0]), cfg)
    # A=2: −min(ρA, clip(ρ)A) = −2·min(ρ, clip(ρ)) = −2·[0.5, 1.0, 1.3, 1.3]
    torch.testing.assert_close(pos, torch.tensor([[-1.0, -2.0, -2.6, -2.6]], dtype=torch.float64))
    neg = policy_loss(logp, old, torch.tensor([-2.0]), cfg)
    # A=−2: 2·max(ρ, clip(ρ)) = 2·[0.8, 1.0, 1.5, 3.0], then dual clip caps at c·|A| = 4
    torch.testing.assert_close(neg, torch.tensor([[1.6, 2.0, 3.0, 4.0]], dtype=torch.float64))
    plain = policy_loss(logp, old, torch.tensor([-2.0]), PolicyLossConfig(kind="none"))
    torch.testing.assert_close(plain, 2.0 * ratio)


def test_gradient_mask_hand_values():
    cfg = PolicyLossConfig(kind="ppo_clip", clip_low=0.2, clip_high=0.3, dual_clip=2.0)
    ratio = torch.tensor([0.5, 0.9, 1.2, 1.5, 2.5])
    assert gradient_mask(ratio, 1, cfg).tolist() == [True, True, True, False, False]
    assert gradient_mask(ratio, -1, cfg).tolist() == [False, True, True, True, False]
    assert gradient_mask(ratio, 0, cfg).tolist() == gradient_mask(ratio, 1, cfg).tolist()
    assert gradient_mask(ratio, 1, PolicyLossConfig(kind="none")).all()
    with pytest.raises(ValueError):
        gradient_mask(ratio, 2, cfg)


def test_sign_free():
    cfg = PolicyLossConfig(kind="ppo_clip", clip_low=0.2, clip_high=0.28, dual_clip=1.5)
    assert sign_free(torch.tensor([0.85, 1.0, 1.27]), cfg)
    assert not sign_free(torch.tensor([0.85, 1.3]), cfg)
    assert not sign_free(torch.tensor([0.7, 1.0]), cfg)
    assert sign_free(torch.tensor([1.0, 4.0]), cfg)  # beyond both 1+ε_high and c: no gradient for either sign
    # masked-out (tool) tokens do not count
    assert sign_free(torch.tensor([0.1, 1.0]), cfg, loss_mask=torch.tensor([0, 1]))
    assert sign_free(torch.tensor([0.1, 9.0]), PolicyLossConfig(kind="none"))


def test_tis_weight():
    cfg = PolicyLossConfig(kind="none", tis_cap=2.0)
    old = torch.tensor([[0.0, 0.0, 0.0]])
    behaviour = torch.tensor([[0.0, -0.5, -3.0]])
    w = tis_weight(old, behaviour, cfg)
    torch.testing.assert_close(w, torch.tensor([[1.0, torch.e ** 0.5, 2.0]]))
    assert tis_weight(old, behaviour, PolicyLossConfig(kind="none")) is None
    with pytest.raises(ValueError, match="behaviour_logp"):
        policy_loss(old.clone().requires_grad_(), old, torch.ones(1), cfg)


def test_at_ratio_one_every_kind_is_the_policy_gradient():
    logp, _, _ = _inputs(seed=7)
    old = logp.detach().clone()
    a = torch.linspace(-2, 2, logp.shape[0], dtype=torch.float64)
    expected = -a.unsqueeze(-1) * torch.ones_like(old)  # ∂ℓ/∂logp at ρ = 1 is −A
    for cfg in CONFIGS.values():
        if cfg.tis_cap is not None:
            continue
        torch.testing.assert_close(_grad(policy_loss(logp, old, a, cfg), logp), expected)


def test_config_validation():
    with pytest.raises(ValueError):
        PolicyLossConfig(kind="gspo")
    with pytest.raises(ValueError):
        PolicyLossConfig(dual_clip=1.0)
    with pytest.raises(ValueError):
        PolicyLossConfig(kind="none", dual_clip=3.0)
    with pytest.raises(ValueError):
        PolicyLossConfig(clip_low=1.0)
    with pytest.raises(ValueError):
        PolicyLossConfig(tis_cap=0.0)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_far_log_ratio_gives_a_finite_loss_and_gradient(name, dtype):
    """A behaviour / old log-prob of −1e4 (what a forged trajectory carried) made ρ and the TIS weight exp(1e4) = inf
    and the async step NaN; the log-ratio clamp (LOG_RATIO_CLAMP) keeps loss and gradient finite for either sign of
    A. Control: inside the clamp ρ is bit-identical to the textbook exp(logp − old)."""
    cfg = CONFIGS[name]
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=dtype, requires_grad=True)
    far = torch.tensor([[-1e4, -1.0, -0.4]], dtype=dtype)  # (1, 3): token 0 is e^9999 off
    for adv in (1.0, -1.0):
        loss = policy_loss(logp, far, torch.tensor([adv], dtype=dtype), cfg, behaviour_logp=far)
        (g,) = torch.autograd.grad(loss.sum(), logp)
        assert torch.isfinite(loss).all() and torch.isfinite(g).all(), (adv, loss, g)
        s = surrogate(logp, far, 1 if adv > 0 else -1, cfg, behaviour_logp=far)
        (gs,) = torch.autograd.grad(s.sum(), logp)
        torch.testing.assert_close(g, adv * gs)  # the streaming identity still holds
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(4, 9, generator=gen, dtype=dtype)
    b = a + 0.3 * torch.randn(4, 9, generator=gen, dtype=dtype)
    assert torch.equal(importance_ratio(a, b), torch.exp(a - b))
