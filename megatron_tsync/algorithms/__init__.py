"""Pure tensor math for megatron_tsync: advantages, policy losses, KL/entropy, aggregation, the streaming contract
and on-policy distillation. Imports torch only (see design/streaming_math.md)."""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    DEFAULT_EPS,
    AdvantageEstimator,
    AffineCoefficients,
    get_advantage_estimator,
    group_mean,
    register_advantage_estimator,
)
from .aggregation import AGGREGATION_MODES, aggregate, barrier_divisor, sequence_weight
from .kl import KL_PENALTIES, entropy_from_logits, kl_penalty
from .opd import full_vocab_reverse_kl, opd_advantages, opd_loss
from .policy_loss import (
    POLICY_LOSS_KINDS,
    PolicyLossConfig,
    gradient_mask,
    importance_ratio,
    policy_loss,
    sign_free,
    surrogate,
    tis_weight,
)
from .streamability import (
    AUX_STRATEGIES,
    KL_MODES,
    REWARD_KINDS,
    RewardSpec,
    StreamDecision,
    decide,
    describe_config,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "AUX_STRATEGIES",
    "DEFAULT_EPS",
    "KL_MODES",
    "KL_PENALTIES",
    "POLICY_LOSS_KINDS",
    "REWARD_KINDS",
    "AdvantageEstimator",
    "AffineCoefficients",
    "PolicyLossConfig",
    "RewardSpec",
    "StreamDecision",
    "aggregate",
    "barrier_divisor",
    "decide",
    "describe_config",
    "entropy_from_logits",
    "full_vocab_reverse_kl",
    "get_advantage_estimator",
    "gradient_mask",
    "group_mean",
    "importance_ratio",
    "kl_penalty",
    "opd_advantages",
    "opd_loss",
    "policy_loss",
    "register_advantage_estimator",
    "sequence_weight",
    "sign_free",
    "surrogate",
    "tis_weight",
]
