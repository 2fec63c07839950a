"""Group-affine advantage estimators (streaming_math.md §1).

Every estimator here is affine in the reward with group-level coefficients,

    A_i = α_g · r_i + β_g          (β_g = −α_g · m_g for every estimator below)

which is what lets a trajectory's backward run the moment its reward lands: the streaming learner accumulates
reward-free per-trajectory gradients h_i and closes each group with two scalars (see ``close_coefficient``).

Each estimator offers two independent computations that the tests compare against each other:

* ``coefficients(group_rewards)`` -> ``AffineCoefficients(α, β)`` in float64 python floats (used by streaming);
* ``advantages(rewards, group_index)`` -> the batch reference, vectorised over the whole batch with scatter ops,
  written directly from the paper's formula and NOT via ``coefficients``.

Registered estimators (``ADVANTAGE_ESTIMATORS``):

| name           | A_i                                  | α_g             | implements                              |
|----------------|--------------------------------------|-----------------|-----------------------------------------|
| grpo           | (r_i − m_g) / (s_g + ε), biased s_g   | 1/(s_g + ε)     | GRPO, Shao et al. 2024 (DeepSeekMath)   |
| grpo_unbiased  | (r_i − m_g) / (s_g + ε), unbiased s_g | 1/(s_g + ε)     | verl ``compute_grpo_outcome_advantage`` |
| dr_grpo        | r_i − m_g                            | 1               | Dr.GRPO, Liu et al. 2025                |
| rloo           | r_i − mean_{j≠i} r_j                 | G/(G−1)         | RLOO, Ahmadian et al. 2024              |
| grpo_batch_std | (r_i − m_g) / (s_batch + ε)          | 1/(s_batch + ε) | group mean + batch std, "Lite PPO"      |

ε = 1e-6 outside the square root (verl convention).

Deviations / definitions worth knowing:

* G = 1 groups: the std-normalised estimators and dr_grpo give advantage 0 (r − m = 0; the unbiased std of one
  sample, undefined, is taken as 0). verl instead sets mean=0, std=1 for singleton groups (advantage = r). RLOO has no
  leave-one-out baseline for G = 1 and raises ``ValueError``.
* ``grpo_batch_std`` uses the *unbiased* std of the raw rewards over the whole batch (``torch.std`` default). Its α is
  final only at the batch barrier (``needs_batch_rewards = True``).
* ``coefficients`` computes the group mean with a shift by the group's first reward, m = r_0 + mean(r − r_0), so that a
  zero-variance group has m == r_0 bit-exactly and its advantages / close coefficient are exactly 0 even though
  α = 1/ε = 1e6 (a plain float64 mean of three, six or seven 0.7's is not 0.7, and α amplifies the last-bit error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "AffineCoefficients",
    "DEFAULT_EPS",
    "get_advantage_estimator",
    "group_mean",
    "register_advantage_estimator",
]

DEFAULT_EPS = 1e-6

RewardsLike = torch.Tensor | Sequence[float]


@dataclass(frozen=True)
class AffineCoefficients:
    """Group-level coefficients of A_i = alpha · r_i + beta (float64 python floats)."""

    alpha: float
    """Slope α_g ≥ 0 applied to the reward."""
    beta: float
    """Offset β_g (= −α_g · m_g for every registered estimator)."""

    def advantage(self, reward: float) -> float:
        """A = α·r + β for one reward (float64)."""
        return self.alpha * float(reward) + self.beta


# --------------------------------------------------------------------------------------------------------------------
# float64 group statistics (used by ``coefficients`` / ``close_coefficient``)
# --------------------------------------------------------------------------------------------------------------------


def _as_float64(rewards: RewardsLike) -> torch.Tensor:
    """Rewards as a detached 1-D float64 CPU tensor (G,)."""
    if isinstance(rewards, torch.Tensor):
        r = rewards.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    else:  # never via torch's default dtype: float32 would round python floats
        r = torch.tensor([float(x) for x in rewards], dtype=torch.float64)
    if r.numel() == 0:
        raise ValueError("a group needs at least one reward")
    if not torch.isfinite(r).all():
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    return r


def group_mean(rewards: RewardsLike) -> float:
    """Group mean m_g in float64, computed as r_0 + mean(r − r_0).

    The shift makes the mean of a zero-variance group equal to its common value bit-exactly.
    rewards: (G,)
    """
    r = _as_float64(rewards)
    shift = r[0]
    return float(shift + (r - shift).mean())


def _group_std(rewards: torch.Tensor, mean: float, *, unbiased: bool) -> float:
    """Std of (G,) float64 rewards about ``mean``; 0 when undefined (G = 1 with the unbiased estimator)."""
    g = rewards.numel()
    dof = g - 1 if unbiased else g
    if dof <= 0:
        return 0.0
    dev = rewards - mean
    return math.sqrt(float((dev * dev).sum()) / dof)


# --------------------------------------------------------------------------------------------------------------------
# vectorised batch helpers (used by ``advantages``; deliberately a different code path)
# --------------------------------------------------------------------------------------------------------------------


def _check_batch(rewards: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Validate and compact (N,) rewards / (N,) group ids -> (float64 rewards, dense ids in [0, K), K)."""
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(f"rewards and group_index must both be (N,), got {tuple(rewards.shape)} and "
                         f"{tuple(group_index.shape)}")
    if group_index.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError("group_index must be an integer tensor")
    _, dense = torch.unique(group_index, return_inverse=True)  # (N,) in [0, K)
    num_groups = int(dense.max()) + 1 if dense.numel() else 0
    return rewards.to(torch.float64), dense, num_groups


def _scatter_sum(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group sum: (N,) values, (N,) ids -> (K,)."""
    out = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    return out.index_add_(0, index, values)


def _batch_group_stats(r: torch.Tensor, idx: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-trajectory group size and group mean, both gathered back to (N,)."""
    counts = _scatter_sum(torch.ones_like(r), idx, k)  # (K,)
    # shift by each group's first reward (as ``group_mean`` does) so that a zero-variance group's mean is its
    # common value bit-exactly; otherwise α = 1/ε turns a last-bit error of the mean into advantages of ~1e-10
    pos = torch.arange(r.numel(), device=r.device)
    first = torch.full((k,), r.numel(), dtype=pos.dtype, device=r.device).scatter_reduce_(0, idx, pos, "amin")
    shift = r[first]  # (K,)
    means = shift + _scatter_sum(r - shift[idx], idx, k) / counts  # (K,)
    return counts[idx], means[idx]


def _batch_group_std(r: torch.Tensor, idx: torch.Tensor, k: int, *, unbiased: bool) -> torch.Tensor:
    """Per-trajectory group std (N,), 0 where undefined."""
    counts, means = _batch_group_stats(r, idx, k)
    sq = _scatter_sum((r - means) ** 2, idx, k)[idx]  # (N,)
    dof = counts - 1 if unbiased else counts
    return torch.where(dof > 0, sq / dof.clamp(min=1), torch.zeros_like(sq)).sqrt()


# --------------------------------------------------------------------------------------------------------------------
# estimator protocol + registry
# --------------------------------------------------------------------------------------------------------------------


class AdvantageEstimator:
    """Base class / contract for a group-affine advantage estimator.

    Subclasses implement ``coefficients`` and ``advantages`` and may override ``alpha_known_in_advance``.
    """

    name: str = "<unregistered>"
    needs_batch_rewards: bool = False
    """True when α depends on rewards outside the group (final only at the batch barrier)."""

    def __init__(self, eps: float = DEFAULT_EPS) -> None:
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        self.eps = float(eps)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, eps={self.eps})"

    def alpha_known_in_advance(self, group_size: int) -> float | None:
        """α_g when it does not depend on any reward (then only S_g needs a per-group buffer), else None."""
        return None

    def coefficients(self, group_rewards: RewardsLike, *,
                     batch_rewards: RewardsLike | None = None) -> AffineCoefficients:
        """(α_g, β_g) for one complete group. group_rewards: (G,); batch_rewards: (N,) when needed."""
        raise NotImplementedError

    def advantages(self, rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
        """Batch reference. rewards: (N,) float; group_index: (N,) long -> (N,) float64."""
        raise NotImplementedError

    def close_coefficient(self, coeffs: AffineCoefficients, origin: float, group_rewards: RewardsLike) -> float:
        """c = α·ρ + β, the coefficient of Q = Σ_i h_i when closing a group whose P was accumulated about origin ρ.

        The streaming learner keeps P = Σ_i (r_i − ρ) h_i and Q = Σ_i h_i, and closes with α·P + c·Q
        (streaming_math.md §1, moving origin). Every registered estimator has β = −α·m_g, so c is computed as
        α·(ρ − m_g) with m_g in float64 (``group_mean``): for a zero-variance group ρ == m_g exactly and c == 0,
        where α·ρ + β would be the difference of two ~α-sized numbers (1e6 for rewards all 0.7 and ε = 1e-6).
        """
        m = group_mean(group_rewards)
        c = coeffs.alpha * (float(origin) - m)
        # Guard: the shortcut is only valid for estimators with β = −α·m.
        ref = coeffs.alpha * float(origin) + coeffs.beta
        if abs(c - ref) > 1e-9 * max(1.0, abs(coeffs.alpha) * (abs(float(origin)) + abs(m))):
            raise ValueError(f"{self.name}: close_coefficient assumes beta == -alpha*mean (got {coeffs})")
        return c


ADVANTAGE_ESTIMATORS: dict[str, type[AdvantageEstimator]] = {}


def register_advantage_estimator(name: str) -> Callable[[type[AdvantageEstimator]], type[AdvantageEstimator]]:
    """Class decorator registering an ``AdvantageEstimator`` subclass under ``name``."""

    def deco(cls: type[AdvantageEstimator]) -> type[AdvantageEstimator]:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        cls.name = name
        ADVANTAGE_ESTIMATORS[name] = cls
        return cls

    return deco


def get_advantage_estimator(name: str, **kwargs: float) -> AdvantageEstimator:
    """Instantiate the estimator registered as ``name`` (kwargs, e.g. ``eps``, go to its constructor)."""
    try:
        cls = ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}") from None
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------------------------------
# estimators
# --------------------------------------------------------------------------------------------------------------------


class _StdNormalised(AdvantageEstimator):
    """A_i = (r_i − m_g) / (s_g + ε). Shao et al. 2024, eq. for outcome supervision (§4.1.2)."""

    unbiased: bool = False

    def coefficients(self, group_rewards: RewardsLike, *,
                     batch_rewards: RewardsLike | None = None) -> AffineCoefficients:
        r = _as_float64(group_rewards)
        m = group_mean(r)
        alpha = 1.0 / (_group_std(r, m, unbiased=self.unbiased) + self.eps)
        return AffineCoefficients(alpha=alpha, beta=-alpha * m)

    def advantages(self, rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
        r, idx, k = _check_batch(rewards, group_index)
        _, mean = _batch_group_stats(r, idx, k)  # (N,)
        std = _batch_group_std(r, idx, k, unbiased=self.unbiased)  # (N,)
        return (r - mean) / (std + self.eps)


@register_advantage_estimator("grpo")
class GRPO(_StdNormalised):
    """GRPO with the biased (population) group std."""

    unbiased = False


@register_advantage_estimator("grpo_unbiased")
class GRPOUnbiased(_StdNormalised):
    """GRPO with the unbiased group std, verl's convention: (r − mean)/(std + 1e-6), ``torch.std`` (G−1)."""

    unbiased = True


@register_advantage_estimator("dr_grpo")
class DrGRPO(AdvantageEstimator):
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i − m_g, no std division."""

    def alpha_known_in_advance(self, group_size: int) -> float | None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        return 1.0

    def coefficients(self, group_rewards: RewardsLike, *,
                     batch_rewards: RewardsLike | None = None) -> AffineCoefficients:
        m = group_mean(group_rewards)
        return AffineCoefficients(alpha=1.0, beta=-m)

    def advantages(self, rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
        r, idx, k = _check_batch(rewards, group_index)
        _, mean = _batch_group_stats(r, idx, k)
        return r - mean


@register_advantage_estimator("rloo")
class RLOO(AdvantageEstimator):
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): A_i = r_i − (1/(G−1)) Σ_{j≠i} r_j = G/(G−1)·(r_i − m_g)."""

    @staticmethod
    def _check_size(group_size: int) -> None:
        if group_size < 2:
            raise ValueError(f"rloo needs a group of at least 2 trajectories (leave-one-out), got {group_size}")

    def alpha_known_in_advance(self, group_size: int) -> float | None:
        self._check_size(group_size)
        return group_size / (group_size - 1)

    def coefficients(self, group_rewards: RewardsLike, *,
                     batch_rewards: RewardsLike | None = None) -> AffineCoefficients:
        r = _as_float64(group_rewards)
        g = r.numel()
        self._check_size(g)
        alpha = g / (g - 1)
        return AffineCoefficients(alpha=alpha, beta=-alpha * group_mean(r))

    def advantages(self, rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
        r, idx, k = _check_batch(rewards, group_index)
        counts = _scatter_sum(torch.ones_like(r), idx, k)[idx]  # (N,)
        if bool((counts < 2).any()):
            raise ValueError("rloo needs every group to hold at least 2 trajectories (leave-one-out)")
        sums = _scatter_sum(r, idx, k)[idx]  # (N,)
        leave_one_out_mean = (sums - r) / (counts - 1)
        return r - leave_one_out_mean


@register_advantage_estimator("grpo_batch_std")
class GRPOBatchStd(AdvantageEstimator):
    """Group mean, batch std: A_i = (r_i − m_g) / (s_batch + ε), s_batch the unbiased std of all N batch rewards.

    ("Tricks or Traps? A Deep Dive into RL for LLM Reasoning", Liu et al. 2025, "Lite PPO".) α is common to all groups
    and final only once the whole batch's rewards are known.
    """

    needs_batch_rewards = True

    def coefficients(self, group_rewards: RewardsLike, *,
                     batch_rewards: RewardsLike | None = None) -> AffineCoefficients:
        if batch_rewards is None:
            raise ValueError("grpo_batch_std needs batch_rewards (all N rewards of the batch) for its alpha")
        b = _as_float64(batch_rewards)
        alpha = 1.0 / (_group_std(b, group_mean(b), unbiased=True) + self.eps)
        return AffineCoefficients(alpha=alpha, beta=-alpha * group_mean(group_rewards))

    def advantages(self, rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
        r, idx, k = _check_batch(rewards, group_index)
        _, mean = _batch_group_stats(r, idx, k)
        s_batch = r.std() if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
        return (r - mean) / (s_batch + self.eps)
