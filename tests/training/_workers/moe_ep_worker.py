"""Qwen3-MoE training at expert parallelism through the streaming learner (run by tests/training/test_moe_ep.py).

``--layout single`` (1 process), ``ep2`` (2 processes: TP 1, PP 1, DP 2, EP 2 — each rank holds half the experts;
every MoE layer's token all-to-all spans both ranks, which train different trajectories: the learner keeps them in
lockstep with idle microbatches, ``model.parallel.ExpertLockstep``) or ``tp2`` (2 processes: TP 2 with sequence
parallelism, which megatron's MoE layer needs at TP > 1; trajectories padded to even lengths by the model).

For each case, float64, the same HF weights (router × 25: decisive routing) and the same rollouts: the gradient after
the barrier in sync, stream-trajectory (two arrival orders) and stream-group, under HF names (experts gathered over
EP), and the weights after one Adam step per mode (float32). Rank 0 writes ``--out`` (torch.save):
{"grads": {case: {mode: {hf name: tensor}}}, "weights": {mode: {...}}, "idle": {case: idle microbatches},
"deferred": {case: items the planner or the executor deferred}}.

``single`` and ``ep2`` also run ``EP_CASES``: ``--deterministic`` (groups assigned to DP ranks by group, as
``DataParallelAssigner(group_order=...)``; the clipped engine-π_old case defers items in stream-trajectory, whose
deferral the EP ranks agree on before the backward) and a KL reference model (``--ref-model``, another tiny
Qwen3-MoE: its forwards in lockstep too), loss and reward. ``by_group``: every trajectory of a group on one rank
without --deterministic (``--dp-assignment balanced``'s DataParallelAssigner), so the other rank's idle slots fill a
bucket of a group its planner never opened; ``frontier``: the streamed order is the frontier-first one (groups
landing in batch order, --rollout-frontier-first).
"""

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from stream_cases import arrival_order, frontier_order, make_samples, spec_for  # noqa: E402

from megatron_tsync.algorithms.policy_loss import PolicyLossConfig  # noqa: E402
from megatron_tsync.model.builder import PrecisionConfig, build_model  # noqa: E402
from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model, megatron_to_hf  # noqa: E402
from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel  # noqa: E402
from megatron_tsync.runtime.rollout_io import grads_to_hf  # noqa: E402
from megatron_tsync.streaming.ready_queue import DataParallelAssigner, ListSource  # noqa: E402
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for  # noqa: E402
from megatron_tsync.training.reference import ReferenceModel  # noqa: E402
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp  # noqa: E402
from megatron_tsync.training.stream_fb import LossConfig  # noqa: E402

CASES = {
    "grpo-bounded-trainer": dict(estimator="grpo", reward="bounded", loss={}),
    "rloo-binary-engine": dict(estimator="rloo", reward="binary",
                               loss={"old_logprobs": "engine", "policy": PolicyLossConfig(dual_clip=3.0)}),
    "dr_grpo-continuous-M2E2": dict(estimator="dr_grpo", reward="continuous", loss={}, M=2, E=2),
}
EP_CASES = {  # single (sync, the reference, and the modes) and ep2; "modes": which of MODES at ep2
    "det-rloo-binary-engine": dict(estimator="rloo", reward="binary", det=True, modes=(0, 1, 2),
                                   loss={"old_logprobs": "engine", "policy": PolicyLossConfig(dual_clip=3.0)}),
    "det-grpo-kl-loss": dict(estimator="grpo", reward="bounded", det=True, ref=True, modes=(1, 2),
                             loss={"kl_mode": "loss", "kl_coef": 0.1, "entropy_coef": 0.01}),
    "kl-loss-grpo-by-group": dict(estimator="grpo", reward="bounded", ref=True, modes=(1,), by_group=True,
                                  loss={"kl_mode": "loss", "kl_coef": 0.1}),
    "frontier-grpo-by-group": dict(estimator="grpo", reward="bounded", loss={}, modes=(1,), by_group=True,
                                   frontier=True),  # frontier-first rollouts' order, a group on one rank
    "kl-reward-grpo": dict(estimator="grpo", reward="bounded", ref=True, modes=(1,),
                           loss={"kl_mode": "reward", "kl_coef": 0.1}),
    "offload-grpo": dict(estimator="grpo", reward="bounded", loss={}, offload=2, modes=(1, 2)),
    "hostacc-grpo": dict(estimator="grpo", reward="bounded", loss={}, host=True, modes=(1, 2)),  # --accumulate-on-host
}
LAYOUTS = {"single": (1, 1, 1), "ep2": (1, 1, 2), "tp2": (2, 1, 1), "pp2": (1, 2, 1),  # (tp, pp, ep)
           "tp2ep2": (2, 1, 2), "pp2ep2": (1, 2, 2)}  # tp2ep2, pp2ep2: 4 processes
FOUR = ("tp2ep2", "pp2ep2")
MODES = (("sync", None), ("stream-trajectory", 1), ("stream-trajectory-b", 2), ("stream-group", 3))


def build(model_dir, dtype, dims, oc):
    arch, hf = load_hf_dir(model_dir)
    model = build_model(arch, PrecisionConfig(params_dtype=dtype), seed=0)
    load_hf_into_model(model, {k: v.to(dtype) for k, v in hf.items()})
    with torch.no_grad():
        for layer in model.decoder.layers:
            if arch.family == "qwen3_moe":  # glm4_moe_lite's tiny model routes decisively as made (sigmoid)
                layer.mlp.router.weight.mul_(25.0)
    ddp = wrap_ddp(model)
    return arch, ddp, build_optimizer(ddp, oc)


def run_case(model_dir, dims, case, mode, order_seed, dtype=torch.float64, oc=None, ref_dir=None):
    oc = oc or OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0)
    arch, ddp, opt = build(model_dir, dtype, dims, oc)
    det = case.get("det", False)
    cfg = LearnerConfig(mode=mode.removesuffix("-b"), estimator=case["estimator"], loss=LossConfig(**case["loss"]),
                        reward_spec=spec_for(case["reward"]), num_minibatches=case.get("M", 1),
                        epochs=case.get("E", 1), deterministic=det, max_device_buckets=case.get("offload"),
                        accumulate_on_host=case.get("host", False))
    ref = ReferenceModel.from_hf_dir(ref_dir, PrecisionConfig(params_dtype=dtype), policy=ddp) \
        if case.get("ref") else None
    learner = Learner(ddp, opt, cfg, dp_rank=dims.dp_rank, pp_size=dims.pp, reference=ref)
    samples = make_samples(41, num_groups=3, reward_kind=case["reward"], vocab=arch.vocab_size)  # 3-5 per group
    order = samples if order_seed is None else arrival_order(samples, order_seed)
    if case.get("frontier") and order_seed is not None:  # frontier-first rollouts: groups land in batch order
        order = frontier_order(samples, order_seed)
    if case.get("by_group"):  # --dp-assignment balanced: a group on one rank
        DataParallelAssigner(dims.dp, balanced=True).assign_samples(order)
    for i, s in enumerate(order):  # as DataParallelAssigner: arrival order, or by group (--deterministic)
        if not case.get("by_group"):
            s.dp_rank = int(s.group_id[1:]) % dims.dp if det else i % dims.dp
        if ref is not None:
            s.ref_logp = None  # scored by the reference model
    got = {}
    learner.grad_hook = lambda d: got.setdefault("g", grads_to_hf(d))
    sizes, shape = shape_for(samples)
    res = learner.train_step(ListSource(order), sizes, shape)
    idle = learner.exec.lockstep.idle + learner.theta0.lockstep.idle + (ref.lockstep.idle if ref else 0)
    return (got["g"], megatron_to_hf(ddp), idle, res.planner_stats.get("deferred", 0),
            {**(res.offload or {}), "direct": res.planner_stats.get("direct", 0)})  # direct: the direct path's items


def run_layout(a, layout, dims=None):
    """{"grads", "weights", "idle", "deferred", "to_host"} of ``layout`` (initialized here unless ``dims`` is given:
    the test runs ``single`` in its own process, on its megatron_single)."""
    if dims is None:
        tp, pp, ep = LAYOUTS[layout]
        dims = initialize_parallel(tp, pp, ep=ep)
    out = {"grads": {}, "weights": {}, "idle": {}, "deferred": {}, "to_host": {}, "flushes": {}, "direct": {}}
    # the second arrival order matters where ranks interleave (EP); TP = 2 and PP = 2 run one streamed order; one
    # process: sync, the layouts' reference (its streamed modes of EP_CASES below are checked in one process)
    cases = {k: dict(c, modes=(0,) if layout == "single" else range(len(MODES)) if layout == "ep2" else (0, 1, 3))
             for k, c in CASES.items()}
    if layout in FOUR:  # 4 processes on CI's 2 cores: one case, sync and one streamed order
        cases = {"grpo-bounded-trainer": dict(CASES["grpo-bounded-trainer"], modes=(0, 1))}
    if layout not in FOUR:
        cases.update({k: dict(c, modes=sorted({0, *c["modes"]})) if layout == "single" else c
                      for k, c in EP_CASES.items()})
    for name, case in cases.items():
        if a.only is not None and name not in a.only:
            continue
        out["grads"][name], out["idle"][name] = {}, 0
        for mode, seed in (MODES[i] for i in case["modes"]):
            g, _, idle, deferred, off = run_case(a.model, dims, case, mode, seed, ref_dir=a.ref_model)
            out["grads"][name][mode] = g
            out["idle"][name] += idle
            out["deferred"][name] = out["deferred"].get(name, 0) + deferred
            out["to_host"][name] = out["to_host"].get(name, 0) + off.get("to_host", 0)
            out["flushes"][name] = out["flushes"].get(name, 0) + off.get("flushes", 0)
            if mode.startswith("stream-trajectory"):
                out["direct"][name] = out["direct"].get(name, 0) + off["direct"]
    adam = OptimConfig(optimizer="adam", lr=1e-3, clip_grad=1.0)
    adam_layouts = ("single", "ep2", "tp2")  # float32, one Adam step on the first case
    for mode, seed in MODES if a.only is None and layout in adam_layouts else ():
        _, w, _, _, _ = run_case(a.model, dims, CASES["grpo-bounded-trainer"], mode, seed, torch.float32, adam)
        out["weights"][mode] = w
    return dims, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", nargs="+", choices=list(LAYOUTS), required=True,
                    help="one or more layouts of the same process count, one after the other on these processes")
    ap.add_argument("--out", required=True, help="the result (torch.save); {layout: result} for several layouts")
    ap.add_argument("--ref-model", help="the KL reference of EP_CASES (single and ep2)")
    ap.add_argument("--only", nargs="*", help="run only these cases (debugging)")
    a = ap.parse_args()
    everything = {}
    for layout in a.layout:
        dims, everything[layout] = run_layout(a, layout)
    if dims.rank == 0:
        torch.save(everything if len(a.layout) > 1 else everything[a.layout[0]], a.out)
    destroy_parallel()


if __name__ == "__main__":
    main()
