"""Create a tiny Hugging Face Llama/Qwen2/Qwen3/Qwen3-MoE/GLM-4.7-Flash-style model with a locally trained tokenizer
(no downloads).

    python tools/make_tiny_model.py --out /tmp/tiny --family llama|qwen2|qwen3|llama3|qwen3_moe|glm4-moe-lite|deepseek-v3|qwen3.5 [--hidden 128
        --layers 2 --heads 4 --kv-heads 2 --head-dim 64 --vocab 512 --tie --seed 0 --experts 4 --topk 2 --moe-ffn 64]

llama3: a Llama config with Llama-3.1-style rope_scaling (rope_type llama3). qwen3: QK-norm, no QKV bias,
head_dim 2·hidden/heads unless --head-dim says otherwise. qwen3_moe: Qwen3 attention + an MoE MLP in every layer
(transformers' Qwen3MoeConfig; --experts experts, --topk per token, normalised top-k weights). glm4-moe-lite
(= glm4_moe_lite): transformers' Glm4MoeLiteConfig — multi-latent attention (low-rank q/kv, a decoupled
interleaved-RoPE head), the first layer dense, then sigmoid-routed experts (4 groups, 2 kept, top-4) with a random
non-zero correction bias, routed scaling 1.8 and one shared expert. deepseek-v3 (= deepseek_v3): the same shapes
through transformers' DeepseekV3Config (its modeling is glm4_moe_lite's; dense layers as first_k_dense_replace). qwen3.5 (= qwen3_5): transformers'
Qwen3_5TextConfig — Gated DeltaNet linear-attention layers alternating with gated full-attention layers (partial
RoPE, zero-centred norms; default 4 layers); qwen3.5-moe: the same with every MLP routed experts (--experts 4,
--topk 2) plus a sigmoid-gated shared expert (transformers' Qwen3_5MoeTextConfig).
"""

from __future__ import annotations

import argparse

from megatron_tsync.model.tiny_model import ALL_FAMILIES, make_tiny_model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--family", choices=list(ALL_FAMILIES) + ["glm4-moe-lite", "deepseek-v3", "qwen3.5", "qwen3.5-moe"],
                   default="llama")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 2; glm4_moe_lite: 3, qwen3.5: 4)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None,
                   help="attention head size (default hidden/heads; qwen3: 2×hidden/heads)")
    p.add_argument("--vocab", type=int, default=512, help="model vocabulary (multiple of 8, ≥ tokenizer size)")
    p.add_argument("--ffn", type=int, default=None, help="MLP width (default 2×hidden)")
    p.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", type=int, default=None,
                   help="routed experts per MoE layer (default qwen3_moe 4, glm4_moe_lite 16)")
    p.add_argument("--topk", type=int, default=None, help="experts per token (default qwen3_moe 2, glm4_moe_lite 4)")
    p.add_argument("--moe-ffn", type=int, default=None, help="qwen3_moe: expert MLP width (default hidden/2)")
    a = p.parse_args(argv)
    out = make_tiny_model(
        a.out, family=a.family, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
        vocab=a.vocab, ffn=a.ffn, tie=a.tie, seed=a.seed, head_dim=a.head_dim,
        experts=a.experts, topk=a.topk, moe_ffn=a.moe_ffn,
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
