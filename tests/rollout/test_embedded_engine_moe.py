"""The embedded engine generates with a tiny Qwen3-MoE (KV cache, left-padded batched rows, rows dropped as they
finish): its per-token log-probs equal the trainer's ``token_logprobs`` on the same weights (measured ≤ 1e-6,
float32).
Routing is per token and dropless, so batching rows does not couple them."""

import torch

from megatron_tsync.rollout.engine import SamplingConfig


def test_moe_engine_logprobs_match_trainer(megatron_single, tmp_path):
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.model.logprobs import token_logprobs
    from megatron_tsync.model.tiny_model import make_tiny_model
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine

    path = make_tiny_model(str(tmp_path / "moe"), family="qwen3_moe", seed=3)
    arch, state = load_hf_dir(path)
    engine = EmbeddedEngine.from_hf_dir(path)
    trainer = build_model(arch, seed=1)
    load_hf_into_model(trainer, state)
    trainer.eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(9, arch.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 9)]
    out = engine.generate(prompts, SamplingConfig(max_new_tokens=16, seed=3), n=2)
    worst, count = 0.0, 0
    for p, comps in zip(prompts, out):
        for c in comps:
            with torch.no_grad():
                ref = token_logprobs(trainer, torch.tensor([list(p) + list(c.token_ids)]))[0, len(p) - 1:]
            worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
            count += len(c.token_ids)
    print(f"qwen3_moe embedded engine vs trainer: max |Δ logp| = {worst:.3g} over {count} tokens")
    assert count > 0 and worst < 1e-5


def test_moe_engine_records_each_positions_experts(megatron_single, tmp_path):
    """``record_routing``: every completion carries (P, L, k) expert indices for the P positions the engine computed
    (prompt + generated − 1; prefill rows left-padded, rows dropped as they finish); they equal the experts the
    trainer's full forward chooses at those positions (float32, same weights), with and without the KV cache."""
    from megatron_tsync.model import moe
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.model.logprobs import model_logits
    from megatron_tsync.model.tiny_model import make_tiny_model
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine

    path = make_tiny_model(str(tmp_path / "moe"), family="qwen3_moe", seed=3)
    arch, state = load_hf_dir(path)
    trainer = build_model(arch, seed=1, moe_enable_routing_replay=True)
    load_hf_into_model(trainer, state)
    trainer.eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(9, arch.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 9)]
    for cache in (True, False):
        engine = EmbeddedEngine.from_hf_dir(path, record_routing=True, use_kv_cache=cache)
        stops = tuple(range(9, 9 + arch.vocab_size // 8))  # rows end at different steps
        out = engine.generate(prompts, SamplingConfig(max_new_tokens=12, seed=4, stop_token_ids=stops), n=2)
        lens = set()
        for p, comps in zip(prompts, out):
            for c in comps:
                seq = list(p) + list(c.token_ids)
                assert c.routing.shape == (len(seq) - 1, arch.num_layers, arch.moe_router_topk)
                lens.add(len(c.token_ids))
                with torch.no_grad(), moe.record_routing(trainer) as rec:
                    model_logits(trainer, torch.tensor([seq]))
                mine = torch.stack(rec.indices, dim=1)[:-1].sort(-1).values  # (P, L, k)
                assert torch.equal(torch.from_numpy(c.routing).long().sort(-1).values, mine)
        assert len(lens) > 1  # rows finished at different steps (the dropped-row path ran)
