"""Gradient-bucket memory of streaming GRPO per GPU, for sizing ``--max-open-groups`` (examples/qwen*/README.md).

    python examples/bucket_memory.py --hf-config /models/Qwen2.5-14B-Instruct/config.json --tp 4 --pp 2 \\
        --estimator grpo --max-open-groups 4

A bucket vector is shaped like Megatron's DDP grad buffer of one rank (fp32 with ``grad_reduce_in_fp32``): the
rank's parameters under TP × PP (× EP for the experts), *not* divided by DP (the distributed optimizer shards
optimizer state, not the grad buffer). Vectors per rank beyond the grad buffer itself (design note §1): 2k for
std-normalised GRPO (P and Q per open group), k for Dr.GRPO / RLOO (Q only), k = open groups ≤
``--max-open-groups``. Prints the largest stage's figures.

Parameters of one decoder layer on one rank (megatron's GPTModel, SwiGLU, no biases except Qwen2's QKV bias):

- attention: QKV ``H × (q + 2·kv)`` (+ ``q + 2·kv`` bias, Qwen2) and output ``q × H``, split over TP;
  Qwen3 / Qwen3-MoE QK-norm weights ``2 · head_dim``, replicated over TP;
- dense MLP: ``3 · H · ffn`` split over TP;
- MoE MLP (Qwen3-MoE): router ``H × E`` replicated over TP; experts ``E × 3 · H · moe_ffn`` of which a rank holds
  E/EP experts, each split over the expert-TP size (= TP here, model/moe.py);
- two RMSNorm weights ``2 · H``, replicated over TP.

Embedding ``V × H / TP`` on the first stage; final norm ``H`` and (untied) output layer ``V × H / TP`` on the last.
With EP the rank's grad buffer holds its E/EP experts (megatron keeps them in a separate expert-parallel buffer of the
same rank, which a bucket vector mirrors), so the figure is per rank of the expert-parallel layout.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_tsync.model.builder import ModelArch
from megatron_tsync.plan.memory import PER_GROUP, estimate, layer_params, params_per_rank, stage_params

__all__ = ["PER_GROUP", "estimate", "layer_params", "params_per_rank", "stage_params", "main"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf-config", required=True,
                    help="a Hugging Face config.json (Llama / Qwen2 / Qwen3 dense / Qwen3-MoE)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE): a rank holds E/EP experts")
    ap.add_argument("--estimator", default="grpo", choices=sorted(PER_GROUP))
    ap.add_argument("--max-open-groups", type=int, required=True)
    a = ap.parse_args(argv)
    with open(a.hf_config) as f:
        arch = ModelArch.from_hf_config(json.load(f))
    e = estimate(arch, a.tp, a.pp, a.estimator, a.max_open_groups, ep=a.ep)
    gib = 1 << 30
    print(f"params per rank {e['params_per_rank'] / 1e9:.2f} B; one gradient-sized fp32 vector "
          f"{e['vector_bytes'] / gib:.1f} GiB; buckets {e['bucket_vectors']} vectors = "
          f"{e['bucket_bytes'] / gib:.1f} GiB per GPU on top of the grad buffer")
    return e


if __name__ == "__main__":
    main(sys.argv[1:])
