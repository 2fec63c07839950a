"""Exact turn-level streaming OPD across pipeline stages: the incremental forward with one p2p exchange per chunk.

``opd_learner.OPDLearner`` in ``stream-turn`` mode with PP > 1 runs, per arriving chunk of s new tokens, on every stage
of the trajectory's pipeline (all its ranks see the same chunk stream, so every stage knows s and the order):

* stage 0 embeds the tokens and runs its layers (``IncrementalGPT.extend``), sends the output (s, 1, h) to stage 1;
* stage k > 0 receives the previous stage's output as a fresh leaf requiring grad, runs its layers over it with the
  K/V of all earlier chunks kept *with autograd*, sends its output on (the last stage computes the chunk's loss terms).

Each stage keeps its own graph: K/V caches, its received inputs (one leaf per chunk) and its outputs (one per chunk).
At the end of the trajectory the last stage backprops its summed loss (or, with ``head_first``, its bodies with the
heads' gradients); the gradients of its received inputs go to the previous stage as ONE message (the chunks
concatenated, Σs × h, a size every stage knows), which backprops all its chunk outputs together
(``torch.autograd.backward(outputs, grads)``) and passes its inputs' gradients on, down to stage 0. Every stage's
parameter gradients thus come from one backward over the whole trajectory graph: the batch gradient, exactly, landing
in megatron DDP's ``main_grad`` buffers through DDP's own grad hooks (reduced once at the barrier).

Communication is plain ``torch.distributed`` send/recv on the PP group (gloo or NCCL). Shapes need no handshake;
the order is the chunk stream's, the same on every rank, so the chain (forward: 0 → P−1; backward: P−1 → 0) cannot
deadlock. Virtual pipeline (several model chunks per stage) is not supported; the learner takes one model chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class StageLink:
    """This rank's neighbours in its pipeline group (global ranks) and blocking p2p with them."""

    def __init__(self, pp_group):
        ranks = dist.get_process_group_ranks(pp_group)
        me = dist.get_rank(pp_group)
        self.group, self.size, self.stage = pp_group, len(ranks), me
        self.prev = ranks[me - 1] if me > 0 else None
        self.next = ranks[me + 1] if me + 1 < len(ranks) else None
        self.messages = 0  # p2p messages this stage sent or received (the no-fallback evidence in tests)

    @property
    def is_first(self) -> bool:
        return self.prev is None

    @property
    def is_last(self) -> bool:
        return self.next is None

    def send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(t.detach().contiguous(), dst, group=self.group)
        self.messages += 1

    def recv(self, shape, dtype, device, src: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buf, src, group=self.group)
        self.messages += 1
        return buf


class StageGraph:
    """One trajectory's graph on one stage: received inputs (leaves) and sent outputs, one per non-empty chunk."""

    def __init__(self):
        self.inputs: list[torch.Tensor] = []  # (s_k, 1, h) leaves requiring grad (stages > 0)
        self.outputs: list[torch.Tensor] = []  # (s_k, 1, h) with graph (stages < P−1)
        self.sizes: list[int] = []  # s_k

    @property
    def output_bytes(self) -> int:
        return sum(o.nelement() * o.element_size() for o in self.outputs)


def stage_forward(inc, link: StageLink, g: StageGraph, ids_new: torch.Tensor, start: int) -> torch.Tensor:
    """This stage's incremental forward of one chunk (s ≥ 1 new tokens): receive, extend, send. -> (s, 1, h)."""
    m = inc.m
    s = int(ids_new.shape[0])
    hidden = None
    if not link.is_first:
        dev = next(m.parameters()).device
        hidden = link.recv((s, 1, m.config.hidden_size), _dtype(m), dev, link.prev).requires_grad_()  # (s, 1, h)
        g.inputs.append(hidden)
    out = inc.extend(ids_new, start, hidden=hidden)  # (s, 1, h)
    if not link.is_last:
        link.send(out, link.next)
        g.outputs.append(out)
    g.sizes.append(s)
    return out


def stage_backward(link: StageLink, g: StageGraph) -> None:
    """The pipeline part of a trajectory's backward, after the last stage's own loss backward (if this is it).

    Stages < P−1 receive d(loss)/d(output) of every chunk (one message) and backprop all outputs at once; stages > 0
    then send d(loss)/d(input) of every chunk (one message) to the previous stage. Clears ``g``.
    """
    pairs = recv_output_grads(link, g)
    if pairs:
        torch.autograd.backward([p for p, _ in pairs], [gr for _, gr in pairs])
    send_input_grads(link, g)


def recv_output_grads(link: StageLink, g: StageGraph) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Stages < P−1: d(loss)/d(output) of every chunk from the next stage (one message) -> (output, gradient) pairs
    to backprop ([] on the last stage or for a trajectory without tokens)."""
    n = sum(g.sizes)
    if n == 0 or link.is_last:
        return []
    o = g.outputs[0]
    grad = link.recv((n, 1, o.shape[-1]), o.dtype, o.device, link.next)  # (Σs, 1, h)
    return [(out, gr) for out, gr in zip(g.outputs, grad.split(g.sizes)) if out.requires_grad]


def send_input_grads(link: StageLink, g: StageGraph) -> None:
    """Stages > 0, after the backward: d(loss)/d(input) of every chunk to the previous stage (one message). Clears
    ``g``."""
    if sum(g.sizes) > 0 and not link.is_first:
        link.send(torch.cat([x.grad if x.grad is not None else torch.zeros_like(x) for x in g.inputs]), link.prev)
    g.inputs, g.outputs, g.sizes = [], [], []


def _dtype(m) -> torch.dtype:
    dt = getattr(m.config, "pipeline_dtype", None)
    return dt if dt is not None else next(m.parameters()).dtype
