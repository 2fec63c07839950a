"""Parameters per rank and gradient-bucket memory of streaming GRPO (moved here from ``examples/bucket_memory.py``,
which keeps its command line; the planner ``megatron_tsync.plan`` uses the same code for its memory figures).

A bucket vector is shaped like Megatron's DDP grad buffer of one rank (fp32 with ``grad_reduce_in_fp32``): the
rank's parameters under TP × PP (× EP for the experts), *not* divided by DP. Vectors per rank beyond the grad buffer
(design note §1): 2k for std-normalised GRPO (P and Q per open group), k for Dr.GRPO / RLOO (Q only), k = open
groups. Layer parameter formulas: ``examples/bucket_memory.py``'s docstring.
"""

from __future__ import annotations

from megatron_tsync.model.builder import ModelArch

PER_GROUP = {"grpo": 2, "grpo_unbiased": 2, "grpo_batch_std": 2, "dr_grpo": 1, "rloo": 1}


def layer_params(arch: ModelArch, tp: int = 1, ep: int = 1) -> int:
    """Parameters of one decoder layer on one (TP, EP) rank."""
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_kv_heads * hd
    split = h * (q + 2 * kv) + (q + 2 * kv if arch.qkv_bias else 0) + q * h
    replicated = 2 * h + (2 * hd if arch.qk_layernorm else 0)
    if arch.num_experts:
        if arch.num_experts % ep:
            raise ValueError(f"{arch.num_experts} experts do not split over EP={ep}")
        split += (arch.num_experts // ep) * 3 * h * arch.moe_ffn_hidden_size
        replicated += h * arch.num_experts  # router
    else:
        if ep != 1:
            raise ValueError("--ep > 1 needs a MoE model")
        split += 3 * h * arch.ffn_hidden_size
    return split // tp + replicated


def stage_params(arch, tp: int, pp: int, ep: int = 1) -> list[int]:
    """Parameters of one rank of each pipeline stage (embedding on stage 0, final norm and output layer on the last);
    ``arch``: a ModelArch, a ``plan.shapes.ModelShape`` or a Hugging Face config dict (``plan/shapes.py``)."""
    from megatron_tsync.plan.shapes import shape_of

    return shape_of(arch).stage_params(tp, pp, ep)


def params_per_rank(arch: ModelArch, tp: int, pp: int, ep: int = 1) -> int:
    """Parameters held by the largest pipeline stage's rank."""
    return max(stage_params(arch, tp, pp, ep))


def estimate(arch: ModelArch, tp: int, pp: int, estimator: str, max_open_groups: int, bytes_per: int = 4,
             ep: int = 1) -> dict:
    n = params_per_rank(arch, tp, pp, ep)
    vec = n * bytes_per
    k_vectors = PER_GROUP[estimator] * max_open_groups
    return {"params_per_rank": n, "vector_bytes": vec, "bucket_vectors": k_vectors,
            "bucket_bytes": k_vectors * vec, "grad_buffer_bytes": vec,
            "stage_params": stage_params(arch, tp, pp, ep)}
