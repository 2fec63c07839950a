"""The planner's model state per learner GPU (``plan.costs.rank_state_gib``): the distributed optimizer shards each
parameter's fp32 master weight and Adam moments over the ranks holding a copy of it — a dense parameter over DP, an
expert over its DP/EP expert-data-parallel ranks — so an EP > 1 rank's optimizer shard is 12·N/DP bytes (N: the
parameters of the model's TP × PP slice), not 12·P_rank/DP."""

import pytest

from megatron_tsync.plan.costs import rank_state_gib
from megatron_tsync.plan.hardware import Layout, load_arch
from megatron_tsync.plan.memory import params_per_rank

GIB = 1 << 30


@pytest.mark.parametrize("model,tp,ep,learners", [("qwen3-30b-a3b", 1, 4, 4), ("qwen3-30b-a3b", 1, 8, 32),
                                                  ("glm-4.7-flash", 1, 4, 4), ("qwen3-8b", 2, 1, 8)])
def test_optimizer_shard_counts_every_copy_of_a_parameter(model, tp, ep, learners):
    arch = load_arch(model)
    lay = Layout(gpu="h100", learner_gpus=learners, tp=tp, ep=ep)
    dp = learners // tp
    p, whole = params_per_rank(arch, tp, 1, ep), params_per_rank(arch, tp, 1)
    # by hand: the rank's experts (X/EP) over the DP/EP copies of each, the rest (D) over DP
    x_rank = (whole - p) / (ep - 1) if ep > 1 else 0.0  # whole = D + X, p = D + X/EP
    d = p - x_rank
    shard = d / dp + (x_rank / (dp / ep) if ep > 1 else 0.0)
    assert rank_state_gib(arch, lay) == pytest.approx((6 * p + 12 * shard) / GIB, rel=1e-12)
    if ep > 1:  # the old rule (12·P_rank/DP) under-counted the experts' state EP-fold
        assert rank_state_gib(arch, lay) > (6 * p + 12 * p / dp) / GIB + 1
