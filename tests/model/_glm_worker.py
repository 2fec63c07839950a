"""GLM-4.7-Flash-style worker (tests/model/test_glm4_moe_lite.py; torchrun with 2 gloo processes).

For each layout (TP=2, then EP=2, then PP=2 with each ``--pp-hf`` model: four layers, two a stage, the first
``first_k_dense_replace`` of them dense, so the dense/MoE boundary falls inside stage 0 or at the stage boundary):
load the HF weights in float64 into a Megatron GPTModel, export them back with ``megatron_to_hf`` (bitwise per
tensor) and compare Megatron's float64 logits (vocab shards gathered) with
transformers' float64 logits (``_glm_reference``) on the same (B, S) input. Rank 0 writes a JSON report.

``--stream-out PATH``: at each layout, also the float64 streaming cases of tests/training/_workers/moe_ep_worker.py
(``STREAM_CASES``, the same modes that worker runs at that layout: EP = 2 is its ``ep2``, TP = 2 its ``tp2``), so
one launch serves the logits test and the streaming test. Rank 0 torch.saves {"grads": {layout: {case: {mode: hf
name → tensor}}}, "idle": {layout: {case: idle microbatches}}}; a PP model's layout is "pp2-dense<k>" and runs
``PP_STREAM_CASES``; "kl", "replay", "det": the cells of :func:`extra`.

``--opd-out PATH``: then OPD at EP = 2, TP = 2 and PP = 2 (:func:`opd_layouts`), torch.saved there (with
``--layouts ""`` and no ``--pp-hf``: OPD alone, its PP = 2 model ``--opd-pp-hf``).
"""

import argparse
import json
import os
import sys

STREAM_CASES = ("grpo-bounded-trainer", "rloo-binary-engine", "det-rloo-binary-engine")
PP_STREAM_CASES = ("grpo-bounded-trainer", "rloo-binary-engine")
KL_CASE = "kl-loss-grpo-by-group"  # moe_ep_worker's: a KL loss against a reference model (the other 4-layer GLM)
OPD_MODES = {"token-mean": ("sync", "stream-turn"), "replay": ("stream-turn",)}  # moe_ep_opd_worker's cases
OPD_CASES = tuple(OPD_MODES)
LAYOUT_NAMES = {(1, 1, 1): "single", (2, 1, 1): "tp2", (1, 1, 2): "ep2", (1, 2, 1): "pp2"}


def _moe_ep_worker(name="moe_ep_worker"):
    import importlib.util
    import warnings

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "training", "_workers", name + ".py")
    spec = importlib.util.spec_from_file_location("_tsync_" + name, path)
    mod = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    with warnings.catch_warnings():
        spec.loader.exec_module(mod)
    sys.path[:] = saved
    return mod


def stream_grads(model_dir, dims, layout, *, sync_only=False, cases=STREAM_CASES, ref_dir=None):
    """moe_ep_worker's cases STREAM_CASES at ``layout`` (its name there), each in the modes that worker's main()
    runs at that layout (``sync_only``: the sync gradient alone, the one-process reference). Returns
    ({case: {mode: {hf name: tensor}}}, {case: idle microbatches})."""
    w = _moe_ep_worker()
    grads, idle = {}, {}
    for name in cases:
        case = w.CASES.get(name) or w.EP_CASES[name]
        if name in w.CASES:
            modes = range(len(w.MODES)) if layout in ("single", "ep2") else (0, 1, 3)
        else:
            modes = sorted({0, *case["modes"]}) if layout == "single" else case["modes"]
        if sync_only:
            modes = (0,)
        grads[name], idle[name] = {}, 0
        for mode, seed in (w.MODES[i] for i in modes):
            g, _, n, _, _ = w.run_case(model_dir, dims, case, mode, seed, ref_dir=ref_dir)
            grads[name][mode] = g
            idle[name] += n
    return grads, idle


def extra(stream, key, hf_dir, dims, name, ref_dir):
    """The cells beyond STREAM_CASES, into ``stream``: "kl" (KL_CASE against ``ref_dir``), "replay"
    (tests/training/_workers/moe_tp_pp_worker.py's ``replay`` case: GRPO replaying recorded random experts, sync
    and stream-trajectory; "agree": [same, differ] (position, MoE layer) pairs) and, at pp2-dense1, "det"
    (--deterministic at PP). Nothing at pp2-dense2 (its own model is the KL reference)."""
    if key == "pp2-dense2":
        return
    grads, _ = stream_grads(hf_dir, dims, name, cases=(KL_CASE,), ref_dir=ref_dir)
    stream.setdefault("kl", {})[key] = grads[KL_CASE]
    if key == "pp2-dense1":
        stream.setdefault("det", {})[key] = stream_grads(hf_dir, dims, name, cases=("det-rloo-binary-engine",))[0]
    w = _moe_ep_worker("moe_tp_pp_worker")
    rep = w.run_layout(hf_dir, dims, ["replay"])
    stream.setdefault("replay", {})[key] = {"grads": rep["grads"]["replay"], "agree": rep["agree"]["replay"]}


def opd_worker():
    """tests/training/_workers/moe_ep_opd_worker.py with the cases of OPD_MODES in their modes (GLM's tiny model)."""
    w = _moe_ep_worker("moe_ep_opd_worker")
    w.CASES = {k: (kw, OPD_MODES[k], replay) for k, (kw, _, replay) in w.CASES.items() if k in OPD_MODES}
    w.TP_MODES = dict(OPD_MODES)
    return w


def opd_layouts(glm_dir: str, pp_dir: str) -> dict:
    """OPD (moe_ep_opd_worker's run) with the tiny GLM student: EP = 2 (each rank its own turn order, lanes of
    matched turn forwards) and TP = 2 (sequence parallel; a GLM teacher scoring too) with ``glm_dir``, then PP = 2
    with ``pp_dir``. {layout: {"grads": {case: {mode: hf grads}}, "replay": {mode: [checked, differing]},
    "teacher": ... (EP/TP)}}."""
    import torch

    from megatron_tsync.model.hf_conversion import load_hf_dir
    from megatron_tsync.model.parallel import initialize_parallel

    w = opd_worker()
    out = {"ep2": w.run_layout(glm_dir, 1, 1), "tp2": w.run_layout(glm_dir, 2, 1)}
    dims = initialize_parallel(1, 2)
    arch, _ = load_hf_dir(pp_dir)
    S, E = w.trajectories(arch)
    pp = {"grads": {}, "replay": {}}
    for case, (_, modes, replay) in w.CASES.items():
        pp["grads"][case] = {}
        for mode in modes:
            check = [0, 0] if replay and mode == "stream-turn" else None
            pp["grads"][case][mode], _ = w.run(pp_dir, case, mode, S, E, check=check, pp_group=dims.pp_group())
            if check is not None:
                both = [None] * dims.world_size
                torch.distributed.all_gather_object(both, check)
                pp["replay"][mode] = [sum(b[i] for b in both) for i in range(2)]
    out["pp2"] = pp
    return out


def logits_and_round_trip(hf_dir, tp, pp, ep, refs):
    """Initialise the (tp, pp, ep) layout, load ``hf_dir`` in float64, export it back and compare the logits with
    transformers' (``refs``: a cache of those per folder). Returns (the report row, gathered over ranks, dims)."""
    import torch

    from _glm_reference import float64_transformers, hf64
    from _qwen35_worker import _logits  # PP: the first stage sends its hidden states to the second

    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model, megatron_to_hf
    from megatron_tsync.model.logprobs import gather_vocab_parallel_logits, model_logits
    from megatron_tsync.model.parallel import initialize_parallel

    arch, state = load_hf_dir(hf_dir)
    state = {k: v if k.endswith("e_score_correction_bias") else v.double() for k, v in state.items()}
    ids = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))  # (B, S)
    if hf_dir not in refs:
        with float64_transformers(), torch.no_grad():
            refs[hf_dir] = hf64(hf_dir)(ids).logits  # (B, S, V)
    ref = refs[hf_dir]
    dims = initialize_parallel(tp, pp, ep=ep, seed=1234)
    model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=99)
    load_hf_into_model(model, state)
    back = megatron_to_hf(model)
    mismatched = [k for k in state if k not in back or not torch.equal(back[k], state[k])]
    model.eval()
    with torch.no_grad():
        mine = (gather_vocab_parallel_logits(model_logits(model, ids)) if pp == 1
                else _logits(model, ids, dims, pp))  # (B, S, V); None on a first pipeline stage
    moe_layers = [layer for layer in model.decoder.layers if hasattr(layer.mlp, "experts")]
    r = {"tp": tp, "pp": pp, "ep": ep, "dense": arch.moe_first_k_dense, "same_keys": sorted(back) == sorted(state),
         "mismatched": mismatched, "local_experts": max(len(m.mlp.experts.local_experts) for m in moe_layers)
         if moe_layers else 0, "stage_layers": [int(hasattr(m.mlp, "experts")) for m in model.decoder.layers],
         "sequence_parallel": bool(model.config.sequence_parallel),
         "rel_logit_diff": 0.0 if mine is None else ((mine - ref).abs().max() / ref.abs().max()).item()}
    gathered = [None] * dims.world_size
    torch.distributed.all_gather_object(gathered, r)
    return {**r, "rel_logit_diff": max(x["rel_logit_diff"] for x in gathered),
            "mismatched": sorted({k for x in gathered for k in x["mismatched"]}),
            "same_keys": all(x["same_keys"] for x in gathered),
            "stage_layers": [x["stage_layers"] for x in gathered]}, dims


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layouts", default="2:1:1,1:1:2", help="comma-separated tp:pp:ep")
    p.add_argument("--pp-hf", default="", help="comma-separated HF folders (4 layers) run at PP = 2 after the layouts")
    p.add_argument("--stream-out", help="also run the streaming cases at each layout; torch.save them here")
    p.add_argument("--opd-out", help="also OPD at EP = 2, TP = 2 and PP = 2 (--opd-pp-hf); torch.save it here")
    p.add_argument("--opd-pp-hf", default="", help="OPD's PP = 2 model (default: the first --pp-hf)")
    p.add_argument("--kl-ref", default="", help="the KL reference of the streaming cells (default: the last --pp-hf)")
    a = p.parse_args()

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from megatron_tsync.model.parallel import destroy_parallel

    runs = [(a.hf, tuple(int(x) for x in spec.split(":"))) for spec in a.layouts.split(",") if spec]
    runs += [(d, (1, 2, 1)) for d in a.pp_hf.split(",") if d]
    results, stream, refs = [], {"grads": {}, "idle": {}}, {}
    for hf_dir, (tp, pp, ep) in runs:
        row, dims = logits_and_round_trip(hf_dir, tp, pp, ep, refs)
        results.append(row)
        if dims.rank == 0:
            print(json.dumps(row), flush=True)
        if a.stream_out:
            name = LAYOUT_NAMES[(tp, pp, ep)]
            key = name if pp == 1 else f"pp2-dense{row['dense']}"
            cases = STREAM_CASES if pp == 1 else PP_STREAM_CASES[:2 if key == "pp2-dense1" else 1]
            stream["grads"][key], stream["idle"][key] = stream_grads(hf_dir, dims, name, cases=cases)
            extra(stream, key, hf_dir, dims, name, a.kl_ref or a.pp_hf.split(",")[-1])
    opd = opd_layouts(a.hf, a.opd_pp_hf or a.pp_hf.split(",")[0]) if a.opd_out else None
    if torch.distributed.get_rank() == 0:
        if opd is not None:
            torch.save(opd, a.opd_out)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
        if a.stream_out:
            torch.save(stream, a.stream_out)
    destroy_parallel()


if __name__ == "__main__":
    main()
