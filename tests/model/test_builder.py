"""build_model in float64 is float64 throughout, RoPE frequencies included.

The reference is a plain-torch decoder written here from the Hugging Face weights (no transformers: it computes
RoPE frequencies in float32), every operation in float64; its RoPE inverse frequencies come from Python floats
element by element (``math``), independently of the compat layer's tensor formula. Megatron's float64 log-probs
must equal it to ≤ 1e-13 for Llama, Qwen2 (QKV bias, tied, MQA), Qwen3 (QK-norm, head_dim ≠ hidden/heads) and a
Llama with llama3 RoPE scaling. Control: megatron-core's own float32-computed frequencies cast to float64 (what
the builder did before) are ~1e-7 off, so the test can fail. fp32/bf16 keep megatron's float32 frequencies.
"""

import math
import os

import pytest
import torch

from megatron_tsync.model import compat
from megatron_tsync.model import hf_conversion as hc
from megatron_tsync.model.builder import PrecisionConfig, build_model, rope_inv_freq

FAMILIES = {  # name -> make_tiny_model kwargs
    "llama": dict(family="llama", kv_heads=2, seed=11),
    "qwen2": dict(family="qwen2", kv_heads=1, tie=True, seed=12),
    "qwen3": dict(family="qwen3", kv_heads=2, head_dim=64, seed=13),
    "llama3": dict(family="llama3", kv_heads=2, seed=14),
}
TOL = 1e-13
F64 = PrecisionConfig(params_dtype=torch.float64)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    root = str(tmp_path_factory.mktemp("tiny_f64"))
    return {n: make_tiny_model(os.path.join(root, n), **kw) for n, kw in FAMILIES.items()}


def reference_inv_freq(arch) -> torch.Tensor:
    """(head_dim/2,) float64 inverse frequencies, element by element in Python floats (llama3: Llama 3.1's rule)."""
    out = []
    for i in range(0, arch.head_dim, 2):
        f = 1.0 / arch.rope_theta ** (i / arch.head_dim)
        if arch.rope_type == "llama3":
            wavelen = 2 * math.pi / f
            lo_wl = arch.rope_original_max_position_embeddings / arch.rope_low_freq_factor
            hi_wl = arch.rope_original_max_position_embeddings / arch.rope_high_freq_factor
            if wavelen > lo_wl:
                f = f / arch.rope_factor
            elif wavelen >= hi_wl:
                s = ((arch.rope_original_max_position_embeddings / wavelen - arch.rope_low_freq_factor)
                     / (arch.rope_high_freq_factor - arch.rope_low_freq_factor))
                f = (1 - s) * f / arch.rope_factor + s * f
        out.append(f)
    return torch.tensor(out, dtype=torch.float64)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, cos, sin):  # x (B, h, S, d); HF's rotate_half convention (halves, not interleaved)
    d = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., d:], x[..., :d]), dim=-1) * sin


def reference_logprobs(arch, state, ids: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """(B, S) -> (B, S-1) next-token log-probs of the HF decoder ``state``, float64 throughout."""
    w = {k: v.to(torch.float64) for k, v in state.items()}
    B, S = ids.shape
    nh, nkv, hd = arch.num_attention_heads, arch.num_kv_heads, arch.head_dim
    freqs = torch.outer(torch.arange(S, dtype=torch.float64), inv_freq)  # (S, d/2)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()  # (S, d)
    mask = torch.full((S, S), float("-inf"), dtype=torch.float64).triu(1)
    x = w["model.embed_tokens.weight"][ids]  # (B, S, H)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], arch.rms_norm_eps)

        def proj(name, heads):
            y = h @ w[p + f"self_attn.{name}_proj.weight"].T
            if arch.qkv_bias:
                y = y + w[p + f"self_attn.{name}_proj.bias"]
            return y.view(B, S, heads, hd).transpose(1, 2)  # (B, heads, S, d)

        q, k, v = proj("q", nh), proj("k", nkv), proj("v", nkv)
        if arch.qk_layernorm:
            q = _rms(q, w[p + "self_attn.q_norm.weight"], arch.rms_norm_eps)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], arch.rms_norm_eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1) @ v  # (B, nh, S, d)
        x = x + att.transpose(1, 2).reshape(B, S, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], arch.rms_norm_eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], arch.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if arch.tie_word_embeddings else w["lm_head.weight"]
    logp = torch.log_softmax(x @ head.T, -1)  # (B, S, V)
    return logp[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def _ids(vocab, rows=2, length=96, seed=0):
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))  # (B, S)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_float64_logprobs_equal_float64_reference(megatron_single, models, name):
    from megatron_tsync.model.logprobs import token_logprobs

    arch, state = hc.load_hf_dir(models[name])
    ref_freq = reference_inv_freq(arch)
    model = build_model(arch, F64, seed=1)
    hc.load_hf_into_model(model, state)
    model.eval()
    rope = model.rotary_pos_emb
    assert rope.inv_freq.dtype == torch.float64
    freq_err = ((rope.inv_freq - ref_freq).abs() / ref_freq).max().item()
    ids = _ids(arch.vocab_size)
    ref = reference_logprobs(arch, state, ids, ref_freq)
    with torch.no_grad():
        err = (token_logprobs(model, ids) - ref).abs().max().item()
        # control: megatron-core's float32 frequencies cast to float64 (the old builder path)
        f32 = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2, dtype=torch.float32) / arch.head_dim))
        if arch.rope_type == "llama3":
            f32 = rope_inv_freq(arch, torch.float32)
        compat.set_rope_inv_freq(model, f32.to(torch.float64))
        old = (token_logprobs(model, ids) - ref).abs().max().item()
    print(f"{name}: inv_freq rel err {freq_err:.2g}; log-prob max |diff| float64 RoPE {err:.2g}, "
          f"float32 RoPE (old path) {old:.2g}")
    assert freq_err <= 1e-15
    assert err <= TOL
    assert old > 1000 * TOL, old  # the control must move: float32 frequencies are 1e-9..1e-7 off here


def test_rope_inv_freq_dtypes():
    from megatron_tsync.model.builder import ModelArch

    arch = ModelArch(family="llama", vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=1,
                     num_attention_heads=2, num_kv_heads=2, head_dim=32, rope_theta=1e6)
    assert rope_inv_freq(arch, torch.float32) is None  # fp32 / bf16: megatron's own frequencies, unchanged
    f64 = rope_inv_freq(arch, torch.float64)
    assert f64.dtype == torch.float64
    assert torch.allclose(f64, reference_inv_freq(arch), rtol=1e-15, atol=0)
    assert not torch.equal(f64, f64.to(torch.float32).to(torch.float64))  # genuinely float64 digits
    l3 = ModelArch(**{**arch.__dict__, "rope_type": "llama3", "rope_factor": 8.0,
                      "rope_original_max_position_embeddings": 64})
    assert rope_inv_freq(l3, torch.float32).dtype == torch.float32  # bitwise transformers' (test_qwen3)
    assert torch.allclose(rope_inv_freq(l3, torch.float64), reference_inv_freq(l3), rtol=1e-15, atol=0)


@pytest.mark.parametrize("bf16", [False, True])
def test_fp32_bf16_keep_float32_frequencies(megatron_single, models, bf16):
    arch, _ = hc.load_hf_dir(models["qwen3"])
    model = build_model(arch, PrecisionConfig(bf16=bf16), seed=1)
    plain = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2, dtype=torch.float32) / arch.head_dim))
    assert model.rotary_pos_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.rotary_pos_emb.inv_freq, plain)
