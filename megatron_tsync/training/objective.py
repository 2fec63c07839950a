"""The objective's true value for the log, the same in every mode and arrival order (``train/loss``).

What streaming backpropagates is not the loss: a bucketed trajectory's term is the reward-free surrogate
ν_i Σ_t w_t s_t(sign), whose value ignores A_i, so a sum of what ran (``StepResult.loss_sum``, logged as
``train/loss_surrogate``) depends on which trajectories streamed before their group closed. The true value is a
function of per-trajectory scalars instead. The per-token policy loss ℓ_t(A) (``algorithms.policy_loss``: PPO clip,
asymmetric and dual clip, TIS, or plain PG) is positively homogeneous in A for a fixed sign of A, so

    ν_i Σ_t w_t ℓ_t(A_i) = A_i · P_i        (A_i ≥ 0),     P_i = ν_i Σ_t w_t ℓ_t(+1)
                         = −A_i · N_i       (A_i < 0),     N_i = ν_i Σ_t w_t ℓ_t(−1)

for any ratio (at ratio 1 both are −ν_i Σ_t w_t τ_t, τ the TIS weight). The executor records (P_i, N_i) and the
value K_i of the trajectory's KL/entropy terms at its forward (``StreamExecutor.values``); once the minibatch's
rewards are all in, A_i comes from the estimator's batch formula over the minibatch's groups (trajectories in id
order), and

    J = (Σ_i [A_i · P_i or −A_i · N_i] + K_i) / divisor

summed with ``math.fsum`` (exactly rounded: independent of order), then over data-parallel replicas and pipeline
stages (only the last stage has values; tensor-parallel ranks hold the same values and are not summed). A step of
several optimizer steps logs the mean of their J.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_tsync.algorithms.policy_loss import PolicyLossConfig, policy_loss

__all__ = ["signed_policy_values", "objective_value", "sum_over_replicas"]


def signed_policy_values(logp: torch.Tensor, old: torch.Tensor, w: torch.Tensor, nu: float, cfg: PolicyLossConfig,
                         beh: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, N): the trajectory's policy term ν Σ_t w_t ℓ_t(A) at A = +1 and A = −1, as 0-d tensors (read at the
    barrier by :func:`objective_value`, so the forward does not wait for the device). logp, old, w, beh: (1, T-1)."""
    with torch.no_grad():
        one = torch.ones(1, dtype=logp.dtype, device=logp.device)
        p = nu * (policy_loss(logp, old, one, cfg, beh) * w).sum()
        n = nu * (policy_loss(logp, old, -one, cfg, beh) * w).sum()
    return p, n


def objective_value(group_rewards: dict[str, dict[str, float]], estimator, values: dict[str, list],
                    divisor: float) -> float:
    """This rank's part of J (module docstring) for one minibatch.

    group_rewards: group id → {trajectory id → reward the advantages use}, groups in batch order; values: trajectory
    id → [P, N, K] (floats or 0-d tensors) for the trajectories this rank forwarded (absent: another replica or
    stage has them).
    """
    ids, rewards, gidx = [], [], []
    for k, group in enumerate(group_rewards.values()):
        for tid in sorted(group):
            ids.append(tid)
            rewards.append(group[tid])
            gidx.append(k)
    if not ids:
        return 0.0
    adv = estimator.advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(gidx, dtype=torch.long))
    terms = []
    for tid, a in zip(ids, adv.tolist()):
        v = values.get(tid)
        if v is not None:
            p, n, k = (float(x) for x in v)
            terms += [a * p if a >= 0 else -a * n, k]
    return math.fsum(terms) / divisor


def sum_over_replicas(value: float) -> float:
    """Σ over data-parallel replicas and pipeline stages (megatron's ``parallel_state`` groups), float64."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized() or not ps.model_parallel_is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    if torch.cuda.is_available():
        t = t.cuda()
    for size, group in ((ps.get_data_parallel_world_size(), ps.get_data_parallel_group),
                        (ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_group)):
        if size > 1:
            dist.all_reduce(t, group=group())
    return float(t[0])
