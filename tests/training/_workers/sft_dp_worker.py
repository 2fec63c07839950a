"""DP=2 supervised warm start with and without the distributed optimizer (run by tests/training/test_sft.py).

Three runs in one launch, each from the same θ0: ``plain`` (DDP all-reduce, plain Adam), ``distributed`` (DDP
reduce-scatter, ``build_sft_optimizer`` picks the distributed optimizer), ``control`` (DDP reduce-scatter, a plain
Adam forced: each replica steps on gradients reduced only in its own shard). Rank 1 writes, per run, the largest
difference between the replicas' weights and the weights themselves; ``--out`` JSON + ``--out``.pt.

``python -m torch.distributed.run --nproc_per_node=2 sft_dp_worker.py MODEL_DIR --out FILE``
"""

import argparse
import json
import os
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from megatron_tsync.model.builder import build_model  # noqa: E402
from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model  # noqa: E402
from megatron_tsync.model.parallel import initialize_parallel  # noqa: E402
from megatron_tsync.model.tokenizer import TokenizerCodec  # noqa: E402
from megatron_tsync.runtime.tasks import ArithmeticCalculatorTask  # noqa: E402
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp  # noqa: E402
from megatron_tsync.training.sft import WARM_START_OPTIM, build_sft_optimizer, sft_warmup  # noqa: E402


def run(path, dims, codec, distributed: bool, force_plain: bool) -> torch.Tensor:
    arch, state = load_hf_dir(path)
    model = build_model(arch, seed=0)
    load_hf_into_model(model, state)
    ddp = wrap_ddp(model, use_distributed_optimizer=distributed)
    build_optimizer(ddp, OptimConfig(use_distributed_optimizer=distributed))  # the run's RL optimizer exists too
    opt, clip = (build_optimizer(ddp, WARM_START_OPTIM), 0.0) if force_plain else build_sft_optimizer(ddp)
    sft_warmup(ddp, opt, codec, ArithmeticCalculatorTask(), 3, batch_size=4, seed=1, dp_group=dims.dp_group(),
               clip_grad=clip)
    return torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dims = initialize_parallel(1, 1)
    codec = TokenizerCodec(Tokenizer.from_file(os.path.join(a.model, "tokenizer.json")))
    report, weights = {}, {}
    for name, distributed, force_plain in (("plain", False, False), ("distributed", True, False),
                                           ("control", True, True)):
        flat = run(a.model, dims, codec, distributed, force_plain)
        rank0 = flat.clone()
        dist.broadcast(rank0, src=0)
        report[name] = (flat - rank0).abs().max().item()
        weights[name] = flat
    if dist.get_rank() == 1:
        torch.save(weights, a.out + ".pt")
        with open(a.out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
