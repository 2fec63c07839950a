"""The learner's and the weight sync's seconds from the model, the layout and the GPU (``hardware.py``'s formulas).

- microbatch of T tokens: ``mb_overhead_s + train_flops(T) / (peak · mfu · TP · PP)`` (a replica's GPUs; EP spreads
  the experts over data-parallel ranks and leaves each rank's FLOPs alone); OPD adds the teacher's forward,
  ``2·N_teacher`` per token;
- a group close (bucket fold): three passes over its bucket vectors (``memory.PER_GROUP`` fp32 vectors of the
  rank's parameters) at the HBM bandwidth;
- the barrier: a ring all-reduce of the fp32 grad buffer over DP, ``2·(DP−1)/DP · 4·P_rank / dp_bw``, the
  distributed Adam step (≈ 30 bytes per parameter of the rank's 1/DP shard at HBM bandwidth) and the bf16 parameter
  all-gather ``2·(DP−1)/DP · 2·P_rank / dp_bw``;
- the weight sync: every bf16 weight once, ``2·P_total / sync_bw``;
- host accumulation (``--accumulate-on-host``): one vector's D2H copy ``4·P_rank / host_link``, its host add
  ``12·P_rank / host_add`` (read the staged chunk and the destination, write the destination: fp32).
"""

from __future__ import annotations

from megatron_tsync.model.builder import ModelArch
from megatron_tsync.plan.hardware import Layout, ModelCost
from megatron_tsync.plan.learner import LearnerCost
from megatron_tsync.plan.memory import PER_GROUP, params_per_rank


def learner_cost(arch: ModelArch, layout: Layout, estimator: str = "grpo",
                 teacher: ModelCost | None = None) -> LearnerCost:
    cost = ModelCost.of(arch)
    rate = layout.peak * layout.mfu * layout.tp * layout.pp
    per_tok = 6.0 * (cost.active_params + cost.embed_params / 2)
    if teacher is not None:
        per_tok += 2.0 * (teacher.active_params + teacher.embed_params / 2)
    p_rank = params_per_rank(arch, layout.tp, layout.pp, layout.ep)
    dp = layout.dp
    ring = 2.0 * (dp - 1) / dp / (layout.dp_bw_gbs * 1e9)
    shard = params_per_rank(arch, layout.tp, layout.pp) / dp  # the distributed optimizer's shard (rank_state_gib)
    barrier = ring * 4 * p_rank + 30.0 * shard / layout.hbm + ring * 2 * p_rank
    fold = 3.0 * PER_GROUP.get(estimator, 2) * 4 * p_rank / layout.hbm
    return LearnerCost(overhead_s=layout.mb_overhead_s, per_token_s=per_tok / rate,
                       per_token2_s=6.0 * cost.layers * cost.q_dim / rate, fold_s=fold, barrier_s=barrier,
                       pp=layout.pp, vector_copy_s=4 * p_rank / (layout.spec("host_link_gbs") * 1e9),
                       host_add_s=12 * p_rank / (layout.spec("host_add_gbs") * 1e9))


def weight_sync_s(cost: ModelCost, layout: Layout) -> float:
    return 2.0 * cost.total_params / (layout.sync_bw_gbs * 1e9)


def rank_state_gib(arch: ModelArch, layout: Layout) -> float:
    """Model state per learner GPU: bf16 weights, fp32 grad buffer, fp32 master weights and Adam moments sharded
    by the distributed optimizer; activations not counted. The rank holds P_rank = D + X/EP parameters (D not
    expert, X its TP × PP slice of the experts), but each parameter's optimizer state is sharded over the ranks that
    hold a copy of it: D over DP, an expert over the DP/EP ranks of its expert-data-parallel group, so the shard is
    12·(D/DP + (X/EP)/(DP/EP)) = 12·(D + X)/DP bytes: P at EP = 1, over DP (not P_rank/DP, which under-counts an
    EP > 1 rank's shard EP-fold for its experts)."""
    p = params_per_rank(arch, layout.tp, layout.pp, layout.ep)
    whole = params_per_rank(arch, layout.tp, layout.pp)
    return (2 * p + 4 * p + 12 * whole / layout.dp) / (1 << 30)
