"""Per-token policy losses and their reward-free streaming surrogates (streaming_math.md §1 and §3).

Conventions (all per token, unaggregated, unmasked; shapes (B, T)):

    ρ_t = exp(logp_t − old_logp_t)                                    importance ratio to the policy that produced A
    w_t = min(exp(old_logp_t − behaviour_logp_t), C)   (detached)     truncated IS to the inference engine (TIS)

* ``kind="none"`` — plain (importance-weighted) policy gradient:  ℓ_t = −A · ρ_t · w_t.
* ``kind="ppo_clip"`` — PPO (Schulman et al. 2017), asymmetric "clip-higher" bounds allowed (DAPO, Yu et al. 2025):

      ℓ_t = max(−A·ρ_t, −A·clip(ρ_t, 1 − ε_low, 1 + ε_high)) · w_t          (= −min(ρA, clip(ρ)A) · w_t)

  dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"), applied only to A < 0: the *objective*
  max(min(ρA, clip(ρ)A), c·A) becomes, in loss terms (loss = −objective),

      ℓ_t = min(ℓ_t^clip, −c·A)     for A < 0           (caps the loss at c·|A|; c > 1)

  exactly verl's ``compute_policy_loss_vanilla`` (``clip_ratio_c``), with TIS applied as verl does: the whole per-token
  loss times the detached weight w_t.

Gradient masks (which tokens carry gradient, from ∂ℓ/∂ρ ≠ 0), given only sign(A):

* A > 0: on iff ρ ≤ 1 + ε_high
* A < 0: on iff ρ ≥ 1 − ε_low and (no dual clip or ρ ≤ c)
* ``kind="none"``: always on.

Hence for A of a fixed sign, ∇ℓ_t(A) = A · ∇s_t with the reward-free surrogate s_t = −mask_t · w_t · ρ_t (mask and w
detached) — what the streaming learner backprops before the group's advantage is known. Ties at a clip boundary are a
measure-zero set; the masks treat the boundary as inside (torch.clamp passes gradient at its bounds).

Deviation from the textbook formula (as verl and slime do): both exponents are clamped before exp,
ρ_t = exp(clamp(logp_t − old_logp_t, −20, 20)) and w_t = min(exp(clamp(old_logp_t − behaviour_logp_t, −20, 20)), C)
(:data:`LOG_RATIO_CLAMP`), so a log-ratio far outside the data (a forged behaviour log-prob, a diverged policy) gives
e^±20 instead of inf / 0 and inf·0 = NaN. Inside the clamp nothing changes, bit for bit (the float64 exactness tests
have ratios near 1); outside it ρ's gradient is 0 (clamp's gradient), which the clipped losses already give for
A > 0 and which replaces the A < 0, no-dual-clip gradient −A·ρ·∇logp (an overflow there) by 0. ``gradient_mask``,
``sign_free`` and ``surrogate`` see the clamped ratio too, so ∇ℓ_t(A) = A·∇s_t still holds (beyond the clamp both are
0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "LOG_RATIO_CLAMP",
    "POLICY_LOSS_KINDS",
    "PolicyLossConfig",
    "gradient_mask",
    "importance_ratio",
    "policy_loss",
    "sign_free",
    "surrogate",
    "tis_weight",
]

POLICY_LOSS_KINDS = ("ppo_clip", "none")

LOG_RATIO_CLAMP = 20.0
"""|log-ratio| bound before exp (module docstring): e^20 ≈ 4.9e8 fits float32 and bf16, so ρ and w stay finite."""


@dataclass(frozen=True)
class PolicyLossConfig:
    """Per-token policy loss configuration."""

    kind: str = "ppo_clip"
    """"ppo_clip" (PPO clipped surrogate) or "none" (plain policy gradient −A·ρ, no clipping)."""
    clip_low: float = 0.2
    """ε_low: lower clip bound is 1 − ε_low (0 ≤ ε_low < 1). Ignored for kind="none"."""
    clip_high: float = 0.2
    """ε_high: upper clip bound is 1 + ε_high (may differ from ε_low: DAPO's clip-higher). Ignored for kind="none"."""
    dual_clip: float | None = None
    """c > 1: dual-clip constant for A < 0 (loss capped at c·|A|), or None. Only with kind="ppo_clip"."""
    tis_cap: float | None = None
    """C > 0: truncated importance sampling cap, weight min(exp(old_logp − behaviour_logp), C), or None (no TIS)."""

    def __post_init__(self) -> None:
        if self.kind not in POLICY_LOSS_KINDS:
            raise ValueError(f"PolicyLossConfig.kind must be one of {POLICY_LOSS_KINDS}, got {self.kind!r}")
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0.0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip is not None:
            if self.kind != "ppo_clip":
                raise ValueError("dual_clip only applies to kind='ppo_clip'")
            if not self.dual_clip > 1.0:
                raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.tis_cap is not None and not self.tis_cap > 0.0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")

    @property
    def clipped(self) -> bool:
        """Whether the gradient mask can depend on sign(A)."""
        return self.kind == "ppo_clip"


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """ρ = exp(clamp(logp − old_logp, ±LOG_RATIO_CLAMP)). (B, T), (B, T) -> (B, T); differentiable in logp."""
    return torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def tis_weight(old_logp: torch.Tensor, behaviour_logp: torch.Tensor | None,
               cfg: PolicyLossConfig) -> torch.Tensor | None:
    """Detached TIS weight min(exp(clamp(old_logp − behaviour_logp, ±LOG_RATIO_CLAMP)), C) (B, T), or None when TIS
    is off.

    behaviour_logp are the inference engine's log-probs of the sampled tokens. Ignored when ``cfg.tis_cap`` is None.
    """
    if cfg.tis_cap is None:
        return None
    if behaviour_logp is None:
        raise ValueError("tis_cap is set but behaviour_logp (the inference engine's log-probs) was not given")
    log_w = (old_logp.detach() - behaviour_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_w).clamp(max=cfg.tis_cap)


def _broadcast_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-sequence (B,) advantages -> (B, 1) so they broadcast over tokens; (B, T) passes through."""
    if advantages.dim() == like.dim() - 1:
        return advantages.unsqueeze(-1)
    return advantages


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, cfg: PolicyLossConfig,
                behaviour_logp: torch.Tensor | None = None) -> torch.Tensor:
    """Reference per-token policy loss ℓ_t (module docstring), unaggregated and unmasked.

    logp: (B, T) current log-probs (requires grad); old_logp: (B, T); advantages: (B,) or (B, T), detached;
    behaviour_logp: (B, T) or None. Returns (B, T).
    """
    adv = _broadcast_advantages(advantages.detach(), logp)  # (B, 1) or (B, T)
    ratio = importance_ratio(logp, old_logp.detach())  # (B, T)
    if cfg.kind == "none":
        loss = -adv * ratio
    else:
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        loss = torch.maximum(unclipped, clipped)
        if cfg.dual_clip is not None:
            cap = -adv * cfg.dual_clip
            loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    weight = tis_weight(old_logp, behaviour_logp, cfg)
    return loss if weight is None else loss * weight


def gradient_mask(ratio: torch.Tensor, adv_sign: int | torch.Tensor, cfg: PolicyLossConfig) -> torch.Tensor:
    """Tokens whose ∂ℓ/∂ρ is nonzero, knowing only sign(A).

    ratio: (B, T); adv_sign: +1 / −1 (0 is treated as +1: with A = 0 every mask gives the same zero gradient), or a
    tensor of signs broadcastable to ratio, e.g. (B, 1). Returns a (B, T) bool tensor.
    """
    ratio = ratio.detach()
    if cfg.kind == "none":
        return torch.ones_like(ratio, dtype=torch.bool)
    pos = ratio <= 1.0 + cfg.clip_high
    neg = ratio >= 1.0 - cfg.clip_low
    if cfg.dual_clip is not None:
        neg = neg & (ratio <= cfg.dual_clip)
    if isinstance(adv_sign, torch.Tensor):
        return torch.where(adv_sign >= 0, pos, neg)
    if adv_sign not in (-1, 0, 1):
        raise ValueError(f"adv_sign must be +1, -1 (or 0), got {adv_sign}")
    return pos if adv_sign >= 0 else neg


def surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv_sign: int | torch.Tensor, cfg: PolicyLossConfig,
              behaviour_logp: torch.Tensor | None = None) -> torch.Tensor:
    """Reward-free surrogate s_t = −mask_t · w_t · ρ_t (mask, w detached), so ∇ℓ_t(A) = A · ∇s_t for sign(A) = adv_sign.

    logp: (B, T) (requires grad); old_logp, behaviour_logp: (B, T). Returns (B, T). Only the gradient matches; the
    value is not the loss.
    """
    ratio = importance_ratio(logp, old_logp.detach())  # (B, T)
    mask = gradient_mask(ratio, adv_sign, cfg).to(ratio.dtype)
    s = -mask * ratio
    weight = tis_weight(old_logp, behaviour_logp, cfg)
    return s if weight is None else s * weight


def sign_free(ratio: torch.Tensor, cfg: PolicyLossConfig, loss_mask: torch.Tensor | None = None) -> bool:
    """Rule 1 of §3: True when every masked token's gradient mask is the same for A > 0 and A < 0.

    Then the trajectory's surrogate does not depend on sign(A) and it can stream before the group completes.
    ratio: (B, T) or (T,); loss_mask: same shape (nonzero = action token) or None (all tokens).
    Always True for kind="none". With dual clip, ratios above max(1 + ε_high, c) are sign-free too (no gradient
    for either sign).
    """
    if not cfg.clipped:
        return True
    differs = gradient_mask(ratio, 1, cfg) != gradient_mask(ratio, -1, cfg)
    if loss_mask is not None:
        differs = differs & loss_mask.bool()
    return not bool(differs.any())
