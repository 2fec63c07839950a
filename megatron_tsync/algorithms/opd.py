"""On-policy distillation (OPD), streaming_math.md §6.

Per-token advantage = negative sampled reverse KL of the sampled token (Agarwal et al. 2024, "On-Policy Distillation
of Language Models: Learning from Self-Generated Mistakes"; Thinking Machines' "On-Policy Distillation", 2025):

    a_t = −(log π_student(a_t) − log π_teacher(a_t))       detached

using the sampling policy's log-probs (old_logp), so a_t is fixed once the teacher has scored the turn, and the
loss is the importance-weighted policy gradient ℓ_t = −w_t · a_t · ρ_t with ρ_t = exp(logp − old_logp) (optionally
clipped / TIS-weighted through a ``PolicyLossConfig``). At ρ = 1 its gradient is ∇ of the sampled reverse KL
Σ_t w_t (log π_θ − log π_teacher) in expectation. There is no group coupling: nothing waits for other trajectories.

The ratio ρ_t and the TIS weight are clamped in log space before exp (``policy_loss.LOG_RATIO_CLAMP``, the deviation
documented there); the advantage is linear in the teacher's log-probs, so none is clamped here.

``full_vocab_reverse_kl`` is the exact per-position KL(π_student ‖ π_teacher) over the vocabulary (for metrics or a
dense objective).
"""

from __future__ import annotations

import torch

from .policy_loss import PolicyLossConfig, policy_loss

__all__ = ["full_vocab_reverse_kl", "opd_advantages", "opd_loss"]

_UNCLIPPED = PolicyLossConfig(kind="none")


def opd_advantages(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """a_t = −(student_logp − teacher_logp), detached. (B, T), (B, T) -> (B, T)."""
    return -(student_logp.detach() - teacher_logp.detach())


def opd_loss(logp: torch.Tensor, old_logp: torch.Tensor, teacher_logp: torch.Tensor, loss_mask: torch.Tensor, *,
             cfg: PolicyLossConfig | None = None, behaviour_logp: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token OPD loss ℓ_t = w_t · policy_loss(logp, old_logp, a_t) with a_t = opd_advantages(old_logp, teacher).

    logp: (B, T) current student log-probs (requires grad); old_logp: (B, T) sampling-policy log-probs;
    teacher_logp: (B, T); loss_mask: (B, T). cfg defaults to the unclipped policy gradient. Returns (B, T), zero
    outside the mask; aggregate it with ``aggregation.aggregate`` / ``sequence_weight``.
    """
    adv = opd_advantages(old_logp, teacher_logp)  # (B, T)
    per_token = policy_loss(logp, old_logp, adv, cfg or _UNCLIPPED, behaviour_logp)  # (B, T)
    return per_token * loss_mask.to(per_token.dtype)


def full_vocab_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(π_s ‖ π_t) = Σ_v p_s(v) (log p_s(v) − log p_t(v)) per position. (..., V), (..., V) -> (...)."""
    log_ps = torch.log_softmax(student_logits, dim=-1)  # (..., V)
    log_pt = torch.log_softmax(teacher_logits, dim=-1)  # (..., V)
    return (log_ps.exp() * (log_ps - log_pt)).sum(dim=-1)
