"""Qwen3-MoE at tensor and pipeline parallelism with sequence packing and router replay (run by
tests/training/test_moe_tp_pp.py).

``--runs LAYOUT=CASE,... ...``: layouts single (1 process), tp2 (2: TP 2 with sequence parallelism), pp2 (2: PP 2)
or tp2pp2 (4: TP 2 × PP 2), one after the other on this launch's processes; DP 1 everywhere. Cases: of
:data:`CASES` (packing on or off, replay of given routing on or off), each in sync and stream-trajectory mode,
float64, on the same HF weights (router × 25: decisive routing) and the same trajectories; with replay each
trajectory carries a random routing (distinct experts per position and layer, for all but its last position), far
from what the routers would choose, so a replay that is not applied, or applied to the wrong positions, changes the
gradient. ``control`` (TP 2 only): replay with every TP rank given the routing of the first
sequence shard (what replay did before it was sharded), sync. ``shared``: ``--shared-prefix`` on groups with one
prompt each (arrivals four at a time), against ``prompts``: the same trajectories without sharing.

Every training forward's routing maps are recorded (per local MoE layer, the rank's sequence shard), gathered over
TP, cut into trajectories by their token ids and compared with the trajectories' routing: ``agree`` counts the
(position, layer) pairs the engine computed, ``differ`` those the router did not route exactly as given.

Rank 0 writes ``--out`` (torch.save): {layout: {"grads": {case: {mode: {hf name: tensor}}}, "agree": {case: [same,
differ]}, "packed": {case: packed (or shared-prefix) items}, "padded": {case: packed / shared-prefix microbatches
padded to a multiple of TP}}}.
The test runs the one-process reference in its own process (:func:`run_layout`).
"""

import argparse
import contextlib
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from stream_cases import arrival_order, make_samples, prompt_groups, spec_for  # noqa: E402

from megatron_tsync.model import moe  # noqa: E402
from megatron_tsync.model.builder import PrecisionConfig, build_model, unwrap  # noqa: E402
from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model  # noqa: E402
from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel  # noqa: E402
from megatron_tsync.runtime.rollout_io import grads_to_hf  # noqa: E402
from megatron_tsync.streaming.ready_queue import ListSource  # noqa: E402
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for  # noqa: E402
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp  # noqa: E402
from megatron_tsync.training import packing, stream_fb  # noqa: E402
from megatron_tsync.training.stream_fb import LossConfig  # noqa: E402

CASES = {  # (sequence packing, router replay, shared prefix: groups with one prompt each)
    "plain": (False, False, False),
    "replay": (False, True, False),
    "pack": (True, False, False),
    "pack-replay": (True, True, False),
    "control": (False, True, False),
    "prompts": (False, False, True),  # the shared-prefix case's trajectories without sharing (its reference)
    "shared": (False, False, True),
    "prompts-replay": (False, True, True),  # with replay (each group's prompt routed alike, as one prefill)
    "shared-replay": (False, True, True),  # needs the executor's shared-prefix replay (main: moe.shared_prefix_routing)
}
LAYOUTS = {"single": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "tp2pp2": (2, 2, 1), "ep2": (1, 1, 2)}  # tp, pp, ep
MODES = (("sync", None), ("stream-trajectory", 7))
PACK_TOKENS = 45  # packs of odd length among them (padded to a multiple of TP)


def samples_with_routing(arch, replay: bool, prompts: bool = False):
    if prompts:  # groups of 4 with one prompt each, binary rewards
        samples = prompt_groups(43, vocab=arch.vocab_size)
    else:
        samples = make_samples(41, num_groups=3, reward_kind="bounded", vocab=arch.vocab_size)
    if replay:
        g = torch.Generator().manual_seed(9)
        E, k, L = arch.num_experts, arch.moe_router_topk, arch.num_layers - arch.moe_first_k_dense  # MoE layers
        for s in samples:
            P = s.token_ids.numel() - 1  # the engine computed every position but the last
            s.routing = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(P * L)]).view(P, L, k)
        if prompts:  # the engine prefilled one prompt per group: equal prompt routing
            first = {}
            for s in samples:
                f = first.setdefault(s.group_id, s)
                p = int((s.loss_mask > 0).nonzero()[0])
                s.routing[:p] = f.routing[:p]
    return samples


class RoutingCapture:
    """Per training forward: its token ids and, per local MoE layer, the (S/TP, E) routing map its router made."""

    def __init__(self, model):
        gpt = unwrap(model)
        moe_layers = [layer for layer in gpt.decoder.layers if hasattr(layer.mlp, "router")]  # dense-first: MoE only
        self.layers = [layer.layer_number - 1 - gpt.arch.moe_first_k_dense for layer in moe_layers]
        self.calls = []
        self.hooks = [gpt.register_forward_pre_hook(lambda m, a: self.calls.append((a[0][0].clone(), [])))]
        for layer in moe_layers:
            self.hooks.append(layer.mlp.router.register_forward_hook(
                lambda m, i, o: self.calls[-1][1].append(o[1].detach().clone())))

    def compare(self, samples, dims):
        """[same, differ] over the engine-computed (position, layer) pairs of every captured forward."""
        for h in self.hooks:
            h.remove()
        by_tokens = {tuple(s.token_ids.tolist()): s for s in samples}
        lengths = sorted({s.token_ids.numel() for s in samples})
        same = differ = 0
        for ids, maps in self.calls:
            if dims.tp > 1:  # the routers saw the rank's sequence shard: gather the whole (padded) sequence
                parts = [None] * dims.tp
                dist.all_gather_object(parts, maps, group=dims.tp_group())
                maps = [torch.cat([p[j] for p in parts]) for j in range(len(maps))]
            a = 0
            while a < ids.numel():
                s = next((by_tokens[tuple(ids[a:a + n].tolist())] for n in lengths
                          if tuple(ids[a:a + n].tolist()) in by_tokens), None)
                if s is None and a == 0 and dims.ep > 1 and ids.numel() == stream_fb._IDLE_TOKENS:
                    break  # an expert-lockstep idle microbatch (EP > 1): no trajectory's routing to check
                if s is None:  # the padding to a multiple of TP (token 0)
                    assert ids.numel() - a < dims.tp and not ids[a:].any(), "not a concatenation of trajectories"
                    break
                r = s.routing  # (P, L, k)
                for layer, rmap in zip(self.layers, maps):
                    want = torch.zeros(r.shape[0], rmap.shape[1], dtype=torch.bool)
                    want.scatter_(1, r[:, layer], True)
                    eq = (rmap[a:a + r.shape[0]] == want).all(-1)
                    same, differ = same + int(eq.sum()), differ + int((~eq).sum())
                a += s.token_ids.numel()
        return [same, differ]


def first_shard(indices, config):
    """The control's replay sharding: every TP rank gets the routing of the first sequence shard."""
    tp = config.tensor_model_parallel_size
    n = (-indices.shape[0]) % tp
    return torch.cat([indices, torch.arange(indices.shape[1]).expand(n, -1)]).chunk(tp)[0]


def run(model_dir, dims, name, mode, order_seed):
    packing, replay, prompts = CASES[name]
    arch, hf = load_hf_dir(model_dir)
    model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0,
                        **({"moe_enable_routing_replay": True} if replay else {}))
    load_hf_into_model(model, {k: v.double() for k, v in hf.items()})
    with torch.no_grad():
        for layer in model.decoder.layers:
            if arch.family == "qwen3_moe":  # glm4_moe_lite's tiny model routes decisively as made (sigmoid)
                layer.mlp.router.weight.mul_(25.0)
    ddp = wrap_ddp(model)
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))
    cfg = LearnerConfig(mode=mode, estimator="grpo", loss=LossConfig(), reward_spec=spec_for("bounded"),
                        sequence_packing=packing, max_packed_tokens=PACK_TOKENS,
                        shared_prefix=name.startswith("shared"))
    learner = Learner(ddp, opt, cfg, dp_rank=dims.dp_rank, pp_size=dims.pp)
    samples = samples_with_routing(arch, replay, prompts)
    order = samples if order_seed is None else arrival_order(samples, order_seed)
    for i, s in enumerate(order):  # as DataParallelAssigner: arrival order (EP > 1: DP 2)
        s.dp_rank = i % dims.dp
    got = {}
    learner.grad_hook = lambda d: got.setdefault("g", grads_to_hf(d))
    capture = RoutingCapture(ddp) if replay else None
    sizes, shape = shape_for(samples)
    original = moe.sequence_shard
    if name == "control":
        moe.sequence_shard = first_shard
    pads = []
    try:
        with _count_pads(pads):
            learner.train_step(ListSource(order, batch=4 if prompts else 1), sizes, shape)
    finally:
        moe.sequence_shard = original
    # (a shared-prefix microbatch is not a concatenation of whole trajectories: its routing is not cut and checked)
    agree = capture.compare(samples, dims) if capture is not None and not prompts else [0, 0]
    packed = learner.exec.shared_prefix_items if prompts else learner.exec.packed_items
    return got["g"], agree, packed, sum(1 for n in pads if n)


@contextlib.contextmanager
def _count_pads(pads: list):
    """Append the padding of every packed / shared-prefix microbatch the executor runs to ``pads``."""
    mask, layout = packing.PrefixLayout.mask, stream_fb.layout_for

    def mask_counted(lay, device=None):
        pads.append(lay.pad)
        return mask(lay, device)

    def layout_counted(*a, **k):
        lay = layout(*a, **k)
        pads.append(lay.pad)
        return lay

    packing.PrefixLayout.mask, stream_fb.layout_for = mask_counted, layout_counted
    try:
        yield
    finally:
        packing.PrefixLayout.mask, stream_fb.layout_for = mask, layout


def run_layout(model_dir, dims, cases, modes=MODES):
    """{"grads": {case: {mode: grads}}, "agree": {case: [same, differ]}, "packed": {...}, "padded": {...}} of
    ``cases`` on the current layout (collective; every rank returns the same)."""
    out = {"grads": {}, "agree": {}, "packed": {}, "padded": {}}
    for name in cases:
        out["grads"][name], agree, out["packed"][name], out["padded"][name] = {}, torch.zeros(2), 0, 0
        for mode, seed in (modes[:1] if name == "control" else modes):
            g, ag, packed, padded = run(model_dir, dims, name, mode, seed)
            out["grads"][name][mode] = g
            agree += torch.tensor(ag, dtype=torch.float64)
            out["packed"][name] += packed
            out["padded"][name] += padded
        if dims.world_size > 1:
            dist.all_reduce(agree)  # every stage's layers (the TP ranks gathered the same maps: counted TP times)
        out["agree"][name] = [int(x) // dims.tp for x in agree.tolist()]
    return out


def main():
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", nargs="+", required=True, metavar="LAYOUT=CASE,CASE",
                    help="layouts of this launch's processes, one after the other, each with its cases")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = {}
    for spec in a.runs:
        layout, cases = spec.split("=")
        tp, pp, ep = LAYOUTS[layout]
        dims = initialize_parallel(tp, pp, ep=ep)
        out[layout] = run_layout(a.model, dims, [c for c in cases.split(",") if c in CASES])
        if dims.rank == 0:
            torch.save(out, a.out)
    destroy_parallel()


if __name__ == "__main__":
    main()
