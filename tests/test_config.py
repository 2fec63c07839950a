"""megatron_tsync.config: section validation, cross-section rules, (de)serialisation, registries in sync."""

import ast
import dataclasses
import inspect
import math

import pytest

from megatron_tsync import config as C
from megatron_tsync.config import (
    CheckpointConfig,
    ConfigError,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    RLConfig,
    RolloutConfig,
    TrainConfig,
    reward_spec_for_verifier,
)

OWN_SECTIONS = [ModelConfig, ParallelConfig, RLConfig, RolloutConfig, CheckpointConfig, LoggingConfig, TrainConfig]


@pytest.mark.parametrize("cls", OWN_SECTIONS, ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(cls):
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    documented = {
        stmt.target.id
        for stmt, nxt in zip(body, body[1:])
        if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
    }
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in documented]
    assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


@pytest.mark.parametrize("cls", OWN_SECTIONS, ids=lambda c: c.__name__)
def test_defaults_valid_and_frozen(cls):
    obj = cls()
    name = dataclasses.fields(obj)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, name, getattr(obj, name))


@pytest.mark.parametrize("cls,kwargs,field", [
    (ParallelConfig, dict(tensor_model_parallel_size=0), "parallel.tensor_model_parallel_size"),
    (ParallelConfig, dict(context_parallel_size=-1), "parallel.context_parallel_size"),
    (ParallelConfig, dict(expert_model_parallel_size=0), "parallel.expert_model_parallel_size"),
    (RLConfig, dict(algorithm="ppo"), "rl.algorithm"),
    (RLConfig, dict(group_size=0), "rl.group_size"),
    (RLConfig, dict(train_iters=0), "rl.train_iters"),
    (RLConfig, dict(max_staleness=-1), "rl.max_staleness"),
    (RLConfig, dict(max_new_tokens=100, seq_length=50), "rl.max_new_tokens"),
    (RolloutConfig, dict(engine="sglang"), "rollout.engine"),
    (RolloutConfig, dict(num_workers=-1), "rollout.num_workers"),
    (RolloutConfig, dict(temperature=0.0), "rollout.temperature"),
    (RolloutConfig, dict(top_k=-1), "rollout.top_k"),
    (RolloutConfig, dict(top_p=1.5), "rollout.top_p"),
    (RolloutConfig, dict(latency_profile="bursty"), "rollout.latency_profile"),
    (RolloutConfig, dict(latency_scale=-1.0), "rollout.latency_scale"),
    (RolloutConfig, dict(sandbox_timeout_s=0.0), "rollout.sandbox_timeout_s"),
    (RolloutConfig, dict(engine_tensor_parallel_size=0, engine="vllm"), "rollout.engine_tensor_parallel_size"),
    (RolloutConfig, dict(engine_tensor_parallel_size=2), "rollout.engine_tensor_parallel_size"),
    (RolloutConfig, dict(stall_timeout_s=0.0), "rollout.stall_timeout_s"),
    (RolloutConfig, dict(max_num_seqs=-1), "rollout.max_num_seqs"),
    (RolloutConfig, dict(frontier_first=True), "rollout.frontier_first"),  # embedded: needs max_num_seqs
    (RolloutConfig, dict(frontier_first=True, max_num_seqs=4, harness_cmd="x"), "rollout.frontier_first"),
    (RLConfig, dict(max_new_tokens=0), "rl.max_new_tokens"),
    (CheckpointConfig, dict(save_interval=0), "checkpoint.save_interval"),
    (CheckpointConfig, dict(finetune=True), "checkpoint.load"),
    (LoggingConfig, dict(log_interval=0), "logging.log_interval"),
    (LoggingConfig, dict(dump_rollouts="d", replay_rollouts="d"), "logging.replay_rollouts"),
    (ModelConfig, dict(init_tiny_model=True), "model.path"),
    (ModelConfig, dict(sft_warmup_steps=-1), "model.sft_warmup_steps"),
    (ModelConfig, dict(sft_warmup_lr=0.0), "model.sft_warmup_lr"),
    (ModelConfig, dict(moe_aux_loss_coeff=1e-3), "model.moe_aux_loss_coeff"),  # not exact when streaming
])
def test_section_validation_names_fields(cls, kwargs, field):
    with pytest.raises(ConfigError) as exc:
        cls(**kwargs)
    assert field in exc.value.fields


def test_latency_profile_file_accepted():
    assert RolloutConfig(latency_profile="profiles/swe.json").latency_profile.endswith(".json")


def test_data_parallel_size():
    par = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert par.model_parallel_size == 4 and par.data_parallel_size(8) == 2
    with pytest.raises(ConfigError) as exc:
        par.data_parallel_size(6)
    assert "parallel.pipeline_model_parallel_size" in exc.value.fields


def _cfg(**sections):
    return TrainConfig.from_dict(sections)


@pytest.mark.parametrize("sections,fields", [
    (dict(precision={"params_dtype": "float64"}), {"precision.params_dtype", "optim.clip_grad"}),
    (dict(precision={"params_dtype": "float64", "bf16": True}, optim={"clip_grad": 0.0}), {"precision.bf16"}),
    (dict(precision={"params_dtype": "float64", "fp8_format": "e4m3"}, optim={"clip_grad": 0.0}),
     {"precision.fp8_format"}),
    (dict(precision={"params_dtype": "bfloat16"}), {"precision.params_dtype"}),
    (dict(precision={"fp8_format": "e5m2"}), {"precision.fp8_format"}),
    (dict(optim={"use_distributed_optimizer": True}), {"optim.use_distributed_optimizer"}),
    (dict(learner={"mode": "stream-turn"}), {"learner.mode", "rl.algorithm"}),
    (dict(learner={"mode": "async"}), {"rl.max_staleness"}),
    (dict(rl={"max_staleness": 3}), {"rl.max_staleness"}),
    (dict(rl={"algorithm": "opd"}), {"rollout.teacher_model"}),
    (dict(rl={"algorithm": "opd", "opd_objective": "full-vocab"}, logging={"replay_rollouts": "d"},
          rollout={"num_workers": 0}), {"rl.opd_objective", "rollout.teacher_model"}),
    (dict(rl={"opd_objective": "full-vocab"}, rollout={"teacher_model": "t"}), {"rl.opd_objective"}),
    (dict(learner={"loss": {"temperature": 0.5}}), {"learner.loss.temperature", "rollout.temperature"}),
    (dict(learner={"loss": {"kl_coef": 0.1}}), {"learner.loss.kl_mode"}),
    (dict(learner={"loss": {"kl_mode": "loss"}}), {"learner.loss.kl_coef", "learner.loss.kl_mode"}),
    (dict(learner={"loss": {"kl_mode": "reward", "kl_coef": -0.1}}), {"learner.loss.kl_coef"}),
    (dict(learner={"loss": {"kl_mode": "loss", "kl_coef": 0.1}}, rl={"algorithm": "opd"}, rollout={"teacher_model": "t"}),
     {"learner.loss.kl_mode", "rl.algorithm"}),
    (dict(model={"ref_model": "r"}), {"model.ref_model", "learner.loss.kl_mode"}),
    (dict(learner={"max_open_groups": 0}), {"learner.max_open_groups"}),
    (dict(learner={"num_minibatches": 2}, rl={"groups_per_step": 1}), {"learner.num_minibatches", "rl.groups_per_step"}),
    (dict(learner={"estimator": "ppo"}), {"learner.estimator"}),
    (dict(learner={"loss": {"aggregation": "mean"}}), {"learner.loss.aggregation"}),
    (dict(logging={"replay_rollouts": "d"}), {"rollout.num_workers"}),
    (dict(learner={"loss": {"policy": {"clip_low": 1.0}}}), {"learner.loss.policy.clip_low"}),
    (dict(learner={"reward_spec": {"kind": "binary", "lo": 1.0, "hi": 0.0}}),
     {"learner.reward_spec.lo", "learner.reward_spec.hi"}),
])
def test_cross_section_rules(sections, fields):
    with pytest.raises(ConfigError) as exc:
        _cfg(**sections)
    assert fields <= set(exc.value.fields), exc.value.fields


def test_valid_combinations():
    import torch

    cfg = _cfg(precision={"params_dtype": "float64"}, optim={"clip_grad": 0.0})
    assert cfg.precision.params_dtype == torch.float64
    assert _cfg(learner={"mode": "async"}, rl={"max_staleness": 2}).rl.max_staleness == 2
    assert _cfg(rl={"algorithm": "opd"}, logging={"replay_rollouts": "d"}, rollout={"num_workers": 0})
    assert _cfg(rl={"algorithm": "opd"}, rollout={"teacher_model": "t"}, learner={"mode": "stream-turn"})
    assert _cfg(rl={"algorithm": "opd", "opd_objective": "full-vocab"}, rollout={"teacher_model": "t"})
    assert _cfg(learner={"loss": {"kl_coef": 0.1, "kl_mode": "reward"}})


def test_from_dict_partial_unknown_and_types():
    assert TrainConfig.from_dict({}) == TrainConfig()
    assert TrainConfig.from_dict({"optim": {"lr": 1}}).optim.lr == 1.0  # YAML ints are fine for floats
    with pytest.raises(ConfigError, match="'rl.grup_size'"):
        TrainConfig.from_dict({"rl": {"grup_size": 4}})
    with pytest.raises(ConfigError, match="'optimizer'"):
        TrainConfig.from_dict({"optimizer": {}})
    with pytest.raises(ConfigError) as exc:
        TrainConfig.from_dict({"rl": {"group_size": "8"}})
    assert exc.value.fields == ("rl.group_size",)
    with pytest.raises(ConfigError):
        TrainConfig.from_dict({"logging": {"progress": "yes"}})
    with pytest.raises(ConfigError):
        TrainConfig.from_dict({"rl": 3})


def test_round_trip_with_inf_and_dtype():
    import json

    from megatron_tsync.algorithms.streamability import RewardSpec

    cfg = dataclasses.replace(TrainConfig(), learner=dataclasses.replace(
        TrainConfig().learner, reward_spec=RewardSpec.continuous()))
    plain = cfg.to_dict()
    assert plain["learner"]["reward_spec"]["hi"] == "inf" and plain["precision"]["params_dtype"] == "float32"
    assert TrainConfig.from_dict(json.loads(json.dumps(plain, allow_nan=False))) == cfg
    assert math.isinf(TrainConfig.from_dict(plain).learner.reward_spec.lo)


def test_reward_spec_for_verifier():
    assert reward_spec_for_verifier("exact_answer") == C._foreign("RewardSpec").binary(0.0, 1.0)
    spec = reward_spec_for_verifier("answer_with_format")
    assert (spec.kind, spec.lo, spec.hi) == ("bounded", 0.0, 1.0)
    assert reward_spec_for_verifier("not-registered").kind == "binary"


def test_reward_spec_conflicts_with_the_verifier():
    """learner.reward_spec may assume less than the verifier declares, never more (also from a config dict)."""
    RS = C._foreign("RewardSpec")
    binary, bounded = RS.binary(0.0, 1.0), RS.bounded(0.0, 1.0)
    ok = [(binary, binary), (bounded, binary), (RS.bounded(-1.0, 2.0), bounded), (RS.continuous(), bounded),
          (RS.continuous(), RS.continuous())]
    bad = [(RS.binary(-1.0, 1.0), binary), (binary, bounded), (RS.bounded(0.0, 0.5), binary),
           (RS.bounded(0.0, 1.0), RS.continuous()), (RS.bounded(0.5, 1.0), bounded)]
    assert all(C.reward_spec_conflict(s, d, "v") is None for s, d in ok)
    assert all("contradicts v" in C.reward_spec_conflict(s, d, "v") for s, d in bad)
    with pytest.raises(ConfigError, match="contradicts rollout.verifier answer_with_format") as e:
        TrainConfig.from_dict({"rollout": {"verifier": "answer_with_format"}})  # the default spec is binary
    assert set(e.value.fields) == {"learner.reward_spec", "rollout.verifier"}
    cfg = TrainConfig.from_dict({"rollout": {"verifier": "my-plugin"},  # not registered: nothing declared
                                 "learner": {"reward_spec": {"kind": "binary", "lo": -1.0, "hi": 1.0}}})
    assert cfg.learner.reward_spec.lo == -1.0


def test_choices_match_the_registries():
    from megatron_tsync.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from megatron_tsync.algorithms.aggregation import AGGREGATION_MODES
    from megatron_tsync.algorithms.kl import KL_PENALTIES
    from megatron_tsync.algorithms.policy_loss import POLICY_LOSS_KINDS
    from megatron_tsync.algorithms.streamability import REWARD_KINDS
    from megatron_tsync.streaming.planner import MODES

    assert set(C.ADVANTAGE_ESTIMATORS) == set(ADVANTAGE_ESTIMATORS)
    assert C.AGGREGATIONS == AGGREGATION_MODES
    assert set(C.KL_ESTIMATORS) == set(KL_PENALTIES)
    assert C.POLICY_LOSSES == POLICY_LOSS_KINDS
    assert C.REWARD_KINDS == REWARD_KINDS
    assert set(MODES) <= set(C.RL_MODES)  # async and stream-turn are run-level modes on top of the planner's
    from megatron_tsync.training.opd_learner import OPD_OBJECTIVES

    assert C.OPD_OBJECTIVES == OPD_OBJECTIVES
    from megatron_tsync.model.tiny_model import FAMILIES

    assert C.TINY_FAMILIES == FAMILIES


def test_tiny_model_family_picks_what_init_tiny_model_creates(tmp_path):
    import json

    from megatron_tsync.runtime.context import model_dir

    for family, model_type in (("llama", "llama"), ("qwen3_moe", "qwen3_moe")):
        cfg = TrainConfig.from_dict({"model": {"path": str(tmp_path / family), "init_tiny_model": True,
                                               "tiny_model_family": family}})
        model_dir(cfg, rank=0)
        assert json.loads((tmp_path / family / "config.json").read_text())["model_type"] == model_type


def test_reused_sections_are_the_owners_classes():
    from megatron_tsync.training.learner import LearnerConfig
    from megatron_tsync.model.builder import PrecisionConfig
    from megatron_tsync.training.optimizer import OptimConfig

    cfg = TrainConfig()
    assert type(cfg.learner) is LearnerConfig and type(cfg.optim) is OptimConfig
    assert type(cfg.precision) is PrecisionConfig


@pytest.mark.parametrize("section", [
    RLConfig(group_size=3, max_turns=2, max_new_tokens=16, seq_length=128, max_staleness=1),
    RolloutConfig(engine="vllm", engine_tensor_parallel_size=2, temperature=0.7, top_k=5, top_p=0.9,
                  latency_profile="swe-like", stall_timeout_s=60.0, teacher_model=None),
], ids=lambda s: type(s).__name__)
def test_sections_round_trip_on_their_own(section):
    """What a rollout worker's spec carries (runtime/worker.py: WorkerSpec)."""
    import json

    assert type(section).from_dict(json.loads(json.dumps(section.to_dict()))) == section
    with pytest.raises(ConfigError) as exc:
        type(section).from_dict({**section.to_dict(), "nope": 1})
    assert f"{section._PATH}.nope" in str(exc.value)


def test_sampling_fields_are_validated_by_the_engines_sampling_config():
    """One set of rules for temperature / top_k / top_p / max_new_tokens: rollout.engine.SamplingConfig's."""
    from megatron_tsync.rollout.engine import SamplingConfig

    for section, kwargs in ((RolloutConfig, dict(temperature=float("nan"))), (RolloutConfig, dict(top_p=0.0)),
                            (RLConfig, dict(max_new_tokens=-3))):
        (name, value), = kwargs.items()
        with pytest.raises(ValueError) as engine_err:
            SamplingConfig(**kwargs)
        with pytest.raises(ConfigError) as exc:
            section(**kwargs)
        assert str(exc.value) == f"{section._PATH}.{engine_err.value}"
        assert exc.value.fields == (f"{section._PATH}.{name}",)
