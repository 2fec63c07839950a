"""OPD on a tiny Qwen3-MoE student at expert parallelism 2 (run by tests/training/test_moe_ep_opd.py; its
one-process reference imports these functions).

``python -m torch.distributed.run --nproc_per_node=2 moe_ep_opd_worker.py --model DIR --out R.pt``: TP 1, PP 1,
DP 2, EP 2 (each rank holds half the experts; every MoE all-to-all spans both ranks, which learn different
trajectories); ``--nproc_per_node=4 ... --pp 2``: PP 2 × EP 2 (the streaming modes only). Each rank gets every chunk (multi-turn trajectories, tool output between turns) but in its OWN
interleaving of the trajectories' turns; trajectory i is learned by rank i mod 2. ``--tp 2``: TP 2 (sequence
parallel, one data-parallel replica, no EP): every mode of ``TP_MODES``, and the teacher at TP 2; ``--tp 1 2``: both
layouts one after the other on the same 2 processes (the result: {tp: ...}). float64, router weights × 25
(decisive routing). Rank 0 writes {"grads": {case: {mode: {hf name: tensor}}}, "idle": {case: {mode: idle
forwards, both ranks}}, "replay": {mode: [tokens checked, tokens whose experts differ from the recorded ones]},
"teacher": {traj_id: teacher log-probs}} (torch.save).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from opd_worker import all_chunks, make_trajectories  # noqa: E402

from megatron_tsync.algorithms.policy_loss import PolicyLossConfig  # noqa: E402
from megatron_tsync.model.builder import PrecisionConfig, build_model, unwrap  # noqa: E402
from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model  # noqa: E402
from megatron_tsync.runtime.rollout_io import grads_to_hf  # noqa: E402
from megatron_tsync.training.opd_learner import ListChunkSource, OPDLearner, OPDLearnerConfig  # noqa: E402
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp  # noqa: E402
from megatron_tsync.training.stream_fb import BatchShape, LossConfig  # noqa: E402
from megatron_tsync.training.teacher import TeacherChunks, TeacherScorer  # noqa: E402

F64 = PrecisionConfig(params_dtype=torch.float64)
CASES = {  # name: (config kwargs, modes, router replay)
    "token-mean": (dict(loss=LossConfig(policy=PolicyLossConfig(kind="none"))),
                   ("sync", "stream-trajectory", "stream-turn", "stream-turn-head-first"), False),
    "seq-mean-engine-tis": (dict(loss=LossConfig(policy=PolicyLossConfig(kind="ppo_clip", tis_cap=2.0),
                                                 aggregation="seq-mean-token-mean", old_logprobs="engine")),
                            ("sync", "stream-turn"), False),
    "replay": (dict(loss=LossConfig(policy=PolicyLossConfig(kind="none"))), ("sync", "stream-turn"), True),
}
TP_MODES = {"token-mean": ("sync", "stream-trajectory", "stream-turn"),
            "replay": ("sync", "stream-trajectory", "stream-turn")}  # --tp 2


def build(model_dir: str, replay: bool):
    arch, hf = load_hf_dir(model_dir)
    model = build_model(arch, F64, seed=0, **({"moe_enable_routing_replay": True} if replay else {}))
    load_hf_into_model(model, {k: v.double() for k, v in hf.items()})
    with torch.no_grad():
        for layer in model.decoder.layers:
            if arch.family == "qwen3_moe":  # glm4_moe_lite's tiny model routes decisively as made (sigmoid)
                layer.mlp.router.weight.mul_(25.0)
    ddp = wrap_ddp(model)
    return arch, ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))


def trajectories(arch, seed: int = 500):
    """Multi-turn trajectories (opd_worker's) with recorded routing: random distinct experts per position and
    MoE layer (a dense-first model's first layers have none) for the first T − 1 positions (the engine never
    computes the last token), unlike the model's own."""
    S, E = make_trajectories(seed, n=6, vocab=arch.vocab_size)
    g = torch.Generator().manual_seed(seed)
    moe_layers = arch.num_layers - arch.moe_first_k_dense
    for s in S:
        p = s.token_ids.shape[0] - 1
        r = torch.rand(p, moe_layers, arch.num_experts, generator=g).argsort(-1)[..., : arch.moe_router_topk]
        s.routing = r.to(torch.int16)  # (P, L, k)
    return S, E


def run(model_dir, case: str, mode: str, S, E, *, dp_rank=0, dp=1, order_seed=11, replay=None, check=None,
        pp_group=None):
    """HF-named float64 gradient after the barrier and the idle forwards of one learner step. ``replay``
    overrides the case's router replay (the control); ``check``: a [checked, differing] counter of the
    stream-turn forwards' expert choices against the chunks' routing."""
    kw, _, case_replay = CASES[case]
    replay = case_replay if replay is None else replay
    arch, ddp, opt = build(model_dir, case_replay)
    head_first = mode.endswith("head-first")
    L = OPDLearner(ddp, opt, OPDLearnerConfig(mode=mode.removesuffix("-head-first"), head_first=head_first, **kw),
                   dp_rank=dp_rank, dp_group=None, pp_group=pp_group)
    got = {}
    L.grad_hook = lambda d: got.setdefault("g", grads_to_hf(d))
    owner = {s.traj_id: i % dp for i, s in enumerate(S)}
    chunks = all_chunks(S, E, order_seed)
    for c in chunks:
        c.dp_rank = owner[c.traj_id]
        if not replay:
            c.routing = None
    hooks = _watch_routing(L, check) if check is not None else []
    L.train_step(ListChunkSource(chunks), BatchShape(num_sequences=len(S), max_len=max(s.token_ids.shape[0]
                                                                                      for s in S)))
    for h in hooks:
        h.remove()
    assert L._open_bytes == 0, L._open_bytes
    idle = L.lockstep.idle if L.lockstep is not None else 0
    return got["g"], idle


def _watch_routing(L: OPDLearner, counter: list):
    """Router forward hooks: during a stream-turn chunk forward, the experts each new token went to (the
    router's routing map) against the chunk's recorded routing; positions the engine never computed are skipped."""
    cur = {}
    fwd = L._turn_forward
    dense = getattr(unwrap(L.model).arch, "moe_first_k_dense", 0)

    def turn_forward(tr, c):
        cur["c"] = c
        try:
            fwd(tr, c)
        finally:
            cur.pop("c", None)

    L._turn_forward = turn_forward

    def hook(router, args, out):
        c = cur.get("c")
        if c is None:
            return
        _, routing_map = out  # (s, E) bool
        layer = router.layer_number - 1 - dense  # the index of this MoE layer in the recorded routing
        rec = c.routing[c.start : c.end, layer].long()  # (≤ s, k)
        cfg = router.config
        if cfg.sequence_parallel:  # the router sees its rank's block of the chunk padded to a multiple of TP
            from megatron.core import parallel_state as ps

            s, tp = c.end - c.start, cfg.tensor_model_parallel_size
            b = (s + (-s) % tp) // tp
            rec = rec[b * ps.get_tensor_model_parallel_rank() :][:b]
        chosen = routing_map[: rec.shape[0]]
        want = torch.zeros_like(chosen)
        want.scatter_(1, rec.to(chosen.device), True)
        counter[0] += int(rec.shape[0])
        counter[1] += int((chosen != want).any(-1).sum())

    return [layer.mlp.router.register_forward_hook(hook) for layer in unwrap(L.model).decoder.layers
            if hasattr(layer.mlp, "router")]


def teacher_scores(model_dir: str, S, E) -> dict:
    """A MoE teacher (the same tiny model) scoring every chunk in one order on every rank (as the OPD runtime's
    BroadcastChunks), turn by turn with its KV cache: {traj_id: (T,) log-probs}."""
    scorer = TeacherChunks(TeacherScorer.from_hf_dir(model_dir, F64))
    out = {}
    for c in all_chunks(S, E, 3):
        c.teacher_logp = None
        out[c.traj_id] = scorer.score(c).teacher_logp
    return out


def run_layout(model_dir: str, tp: int, pp: int) -> dict:
    from megatron_tsync.model.parallel import initialize_parallel

    ep = 2 if tp == 1 else 1
    dims = initialize_parallel(tp, pp, ep=ep)
    assert dims.ep == ep and dims.dp == 2 // tp and dims.pp == pp and dims.tp == tp, dims
    pp_group = dims.pp_group() if pp > 1 else None
    arch, _ = load_hf_dir(model_dir)
    S, E = trajectories(arch)
    out = {"grads": {}, "idle": {}, "replay": {}}
    seed = 11 + 7 * dims.dp_rank  # each rank its own arrival order
    for case, (_, modes, replay) in CASES.items():
        if tp > 1:
            if case not in TP_MODES:
                continue
            modes = TP_MODES[case]
        out["grads"][case], out["idle"][case] = {}, {}
        for mode in modes if pp == 1 else [m for m in modes if m != "sync"]:
            check = [0, 0] if replay and mode == "stream-turn" else None
            g, idle = run(model_dir, case, mode, S, E, dp_rank=dims.dp_rank, dp=dims.dp, order_seed=seed,
                          check=check, pp_group=pp_group)
            both = [None] * dims.world_size
            dist.all_gather_object(both, (idle, check))
            out["grads"][case][mode] = g
            out["idle"][case][mode] = [b[0] for b in both]
            if check is not None:
                out["replay"][mode] = [sum(b[1][i] for b in both) for i in range(2)]
    out["teacher"] = teacher_scores(model_dir, S, E)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--tp", type=int, nargs="+", default=[1],
                    help="one or more TP sizes (1: EP 2), one after the other on these processes")
    a = ap.parse_args()
    from megatron_tsync.model.parallel import destroy_parallel

    torch.set_num_threads(1)
    got = {tp: run_layout(a.model, tp, a.pp) for tp in a.tp}
    if dist.get_rank() == 0:
        torch.save(got if len(a.tp) > 1 else got[a.tp[0]], a.out)
    destroy_parallel()


if __name__ == "__main__":
    main()
