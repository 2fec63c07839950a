"""The typed configuration of a training run: frozen dataclasses, built once at the entry point.

``TrainConfig`` is the one object a run is configured by. Its sections reuse the dataclasses of the modules that
consume them — ``PrecisionConfig`` (model/builder.py), ``OptimConfig`` (training/optimizer.py), ``LearnerConfig``
with its ``LossConfig`` / ``PolicyLossConfig`` / ``RewardSpec`` (training/learner.py and algorithms/) — and add the
sections that have no other home yet: ``ModelConfig``, ``ParallelConfig``, ``RLConfig``, ``RolloutConfig``,
``CheckpointConfig`` and ``LoggingConfig``, defined here.

Validation is split by where it belongs: each dataclass checks its own fields in ``__post_init__``; ``TrainConfig``
checks only combinations that span sections (a handful, see ``TrainConfig._check_combinations``); what can only be
known at run time (world size against TP×PP×CP, FP8 hardware, a model's head count) is checked where it is used.
Errors are :class:`ConfigError`, which names the offending fields by dotted path (``"rl.max_staleness"``) so that
``megatron_tsync.arguments`` can report them as the flags that set them.

``to_dict`` / ``from_dict`` round-trip through JSON and YAML: torch dtypes become their names (``"float32"``) and
non-finite floats the strings ``"inf"`` / ``"-inf"``.

The package: :mod:`.plain` (``ConfigError``, the plain-dict round trip, the lazily loaded foreign sections),
:mod:`.sections` (the six own sections and the accepted values of their string fields), :mod:`.train`
(``TrainConfig`` and its cross-section rules), :mod:`.rewards` (reward specs of verifiers); everything is
re-exported here (``from megatron_tsync.config import TrainConfig``).

Importing this package does not import torch: the sections owned by torch-importing modules are loaded lazily, when
a ``TrainConfig`` is first built (so ``arguments.build_parser`` and ``--help`` stay fast).
"""

from megatron_tsync.config.plain import ConfigError, _foreign  # noqa: F401 - _foreign: the lazily loaded sections
from megatron_tsync.config.rewards import declared_reward_spec, reward_spec_conflict, reward_spec_for_verifier
from megatron_tsync.config.sections import (ADVANTAGE_ESTIMATORS, AGGREGATIONS, AUX_STRATEGIES, FP8_FORMATS,
                                            FP8_RECIPES, KL_ESTIMATORS, KL_MODES, LATENCY_PROFILES, OLD_LOGPROBS,
                                            OPD_OBJECTIVES, OPTIMIZERS, PARAMS_DTYPES, POLICY_LOSSES, RECOMPUTE_GRANULARITIES,
                                            RECOMPUTE_METHODS, REWARD_KINDS,
                                            RL_ALGORITHMS, RL_MODES, ROLLOUT_ENGINES, TINY_FAMILIES, WEIGHT_SYNCS,
                                            CheckpointConfig, LoggingConfig, ModelConfig, ParallelConfig, RLConfig, RolloutConfig,
                                            parse_cpu_list)
from megatron_tsync.config.train import TrainConfig

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "AUX_STRATEGIES",
    "CheckpointConfig",
    "ConfigError",
    "FP8_FORMATS",
    "FP8_RECIPES",
    "KL_ESTIMATORS",
    "KL_MODES",
    "LATENCY_PROFILES",
    "LoggingConfig",
    "ModelConfig",
    "OLD_LOGPROBS",
    "OPD_OBJECTIVES",
    "OPTIMIZERS",
    "PARAMS_DTYPES",
    "ParallelConfig",
    "POLICY_LOSSES",
    "RECOMPUTE_GRANULARITIES",
    "RECOMPUTE_METHODS",
    "REWARD_KINDS",
    "RL_ALGORITHMS",
    "RL_MODES",
    "RLConfig",
    "ROLLOUT_ENGINES",
    "RolloutConfig",
    "TINY_FAMILIES",
    "WEIGHT_SYNCS",
    "TrainConfig",
    "parse_cpu_list",
    "declared_reward_spec",
    "reward_spec_conflict",
    "reward_spec_for_verifier",
]
