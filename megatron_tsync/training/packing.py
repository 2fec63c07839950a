"""Sequence packing: several trajectories in one microbatch, each attending only to itself.

A packed microbatch is the concatenation of trajectories (segments) into one sequence of ``T = Σ T_k`` tokens.
Attention is block-diagonal causal (segment k's tokens see only earlier tokens of segment k) and RoPE positions
restart at 0 in every segment, so every segment's logits equal those of its unpacked forward (up to summation
order inside the attention softmax: masked entries contribute exactly 0). The executor then adds one loss term per
segment with that trajectory's own ν_i, advantage and clip mask; the backward of the sum is the sum of the
per-trajectory backwards — provided all segments share the gradient destination, which :func:`share_key` and
:func:`plan_microbatches` guarantee; or, with ``--pack-across-groups`` (:func:`mix_key`), the executor splits the
weight gradients by rows so that each segment's terms reach its own destination (``model.row_split``).

Two attention formats, keyed on the layer spec's core attention (:func:`uses_varlen_attention`):

- THD, ``PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv, max_seqlen)``, no T×T mask; RoPE restarts per segment
  inside megatron (``apply_rotary_pos_emb`` with ``cu_seqlens``). Used with Transformer Engine's attention (GPU; with
  FP8 the pack is padded to a multiple of 16 tokens by a dummy segment that no loss term reads — run only by
  ``tools/gpu_smoke.py``) and with the local spec's ``compat.SDPAttention`` (CPU: one causal SDPA per segment, time
  and memory linear in the pack; the default local spec).
- An explicit ``(1, 1, T, T)`` boolean mask (True = masked out) and per-token RoPE positions
  (``compat.rope_positions``: megatron-core 0.16's ``RotaryEmbedding`` ignores ``position_ids``), for megatron's own
  ``DotProductAttention`` (``local_layer_spec(sdpa=False)``): O(T²) memory and time per head.

Pure bookkeeping plus tensor construction: no megatron schedule, no gradient routing here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Sequence

import torch

from megatron_tsync.model import compat
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


def mix_key(item: WorkItem) -> Hashable | None:
    """:func:`share_key` for row-split microbatches (``model.row_split``): every item that has a share key may share
    a backward with any other, whatever its destination; the rest still run alone."""
    return None if share_key(item) is None else ("mixed",)


def plan_microbatches(items: Sequence[WorkItem], length: Callable[[WorkItem], int], max_tokens: int | None,
                      key: Callable[[WorkItem], Hashable | None] | None = None) -> list[list[WorkItem]]:
    """Group ``items`` into microbatches of at most ``max_tokens`` tokens (first fit, in order).

    Each item goes into the first open microbatch with the same :func:`share_key` that still has room; an item
    longer than ``max_tokens``, or one without a key, is a microbatch of its own. Microbatches come out in the
    order of their first item; within one, items keep their order. ``max_tokens`` None or ≤ 0: no packing.
    ``key``: the share key (default :func:`share_key`; :func:`mix_key` for row-split microbatches).
    """
    if not max_tokens or max_tokens <= 0:
        return [[it] for it in items]
    packs: list[list[WorkItem]] = []
    fill: list[int] = []
    keys: list[Hashable | None] = []
    for it in items:
        n, k = length(it), (key or share_key)(it)
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

    def starts(self) -> list[int]:
        """Where in its trajectory each segment starts (0: a packed segment is the whole trajectory)."""
        return [0] * len(self.lengths)

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


def uses_varlen_attention(model) -> bool:
    """Whether ``model``'s core attention takes THD packed sequences (Transformer Engine's, or the local spec's
    ``compat.SDPAttention``) rather than a T×T mask (megatron's ``DotProductAttention``)."""
    return any(type(m).__name__ in ("TEDotProductAttention", "SDPAttention") for m in model.modules())


# ------------------------------------------------------------------------------------------------ shared prefix
@dataclasses.dataclass(frozen=True)
class PrefixLayout:
    """A shared-prefix microbatch: a group's common prompt once (its first ``prefix`` tokens), then each
    trajectory's continuation from token ``prefix`` on. A continuation attends to the whole prefix and causally to
    itself, never to another continuation; its positions continue the prefix's (RoPE sees the positions of the
    unshared sequence). The prefix stops one token before the first action token, so every scored log-prob comes
    from a continuation's own position: the prefix's logits are never read, and its forward and backward run once
    for the whole pack (the backward receives the sum of the continuations' gradients)."""

    prefix: int  # o >= 1: the shared tokens
    lengths: tuple[int, ...]  # T_i of each trajectory (> prefix)
    pad: int = 0  # dummy tokens at the end (a multiple of TP under sequence parallelism); read by no loss term

    @property
    def total(self) -> int:
        return self.prefix + sum(n - self.prefix for n in self.lengths) + self.pad

    def aligned(self, align: int) -> "PrefixLayout":
        """This layout padded to a multiple of ``align`` tokens (TP under sequence parallelism)."""
        return dataclasses.replace(self, pad=(self.pad - self.total) % align)

    def segments(self) -> list[tuple[int, int]]:
        """Each continuation's (start, end) in the microbatch."""
        out, a = [], self.prefix
        for n in self.lengths:
            out.append((a, a + n - self.prefix))
            a += n - self.prefix
        return out

    def starts(self) -> list[int]:
        return [self.prefix] * len(self.lengths)

    def token_ids(self, tokens: Sequence[torch.Tensor]) -> torch.Tensor:
        """(T,) the microbatch's tokens from the trajectories' (their first ``prefix`` tokens must agree)."""
        return torch.cat([tokens[0][: self.prefix]] + [t[self.prefix:] for t in tokens]
                         + [tokens[0].new_zeros(self.pad)])

    def position_ids(self, device=None) -> torch.Tensor:
        return torch.cat([torch.arange(self.prefix, device=device)]
                         + [torch.arange(self.prefix, n, device=device) for n in self.lengths]
                         + [torch.arange(self.prefix, self.prefix + self.pad, device=device)])

    def mask(self, device=None) -> torch.Tensor:
        """(1, 1, T, T) bool, True = masked out: prefix causal; continuation k sees the prefix and itself causally
        (the padding too, as one more continuation)."""
        o = self.prefix
        conts = [n - o for n in self.lengths] + ([self.pad] if self.pad else [])
        seg = torch.repeat_interleave(torch.arange(len(conts) + 1, device=device),
                                      torch.tensor([o] + conts, device=device))  # (T,)
        idx = torch.arange(self.total, device=device)
        allowed = ((seg[:, None] == seg[None, :]) | (seg[None, :] == 0)) & (idx[None, :] <= idx[:, None])
        mask = (~allowed).view(1, 1, self.total, self.total)
        # compat.SDPAttention reads the structure off the mask and attends block by block (no T×T scores)
        setattr(mask, compat.PREFIX_TREE_ATTR, (self.prefix, conts))
        return mask


def prompt_length(loss_mask: torch.Tensor) -> int:
    """Tokens before the first action token (the whole length when nothing is trained)."""
    nz = torch.nonzero(loss_mask).flatten()
    return int(nz[0]) if nz.numel() else int(loss_mask.numel())


def plan_shared_prefix(items: Sequence[WorkItem], tokens: Callable[[WorkItem], torch.Tensor],
                       mask: Callable[[WorkItem], torch.Tensor], max_tokens: int,
                       routing: Callable[[WorkItem], torch.Tensor | None] | None = None
                       ) -> tuple[list[tuple[list[WorkItem], PrefixLayout]], list[WorkItem], int]:
    """Shared-prefix microbatches of ``items``: members of one group with one :func:`share_key` whose prompts
    agree (the longest common prompt less its last token, >= 1 token), at least two per microbatch, at most
    ``max_tokens`` tokens each. ``routing`` (router replay): each item's engine routing; members share only with
    members whose prompt positions route alike (``moe.prompt_routing``; the engine prefilled each member's prompt,
    and float rounding of another batch can flip a near-tie) — one trajectory's routing is never replayed for
    another's prompt. Returns (packs with their layouts, the items left over in their order, the number of members
    kept from their group's most common prompt routing — they share among themselves or run unshared)."""
    by_key: dict[Hashable, list[WorkItem]] = {}
    for it in items:
        k = share_key(it)
        if k is not None:
            by_key.setdefault((it.group_id, k), []).append(it)
    packs, split = [], 0
    for members in by_key.values():
        if len(members) < 2:
            continue
        first = tokens(members[0])
        o = min(prompt_length(mask(it)) for it in members) - 1
        same = [it for it in members if o >= 1 and torch.equal(tokens(it)[:o], first[:o])]
        classes = _by_prompt_routing(same, lambda it: tokens(it).numel(), routing, o) if routing else [same]
        split += len(same) - max(map(len, classes), default=0)
        for cls in classes:
            packs += _prefix_chunks(cls, tokens, o, max_tokens)
    used = {it.traj_id for p, _ in packs for it in p}
    return packs, [it for it in items if it.traj_id not in used], split


def _by_prompt_routing(members: list[WorkItem], length: Callable[[WorkItem], int],
                       routing: Callable[[WorkItem], torch.Tensor | None], o: int) -> list[list[WorkItem]]:
    """``members`` split by the experts their first ``o`` positions replay (in order of first appearance)."""
    from megatron_tsync.model.moe import prompt_routing

    classes: dict[Hashable, list[WorkItem]] = {}
    for it in members:
        r = prompt_routing(routing(it), length(it), o)
        classes.setdefault(None if r is None else r.to(torch.int16).numpy().tobytes(), []).append(it)
    return list(classes.values())


def _prefix_chunks(members: list[WorkItem], tokens: Callable[[WorkItem], torch.Tensor], o: int,
                   max_tokens: int) -> list[tuple[list[WorkItem], PrefixLayout]]:
    """Greedy chunks of ``members`` (prefix ``o``) under ``max_tokens``; a chunk of one is left unshared."""
    packs, cur = [], []
    for it in members + [None]:
        n = 0 if it is None else tokens(it).numel() - o
        if cur and (it is None or o + sum(tokens(c).numel() - o for c in cur) + n > max_tokens):
            if len(cur) >= 2:
                packs.append((cur, PrefixLayout(o, tuple(tokens(c).numel() for c in cur))))
            cur = []
        if it is not None:
            cur.append(it)
    return packs
