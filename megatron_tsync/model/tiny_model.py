"""Tiny Llama / Qwen2 / Qwen3 models in Hugging Face format, made locally (no downloads) for tests, the quickstart and laptops.

The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on synthetic arithmetic / tool-use text
("Q: 12+7*3 <tool>calculator: 12+7*3</tool><result>33</result><answer>33</answer>"), digits split one per token.
Special tokens: ``<s>`` (BOS), ``</s>`` (EOS), ``<pad>``, and ``<tool> </tool> <result> </result> <answer>
</answer>`` (the calculator agent task). The model's vocabulary (``--vocab``) may exceed the tokenizer's
(padding rows are never produced by the tokenizer). Weights are transformers' random init under ``seed``;
everything is deterministic for a given seed.

Families (:data:`FAMILIES`): ``llama`` (plain RoPE, θ 1e4), ``qwen2`` (QKV bias, θ 1e6), ``qwen3`` (QK-norm, no
bias, θ 1e6, ``head_dim`` 2·hidden/heads by default: decoupled from hidden/heads as in Qwen3-4B) and ``llama3``
(a Llama config with Llama-3.1-style ``rope_scaling`` — factor 8, low/high frequency factors 1/4, θ 5e5 — whose
``original_max_position_embeddings`` is 64 so that short test sequences already cross the scaled wavelengths),
``qwen3_moe`` and ``glm4_moe_lite`` (GLM-4.7-Flash's layout, transformers' Glm4MoeLiteConfig, see
:func:`glm4_moe_lite_arch`), ``qwen3_5`` (the Gated DeltaNet hybrid, transformers' Qwen3_5TextConfig, see
:func:`qwen3_5_arch`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

import torch

from megatron_tsync.model.hf_conversion import save_hf_dir
from megatron_tsync.model.builder import ModelArch

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<tool>", "</tool>", "<result>", "</result>", "<answer>", "</answer>"]
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
FAMILIES = ("llama", "qwen2", "qwen3", "llama3", "qwen3_moe", "qwen3_5")  # what --tiny-model-family offers (a live run)
# make_tiny_model / tools/make_tiny_model.py also make glm4_moe_lite, deepseek_v3 and qwen3_5_moe (not run live yet;
# their learner and embedded engine are tested in tests/model)
ALL_FAMILIES = FAMILIES + ("glm4_moe_lite", "deepseek_v3", "qwen3_5_moe")
_LLAMA3_SCALING = dict(rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                       rope_original_max_position_embeddings=64)


def _expression(rng: random.Random) -> str:
    n = rng.randint(2, 4)
    parts = [str(rng.randint(0, 99))]
    for _ in range(n - 1):
        parts += [rng.choice("+-*"), str(rng.randint(0, 99))]
    return "".join(parts)


def synthetic_corpus(n: int = 3000, seed: int = 0) -> list[str]:
    """Arithmetic questions with calculator calls and answers, plus a few plain sentences."""
    rng = random.Random(seed)
    words = ["the", "answer", "is", "compute", "what", "result", "of", "calculator", "use", "tool", "please", "sum"]
    lines = []
    for _ in range(n):
        e = _expression(rng)
        v = str(eval(e))  # noqa: S307 - digits and + - * only
        style = rng.random()
        if style < 0.6:
            lines.append(f"Q: {e} <tool>calculator: {e}</tool><result>{v}</result><answer>{v}</answer>")
        elif style < 0.85:
            lines.append(f"Q: What is {e}? A: {e} = {v} <answer>{v}</answer>")
        else:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + ".")
    return lines


def train_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE ``tokenizers.Tokenizer`` with at most ``vocab_size`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        min_frequency=2,
    )
    tok.train_from_iterator(synthetic_corpus(seed=seed), trainer=trainer)
    return tok


def _save_tokenizer(tok, out_dir: str) -> dict[str, int]:
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": SPECIAL_TOKENS[3:],
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "additional_special_tokens": SPECIAL_TOKENS[3:]}, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}, f, indent=2)
    return ids


def make_tiny_model(
    out_dir: str,
    *,
    family: str = "llama",
    hidden: int = 128,
    layers: int | None = None,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    ffn: int | None = None,
    tie: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    head_dim: int | None = None,
    experts: int | None = None,
    topk: int | None = None,
    moe_ffn: int | None = None,
    mla: dict | None = None,
) -> str:
    """Write a tiny HF model + tokenizer to ``out_dir``; returns ``out_dir``. ``head_dim`` (default hidden/heads,
    2·hidden/heads for qwen3 and qwen3_moe) may differ from hidden/heads. qwen3_moe: ``experts`` experts per layer,
    ``topk`` per token, each of width ``moe_ffn`` (default hidden/2), normalised top-k weights; the router gets
    N(0, 0.5²) weights (not transformers' zeros) so that routing is decisive, without near-ties. glm4_moe_lite:
    :func:`glm4_moe_lite_arch` (``layers`` default 3, ``experts`` 16, ``topk`` 4); the router gets N(0, 0.2²)
    weights (sigmoid scores spread over (0, 1)) and the correction bias N(0, 0.1²) values, large enough to change
    which experts are selected; ``mla``: its latent widths (``kv_lora_rank``, ``qk_rope_head_dim``) and
    ``first_k_dense``. ``layers`` defaults to 2 (glm4_moe_lite: 3)."""
    family = family.replace("-", "_").replace(".", "_")  # the CLI also accepts glm4-moe-lite and qwen3.5
    if family not in ALL_FAMILIES:
        raise ValueError(f"family must be one of {ALL_FAMILIES}, not {family!r}")
    if family in ("glm4_moe_lite", "deepseek_v3"):  # deepseek_v3: the same shapes through DeepseekV3Config
        arch = glm4_moe_lite_arch(hidden=hidden, layers=layers or 3, heads=heads, vocab=vocab, ffn=ffn, tie=tie,
                                  experts=experts or 16, topk=topk or 4, moe_ffn=moe_ffn, **(mla or {}))
        arch = dataclasses.replace(arch, family=family)
        return _write(out_dir, arch, seed=seed, dtype=dtype, router_std=0.2, bias_std=0.1)
    if family in ("qwen3_5", "qwen3_5_moe"):
        arch = qwen3_5_arch(hidden=hidden, layers=layers or 4, heads=heads, kv_heads=kv_heads, vocab=vocab, ffn=ffn,
                            tie=tie, head_dim=head_dim)
        if family == "qwen3_5_moe":  # every MLP: experts (top-2 of 4, width hidden/2) + a gated shared expert
            f = moe_ffn or hidden // 2
            arch = dataclasses.replace(arch, family=family, num_experts=experts or 4, moe_router_topk=topk or 2,
                                       moe_ffn_hidden_size=f, norm_topk_prob=True, moe_shared_expert_ffn_hidden_size=f)
        return _write(out_dir, arch, seed=seed, dtype=dtype, router_std=0.5)
    experts, topk, layers = experts or 4, topk or 2, layers or 2
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden {hidden} must divide by heads {heads}, and heads by kv_heads {kv_heads}")
    if head_dim is None:
        head_dim = (2 if family in ("qwen3", "qwen3_moe") else 1) * hidden // heads
    if head_dim < 32 or head_dim % 32:
        raise ValueError(f"head_dim {head_dim}: vLLM's CPU attention needs 32, 64, 96, 128, ...")
    arch = ModelArch(
        family="llama" if family == "llama3" else family,
        vocab_size=vocab,
        hidden_size=hidden,
        ffn_hidden_size=ffn or 2 * hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta={"llama": 10000.0, "llama3": 500000.0}.get(family, 1000000.0),
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        qkv_bias=family == "qwen2",
        max_position_embeddings=4096,
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        **(_LLAMA3_SCALING if family == "llama3" else {}),
        **(dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn or hidden // 2,
                norm_topk_prob=True) if family == "qwen3_moe" else {}),
    )
    return _write(out_dir, arch, seed=seed, dtype=dtype, router_std=0.5)


def glm4_moe_lite_arch(*, hidden: int = 128, layers: int = 3, heads: int = 4, vocab: int = 512,
                       ffn: int | None = None, tie: bool = False, experts: int = 16, topk: int = 4,
                       moe_ffn: int | None = None, kv_lora_rank: int | None = None,
                       qk_rope_head_dim: int = 16, first_k_dense: int = 1) -> ModelArch:
    """A tiny GLM-4.7-Flash-shaped decoder: low-rank q (hidden/2) and kv (hidden/4) latents, 32-wide no-RoPE and
    16-wide RoPE query/key parts, 32-wide values, interleaved RoPE, the first layer(s) dense, ``experts`` routed
    experts in 4 groups of which 2 are kept (top-``topk`` = 2·2 inside them), routed scaling 1.8, one shared
    expert, rms_norm_eps 1e-5 (the latent norms keep transformers' 1e-6). ``kv_lora_rank`` / ``qk_rope_head_dim``:
    other latent widths (vLLM's MLA takes only kv_lora_rank + rope = 576, GLM's and DeepSeek's 512 + 64);
    ``first_k_dense``: how many first layers are dense (``first_k_dense_replace``; where it falls on a pipeline
    split)."""
    if not 1 <= first_k_dense < layers or experts % 4 or topk != 4:
        raise ValueError("glm4_moe_lite tiny model: 1 ≤ first_k_dense < layers (dense first, then MoE), experts a "
                         "multiple of 4, topk 4 (4 groups, 2 kept: transformers scores a group by its top 2)")
    moe_ffn = moe_ffn or hidden // 2
    return ModelArch(
        family="glm4_moe_lite", vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=ffn or 2 * hidden,
        num_layers=layers, num_attention_heads=heads, num_kv_heads=heads, head_dim=32 + qk_rope_head_dim,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=tie, max_position_embeddings=4096,
        num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn, norm_topk_prob=True,
        q_lora_rank=hidden // 2, kv_lora_rank=kv_lora_rank or hidden // 4, qk_nope_head_dim=32,
        qk_rope_head_dim=qk_rope_head_dim, v_head_dim=32,
        rope_interleave=True, moe_first_k_dense=first_k_dense, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_routed_scaling_factor=1.8, moe_shared_expert_ffn_hidden_size=moe_ffn,
    )


def qwen3_5_arch(*, hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2, vocab: int = 512,
                 ffn: int | None = None, tie: bool = False, head_dim: int | None = None) -> ModelArch:
    """A tiny Qwen3.5-shaped hybrid: linear attention and gated full attention alternating (``layer_types`` linear,
    full, linear, full, ...: every pipeline stage of an even split holds both kinds), head_dim 2·hidden/heads, RoPE
    on a quarter of it (partial_rotary_factor 0.25, Qwen3.5's), θ 1e7; linear attention with 2 key heads and 4 value
    heads (grouped values, as Qwen3.5) of 32 dims, conv kernel 4."""
    if layers < 2 or layers % 2:
        raise ValueError(f"qwen3_5 tiny model: an even number of layers ≥ 2 (linear and full alternate), not {layers}")
    return ModelArch(
        family="qwen3_5", vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=ffn or 2 * hidden, num_layers=layers,
        num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim or 2 * hidden // heads,
        rope_theta=10000000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie, max_position_embeddings=4096,
        qk_layernorm=True, layer_types=("linear_attention", "full_attention") * (layers // 2),
        partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4,
    )


def _write(out_dir: str, arch: ModelArch, *, seed: int, dtype: torch.dtype, router_std: float,
           bias_std: float = 0.0) -> str:
    """Tokenizer + transformers' random init of ``arch`` under ``seed`` (norms, biases, router and correction
    bias redrawn, see :func:`make_tiny_model`) → ``out_dir``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_tsync.model.hf_conversion import hf_config_dict

    vocab = arch.vocab_size
    if vocab % 8:
        raise ValueError(f"vocab {vocab} must be divisible by 8")
    os.makedirs(out_dir, exist_ok=True)
    tok = train_tokenizer(vocab, seed=seed)
    if tok.get_vocab_size() > vocab:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} entries > vocab {vocab}")
    ids = _save_tokenizer(tok, out_dir)
    tokens = {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}
    cfg = AutoConfig.for_model(**hf_config_dict(arch, extra=tokens))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():  # small random norms/biases make conversion bugs visible
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight") and arch.num_experts:  # the MoE router
                p.copy_(router_std * torch.randn_like(p))
            elif name.endswith("dt_bias"):  # transformers: ones (a TP mix-up of heads would not show)
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
        for name, b in model.named_buffers():  # sigmoid routing's correction bias: non-zero, so selection uses it
            if name.endswith("e_score_correction_bias") and bias_std:
                b.copy_(bias_std * torch.randn_like(b))
    state = {k: v for k, v in model.state_dict().items()}
    if arch.num_experts:  # transformers >= 5 fuses the experts in memory; checkpoints keep one tensor each
        from megatron_tsync.model.moe import unfuse_hf_experts

        state = unfuse_hf_experts(state, arch)
    save_hf_dir(out_dir, state, arch, extra_config=tokens)
    return out_dir
