"""--shared-prefix (training/packing.PrefixLayout): a group's prompt forwarded and backpropagated once per
microbatch, each trajectory's continuation attending to it; the update equals the unshared synchronous one.

float64, one process: the model's log-probs through a prefix layout equal each trajectory's own forward (control: a
mask that lets continuations see each other does not); gradients for every estimator × aggregation, the PPO/engine
and KL/entropy losses, sync / stream-group / stream-trajectory in several arrival orders, minibatches, against sync
unshared (≤ 1e-12); the planner's chunks (token cap, a member whose prompt differs runs alone, with router replay a
member whose prompt routes otherwise too: tests/training/test_replay_shared_prefix.py has the MoE runs).
"""

import pytest
import torch

from megatron_tsync.algorithms.policy_loss import PolicyLossConfig
from megatron_tsync.model import compat
from megatron_tsync.model.builder import unwrap
from megatron_tsync.model.logprobs import token_logprobs, vocab_parallel_logprobs
from megatron_tsync.streaming.planner import Dest, WorkItem
from megatron_tsync.streaming.ready_queue import ListSource
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
from megatron_tsync.training.packing import PrefixLayout, plan_shared_prefix, prompt_length
from megatron_tsync.training.stream_fb import LossConfig

from .stream_cases import arrival_order, prompt_groups, spec_for
from .test_streaming_exactness import AGGREGATIONS, ESTIMATORS, TOL, model64, rel  # noqa: F401


def gradient(model64, mode, samples, order, shared, **kw):
    ddp, opt = model64
    learner = Learner(ddp, opt, LearnerConfig(mode=mode, shared_prefix=shared, **kw))
    got = {}
    learner.grad_hook = lambda d: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
    sizes, shape = shape_for(samples)
    res = learner.train_step(ListSource(order), sizes, shape)
    return got["g"], res


def test_prefix_layout_logprobs_equal_each_trajectory(model64):
    ddp, _ = model64
    gpt = unwrap(ddp)
    compat.install_per_token_rope(gpt)
    S = prompt_groups(3)[4:8]  # one group
    o = prompt_length(S[0].loss_mask) - 1
    lay = PrefixLayout(o, tuple(s.token_ids.numel() for s in S))
    ids, pos = lay.token_ids([s.token_ids for s in S]).unsqueeze(0), lay.position_ids()
    assert ids.shape[1] == lay.total == o + sum(s.token_ids.numel() - o for s in S)
    with torch.no_grad():
        ref = [token_logprobs(gpt, s.token_ids.unsqueeze(0))[0, o:] for s in S]

        def logps(mask):
            with compat.rope_positions(gpt, pos):
                logits = gpt(ids, pos.unsqueeze(0), mask)
            return [vocab_parallel_logprobs(logits[:, a:b - 1], s.token_ids[o + 1:].unsqueeze(0))[0]
                    for (a, b), s in zip(lay.segments(), S)]

        for got, r in zip(logps(lay.mask()), ref):  # SDPAttention's block-by-block path (structure on the mask)
            assert (got - r).abs().max().item() < 1e-13
        for got, r in zip(logps(lay.mask().clone()), ref):  # the same mask as a plain T×T mask (attribute dropped)
            assert (got - r).abs().max().item() < 1e-13
        # control: continuations that also see the earlier continuations are wrong from the second one on
        leaky = lay.mask().clone()
        a1, _ = lay.segments()[1]
        leaky[0, 0, a1:, o:a1] = False
        bad = logps(leaky)
        assert (bad[1] - ref[1]).abs().max().item() > 1e-6


# every aggregation x estimator; the fast tier keeps a diagonal (each of both at least once), the rest is slow
@pytest.mark.parametrize("aggregation,estimator", [
    pytest.param(a, e, id=f"{a}-{e}", marks=() if AGGREGATIONS.index(a) == i % len(AGGREGATIONS) else pytest.mark.slow)
    for a in AGGREGATIONS for i, e in enumerate(ESTIMATORS)])
def test_shared_equals_unshared_sync(model64, estimator, aggregation):
    samples = prompt_groups(5)
    kw = dict(estimator=estimator, reward_spec=spec_for("binary"), loss=LossConfig(aggregation=aggregation),
              skip_zero_advantage=False)
    g_ref, r_ref = gradient(model64, "sync", samples, samples, False, **kw)
    assert g_ref.norm() > 0 and r_ref.planner_stats["shared_prefix_items"] == 0
    for mode in ("sync", "stream-group", "stream-trajectory"):
        for seed in (0, 1):
            order = samples if seed == 0 and mode != "stream-trajectory" else arrival_order(samples, seed)
            g, res = gradient(model64, mode, samples, order, True, **kw)
            assert rel(g, g_ref) < TOL, (mode, seed, rel(g, g_ref))
            if mode != "stream-trajectory":  # whole groups run together: every trajectory is a continuation
                assert res.planner_stats["shared_prefix_items"] == len(samples)
                assert res.microbatches == 3


@pytest.mark.parametrize("case", ["ppo-engine", "kl-entropy", "minibatches"])
def test_shared_prefix_loss_variants(model64, case):
    samples = prompt_groups(7)
    loss = {"ppo-engine": LossConfig(old_logprobs="engine", policy=PolicyLossConfig(clip_low=0.2, clip_high=0.28,
                                                                                   dual_clip=3.0)),
            "kl-entropy": LossConfig(kl_mode="loss", kl_coef=0.1, entropy_coef=0.01),
            "minibatches": LossConfig()}[case]
    kw = dict(estimator="grpo", reward_spec=spec_for("binary"), loss=loss,
              num_minibatches=2 if case == "minibatches" else 1, epochs=2 if case == "minibatches" else 1)
    g_ref, _ = gradient(model64, "sync", samples, samples, False, **kw)
    assert g_ref.norm() > 0
    for mode in ("sync", "stream-group", "stream-trajectory"):
        g, res = gradient(model64, mode, samples, arrival_order(samples, 4), True, **kw)
        assert rel(g, g_ref) < TOL, (case, mode, rel(g, g_ref))
        if mode != "stream-trajectory":  # one arrival at a time: members may all run alone there
            assert res.planner_stats["shared_prefix_items"] > 0


def test_planner_chunks_and_mismatched_prompt():
    S = prompt_groups(9, groups=1, G=4)
    S[3].token_ids = S[3].token_ids.clone()
    S[3].token_ids[2] += 1  # another prompt: not a member
    by_id = {s.traj_id: s for s in S}
    items = [WorkItem(s.traj_id, s.group_id, s.reward, Dest.ACCUM, advantage=0.5) for s in S]
    tok, msk = (lambda it: by_id[it.traj_id].token_ids), (lambda it: by_id[it.traj_id].loss_mask)
    packs, rest, split = plan_shared_prefix(items, tok, msk, 10_000)
    assert split == 0 and [[it.traj_id for it in p] for p, _ in packs] == [["g0t0", "g0t1", "g0t2"]] and [it.traj_id for it in rest] == ["g0t3"]
    (lay,) = [lay for _, lay in packs]
    assert lay.prefix == prompt_length(S[0].loss_mask) - 1
    o = lay.prefix
    cap = o + sum(S[i].token_ids.numel() - o for i in (0, 1))  # room for two continuations only
    packs, rest, _ = plan_shared_prefix(items[:3], tok, msk, cap)
    assert [len(p) for p, _ in packs] == [2] and [it.traj_id for it in rest] == ["g0t2"]
    assert all(lay.total <= cap for _, lay in packs)


def test_planner_keeps_members_apart_whose_prompt_routes_otherwise():
    """Router replay: members share a prefix only with members whose prompt positions replay the same experts
    (in any order within the top-k); the rest share among themselves or run alone, counted."""
    S = prompt_groups(9, groups=1, G=4)
    o = prompt_length(S[0].loss_mask) - 1
    base = torch.randint(0, 8, (100, 2, 2), generator=torch.Generator().manual_seed(0))  # (P, L, k) experts
    routing = {s.traj_id: base[: s.token_ids.numel() - 1].clone() for s in S}
    routing["g0t0"][0] = routing["g0t0"][0].flip(-1)  # the same experts in another order: still alike
    items = [WorkItem(s.traj_id, s.group_id, s.reward, Dest.ACCUM, advantage=0.5) for s in S]
    by_id = {s.traj_id: s for s in S}
    tok, msk = (lambda it: by_id[it.traj_id].token_ids), (lambda it: by_id[it.traj_id].loss_mask)

    def plan():
        packs, rest, split = plan_shared_prefix(items, tok, msk, 10_000, routing=lambda it: routing[it.traj_id])
        return [[it.traj_id for it in p] for p, _ in packs], [it.traj_id for it in rest], split

    assert plan() == ([["g0t0", "g0t1", "g0t2", "g0t3"]], [], 0)
    routing["g0t1"][o - 1, 1, 0] = 8  # another expert at the prefix's last position
    assert plan() == ([["g0t0", "g0t2", "g0t3"]], ["g0t1"], 1)
    routing["g0t3"][o - 1, 1, 0] = 8  # two and two: each pair shares its own prefix
    assert plan() == ([["g0t0", "g0t2"], ["g0t1", "g0t3"]], [], 2)
    routing["g0t1"][o, 1, 0] = 9  # a continuation's position is its own: no effect
    assert plan()[2] == 2
