"""Fused core attention for the local layer spec (CPU): torch SDPA instead of megatron's unfused baddbmm + softmax.

:func:`use_sdpa_attention` puts :class:`SDPAttention` into a local layer spec (``compat.local_layer_spec`` does by
default); megatron is imported only when the class is first made.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["PREFIX_TREE_ATTR", "SDPAttention", "use_sdpa_attention"]

_SEGMENT_CACHE: list = [None, -1, None]  # [weakref to the last mask, its _version, its segments or None]
_MAX_SEGMENTS = 4096  # more segments than this: not searched for (the generic masked SDPA, still exact)


def _causal_segments(mask: torch.Tensor) -> list[tuple[int, int]] | None:
    """Segments ``[(a, b), ...]`` when ``mask`` ((1, 1, T, T) bool, True = masked) is exactly block-diagonal causal
    (query i sees key j iff j ≤ i in the same segment: ``training.packing``'s packed mask; one segment = plain
    causal); None otherwise. Segment starts are read off the subdiagonal (query i sees key i − 1 iff both lie in
    one segment), then every entry is checked (one read of the mask, no T×T temporaries); cached for the mask object
    that every layer of a forward receives."""
    import weakref

    ref, version, segs = _SEGMENT_CACHE
    if ref is not None and ref() is mask and version == mask._version:
        return segs
    segs = None
    if mask.dim() == 4 and mask.shape[0] == 1 and mask.shape[1] == 1 and mask.shape[2] == mask.shape[3] > 0:
        m = mask[0, 0]  # (T, T)
        n = m.shape[0]
        heads = [0] + (torch.diagonal(m, -1).nonzero().flatten() + 1).tolist()  # (i, i-1) masked: i starts one
        if len(heads) <= _MAX_SEGMENTS:
            bounds = list(zip(heads, heads[1:] + [n]))
            tri = {}
            ok = True
            for a, b in bounds:
                if b - a not in tri:
                    tri[b - a] = torch.ones(b - a, b - a, dtype=torch.bool, device=m.device).triu(1)
                ok = (torch.equal(m[a:b, a:b], tri[b - a]) and bool(m[a:b, :a].all()) and bool(m[a:b, b:].all()))
                if not ok:
                    break
            segs = bounds if ok else None
    _SEGMENT_CACHE[:] = [weakref.ref(mask), mask._version, segs]
    return segs


def _sdpa_masked(q, k, v, mask, scale, gqa):
    """SDPA with an explicit boolean mask (True = masked, broadcastable to (b, np, sq, sk)). A query that sees no
    key gets megatron's result there (all scores filled with −10000: the uniform average of the values) instead of
    SDPA's zeros, so every row equals :class:`DotProductAttention`'s."""
    full = mask.all(dim=-1, keepdim=True)  # (.., sq, 1) queries that see nothing
    any_full = bool(full.any())
    visible = ~(mask & ~full) if any_full else ~mask
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)
    if any_full:
        vmean = v.mean(dim=2, keepdim=True)  # (b, ng, 1, hn)
        if gqa:
            vmean = vmean.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out = torch.where(full, vmean, out)
    return out


class _SDPAForward:
    """The forward of :class:`SDPAttention` (mixed into megatron's ``DotProductAttention`` by
    :func:`_sdpa_attention_class`, so that this module imports no megatron)."""

    def _fallback(self, attention_bias, packed_seq_params) -> bool:
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        return (attention_bias is not None or (packed_seq_params is not None and not thd)
                or self.softmax_offset is not None or self.scale_mask_softmax.window_size is not None
                or self.config.apply_query_key_layer_scaling or (self.training and self.attention_dropout.p > 0))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """(sq, b, np, hn) queries, (sk, b, ng, hn) keys/values -> (sq, b, hp); THD: (t, ·, hn) -> (t, hp). Like
        megatron's, the mask type is the one the module was built with (``attn_mask_type`` is not read)."""
        from megatron.core.transformer.enums import AttnMaskType

        if self._fallback(attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        if packed_seq_params is not None:
            return self._thd(query, key, value, packed_seq_params)
        sq, b, sk = query.shape[0], query.shape[1], key.shape[0]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads, s, hn)
        gqa = q.shape[1] != k.shape[1]
        sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, scale=self.softmax_scale,
                                 enable_gqa=gqa)
        if attention_mask is None:
            causal = self.attn_mask_type == AttnMaskType.causal and sq > 1
            if causal and sq != sk:
                raise ValueError(f"causal attention without a mask needs sq == sk (got {sq}, {sk})")
            out = sdpa(q, k, v, is_causal=causal)
        else:
            if attention_mask.dtype != torch.bool:
                raise TypeError(f"attention_mask must be boolean (True = masked), got {attention_mask.dtype}")
            tree = getattr(attention_mask, PREFIX_TREE_ATTR, None)  # (prefix, continuation lengths) or None
            segs = _causal_segments(attention_mask) if sq == sk and tree is None else None
            if tree is not None and sq == sk == tree[0] + sum(tree[1]):
                out = _prefix_tree(sdpa, q, k, v, *tree)
            elif segs is not None and len(segs) == 1:
                out = sdpa(q, k, v, is_causal=True)
            elif segs is not None:
                out = _per_segment(sdpa, q, k, v, [e - a for a, e in segs], is_causal=True)
            else:
                out = _sdpa_masked(q, k, v, attention_mask, self.softmax_scale, gqa)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)  # (sq, b, hp)

    def _thd(self, query, key, value, psp):
        """THD packing (``PackedSeqParams``, query (t, np, hn)): one causal SDPA per segment -> (t, hp)."""
        from megatron.core.transformer.enums import AttnMaskType

        cu_q, cu_k = psp.cu_seqlens_q, psp.cu_seqlens_kv
        padded = (psp.cu_seqlens_q_padded, psp.cu_seqlens_kv_padded)
        if not torch.equal(cu_q, cu_k) or any(c is not None and not torch.equal(c, cu_q) for c in padded):
            raise ValueError("SDPAttention (THD): cu_seqlens_q, cu_seqlens_kv and their padded forms must agree")
        if self.attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention (THD) supports causal self-attention only, not {self.attn_mask_type}")
        q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))  # (1, heads, t, hn)
        bounds = cu_q.tolist()
        sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, scale=self.softmax_scale,
                                 enable_gqa=q.shape[1] != k.shape[1], is_causal=True)
        out = _per_segment(sdpa, q, k, v, [e - a for a, e in zip(bounds, bounds[1:])])  # (1, np, t, hn)
        return out[0].permute(1, 0, 2).reshape(query.shape[0], self.hidden_size_per_partition)


PREFIX_TREE_ATTR = "tsync_prefix_tree"  # set on a shared-prefix mask (training.packing.PrefixLayout.mask)


def _prefix_tree(sdpa, q, k, v, prefix: int, lengths: list[int]):
    """A shared-prefix mask's attention by blocks: the prefix causally, then each continuation over the prefix's
    keys and its own (causal), never another continuation's; the mask's own result (every query sees at least
    itself), without a (T, T) score matrix: time and memory prefix² + Σ_k s_k·(prefix + s_k)."""
    qs, ks, vs = (torch.split(t, [prefix, *lengths], dim=2) for t in (q, k, v))
    parts = [sdpa(qs[0], ks[0], vs[0], is_causal=True)]
    for qi, ki, vi in zip(qs[1:], ks[1:], vs[1:]):
        s = qi.shape[2]
        seen = torch.ones(s, prefix + s, dtype=torch.bool, device=q.device)
        seen[:, prefix:] = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        parts.append(sdpa(qi, torch.cat([ks[0], ki], dim=2), torch.cat([vs[0], vi], dim=2), attn_mask=seen))
    return torch.cat(parts, dim=2)


def _per_segment(sdpa, q, k, v, lengths: list[int], **kw):
    """One SDPA per segment along dim 2, concatenated. ``torch.split``, not slicing: a slice's backward fills a zero
    tensor of the whole pack per segment (64 segments: 1,188 fills, a third of a quickstart sync step); split's
    backward is one concatenation."""
    if sum(lengths) != q.shape[2]:
        raise ValueError(f"segments cover {sum(lengths)} positions of a {q.shape[2]}-token pack")
    parts = zip(*(torch.split(t, lengths, dim=2) for t in (q, k, v)))
    return torch.cat([sdpa(qs, ks, vs, **kw) for qs, ks, vs in parts], dim=2)


_SDPA_DOC = """megatron's ``DotProductAttention`` (same constructor, forward signature, softmax scale, mask convention
    True = masked, and state) computed by ``torch.nn.functional.scaled_dot_product_attention``: no (b·np, sq, sk)
    score buffer, memory linear in the length.

    - no mask: ``is_causal`` for causal self-attention (sq == sk > 1), else unmasked (decode steps, sq = 1);
    - a block-diagonal causal mask (sequence packing, ``training.packing.block_causal_mask``): one causal SDPA per
      segment (exact; the pack's attention costs the sum of its segments' instead of the whole pack's);
    - THD ``PackedSeqParams`` (``cu_seqlens``): the same per-segment SDPA, no T×T mask at all;
    - any other boolean mask (left-padding, KV-cache decode): SDPA with that mask; a query that sees no key gets
      megatron's result there (the uniform average of the values), not SDPA's zeros;
    - GQA: SDPA's ``enable_gqa`` (no repeated keys/values).

    Falls back to megatron's computation where SDPA would differ: sliding windows, softmax offsets (off-by-one,
    learnable), query-key layer scaling, attention dropout while training, attention bias, non-THD packed params.
    """


def _sdpa_attention_class():
    """:class:`SDPAttention`, made on first use (megatron imports only when a spec is built)."""
    global SDPAttention
    if SDPAttention is None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        SDPAttention = type("SDPAttention", (_SDPAForward, DotProductAttention),
                            {"__doc__": _SDPA_DOC, "__module__": __name__})
    return SDPAttention


SDPAttention = None  # the class, once _sdpa_attention_class() ran


def use_sdpa_attention(spec, enabled: bool = True):
    """``spec`` (a local layer spec) with :class:`SDPAttention` as its core attention (in place); returned."""
    if enabled:
        spec.submodules.self_attention.submodules.core_attention = _sdpa_attention_class()
    return spec
