"""The flag surface of megatron_tsync.arguments: pinned names, defaults, bad combinations, --config files."""

import json
import os
import subprocess
import sys

import pytest

from megatron_tsync.arguments import build_parser, flag_for_field, parse_args
from megatron_tsync.config import TrainConfig

# Every option string the training entry point accepts, sorted. This list is deliberately checked in: adding,
# removing or renaming a flag is a user-facing change (launch scripts, --config files, docs) and must be made here
# on purpose, in the same change.
EXPECTED_FLAGS = [
    "--adam-beta1", "--adam-beta2", "--adam-eps", "--advantage-eps", "--advantage-estimator", "--aux-strategy",
    "--accumulate-on-host", "--no-accumulate-on-host", "--bf16", "--bucket-device-gib", "--bucket-host-gib", "--harness-cmd", "--harness-fn", "--harness-timeout", "--harness-chat-format", "--clip-grad", "--clip-ratio-high", "--clip-ratio-low", "--config", "--context-parallel-size", "--deterministic",
    "--dual-clip", "--dump-grads", "--dump-rollouts", "--entropy-coef", "--eval-interval", "--eval-prompts", "--eval-greedy", "--no-eval-greedy", "--exit-duration-in-mins", "--expert-model-parallel-size", "--finetune", "--fp8-format", "--fp8-recipe",
    "--global-batch-size", "--group-size", "--groups-per-step", "--help", "--init-tiny-model", "--kl-coef",
    "--keep-last-checkpoints", "--kl-estimator", "--kl-mode", "--latency-profile", "--latency-scale", "--load",
    "--load-fallback", "--log-interval",
    "--dp-assignment", "--loss-aggregation", "--lr", "--max-consecutive-skipped-steps", "--max-device-buckets", "--max-new-tokens", "--max-open-groups", "--max-staleness", "--max-turns",
    "--micro-batch-size", "--min-lr", "--model", "--moe-aux-loss-coeff", "--moe-router-replay", "--no-progress", "--num-minibatches", "--num-samples-per-prompt", "--old-logprobs", "--opd-objective",
    "--optimizer", "--override-loaded-config", "--params-dtype", "--pipeline-model-parallel-size", "--policy-loss", "--ppo-epochs", "--replay-rollouts",
    "--replay-shuffle-seed",
    "--reward-kind", "--reward-range", "--rl-algorithm", "--rl-mode", "--rollout-endpoint", "--rollout-engine",
    "--rollout-dir", "--rollout-gpus", "--rollout-heartbeat-timeout", "--rollout-launch", "--rollout-retries", "--rollout-stall-timeout", "--rollout-tensor-parallel-size", "--rollout-cpus", "--trainer-cpus",
    "--rollout-max-num-seqs", "--rollout-frontier-first", "--no-rollout-frontier-first",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
    "--ref-model", "--rollout-workers", "--sandbox-timeout", "--save", "--save-interval", "--secret-file", "--seed", "--seq-length",
    "--sequence-packing", "--no-sequence-packing", "--max-packed-tokens", "--skip-zero-advantage",
    "--no-skip-zero-advantage", "--shared-prefix", "--no-shared-prefix", "--pack-across-groups",
    "--no-pack-across-groups",
    "--speculative-rollouts", "--speculative-draft-tokens",
    "--stream-coalesce-ms", "--stream-coalesce-tokens", "--stream-wait-for-variance", "--no-stream-wait-for-variance",
    "--stream-full-microbatches", "--no-stream-full-microbatches",
    "--sft-warmup-lr", "--sft-warmup-steps", "--sgd-momentum", "--task", "--tau2-keep-trivial-tasks", "--no-tau2-keep-trivial-tasks",
    "--teacher-model", "--temperature",
    "--tensor-model-parallel-size", "--tensorboard-dir", "--tiny-model-family", "--tis-cap", "--top-k", "--top-p", "--train-iters",
    "--use-distributed-optimizer", "--verifier",
    # every switch has its --no- form (test_every_switch_has_a_no_form)
    "--no-bf16", "--no-deterministic", "--no-finetune", "--no-init-tiny-model", "--no-load-fallback",
    "--no-moe-router-replay", "--no-override-loaded-config", "--no-speculative-rollouts",
    "--no-use-distributed-optimizer", "--stop-on-no-signal", "--wandb-exp-name", "--wandb-project", "--wandb-save-dir", "--weight-decay", "--weight-sync", "--weight-sync-bucket-mb", "-h",
]


def _option_strings():
    return sorted(o for a in build_parser()._actions for o in a.option_strings)


def test_flag_surface_is_pinned():
    actual = _option_strings()
    added = sorted(set(actual) - set(EXPECTED_FLAGS))
    removed = sorted(set(EXPECTED_FLAGS) - set(actual))
    assert actual == sorted(EXPECTED_FLAGS), (
        f"the command-line surface changed (added: {added}, removed: {removed}). If this is deliberate, update "
        "EXPECTED_FLAGS in tests/test_arguments.py in the same change (and the docs / example configs that use "
        "the flag); otherwise restore the flag."
    )


def test_build_parser_imports_no_torch():
    code = ("import sys; from megatron_tsync.arguments import build_parser; build_parser().parse_args(['--lr', '1']);"
            "assert 'torch' not in sys.modules and 'megatron.core' not in sys.modules, 'heavy import'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_defaults_produce_the_default_config():
    cfg = parse_args([])
    assert cfg == TrainConfig()
    assert cfg.rl.sequences_per_step == cfg.rl.groups_per_step * cfg.rl.group_size


def test_flags_land_in_their_fields():
    import torch

    cfg = parse_args([
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
        "--micro-batch-size", "1", "--num-samples-per-prompt", "4", "--global-batch-size", "12", "--lr", "3e-6",
        "--min-lr", "3e-6", "--clip-grad", "0", "--params-dtype", "float64", "--optimizer", "sgd",
        "--rl-mode", "stream-group", "--clip-ratio-low", "0.1", "--clip-ratio-high", "0.28", "--dual-clip", "3",
        "--tis-cap", "2", "--kl-coef", "0.01", "--kl-mode", "loss", "--kl-estimator", "k1", "--temperature", "0.7",
        "--aux-strategy", "defer", "--max-open-groups", "2", "--verifier", "answer_with_format", "--model", "m",
        "--no-progress", "--save", "ck", "--save-interval", "5", "--rollout-workers", "3", "--sandbox-timeout", "2.5",
        "--eval-interval", "10", "--eval-prompts", "64", "--no-eval-greedy",
    ], world_size=8)
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size) == (2, 2)
    assert cfg.parallel.use_distributed_optimizer and cfg.optim.use_distributed_optimizer
    assert (cfg.rl.group_size, cfg.rl.groups_per_step) == (4, 3)
    assert cfg.optim.lr == 3e-6 and cfg.optim.clip_grad == 0 and cfg.optim.optimizer == "sgd"
    assert cfg.precision.params_dtype == torch.float64
    pol = cfg.learner.loss.policy
    assert (pol.clip_low, pol.clip_high, pol.dual_clip, pol.tis_cap) == (0.1, 0.28, 3.0, 2.0)
    assert cfg.learner.mode == "stream-group" and cfg.learner.aux_strategy == "defer"
    assert cfg.learner.loss.temperature == cfg.rollout.temperature == 0.7
    assert (cfg.learner.loss.kl_coef, cfg.learner.loss.kl_mode, cfg.learner.loss.kl_kind) == (0.01, "loss", "k1")
    assert cfg.learner.reward_spec.kind == "bounded"  # declared by answer_with_format
    assert cfg.learner.max_open_groups == 2
    assert cfg.model.path == "m" and not cfg.logging.progress
    assert (cfg.logging.eval_interval, cfg.logging.eval_prompts, cfg.logging.eval_greedy) == (10, 64, False)
    assert (cfg.checkpoint.save, cfg.checkpoint.save_interval) == ("ck", 5)
    assert cfg.rollout.num_workers == 3 and cfg.rollout.sandbox_timeout_s == 2.5


def test_rollout_engine_flags():
    cfg = parse_args(["--rollout-engine", "vllm", "--rollout-tensor-parallel-size", "4",
                      "--rollout-stall-timeout", "60"])
    assert cfg.rollout.engine_tensor_parallel_size == 4 and cfg.rollout.stall_timeout_s == 60.0
    assert parse_args([]).rollout.engine_tensor_parallel_size == 1  # the worker factory's use: tests/runtime


def test_sequence_packing_flags():
    cfg = parse_args(["--sequence-packing", "--max-packed-tokens", "8192"])
    assert cfg.learner.sequence_packing and cfg.learner.max_packed_tokens == 8192
    assert not parse_args([]).learner.sequence_packing


def test_every_field_flag_maps_back():
    from megatron_tsync.arguments import _FLAGS

    for flag in _FLAGS:
        for path in flag.fields:
            assert flag_for_field(path) == flag.names[0]
            obj = TrainConfig()
            for part in path.split("."):
                obj = getattr(obj, part)  # the path exists in TrainConfig


def test_reward_flags():
    assert parse_args(["--reward-kind", "bounded", "--reward-range", "-1", "1"]).learner.reward_spec.lo == -1.0
    spec = parse_args(["--reward-kind", "continuous"]).learner.reward_spec
    assert spec.kind == "continuous"
    spec = parse_args(["--reward-kind", "bounded", "--reward-range", "0", "5"]).learner.reward_spec
    assert (spec.kind, spec.lo, spec.hi) == ("bounded", 0.0, 5.0)
    spec = parse_args(["--reward-kind", "bounded"]).learner.reward_spec  # the verifier's range, as bounds
    assert (spec.kind, spec.lo, spec.hi) == ("bounded", 0.0, 1.0)
    assert parse_args(["--reward-range", "0", "1"]).learner.reward_spec.kind == "binary"  # = exact_answer's


@pytest.mark.parametrize("argv,declared", [
    (["--reward-range", "-1", "1"], "binary {0, 1}"),  # other binary values than exact_answer's
    (["--reward-kind", "bounded", "--reward-range", "0", "0.5"], "binary {0, 1}"),  # excludes its success value
    (["--reward-kind", "binary", "--verifier", "answer_with_format"], "bounded [0, 1]"),  # 0.5 is legal there
    (["--reward-kind", "bounded", "--reward-range", "0.1", "1", "--verifier", "answer_with_format"], "bounded [0, 1]"),
])
def test_reward_flags_contradicting_the_verifier_are_errors(capsys, argv, declared):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--reward-kind/--reward-range" in err and "contradicts --verifier" in err and declared in err, err


def test_reward_flags_are_honoured_not_replaced():
    """What the flags say reaches the learner's section (a weaker assumption than the verifier's is allowed)."""
    for argv, want in ((["--reward-kind", "continuous"], ("continuous",)),
                       (["--reward-kind", "bounded", "--reward-range", "-2", "3"], ("bounded", -2.0, 3.0)),
                       (["--verifier", "answer_with_format", "--reward-kind", "bounded", "--reward-range", "-1", "1"],
                        ("bounded", -1.0, 1.0))):
        spec = parse_args(argv).learner.reward_spec
        assert (spec.kind, spec.lo, spec.hi)[:len(want)] == want, argv


def test_weight_sync_flags():
    cfg = parse_args(["--weight-sync", "broadcast", "--weight-sync-bucket-mb", "64"])
    assert (cfg.rollout.weight_sync, cfg.rollout.weight_sync_bucket_mb) == ("broadcast", 64)
    assert parse_args([]).rollout.weight_sync == "file"


def test_replay_needs_no_workers():
    cfg = parse_args(["--replay-rollouts", "dir"])
    assert cfg.rollout.num_workers == 0
    assert parse_args(["--replay-rollouts", "dir", "--rollout-workers", "0"]).rollout.num_workers == 0


def test_async_and_opd_modes():
    assert parse_args(["--rl-mode", "async", "--max-staleness", "2"]).rl.max_staleness == 2
    cfg = parse_args(["--rl-algorithm", "opd", "--teacher-model", "t", "--rl-mode", "stream-turn"])
    assert cfg.rl.algorithm == "opd" and cfg.learner.mode == "stream-turn" and cfg.rl.opd_objective == "sampled"
    cfg = parse_args(["--rl-algorithm", "opd", "--teacher-model", "t", "--opd-objective", "full-vocab"])
    assert cfg.rl.opd_objective == "full-vocab"
    assert parse_args(["--rl-algorithm", "opd", "--replay-rollouts", "d"]).rollout.teacher_model is None
    assert parse_args(["--dump-grads", "g", "--pipeline-model-parallel-size", "2"]).logging.dump_grads == "g"


BAD = [
    (["--micro-batch-size", "2"], ["--micro-batch-size", "one trajectory per microbatch"]),
    (["--min-lr", "1e-7"], ["--min-lr", "--lr", "no learning-rate schedule"]),
    (["--global-batch-size", "30", "--group-size", "8"], ["--global-batch-size", "--group-size"]),
    (["--global-batch-size", "32", "--groups-per-step", "3"], ["--global-batch-size", "--groups-per-step"]),
    (["--tensor-model-parallel-size", "3"], ["--tensor-model-parallel-size", "--pipeline-model-parallel-size"]),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4"], ["--tensor-model-parallel-size"]),
    (["--params-dtype", "float64"], ["--params-dtype", "--clip-grad"]),
    (["--params-dtype", "float64", "--clip-grad", "0", "--bf16"], ["--bf16", "--params-dtype"]),
    (["--params-dtype", "float64", "--clip-grad", "0", "--fp8-format", "e4m3"], ["--fp8-format", "--params-dtype"]),
    (["--fp8-recipe", "mxfp8"], ["--fp8-recipe", "--fp8-format"]),
    (["--rl-mode", "stream-turn"], ["--rl-mode", "--rl-algorithm opd"]),
    (["--rl-algorithm", "opd"], ["--rl-algorithm", "--teacher-model"]),
    (["--rl-mode", "async"], ["--max-staleness", "--rl-mode"]),
    (["--max-staleness", "2"], ["--max-staleness", "--rl-mode"]),
    (["--max-staleness", "0", "--rl-mode", "sync"], ["--max-staleness", "--rl-mode async"]),
    (["--rl-mode", "async", "--max-staleness", "0"], ["--max-staleness", "> 0"]),
    (["--replay-rollouts", "d", "--rollout-workers", "2"], ["--replay-rollouts", "--rollout-workers"]),
    (["--harness-cmd", "a", "--harness-fn", "m:f"], ["--harness-cmd", "--harness-fn"]),
    (["--harness-fn", "nocolon"], ["--harness-fn"]),
    (["--harness-cmd", "a", "--replay-rollouts", "d", "--rollout-workers", "0"], ["--harness-cmd", "--rollout-workers"]),
    (["--harness-cmd", "a", "--harness-timeout", "0"], ["--harness-timeout"]),
    (["--max-open-groups", "0"], ["--max-open-groups"]),
    (["--max-device-buckets", "1"], ["--max-device-buckets"]),
    (["--bucket-device-gib", "0"], ["--bucket-device-gib"]),
    (["--bucket-host-gib", "1"], ["--bucket-host-gib", "--max-device-buckets", "--bucket-device-gib"]),
    (["--accumulate-on-host", "--max-device-buckets", "2"], ["--accumulate-on-host", "--max-device-buckets"]),
    (["--sequence-packing", "--max-packed-tokens", "0"], ["--max-packed-tokens"]),
    (["--pack-across-groups", "--rl-mode", "stream-trajectory"], ["--pack-across-groups", "--sequence-packing"]),
    (["--pack-across-groups", "--sequence-packing", "--rl-mode", "sync"], ["--pack-across-groups", "--rl-mode"]),
    (["--stream-full-microbatches", "--rl-mode", "stream-trajectory"], ["--stream-full-microbatches",
                                                                         "--sequence-packing"]),
    (["--stream-full-microbatches", "--sequence-packing", "--rl-mode", "sync"],
     ["--stream-full-microbatches", "--rl-mode"]),
    (["--sequence-packing", "--rl-algorithm", "opd", "--teacher-model", "t"], ["--sequence-packing", "--rl-algorithm"]),
    (["--clip-ratio-low", "1.5"], ["--clip-ratio-low"]),
    (["--clip-ratio-high", "-0.1"], ["--clip-ratio-high"]),
    (["--dual-clip", "0.5"], ["--dual-clip"]),
    (["--policy-loss", "none", "--dual-clip", "3"], ["--dual-clip", "--policy-loss"]),
    (["--tis-cap", "0"], ["--tis-cap"]),
    (["--reward-kind", "continuous", "--reward-range", "0", "1"], ["--reward-kind", "--reward-range"]),
    (["--reward-kind", "binary", "--reward-range", "1", "1"], ["--reward-range"]),
    (["--kl-coef", "0.1"], ["--kl-coef", "--kl-mode"]),
    (["--kl-mode", "loss"], ["--kl-coef", "--kl-mode"]),
    (["--kl-estimator", "k1"], ["--kl-estimator"]),
    (["--ref-model", "r"], ["--ref-model", "--kl-mode"]),
    (["--finetune"], ["--finetune", "--load"]),
    (["--init-tiny-model"], ["--init-tiny-model", "--model"]),
    (["--tiny-model-family", "qwen3"], ["--tiny-model-family", "--init-tiny-model"]),
    (["--max-new-tokens", "4096", "--seq-length", "1024"], ["--max-new-tokens", "--seq-length"]),
    (["--temperature", "0"], ["--temperature"]),
    (["--top-p", "0"], ["--top-p"]),
    (["--latency-profile", "bursty"], ["--latency-profile"]),
    (["--dump-rollouts", "d", "--replay-rollouts", "d"], ["--dump-rollouts", "--replay-rollouts"]),
    (["--save-interval", "0"], ["--save-interval"]),
    (["--load-fallback"], ["--load-fallback", "--load"]),
    (["--save", "ck", "--keep-last-checkpoints", "0"], ["--keep-last-checkpoints"]),
    (["--keep-last-checkpoints", "2"], ["--keep-last-checkpoints", "--save"]),
    (["--weight-sync", "broadcast", "--rl-mode", "async", "--max-staleness", "1"], ["--weight-sync", "--rl-mode"]),
    (["--weight-sync-bucket-mb", "0"], ["--weight-sync-bucket-mb"]),
    (["--rollout-tensor-parallel-size", "2"], ["--rollout-tensor-parallel-size", "--rollout-engine"]),
    (["--rollout-engine", "vllm", "--rollout-tensor-parallel-size", "0"], ["--rollout-tensor-parallel-size"]),
    (["--rollout-stall-timeout", "0"], ["--rollout-stall-timeout"]),
    (["--rollout-heartbeat-timeout", "0"], ["--rollout-heartbeat-timeout"]),
    (["--rollout-retries", "-1"], ["--rollout-retries"]),
    (["--top-k", "-1"], ["--top-k"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["--group-size", "0"], ["--group-size"]),
    (["--rl-mode", "streaming"], ["--rl-mode", "invalid choice"]),
    (["--moe-aux-loss-coeff", "0.001"], ["--moe-aux-loss-coeff", "advantage"]),
    # no abbreviations: the surface is exactly the list above
    (["--tensor-model"], ["unrecognized argument --tensor-model; did you mean --tensor-model-parallel-size?"]),
]


@pytest.mark.parametrize("argv,needles", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_combinations_exit_2_naming_the_flags(argv, needles, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=4)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def test_world_size_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert parse_args(["--tensor-model-parallel-size", "3"]).parallel.tensor_model_parallel_size == 3
    with pytest.raises(SystemExit):
        parse_args(["--tensor-model-parallel-size", "4"])
    monkeypatch.delenv("WORLD_SIZE")
    parse_args(["--tensor-model-parallel-size", "4"])  # unknown world size: checked at launch instead


# ------------------------------------------------------------------------------------------------------ --config
def test_yaml_config_and_cli_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1e-4\nmin-lr: 1.0e-4\nclip_grad: 0.5\ngroup-size: 4\nbf16: true\nno_progress: true\n"
                    "reward-kind: bounded\nreward-range: [-1, 1]\ndual_clip: null\nrl-mode: stream-group\n")
    cfg = parse_args(["--config", str(path)])
    assert cfg.optim.lr == 1e-4 and cfg.optim.clip_grad == 0.5 and cfg.rl.group_size == 4
    assert cfg.precision.bf16 and not cfg.logging.progress and cfg.learner.mode == "stream-group"
    assert (cfg.learner.reward_spec.lo, cfg.learner.reward_spec.hi) == (-1.0, 1.0)
    assert cfg.learner.loss.policy.dual_clip is None
    cfg = parse_args(["--clip-grad", "2", "--config", str(path), "--group-size", "2"])
    assert cfg.optim.clip_grad == 2.0 and cfg.rl.group_size == 2 and cfg.optim.lr == 1e-4


def test_json_config(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"rl_algorithm": "opd", "teacher-model": "t", "global_batch_size": 16,
                                "num_samples_per_prompt": 4, "finetune": False}))
    cfg = parse_args(["--config", str(path)])
    assert cfg.rl.algorithm == "opd" and cfg.rollout.teacher_model == "t"
    assert (cfg.rl.group_size, cfg.rl.groups_per_step) == (4, 4)
    assert not cfg.checkpoint.finetune


@pytest.mark.parametrize("text,needle", [
    ("clip_ratio_hgih: 0.3\n", "'clip_ratio_hgih'"),
    ("config: other.yaml\n", "'config'"),
    ("bf16: 1\n", "'bf16'"),
    ("lr: fast\n", "--lr"),
    ("- 1\n- 2\n", "mapping"),
    ("rl-mode: [sync\n", "cannot parse"),
    ("rl-mode: [sync\n", "line 1"),
    ("group-size: 0\n", "--group-size must be >= 1, got 0 (--group-size set in --config"),
    ("{]\n", "cannot parse"),
])
def test_bad_config_file(tmp_path, capsys, text, needle):
    """Every error about a --config file names the file (and the line for a syntax error)."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and str(path) in err, err


def test_a_flag_on_the_command_line_is_not_blamed_on_the_config_file(tmp_path, capsys):
    path = tmp_path / "ok.yaml"
    path.write_text("lr: 0.001\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(path), "--group-size", "0"])
    err = capsys.readouterr().err
    assert "--group-size must be >= 1" in err and str(path) not in err


def test_missing_config_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", str(tmp_path / "nope.yaml")])
    assert exc.value.code == 2 and "--config" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("argv", [
    [],
    ["--params-dtype", "float64", "--clip-grad", "0", "--reward-kind", "continuous", "--rl-mode", "sync"],
    ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--dual-clip", "3", "--tis-cap", "2",
     "--rl-mode", "async", "--max-staleness", "1", "--load", "ck", "--finetune", "--latency-profile", "p.json"],
])
def test_config_round_trip(argv):
    import yaml

    cfg = parse_args(argv)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict(), allow_nan=False))) == cfg
    assert TrainConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg


def test_help_exits_0_and_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--clip-ratio-high" in out and "(default: 0.2)" in out


def test_moe_flags_accept_only_the_exact_values():
    """--expert-model-parallel-size / --moe-aux-loss-coeff exist under megatron's names so that a launch script
    carrying them gets a reason, not 'unrecognized arguments'; only the values the learner trains exactly pass."""
    cfg = parse_args(["--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0"])
    assert cfg.parallel.expert_model_parallel_size == 2 and cfg.model.moe_aux_loss_coeff == 0.0


def test_config_switch_overridden_by_no_flag(tmp_path):
    """A config's ``sequence-packing: true`` is overridden by ``--no-sequence-packing`` on the command line, and the
    config's ``false`` by ``--sequence-packing`` (the command line wins in both directions)."""
    from megatron_tsync.arguments import parse_args

    for value, flag, want in ((True, "--no-sequence-packing", False), (False, "--sequence-packing", True)):
        cfg_file = tmp_path / f"c{value}.yaml"
        cfg_file.write_text(f"sequence-packing: {str(value).lower()}\n")
        assert parse_args(["--config", str(cfg_file)]).learner.sequence_packing is value
        assert parse_args(["--config", str(cfg_file), flag]).learner.sequence_packing is want


def test_help_defaults_snapshot_is_current():
    """--help reads its defaults from help_defaults.py (no torch import); regenerate it with
    ``python -m megatron_tsync.help_defaults`` after changing a default."""
    from megatron_tsync.help_defaults import DEFAULTS, current

    assert DEFAULTS == current()


def test_every_switch_has_a_no_form(tmp_path):
    """docs/flags.md: a switch a config file sets can be turned off on the command line. Walks the flag table: every
    switch (an option that takes no value) but the --no-X ones themselves has its --no- form, and it works."""
    import argparse

    parser = build_parser()
    switches = [a for a in parser._actions
                if isinstance(a, (argparse._StoreConstAction, argparse.BooleanOptionalAction)) and a.dest != "help"]
    assert len(switches) > 10
    for action in switches:
        on = [o for o in action.option_strings if not o.startswith("--no-")]
        if not on:  # --no-progress: itself the negative form
            continue
        assert isinstance(action, argparse.BooleanOptionalAction) and f"--no-{on[0][2:]}" in action.option_strings, (
            f"{on[0]} has no --no-{on[0][2:]}")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("model: m\ninit-tiny-model: true\ndeterministic: true\n")
    cfg = parse_args(["--config", str(cfg_file), "--no-init-tiny-model", "--no-deterministic"])
    assert cfg.model.init_tiny_model is False and cfg.learner.deterministic is False


def test_config_tiny_model_does_not_cover_another_model_path(tmp_path, capsys):
    """A config's ``init-tiny-model: true`` creates a random model only at the config's own ``model``: a mistyped
    --model on the command line is an error (it used to train a random tiny model, rc 0, no word)."""
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"model: {tmp_path}/tiny\ninit-tiny-model: true\ntiny-model-family: qwen3\n")
    assert parse_args(["--config", str(cfg_file)]).model.init_tiny_model is True  # the config's own path
    missing = str(tmp_path / "Qwen3-0.6B-typo")
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(cfg_file), "--model", missing])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --model: {missing} is not a Hugging Face model folder" in err and "--init-tiny-model" in err
    cfg = parse_args(["--config", str(cfg_file), "--model", missing, "--init-tiny-model"])  # asked for: allowed
    assert cfg.model.init_tiny_model is True and cfg.model.path == missing
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text("{}")
    cfg = parse_args(["--config", str(cfg_file), "--model", str(real)])  # an existing folder: used as it is
    assert cfg.model.init_tiny_model is False and cfg.model.tiny_model_family == "llama"


def test_stop_on_no_signal_flag():
    assert parse_args([]).logging.stop_on_no_signal == 0
    assert parse_args(["--stop-on-no-signal", "3"]).logging.stop_on_no_signal == 3
