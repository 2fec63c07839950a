"""HF ⇄ Megatron conversion worker (run by tests/model/test_hf_conversion.py and tests/model/test_qwen3*.py, single process or torchrun).

For every layout (world 1: TP=1; world 2: TP=2 then PP=2) and every given HF folder: load the HF weights into a
Megatron GPTModel stage, export them back with ``megatron_to_hf`` (compare bitwise), and, without PP, compare
Megatron's logits (vocab shards gathered) with transformers' fp32 logits. Rank 0 writes a JSON report.
"""

import argparse
import json


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", nargs="+", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model, megatron_to_hf
    from megatron_tsync.model.logprobs import gather_vocab_parallel_logits, model_logits
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel, launcher_env

    _, world, _ = launcher_env()
    layouts = [(1, 1)] if world == 1 else [(2, 1), (1, 2)]
    results = []
    for tp, pp in layouts:
        dims = initialize_parallel(tp, pp, seed=1234)
        for path in a.hf:
            arch, state = load_hf_dir(path)
            model = build_model(arch, seed=99)
            load_hf_into_model(model, state)
            back = megatron_to_hf(model)
            same_keys = sorted(back) == sorted(state)
            mismatched = [k for k in state if k not in back or not torch.equal(back[k], state[k])]
            r = {"path": path, "family": arch.family, "tie": arch.tie_word_embeddings, "tp": tp, "pp": pp,
                 "same_keys": same_keys, "mismatched": mismatched, "max_abs_logit_diff": None,
                 "qk_layernorm": arch.qk_layernorm, "rope_type": arch.rope_type}
            if pp == 1:
                tok = AutoTokenizer.from_pretrained(path)
                text = "Q: 12+7*3 <tool>calculator: 12+7*3</tool><result>33</result><answer>33</answer>"
                ids = torch.tensor([tok(text)["input_ids"]] * 2)  # (B, S)
                g = torch.Generator().manual_seed(0)
                ids[1] = torch.randint(0, arch.vocab_size, (ids.shape[1],), generator=g)
                hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
                with torch.no_grad():
                    ref = hf(ids).logits  # (B, S, V)
                    mine = gather_vocab_parallel_logits(model_logits(model, ids))  # (B, S, V)
                r["max_abs_logit_diff"] = (mine - ref).abs().max().item()
                r["max_abs_logit"] = ref.abs().max().item()
            results.append(r)
        destroy_parallel() if (tp, pp) == layouts[-1] else None
        if dims.rank == 0:
            print(json.dumps(results[-len(a.hf):], indent=1), flush=True)
    if dims.rank == 0:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
