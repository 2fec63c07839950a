"""``TrainConfig``: every section of a run in one frozen record, and the rules that span sections."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping

from megatron_tsync.config.plain import _check, _foreign, _from_plain, _to_plain
from megatron_tsync.config.rewards import declared_reward_spec, reward_spec_conflict
from megatron_tsync.config.sections import (ADVANTAGE_ESTIMATORS, AGGREGATIONS, AUX_STRATEGIES, FP8_FORMATS,
                                            FP8_RECIPES, KL_ESTIMATORS, KL_MODES, OLD_LOGPROBS, OPTIMIZERS,
                                            RL_MODES, CheckpointConfig, LoggingConfig, ModelConfig,
                                            ParallelConfig, RLConfig, RolloutConfig)

__all__ = ["TrainConfig"]


def _default(name: str):
    return dataclasses.field(default_factory=lambda: _foreign(name)())


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run is configured by (``arguments.parse_args`` builds it from flags)."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The policy model (its folder, tiny-model creation, supervised warm start)."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """TP / PP / CP sizes and the distributed optimizer."""
    precision: PrecisionConfig = _default("PrecisionConfig")
    """Parameter dtype, bf16, FP8 (``model.builder.PrecisionConfig``)."""
    optim: OptimConfig = _default("OptimConfig")
    """Optimizer, learning rate, clipping (``training.optimizer.OptimConfig``)."""
    learner: LearnerConfig = _default("LearnerConfig")
    """Streaming mode, advantage estimator, loss, reward spec (``training.learner.LearnerConfig``)."""
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    """Algorithm, iterations, group size and count, trajectory limits, staleness, seed."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Inference engine, task, verifier, sampling, latency simulation, transport."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Load / save / finetune."""
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """TensorBoard, log interval, rollout/gradient dumps, progress bar."""

    def __post_init__(self) -> None:
        self._check_combinations()

    def _check_combinations(self) -> None:
        """Constraints that span sections, or fields of reused sections whose owners do not check them."""
        self._check_reused_sections()
        self._check_numerics()
        self._check_run_combinations()

    def _check_reused_sections(self) -> None:
        """Fields of the sections owned by torch-importing modules (learner, optimizer, precision)."""
        import torch

        lr, lc, pr = self.learner, self.learner.loss, self.precision
        for path, value, choices in (
            ("learner.mode", lr.mode, RL_MODES),
            ("learner.estimator", lr.estimator, ADVANTAGE_ESTIMATORS),
            ("learner.aux_strategy", lr.aux_strategy, AUX_STRATEGIES),
            ("learner.loss.aggregation", lc.aggregation, AGGREGATIONS),
            ("learner.loss.kl_kind", lc.kl_kind, KL_ESTIMATORS),
            ("learner.loss.kl_mode", lc.kl_mode, KL_MODES),
            ("learner.loss.old_logprobs", lc.old_logprobs, OLD_LOGPROBS),
            ("optim.optimizer", self.optim.optimizer, OPTIMIZERS),
            ("precision.fp8_recipe", pr.fp8_recipe, FP8_RECIPES),
        ):
            _check(value in choices, f"{path} must be one of {choices}, got {value!r}", path)
        _check(pr.fp8_format is None or pr.fp8_format in FP8_FORMATS,
               f"precision.fp8_format must be None or one of {FP8_FORMATS}, got {pr.fp8_format!r}",
               "precision.fp8_format")
        _check(pr.params_dtype in (torch.float32, torch.float64),
               f"precision.params_dtype must be float32 or float64 (bfloat16 is precision.bf16), got {pr.params_dtype}",
               "precision.params_dtype")
        _check(lr.dp_assignment in ("auto", "arrival", "group", "balanced", "spill"), "learner.dp_assignment must be "
               f"'auto', 'arrival', 'group', 'balanced' or 'spill', got {lr.dp_assignment!r}", "learner.dp_assignment")
        _check(not (lr.dp_assignment in ("group", "balanced", "spill") and self.rl.algorithm == "opd"),
               f"learner.dp_assignment {lr.dp_assignment!r} keeps a GRPO group's buckets on one rank; OPD has no group "
               "buckets (it would do nothing there)",
               "learner.dp_assignment", "rl.algorithm")
        self._check_bucket_memory()
        _check(lr.estimator_eps >= 0, f"learner.estimator_eps must be >= 0, got {lr.estimator_eps}",
               "learner.estimator_eps")
        _check(lr.coalesce_ms >= 0, f"learner.coalesce_ms must be >= 0, got {lr.coalesce_ms}", "learner.coalesce_ms")
        _check(lr.coalesce_tokens >= 0, f"learner.coalesce_tokens must be >= 0, got {lr.coalesce_tokens}",
               "learner.coalesce_tokens")
        _check(not ((lr.coalesce_ms or lr.coalesce_tokens) and self.rl.algorithm == "opd"),
               "learner.coalesce_ms / learner.coalesce_tokens coalesce GRPO arrivals; OPD streams turns as they land "
               "(they would do nothing there)", "learner.coalesce_ms", "learner.coalesce_tokens")
        _check(lr.num_minibatches <= self.rl.groups_per_step,
               f"learner.num_minibatches {lr.num_minibatches} > rl.groups_per_step {self.rl.groups_per_step}: "
               "minibatches are made of whole groups (lower --num-minibatches or raise --global-batch-size)",
               "learner.num_minibatches", "rl.groups_per_step")
        _check(lr.max_packed_tokens >= 1, f"learner.max_packed_tokens must be >= 1, got {lr.max_packed_tokens}",
               "learner.max_packed_tokens")
        _check(not (lr.sequence_packing and self.rl.algorithm == "opd"),
               "learner.sequence_packing is implemented for rl.algorithm grpo only (the OPD learner runs one "
               "trajectory per microbatch)", "learner.sequence_packing", "rl.algorithm")
        _check(not (lr.deterministic and lr.sequence_packing), "learner.deterministic runs one trajectory per "
               "microbatch: learner.sequence_packing is refused (--no-sequence-packing overrides a config's)",
               "learner.deterministic", "learner.sequence_packing")
        _check(not lr.pack_across_groups or (lr.sequence_packing and lr.mode == "stream-trajectory"
                                              and self.rl.algorithm == "grpo" and lr.max_device_buckets is None
                                              and lr.bucket_device_gib is None),
               "learner.pack_across_groups mixes bucket destinations in packed microbatches: it needs "
               "learner.sequence_packing and learner.mode stream-trajectory (the only mode with bucket work), "
               "rl.algorithm grpo, and no bucket residency (learner.max_device_buckets, learner.bucket_device_gib)", "learner.pack_across_groups",
               "learner.sequence_packing", "learner.mode")
        _check(not lr.full_microbatches or (lr.sequence_packing and lr.mode in ("stream-group", "stream-trajectory")
                                             and self.rl.algorithm == "grpo"),
               "learner.full_microbatches holds packed microbatches until they are full: it needs "
               "learner.sequence_packing, learner.mode stream-group or stream-trajectory and rl.algorithm grpo",
               "learner.full_microbatches", "learner.sequence_packing", "learner.mode")
        _check(not (lr.shared_prefix and (lr.deterministic or self.rl.algorithm == "opd")),
               "learner.shared_prefix is implemented for rl.algorithm grpo without learner.deterministic (one "
               "trajectory per microbatch there)", "learner.shared_prefix", "learner.deterministic")
        _check(not (lr.deterministic and (lr.mode == "async" or self.rl.algorithm == "opd")),
               "learner.deterministic is implemented for rl.algorithm grpo in modes sync / stream-group / "
               "stream-trajectory (async: which policy version produced a trajectory depends on timing)",
               "learner.deterministic", "learner.mode", "rl.algorithm")

    def _check_bucket_memory(self) -> None:
        """Open groups, bucket residency and host accumulation."""
        lr = self.learner
        _check(lr.max_open_groups is None or lr.max_open_groups >= 1,
               f"learner.max_open_groups must be >= 1, got {lr.max_open_groups}", "learner.max_open_groups")
        _check(lr.max_device_buckets is None or lr.max_device_buckets >= 2,
               f"learner.max_device_buckets must be >= 2 (an origin shift touches P and Q at once), got "
               f"{lr.max_device_buckets}", "learner.max_device_buckets")
        for path, gib in (("learner.bucket_device_gib", lr.bucket_device_gib),
                          ("learner.bucket_host_gib", lr.bucket_host_gib)):
            _check(gib is None or gib > 0, f"{path} must be > 0, got {gib}", path)
        _check(lr.bucket_host_gib is None or lr.max_device_buckets is not None or lr.bucket_device_gib is not None
               or lr.accumulate_on_host,
               "learner.bucket_host_gib sizes the host arena of bucket residency, which is on with "
               "learner.max_device_buckets or learner.bucket_device_gib, or of learner.accumulate_on_host (none is set)",
               "learner.bucket_host_gib", "learner.max_device_buckets", "learner.bucket_device_gib")
        _check(not lr.accumulate_on_host or (lr.max_device_buckets is None and lr.bucket_device_gib is None
                                             and not lr.deterministic and not lr.pack_across_groups
                                             and self.rl.algorithm == "grpo"),
               "learner.accumulate_on_host keeps every gradient vector on the host: not with bucket residency's device "
               "cache (learner.max_device_buckets, learner.bucket_device_gib), learner.deterministic, "
               "learner.pack_across_groups, or rl.algorithm opd (no group buckets there)",
               "learner.accumulate_on_host", "learner.max_device_buckets", "learner.deterministic")

    def _check_numerics(self) -> None:
        """float64 verification runs, FP8, the distributed optimizer."""
        import torch

        lr, lc, pr = self.learner, self.learner.loss, self.precision
        f64 = pr.params_dtype == torch.float64
        _check(not (f64 and self.optim.clip_grad > 0),
               f"precision.params_dtype float64 needs optim.clip_grad 0 (megatron's gradient clipping is "
               f"float32-only), got optim.clip_grad {self.optim.clip_grad}",
               "precision.params_dtype", "optim.clip_grad")
        _check(not (f64 and pr.bf16), "precision.bf16 contradicts precision.params_dtype float64",
               "precision.bf16", "precision.params_dtype")
        _check(not (f64 and pr.fp8_format is not None),
               f"precision.fp8_format {pr.fp8_format} contradicts precision.params_dtype float64",
               "precision.fp8_format", "precision.params_dtype")
        _check(not (pr.fp8_format is not None and lc.old_logprobs == "trainer"
                    and (lr.num_minibatches > 1 or lr.epochs > 1)),
               "precision.fp8_format with several optimizer steps per batch needs learner.loss.old_logprobs engine: "
               "π_θ0 for minibatches ≥ 2 swaps θ0 weights in, which does not refresh Transformer Engine's cached FP8 "
               "weights (not verified on a GPU)", "precision.fp8_format", "learner.loss.old_logprobs")
        _check(self.optim.use_distributed_optimizer == self.parallel.use_distributed_optimizer,
               "optim.use_distributed_optimizer and parallel.use_distributed_optimizer disagree",
               "optim.use_distributed_optimizer", "parallel.use_distributed_optimizer")

    def _check_run_combinations(self) -> None:
        """Modes against algorithms, rollouts and logging."""
        lr, lc = self.learner, self.learner.loss
        _check(lr.mode != "stream-turn" or self.rl.algorithm == "opd",
               "learner.mode stream-turn needs rl.algorithm opd (a turn can only be trained before its trajectory "
               "ends when each token has its own teacher signal)", "learner.mode", "rl.algorithm")
        _check(not (self.rollout.speculative and lr.mode == "async"), "rollout.speculative replaces async "
               "sampling (drafts are verified under the current policy); it runs with learner.mode sync or streaming",
               "rollout.speculative", "learner.mode")
        _check(not (self.rollout.speculative and self.model.moe_router_replay), "rollout.speculative does not "
               "record MoE routing for router replay yet", "rollout.speculative", "model.moe_router_replay")
        harness = self.rollout.harness_cmd or self.rollout.harness_fn
        _check(not harness or (self.rollout.num_workers > 0 and self.logging.replay_rollouts is None
                               and self.rl.algorithm == "grpo"),
               "rollout.harness_cmd / harness_fn drive live GRPO rollouts in the rollout workers: they need "
               "rollout.num_workers > 0, no logging.replay_rollouts and rl.algorithm grpo", "rollout.harness_cmd",
               "rollout.num_workers")
        _check((lr.mode == "async") == (self.rl.max_staleness > 0),
               f"rl.max_staleness must be > 0 exactly when learner.mode is async (got rl.max_staleness "
               f"{self.rl.max_staleness} with learner.mode {lr.mode})", "rl.max_staleness", "learner.mode")
        _check(self.rl.algorithm != "opd" or self.rollout.teacher_model is not None
               or self.logging.replay_rollouts is not None,
               "rl.algorithm opd needs rollout.teacher_model (or logging.replay_rollouts with recorded teacher "
               "log-probs)", "rl.algorithm", "rollout.teacher_model")
        _check(self.rl.opd_objective == "sampled" or (self.rl.algorithm == "opd"
                                                      and self.rollout.teacher_model is not None),
               "rl.opd_objective full-vocab needs rl.algorithm opd and rollout.teacher_model (the teacher's full "
               "logits are scored on the learner side; recorded rollouts only carry log-probs of sampled tokens)",
               "rl.opd_objective", "rollout.teacher_model")
        _check(lc.temperature == self.rollout.temperature,
               f"learner.loss.temperature {lc.temperature} differs from rollout.temperature "
               f"{self.rollout.temperature}: the learner's log-probs must use the sampling temperature",
               "learner.loss.temperature", "rollout.temperature")
        _check(lc.kl_mode != "none" or lc.kl_coef == 0.0,
               f"learner.loss.kl_coef {lc.kl_coef} has no effect with learner.loss.kl_mode none "
               "(choose loss or reward)", "learner.loss.kl_coef", "learner.loss.kl_mode")
        self._check_kl()
        _check(self.rollout.weight_sync != "broadcast" or lr.mode != "async",
               "rollout.weight_sync broadcast is a collective every worker joins for every version, so workers cannot "
               "run ahead: use rollout.weight_sync file with learner.mode async", "rollout.weight_sync", "learner.mode")
        declared = declared_reward_spec(self.rollout.verifier)
        conflict = None if declared is None else reward_spec_conflict(
            lr.reward_spec, declared, f"rollout.verifier {self.rollout.verifier}")
        _check(conflict is None, conflict or "", "learner.reward_spec", "rollout.verifier")
        _check(self.logging.replay_rollouts is None or self.rollout.num_workers == 0,
               f"logging.replay_rollouts trains on recorded rollouts: rollout.num_workers must be 0, "
               f"got {self.rollout.num_workers}", "logging.replay_rollouts", "rollout.num_workers")

    def _check_kl(self) -> None:
        """The KL-to-reference term: on only with a coefficient, for GRPO, and a reference folder only with it."""
        lc = self.learner.loss
        _check(lc.kl_mode == "none" or lc.kl_coef > 0.0,
               f"learner.loss.kl_mode {lc.kl_mode} needs learner.loss.kl_coef > 0, got {lc.kl_coef} (β = 0 trains "
               "without the KL term)", "learner.loss.kl_coef", "learner.loss.kl_mode")
        _check(lc.kl_mode == "none" or self.rl.algorithm == "grpo",
               f"learner.loss.kl_mode {lc.kl_mode} is implemented for rl.algorithm grpo only (the OPD learner has no "
               "KL-to-reference term: its objective is the reverse KL to the teacher)", "learner.loss.kl_mode",
               "rl.algorithm")
        _check(self.model.ref_model is None or lc.kl_mode != "none",
               "model.ref_model has no effect with learner.loss.kl_mode none (the reference only scores the KL term)",
               "model.ref_model", "learner.loss.kl_mode")

    # -------------------------------------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict (JSON/YAML-safe): dtypes as names, non-finite floats as "inf" / "-inf"."""
        return _to_plain(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainConfig":
        """Inverse of ``to_dict``. Missing keys take their defaults; unknown keys are a ConfigError naming them."""
        return _from_plain(cls, data, "")


if typing.TYPE_CHECKING:  # pragma: no cover - names of the lazily loaded sections, for type checkers
    from megatron_tsync.training.learner import LearnerConfig
    from megatron_tsync.model.builder import PrecisionConfig
    from megatron_tsync.training.optimizer import OptimConfig
