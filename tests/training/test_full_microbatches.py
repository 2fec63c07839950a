"""``--stream-full-microbatches`` (``StreamExecutor.run`` / ``_hold_partial``): packed microbatches that are not full
wait for later arrivals; when a group closes, its waiting bucket items become accumulator items with their advantage
(``StepPlanner.redirect``) and the bucket folds. Float64, one process.

- The update is batch-synchronous training's (≤ 1e-12) in stream-trajectory (with and without
  ``--pack-across-groups``) and stream-group, for estimators with P/Q buckets, α known in advance and batch-coupled
  statistics, over several arrival orders; items really waited, and some were redirected (an item left in a closed
  group's bucket would be lost or leave the bucket open at the barrier).
- With mixing, the learner runs at most one microbatch more than sync per step.
- Trajectories that may still be deferred (PPO clip with engine log-probs, ratio ≠ 1) never wait, and the update is
  still sync's.
"""

import pytest

from megatron_tsync.algorithms.policy_loss import PolicyLossConfig
from megatron_tsync.streaming.ready_queue import ListSource
from megatron_tsync.training.stream_fb import LossConfig

from .stream_cases import arrival_order, make_samples, spec_for
from .test_packing import gradient, model64, rel  # noqa: F401  (model64: the module's float64 model fixture)

TOL = 1e-12


@pytest.mark.parametrize("mode,mix", [("stream-trajectory", False), ("stream-trajectory", True),
                                      ("stream-group", False)])
@pytest.mark.parametrize("estimator,reward", [("grpo", "binary"), ("dr_grpo", "continuous"), ("rloo", "bounded"),
                                              ("grpo_batch_std", "binary")])
def test_full_microbatches_equal_sync(model64, mode, mix, estimator, reward):
    samples = make_samples(12, num_groups=4, reward_kind=reward)
    kw = dict(estimator=estimator, reward_spec=spec_for(reward))
    g_sync, res_sync, _ = gradient(model64, "sync", samples, samples, packing=300, **kw)
    waited = redirected = 0
    for seed in (1, 2):
        order = ListSource(arrival_order(samples, seed), batch=3)
        g, res, L = gradient(model64, mode, samples, order, packing=300, pack_across_groups=mix,
                             full_microbatches=True, wait_for_variance=False, **kw)
        assert rel(g, g_sync) < TOL, (seed, rel(g, g_sync))
        assert not L.exec.waiting
        waited += res.planner_stats["waited_for_full_microbatch"]
        redirected += res.planner_stats["redirected"]
        if mix:
            assert res.microbatches <= res_sync.microbatches + 1, (res.microbatches, res_sync.microbatches)
    assert waited > 0 or (mode == "stream-group" and estimator == "grpo_batch_std")  # batch-coupled: all at the end
    assert redirected > 0 or mode == "stream-group" or estimator == "grpo_batch_std"  # (no buckets / no closes)


def test_fewer_microbatches_than_without(model64):
    samples = make_samples(12, num_groups=4, reward_kind="binary")
    got = {}
    for full in (False, True):
        g, res, _ = gradient(model64, "stream-trajectory", samples, ListSource(arrival_order(samples, 3), batch=2),
                             packing=300, pack_across_groups=True, full_microbatches=full, wait_for_variance=False)
        got[full] = (res.microbatches, g)
    assert got[True][0] < got[False][0], (got[True][0], got[False][0])
    assert rel(got[True][1], got[False][1]) < TOL


def test_items_that_may_defer_never_wait(model64):
    """PPO clip with engine log-probs: bucket items may be deferred after their forward, which must reach the planner
    before their group closes, so they run at once; the update is still sync's."""
    samples = make_samples(7, reward_kind="bounded", num_groups=4)
    kw = dict(estimator="grpo", reward_spec=spec_for("bounded"),
              loss=LossConfig(policy=PolicyLossConfig(), old_logprobs="engine"))
    g_sync, _, _ = gradient(model64, "sync", samples, samples, **kw)
    for seed in (5, 6):
        g, res, L = gradient(model64, "stream-trajectory", samples,
                             ListSource(arrival_order(samples, seed), batch=3), packing=400, pack_across_groups=True,
                             full_microbatches=True, **kw)
        assert rel(g, g_sync) < TOL, (seed, rel(g, g_sync))
        assert res.planner_stats["deferred"] > 0
