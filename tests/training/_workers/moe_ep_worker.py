"""Qwen3-MoE training at expert parallelism through the streaming learner (run by tests/training/test_moe_ep.py).

``--layout single`` (1 process), ``ep2`` (2 processes: TP 1, PP 1, DP 2, EP 2 — each rank holds half the experts;
every MoE layer's token all-to-all spans both ranks, which train different trajectories: the learner keeps them in
lockstep with idle microbatches, ``model.parallel.ExpertLockstep``) or ``tp2`` (2 processes: TP 2 with sequence
parallelism, which megatron's MoE layer needs at TP > 1; trajectories padded to even lengths by the model).

For each case, float64, the same HF weights (router × 25: decisive routing) and the same rollouts: the gradient after
the barrier in sync, stream-trajectory (two arrival orders) and stream-group, under HF names (experts gathered over
EP), and the weights after one Adam step per mode (float32). Rank 0 writes ``--out`` (torch.save):
{"grads": {case: {mode: {hf name: tensor}}}, "weights": {mode: {...}}, "idle": {case: idle microbatches}}.
"""

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from stream_cases import arrival_order, make_samples, spec_for  # noqa: E402

from megatron_tsync.algorithms.policy_loss import PolicyLossConfig  # noqa: E402
from megatron_tsync.model.builder import PrecisionConfig, build_model  # noqa: E402
from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model, megatron_to_hf  # noqa: E402
from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel  # noqa: E402
from megatron_tsync.runtime.rollout_io import grads_to_hf  # noqa: E402
from megatron_tsync.streaming.ready_queue import ListSource  # noqa: E402
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for  # noqa: E402
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp  # noqa: E402
from megatron_tsync.training.stream_fb import LossConfig  # noqa: E402

CASES = {
    "grpo-bounded-trainer": dict(estimator="grpo", reward="bounded", loss={}),
    "rloo-binary-engine": dict(estimator="rloo", reward="binary",
                               loss={"old_logprobs": "engine", "policy": PolicyLossConfig(dual_clip=3.0)}),
    "dr_grpo-continuous-M2E2": dict(estimator="dr_grpo", reward="continuous", loss={}, M=2, E=2),
}
LAYOUTS = {"single": (1, 1), "ep2": (1, 2), "tp2": (2, 1)}  # (tp, ep)
MODES = (("sync", None), ("stream-trajectory", 1), ("stream-trajectory-b", 2), ("stream-group", 3))


def build(model_dir, dtype, dims, oc):
    arch, hf = load_hf_dir(model_dir)
    model = build_model(arch, PrecisionConfig(params_dtype=dtype), seed=0)
    load_hf_into_model(model, {k: v.to(dtype) for k, v in hf.items()})
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.mlp.router.weight.mul_(25.0)
    ddp = wrap_ddp(model)
    return arch, ddp, build_optimizer(ddp, oc)


def run_case(model_dir, dims, case, mode, order_seed, dtype=torch.float64, oc=None):
    oc = oc or OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0)
    arch, ddp, opt = build(model_dir, dtype, dims, oc)
    cfg = LearnerConfig(mode=mode.removesuffix("-b"), estimator=case["estimator"], loss=LossConfig(**case["loss"]),
                        reward_spec=spec_for(case["reward"]), num_minibatches=case.get("M", 1),
                        epochs=case.get("E", 1))
    learner = Learner(ddp, opt, cfg, dp_rank=dims.dp_rank, pp_size=dims.pp)
    samples = make_samples(41, num_groups=3, reward_kind=case["reward"], vocab=arch.vocab_size)  # 3-5 per group
    order = samples if order_seed is None else arrival_order(samples, order_seed)
    for i, s in enumerate(order):
        s.dp_rank = i % dims.dp  # as DataParallelAssigner: arrival order
    got = {}
    learner.grad_hook = lambda d: got.setdefault("g", grads_to_hf(d))
    sizes, shape = shape_for(samples)
    learner.train_step(ListSource(order), sizes, shape)
    idle = learner.exec.lockstep.idle + learner.theta0.lockstep.idle
    return got["g"], megatron_to_hf(ddp), idle


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", choices=list(LAYOUTS), required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    tp, ep = LAYOUTS[a.layout]
    dims = initialize_parallel(tp, 1, ep=ep)
    out = {"grads": {}, "weights": {}, "idle": {}}
    for name, case in CASES.items():
        out["grads"][name], out["idle"][name] = {}, 0
        for mode, seed in MODES:
            g, _, idle = run_case(a.model, dims, case, mode, seed)
            out["grads"][name][mode] = g
            out["idle"][name] += idle
    adam = OptimConfig(optimizer="adam", lr=1e-3, clip_grad=1.0)
    for mode, seed in MODES:  # float32, one Adam step on the first case
        _, w, _ = run_case(a.model, dims, CASES["grpo-bounded-trainer"], mode, seed, torch.float32, adam)
        out["weights"][mode] = w
    if dims.rank == 0:
        torch.save(out, a.out)
    destroy_parallel()


if __name__ == "__main__":
    main()
