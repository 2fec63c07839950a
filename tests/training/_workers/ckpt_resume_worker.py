"""Checkpoint resume worker (run by tests/training/test_checkpointing.py, single process or under torchrun).

Modes:
  full    run steps 0 .. k+n-1 uninterrupted; write the losses of steps k .. k+n-1 and the final parameters
  first   as `full`, but save a checkpoint after step k-1 (at "step k") and SIGKILL itself at the end (no clean
          shutdown). Its steps k .. k+n-1 are the uninterrupted reference (a save must not perturb training).
  resume  build a differently initialised model, load the latest checkpoint, run steps k .. k+n-1; write as `full`

One launch serves several layouts of its processes: each ``--job`` (TP size, distributed optimizer or not) runs after
the previous one (model parallelism re-initialised, seeds reset); `first` is SIGKILLed once, after the last job.
Several checkpoints in one job (the distributed optimizer's shardings): `first` saves the same state into each (one
format per checkpoint); `resume` resumes from each in turn (a fresh model per checkpoint), one out per checkpoint.
``--integrity`` (resume only): after the resumes, the same processes run cases of ``ckpt_integrity_worker``
(damaged checkpoints / a full disk, on their own model and folder), one launch fewer for the integrity tests.

Each step draws its batch from torch's global RNG (and python/numpy random), so a resume that did not restore
the RNG states would train on different data.
"""

import argparse
import json
import os
import random
import signal
import sys

import numpy as np
import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["full", "first", "resume"], required=True)
    p.add_argument("--hf", required=True)
    p.add_argument("--save-step", dest="k", type=int, default=3)
    p.add_argument("--extra-steps", dest="n", type=int, default=3)
    p.add_argument("--job", action="append", default=[], type=json.loads, metavar="JSON",
                   help='one layout of this launch\'s processes: {"tp": 1, "dist_opt": false, "ckpt": [...], '
                        '"sharding": [...], "out": [...]}; jobs run one after the other (first: then one SIGKILL)')
    p.add_argument("--integrity", action="append", default=[], metavar="JSON",
                   help="resume only, after the jobs: ckpt_integrity_worker cases run in this launch's processes, "
                        '{"case": "damage"|"enospc", "inject": bool, "tp": 1, "hf", "root", "out"}')
    a = p.parse_args()

    from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel

    for job in a.job:
        job = argparse.Namespace(k=a.k, n=a.n, mode=a.mode, tp=job.get("tp", 1), dist_opt=job.get("dist_opt", False),
                                 ckpt=job["ckpt"], out=job.get("out"), optim_sharding=job.get("sharding")
                                 or ["dp_reshardable"] * len(job["ckpt"]), hf=a.hf)
        dims = initialize_parallel(job.tp, 1, seed=1234)
        if job.mode == "resume":  # one differently initialised model per checkpoint, one after the other
            assert job.out and len(job.out) == len(job.ckpt), (job.out, job.ckpt)
            for ckpt, out in zip(job.ckpt, job.out):
                run(job, dims, load=ckpt, out=out)
        else:
            assert job.mode == "full" or len(job.optim_sharding) == len(job.ckpt), (job.optim_sharding, job.ckpt)
            run(job, dims, save=list(zip(job.ckpt, job.optim_sharding)), out=job.out[0] if job.out else None)
    if a.mode == "first":
        torch.distributed.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    if a.integrity:
        assert a.mode == "resume", "integrity cases run in the resume launch (which ends cleanly)"
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import ckpt_integrity_worker as CI

        for spec in map(json.loads, a.integrity):
            CI.run_case(argparse.Namespace(**{"inject": False, "tp": 1, **spec}))
    destroy_parallel()


def run(a, dims, *, load=None, save=(), out=None):
    from megatron_tsync.training import checkpointing as ck
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.model.logprobs import token_logprobs
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, finalize_and_scale, wrap_ddp

    arch, state = load_hf_dir(a.hf)
    model = build_model(arch, seed=7 if a.mode == "resume" else 1234)
    if a.mode != "resume":
        load_hf_into_model(model, state)
    ddp = wrap_ddp(model, use_distributed_optimizer=a.dist_opt)
    opt = build_optimizer(ddp, OptimConfig(optimizer="adam", lr=1e-3, clip_grad=1.0, weight_decay=0.01,
                                           use_distributed_optimizer=a.dist_opt))
    start = 0
    torch.manual_seed(100 + dims.dp_rank)  # per-DP-rank data stream
    random.seed(5)
    np.random.seed(6)
    if a.mode == "resume":
        step, ts = ck.load_checkpoint(load, ddp, opt)
        assert step == a.k and ts == {"data_position": a.k, "note": "hi"}, (step, ts)
        start = step
    losses = []
    for s in range(start, a.k + a.n):
        if a.mode == "first" and s == a.k:
            for ckpt, sharding in save:  # several shardings: the same state saved once per format
                ck.save_checkpoint(ckpt, a.k, ddp, opt, {"data_position": a.k, "note": "hi"}, optim_sharding=sharding)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        length = 8 + random.randint(0, 4) + int(np.random.randint(0, 4))
        ids = torch.randint(0, arch.vocab_size, (2, length))  # (B, S)
        lp = token_logprobs(ddp, ids)  # (B, S-1)
        loss = -lp.mean()
        loss.backward()
        finalize_and_scale(ddp, float(dims.dp))
        opt.step()
        losses.append(loss.detach().clone())
    result = {"losses": losses[-a.n:], "params": {k: v.detach().clone() for k, v in model.named_parameters()}}
    torch.save(result, f"{out}.rank{dims.rank}")


if __name__ == "__main__":
    main()
