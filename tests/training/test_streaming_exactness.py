"""float64, one process: streamed gradient == batch-synchronous gradient (≤ 1e-12 relative).

The sync reference takes advantages from each estimator's batch implementation and the reference policy loss;
streaming takes them from the affine coefficients, the surrogate and the (P, Q, ρ) buckets — independent paths.
Every estimator × aggregation; every clip variant × reward kind × old-log-prob source; KL/entropy strategies;
several random interleaved arrival orders; a zero-variance group in every batch.
"""

import itertools

import pytest
import torch

from megatron_tsync.algorithms.policy_loss import PolicyLossConfig
from megatron_tsync.streaming.ready_queue import ListSource
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
from megatron_tsync.model.builder import PrecisionConfig, build_model
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
from megatron_tsync.training.stream_fb import LossConfig

from .stream_cases import TINY, arrival_order, make_samples, spec_for

TOL = 1e-12
ESTIMATORS = ["grpo", "grpo_unbiased", "dr_grpo", "rloo", "grpo_batch_std"]
AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
POLICIES = {
    "no-clip": PolicyLossConfig(kind="none"),
    "ppo": PolicyLossConfig(),
    "asym-dual": PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0),
    "tis": PolicyLossConfig(tis_cap=2.0),
}


@pytest.fixture(scope="module")
def model64(megatron_single):
    m = build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0)
    ddp = wrap_ddp(m)
    return ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))


def gradient(model64, mode, samples, order, reference=None, **kw):
    """(gradient after the barrier, StepResult) of one learner step of ``mode`` over ``order`` (``reference``: the
    KL reference model, ``training.reference``)."""
    ddp, opt = model64
    learner = Learner(ddp, opt, LearnerConfig(mode=mode, **kw), reference=reference)
    got = {}
    learner.grad_hook = lambda d: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
    sizes, shape = shape_for(samples)
    res = learner.train_step(ListSource(order), sizes, shape)
    return got["g"], res


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("estimator,aggregation", list(itertools.product(ESTIMATORS, AGGREGATIONS)))
def test_estimator_x_aggregation(model64, estimator, aggregation):
    samples = make_samples(hash((estimator, aggregation)) % 1000, reward_kind="bounded")
    kw = dict(estimator=estimator, reward_spec=spec_for("bounded"), loss=LossConfig(aggregation=aggregation))
    g_sync, _ = gradient(model64, "sync", samples, samples, **kw)
    assert g_sync.norm() > 0
    for seed in (1, 2, 3):
        g, res = gradient(model64, "stream-trajectory", samples, arrival_order(samples, seed), **kw)
        assert rel(g, g_sync) < TOL, (seed, rel(g, g_sync))
        assert res.planner_stats["bucketed"] > 0
    g, _ = gradient(model64, "stream-group", samples, arrival_order(samples, 4), **kw)
    assert rel(g, g_sync) < TOL


@pytest.mark.parametrize("reward", ["binary", "bounded", "continuous"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("old", ["trainer", "engine"])
def test_clip_rule(model64, reward, policy, old):
    """Ratio 1 (trainer old log-probs) and ratio ≠ 1 (engine log-probs as π_old: far outside the clip band)."""
    samples = make_samples(7, reward_kind=reward)
    kw = dict(estimator="grpo", reward_spec=spec_for(reward), loss=LossConfig(policy=POLICIES[policy], old_logprobs=old))
    g_sync, _ = gradient(model64, "sync", samples, samples, **kw)
    for seed in (5, 6):
        g, res = gradient(model64, "stream-trajectory", samples, arrival_order(samples, seed), **kw)
        assert rel(g, g_sync) < TOL, (seed, rel(g, g_sync), res.planner_stats)
    if old == "engine" and policy in ("ppo", "asym-dual") and reward == "continuous":
        assert res.planner_stats["deferred"] > 0  # the rule had to defer: the test exercises rule 3


@pytest.mark.parametrize("strategy", ["second-backward", "defer"])
@pytest.mark.parametrize("terms", [dict(kl_mode="loss", kl_coef=0.1, kl_kind="k3"),
                                   dict(kl_mode="loss", kl_coef=0.05, kl_kind="k1", entropy_coef=0.01),
                                   dict(entropy_coef=0.02)])
def test_kl_entropy(model64, strategy, terms):
    samples = make_samples(11, reward_kind="binary", with_ref=True)
    kw = dict(estimator="grpo", reward_spec=spec_for("binary"), aux_strategy=strategy, loss=LossConfig(**terms))
    g_sync, _ = gradient(model64, "sync", samples, samples, **kw)
    g, res = gradient(model64, "stream-trajectory", samples, arrival_order(samples, 9), **kw)
    assert rel(g, g_sync) < TOL
    key = "second_backward" if strategy == "second-backward" else "deferred"
    assert res.planner_stats[key] > 0


def test_aux_terms_change_the_gradient(model64):
    """Guard against a test that passes because KL/entropy were silently dropped."""
    samples = make_samples(11, reward_kind="binary", with_ref=True)
    base = dict(estimator="grpo", reward_spec=spec_for("binary"))
    g0, _ = gradient(model64, "sync", samples, samples, **base)
    g1, _ = gradient(model64, "sync", samples, samples, loss=LossConfig(kl_mode="loss", kl_coef=0.1), **base)
    assert rel(g1, g0) > 1e-3


def test_open_group_cap_degrades_to_per_group(model64):
    samples = make_samples(13, num_groups=4, reward_kind="bounded")
    kw = dict(estimator="grpo", reward_spec=spec_for("bounded"))
    g_sync, _ = gradient(model64, "sync", samples, samples, **kw)
    for wait in (False, True):  # waiting for variance opens fewer groups at once (none overflow in this order)
        g, res = gradient(model64, "stream-trajectory", samples, arrival_order(samples, 3), max_open_groups=1,
                          wait_for_variance=wait, **kw)
        assert rel(g, g_sync) < TOL
        assert res.planner_stats["overflow_groups"] > 0 or wait
        assert res.peak_bucket_vectors <= 2  # one std-GRPO group open: P and Q


def test_buffer_minimum(model64):
    """Peak bucket vectors ≤ 2k (std GRPO) / k (Dr.GRPO, RLOO) for k simultaneously open groups."""
    samples = make_samples(17, num_groups=4, reward_kind="bounded", zero_var_group=False)
    by_group = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s)
    # all groups interleaved: every group open at once until its last member arrives
    order = [grp[i] for i in range(5) for grp in by_group.values() if i < len(grp)]
    k = len(by_group)
    for est, per_group in (("grpo", 2), ("dr_grpo", 1), ("rloo", 1)):
        _, res = gradient(model64, "stream-trajectory", samples, order, estimator=est, reward_spec=spec_for("bounded"))
        assert res.peak_bucket_vectors == per_group * k, (est, res.peak_bucket_vectors)
        numel = sum(b.grad_data.numel() for b in model64[0].buffers)
        assert res.peak_bucket_bytes == res.peak_bucket_vectors * numel * 8  # float64 vectors


@pytest.mark.parametrize("minibatches,epochs", [(2, 1), (3, 2)])
@pytest.mark.parametrize("reward", ["binary", "continuous"])
def test_minibatches_and_epochs(megatron_single, minibatches, epochs, reward):
    """Several optimizer steps per batch (§5): minibatches by group index, minibatch j streams after step j − 1
    with the clip rule (π_old from the engine, ratio ≠ 1), later epochs synchronous. Weights after the whole step
    equal the synchronous run's (float64, SGD with a real learning rate so every intermediate step matters)."""
    samples = make_samples(21, num_groups=4, reward_kind=reward, ratio_noise=0.0)
    weights = {}
    for mode, order in (("sync", samples), ("stream-trajectory", arrival_order(samples, 3)),
                        ("stream-group", arrival_order(samples, 4))):
        m = build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0)
        ddp = wrap_ddp(m)
        opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.05, clip_grad=0))
        theta0 = torch.cat([p.detach().reshape(-1).clone() for p in ddp.parameters()])
        learner = Learner(ddp, opt, LearnerConfig(mode=mode, reward_spec=spec_for(reward), num_minibatches=minibatches,
                                                   epochs=epochs, loss=LossConfig(policy=POLICIES["ppo"])))
        sizes, shape = shape_for(samples)
        res = learner.train_step(ListSource(order), sizes, shape)
        weights[mode] = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
        if mode == "stream-trajectory":
            assert res.planner_stats["bucketed"] > 0
    moved = (weights["sync"] - theta0).norm()
    assert moved > 1e-6
    for mode in ("stream-trajectory", "stream-group"):
        assert ((weights[mode] - weights["sync"]).norm() / moved).item() < 1e-12, mode


def test_direct_path_and_cohorts_save_bucket_traffic(model64):
    """Binary rewards, GRPO, stream-trajectory, 6 groups in 4 random arrival orders, with and without
    --stream-wait-for-variance: streamed == sync ≤ 1e-12, and the traffic counters (GroupBuckets.traffic_stats) show
    the direct path and equal-reward cohorts saving bucket traffic; the bucket bytes equal the vectors' zero-fills,
    shifts and folds. Prints the totals (docs/streaming.md, "Traffic saved")."""
    samples = make_samples(29, num_groups=6, reward_kind="binary")
    ref, _ = gradient(model64, "sync", samples, samples)
    V = sum(b.grad_data.numel() for b in model64[0].buffers) * 8
    tot = {}
    for wait in (True, False):
        acc = dict.fromkeys(("bucket_bytes", "saved_direct_bytes", "saved_cohort_bytes"), 0)
        for seed in range(4):
            g, res = gradient(model64, "stream-trajectory", samples, arrival_order(samples, 50 + seed),
                              wait_for_variance=wait)
            assert rel(g, ref) < TOL
            st = res.planner_stats
            assert all(st[k] % V == 0 for k in acc)  # whole vectors
            for k in acc:
                acc[k] += st[k] // V
        tot[wait] = acc
    print("bucket traffic in vectors over 4 orders (wait_for_variance: on / off):", tot)
    for wait in (True, False):
        assert tot[wait]["saved_direct_bytes"] > 0 and tot[wait]["bucket_bytes"] > 0
    assert tot[False]["saved_cohort_bytes"] > 0  # zero-variance groups bucketed without waiting: Q only
