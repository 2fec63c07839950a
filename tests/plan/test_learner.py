"""The simulated learner's order of work is the real learner's: the same arrivals (poll by poll) through
``training.learner.Learner`` (a real Megatron model, its real executor) and through ``plan.learner.simulate_rank``
hand the same trajectories to the executor, and close the same groups, in the same order."""

import random

import pytest
import torch

from megatron_tsync.plan.learner import LearnerCost, PlannerSettings, simulate_rank
from megatron_tsync.plan.workload import WorkloadSpec, build_batch
from megatron_tsync.streaming.ready_queue import DataParallelAssigner, Sample

from tests.training.stream_cases import TINY


@pytest.fixture(scope="module")
def tiny(megatron_single):
    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    ddp = wrap_ddp(build_model(TINY, PrecisionConfig(), seed=0))
    return ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))


class _Polls:
    """Arrivals in fixed poll batches (no clock): poll p returns batch p."""

    def __init__(self, polls):
        self.polls, self.i = polls, 0

    def poll(self, timeout_s):
        self.i += 1
        return self.polls[self.i - 1] if self.i <= len(self.polls) else []

    def exhausted(self):
        return self.i >= len(self.polls)


def _arrivals(seed):
    trajs = build_batch(WorkloadSpec(prompts=5, group_size=4, calls=0, profile="none", seed=seed), 0)
    rnd = random.Random(seed)
    rnd.shuffle(trajs)
    polls, k = [], 0
    while k < len(trajs):
        n = rnd.choice([1, 1, 2, 3])
        polls.append(trajs[k:k + n])
        k += n
    return polls


def _samples(polls, dp):
    g = torch.Generator().manual_seed(0)
    out = []
    for batch in polls:
        row = []
        for tr in batch:
            T = 12 + tr.index
            mask = torch.ones(T)
            mask[:3] = 0
            row.append(Sample(traj_id=tr.traj_id, group_id=tr.group_id, group_size=4,
                              token_ids=torch.randint(0, TINY.vocab_size, (T,), generator=g), loss_mask=mask,
                              reward=tr.reward, behaviour_logp=-torch.rand(T, generator=g, dtype=torch.float64) - 1))
        out.append(row)
    DataParallelAssigner(dp).assign_samples([s for row in out for s in row])
    return out


def _real_order(tiny, mode, polls, dp, rank):
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for

    ddp, opt = tiny
    L = Learner(ddp, opt, LearnerConfig(mode=mode), dp_rank=rank)
    order = []
    run, close = L.exec.run, L.exec.close

    def rec_run(items, **kw):
        order.extend(("run", it.traj_id) for it in items)
        return run(items, **kw)

    def rec_close(closes):
        order.extend(("close", c.group_id) for c in closes)
        return close(closes)

    L.exec.run, L.exec.close = rec_run, rec_close
    samples = _samples(polls, dp)
    sizes, shape = shape_for([s for row in samples for s in row])
    res = L.train_step(_Polls(samples), sizes, shape)
    return order, res.planner_stats


@pytest.mark.parametrize("mode,dp,rank", [("sync", 1, 0), ("stream-group", 1, 0), ("stream-trajectory", 1, 0),
                                          ("stream-trajectory", 2, 1)])
def test_simulated_order_is_the_learners(tiny, mode, dp, rank):
    polls = _arrivals(3)
    real, stats = _real_order(tiny, mode, polls, dp, rank)
    arrivals = [(float(p), tr) for p, batch in enumerate(polls) for tr in batch]  # poll p lands at t = p
    free = LearnerCost(overhead_s=0.0, per_token_s=0.0)
    sim = simulate_rank(free, PlannerSettings(), arrivals, mode, rank, dp)
    assert sim.order == real
    other = {"sync": "stream-trajectory", "stream-group": "stream-trajectory"}.get(mode, "stream-group")
    assert simulate_rank(free, PlannerSettings(), arrivals, other, rank, dp).order != real  # the order is a real test
    assert sim.stats == {k: stats[k] for k in sim.stats}
    assert stats["skipped_zero_advantage"] > 0  # an all-equal group is in the batch (its work skipped alike)
    if mode == "stream-trajectory":
        assert stats["bucketed"] > 0  # trajectories streamed into buckets before their group completed
        assert any(op == "close" for op, _ in real)


def test_schedule_call_and_planner_costs():
    """``call_s`` is paid once per schedule call (sync: one, at the barrier), ``planner_time`` adds the planner's own
    seconds."""
    import dataclasses

    trajs = build_batch(WorkloadSpec(prompts=2, group_size=4, calls=0, profile="none"), 0)
    arrivals = [(0.0, tr) for tr in trajs]
    base = LearnerCost(overhead_s=0.01, per_token_s=0.0)
    every = PlannerSettings(skip_zero_advantage=False)
    a = simulate_rank(base, every, arrivals, "sync", 0, 1)
    assert a.end_s == pytest.approx(0.01 * len(trajs))
    b = simulate_rank(dataclasses.replace(base, call_s=1.0), every, arrivals, "sync", 0, 1)
    assert b.end_s == pytest.approx(a.end_s + 1.0)
    c = simulate_rank(dataclasses.replace(base, planner_time=True), every, arrivals, "sync", 0, 1)
    assert c.end_s > a.end_s
