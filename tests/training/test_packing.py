"""Sequence packing (training/packing.py): float64, one process, packed vs unpacked gradient ≤ 1e-12 relative.

Several trajectories share one microbatch (block-diagonal causal attention, RoPE positions restarting per segment,
one loss term per segment with its own ν_i and advantage). The backward of the sum must equal the sum of the
per-trajectory backwards: sync with packing vs sync without, across aggregations, PPO clip with ratio ≠ 1 (engine
log-probs as π_old), KL/entropy; stream-trajectory with packing vs unpacked sync (bucket items of one group with
equal rewards share a microbatch, accumulator items share); deferred items inside a packed bucket microbatch.
"""

import pytest
import torch

from megatron_tsync.algorithms.policy_loss import PolicyLossConfig
from megatron_tsync.streaming.planner import Dest, WorkItem
from megatron_tsync.streaming.ready_queue import ListSource
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
from megatron_tsync.model.logprobs import token_logprobs
from megatron_tsync.model.builder import PrecisionConfig, build_model, unwrap
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
from megatron_tsync.training.packing import layout_for, plan_microbatches, share_key
from megatron_tsync.training.stream_fb import LossConfig

from .stream_cases import TINY, arrival_order, make_samples, spec_for

TOL = 1e-12


@pytest.fixture(scope="module")
def model64(megatron_single):
    m = build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0)
    ddp = wrap_ddp(m)
    return ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))


def gradient(model64, mode, samples, order, packing=None, **kw):
    ddp, opt = model64
    cfg = LearnerConfig(mode=mode, sequence_packing=packing is not None, max_packed_tokens=packing or 4096, **kw)
    learner = Learner(ddp, opt, cfg)
    got = {}
    learner.grad_hook = lambda d: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
    sizes, shape = shape_for(samples)
    source = order if isinstance(order, ListSource) else ListSource(order)
    res = learner.train_step(source, sizes, shape)
    return got["g"], res, learner


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# ------------------------------------------------------------------------------------------------ planning units
def test_layout_mask_and_positions():
    lay = layout_for([3, 2])
    assert lay.position_ids().tolist() == [0, 1, 2, 0, 1]
    allowed = ~lay.block_causal_mask()[0, 0]
    expect = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]],
                          dtype=torch.bool)
    assert torch.equal(allowed, expect)
    padded = layout_for([5, 6], align=16)
    assert padded.total == 16 and padded.pad == 5 and padded.cu_seqlens() == [0, 5, 11, 16]
    assert padded.segments() == [(0, 5), (5, 11)]


def test_shared_prefix_layout_padded_to_tp():
    """Sequence parallelism (MoE at TP > 1): a shared-prefix microbatch padded to a multiple of TP by a dummy
    continuation that sees the prefix and itself; the real continuations' rows of the mask, positions and tokens are
    those of the unpadded layout."""
    from megatron_tsync.model import compat
    from megatron_tsync.training.packing import PrefixLayout

    plain, padded = PrefixLayout(3, (5, 6)), PrefixLayout(3, (5, 6)).aligned(3)
    assert padded.pad == 1 and padded.aligned(3) == padded and plain.aligned(1) == plain
    assert (plain.total, padded.total) == (8, 9) and padded.segments() == plain.segments() == [(3, 5), (5, 8)]
    toks = [torch.tensor([7, 8, 9, 1, 2]), torch.tensor([7, 8, 9, 3, 4, 5])]
    assert padded.token_ids(toks).tolist() == plain.token_ids(toks).tolist() + [0]
    assert padded.position_ids().tolist() == plain.position_ids().tolist() + [3]
    m, m0 = ~padded.mask()[0, 0], ~plain.mask()[0, 0]
    assert torch.equal(m[:8, :8], m0) and not m[:8, 8].any()  # no real token sees the padding
    assert m[8].tolist() == [True] * 3 + [False] * 5 + [True]  # the padding: the prefix and itself
    assert getattr(padded.mask(), compat.PREFIX_TREE_ATTR) == (3, [2, 3, 1])


def test_share_key_and_plan():
    acc = [WorkItem(f"a{i}", "g0", 1.0, Dest.ACCUM, advantage=0.5) for i in range(3)]
    aux = WorkItem("x", "g1", 0.0, Dest.ACCUM, policy=False, aux=True)
    b1 = WorkItem("b1", "g2", 1.0, Dest.BUCKET, adv_sign=1)
    b2 = WorkItem("b2", "g2", 1.0, Dest.BUCKET, adv_sign=1)
    b3 = WorkItem("b3", "g2", 0.0, Dest.BUCKET, adv_sign=-1)
    b4 = WorkItem("b4", "g3", 1.0, Dest.BUCKET, adv_sign=1)
    assert share_key(acc[0]) == share_key(aux)  # both only route to the accumulator
    assert share_key(b1) == share_key(b2) != share_key(b3)  # same group, same reward only
    assert share_key(b1) != share_key(b4)
    items = [acc[0], b1, b3, acc[1], b2, aux, b4, acc[2]]
    packs = plan_microbatches(items, lambda it: 10, 30)
    ids = [[it.traj_id for it in p] for p in packs]
    assert ids == [["a0", "a1", "x"], ["b1", "b2"], ["b3"], ["b4"], ["a2"]]
    assert plan_microbatches(items, lambda it: 10, None) == [[it] for it in items]
    assert plan_microbatches(items, lambda it: 40, 30) == [[it] for it in items]  # too long to pack


def test_packed_forward_equals_unpacked_logprobs(model64):
    """The model itself: a packed forward's per-segment log-probs equal each trajectory's own forward."""
    from megatron_tsync.model import compat

    ddp, _ = model64
    gpt = unwrap(ddp)
    compat.install_per_token_rope(gpt)
    S = make_samples(3)[:4]
    lay = layout_for([s.token_ids.shape[0] for s in S])
    ids = torch.cat([s.token_ids for s in S]).unsqueeze(0)
    pos = lay.position_ids()
    with torch.no_grad(), compat.rope_positions(gpt, pos):
        logits = gpt(ids, pos.unsqueeze(0), lay.block_causal_mask())
    with torch.no_grad():
        ref = [token_logprobs(gpt, s.token_ids.unsqueeze(0))[0] for s in S]
        from megatron_tsync.model.logprobs import vocab_parallel_logprobs

        for (a, b), s, r in zip(lay.segments(), S, ref):
            got = vocab_parallel_logprobs(logits[:, a:b - 1], s.token_ids[1:].unsqueeze(0))[0]
            assert (got - r).abs().max().item() < 1e-13
        # plain causal attention over the pack (no block mask): later segments see earlier ones and are wrong
        wrong = gpt(ids, pos.unsqueeze(0), None)
        a, b = lay.segments()[1]
        got = vocab_parallel_logprobs(wrong[:, a:b - 1], S[1].token_ids[1:].unsqueeze(0))[0]
        assert (got - ref[1]).abs().max().item() > 1e-6
        # RoPE is relative: inside a block-diagonal mask, positions continuing across segments change the scores
        # only by rounding (measured ~1e-15), which is why per-segment positions are not a large effect here
        shifted = gpt(ids, pos.unsqueeze(0), lay.block_causal_mask())
        got = vocab_parallel_logprobs(shifted[:, a:b - 1], S[1].token_ids[1:].unsqueeze(0))[0]
        assert (got - ref[1]).abs().max().item() < 1e-10


# ------------------------------------------------------------------------------------------------ gradients
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("case", ["ratio1", "ppo-engine", "kl-entropy"])
def test_sync_packed_equals_unpacked(model64, aggregation, case):
    samples = make_samples(31, reward_kind="bounded", with_ref=True)
    loss = {"ratio1": LossConfig(aggregation=aggregation),
            "ppo-engine": LossConfig(aggregation=aggregation, old_logprobs="engine",
                                     policy=PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0)),
            "kl-entropy": LossConfig(aggregation=aggregation, kl_mode="loss", kl_coef=0.1, entropy_coef=0.01)}[case]
    kw = dict(estimator="grpo", reward_spec=spec_for("bounded"), loss=loss)
    g_ref, r_ref, _ = gradient(model64, "sync", samples, samples, **kw)
    g, res, _ = gradient(model64, "sync", samples, samples, packing=64, **kw)
    assert g_ref.norm() > 0
    assert rel(g, g_ref) < TOL, rel(g, g_ref)
    assert r_ref.microbatches == len(samples) - r_ref.planner_stats["skipped_zero_advantage"]
    assert res.microbatches < len(samples) // 2, res.microbatches  # 10-24 tokens each, 64 per microbatch
    assert abs(res.loss_sum - r_ref.loss_sum) <= 1e-12 * max(1.0, abs(r_ref.loss_sum))


@pytest.mark.parametrize("estimator,aggregation", [("grpo", "token-mean"), ("dr_grpo", "seq-mean-token-mean"),
                                                   ("rloo", "seq-mean-token-sum")])
def test_stream_trajectory_packed_equals_sync(model64, monkeypatch, estimator, aggregation):
    """Binary rewards: bucket items of one group with equal rewards share microbatches; arrivals in batches of
    several trajectories (as when several rewards land within one poll) so that packing has something to pack."""
    samples = make_samples(41, num_groups=4, reward_kind="binary")
    kw = dict(estimator=estimator, reward_spec=spec_for("binary"), loss=LossConfig(aggregation=aggregation))
    g_sync, _, _ = gradient(model64, "sync", samples, samples, **kw)
    order = arrival_order(samples, 5)
    packs = _spy_packs(monkeypatch)
    g, res, L = gradient(model64, "stream-trajectory", samples, ListSource(order, batch=5), packing=80, **kw)
    assert rel(g, g_sync) < TOL, rel(g, g_sync)
    assert res.planner_stats["bucketed"] > 0
    assert L.exec.packed_items > 0
    assert any(len(p) > 1 and p[0].dest is Dest.BUCKET for p in packs)  # bucket items really shared a backward
    assert any(len(p) > 1 and p[0].dest is Dest.ACCUM for p in packs)


@pytest.mark.parametrize("reward", ["bounded", "continuous"])
def test_stream_packed_with_deferred_items(model64, monkeypatch, reward):
    """PPO clip with engine log-probs (ratio ≠ 1): items whose clip mask needs the unknown advantage sign defer
    after their forward, inside a packed microbatch; their segment contributes zero and runs at group close."""
    samples = make_samples(7, reward_kind=reward)
    kw = dict(estimator="grpo", reward_spec=spec_for(reward),
              loss=LossConfig(policy=PolicyLossConfig(), old_logprobs="engine"))
    g_sync, _, _ = gradient(model64, "sync", samples, samples, **kw)
    for wait in (False, True):  # --stream-wait-for-variance moves when bucket items run (and what they pack with)
        routed = _spy_routing(monkeypatch)
        for seed in (5, 6):
            g, res, L = gradient(model64, "stream-trajectory", samples, ListSource(arrival_order(samples, seed),
                                                                                   batch=6),
                                 packing=96, wait_for_variance=wait, **kw)
            assert rel(g, g_sync) < TOL, (seed, rel(g, g_sync), res.planner_stats)
            assert res.planner_stats["deferred"] > 0
        # a packed bucket microbatch had deferred segments (they contributed zero and ran again at group close)
        assert any(n > 1 and 0 < d for n, d, _ in routed) or wait, routed


def _spy_packs(monkeypatch):
    from megatron_tsync.training import packing, stream_fb

    seen = []

    def spy(items, length, max_tokens, key=None):
        out = packing.plan_microbatches(items, length, max_tokens, key=key)
        seen.extend(out)
        return out

    monkeypatch.setattr(stream_fb, "plan_microbatches", spy)
    return seen


def _spy_routing(monkeypatch):
    """(segments, deferred segments, dest) of every microbatch at backward time."""
    from megatron_tsync.training.stream_fb import StreamExecutor

    seen, original = [], StreamExecutor._before_backward

    def spy(self, item, states, grad_outputs):
        seen.append((len(states), sum(st["deferred"] for st in states), item.dest))
        return original(self, item, states, grad_outputs)

    monkeypatch.setattr(StreamExecutor, "_before_backward", spy)
    return seen


def test_stream_group_and_minibatches_packed(model64):
    samples = make_samples(51, num_groups=4, reward_kind="bounded")
    kw = dict(estimator="grpo_unbiased", reward_spec=spec_for("bounded"))
    g_sync, _, _ = gradient(model64, "sync", samples, samples, **kw)
    g, res, _ = gradient(model64, "stream-group", samples, arrival_order(samples, 2), packing=128, **kw)
    assert rel(g, g_sync) < TOL
    assert res.microbatches < len(samples)

