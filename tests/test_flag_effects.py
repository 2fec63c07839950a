"""Every accepted RL flag does what it says (issue 15): a non-default value changes the gradient, the weights, or the
documented observable, on a tiny float64 case run through the real path — ``arguments.parse_args`` →
``runtime.grpo.learner_config`` → the megatron learner (``training.learner.Learner``, a real reference model for the
KL flags via ``RunContext._reference``).

The flags are enumerated from the parser: every flag of the "RL algorithm" group and every flag that sets a
``learner.*`` or ``optim.*`` field (or ``rl.seq_length``, which the learner reads). A flag in that set without an
entry in ``CASES``, ``ELSEWHERE`` (its effect is tested by a named test of another module, which must exist) or
``EXEMPT`` (legitimately no effect on one process, with the reason) fails :func:`test_every_rl_flag_is_covered`, so a
new flag cannot land without a test of its effect.

Observables: ``grad`` — the first barrier's gradient moves (relative change > 1e-6); ``weights`` — the weights after
``steps`` train steps move (optimizer flags, several optimizer steps per batch); ``stat:KEY`` / ``result:ATTR`` — a
planner statistic or a step-result field changes while the gradient stays the same to ≤ 1e-12 (flags that decide
*when* work runs: the update is the synchronous one by design); ``config:NAME`` — a value the flag's consumer
computes from the config (rollout-side flags). The control (:func:`test_control_inert_flag_is_detected`) shows the
comparison fails for a flag without effect.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import types
from typing import Callable

import pytest
import torch

from megatron_tsync import arguments as A
from megatron_tsync.arguments import parse_args

from tests.training.stream_cases import TINY, arrival_order, make_samples

BASE = ["--params-dtype", "float64", "--clip-grad", "0", "--optimizer", "sgd", "--lr", "0.05", "--rl-mode", "sync"]
KL = ["--kl-mode", "loss", "--kl-coef", "0.1", "--kl-estimator", "k3"]  # + "--ref-model", REF (filled in below)
ENGINE = ["--old-logprobs", "engine"]  # ratio ≠ 1: clip flags matter
REF = "@REF@"  # replaced by the reference-model folder
STREAM = ["--rl-mode", "stream-trajectory"]
SUM_NORM = ["--loss-aggregation", "seq-mean-token-sum-norm"]  # divides by L_max = min(turns × new tokens, seq length)


@dataclasses.dataclass(frozen=True)
class Case:
    base: list[str]
    variants: list[list[str]]  # each must change the observable against ``base``
    observe: str = "grad"  # "grad" | "weights" | "stat:KEY" | "result:ATTR" | "config:NAME"
    steps: int = 1


def _sampling_max_new(cfg):
    from megatron_tsync.rollout.engine import SamplingConfig

    return SamplingConfig.from_config(cfg.rollout, cfg.rl).max_new_tokens


def _version_window(cfg):
    from megatron_tsync.transport.versions import VersionWindow

    return VersionWindow(5, cfg.rl.max_staleness).accepted()  # what the fleet/worker accept at step 5


def _train_spec(cfg):
    from megatron_tsync.runtime.loop import train_spec

    return train_spec(cfg.rl.algorithm).name


def _early_work(res) -> int:
    """Schedule calls that ran before the step's last trajectory landed (sync: none; streaming: some)."""
    return sum(1 for _, end in res.busy_intervals if end <= res.last_arrival_s)


def _arena(tier: str) -> Callable:
    """Bytes of bucket residency's device cache or host arena (``streaming/offload.py``)."""
    return lambda res: res.offload[f"{tier}_arena_bytes"]


RESULT_OBSERVABLES: dict[str, Callable] = {"early_work": _early_work, "device_arena": _arena("device"),
                                           "host_arena": _arena("host")}
CONFIG_OBSERVABLES: dict[str, Callable] = {"sampling_max_new_tokens": _sampling_max_new,
                                           "version_window": _version_window, "train_spec": _train_spec}

CASES: dict[str, Case] = {
    "--rl-algorithm": Case([], [["--rl-algorithm", "opd", "--teacher-model", REF]], "config:train_spec"),
    "--rl-mode": Case([], [["--rl-mode", "stream-trajectory"], ["--rl-mode", "stream-group"]], "result:early_work"),
    "--max-staleness": Case(["--rl-mode", "async", "--max-staleness", "1"], [["--rl-mode", "async",
                                                                               "--max-staleness", "3"]],
                            "config:version_window"),
    "--advantage-estimator": Case([], [["--advantage-estimator", e] for e in ("grpo_unbiased", "dr_grpo", "rloo",
                                                                              "grpo_batch_std")]),
    "--advantage-eps": Case([], [["--advantage-eps", "0.5"]]),
    "--policy-loss": Case(ENGINE, [[*ENGINE, "--policy-loss", "none"]]),
    "--clip-ratio-low": Case(ENGINE, [[*ENGINE, "--clip-ratio-low", "0.5"]]),
    "--clip-ratio-high": Case(ENGINE, [[*ENGINE, "--clip-ratio-high", "0.6"]]),
    "--dual-clip": Case(ENGINE, [[*ENGINE, "--dual-clip", "1.5"]]),
    "--tis-cap": Case([], [["--tis-cap", "1.2"]]),  # weight min(π_θ0/π_engine, C): trainer π_old
    "--loss-aggregation": Case([], [["--loss-aggregation", a] for a in ("seq-mean-token-mean", "seq-mean-token-sum",
                                                                        "seq-mean-token-sum-norm")]),
    "--kl-coef": Case([*KL, "--ref-model", REF], [[*KL, "--ref-model", REF, "--kl-coef", "0.3"]]),
    "--kl-estimator": Case([*KL, "--ref-model", REF], [[*KL, "--ref-model", REF, "--kl-estimator", k]
                                                       for k in ("k1", "k2")]),
    "--kl-mode": Case([], [["--kl-mode", m, "--kl-coef", "0.1", "--ref-model", REF] for m in ("loss", "reward")]),
    # k3's gradient at θ0 is 0 against the frozen initial policy; a different reference must move it
    "--ref-model": Case(KL, [[*KL, "--ref-model", REF]]),
    "--entropy-coef": Case([], [["--entropy-coef", "0.05"]]),
    "--num-minibatches": Case([], [["--num-minibatches", "2"]], "weights"),
    "--ppo-epochs": Case([], [["--ppo-epochs", "2"]], "weights"),
    "--aux-strategy": Case([*STREAM, "--entropy-coef", "0.05"], [[*STREAM, "--entropy-coef", "0.05", "--aux-strategy",
                                                                  "defer"]], "stat:deferred"),
    "--old-logprobs": Case([], [ENGINE]),
    "--max-open-groups": Case(STREAM, [[*STREAM, "--max-open-groups", "1"]], "stat:overflow_groups"),
    "--max-device-buckets": Case(STREAM, [[*STREAM, "--max-device-buckets", "2"]], "result:offload"),
    "--accumulate-on-host": Case(STREAM, [[*STREAM, "--accumulate-on-host"]], "result:offload"),
    # a vector of the tiny float64 model is 0.81 MiB: 0.002 GiB holds 2 of the 4 slots --max-device-buckets asks for
    "--bucket-device-gib": Case([*STREAM, "--max-device-buckets", "4"],
                                [[*STREAM, "--max-device-buckets", "4", "--bucket-device-gib", "0.002"]],
                                "result:device_arena"),
    "--bucket-host-gib": Case([*STREAM, "--max-device-buckets", "2"],
                              [[*STREAM, "--max-device-buckets", "2", "--bucket-host-gib", "0.02"]],
                              "result:host_arena"),
    "--skip-zero-advantage": Case(["--no-skip-zero-advantage"], [["--skip-zero-advantage"]],
                                  "stat:skipped_zero_advantage"),
    "--stream-wait-for-variance": Case([*STREAM, "--no-stream-wait-for-variance"],
                                       [[*STREAM, "--stream-wait-for-variance"]], "stat:waited_for_variance"),
    "--sequence-packing": Case([], [["--sequence-packing"]], "result:microbatches"),
    "--pack-across-groups": Case([*STREAM, "--sequence-packing"], [[*STREAM, "--sequence-packing",
                                                                     "--pack-across-groups"]], "result:microbatches"),
    "--stream-full-microbatches": Case([*STREAM, "--sequence-packing", "--pack-across-groups"],
                                       [[*STREAM, "--sequence-packing", "--pack-across-groups",
                                         "--stream-full-microbatches"]], "stat:waited_for_full_microbatch"),
    "--max-packed-tokens": Case(["--sequence-packing"], [["--sequence-packing", "--max-packed-tokens", "40"]],
                                "result:microbatches"),
    # assuming less about rewards: the exact clip rule can certify fewer signs, so more trajectories wait
    "--reward-kind": Case([*STREAM, *ENGINE], [[*STREAM, *ENGINE, "--reward-kind", "continuous"]], "stat:deferred"),
    "--reward-range": Case([*STREAM, *ENGINE, "--reward-kind", "bounded"],
                           [[*STREAM, *ENGINE, "--reward-kind", "bounded", "--reward-range", "-1", "2"]],
                           "stat:deferred"),
    # the engines' token limit per turn, and (× --max-turns, ≤ --seq-length) seq-mean-token-sum-norm's constant L_max
    "--max-new-tokens": Case([], [["--max-new-tokens", "17"]], "config:sampling_max_new_tokens"),
    "--max-turns": Case(SUM_NORM, [[*SUM_NORM, "--max-turns", "2"]]),
    "--seq-length": Case(SUM_NORM, [[*SUM_NORM, "--seq-length", "100"]]),
    # learner-affecting flags of other groups
    "--temperature": Case([], [["--temperature", "0.7"]]),
    "--optimizer": Case([], [["--optimizer", "adam"]], "weights"),
    "--lr": Case([], [["--lr", "0.1"]], "weights"),
    "--weight-decay": Case([], [["--weight-decay", "0.1"]], "weights"),
    "--adam-beta1": Case(["--optimizer", "adam"], [["--optimizer", "adam", "--adam-beta1", "0.5"]], "weights", 2),
    "--adam-beta2": Case(["--optimizer", "adam"], [["--optimizer", "adam", "--adam-beta2", "0.9"]], "weights", 2),
    "--adam-eps": Case(["--optimizer", "adam"], [["--optimizer", "adam", "--adam-eps", "0.01"]], "weights"),
    "--sgd-momentum": Case([], [["--sgd-momentum", "0.9"]], "weights", 2),
    "--clip-grad": Case(["--params-dtype", "float32"], [["--params-dtype", "float32", "--clip-grad", "0.001"]],
                        "weights"),
}

# Flags whose effect needs another learner or the rollout plane: the named test shows it (and must exist).
ELSEWHERE = {
    "--opd-objective": "tests/runtime/test_opd_e2e.py::test_opd_full_vocab_stream_turn_pp2_matches_one_process",
    # its observable is bitwise equality across arrival orders, which the default mode does not have
    "--deterministic": "tests/training/test_deterministic.py::test_control_default_mode_is_not_bitwise",
    # needs groups that share a prompt (the harness's trajectories do not): microbatches and shared items change there
    "--shared-prefix": "tests/training/test_shared_prefix.py::test_shared_equals_unshared_sync",
    # which DP rank trains a trajectory: no effect on one process; the trainer's assigner and its float64 DP=2 check
    "--dp-assignment": "tests/streaming/test_dp_assigner.py::test_flag_reaches_the_trainers_assigner",
    # the runtime's arrival source, not the learner: fewer microbatches for the same update there
    "--stream-coalesce-ms": "tests/streaming/test_coalescing.py::test_learner_update_unchanged_with_fewer_microbatches",
    "--stream-coalesce-tokens": "tests/streaming/test_coalescing.py::test_token_target_fills_polls_and_update_unchanged",
}

# Flags that legitimately leave a one-process run unchanged, with the reason.
EXEMPT = {
    "--use-distributed-optimizer": "shards the optimizer state over data-parallel ranks; the update is the same by "
                                   "design (tests/training/test_checkpointing.py resumes bitwise with it at DP=2)",
}


LEARNER_FIELDS = {"rl.seq_length"}  # outside the RL group, read by the learner (L_max of seq-mean-token-sum-norm)


def _scope() -> set[str]:
    out = set()
    for f in A._FLAGS:
        if f.group == A._G_RL or any(p.startswith(("learner.", "optim.")) or p in LEARNER_FIELDS for p in f.fields):
            out.add(f.names[0])
    return out


def test_every_rl_flag_is_covered():
    scope = _scope()
    covered = set(CASES) | set(ELSEWHERE) | set(EXEMPT)
    assert not (set(CASES) & set(ELSEWHERE)) and not (set(CASES) & set(EXEMPT))
    assert scope - covered == set(), f"RL flags without a flag-effect test: {sorted(scope - covered)}"
    assert covered - scope == set(), f"entries for flags that are not RL/learner flags: {sorted(covered - scope)}"


@pytest.mark.parametrize("flag", sorted(ELSEWHERE))
def test_elsewhere_tests_exist(flag):
    path, name = ELSEWHERE[flag].split("::")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, path)) as f:
        assert f"def {name}(" in f.read(), ELSEWHERE[flag]


# ------------------------------------------------------------------------------------------------------ harness
@pytest.fixture(scope="module")
def world(megatron_single, tmp_path_factory):
    """θ0's log-probs (for behaviour log-probs near the policy: ratios straddle the clip bands) and a reference
    model folder (a different tiny model)."""
    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.model.hf_conversion import megatron_to_hf, save_hf_dir
    from megatron_tsync.model.logprobs import token_logprobs

    ref_dir = str(tmp_path_factory.mktemp("flag_ref"))
    save_hf_dir(ref_dir, {k: v.float() for k, v in megatron_to_hf(build_model(TINY, PrecisionConfig(
        params_dtype=torch.float64), seed=1)).items()}, TINY)
    policy = build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0)
    samples = make_samples(53, reward_kind="binary")
    g = torch.Generator().manual_seed(5)
    for s in samples:
        with torch.no_grad():
            lp = token_logprobs(policy, s.token_ids.unsqueeze(0))[0]  # (T-1,)
        s.behaviour_logp = torch.cat([lp.new_zeros(1), lp]) + 0.8 * torch.randn(lp.shape[0] + 1, generator=g,
                                                                                 dtype=torch.float64)
    return types.SimpleNamespace(ref_dir=ref_dir, samples=samples, cache={})


@dataclasses.dataclass
class Outcome:
    cfg: object
    grad: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    stats: dict | None = None
    result: object = None


def _argv(world, args: list[str]) -> list[str]:
    return BASE + [world.ref_dir if a == REF else a for a in args]


def outcome(world, args: list[str], observe: str, steps: int = 1) -> Outcome:
    key = (tuple(args), observe.startswith("config:"), steps)
    if key in world.cache:
        return world.cache[key]
    cfg = parse_args(_argv(world, args), world_size=1)
    out = Outcome(cfg)
    if not observe.startswith("config:"):
        out = _train(world, cfg, steps)
    world.cache[key] = out
    return out


def _train(world, cfg, steps: int) -> Outcome:
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.runtime.context import RunContext
    from megatron_tsync.runtime.grpo import batch_shape, learner_config
    from megatron_tsync.runtime.tasks import get_task
    from megatron_tsync.streaming.ready_queue import ListSource
    from megatron_tsync.training.learner import Learner, shape_for
    from megatron_tsync.training.optimizer import build_optimizer, wrap_ddp

    ddp = wrap_ddp(build_model(TINY, cfg.precision, seed=0))
    opt = build_optimizer(ddp, cfg.optim)
    ref = RunContext._reference(types.SimpleNamespace(cfg=cfg, ddp=ddp, step=0))  # the run's own reference
    learner = Learner(ddp, opt, learner_config(cfg, get_task(cfg.rollout.task, verifier=cfg.rollout.verifier)),
                      reference=ref)
    grads = []
    learner.grad_hook = lambda d: grads.append(torch.cat([b.grad_data.clone() for b in d.buffers]))
    first = None
    for _ in range(steps):
        samples = [copy.deepcopy(s) for s in world.samples]
        sizes, _ = shape_for(samples)
        shape = batch_shape(cfg, sizes)  # the run's own batch constants (L_max from the config)
        order = samples if cfg.learner.mode == "sync" else arrival_order(samples, 3)
        res = learner.train_step(ListSource(order), sizes, shape)
        first = first or res
    weights = torch.cat([p.detach().reshape(-1).double() for p in ddp.parameters()])
    return Outcome(cfg, grads[0].double(), weights, first.planner_stats, first)


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def changed(a: Outcome, b: Outcome, observe: str) -> tuple[bool, str]:
    """Whether ``b`` differs from ``a`` in the observable (and, for the when-flags, keeps the gradient)."""
    kind, _, name = observe.partition(":")
    if kind == "config":
        fa, fb = CONFIG_OBSERVABLES[name](a.cfg), CONFIG_OBSERVABLES[name](b.cfg)
        return fa != fb, f"{name}: {fa} -> {fb}"
    if kind == "grad":
        r = _rel(b.grad, a.grad)
        return r > 1e-6, f"gradient moved by {r:.2e} relative"
    if kind == "weights":
        r = _rel(b.weights, a.weights)
        return r > 1e-9, f"weights moved by {r:.2e} relative"
    same = _rel(b.grad, a.grad)
    get = RESULT_OBSERVABLES.get(name, lambda r: getattr(r, name))
    va = a.stats.get(name, 0) if kind == "stat" else get(a.result)
    vb = b.stats.get(name, 0) if kind == "stat" else get(b.result)
    return va != vb and same <= 1e-12, f"{name}: {va} -> {vb}, gradient equal to {same:.1e}"


@pytest.mark.parametrize("flag", sorted(CASES))
def test_flag_changes_its_observable(world, flag):
    case = CASES[flag]
    base = outcome(world, case.base, case.observe, case.steps)
    for variant in case.variants:
        assert flag in variant, (flag, variant)
        ok, why = changed(base, outcome(world, variant, case.observe, case.steps), case.observe)
        assert ok, f"{flag} ({' '.join(variant)}) is accepted but changes nothing: {why}"


def test_control_inert_flag_is_detected(world):
    """The comparison can fail: a flag without effect on the learner (--log-interval) changes none of them."""
    base = outcome(world, [], "grad")
    inert = outcome(world, ["--log-interval", "5"], "grad")
    for observe in ("grad", "weights", "stat:bucketed", "result:microbatches", "result:early_work"):
        assert not changed(base, inert, observe)[0], observe
