"""Multi-process streaming exactness worker (run by torchrun from tests/training/test_streaming_parallel.py).

One launch runs several checks on several layouts of the same 2 processes (``--checks LAYOUT:CHECK ...``, layouts
tp2 / pp2 / dp2, run one after the other: model parallelism is re-initialised between layouts):

f64: for several configs, streamed vs sync gradient (after the barrier) in float64 on this layout (two of them also
in stream-trajectory under bucket residency, 2 device slots, groups interleaved); and several minibatches /
epochs per batch (weights after the whole step, π_θ0 kept by the trainer).
packed: sequence packing on (sync, stream-trajectory — also with --pack-across-groups, and with it
--stream-full-microbatches —, stream-group) vs unpacked
sync, float64.
f32-sgd / f32-adam: 3 steps per mode in float32; Δ_k of stream-trajectory / stream-group vs sync next to the
permutation control (sync with microbatches reordered).
Rank 0 writes one JSON report per pair, ``--out-dir``/LAYOUT-CHECK.json = {"tp", "pp", "dp", "result", "seconds"}.

``python -m torch.distributed.run --nproc_per_node=2 stream_worker.py --out-dir D --checks tp2:f64 dp2:f32-adam``
"""

import argparse
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from stream_cases import TINY, arrival_order, frontier_order, make_samples, prompt_groups, spec_for  # noqa: E402

from megatron_tsync.algorithms.policy_loss import PolicyLossConfig  # noqa: E402
from megatron_tsync.streaming.ready_queue import DataParallelAssigner, ListSource  # noqa: E402
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for  # noqa: E402
from megatron_tsync.model.builder import PrecisionConfig, build_model  # noqa: E402
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp  # noqa: E402
from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel  # noqa: E402
from megatron_tsync.training.stream_fb import LossConfig  # noqa: E402

F64_CASES = [
    dict(estimator="grpo", reward="binary", loss={}),
    dict(estimator="grpo_unbiased", reward="bounded", loss={"aggregation": "seq-mean-token-mean"}),
    dict(estimator="dr_grpo", reward="continuous", loss={"aggregation": "seq-mean-token-sum-norm"}),
    dict(estimator="rloo", reward="binary", loss={"aggregation": "seq-mean-token-sum"}),
    dict(estimator="grpo_batch_std", reward="bounded", loss={}),
    dict(estimator="grpo", reward="bounded", loss={"old_logprobs": "engine", "policy": PolicyLossConfig(dual_clip=3.0)}),
    dict(estimator="grpo", reward="binary", loss={"kl_mode": "loss", "kl_coef": 0.1, "entropy_coef": 0.01}),
    dict(estimator="grpo", reward="binary", aux="defer", loss={"kl_mode": "loss", "kl_coef": 0.1}),
]


# Sequence packing (several trajectories per microbatch): packed runs against the *unpacked* sync gradient.
PACKED_CASES = [
    dict(estimator="grpo", reward="binary", loss={}),
    dict(estimator="grpo_unbiased", reward="bounded", loss={"aggregation": "seq-mean-token-mean", "old_logprobs": "engine",
                                                            "policy": PolicyLossConfig(dual_clip=3.0)}),
    dict(estimator="dr_grpo", reward="binary", loss={"kl_mode": "loss", "kl_coef": 0.1, "entropy_coef": 0.01}),
]
PACK_TOKENS = 72


def interleaved(samples):
    """Round-robin over the groups (every group open at once: the most bucket vectors)."""
    by: dict = {}
    for s in samples:
        by.setdefault(s.group_id, []).append(s)
    return [g[i] for i in range(max(map(len, by.values()))) for g in by.values() if i < len(g)]


def assign_dp(samples, dp, by_group=False):
    """Round-robin by arrival (the default), or the trainer's --dp-assignment group / balanced / spill
    (DataParallelAssigner; ``by_group`` "balanced": a new group on the rank with the least predicted work; "spill": by
    group, a member spilling to the least-loaded rank when its group's rank runs ahead, so a group may span ranks)."""
    if by_group:
        DataParallelAssigner(dp, by_group=True, balanced=by_group == "balanced", spill=by_group == "spill",
                             step_trajectories=len(samples)).assign_samples(samples)
        return samples
    for i, s in enumerate(samples):
        s.dp_rank = i % dp
    return samples


def make_learner(dims, dtype, oc, mode, case, seed=0, packing=None, mix=False, full=False, recompute=None,
                 resident=None, host=False):
    model = build_model(TINY, PrecisionConfig(params_dtype=dtype), seed=seed, **(recompute or {}))
    ddp = wrap_ddp(model)
    opt = build_optimizer(ddp, oc)
    lc = LossConfig(**case.get("loss", {}))
    cfg = LearnerConfig(mode=mode, estimator=case["estimator"], loss=lc, reward_spec=spec_for(case["reward"]),
                        aux_strategy=case.get("aux", "second-backward"), sequence_packing=packing is not None,
                        max_packed_tokens=packing or 4096, pack_across_groups=mix, full_microbatches=full,
                        max_device_buckets=resident, accumulate_on_host=host)
    return ddp, Learner(ddp, opt, cfg, dp_rank=dims.dp_rank, pp_size=dims.pp)


def global_rel(a, b, dims):
    """‖a − b‖ / ‖b‖ over all model-parallel shards (a, b: this rank's flat tensors)."""
    t = torch.tensor([float((a - b).double().pow(2).sum()), float(b.double().pow(2).sum())], dtype=torch.float64)
    dist.all_reduce(t, group=dims.model_parallel_group())
    return (t[0].sqrt() / t[1].sqrt()).item()


def params_flat(ddp):
    return torch.cat([p.detach().reshape(-1).double() for p in ddp.parameters()])


def affinity(ci: int):
    """The f64 check's DP assignment of case ``ci``: arrival order (even), by group (1), spill (5), balanced (3, 7)."""
    return (False, "group", False, "balanced", False, "spill", False, "balanced")[ci % 8]


FRONTIER_CASES = (1, 3)  # F64_CASES also run in stream-trajectory in frontier-first order (by group, balanced)
RESIDENT_CASES = (0, 2)  # F64_CASES also run in stream-trajectory under bucket residency (2 device slots) and
# with host accumulation (--accumulate-on-host: every vector on the host, the grad buffer as scratch)


def run_f64(dims):
    out = []
    for ci, case in enumerate(F64_CASES):
        grads = {}
        runs = [("sync", None), ("stream-trajectory", 11 + ci), ("stream-group", 23 + ci)]
        runs += [("stream-trajectory-resident", "interleaved"), ("stream-trajectory-host", "interleaved"),
                 ("stream-group-host", 23 + ci)] if ci in RESIDENT_CASES else []
        runs += [("stream-trajectory-frontier", "frontier")] if ci in FRONTIER_CASES else []
        for name, order_seed in runs:
            mode = name.removesuffix("-resident").removesuffix("-host").removesuffix("-frontier")
            ddp, L = make_learner(dims, torch.float64, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0), mode, case,
                                  resident=2 if name.endswith("-resident") else None, host=name.endswith("-host"))
            S = make_samples(100 + ci, reward_kind=case["reward"], with_ref=True)
            order = (S if order_seed is None else interleaved(S) if order_seed == "interleaved" else
                     frontier_order(S, 61 + ci) if order_seed == "frontier" else arrival_order(S, order_seed))
            assign_dp(order, dims.dp, by_group=affinity(ci))  # odd cases: a group's members on one rank
            if name == "stream-trajectory":  # the ranks holding each group's members (spill: some span two)
                ranks_of = {g: {s.dp_rank for s in order if s.group_id == g} for g in {s.group_id for s in order}}
            got = {}
            L.grad_hook = lambda d: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
            sizes, shape = shape_for(S)
            res = L.train_step(ListSource(order), sizes, shape)
            grads[name] = (got["g"], res)
        row = {"case": ci, "estimator": case["estimator"], "reward": case["reward"], "by_group": affinity(ci),
               "split_groups": sum(len(v) > 1 for v in ranks_of.values()),
               "peak_vectors": grads["stream-trajectory"][1].peak_bucket_vectors,
               "stats": grads["stream-trajectory"][1].planner_stats,
               "loss_keys": sorted(case["loss"]),  # train/loss (training/objective.py) of each mode:
               "objective": {mode: r.objective for mode, (_, r) in grads.items()}}
        for mode in ("stream-trajectory", "stream-group"):
            row[mode] = global_rel(grads[mode][0], grads["sync"][0], dims)
        if ci in FRONTIER_CASES:
            g, r = grads["stream-trajectory-frontier"]
            row["frontier"] = {"vs_sync": global_rel(g, grads["sync"][0], dims), "peak": r.peak_bucket_vectors}
        if ci in RESIDENT_CASES:  # every group open at once, vectors through the host arena
            g, r = grads["stream-trajectory-resident"]
            row["resident"] = {"vs_sync": global_rel(g, grads["sync"][0], dims), "peak": r.peak_bucket_vectors,
                               **{k: r.offload[k] for k in ("to_host", "to_device", "prefetched", "bytes_moved")}}
            row["host_accum"] = {mode: {"vs_sync": global_rel(grads[f"{mode}-host"][0], grads["sync"][0], dims),
                                        **{k: grads[f"{mode}-host"][1].offload[k] for k in ("flushes", "d2h_bytes",
                                                                                            "peak_host")}}
                                 for mode in ("stream-trajectory", "stream-group")}
        out.append(row)
    return out + run_f64_minibatches(dims)


MB_CASES = [  # several optimizer steps per batch (§5): weights after the whole step, stream vs sync
    dict(estimator="grpo", reward="binary", M=2, E=2, loss={"policy": PolicyLossConfig()}),  # π_θ0 from the trainer
    dict(estimator="dr_grpo", reward="continuous", M=3, E=1,
         loss={"policy": PolicyLossConfig(dual_clip=3.0), "aggregation": "seq-mean-token-mean"}),
]


def run_f64_minibatches(dims):
    out = []
    for ci, case in enumerate(MB_CASES):
        weights = {}
        for mode, order_seed in (("sync", None), ("stream-trajectory", 31 + ci), ("stream-group", 41 + ci)):
            model = build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0)
            ddp = wrap_ddp(model)
            opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.05, clip_grad=0))
            cfg = LearnerConfig(mode=mode, estimator=case["estimator"], loss=LossConfig(**case["loss"]),
                                reward_spec=spec_for(case["reward"]), num_minibatches=case["M"], epochs=case["E"])
            L = Learner(ddp, opt, cfg, dp_rank=dims.dp_rank, pp_size=dims.pp)
            theta0 = params_flat(ddp)
            S = make_samples(300 + ci, num_groups=4, reward_kind=case["reward"])
            order = S if order_seed is None else arrival_order(S, order_seed)
            assign_dp(order, dims.dp)
            sizes, shape = shape_for(S)
            L.train_step(ListSource(order), sizes, shape)
            weights[mode] = params_flat(ddp)
        moved = weights["sync"] - theta0
        row = {"case": f"minibatches M={case['M']} E={case['E']}", "estimator": case["estimator"],
               "reward": case["reward"], "theta0_forwards": L.theta0.forwards}
        for mode in ("stream-trajectory", "stream-group"):
            t = torch.tensor([float((weights[mode] - weights["sync"]).pow(2).sum()), float(moved.pow(2).sum())],
                             dtype=torch.float64)
            dist.all_reduce(t, group=dims.model_parallel_group())
            row[mode] = (t[0].sqrt() / t[1].sqrt()).item()
        out.append(row)
    return out


def run_packed(dims):
    """float64: sync / stream-trajectory / stream-group with packing vs sync without, on this layout. Arrivals come
    four per poll so that streaming has several ready items to pack."""
    out = []
    for ci, case in enumerate(PACKED_CASES):
        grads = {}
        runs = (("sync-unpacked", "sync", None, None), ("sync", "sync", None, PACK_TOKENS),
                ("stream-trajectory", "stream-trajectory", 31 + ci, PACK_TOKENS),
                ("stream-group", "stream-group", 43 + ci, PACK_TOKENS),
                ("stream-trajectory-mixed", "stream-trajectory", 31 + ci, PACK_TOKENS),
                ("stream-trajectory-mixed-full", "stream-trajectory", 31 + ci, PACK_TOKENS))
        for name, mode, order_seed, packing in runs:
            ddp, L = make_learner(dims, torch.float64, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0), mode, case,
                                  packing=packing, mix="mixed" in name, full=name.endswith("full"))
            S = make_samples(300 + ci, num_groups=4, reward_kind=case["reward"], with_ref=True)
            order = S if order_seed is None else arrival_order(S, order_seed)
            assign_dp(order, dims.dp, by_group=ci % 2 == 1)  # odd cases: a group's members on one rank
            got = {}
            L.grad_hook = lambda d: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
            sizes, shape = shape_for(S)
            res = L.train_step(ListSource(order, batch=4), sizes, shape)
            grads[name] = (got["g"], res)
        row = {"case": ci, "estimator": case["estimator"], "reward": case["reward"],
               "microbatches": {k: v[1].microbatches for k, v in grads.items()},
               "stats": grads["stream-trajectory"][1].planner_stats,
               "waited_for_full": grads["stream-trajectory-mixed-full"][1].planner_stats["waited_for_full_microbatch"]}
        for name in ("sync", "stream-trajectory", "stream-group", "stream-trajectory-mixed",
                     "stream-trajectory-mixed-full"):
            row[name] = global_rel(grads[name][0], grads["sync-unpacked"][0], dims)
        out.append(row)
    return out


SHARED_CASES = [
    dict(estimator="grpo", reward="binary", loss={}),
    dict(estimator="rloo", reward="binary", loss={"aggregation": "seq-mean-token-sum", "old_logprobs": "engine"}),
]


def run_shared(dims):
    """float64: --shared-prefix and --skip-zero-advantage (sync, stream-trajectory, stream-group) vs sync with neither,
    on groups that share a prompt (one of them all-equal); arrivals four per poll."""
    out = []
    for ci, case in enumerate(SHARED_CASES):
        grads = {}
        runs = (("sync-plain", "sync", None, False), ("sync", "sync", None, True),
                ("stream-trajectory", "stream-trajectory", 51 + ci, True), ("stream-group", "stream-group", 61 + ci, True))
        for name, mode, order_seed, on in runs:
            ddp = wrap_ddp(build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0))
            opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))
            cfg = LearnerConfig(mode=mode, estimator=case["estimator"], loss=LossConfig(**case["loss"]),
                                reward_spec=spec_for(case["reward"]), shared_prefix=on, skip_zero_advantage=on)
            L = Learner(ddp, opt, cfg, dp_rank=dims.dp_rank, pp_size=dims.pp)
            S = prompt_groups(400 + ci)
            order = S if order_seed is None else arrival_order(S, order_seed)
            for s in S:  # whole groups per rank, so a rank has members to share a prompt between
                s.dp_rank = int(s.group_id[1:]) % dims.dp
            got = {}
            L.grad_hook = lambda d: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
            sizes, shape = shape_for(S)
            res = L.train_step(ListSource(order, batch=4), sizes, shape)
            grads[name] = (got["g"], res)
        row = {"case": ci, "estimator": case["estimator"],
               "stats": {k: v[1].planner_stats for k, v in grads.items()}}
        for name in ("sync", "stream-trajectory", "stream-group"):
            row[name] = global_rel(grads[name][0], grads["sync-plain"][0], dims)
        out.append(row)
    return out


def run_f32(dims, steps=3, seed=0, optimizer="adam"):
    """Δ_k of each float32 mode against float32 sync, next to the permutation control; and every float32 run's
    distance to the float64 sync run from the same θ0 (the exact update), which separates streaming's rounding
    from real error: a reordering control leaves each microbatch's backward bit-identical, streaming does not
    (it backprops h_i and scales by A_i later)."""
    case = dict(estimator="grpo", reward="bounded", loss={})
    thetas = {}
    theta0 = None
    init = None
    runs = (("sync64", "sync", None, torch.float64), ("sync", "sync", None, torch.float32),
            ("sync-permuted", "sync", 5, torch.float32), ("stream-trajectory", "stream-trajectory", None, torch.float32),
            ("stream-group", "stream-group", None, torch.float32))
    for name, mode, perm, dtype in runs:
        lr = 1e-3 if optimizer == "adam" else 0.5
        oc = OptimConfig(optimizer=optimizer, lr=lr, sgd_momentum=0.9, clip_grad=0.0)
        if dtype == torch.float64:  # same θ0 as the float32 runs: build in float32, copy up
            ddp32, _ = make_learner(dims, torch.float32, oc, mode, case)
            init = [p.detach().clone() for p in ddp32.parameters()]
            del ddp32
        ddp, L = make_learner(dims, dtype, oc, mode, case)
        with torch.no_grad():
            for p, q in zip(ddp.parameters(), init):
                p.copy_(q.to(p.dtype))
        if theta0 is None:
            theta0 = params_flat(ddp)
        for k in range(steps):
            S = make_samples(500 + 10 * seed + k, reward_kind="bounded", num_groups=4)
            order = S if mode == "sync" else arrival_order(S, 77 + 10 * seed + k)
            if perm is not None:
                order = arrival_order(S, perm + 10 * seed + k)
                L.sync_order = [s.traj_id for s in order]
            assign_dp(order, dims.dp)
            sizes, shape = shape_for(S)
            L.train_step(ListSource(order), sizes, shape)
        thetas[name] = params_flat(ddp)

    def delta(x, ref):
        t = torch.tensor([float((x - ref).pow(2).sum()), float((ref - theta0).pow(2).sum())], dtype=torch.float64)
        dist.all_reduce(t, group=dims.model_parallel_group())
        return (t[0].sqrt() / t[1].sqrt()).item()

    f32 = ("sync", "sync-permuted", "stream-trajectory", "stream-group")
    return {"delta_k": {m: delta(thetas[m], thetas["sync"]) for m in ("stream-trajectory", "stream-group")},
            "delta_k_permutation_control": delta(thetas["sync-permuted"], thetas["sync"]),
            "error_vs_float64": {m: delta(thetas[m], thetas["sync64"]) for m in f32}, "steps": steps,
            "optimizer": optimizer}


RECOMPUTE = {"full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             "full-block-1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
             "selective": dict(recompute_granularity="selective")}


def run_recompute(dims):
    """float64: sync without recomputation vs sync / stream-trajectory / packed stream-trajectory with each setting
    (``--recompute-num-layers 1``: one layer per stage under PP 2)."""
    case = PACKED_CASES[0]
    oc = OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0)
    S = make_samples(500, reward_kind=case["reward"])
    out = {}
    for name, rc in [("off", None), *RECOMPUTE.items()]:
        for mode, packing, order in (("sync", None, S), ("stream-trajectory", None, arrival_order(S, 7)),
                                     ("stream-trajectory", PACK_TOKENS, arrival_order(S, 9))):
            if name == "off" and mode != "sync":
                continue
            ddp, L = make_learner(dims, torch.float64, oc, mode, case, packing=packing, recompute=rc)
            assign_dp(order, dims.dp)
            got = {}
            L.grad_hook = lambda d: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
            sizes, shape = shape_for(S)
            L.train_step(ListSource(order), sizes, shape)
            out[f"{name}/{mode}{'/packed' if packing else ''}"] = got["g"]
    ref = out.pop("off/sync")
    return {k: global_rel(g, ref, dims) for k, g in out.items()}


LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}  # (tp, pp) of 2 processes; dp = 2 / (tp × pp)
CHECKS = {
    "f64": run_f64,
    "packed": run_packed,
    "shared": run_shared,
    "recompute": run_recompute,
    "f32-sgd": lambda dims, seed: run_f32(dims, seed=seed, optimizer="sgd"),
    "f32-adam": lambda dims, seed: run_f32(dims, seed=seed, optimizer="adam"),
}


def parse_run(pairs: list[str]) -> dict[str, list[str]]:
    """["tp2:f64", "tp2:packed", "dp2:f64"] -> {"tp2": ["f64", "packed"], "dp2": ["f64"]} (first-seen order)."""
    plan: dict[str, list[str]] = {}
    for pair in pairs:
        layout, check = pair.split(":")
        if layout not in LAYOUTS or check not in CHECKS:
            raise SystemExit(f"unknown LAYOUT:CHECK {pair!r}: layouts {list(LAYOUTS)}, checks {list(CHECKS)}")
        plan.setdefault(layout, [])
        if check not in plan[layout]:
            plan[layout].append(check)
    return plan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checks", nargs="+", required=True, metavar="LAYOUT:CHECK")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    for layout, checks in parse_run(a.checks).items():
        dims = initialize_parallel(*LAYOUTS[layout])
        for check in checks:
            t0 = time.time()
            fn = CHECKS[check]
            res = fn(dims) if check in ("f64", "packed", "shared", "recompute") else fn(dims, a.seed)
            if dims.rank == 0:
                path = os.path.join(a.out_dir, f"{layout}-{check}.json")
                with open(path + ".tmp", "w") as f:
                    json.dump({"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "result": res,
                               "seconds": round(time.time() - t0, 2)}, f, indent=1)
                os.replace(path + ".tmp", path)
                print(f"{layout}:{check} {time.time() - t0:.1f}s", flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main()
