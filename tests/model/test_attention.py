"""compat.SDPAttention (torch SDPA) equals megatron's unfused DotProductAttention in float64.

Both modules are built from one config (same constructor); the old one is the SDPA module with its class set back
to ``DotProductAttention`` (no extra state), so they share every attribute. Cases: plain causal (no mask),
left-padded boolean masks (the embedded engine's, with fully masked padding queries), a decode step (sq = 1
against a longer key range), the block-diagonal mask of a packed microbatch (``training.packing``; run as one
causal SDPA per segment), the same pack as THD ``PackedSeqParams``, and near-block masks that must not be taken for
one. Forward and input gradients agree
to ≤ 1e-12, GQA included. Controls: a wrong scale and a packed mask read as plain causal both move far past the
tolerance. Model-level checks: the default local spec builds SDPAttention, a full float64 model's log-probs and
gradients equal the old attention's, and a pack as THD params = as a block mask = as separate sequences.
"""

import math

import pytest
import torch

from megatron_tsync.model import compat
from megatron_tsync.training.packing import layout_for

TOL = 1e-12


def _pair(heads=4, groups=2, hn=16, causal=True):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    cfg, _ = compat.make_transformer_config(
        num_layers=1, hidden_size=heads * hn, num_attention_heads=heads, num_query_groups=groups, kv_channels=hn,
        attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False, params_dtype=torch.float64)
    cls = compat._sdpa_attention_class()
    kind = AttnMaskType.causal if causal else AttnMaskType.no_mask
    new = cls(cfg, layer_number=1, attn_mask_type=kind, attention_type="self")
    old = cls(cfg, layer_number=1, attn_mask_type=kind, attention_type="self")
    old.__class__ = DotProductAttention
    assert not new._fallback(None, None)  # the SDPA path runs, not megatron's computation
    return new, old


def _qkv(sq, b, heads, groups, hn, sk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    sk = sk or sq
    mk = lambda s, n: torch.randn(s, b, n, hn, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return mk(sq, heads), mk(sk, groups), mk(sk, groups)


def _diff(new, old, q, k, v, mask):
    outs, grads = [], []
    for mod in (new, old):
        o = mod(q, k, v, mask)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(7), dtype=o.dtype)
        outs.append(o)
        grads.append(torch.autograd.grad((o * w).sum(), (q, k, v)))
    assert outs[0].shape == outs[1].shape and torch.isfinite(outs[0]).all()
    fwd = (outs[0] - outs[1]).abs().max().item()
    bwd = max((a - b).abs().max().item() for a, b in zip(*grads))
    print(f"max |new - old|: output {fwd:.2g}, input grads {bwd:.2g}")
    return fwd, bwd


def _left_padded_mask(lens, L):
    key_pad = torch.arange(L)[None, :] < (L - torch.tensor(lens))[:, None]  # (R, L) True = pad
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    return (causal[None] | key_pad[:, None, :])[:, None]  # (R, 1, L, L), as rollout/embedded_engine.py builds it


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
def test_causal_no_mask(megatron_single, heads, groups):
    new, old = _pair(heads, groups)
    q, k, v = _qkv(37, 2, heads, groups, 16)
    fwd, bwd = _diff(new, old, q, k, v, None)
    assert fwd <= TOL and bwd <= TOL, (fwd, bwd)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_left_padded_mask(megatron_single, heads, groups):
    new, old = _pair(heads, groups)
    mask = _left_padded_mask([9, 5, 1], 9)  # rows with 0, 4 and 8 padding queries that see nothing
    assert mask.all(-1).any()
    q, k, v = _qkv(9, 3, heads, groups, 16, seed=1)
    fwd, bwd = _diff(new, old, q, k, v, mask)
    assert fwd <= TOL and bwd <= TOL, (fwd, bwd)


def test_decode_step_mask(megatron_single):
    new, old = _pair(4, 2, causal=False)  # megatron switches to no_mask in decode; the engine passes a mask
    mask = _left_padded_mask([7, 3], 8)[:, :, -1:, :]  # (R, 1, 1, 8): the last query against all keys
    q, k, v = _qkv(1, 2, 4, 2, 16, sk=8, seed=2)
    fwd, bwd = _diff(new, old, q, k, v, mask)
    assert fwd <= TOL and bwd <= TOL, (fwd, bwd)
    fwd, _ = _diff(new, old, q, k, v, None)  # unmasked decode
    assert fwd <= TOL


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_packed_block_mask(megatron_single, heads, groups):
    layout = layout_for([11, 1, 20, 6])
    mask = layout.block_causal_mask()
    assert compat._causal_segments(mask) == layout.segments()
    new, old = _pair(heads, groups)
    q, k, v = _qkv(layout.total, 1, heads, groups, 16, seed=3)
    fwd, bwd = _diff(new, old, q, k, v, mask)
    assert fwd <= TOL and bwd <= TOL, (fwd, bwd)
    # control: plain causal attention over the whole pack (segments not separated) is far off
    bad = (new(q, k, v, mask) - old(q, k, v, None)).abs().max().item()
    assert bad > 1e-3, bad


def test_near_block_mask_is_not_taken_for_segments(megatron_single):
    mask = layout_for([5, 7]).block_causal_mask().clone()
    mask[0, 0, 9, 2] = False  # one query of segment 2 also sees a key of segment 1
    assert compat._causal_segments(mask) is None
    new, old = _pair(4, 2)
    q, k, v = _qkv(12, 1, 4, 2, 16, seed=4)
    fwd, bwd = _diff(new, old, q, k, v, mask)
    assert fwd <= TOL and bwd <= TOL, (fwd, bwd)


def test_scale_control(megatron_single):
    new, old = _pair(4, 2)
    assert new.softmax_scale == 1.0 / math.sqrt(16)
    q, k, v = _qkv(13, 1, 4, 2, 16, seed=5)
    new.softmax_scale *= 1.01
    fwd, _ = _diff(new, old, q, k, v, None)
    assert fwd > 1e-4, fwd  # the comparison sees a 1% scale change


def test_model_logprobs_and_grads(megatron_single, tmp_path):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_tsync.model import hf_conversion as hc
    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.model.logprobs import token_logprobs
    from megatron_tsync.model.tiny_model import make_tiny_model

    arch, state = hc.load_hf_dir(make_tiny_model(str(tmp_path / "m"), family="llama", kv_heads=2, seed=3))
    model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=1)
    hc.load_hf_into_model(model, state)
    cores = [m for m in model.modules() if isinstance(m, DotProductAttention)]
    assert cores and all(type(m).__name__ == "SDPAttention" for m in cores)
    ids = torch.randint(0, arch.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    res = []
    for cls in (type(cores[0]), DotProductAttention):
        for m in cores:
            m.__class__ = cls
        model.zero_grad()
        lp = token_logprobs(model, ids)
        lp.sum().backward()
        res.append((lp.detach(), [p.grad.clone() if p.grad is not None else p.main_grad.clone()
                                  for p in model.parameters()]))
    assert (res[0][0] - res[1][0]).abs().max().item() <= TOL
    assert max((a - b).abs().max().item() for a, b in zip(res[0][1], res[1][1])) <= TOL


def test_thd_packing_module(megatron_single):
    """PackedSeqParams (THD, query (t, np, hn)) = the block-mask path, GQA; mismatched cu_seqlens are refused."""
    layout = layout_for([11, 1, 20, 6])
    new, old = _pair(4, 2)
    q, k, v = _qkv(layout.total, 1, 4, 2, 16, seed=6)
    psp = layout.packed_seq_params()
    thd = new(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=psp)  # (t, hp)
    ref = old(q, k, v, layout.block_causal_mask())  # (t, 1, hp)
    assert thd.shape == (layout.total, 64)
    assert (thd - ref[:, 0]).abs().max().item() <= TOL
    bad = layout_for([11, 1, 26]).packed_seq_params()
    psp.cu_seqlens_kv = bad.cu_seqlens_kv
    with pytest.raises(ValueError, match="cu_seqlens"):
        new(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=psp)


def test_model_packed_thd_equals_segments(megatron_single, tmp_path):
    """Whole float64 model: a pack given as THD params, as a block mask (+ per-token RoPE) and as separate
    sequences give the same logits and gradients."""
    from megatron_tsync.model import hf_conversion as hc
    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.model.tiny_model import make_tiny_model

    arch, state = hc.load_hf_dir(make_tiny_model(str(tmp_path / "m"), family="qwen3", kv_heads=2, seed=4))
    model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=1)
    hc.load_hf_into_model(model, state)
    compat.install_per_token_rope(model)
    layout = layout_for([17, 5, 30])
    ids = torch.randint(0, arch.vocab_size, (1, layout.total), generator=torch.Generator().manual_seed(1))
    pos = layout.position_ids()
    w = torch.randn(1, layout.total, arch.vocab_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def run(kind):
        model.zero_grad()
        if kind == "thd":
            out = model(ids, pos[None], None, packed_seq_params=layout.packed_seq_params())
        elif kind == "mask":
            with compat.rope_positions(model, pos):
                out = model(ids, pos[None], layout.block_causal_mask())
        else:
            out = torch.cat([model(ids[:, a:b], torch.arange(b - a)[None], None) for a, b in layout.segments()], 1)
        (out * w).sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ref = run("segments")
    for kind in ("thd", "mask"):
        out, grads = run(kind)
        assert (out - ref[0]).abs().max().item() <= TOL, kind
        assert len(grads) == len(ref[1]) and max((a - b).abs().max().item() for a, b in zip(grads, ref[1])) <= TOL


def test_segment_detection_cases(megatron_single):
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1).view(1, 1, 6, 6)
    assert compat._causal_segments(causal) == [(0, 6)]
    assert compat._causal_segments(layout_for([1, 1, 3]).block_causal_mask()) == [(0, 1), (1, 2), (2, 5)]
    assert compat._causal_segments(torch.zeros(1, 1, 6, 6, dtype=torch.bool)) is None  # no mask at all
    assert compat._causal_segments(_left_padded_mask([4], 6)) is None  # padding queries see nothing
    assert compat._causal_segments(_left_padded_mask([4, 6], 6)) is None  # batch of masks: not searched
    shifted = layout_for([3, 3]).block_causal_mask().clone()
    shifted[0, 0, 4, 3] = True  # a hole inside segment 2's triangle
    assert compat._causal_segments(shifted) is None
    cached = layout_for([2, 4]).block_causal_mask()
    assert compat._causal_segments(cached) == [(0, 2), (2, 6)]
    cached[0, 0, 5, 0] = False  # changed in place: the cache sees the new version
    assert compat._causal_segments(cached) is None


def test_fallbacks_to_megatron(megatron_single):
    from megatron.core.packed_seq_params import PackedSeqParams

    new, old = _pair(4, 2)
    new.train()
    new.attention_dropout.p = 0.1
    assert new._fallback(None, None)  # dropout while training: megatron's RNG-tracked dropout
    new.eval()
    assert not new._fallback(None, None)
    assert new._fallback(None, PackedSeqParams(qkv_format="sbhd"))
    assert new._fallback(torch.zeros(1), None)


def test_spec_functions_choose_the_attention(megatron_single):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    core = lambda spec: spec.submodules.self_attention.submodules.core_attention  # noqa: E731
    assert core(compat.local_layer_spec()).__name__ == "SDPAttention"
    assert core(compat.local_layer_spec(qk_layernorm=True, sdpa=False)) is DotProductAttention
    assert core(compat.local_moe_layer_spec(4)).__name__ == "SDPAttention"
    assert core(compat.local_moe_layer_spec(4, sdpa=False)) is DotProductAttention
