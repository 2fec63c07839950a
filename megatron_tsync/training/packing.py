"""Sequence packing: several trajectories in one microbatch, each attending only to itself.

A packed microbatch is the concatenation of trajectories (segments) into one sequence of ``T = Σ T_k`` tokens.
Attention is block-diagonal causal (segment k's tokens see only earlier tokens of segment k) and RoPE positions
restart at 0 in every segment, so every segment's logits equal those of its unpacked forward (up to summation
order inside the attention softmax: masked entries contribute exactly 0). The executor then adds one loss term per
segment with that trajectory's own ν_i, advantage and clip mask; the backward of the sum is the sum of the
per-trajectory backwards — provided all segments share the gradient destination, which :func:`share_key` and
:func:`plan_microbatches` guarantee.

Two attention implementations, keyed on the layer spec in use (:func:`uses_te_attention`):

- local spec (CPU, megatron's ``DotProductAttention``): an explicit ``(1, 1, T, T)`` boolean mask (True = masked
  out; megatron fills it with −10000 before the softmax) and per-token RoPE positions
  (``compat.rope_positions``: megatron-core 0.16's ``RotaryEmbedding`` ignores ``position_ids``). Memory and time
  are O(T²) per head, like unpacked attention of the whole pack.
- Transformer Engine spec (GPU): THD format, ``PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv, max_seqlen)``,
  no T×T mask; RoPE restarts per segment inside megatron (``apply_rotary_pos_emb`` with ``cu_seqlens``). With FP8
  the pack is padded to a multiple of 16 tokens by a dummy segment that no loss term reads. **This branch only runs
  on a GPU and has not been run in this repository's CPU tests** (``tools/gpu_smoke.py`` checks it).

Pure bookkeeping plus tensor construction: no megatron schedule, no gradient routing here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Sequence

import torch

from megatron_tsync.streaming.planner import Dest, WorkItem


def share_key(item: WorkItem) -> Hashable | None:
    """Items with equal keys may share one backward (their gradients land in the same place the same way).

    - Accumulator items (advantage known, or the aux-only second pass): the pre-backward hook only routes to the
      batch accumulator; advantages and ν_i live in each segment's loss term → they all share ``("accum",)``.
    - Bucket items: ``GroupBuckets.enter(group, reward)`` moves the group's origin to ``reward`` before the
      backward; a second ``enter`` with the same reward is a no-op, with another reward it shifts P by
      (ρ − r)·Q, which must happen *between* the two backwards → only items of one group *with equal rewards*
      share (``("bucket", group, reward)``; binary rewards make that common).
    """
    if item.dest is Dest.ACCUM:
        return ("accum",)
    if item.dest is Dest.BUCKET and item.policy and not item.aux:
        return ("bucket", item.group_id, float(item.reward))
    return None


def plan_microbatches(items: Sequence[WorkItem], length: Callable[[WorkItem], int],
                      max_tokens: int | None) -> list[list[WorkItem]]:
    """Group ``items`` into microbatches of at most ``max_tokens`` tokens (first fit, in order).

    Each item goes into the first open microbatch with the same :func:`share_key` that still has room; an item
    longer than ``max_tokens``, or one without a key, is a microbatch of its own. Microbatches come out in the
    order of their first item; within one, items keep their order. ``max_tokens`` None or ≤ 0: no packing.
    """
    if not max_tokens or max_tokens <= 0:
        return [[it] for it in items]
    packs: list[list[WorkItem]] = []
    fill: list[int] = []
    keys: list[Hashable | None] = []
    for it in items:
        n, k = length(it), share_key(it)
        for j in range(len(packs)):
            if k is not None and keys[j] == k and fill[j] + n <= max_tokens:
                packs[j].append(it)
                fill[j] += n
                break
        else:
            packs.append([it])
            fill.append(n)
            keys.append(k)
    return packs


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """Segment lengths of one packed microbatch (a trailing padding segment, if any, is counted separately)."""

    lengths: tuple[int, ...]
    pad: int = 0  # dummy tokens appended as their own segment (THD + FP8 alignment); read by no loss term

    @property
    def total(self) -> int:
        return sum(self.lengths) + self.pad

    @property
    def offsets(self) -> list[int]:
        """Start of each segment, plus the end of the last real one."""
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out

    def segments(self) -> list[tuple[int, int]]:
        o = self.offsets
        return [(o[k], o[k + 1]) for k in range(len(self.lengths))]

    def cu_seqlens(self) -> list[int]:
        """Cumulative segment boundaries including the padding segment: (K + 1,) or (K + 2,)."""
        o = self.offsets
        return o + [o[-1] + self.pad] if self.pad else o

    def position_ids(self, device=None) -> torch.Tensor:
        """(T,) long: 0..T_k−1 in every segment."""
        parts = [torch.arange(n, device=device) for n in self.lengths]
        if self.pad:
            parts.append(torch.arange(self.pad, device=device))
        return torch.cat(parts)

    def block_causal_mask(self, device=None) -> torch.Tensor:
        """(1, 1, T, T) bool, True = masked out (megatron's convention): query i may see key j iff j ≤ i and both
        lie in the same segment."""
        seg = torch.repeat_interleave(torch.arange(len(self.lengths) + (1 if self.pad else 0), device=device),
                                      torch.tensor(list(self.lengths) + ([self.pad] if self.pad else []),
                                                   device=device))  # (T,)
        idx = torch.arange(self.total, device=device)
        allowed = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])  # (T, T)
        return (~allowed).view(1, 1, self.total, self.total)

    def packed_seq_params(self, device=None):
        """THD ``PackedSeqParams`` for Transformer Engine attention (GPU)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.tensor(self.cu_seqlens(), dtype=torch.int32, device=device)  # (K + 1,)
        longest = max(list(self.lengths) + ([self.pad] if self.pad else []))
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                               max_seqlen_kv=longest)


def layout_for(lengths: Sequence[int], *, align: int = 1) -> PackLayout:
    """Layout of segments ``lengths``, padded to a multiple of ``align`` tokens by a dummy segment."""
    total = sum(lengths)
    pad = (-total) % align if align > 1 else 0
    return PackLayout(tuple(int(n) for n in lengths), pad)


def uses_te_attention(model) -> bool:
    """Whether ``model``'s attention is Transformer Engine's (THD packing) or megatron's local one (T×T mask)."""
    return any(type(m).__name__ == "TEDotProductAttention" for m in model.modules())
