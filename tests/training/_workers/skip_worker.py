"""DP = 2 (torchrun, gloo): the barrier's skip verdict is common to every rank (``training.barrier``).

Cases, each on a fresh float64 model with a random backward per rank: ``clean`` (control: both update), ``loss``
(rank 1 alone reports a non-finite loss, its gradient finite), ``grad`` (rank 1 alone has a NaN in its local gradient
before the DP reduction). Rank 0 writes {case: [per rank {"skipped", "moved", "finite"}]} to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from stream_cases import TINY  # noqa: E402

from megatron_tsync.model.builder import PrecisionConfig, build_model  # noqa: E402
from megatron_tsync.training.barrier import barrier_step  # noqa: E402
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp  # noqa: E402


def case(name: str, rank: int) -> dict:
    ddp = wrap_ddp(build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0))
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.1, clip_grad=0))
    before = torch.cat([p.detach().reshape(-1).clone() for p in ddp.parameters()])
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, TINY.vocab_size, (1, 10), generator=g)
    logits = ddp(ids, torch.arange(10).unsqueeze(0), None)  # (1, 10, V)
    ddp.zero_grad_buffer()
    (logits * torch.randn(logits.shape, generator=g, dtype=logits.dtype)).sum().backward()
    if name == "grad" and rank == 1:
        next(iter(ddp.parameters())).main_grad.view(-1)[0] = float("nan")
    res = barrier_step(ddp, opt, 2.0, loss_finite=not (name == "loss" and rank == 1))
    after = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    return {"skipped": res.skipped, "moved": not torch.equal(after, before), "finite": bool(torch.isfinite(after).all())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel

    torch.set_num_threads(1)
    dims = initialize_parallel(1, 1)
    report = {}
    for name in ("clean", "loss", "grad"):
        rows = [None] * dims.world_size
        dist.all_gather_object(rows, case(name, dims.rank))
        report[name] = rows
    if dims.rank == 0:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    destroy_parallel()


if __name__ == "__main__":
    main()
