"""Gradient-bucket memory of streaming GRPO per GPU, for sizing ``--max-open-groups`` (examples/qwen_*/README.md).

    python examples/bucket_memory.py --hf-config /models/Qwen2.5-14B-Instruct/config.json --tp 4 --pp 2 \\
        --estimator grpo --max-open-groups 4

A bucket vector is shaped like Megatron's DDP grad buffer of one rank (fp32 with ``grad_reduce_in_fp32``): the
rank's parameters under TP × PP, *not* divided by DP (the distributed optimizer shards optimizer state, not the grad
buffer). Vectors per rank beyond the grad buffer itself (design note §1): 2k for std-normalised GRPO (P and Q per open
group), k for Dr.GRPO / RLOO (Q only), k = open groups ≤ ``--max-open-groups``. Prints the largest stage's figures.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_tsync.model.builder import ModelArch

PER_GROUP = {"grpo": 2, "grpo_unbiased": 2, "grpo_batch_std": 2, "dr_grpo": 1, "rloo": 1}


def params_per_rank(arch: ModelArch, tp: int, pp: int) -> int:
    """Parameters held by the largest pipeline stage's rank (embedding on stage 0, output layer on the last)."""
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_kv_heads * hd
    split = h * (q + 2 * kv) + (q + 2 * kv if arch.qkv_bias else 0) + q * h + 3 * h * arch.ffn_hidden_size
    layer = split // tp + 2 * h  # two RMSNorm weights, replicated over TP
    body = (arch.num_layers // pp) * layer
    emb = arch.vocab_size * h // tp
    first = body + emb + (emb + h if pp == 1 and not arch.tie_word_embeddings else 0)
    last = body + h + (emb if not arch.tie_word_embeddings or pp > 1 else 0)
    return max(first, last) if pp > 1 else first


def estimate(arch: ModelArch, tp: int, pp: int, estimator: str, max_open_groups: int, bytes_per: int = 4) -> dict:
    n = params_per_rank(arch, tp, pp)
    vec = n * bytes_per
    k_vectors = PER_GROUP[estimator] * max_open_groups
    return {"params_per_rank": n, "vector_bytes": vec, "bucket_vectors": k_vectors,
            "bucket_bytes": k_vectors * vec, "grad_buffer_bytes": vec}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf-config", required=True, help="a Hugging Face config.json (Llama / Qwen2 / Qwen3 dense; not MoE yet)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--estimator", default="grpo", choices=sorted(PER_GROUP))
    ap.add_argument("--max-open-groups", type=int, required=True)
    a = ap.parse_args(argv)
    with open(a.hf_config) as f:
        arch = ModelArch.from_hf_config(json.load(f))
    e = estimate(arch, a.tp, a.pp, a.estimator, a.max_open_groups)
    gib = 1 << 30
    print(f"params per rank {e['params_per_rank'] / 1e9:.2f} B; one gradient-sized fp32 vector "
          f"{e['vector_bytes'] / gib:.1f} GiB; buckets {e['bucket_vectors']} vectors = "
          f"{e['bucket_bytes'] / gib:.1f} GiB per GPU on top of the grad buffer")
    return e


if __name__ == "__main__":
    main(sys.argv[1:])
