"""KL-to-reference penalties and entropy (streaming_math.md §4).

Per-token estimators of KL(π_θ ‖ π_ref) from the sampled token's log-probs (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html), with log r = ref_logp − logp:

| kind | estimator                   | unbiased | ≥ 0 | verl name   |
|------|-----------------------------|----------|-----|-------------|
| k1   | logp − ref_logp             | yes      | no  | "kl"        |
| k2   | ½ (logp − ref_logp)²        | no       | yes | "mse"       |
| k3   | exp(log r) − log r − 1      | yes      | yes | "low_var_kl" |

Deviation from verl: no clamp of k3 to [−10, 10] (the reference stays the formula).

The gradient of these terms needs no reward, but it is a different vector from the policy-gradient h_i: it needs its
own backward, folding into the reward, or deferral to group close (see ``streamability.describe_config``).
"""

from __future__ import annotations

import torch

__all__ = ["KL_PENALTIES", "entropy_from_logits", "kl_penalty"]


def _k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def _k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def _k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_r = ref_logp - logp
    return torch.exp(log_r) - log_r - 1.0


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


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Categorical entropy H = logsumexp(z) − Σ softmax(z)·z. logits: (..., V) -> (...)."""
    probs = torch.softmax(logits, dim=-1)  # (..., V)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
