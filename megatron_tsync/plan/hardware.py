"""What the planner knows about the hardware and the model: GPU types, the layout, model sizes and their costs.

Every number here is a stated assumption (docs/planner.md), overridable from the command line.

GPU types (dense bf16 peak, HBM bandwidth, memory): the vendors' data-sheet figures (H100 SXM 989 TFLOP/s, 3.35 TB/s,
80 GB; H200 989 TFLOP/s, 4.8 TB/s, 141 GB; B200 2,250 TFLOP/s, 8 TB/s, 180 GB; A100 312 TFLOP/s, 2.0 TB/s, 80 GB).
``cpu``: a placeholder whose learner costs come from calibration (measured microbatch times), not from FLOPs.

Model costs (per token; N_act = active parameters without the embedding, L layers, q = heads × head_dim):

- learner forward + backward of a trajectory of T tokens: ``6·N_act·T + 6·L·q·T²`` FLOPs (causal attention's two
  matmuls, half the square, × 3 for the backward), at ``mfu`` of the replica's peak, plus a fixed per-microbatch
  overhead (kernel launches, the schedule, the loss);
- rollout decode step of a batch of b sequences: the larger of the memory time (the weights read once per step, the
  MoE's experts only those some sequence routes to, plus every sequence's KV cache) and the compute time
  ``2·N_act·b`` at ``decode_mfu`` — a roofline; prefill ``2·N_act`` per prompt token at ``prefill_mfu``.
"""

from __future__ import annotations

import dataclasses
import json
import os

from megatron_tsync.model.builder import ModelArch
from megatron_tsync.plan.memory import stage_params

GPUS: dict[str, dict] = {
    "h100": {"peak_tflops": 989.0, "hbm_tbs": 3.35, "mem_gib": 80.0},
    "h200": {"peak_tflops": 989.0, "hbm_tbs": 4.8, "mem_gib": 141.0},
    "b200": {"peak_tflops": 2250.0, "hbm_tbs": 8.0, "mem_gib": 180.0},
    "a100": {"peak_tflops": 312.0, "hbm_tbs": 2.0, "mem_gib": 80.0},
    "cpu": {"peak_tflops": 0.05, "hbm_tbs": 0.02, "mem_gib": 64.0},
}

_QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
          "tie_word_embeddings": False, "max_position_embeddings": 40960}
MODELS: dict[str, dict] = {
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8},
    "qwen3-32b": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                  "num_attention_heads": 64, "num_key_value_heads": 8},
    "qwen3-30b-a3b": {**_QWEN3, "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                      "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "norm_topk_prob": True},
    # the seed paper's dense model: a 27B dense decoder (Gemma-3-27B's shape: 62 layers, 5376 wide; as Qwen3 here)
    "dense-27b": {**_QWEN3, "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
                  "num_attention_heads": 32, "num_key_value_heads": 16, "vocab_size": 262144,
                  "tie_word_embeddings": True},
    # the seed paper's "31B-A3B-like" MoE: Qwen3-30B-A3B's shape with 8 more layers (≈ 31 B total, ≈ 3.3 B active)
    "moe-31b-a3b": {**_QWEN3, "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                    "num_hidden_layers": 50, "num_attention_heads": 32, "num_key_value_heads": 4,
                    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                    "norm_topk_prob": True},
    # the benchmark's tiny learner (tools/bench_streaming.py's Harness, hidden 128, 2 layers): the CPU calibration
    "bench-tiny": {"model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
}


def load_arch(name_or_path: str) -> ModelArch:
    """A named size (:data:`MODELS`), a Hugging Face ``config.json`` or a folder holding one."""
    if name_or_path in MODELS:
        return ModelArch.from_hf_config(MODELS[name_or_path])
    if os.path.isdir(name_or_path):
        return ModelArch.from_hf_dir(name_or_path)
    if os.path.isfile(name_or_path):
        with open(name_or_path) as f:
            return ModelArch.from_hf_config(json.load(f))
    raise ValueError(f"--model {name_or_path!r}: neither a named size ({', '.join(MODELS)}) nor a config.json")


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """Sizes of one model that the cost formulas need (module docstring)."""

    total_params: int
    active_params: int  # without the embedding / output layer, experts counted top-k of E
    embed_params: int
    layers: int
    q_dim: int
    kv_bytes_per_token: int  # bf16 K and V of every layer
    expert_params: int  # all experts of all layers (0 for dense)
    num_experts: int
    topk: int

    @classmethod
    def of(cls, arch: ModelArch) -> "ModelCost":
        total = sum(stage_params(arch, 1, 1))
        h, e = arch.hidden_size, arch.num_experts
        embed = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
        experts = arch.num_layers * e * 3 * h * arch.moe_ffn_hidden_size if e else 0
        active = total - embed - experts + (experts * arch.moe_router_topk // e if e else 0)
        return cls(total_params=total, active_params=active, embed_params=embed, layers=arch.num_layers,
                   q_dim=arch.num_attention_heads * arch.head_dim,
                   kv_bytes_per_token=2 * 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim,
                   expert_params=experts, num_experts=e, topk=arch.moe_router_topk)

    def train_flops(self, tokens: int) -> float:
        """Forward + backward of one trajectory of ``tokens`` tokens (output layer included)."""
        per_tok = 6.0 * (self.active_params + self.embed_params / 2)
        return per_tok * tokens + 6.0 * self.layers * self.q_dim * tokens * tokens

    def weight_bytes_read(self, batch: int) -> float:
        """bf16 bytes one decode step reads: dense weights, and the experts that at least one of ``batch`` sequences
        routes to (uniform routing: each expert unused by one token with probability 1 − k/E)."""
        dense = self.total_params - self.expert_params
        if not self.num_experts:
            return 2.0 * dense
        used = 1.0 - (1.0 - self.topk / self.num_experts) ** max(batch, 1)
        return 2.0 * (dense + self.expert_params * used)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the step runs: rollout engines, the learner's parallelism, the GPU and the links."""

    gpu: str = "h100"
    rollout_gpus: int = 4
    rollout_tp: int = 1  # GPUs per engine: engines = rollout_gpus / rollout_tp
    learner_gpus: int = 4
    tp: int = 1
    pp: int = 1
    ep: int = 1
    mfu: float = 0.35  # the learner's share of peak on full microbatches
    decode_mfu: float = 0.5  # the compute roof's share of peak in decode
    prefill_mfu: float = 0.4
    hbm_eff: float = 0.7  # share of HBM bandwidth a decode step reaches
    mb_overhead_s: float = 0.004  # fixed seconds per learner microbatch (launches, schedule, loss)
    decode_overhead_s: float = 0.003  # fixed seconds per decode step (scheduler, sampling)
    dp_bw_gbs: float = 100.0  # gradient all-reduce bandwidth per GPU (GB/s)
    sync_bw_gbs: float = 50.0  # learner → engines weight broadcast (GB/s)
    max_concurrency: int = 256  # sequences per engine at most (the engine's batch cap)
    peak_tflops: float | None = None  # overrides the GPU type's
    hbm_tbs: float | None = None
    mem_gib: float | None = None

    def __post_init__(self):
        if self.gpu not in GPUS:
            raise ValueError(f"unknown GPU type {self.gpu!r}; known: {', '.join(GPUS)}")
        for k in ("rollout_gpus", "rollout_tp", "learner_gpus", "tp", "pp", "ep", "max_concurrency"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.rollout_gpus % self.rollout_tp:
            raise ValueError(f"rollout GPUs {self.rollout_gpus} do not split into engines of {self.rollout_tp}")
        if self.learner_gpus % (self.tp * self.pp):
            raise ValueError(f"learner GPUs {self.learner_gpus} do not split into TP {self.tp} × PP {self.pp}")
        if self.dp % self.ep:
            raise ValueError(f"EP {self.ep} must divide DP {self.dp} (experts are spread over data-parallel ranks)")
        for k in ("mfu", "decode_mfu", "prefill_mfu", "hbm_eff"):
            if not 0 < getattr(self, k) <= 1:
                raise ValueError(f"{k} must be in (0, 1], got {getattr(self, k)}")

    @property
    def dp(self) -> int:
        return self.learner_gpus // (self.tp * self.pp)

    @property
    def engines(self) -> int:
        return self.rollout_gpus // self.rollout_tp

    def spec(self, key: str) -> float:
        own = {"peak_tflops": self.peak_tflops, "hbm_tbs": self.hbm_tbs, "mem_gib": self.mem_gib}[key]
        return GPUS[self.gpu][key] if own is None else own

    @property
    def peak(self) -> float:
        return self.spec("peak_tflops") * 1e12

    @property
    def hbm(self) -> float:
        return self.spec("hbm_tbs") * 1e12
