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
    "h100": {"peak_tflops": 989.0, "hbm_tbs": 3.35, "mem_gib": 80.0, "host_link_gbs": 50.0, "host_add_gbs": 57.6},
    "h200": {"peak_tflops": 989.0, "hbm_tbs": 4.8, "mem_gib": 141.0, "host_link_gbs": 50.0, "host_add_gbs": 57.6},
    "gh200": {"peak_tflops": 989.0, "hbm_tbs": 4.9, "mem_gib": 141.0, "host_link_gbs": 400.0, "host_add_gbs": 375.0},
    "b200": {"peak_tflops": 2250.0, "hbm_tbs": 8.0, "mem_gib": 180.0, "host_link_gbs": 50.0, "host_add_gbs": 67.0},
    "a100": {"peak_tflops": 312.0, "hbm_tbs": 2.0, "mem_gib": 80.0, "host_link_gbs": 25.0, "host_add_gbs": 38.4},
    "cpu": {"peak_tflops": 0.05, "hbm_tbs": 0.02, "mem_gib": 64.0, "host_link_gbs": 3.3, "host_add_gbs": 13.0},
}
"""``host_link_gbs``: one direction of the GPU's host link as pinned copies reach it (data-sheet peak × ~0.8): PCIe
Gen5 x16 (64 GB/s) for H100/H200/B200 SXM boards, Gen4 (32 GB/s) for A100, NVLink-C2C (450 GB/s per direction) for
Grace Hopper; "cpu": a 256 MiB slot-to-slot copy measured on the project's 2-core CPU machine (docs/streaming.md).

``host_add_gbs``: host memory bandwidth one learner rank's host add gets (host accumulation), all ranks of a node
adding at once: the node's sockets' DDR peak (channels × transfer rate × 8 B) × 0.75 (STREAM-like sustained share)
divided by the node's GPUs. DGX H100 / HGX H200: 2 × Xeon 8480C, 8 channels DDR5-4800 (307 GB/s per socket) →
2 × 307 × 0.75 / 8 = 57.6; DGX B200: 2 × Xeon 8570, 8 channels DDR5-5600 (358 GB/s) → 67; DGX A100: 2 × EPYC 7742, 8
channels DDR4-3200 (205 GB/s) → 38.4; GH200: one Grace (LPDDR5X, 500 GB/s) per GPU → 375; "cpu": torch ``add_`` of a
256 MiB fp32 vector with one thread measured on the project's 2-core CPU machine, 12 bytes per element
(docs/streaming.md)."""

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
    # the seed paper's two models, their Hugging Face configs (the fields the planner reads): GLM-4.7-Flash
    # (zai-org/GLM-4.7-Flash: multi-latent attention, 64 routed experts top-4 + 1 shared, the first layer dense) and
    # Qwen3.5-27B (Qwen/Qwen3.5-27B's text config: 48 Gated DeltaNet + 16 gated full-attention layers)
    "glm-4.7-flash": {"model_type": "glm4_moe_lite", "vocab_size": 154880, "hidden_size": 2048,
                      "intermediate_size": 10240, "moe_intermediate_size": 1536, "num_hidden_layers": 47,
                      "num_attention_heads": 20, "num_key_value_heads": 20, "n_routed_experts": 64,
                      "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1,
                      "routed_scaling_factor": 1.8, "norm_topk_prob": True, "first_k_dense_replace": 1,
                      "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
                      "v_head_dim": 256, "rope_theta": 1e6, "rope_interleave": True, "rms_norm_eps": 1e-5,
                      "tie_word_embeddings": False, "max_position_embeddings": 202752},
    "qwen3.5-27b": {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120,
                    "intermediate_size": 17408, "num_hidden_layers": 64, "num_attention_heads": 24,
                    "num_key_value_heads": 4, "head_dim": 256, "full_attention_interval": 4, "attn_output_gate": True,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
                    "max_position_embeddings": 262144},
    # the benchmark's tiny learner (tools/bench_streaming.py's Harness, hidden 128, 2 layers): the CPU calibration
    "bench-tiny": {"model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
}


# families the planner counts from the config itself (plan/shapes.py): Qwen3.5's hybrid layers (Gated DeltaNet beside
# gated attention), which ModelArch's dense count does not describe, and DeepSeek-V3, whose released config (YaRN
# RoPE) ModelArch refuses although its shape is known (the learner builds tiny deepseek_v3 with plain RoPE)
PLANNER_ONLY = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "deepseek_v3")


def _arch(cfg: dict):
    if cfg.get("model_type") in PLANNER_ONLY:
        from megatron_tsync.plan.shapes import shape_of

        return shape_of(cfg)
    return ModelArch.from_hf_config(cfg)


def load_arch(name_or_path: str):
    """A named size (:data:`MODELS`), a Hugging Face ``config.json`` or a folder holding one: a ModelArch where the
    learner builds the family, else the planner's :class:`~megatron_tsync.plan.shapes.ModelShape` (it only counts)."""
    if name_or_path in MODELS:
        return _arch(MODELS[name_or_path])
    path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    if os.path.isdir(name_or_path) and not os.path.isfile(path):
        return ModelArch.from_hf_dir(name_or_path)  # its error names the missing file
    if os.path.isfile(path):
        with open(path) as f:
            try:
                cfg = json.load(f)
            except ValueError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
        if cfg.get("model_type") not in PLANNER_ONLY and os.path.isdir(name_or_path):
            return ModelArch.from_hf_dir(name_or_path)
        return _arch(cfg)
    raise ValueError(f"--model {name_or_path!r}: neither a named size ({', '.join(MODELS)}) nor a config.json")


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """Sizes of one model that the cost formulas need (module docstring; counted by ``plan/shapes.py``)."""

    total_params: int
    active_params: int  # without the embedding / output layer, experts counted top-k of E
    embed_params: int
    layers: int  # softmax-attention layers (the T² term; a hybrid's linear-attention layers have none)
    q_dim: float  # their attention width (heads × head_dim; MLA: heads × the mean of the qk and v head dims)
    kv_bytes_per_token: int  # bf16 KV cache of every attention layer (MLA: the latent and the RoPE key)
    expert_params: int  # all experts of all layers (0 for dense)
    num_experts: int
    topk: int
    state_bytes_per_seq: int = 0  # linear-attention layers' recurrent state (read and written every decode step)
    mixer_flops_per_token: float = 0.0  # linear-attention layers' recurrence, forward, all layers

    @classmethod
    def of(cls, arch) -> "ModelCost":
        """``arch``: a ModelArch, a ``plan.shapes.ModelShape`` or a Hugging Face config dict."""
        from megatron_tsync.plan.shapes import shape_of

        shape = shape_of(arch)
        total = sum(shape.stage_params(1, 1))
        embed = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
        experts = sum(ly.experts for ly in shape.layers)
        e = shape.num_experts
        active = total - embed - experts + (experts * shape.topk // e if e else 0)
        attn = [ly for ly in shape.layers if ly.kind in ("attention", "mla")]
        return cls(total_params=total, active_params=active, embed_params=embed, layers=len(attn),
                   q_dim=attn[0].attn_width if attn else 0.0,
                   kv_bytes_per_token=sum(ly.kv_bytes_per_token for ly in attn),
                   expert_params=experts, num_experts=e, topk=shape.topk,
                   state_bytes_per_seq=sum(ly.state_bytes for ly in shape.layers),
                   mixer_flops_per_token=sum(ly.mixer_flops_per_token for ly in shape.layers))

    def train_flops(self, tokens: int) -> float:
        """Forward + backward of one trajectory of ``tokens`` tokens (output layer included)."""
        per_tok = 6.0 * (self.active_params + self.embed_params / 2) + 3.0 * self.mixer_flops_per_token
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
    frontier_first: bool = False  # engines admit waiting sequences of earlier groups first (--rollout-frontier-first)
    peak_tflops: float | None = None  # overrides the GPU type's
    host_link_gbs: float | None = None
    host_add_gbs: float | None = None
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
        own = {"peak_tflops": self.peak_tflops, "hbm_tbs": self.hbm_tbs, "mem_gib": self.mem_gib,
               "host_link_gbs": self.host_link_gbs, "host_add_gbs": self.host_add_gbs}[key]
        return GPUS[self.gpu][key] if own is None else own

    @property
    def peak(self) -> float:
        return self.spec("peak_tflops") * 1e12

    @property
    def hbm(self) -> float:
        return self.spec("hbm_tbs") * 1e12
