"""Checkpoint resume worker (run by tests/training/test_checkpointing.py, single process or under torchrun).

Modes:
  full    run steps 0 .. k+n-1 uninterrupted; write the losses of steps k .. k+n-1 and the final parameters
  first   as `full`, but save a checkpoint after step k-1 (at "step k") and SIGKILL itself at the end (no clean
          shutdown). Its steps k .. k+n-1 are the uninterrupted reference (a save must not perturb training).
  resume  build a differently initialised model, load the latest checkpoint, run steps k .. k+n-1; write as `full`

Several --ckpt at once (the distributed optimizer's shardings): `first` saves the same state into each (one format
per checkpoint) and is SIGKILLed once; `resume` resumes from each in turn (a fresh model per checkpoint), one
--out per checkpoint.

Each step draws its batch from torch's global RNG (and python/numpy random), so a resume that did not restore
the RNG states would train on different data.
"""

import argparse
import os
import random
import signal

import numpy as np
import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["full", "first", "resume"], required=True)
    p.add_argument("--hf", required=True)
    p.add_argument("--ckpt", nargs="+", required=True,
                   help="first: save into each (one per --optim-sharding); resume: resume from each in turn")
    p.add_argument("--out", nargs="+", default=None, help="output prefix (resume: one per --ckpt)")
    p.add_argument("--save-step", dest="k", type=int, default=3)
    p.add_argument("--extra-steps", dest="n", type=int, default=3)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dist-opt", action="store_true")
    p.add_argument("--optim-sharding", nargs="+", default=["dp_reshardable"])
    a = p.parse_args()

    from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel

    dims = initialize_parallel(a.tp, 1, seed=1234)
    if a.mode == "resume":  # one differently initialised model per checkpoint, one after the other
        assert a.out and len(a.out) == len(a.ckpt), (a.out, a.ckpt)
        for ckpt, out in zip(a.ckpt, a.out):
            run(a, dims, load=ckpt, out=out)
    else:
        assert a.mode == "full" or len(a.optim_sharding) == len(a.ckpt), (a.optim_sharding, a.ckpt)
        run(a, dims, save=list(zip(a.ckpt, a.optim_sharding)), out=a.out[0] if a.out else None)
    if a.mode == "first":
        torch.distributed.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
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
