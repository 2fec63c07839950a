"""KL-to-reference penalties and entropy (streaming_math.md §4).

Per-token estimators of KL(π_θ ‖ π_ref) from the sampled token's log-probs (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html), with log r = ref_logp − logp:

| kind | estimator                   | unbiased | ≥ 0 | verl name   |
|------|-----------------------------|----------|-----|-------------|
| k1   | logp − ref_logp             | yes      | no  | "kl"        |
| k2   | ½ (logp − ref_logp)²        | no       | yes | "mse"       |
| k3   | exp(log r) − log r − 1      | yes      | yes | "low_var_kl" |

Deviations from the formula: k3's exponent is clamped, exp(clamp(log r, −20, 20)) (``policy_loss.LOG_RATIO_CLAMP``,
as verl's ``low_var_kl``), so a reference far from the policy gives a large finite penalty instead of inf; inside the
clamp nothing changes (the exactness tests have log r near 0); outside it k3's gradient in log π_θ is 1 (the −log r
term). Unlike verl, no clamp of k3 itself to [−10, 10].

Two ways to train with them (``--kl-mode``; ``streamability.describe_config``):

- ``loss``: β·Σ_t w_t kl_t(log π_θ, log π_ref) is a loss term. Its gradient needs no reward, but it is a different
  vector from the policy-gradient h_i: a second backward straight into the batch accumulator, or deferral to group
  close.
  At log π_θ = log π_ref the gradients of k2 and k3 vanish and k1's is ∇ log π_θ whatever the reference (tested).
- ``reward``: r'_i = r_i − β·KL_i with KL_i = :func:`sequence_kl` at θ0 (detached, per trajectory; verl's token-level
  penalty summed over the action tokens of an outcome reward). r'_i is known once π_θ0 and π_ref have scored the
  trajectory, so the advantage stays affine in it and a group still closes with two scalars (design note §1, §4).
"""

from __future__ import annotations

import torch

from .policy_loss import LOG_RATIO_CLAMP

__all__ = ["KL_PENALTIES", "entropy_from_logits", "kl_penalty", "sequence_kl"]


def _k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def _k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def _k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_r = ref_logp - logp
    return torch.exp(log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) - log_r - 1.0


KL_PENALTIES = {"k1": _k1, "k2": _k2, "k3": _k3}
_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate. logp, ref_logp: (B, T) log-probs of the sampled tokens -> (B, T).

    kind: "k1" | "k2" | "k3" (verl aliases "kl", "mse", "low_var_kl" accepted). Differentiable in both inputs.
    """
    key = _ALIASES.get(kind, kind)
    if key not in KL_PENALTIES:
        raise ValueError(f"unknown kl kind {kind!r}; known: {sorted(KL_PENALTIES)} (+ aliases {sorted(_ALIASES)})")
    return KL_PENALTIES[key](logp, ref_logp)


def sequence_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    """Σ_t mask_t · kl_t per sequence: (B, T) log-probs and loss mask -> (B,). The KL of ``--kl-mode reward``."""
    return (kl_penalty(logp, ref_logp, kind) * mask).sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Categorical entropy H = logsumexp(z) − Σ softmax(z)·z. logits: (..., V) -> (...)."""
    probs = torch.softmax(logits, dim=-1)  # (..., V)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
