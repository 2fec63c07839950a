"""runtime.grpo: the learner section a live run trains with, and its log row.

- ``--reward-kind/--reward-range`` reach the learner (not replaced by the task's declared spec); a spec that assumes
  more than the task declares is an error naming the task; the flag changes what the learner does (the clip rule
  defers more under weaker assumptions), so it is not accepted-and-ignored.
"""

import pytest
import torch

from megatron_tsync.algorithms.streamability import RewardSpec
from megatron_tsync.arguments import parse_args
from megatron_tsync.runtime.grpo import learner_config
from megatron_tsync.runtime.tasks import get_task


def test_learner_config_takes_the_reward_flags():
    task = get_task("arithmetic-calculator", verifier="exact_answer")
    assert learner_config(parse_args([]), task).reward_spec == RewardSpec.binary(0.0, 1.0)  # the default
    spec = learner_config(parse_args(["--reward-kind", "continuous"]), task).reward_spec
    assert spec.kind == "continuous"  # honoured, not replaced by the task's binary spec
    spec = learner_config(parse_args(["--reward-kind", "bounded", "--reward-range", "-1", "2"]), task).reward_spec
    assert (spec.kind, spec.lo, spec.hi) == ("bounded", -1.0, 2.0)


def test_learner_config_refuses_a_spec_the_task_contradicts():
    """A task whose declaration differs from its verifier's registry entry: the runtime check catches it."""
    class WideTask:
        name, verifier = "wide", "exact_answer"
        reward_spec = RewardSpec.bounded(0.0, 1.0)

    with pytest.raises(ValueError, match=r"--reward-kind/--reward-range binary \{0, 1\} contradicts task wide"):
        learner_config(parse_args([]), WideTask())
    assert learner_config(parse_args(["--reward-kind", "bounded"]), WideTask()).reward_spec.kind == "bounded"


def test_reward_kind_changes_the_learners_behaviour(megatron_single):
    """PPO clipping with engine log-probs (ratio ≠ 1): under binary rewards the clip rule can stream trajectories
    whose advantage sign is already certain; under --reward-kind continuous it must defer more of them. Same
    gradient (float64), different schedule: the flag does something."""
    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.streaming.ready_queue import ListSource
    from megatron_tsync.training.learner import Learner, shape_for
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    from tests.training.stream_cases import TINY, arrival_order, make_samples

    task = get_task("arithmetic-calculator", verifier="exact_answer")
    ddp = wrap_ddp(build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0))
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))
    samples = make_samples(7, reward_kind="binary")
    out = {}
    for kind in ("binary", "continuous"):
        argv = ["--old-logprobs", "engine", "--rl-mode", "stream-trajectory"]
        cfg = learner_config(parse_args(argv + (["--reward-kind", kind] if kind != "binary" else [])), task)
        assert cfg.reward_spec.kind == kind
        learner = Learner(ddp, opt, cfg)
        got = {}
        learner.grad_hook = lambda d: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
        sizes, shape = shape_for(samples)
        res = learner.train_step(ListSource(arrival_order(samples, 5)), sizes, shape)
        out[kind] = (res.planner_stats["deferred"], got["g"])
    assert out["continuous"][0] > out["binary"][0], out
    rel = ((out["continuous"][1] - out["binary"][1]).norm() / out["binary"][1].norm()).item()
    assert rel < 1e-12


def test_sum_norm_constant_is_the_action_token_budget():
    """seq-mean-token-sum-norm's L_max in a run: min(--max-turns × --max-new-tokens, --seq-length), not
    --seq-length (prompt and tool output carry no loss)."""
    from megatron_tsync.runtime.grpo import batch_shape

    cfg = parse_args(["--max-turns", "3", "--max-new-tokens", "32", "--seq-length", "128", "--group-size", "4",
                      "--global-batch-size", "8"])
    assert cfg.rl.max_action_tokens == 96
    shape = batch_shape(cfg, {"a": 4, "b": 4})
    assert (shape.num_sequences, shape.max_len) == (8, 96)
    cfg = parse_args(["--max-turns", "16", "--max-new-tokens", "64", "--seq-length", "512"])
    assert cfg.rl.max_action_tokens == 512  # the whole trajectory is cut at --seq-length
