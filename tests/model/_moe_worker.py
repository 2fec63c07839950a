"""Qwen3-MoE worker (tests/model/test_qwen3_moe.py; single process or torchrun with 2 gloo processes).

For every layout (world 1: TP=1; world 2: TP=2, EP=2, PP=2 in turn): load the HF weights into a Megatron GPTModel
stage, export them back with ``megatron_to_hf`` (compare bitwise per tensor) and compare Megatron's fp32 logits
(vocab shards gathered; with PP the first stage sends its hidden states to the last) with transformers' eager fp32
logits on the same (B, S) input. Rank 0 writes a JSON report.
"""

import argparse
import json


def _pp_logits(model, ids, dims):
    """Logits of a 2-stage pipeline by hand: stage 0 sends its (S, B, H) output to stage 1 (gloo p2p)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_tsync.model.logprobs import model_logits

    ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    if dims.pp_rank == 0:
        hidden = model(ids, pos, None)  # (S, B, H)
        dist.send(hidden.contiguous(), dst=ranks[1])
        return None
    hidden = torch.empty(ids.shape[1], ids.shape[0], model.config.hidden_size)
    dist.recv(hidden, src=ranks[0])
    model.set_input_tensor(hidden)
    return model_logits(model, ids, pos)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layouts", default=None, help="comma-separated tp:pp:ep (default: by world size)")
    a = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from megatron_tsync.model.builder import build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model, megatron_to_hf
    from megatron_tsync.model.logprobs import gather_vocab_parallel_logits, model_logits
    from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel, launcher_env

    _, world, _ = launcher_env()
    if a.layouts:
        layouts = [tuple(int(x) for x in s.split(":")) for s in a.layouts.split(",")]
    else:
        layouts = [(1, 1, 1)] if world == 1 else [(2, 1, 1), (1, 1, 2), (1, 2, 1)]
    arch, state = load_hf_dir(a.hf)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (2, 24), generator=g)  # (B, S)
    hf = AutoModelForCausalLM.from_pretrained(a.hf, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref = hf(ids).logits  # (B, S, V)
    results = []
    for tp, pp, ep in layouts:
        dims = initialize_parallel(tp, pp, ep=ep, seed=1234)
        model = build_model(arch, seed=99)
        load_hf_into_model(model, state)
        back = megatron_to_hf(model)
        mismatched = [k for k in state if k not in back or not torch.equal(back[k], state[k])]
        r = {"tp": tp, "pp": pp, "ep": ep, "same_keys": sorted(back) == sorted(state), "mismatched": mismatched,
             "local_experts": len(model.decoder.layers[0].mlp.experts.local_experts)}
        model.eval()  # megatron refuses MoE + TP without sequence parallelism in training mode
        with torch.no_grad():
            mine = model_logits(model, ids) if pp == 1 else _pp_logits(model, ids, dims)
        if mine is not None:
            mine = gather_vocab_parallel_logits(mine)  # (B, S, V)
            r["max_abs_logit_diff"] = (mine - ref).abs().max().item()
            r["max_abs_logit"] = ref.abs().max().item()
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, r)
        results.append({**r, "max_abs_logit_diff": max(x.get("max_abs_logit_diff", 0.0) for x in gathered),
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
