"""OPD ``stream-turn`` at expert parallelism > 1: lockstep *lanes*, so that every MoE all-to-all is matched.

Each MoE layer's token all-to-all (forward, and its backward) is a collective over the expert-parallel ranks, which
are data-parallel replicas learning different trajectories. The GRPO learner matches them per microbatch
(``training.stream_fb``: forward and backward of a microbatch run together). ``stream-turn`` cannot: a chunk's
forward runs when the turn arrives, its backward only at the end of its trajectory, as part of one backward over
the whole trajectory's graph. Lanes pair those graphs across the ranks:

* a trajectory takes a lane when its first chunk arrives: the lowest lane this rank holds nothing in;
* at each schedule point (one poll of the chunk source) the ranks exchange, per lane, how many chunk forwards
  they run (``all_gather_object`` over the group); per lane in lane order every rank runs its own forwards, then
  idle forwards (:func:`idle_forward`, 2 tokens) up to the most any rank runs there. The k-th forward of lane j is
  thus the same collective on every rank;
* a lane closes when no rank has an open trajectory in it. Then every rank runs ONE backward over everything the
  lane holds on it: its finished trajectories' losses (or head-first bodies), every chunk output and every idle
  output with gradient 0 (so that every forward's all-to-alls are reached even where no loss term reads them).

Why the backward all-to-alls match: autograd runs the ready nodes of one backward call in decreasing sequence number
(creation order reversed, one thread per device), and a node created later can only depend on earlier ones, so a
backward runs its nodes in exactly reverse creation order. The lane's all-to-all nodes were created in the same
(matched) order on every rank, so they run in the same reverse order on every rank. Idle forwards add exact zeros
to this rank's gradient and carry the other ranks' tokens through this rank's experts (their expert gradients).

Everything goes to the batch accumulator (DDP's buffers), so the lanes need no gradient destinations. A finished
trajectory's graph stays alive until its lane closes (memory: ``peak_graph_bytes`` counts it).

Under PP every stage runs the lanes with its own expert-parallel group (the same stage of the other replicas); the
stages of one pipeline see the same chunks, so they agree on lanes, counts and closes. A chunk forward is
``opd_pipeline.stage_forward`` (p2p within the pipeline), an idle forward runs this stage's layers only
(:func:`idle_stage_forward`, zeros as a later stage's input: no p2p). At a close the last stage backprops its
roots and sends each trajectory's input gradients down (one message per trajectory, in lane order); a stage before
it receives them all, runs its one backward (with its idle roots) and sends its own down.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_tsync.model.incremental import IncrementalGPT
from megatron_tsync.training.opd_pipeline import recv_output_grads, send_input_grads

IDLE_TOKENS = 2  # length of an expert-lockstep idle forward


def idle_forward(model) -> torch.Tensor:
    """An idle microbatch's forward inside megatron's schedule: 2 tokens (id 0) through ``model`` (its MoE layers
    join the all-to-alls). -> its output."""
    dev = next(model.parameters()).device
    ids = torch.zeros(1, IDLE_TOKENS, dtype=torch.long, device=dev)
    return model(ids, torch.arange(IDLE_TOKENS, device=dev).unsqueeze(0), None)


def idle_stage_forward(model) -> torch.Tensor:
    """A lane's idle forward through this pipeline stage's layers only: 2 tokens (id 0) on the first stage, zeros
    (2, 1, h) as a later stage's input. -> the stage's output (2, 1, h)."""
    inc = IncrementalGPT(model, whole=False)
    m = inc.m
    p = next(m.parameters())
    hidden = None if m.pre_process else torch.zeros(IDLE_TOKENS, 1, m.config.hidden_size, dtype=p.dtype,
                                                     device=p.device)
    return inc.extend(torch.zeros(IDLE_TOKENS, dtype=torch.long), 0, hidden=hidden)


@dataclasses.dataclass
class _Lane:
    trajs: list = dataclasses.field(default_factory=list)  # this rank's trajectories in the lane (opd_learner._Traj)
    idle: list = dataclasses.field(default_factory=list)  # outputs of this rank's idle forwards in the lane

    @property
    def open(self) -> bool:
        return any(not tr.ended for tr in self.trajs)


class TurnLanes:
    """The lanes of one ``OPDLearner`` (stream-turn, EP > 1); :meth:`point` once per poll on every rank."""

    def __init__(self, learner, lockstep):
        self.learner, self.lockstep = learner, lockstep
        self.lanes: dict[int, _Lane] = {}

    def point(self, mine: list, exhausted: bool) -> bool:
        """One schedule point: ``mine`` = this rank's (trajectory, chunk) pairs of this poll (accepted already),
        ``exhausted``: this rank's source has no more. Runs the forwards and the lanes that close (module
        docstring). Collective over the expert-parallel group. -> whether any rank's source has more."""
        L = self.learner
        for tr, _ in mine:
            if tr.lane is None:
                tr.lane = next(j for j in range(len(self.lanes) + 1) if j not in self.lanes)
                self.lanes[tr.lane] = _Lane()
                self.lanes[tr.lane].trajs.append(tr)
        n_fwd: dict[int, int] = {}
        for tr, c in mine:
            n_fwd[tr.lane] = n_fwd.get(tr.lane, 0) + int(c.end > c.start)
        open_after = sorted(j for j, lane in self.lanes.items() if lane.open)
        plans: list = [None] * dist.get_world_size(self.lockstep.group)
        dist.all_gather_object(plans, (n_fwd, open_after, exhausted), group=self.lockstep.group)
        used = sorted({j for f, _, _ in plans for j in f} | {j for _, o, _ in plans for j in o} | set(self.lanes))
        for j in used:
            most = max(f.get(j, 0) for f, _, _ in plans)
            if most == 0:
                continue
            for tr, c in mine:
                if tr.lane == j:
                    L._turn_forward(tr, c)
            lane = self.lanes.setdefault(j, _Lane())
            for _ in range(most - n_fwd.get(j, 0)):
                lane.idle.append(idle_stage_forward(L.model))
            self.lockstep.idle += most - n_fwd.get(j, 0)
        # empty chunks of lanes where no rank runs a forward (no collective): their bookkeeping only
        for tr, c in mine:
            if max(f.get(tr.lane, 0) for f, _, _ in plans) == 0:
                L._turn_forward(tr, c)
        still_open = {j for _, o, _ in plans for j in o}
        for j in used:
            if j not in still_open:
                self._close(j)
        return not all(done for _, _, done in plans)

    def _close(self, j: int) -> None:
        """Lane ``j`` is finished on every rank: one backward over all it holds on this rank (module docstring)."""
        lane = self.lanes.pop(j, None)
        if lane is None:
            return
        L, link = self.learner, self.learner.link
        kept = [L._kept_bytes(tr) for tr in lane.trajs]
        roots = []
        for tr in lane.trajs:  # lane order: the same on every stage of the pipeline
            roots += L._turn_roots(tr) if link is None or link.is_last else recv_output_grads(link, tr.stage)
        roots += [(o, torch.zeros_like(o)) for o in lane.idle if o.requires_grad]
        if roots:
            torch.autograd.backward([r for r, _ in roots], [g for _, g in roots])
        for tr, k in zip(lane.trajs, kept):
            if link is not None:
                send_input_grads(link, tr.stage)
            L._turn_done(tr, k)
