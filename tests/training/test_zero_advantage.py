"""--skip-zero-advantage (streaming/planner.py): trajectories of advantage exactly 0 get no work, a zero-variance group
whose members already ran into its bucket folds with α = c = 0, and the update equals the unskipped synchronous one.

float64, one process: every estimator × aggregation, sync / stream-group / stream-trajectory with several arrival
orders, against sync with the skip off (every trajectory forwarded and backpropagated); the skipped trajectories'
tokens still count in the token-mean denominator (a control drops them and fails).
"""

import pytest
import torch

from megatron_tsync.streaming.planner import StepPlanner, TrajMeta
from megatron_tsync.algorithms.advantages import get_advantage_estimator

from .stream_cases import arrival_order, make_samples, spec_for
from .test_streaming_exactness import AGGREGATIONS, ESTIMATORS, TOL, gradient, model64, rel  # noqa: F401


def _two_zero_groups(seed, reward="binary"):
    """3 groups, the first zero-variance; plus a second all-equal group (all 1 or all 0) made from group 3."""
    samples = make_samples(seed, num_groups=3, reward_kind=reward)
    last = samples[-1].group_id
    for s in samples:
        if s.group_id == last:
            s.reward = 1.0
    return samples


# every estimator x aggregation x wait; the fast tier keeps a diagonal (each estimator and each aggregation at least
# once, with and without waiting), the rest of the grid is slow
SKIP_GRID = [pytest.param(wait, aggregation, estimator, id=f"{wait_id}-{aggregation}-{estimator}",
                          marks=() if AGGREGATIONS.index(aggregation) == i % len(AGGREGATIONS) else pytest.mark.slow)
             for i, estimator in enumerate(ESTIMATORS) for aggregation in AGGREGATIONS
             for wait, wait_id in ((True, "wait-for-variance"), (False, "no-wait"))]


@pytest.mark.parametrize("wait,aggregation,estimator", SKIP_GRID)
def test_skip_equals_unskipped_sync(model64, estimator, aggregation, wait):
    samples = _two_zero_groups(11)
    kw = dict(estimator=estimator, reward_spec=spec_for("binary"), loss=_loss(aggregation))
    g_ref, r_ref = gradient(model64, "sync", samples, samples, skip_zero_advantage=False, **kw)
    kw["wait_for_variance"] = wait
    assert r_ref.planner_stats["skipped_zero_advantage"] == 0
    assert g_ref.norm() > 0
    zero_members = sum(1 for s in samples if s.group_id in _all_equal_groups(samples))
    for mode in ("sync", "stream-group", "stream-trajectory"):
        for seed in (0, 1, 2):
            g, res = gradient(model64, mode, samples, arrival_order(samples, seed), **kw)
            err = rel(g, g_ref)
            assert err < TOL, (mode, seed, err)
            st = res.planner_stats
            # each member of an all-equal group is skipped, or ran into a bucket that was then wasted (α known in
            # advance, as dr_grpo's and rloo's: the bucket was already folded on the way, and closes normally)
            alpha_known = get_advantage_estimator(estimator).alpha_known_in_advance(4) is not None
            assert st["skipped_zero_advantage"] + (0 if alpha_known else st["wasted_bucket_items"]) <= zero_members
            if not alpha_known:
                assert st["skipped_zero_advantage"] + st["wasted_bucket_items"] == zero_members, (mode, st)
            if mode != "stream-trajectory" or wait:  # waiting for variance: an all-equal group never runs
                assert st["skipped_zero_advantage"] == zero_members and st["wasted_bucket_items"] == 0, (mode, st)
            assert res.microbatches == len(samples) - st["skipped_zero_advantage"] + st["second_backward"]
            assert res.num_action_tokens == r_ref.num_action_tokens  # the denominators count every trajectory


def _loss(aggregation):
    from megatron_tsync.training.stream_fb import LossConfig

    return LossConfig(aggregation=aggregation)


def _all_equal_groups(samples):
    by = {}
    for s in samples:
        by.setdefault(s.group_id, set()).add(s.reward)
    return {g for g, rs in by.items() if len(rs) == 1}


def test_denominator_control(model64):
    """Control: dropping the skipped trajectories from the batch (their tokens leave the token-mean denominator)
    changes the gradient far beyond the tolerance, so the equality above could fail."""
    samples = _two_zero_groups(11)
    kw = dict(estimator="grpo", reward_spec=spec_for("binary"), loss=_loss("token-mean"))
    g_ref, _ = gradient(model64, "sync", samples, samples, skip_zero_advantage=False, **kw)
    zero = _all_equal_groups(samples)
    rest = [s for s in samples if s.group_id not in zero]
    g_drop, _ = gradient(model64, "sync", rest, rest, **kw)
    assert rel(g_drop, g_ref) > 1e-3


def test_kl_term_keeps_the_work(model64):
    """With a KL loss term the zero-advantage trajectories still carry a gradient: nothing is skipped."""
    samples = make_samples(5, with_ref=True)
    from megatron_tsync.training.stream_fb import LossConfig

    kw = dict(estimator="grpo", reward_spec=spec_for("binary"), loss=LossConfig(kl_mode="loss", kl_coef=0.1))
    g_ref, _ = gradient(model64, "sync", samples, samples, skip_zero_advantage=False, **kw)
    g, res = gradient(model64, "stream-trajectory", samples, arrival_order(samples, 3), **kw)
    assert res.planner_stats["skipped_zero_advantage"] == 0
    assert rel(g, g_ref) < TOL


def test_planner_zero_variance_close_is_exact_zero():
    """Planner only: a zero-variance group whose first members went to the bucket closes with α = c = 0 and its
    last member gets no work; off (the default of the class), the close is α = 1/ε."""
    est = get_advantage_estimator("grpo")
    for skip, alpha in ((True, 0.0), (False, 1e6)):
        pl = StepPlanner(est, {"g": 3}, mode="stream-trajectory", reward_spec=spec_for("binary"), loss_kind="ppo_clip",
                         skip_zero_advantage=skip, wait_for_variance=False)
        items = pl.on_ready(TrajMeta("a", "g", 1.0, 5)) + pl.on_ready(TrajMeta("b", "g", 1.0, 5))
        assert [it.traj_id for it in items] == ["a", "b"]
        last = pl.on_ready(TrajMeta("c", "g", 1.0, 5))
        (close,), held = pl.closable()
        assert (len(last) == 0) == skip
        assert close.alpha == pytest.approx(alpha, rel=1e-9)
        if skip:
            assert close.q_coefficient(1.0) == 0.0
            assert pl.stats["wasted_bucket_items"] == 2 and pl.stats["skipped_zero_advantage"] == 1
        assert torch.isfinite(torch.tensor(close.alpha))


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_planner_waits_for_variance(estimator):
    """--stream-wait-for-variance (stream-trajectory, skip on): members whose group's rewards are so far all equal get
    no work; the first differing reward releases them together into the bucket (one destination); the group's last
    member goes straight to the accumulator; no bucket work is ever wasted. A group that ends all-equal gets no work
    at all, and no bucket. Rewards landing on another DP rank count too."""
    est = get_advantage_estimator(estimator)

    def planner(**kw):
        return StepPlanner(est, {"g": 4, "h": 3}, mode="stream-trajectory", reward_spec=spec_for("binary"),
                           loss_kind="ppo_clip", skip_zero_advantage=True, **kw)

    pl = planner()
    assert pl.on_ready(TrajMeta("a", "g", 1.0, 5)) == [] and pl.on_ready(TrajMeta("b", "g", 1.0, 5)) == []
    items = pl.on_ready(TrajMeta("c", "g", 0.0, 5))
    assert [(it.traj_id, it.dest.value) for it in items] == [("a", "bucket"), ("b", "bucket"), ("c", "bucket")]
    last = pl.on_ready(TrajMeta("d", "g", 1.0, 5))
    coupled = est.needs_batch_rewards  # advantages final only at the barrier: the last member goes to the bucket too
    assert [(it.traj_id, it.dest.value) for it in last] == [("d", "bucket" if coupled else "accum")]
    assert coupled or last[0].advantage != 0.0
    for t in ("x", "y", "z"):  # group h: all equal
        assert pl.on_ready(TrajMeta(t, "h", 0.0, 5)) == []
    closes, held = pl.finish() if coupled else pl.closable()
    assert [c.group_id for c in closes] == ["g"] and closes[0].alpha != 0.0 and held == []
    assert pl.stats["waited_for_variance"] == 4 + coupled and pl.stats["wasted_bucket_items"] == 0  # coupled: z too
    assert pl.stats["skipped_zero_advantage"] == 3 and pl.stats["bucketed"] == 3 + coupled
    # the differing reward lands on another DP rank: it releases this rank's waiting members all the same
    pl = planner()
    assert pl.on_ready(TrajMeta("a", "g", 1.0, 5)) == []
    assert [it.traj_id for it in pl.on_ready(TrajMeta("b", "g", 0.0, 5, dp_rank=1))] == ["a"]
    # control: without the wait every member runs on arrival, and the all-equal group's bucket work is wasted (or,
    # α known in advance, folded on the way)
    pl = planner(wait_for_variance=False)
    assert [len(pl.on_ready(TrajMeta(t, "h", 0.0, 5))) for t in ("x", "y", "z")] == [1, 1, int(coupled)]
    assert pl.stats["waited_for_variance"] == 0 and pl.stats["bucketed"] == 2 + coupled


def test_planner_known_advantage_work_first():
    """Priority: when one poll brings a group's last reward and a new group's first ones, the completed group's
    known-advantage items come first and the bucket items after them (each group's order kept)."""
    est = get_advantage_estimator("grpo")
    pl = StepPlanner(est, {"a": 2, "b": 3}, mode="stream-trajectory", reward_spec=spec_for("binary"),
                     loss_kind="ppo_clip")
    pl.on_ready(TrajMeta("a0", "a", 1.0, 5))  # bucket item of group a
    items = pl.on_ready_batch([TrajMeta("b0", "b", 1.0, 5), TrajMeta("b1", "b", 0.0, 5), TrajMeta("a1", "a", 0.0, 5)])
    assert [(it.traj_id, it.dest.value) for it in items] == [("a1", "accum"), ("b0", "bucket"), ("b1", "bucket")]


def test_step_grad_norm_is_zero_only_when_every_minibatch_is(megatron_single):
    """Two minibatches, the second of zero-variance groups only: the step's grad-norm is the mean over its optimizer
    steps (the first > 0, the second exactly 0), not the last one's 0 — which made the signal-health check call a
    step with signal "NO SIGNAL (grad-norm 0)" (seen live at step 2 of the quickstart config). float32, with and
    without clipping."""
    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    from .stream_cases import TINY

    def norm_of(samples, clip, **kw):
        ddp = wrap_ddp(build_model(TINY, PrecisionConfig(params_dtype=torch.float32), seed=0))
        opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=clip))
        return gradient((ddp, opt), "sync", samples, samples, estimator="grpo", reward_spec=spec_for("binary"),
                        **kw)[1].grad_norm

    samples = make_samples(5, num_groups=4, reward_kind="binary")
    groups = list(dict.fromkeys(s.group_id for s in samples))
    for i, s in enumerate(samples):  # minibatch j holds groups j, j + 2 (group index mod 2): the first's groups vary,
        s.reward = 1.0 if s.group_id in groups[1::2] else float(i % 2)  # the second's have one reward each
    both = norm_of(samples, 1e6, num_minibatches=2)
    first = norm_of([s for s in samples if s.group_id in groups[0::2]], 1e6)  # minibatch 1 alone: its norm
    assert first > 0 and abs(both - first / 2) <= 1e-5 * first, (both, first)  # (first + 0) / 2
    assert norm_of(samples, 0.0, num_minibatches=2) == both  # megatron's chained optimizer measures it unclipped too
