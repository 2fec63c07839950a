"""GLM-4.7-Flash-style worker (tests/model/test_glm4_moe_lite.py; torchrun with 2 gloo processes).

For each layout (TP=2, then EP=2): load the HF weights in float64 into a Megatron GPTModel, export them back with
``megatron_to_hf`` (bitwise per tensor) and compare Megatron's float64 logits (vocab shards gathered) with
transformers' float64 logits (``_glm_reference``) on the same (B, S) input. Rank 0 writes a JSON report.
"""

import argparse
import json
import os
import sys


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layouts", default="2:1:1,1:1:2", help="comma-separated tp:pp:ep")
    a = p.parse_args()

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _glm_reference import float64_transformers, hf64

    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model, megatron_to_hf
    from megatron_tsync.model.logprobs import gather_vocab_parallel_logits, model_logits
    from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel, launcher_env

    _, world, _ = launcher_env()
    arch, state = load_hf_dir(a.hf)
    state = {k: v if k.endswith("e_score_correction_bias") else v.double() for k, v in state.items()}
    ids = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))  # (B, S)
    with float64_transformers(), torch.no_grad():
        ref = hf64(a.hf)(ids).logits  # (B, S, V)
    results = []
    for spec in a.layouts.split(","):
        tp, pp, ep = (int(x) for x in spec.split(":"))
        dims = initialize_parallel(tp, pp, ep=ep, seed=1234)
        model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=99)
        load_hf_into_model(model, state)
        back = megatron_to_hf(model)
        mismatched = [k for k in state if k not in back or not torch.equal(back[k], state[k])]
        model.eval()
        with torch.no_grad():
            mine = gather_vocab_parallel_logits(model_logits(model, ids))  # (B, S, V)
        r = {"tp": tp, "pp": pp, "ep": ep, "same_keys": sorted(back) == sorted(state), "mismatched": mismatched,
             "local_experts": len(model.decoder.layers[1].mlp.experts.local_experts),
             "sequence_parallel": bool(model.config.sequence_parallel),
             "rel_logit_diff": ((mine - ref).abs().max() / ref.abs().max()).item()}
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, r)
        results.append({**r, "rel_logit_diff": max(x["rel_logit_diff"] for x in gathered),
                        "mismatched": sorted({k for x in gathered for k in x["mismatched"]}),
                        "same_keys": all(x["same_keys"] for x in gathered)})
        if dims.rank == 0:
            print(json.dumps(results[-1]), flush=True)
    if dims.rank == 0:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    destroy_parallel()


if __name__ == "__main__":
    main()
