"""KL to a live reference model under TP=2, PP=2 and DP=2 (run by torchrun from tests/training/test_reference_kl.py).

Per layout (one after the other in the same 2 processes): the policy (``--policy-dir``, float64) and the reference
(``--ref-dir``, a Hugging Face folder, built with the same layout through ``ReferenceModel.from_hf_dir``); for each
KL case, sync / stream-trajectory / stream-group gradients; streamed vs sync relative error over all shards, and
the sync gradient under Hugging Face names (``grads_to_hf``, collective) saved by rank 0 as
``--out-dir``/LAYOUT-CASE.safetensors, which the test compares with the one-process gradient. JSON report per
layout: ``LAYOUT.json`` = {"tp", "pp", "dp", "result": [{"case", "stream-trajectory", "stream-group", "stats",
"ref_forwards"}], "seconds"}.
"""

import argparse
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from stream_cases import arrival_order, make_samples, spec_for  # noqa: E402

from megatron_tsync.model.builder import PrecisionConfig, build_model  # noqa: E402
from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel  # noqa: E402
from megatron_tsync.runtime.rollout_io import grads_to_hf  # noqa: E402
from megatron_tsync.streaming.ready_queue import ListSource  # noqa: E402
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for  # noqa: E402
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp  # noqa: E402
from megatron_tsync.training.reference import ReferenceModel  # noqa: E402
from megatron_tsync.training.stream_fb import LossConfig  # noqa: E402

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}
F64 = PrecisionConfig(params_dtype=torch.float64)
CASES = {  # name -> (LossConfig kwargs, aux strategy); the test computes the same cases in one process
    "loss-k3": (dict(kl_mode="loss", kl_coef=0.1, kl_kind="k3"), "second-backward"),
    "loss-k1-defer": (dict(kl_mode="loss", kl_coef=0.1, kl_kind="k1"), "defer"),
    "reward-k3": (dict(kl_mode="reward", kl_coef=0.05, kl_kind="k3"), "second-backward"),
}
SEED = 61  # make_samples seed of every case


def learner_cfg(mode: str, name: str) -> LearnerConfig:
    loss, aux = CASES[name]
    return LearnerConfig(mode=mode, estimator="grpo", reward_spec=spec_for("binary"), aux_strategy=aux,
                         loss=LossConfig(**loss))


def load_policy(path: str):
    """This rank's float64 policy stage from a Hugging Face folder (the builder/conversion path)."""
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model

    arch, state = load_hf_dir(path)
    model = build_model(arch, F64, seed=0)
    load_hf_into_model(model, state)
    return model


def global_rel(a, b, dims):
    t = torch.tensor([float((a - b).double().pow(2).sum()), float(b.double().pow(2).sum())], dtype=torch.float64)
    dist.all_reduce(t, group=dims.model_parallel_group())
    return (t[0].sqrt() / t[1].sqrt()).item()


def run_layout(dims, ref_dir: str, policy_dir: str, out_dir: str, layout: str) -> list[dict]:
    from safetensors.torch import save_file

    ddp = wrap_ddp(load_policy(policy_dir))
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))
    ref = ReferenceModel.from_hf_dir(ref_dir, F64, policy=ddp)
    out = []
    for name in CASES:
        grads, hf = {}, None
        for mode, order_seed in (("sync", None), ("stream-trajectory", 5), ("stream-group", 6)):
            learner = Learner(ddp, opt, learner_cfg(mode, name), dp_rank=dims.dp_rank, pp_size=dims.pp,
                              reference=ref)
            S = make_samples(SEED, reward_kind="binary")
            order = S if order_seed is None else arrival_order(S, order_seed)
            for i, s in enumerate(order):
                s.dp_rank = i % dims.dp
            got = {}

            def hook(d, got=got, mode=mode):
                got["g"] = torch.cat([b.grad_data.clone() for b in d.buffers])
                if mode == "sync":
                    got["hf"] = grads_to_hf(d)

            learner.grad_hook = hook
            sizes, shape = shape_for(S)
            res = learner.train_step(ListSource(order), sizes, shape)
            grads[mode] = (got["g"], res)
            hf = got.get("hf", hf)
        if dims.rank == 0:
            save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(out_dir, f"{layout}-{name}.safetensors"))
        out.append({"case": name, "stats": grads["stream-trajectory"][1].planner_stats,
                    "ref_forwards": ref.forwards,
                    **{m: global_rel(grads[m][0], grads["sync"][0], dims) for m in ("stream-trajectory",
                                                                                      "stream-group")}})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", nargs="+", required=True, choices=sorted(LAYOUTS))
    ap.add_argument("--ref-dir", required=True)
    ap.add_argument("--policy-dir", required=True)
    ap.add_argument("--out-dir", required=True)
    a = ap.parse_args()
    for layout in a.layouts:
        t0 = time.time()
        dims = initialize_parallel(*LAYOUTS[layout])
        res = run_layout(dims, a.ref_dir, a.policy_dir, a.out_dir, layout)
        if dims.rank == 0:
            path = os.path.join(a.out_dir, f"{layout}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "result": res,
                           "seconds": round(time.time() - t0, 2)}, f, indent=1)
            os.replace(path + ".tmp", path)
    destroy_parallel()


if __name__ == "__main__":
    main()
