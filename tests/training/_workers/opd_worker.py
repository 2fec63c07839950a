"""OPD exactness cases, shared by tests/training/test_opd_exactness.py (one process) and torchrun (TP=2, PP=2, both).

Float64 gradients after the barrier (finalize + explicit divisor) of the same batch of multi-turn trajectories
(prompt, turns, tool-output tokens with loss_mask 0 between them), per learner mode, compared with ``sync`` (each
trajectory one microbatch of megatron's schedule = the batch OPD gradient). ``cut`` is the control that detaches
the prefix K/V at every turn boundary (per-turn backward; under PP on every stage): it must NOT match.

As a script: ``python -m torch.distributed.run --nproc_per_node=2 opd_worker.py --runs tp2 pp2 pp2/selective
--out-dir D`` (layouts one after the other in the same processes; 4 processes for ``--runs tp2pp2``); per run rank 0
writes D/LAYOUT[+RECOMPUTE].json = {case: {mode: {"rel": whole-model relative error, and per-rank lists "ran",
"rel_this_rank", "peak_graph_bytes", "p2p_messages"}}}. Runs of one layout share each case's sync reference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from stream_cases import TINY  # noqa: E402

from megatron_tsync.algorithms.policy_loss import PolicyLossConfig  # noqa: E402
from megatron_tsync.streaming.ready_queue import Sample  # noqa: E402
from megatron_tsync.model.builder import PrecisionConfig, build_model  # noqa: E402
from megatron_tsync.training.opd_learner import (  # noqa: E402
    ListChunkSource,
    OPDLearner,
    OPDLearnerConfig,
    chunks_from_sample,
)
from megatron_tsync.training.opd_pipeline import stage_backward  # noqa: E402
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp  # noqa: E402
from megatron_tsync.training.stream_fb import BatchShape, LossConfig  # noqa: E402

CASES = {
    "token-mean": dict(loss=LossConfig(policy=PolicyLossConfig(kind="none"))),
    "seq-mean-engine-tis": dict(loss=LossConfig(policy=PolicyLossConfig(kind="ppo_clip", tis_cap=2.0),
                                                aggregation="seq-mean-token-mean", old_logprobs="engine")),
    "full-vocab-token-sum": dict(loss=LossConfig(aggregation="seq-mean-token-sum"), objective="full-vocab"),
}


def make_trajectories(seed: int, n: int = 4, vocab: int = 256, full_vocab: bool = False):
    """(samples, turn_ends): 2-4 turns each, tool output (mask 0) between turns; teacher/behaviour log-probs."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    samples, ends = [], {}
    for i in range(n):
        segs, mask_vals, turn_ends = [], [], []
        p = rnd.randint(3, 6)
        segs.append(p), mask_vals.append(0)
        for k in range(rnd.randint(2, 4)):
            if k:
                segs.append(rnd.randint(2, 5)), mask_vals.append(0)  # tool output
            segs.append(rnd.randint(3, 8)), mask_vals.append(1)  # generated turn
            turn_ends.append(sum(segs))
        T = sum(segs)
        mask = torch.cat([torch.full((L,), float(v)) for L, v in zip(segs, mask_vals)])
        ids = torch.randint(0, vocab, (T,), generator=g)
        beh = -torch.rand(T, generator=g, dtype=torch.float64) * 3 - 1.0
        teach = -torch.rand(T, generator=g, dtype=torch.float64) * 3 - 1.0
        s = Sample(traj_id=f"t{i}", group_id=f"t{i}", group_size=1, token_ids=ids, loss_mask=mask, reward=0.0,
                   behaviour_logp=beh * mask, teacher_logp=teach)
        if full_vocab:
            s.meta["teacher_logits"] = torch.randn(T - 1, vocab, generator=g, dtype=torch.float64) * 2
        samples.append(s)
        ends[s.traj_id] = turn_ends[:-1]
    return samples, ends


def all_chunks(samples, ends, seed: int, *, per_turn: bool = True):
    """Chunks of every trajectory, turns of different trajectories interleaved (random but each in order)."""
    queues = []
    for s in samples:
        cs = chunks_from_sample(s, ends[s.traj_id] if per_turn else [])
        tl = s.meta.get("teacher_logits")
        for c in cs:
            c.teacher_logits = None if tl is None else tl[c.lo - 1 : c.end - 1]
        queues.append(cs)
    rnd = random.Random(seed)
    out = []
    while any(queues):
        q = rnd.choice([q for q in queues if q])
        out.append(q.pop(0))
    return out


def grads(mode: str, case: dict, samples, ends, dims, *, head_first=False, seed=7, recompute=None):
    """Flat float64 gradient (this rank's DDP buffers) after the barrier (``recompute``: TransformerConfig fields of
    activation recomputation for the learner's model)."""
    model = build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0, **(recompute or {}))
    ddp = wrap_ddp(model)
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))
    cfg = OPDLearnerConfig(mode=mode if mode != "cut" else "stream-turn", head_first=head_first, **case)
    L = OPDLearner(ddp, opt, cfg, dp_rank=dims.dp_rank if dims else 0, pp_size=dims.pp if dims else 1,
                   pp_group=dims.pp_group() if dims else None)
    got = {}
    L.grad_hook = lambda d: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
    if mode == "cut":
        _cut_turns(L)
    shape = BatchShape(num_sequences=len(samples), max_len=max(s.token_ids.shape[0] for s in samples))
    res = L.train_step(ListChunkSource(all_chunks(samples, ends, seed)), shape)
    assert mode == "cut" or L._open_bytes == 0, L._open_bytes  # every kept graph was counted out again
    return got["g"], res


def _cut_turns(L: OPDLearner) -> None:
    """The inexact control: backward each turn at once and detach the prefix K/V (the gradient is cut at turns).

    Under PP every stage detaches its own K/V, and the turn's backward runs down the pipeline right away.
    """
    fwd = L._turn_forward

    def cut_forward(tr, c):
        fwd(tr, c)
        if tr.terms:
            (L._nu(tr.n_act if c.last else 0) * torch.stack(tr.terms).sum()).backward()
            tr.terms = []
        if L.link is not None:
            stage_backward(L.link, tr.stage)
        tr.inc.kv = [(k.detach(), v.detach()) for k, v in tr.inc.kv]
        if tr.last_h is not None:
            tr.last_h = tr.last_h.detach()

    L._turn_forward = cut_forward


def rel(a, b, dims=None) -> float:
    t = torch.tensor([float((a - b).pow(2).sum()), float(b.pow(2).sum())], dtype=torch.float64)
    if dims is not None and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, group=dims.model_parallel_group())
    return (t[0].sqrt() / t[1].sqrt()).item()


RECOMPUTE = {"full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             "selective": dict(recompute_granularity="selective")}


def run_cases(dims, modes=("stream-trajectory", "stream-turn", "stream-turn-head-first", "cut"),
              recompute=None) -> dict:
    """Each case's streamed modes (with ``recompute``, a RECOMPUTE entry, on the learner's model) vs sync without."""
    return run_cases_multi(dims, [recompute], modes)[recompute]


def run_cases_multi(dims, recomputes, modes=("stream-trajectory", "stream-turn", "stream-turn-head-first", "cut")
                    ) -> dict:
    """{recompute: run_cases(dims, modes, recompute)} for several recompute settings (None: off) on one layout; each
    case's sync reference (without recomputation) is computed once and serves every setting."""
    reports = {rc: {} for rc in recomputes}
    for ci, (name, case) in enumerate(CASES.items()):
        S, E = make_trajectories(300 + ci, full_vocab=case.get("objective") == "full-vocab")
        ref, _ = grads("sync", case, S, E, dims)
        for recompute in recomputes:
            row = {}
            for m in modes:
                hf = m.endswith("head-first")
                if hf and case["loss"].aggregation == "seq-mean-token-mean":
                    continue
                g, res = grads(m.replace("-head-first", ""), case, S, E, dims, head_first=hf, seed=11 + ci,
                               recompute=RECOMPUTE.get(recompute))
                row[m] = {"rel": rel(g, ref, dims), **_per_rank(ran=res.mode, rel_this_rank=rel(g, ref),
                                                                 peak_graph_bytes=res.peak_graph_bytes,
                                                                 p2p_messages=res.p2p_messages)}
            reports[recompute][name] = row
    return reports


def _per_rank(**kw) -> dict:
    """{key: [value of rank 0, rank 1, ...]} (one process: [value])."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return {k: [v] for k, v in kw.items()}
    allv = [None] * dist.get_world_size()
    dist.all_gather_object(allv, kw)
    return {k: [a[k] for a in allv] for k in kw}


LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}


def parse_runs(runs: list[str]) -> dict[str, list]:
    """["tp2", "pp2", "pp2/selective"] -> {"tp2": [None], "pp2": [None, "selective"]} (first-seen order)."""
    plan: dict[str, list] = {}
    for run in runs:
        layout, _, rc = run.partition("/")
        if layout not in LAYOUTS or (rc and rc not in RECOMPUTE):
            raise SystemExit(f"unknown run {run!r}: LAYOUT[/RECOMPUTE], layouts {list(LAYOUTS)}, {list(RECOMPUTE)}")
        plan.setdefault(layout, [])
        if (rc or None) not in plan[layout]:
            plan[layout].append(rc or None)
    return plan


def run_name(layout: str, recompute) -> str:
    return layout if recompute is None else f"{layout}+{recompute}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="+", required=True, metavar="LAYOUT[/RECOMPUTE]",
                    help="layouts of the launch's processes (tp2, pp2: 2; tp2pp2: 4), run one after the other, each "
                         "with recomputation off and/or with a RECOMPUTE setting")
    ap.add_argument("--out-dir", required=True, help="rank 0 writes LAYOUT[+RECOMPUTE].json per run")
    a = ap.parse_args()
    from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel

    torch.set_num_threads(1)
    for layout, recomputes in parse_runs(a.runs).items():
        dims = initialize_parallel(*LAYOUTS[layout])
        for rc, report in run_cases_multi(dims, recomputes).items():
            if dims.rank == 0:
                path = os.path.join(a.out_dir, run_name(layout, rc) + ".json")
                with open(path + ".tmp", "w") as f:
                    json.dump(report, f, indent=1)
                os.replace(path + ".tmp", path)
    destroy_parallel()


if __name__ == "__main__":
    main()
