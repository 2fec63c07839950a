"""The streaming contract: when may a trajectory's backward run before its group's advantages are known?
(streaming_math.md §3 and §4.)

A trajectory's reward-free surrogate (``policy_loss.surrogate``) needs the gradient mask, which for PPO clipping
depends on sign(A_i) = sign(r_i − m_g) (α_g > 0 for every registered estimator). ``decide`` implements §3 exactly:

0. unclipped loss (kind "none", with or without detached TIS weights): the per-token weight is reward-affine →
   stream, sign irrelevant;
1. every action token's ratio in the band where the mask is sign-free (``policy_loss.sign_free``) → stream;
2. sign(A_i) already certain whatever the outstanding rewards are → stream with that sign's mask. With u outstanding
   rewards in [lo, hi] and known rewards K (including r_i), m_g ranges over [(ΣK + u·lo)/G, (ΣK + u·hi)/G], so
       A_i ≥ 0 is certain iff r_i ≥ (ΣK + u·hi)/G,      A_i ≤ 0 is certain iff r_i ≤ (ΣK + u·lo)/G.
   Binary rewards are bounded with lo = min, hi = max. Continuous (unbounded) rewards are certain only when u = 0;
3. otherwise defer: keep the trajectory's tokens (not a gradient) and run its backward at group close with its real A.

The comparisons of rule 2 are made in exact rational arithmetic on the float64 reward values, so rounding can never
turn an uncertain sign into a "certain" one. (With A_i = 0, e.g. u = 0 and r_i = m_g, both signs are certain and
give the same zero gradient; +1 is returned.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

from .policy_loss import POLICY_LOSS_KINDS, PolicyLossConfig

__all__ = [
    "AUX_STRATEGIES",
    "KL_MODES",
    "REWARD_KINDS",
    "RewardSpec",
    "StreamDecision",
    "decide",
    "describe_config",
]

REWARD_KINDS = ("binary", "bounded", "continuous")
KL_MODES = ("none", "in_reward", "loss")
AUX_STRATEGIES = ("second_backward", "defer_to_close")


@dataclass(frozen=True)
class RewardSpec:
    """What is known about a reward before it lands."""

    kind: str = "continuous"
    """"binary" (exactly lo or hi), "bounded" (in [lo, hi]) or "continuous" (unbounded; lo/hi ignored)."""
    lo: float = -math.inf
    """Smallest possible reward (binary: the failure value)."""
    hi: float = math.inf
    """Largest possible reward (binary: the success value)."""

    def __post_init__(self) -> None:
        if self.kind not in REWARD_KINDS:
            raise ValueError(f"RewardSpec.kind must be one of {REWARD_KINDS}, got {self.kind!r}")
        if self.kind == "continuous":
            return
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)):
            raise ValueError(f"{self.kind} rewards need finite lo and hi, got [{self.lo}, {self.hi}]")
        if self.kind == "binary" and not self.lo < self.hi:
            raise ValueError(f"binary rewards need lo < hi, got lo={self.lo}, hi={self.hi}")
        if self.kind == "bounded" and not self.lo <= self.hi:
            raise ValueError(f"bounded rewards need lo <= hi, got lo={self.lo}, hi={self.hi}")

    @classmethod
    def binary(cls, lo: float = 0.0, hi: float = 1.0) -> "RewardSpec":
        return cls(kind="binary", lo=lo, hi=hi)

    @classmethod
    def bounded(cls, lo: float, hi: float) -> "RewardSpec":
        return cls(kind="bounded", lo=lo, hi=hi)

    @classmethod
    def continuous(cls) -> "RewardSpec":
        return cls(kind="continuous")

    @property
    def is_bounded(self) -> bool:
        return self.kind != "continuous"

    def check(self, reward: float) -> None:
        """Raise ValueError if ``reward`` is impossible under this spec."""
        if not math.isfinite(reward):
            raise ValueError(f"reward must be finite, got {reward}")
        if self.kind == "binary" and reward not in (self.lo, self.hi):
            raise ValueError(f"binary reward must be {self.lo} or {self.hi}, got {reward}")
        if self.kind == "bounded" and not self.lo <= reward <= self.hi:
            raise ValueError(f"bounded reward must lie in [{self.lo}, {self.hi}], got {reward}")


@dataclass(frozen=True)
class StreamDecision:
    """Outcome of ``decide`` for one trajectory."""

    stream: bool
    """True: backprop the surrogate now. False: keep the tokens and backprop at group close."""
    adv_sign: int | None
    """+1 / −1: the gradient-mask sign to use; None when the mask does not depend on the sign (or when deferred)."""
    reason: str
    """Human-readable rule that fired (for logs and metrics)."""


def decide(*, ratio_in_band: bool, reward: float, known_rewards: Sequence[float], group_size: int, spec: RewardSpec,
           loss_kind: str) -> StreamDecision:
    """Apply §3 to trajectory i (module docstring).

    ratio_in_band: ``policy_loss.sign_free(ratio_i, cfg, loss_mask_i)``; reward: r_i; known_rewards: every known
    reward of the group INCLUDING r_i; group_size: G; loss_kind: ``PolicyLossConfig.kind``.
    """
    if loss_kind not in POLICY_LOSS_KINDS:
        raise ValueError(f"loss_kind must be one of {POLICY_LOSS_KINDS}, got {loss_kind!r}")
    known = [float(r) for r in known_rewards]
    reward = float(reward)
    if not 1 <= len(known) <= group_size:
        raise ValueError(f"known_rewards must hold 1..group_size={group_size} rewards, got {len(known)}")
    if reward not in known:
        raise ValueError("known_rewards must include this trajectory's own reward")
    for r in known:
        spec.check(r)

    if loss_kind == "none":
        return StreamDecision(True, None, "unclipped loss: per-token weight is reward-affine (rule 0)")
    if ratio_in_band:
        return StreamDecision(True, None, "all ratios inside the sign-free band (rule 1)")

    outstanding = group_size - len(known)
    if outstanding > 0 and not spec.is_bounded:
        return StreamDecision(False, None, f"sign uncertain: {outstanding} unbounded rewards outstanding (rule 3)")
    # Exact rational arithmetic: G·r_i compared with ΣK + u·bound.
    g_times_r = group_size * Fraction(reward)
    known_sum = sum((Fraction(r) for r in known), Fraction(0))
    hi = Fraction(spec.hi) if outstanding else Fraction(0)
    lo = Fraction(spec.lo) if outstanding else Fraction(0)
    if g_times_r >= known_sum + outstanding * hi:
        return StreamDecision(True, 1, f"A >= 0 certain with {outstanding} outstanding (rule 2)")
    if g_times_r <= known_sum + outstanding * lo:
        return StreamDecision(True, -1, f"A <= 0 certain with {outstanding} outstanding (rule 2)")
    return StreamDecision(False, None, f"sign uncertain with {outstanding} outstanding: defer to group close (rule 3)")


def _aux_sentence(kl_mode: str, entropy_coef: float, aux_strategy: str | None) -> str:
    """How KL / entropy terms are handled (§4); raises rather than silently dropping one."""
    if kl_mode not in KL_MODES:
        raise ValueError(f"kl_mode must be one of {KL_MODES}, got {kl_mode!r}")
    parts = []
    if kl_mode == "in_reward":
        parts.append("KL folded into the reward (affine, one backward)")
    loss_terms = (["KL loss"] if kl_mode == "loss" else []) + (["entropy bonus"] if entropy_coef != 0.0 else [])
    if loss_terms:
        if aux_strategy not in AUX_STRATEGIES:
            raise ValueError(f"{' and '.join(loss_terms)} need an explicit aux_strategy in {AUX_STRATEGIES}, got "
                             f"{aux_strategy!r}: its gradient is not part of h_i and must not be dropped")
        how = ("a second backward per trajectory straight into the batch accumulator"
               if aux_strategy == "second_backward" else "deferring those trajectories' backward to group close")
        parts.append(f"{' and '.join(loss_terms)} via {how}")
    return "; ".join(parts) if parts else "no KL or entropy term"


def describe_config(loss_cfg: PolicyLossConfig, spec: RewardSpec, kl_mode: str = "none", entropy_coef: float = 0.0,
                    *, aux_strategy: str | None = "second_backward") -> str:
    """One sentence for the log saying how (and how fully) this configuration streams exactly.

    kl_mode: "none" | "in_reward" | "loss"; entropy_coef: entropy-bonus coefficient (0 = off);
    aux_strategy: how a loss-side KL / entropy gradient is produced, "second_backward" | "defer_to_close".
    Every accepted combination is exact; what varies is how many trajectories may have to wait for group close.
    """
    if loss_cfg.kind == "none":
        tis = f" with TIS (cap {loss_cfg.tis_cap})" if loss_cfg.tis_cap is not None else ""
        clip = f"unclipped policy gradient{tis}: every trajectory streams on arrival (rule 0)"
    else:
        band = f"[{1 - loss_cfg.clip_low:g}, {1 + loss_cfg.clip_high:g}]"
        dual = f", dual clip c={loss_cfg.dual_clip:g}" if loss_cfg.dual_clip is not None else ""
        tis = f", TIS cap {loss_cfg.tis_cap:g}" if loss_cfg.tis_cap is not None else ""
        if spec.kind == "binary":
            sign = (f"binary rewards {{{spec.lo:g}, {spec.hi:g}}}: r=max streams as A>=0, r=min as A<=0 once the "
                    f"known rewards fix the sign")
        elif spec.kind == "bounded":
            sign = f"rewards bounded in [{spec.lo:g}, {spec.hi:g}]: streams once the bound fixes sign(A)"
        else:
            sign = "unbounded rewards: sign(A) is certain only when the group completes"
        clip = (f"PPO clip band {band}{dual}{tis}: trajectories with every ratio in the band stream (rule 1), "
                f"else {sign} (rule 2), the rest wait for group close (rule 3); at the first minibatch ratio = 1 so "
                f"everything streams")
    return f"Streaming is exact. {clip}; {_aux_sentence(kl_mode, entropy_coef, aux_strategy)}."
