"""Qwen3.5-style worker (tests/model/test_qwen35.py; 2 gloo processes).

For each layout (TP=2, then PP=2): load the HF weights in float64 into a Megatron GPTModel, export them back with
``megatron_to_hf`` (bitwise per tensor) and compare Megatron's float64 logits with transformers' float64 logits
(``_qwen35_reference``) on the same (B, S) input. Under PP the first stage sends its hidden states to the second
(megatron's ``set_input_tensor``), which computes the logits. Rank 0 writes a JSON report.

``--stream-out PATH``: at each layout also tests/training/_workers/moe_ep_worker.py's ``grpo-bounded-trainer`` case
(float64, the learner through megatron's schedules) in sync, stream-trajectory and stream-group; rank 0
torch.saves {layout: {mode: {hf name: gradient}}} for the test to compare with one process's sync gradient.
"""

STREAM_CASE = "grpo-bounded-trainer"
STREAM_MODES = (0, 1, 3)  # moe_ep_worker.MODES: sync, stream-trajectory (order 1), stream-group

import argparse
import json
import os
import sys


def _logits(model, ids, dims, pp: int):
    import torch
    import torch.distributed as dist

    from megatron_tsync.model.logprobs import gather_vocab_parallel_logits

    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    if pp == 1:
        return gather_vocab_parallel_logits(model(ids, pos, None))  # (B, S, V)
    ranks = dist.get_process_group_ranks(dims.pp_group())
    if model.pre_process:
        hidden = model(ids, pos, None)  # (S, B, H)
        dist.send(hidden.contiguous(), ranks[1], group=dims.pp_group())
        return None
    hidden = torch.empty(ids.shape[1], ids.shape[0], model.config.hidden_size, dtype=torch.float64)
    dist.recv(hidden, ranks[0], group=dims.pp_group())
    model.set_input_tensor(hidden)
    return gather_vocab_parallel_logits(model(ids, pos, None))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layouts", default="2:1,1:2", help="comma-separated tp:pp")
    p.add_argument("--stream-out", help="also run the streaming case at each layout; torch.save it here")
    a = p.parse_args()

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _qwen35_reference import float64_transformers, hf_model

    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model, megatron_to_hf
    from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel, launcher_env

    _, world, _ = launcher_env()
    arch, state = load_hf_dir(a.hf)
    state = {k: v.double() for k, v in state.items()}
    ids = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))  # (B, S)
    with float64_transformers(), torch.no_grad():
        ref = hf_model(a.hf)(ids).logits  # (B, S, V)
    results, stream = [], {}
    for spec in a.layouts.split(","):
        tp, pp = (int(x) for x in spec.split(":"))
        dims = initialize_parallel(tp, pp, seed=1234)
        model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=99)
        load_hf_into_model(model, state)
        back = megatron_to_hf(model)
        mismatched = [k for k in state if k not in back or not torch.equal(back[k], state[k])]
        model.eval()
        with torch.no_grad():
            mine = _logits(model, ids, dims, pp)
        r = {"tp": tp, "pp": pp, "same_keys": sorted(back) == sorted(state), "mismatched": mismatched,
             "layers": len(model.decoder.layers),
             "rel_logit_diff": None if mine is None else ((mine - ref).abs().max() / ref.abs().max()).item()}
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, r)
        rels = [x["rel_logit_diff"] for x in gathered if x["rel_logit_diff"] is not None]
        results.append({**r, "rel_logit_diff": max(rels), "ranks_with_logits": len(rels),
                        "mismatched": sorted({k for x in gathered for k in x["mismatched"]}),
                        "same_keys": all(x["same_keys"] for x in gathered)})
        if dims.rank == 0:
            print(json.dumps(results[-1]), flush=True)
        del model, back
        if a.stream_out:
            from _glm_worker import _moe_ep_worker

            w = _moe_ep_worker()
            stream[f"tp{tp}pp{pp}"] = {mode: w.run_case(a.hf, dims, w.CASES[STREAM_CASE], mode, seed)[0]
                                       for mode, seed in (w.MODES[i] for i in STREAM_MODES)}
    if dims.rank == 0:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
        if a.stream_out:
            torch.save(stream, a.stream_out)
    destroy_parallel()


if __name__ == "__main__":
    main()
