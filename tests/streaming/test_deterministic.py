"""The bitwise mode's pieces in ``streaming/``: the canonical-order sum, exact signs, canonical rewards, DP by group.

``CanonicalSum`` over a real DDP model's grad buffers (float32): random per-trajectory "backwards" (written through
``param.main_grad`` as megatron's DDP hook does) in many arrival orders give a ``torch.equal`` accumulator, equal to
the documented fold computed by hand; the same contributions added as they arrive (the default mode's order) do not.
"""

import random

import pytest
import torch

from megatron_tsync.algorithms.advantages import get_advantage_estimator
from megatron_tsync.algorithms.streamability import RewardSpec
from megatron_tsync.model.builder import PrecisionConfig, build_model
from megatron_tsync.streaming.buckets import BucketPool, GradRouter
from megatron_tsync.streaming.canonical import CanonicalSum, canonical_key
from megatron_tsync.streaming.offload import Residency, ResidencyConfig
from megatron_tsync.streaming.planner import StepPlanner, TrajMeta, exact_sign
from megatron_tsync.streaming.ready_queue import DataParallelAssigner
from megatron_tsync.training.optimizer import wrap_ddp

from ..training.stream_cases import TINY

GROUPS = {f"g{k}": [f"g{k}t{i}" for i in range(n)] for k, n in enumerate([3, 5, 4, 12])}


@pytest.fixture(scope="module")
def router(megatron_single):
    return GradRouter(wrap_ddp(build_model(TINY, PrecisionConfig(), seed=0)))


def _contribs(router, seed=0):
    """traj -> (policy gradient, aux gradient, advantage): flat tensors shaped like the grad buffer."""
    g = torch.Generator().manual_seed(seed)
    n = router.accumulator.numel()
    out = {}
    for tids in GROUPS.values():
        for t in tids:
            scale = 10.0 ** torch.randint(-3, 4, (1,), generator=g).item()  # mixed magnitudes: rounding matters
            out[t] = (torch.randn(n, generator=g) * scale, torch.randn(n, generator=g),
                      float(torch.randn(1, generator=g)))
    return out


def _write(router, flat):
    """What a backward does under megatron's DDP: main_grad += grad for every parameter."""
    off = 0
    for (param, *_rest) in router._slots:
        k = param.main_grad.numel()
        param.main_grad.add_(flat[off:off + k].view_as(param.main_grad))
        off += k


def _run(router, contribs, order, residency=None):
    router.accumulator.zero_()
    pool = BucketPool(router.accumulator, keep_free=residency is None)
    cs = CanonicalSum(router, pool, residency)
    cs.begin(list(GROUPS), ("policy", "aux"))
    left = {gid: set(tids) for gid, tids in GROUPS.items()}
    for t in order:
        gid = t.split("t")[0]
        h, k, _ = contribs[t]
        cs.enter(t, gid, "policy")
        _write(router, h)
        cs.enter(t, gid, "aux")
        _write(router, k)
        left[gid].discard(t)
        if not left[gid]:
            cs.close_group(gid, {x: contribs[x][2] for x in GROUPS[gid]})
    cs.finish()
    return router.accumulator.flat().clone(), pool.stats.peak_in_use


def test_canonical_sum_is_order_free_and_the_documented_fold(router):
    contribs = _contribs(router)
    tids = [t for ts in GROUPS.values() for t in ts]
    results, peaks = [], []
    for seed in range(6):
        order = list(tids)
        random.Random(seed).shuffle(order)
        acc, peak = _run(router, contribs, order)
        results.append(acc)
        peaks.append(peak)
    assert all(torch.equal(r, results[0]) for r in results)
    # the documented shape: acc = Σ_g C_g (batch order), C_g = Σ_i A_i h_i + k_i (canonical id order), left folds
    acc = torch.zeros_like(results[0])
    for gid, ts in GROUPS.items():
        c = None
        for t in sorted(ts, key=canonical_key):
            h, k, a = contribs[t]
            c = (h * a + k) if c is None else torch.add(c, h, alpha=a) + k  # add_(alpha=) may fuse: same op
        acc = acc + c
    assert torch.equal(results[0], acc)
    assert max(peaks) <= 2 * len(tids) and min(peaks) >= 2  # per-trajectory vectors held until the group closes
    # control: the same contributions summed in arrival order differ in their bits for some order
    naive = []
    for seed in range(6):
        order = list(tids)
        random.Random(seed).shuffle(order)
        s = torch.zeros_like(acc)
        for t in order:
            h, k, a = contribs[t]
            s = s + h * a + k
        naive.append(s)
    assert any(not torch.equal(x, naive[0]) for x in naive[1:])


def test_canonical_sum_with_host_offload_is_bit_identical(router):
    contribs = _contribs(router, 1)
    order = [t for i in range(12) for ts in GROUPS.values() for t in ts[i:i + 1]]  # every group open at once
    ref, _ = _run(router, contribs, order)
    res = Residency(router, ResidencyConfig(max_device_vectors=3))
    got, _ = _run(router, contribs, order, residency=res)
    assert torch.equal(got, ref)
    assert res.stats.to_host > 0 and res.stats.peak_device <= 3


def test_canonical_sum_misuse(router):
    cs = CanonicalSum(router, BucketPool(router.accumulator))
    cs.begin(["g0", "g1"])
    cs.close_group("g1", {})
    with pytest.raises(AssertionError, match="already closed"):
        cs.enter("g1t0", "g1", "policy")
    with pytest.raises(AssertionError, match="not folded"):
        cs.finish()  # g0 never closed: g1 waits for it
    with pytest.raises(ValueError, match="part"):
        cs.enter("g0t0", "g0", "value")


def test_canonical_key_is_natural_for_ids():
    assert sorted(["s0g1t10", "s0g1t2", "s0g1t0"], key=canonical_key) == ["s0g1t0", "s0g1t2", "s0g1t10"]


def test_exact_sign():
    assert exact_sign(0.1, [0.1, 0.1, 0.1]) == 1  # a tie (the float mean is 0.10000000000000002): +1
    assert exact_sign(0.0, [0.0, 1.0]) == -1 and exact_sign(1.0, [0.0, 1.0]) == 1
    # 0.2 is above the exact mean of the doubles 0.1, 0.2, 0.3 but below their float mean 0.20000000000000004
    assert 0.2 - (0.1 + 0.2 + 0.3) / 3 < 0
    assert exact_sign(0.2, [0.1, 0.2, 0.3]) == 1 and exact_sign(0.2, [0.3, 0.2, 0.1]) == 1


def test_planner_canonical_advantages_ignore_arrival_order():
    est = get_advantage_estimator("grpo")
    rewards = {f"g0t{i}": r for i, r in enumerate([0.1, 0.7, 0.3, 0.9, 0.25, 0.6])}
    got, got_default = [], []
    for seed in range(8):
        order = list(rewards)
        random.Random(seed).shuffle(order)
        for det, sink in ((True, got), (False, got_default)):
            p = StepPlanner(est, {"g0": 6}, mode="stream-trajectory", reward_spec=RewardSpec.bounded(0, 1),
                            loss_kind="ppo_clip", deterministic=det)
            p.on_ready_batch([TrajMeta(t, "g0", rewards[t], 5) for t in order])
            rs = torch.tensor(p._rewards(p.groups["g0"]), dtype=torch.float64)
            sink.append(est.coefficients(rs))
    assert all(c == got[0] for c in got)
    assert any(c != got_default[0] for c in got_default)  # control: arrival order changes the coefficients' bits


def test_dp_by_group_ignores_arrival_order():
    order = [f"s0g{g}t{i}" for g in range(5) for i in range(3)]
    ranks = []
    for seed in range(3):
        shuffled = list(order)
        random.Random(seed).shuffle(shuffled)
        a = DataParallelAssigner(2, group_order=[f"s0g{g}" for g in range(5)])
        ranks.append({t: a.assign(t, t.split("t")[0]) for t in shuffled})
    assert ranks[0] == ranks[1] == ranks[2]
    assert all(r == int(t[3]) % 2 for t, r in ranks[0].items())
    with pytest.raises(ValueError, match="not in this step's group order"):
        DataParallelAssigner(2, group_order=["s0g0"]).assign("s1g0t0", "s1g0")
