"""--deterministic under TP=2 / PP=2 / DP=2 (run by torchrun from tests/training/test_deterministic_parallel.py).

For each layout (the same 2 gloo processes, model parallelism re-initialised between layouts) and each case: float32
weights after 2 Adam steps for sync (two orders), stream-trajectory (three orders) and stream-group, with and
without --deterministic; DP ranks from ``DataParallelAssigner`` (by group with --deterministic, by arrival order
without, as the live sources do). Rank 0 writes ``--out``: {layout: {case: {"det": {run: equal}, "default": {...}}}},
"equal" meaning torch.equal to the first sync run on every rank's shard (all-reduced).

``python -m torch.distributed.run --nproc_per_node=2 deterministic_worker.py --out R.json --layouts tp2 dp2``
(``--layouts tp2:grpo-bounded,engine-dual-clip-kl``: some cases of a layout)
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
from stream_cases import TINY, arrival_order, make_samples, spec_for  # noqa: E402

from megatron_tsync.algorithms.policy_loss import PolicyLossConfig  # noqa: E402
from megatron_tsync.model.builder import PrecisionConfig, build_model  # noqa: E402
from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel  # noqa: E402
from megatron_tsync.streaming.ready_queue import DataParallelAssigner, ListSource  # noqa: E402
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for  # noqa: E402
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp  # noqa: E402
from megatron_tsync.training.stream_fb import LossConfig  # noqa: E402

CASES = {
    "grpo-bounded": dict(estimator="grpo", reward="bounded", loss={}),
    "engine-dual-clip-kl": dict(estimator="grpo", reward="bounded",
                                loss={"old_logprobs": "engine", "policy": PolicyLossConfig(dual_clip=3.0),
                                      "kl_mode": "loss", "kl_coef": 0.1}),
    "dr_grpo-minibatches": dict(estimator="dr_grpo", reward="continuous", M=2, E=2, loss={}),
}
RUNS = [("sync", None), ("sync", 7), ("stream-trajectory", 1), ("stream-trajectory", 2), ("stream-trajectory", 3),
        ("stream-group", 4)]
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}


def weights(dims, case, mode, seed, det, steps=2):
    ddp = wrap_ddp(build_model(TINY, PrecisionConfig(), seed=0))
    opt = build_optimizer(ddp, OptimConfig(optimizer="adam", lr=1e-3, clip_grad=0))
    cfg = LearnerConfig(mode=mode, estimator=case["estimator"], reward_spec=spec_for(case["reward"]),
                        loss=LossConfig(**case["loss"]), num_minibatches=case.get("M", 1), epochs=case.get("E", 1),
                        deterministic=det)
    learner = Learner(ddp, opt, cfg, dp_rank=dims.dp_rank, pp_size=dims.pp)
    for k in range(steps):
        samples = make_samples(60 + k, num_groups=3, reward_kind=case["reward"], with_ref=True)
        order = samples if seed is None else arrival_order(samples, 100 * seed + k)
        sizes, shape = shape_for(samples)
        DataParallelAssigner(dims.dp, list(sizes) if det else None).assign_samples(order)
        learner.train_step(ListSource(order), sizes, shape)
    return torch.cat([p.detach().reshape(-1).clone() for p in ddp.parameters()])


def all_true(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def run_layout(dims, cases):
    out = {}
    for name in cases:
        case = CASES[name]
        row = {}
        for det in (True, False):
            ref = weights(dims, case, *RUNS[0], det)
            row["det" if det else "default"] = {f"{m}:{s}": all_true(torch.equal(weights(dims, case, m, s, det), ref))
                                                for m, s in RUNS[1:]}
        out[name] = row
    torch.use_deterministic_algorithms(False)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", nargs="+", default=["tp2", "dp2"],
                    help="LAYOUT (every case) or LAYOUT:CASE,CASE (those cases); the report's keys are these words")
    a = ap.parse_args()
    report = {}
    for part in a.layouts:
        layout, _, cases = part.partition(":")
        cases = cases.split(",") if cases else list(CASES)
        assert layout in LAYOUTS and set(cases) <= set(CASES), part
        t0 = time.time()
        dims = initialize_parallel(*LAYOUTS[layout])
        report[part] = {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "cases": run_layout(dims, cases),
                        "seconds": round(time.time() - t0, 1)}
        if dims.rank == 0:
            print(part, report[part]["seconds"], "s", flush=True)
    if dist.get_rank() == 0:
        with open(a.out + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(a.out + ".tmp", a.out)
    destroy_parallel()


if __name__ == "__main__":
    main()
