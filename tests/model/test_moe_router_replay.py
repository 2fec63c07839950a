"""Router replay on the tiny Qwen3-MoE (model/moe.py over megatron-core's RouterReplay), single process.

The engine side (recording each sampled token's experts, carrying them in the trajectory event) is not built yet;
transformers' router logits stand in for the engine here: the learner records the same top-k as transformers for
every token, replaying those choices leaves the logits bitwise unchanged, and replaying other choices makes the
routers follow them (routing map = the replayed indices) and changes the logits.
"""

import pytest
import torch

from megatron_tsync.model import moe


@pytest.fixture(scope="module")
def setup(megatron_single, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from megatron_tsync.model.builder import build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.model.tiny_model import make_tiny_model

    path = make_tiny_model(str(tmp_path_factory.mktemp("replay") / "m"), family="qwen3_moe", seed=3)
    arch, state = load_hf_dir(path)
    model = build_model(arch, seed=0, moe_enable_routing_replay=True)
    load_hf_into_model(model, state)
    model.eval()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    ids = torch.randint(0, arch.vocab_size, (1, 20), generator=torch.Generator().manual_seed(5))  # (1, S)
    return arch, model, hf, ids


def _logits(model, ids):
    from megatron_tsync.model.logprobs import model_logits

    with torch.no_grad():
        return model_logits(model, ids)  # (1, S, V)


def test_learner_records_the_engines_experts(setup):
    arch, model, hf, ids = setup
    with torch.no_grad():
        out = hf(ids, output_router_logits=True)
    engine = [torch.topk(lg.float(), arch.moe_router_topk, dim=-1).indices for lg in out.router_logits]  # (S, k)
    with moe.record_routing(model) as rec:
        _logits(model, ids)
    assert len(rec.indices) == arch.num_layers
    for mine, theirs in zip(rec.indices, engine):
        assert torch.equal(mine.sort(dim=-1).values, theirs.sort(dim=-1).values)


def test_replay_follows_the_given_experts(setup):
    arch, model, _, ids = setup
    base = _logits(model, ids)
    with moe.record_routing(model) as rec:
        _logits(model, ids)
    with moe.replay_routing(model, rec.indices):
        same = _logits(model, ids)
    assert torch.equal(same, base)  # replaying the router's own choice changes nothing, bitwise

    other = [(idx + 1) % arch.num_experts for idx in rec.indices]  # every token to other experts
    maps = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, i, o: maps.append(o[1].clone()))
             for layer in model.decoder.layers]
    try:
        with moe.replay_routing(model, other):
            moved = _logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    for routing_map, idx in zip(maps, other):  # (S, E) bool: exactly the replayed experts
        expect = torch.zeros_like(routing_map).scatter(1, idx, True)
        assert torch.equal(routing_map, expect)
    assert (moved - base).abs().max() > 1e-3
    _logits(model, ids)  # the context is gone: routing is the model's own again
    assert torch.equal(_logits(model, ids), base)


def test_replay_needs_the_config_flag(megatron_single):
    from megatron_tsync.model.builder import ModelArch, build_model

    from .test_qwen3_moe import QWEN3_MOE_JSON

    model = build_model(ModelArch.from_hf_config(QWEN3_MOE_JSON), seed=0)
    with pytest.raises(ValueError, match="moe_enable_routing_replay"):
        with moe.record_routing(model):
            pass


def test_bf16_engine_routing_replayed_in_fp32_trainer(megatron_single, tmp_path):
    """A bf16 "engine" and the fp32 trainer on the same weights, with fragile routing (router weights × 0.02):
    some (token, layer) routing decisions differ; with replay the trainer routes every token like the engine, and
    its log-probs are closer to the engine's on average. The max |Δ logp| (~0.03-0.05 on this tiny model) is
    mostly bf16 rounding, which replay cannot remove; printed with -s."""
    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.model.logprobs import token_logprobs
    from megatron_tsync.model.tiny_model import make_tiny_model

    arch, state = load_hf_dir(make_tiny_model(str(tmp_path / "m"), family="qwen3_moe", seed=3))
    state = {k: (0.02 * v if k.endswith("mlp.gate.weight") else v) for k, v in state.items()}
    engine = build_model(arch, PrecisionConfig(bf16=True), seed=0, moe_enable_routing_replay=True)
    load_hf_into_model(engine, {k: v.to(torch.bfloat16) for k, v in state.items()})
    trainer = build_model(arch, seed=0, moe_enable_routing_replay=True)
    load_hf_into_model(trainer, state)
    engine.eval(), trainer.eval()
    ids = torch.randint(9, arch.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    maps = []
    with torch.no_grad():
        with moe.record_routing(engine) as eng:
            logp_engine = token_logprobs(engine, ids).float()
        with moe.record_routing(trainer) as own:
            logp_free = token_logprobs(trainer, ids)
        hooks = [layer.mlp.router.register_forward_hook(lambda m, i, o: maps.append(o[1].clone()))
                 for layer in trainer.decoder.layers]
        try:
            with moe.replay_routing(trainer, eng.indices):
                logp_replay = token_logprobs(trainer, ids)
        finally:
            for h in hooks:
                h.remove()
    differ = sum((a.sort(-1).values != b.sort(-1).values).any(-1).sum().item()
                 for a, b in zip(eng.indices, own.indices))
    for routing_map, idx in zip(maps, eng.indices):
        assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, idx, True))
    d_free, d_replay = (logp_free - logp_engine).abs(), (logp_replay - logp_engine).abs()
    print(f"bf16 engine vs fp32 trainer: {differ} of {ids.numel() * arch.num_layers} routing decisions differ; "
          f"|Δ logp| max {d_free.max():.3g} / mean {d_free.mean():.4g} without replay, "
          f"max {d_replay.max():.3g} / mean {d_replay.mean():.4g} with")
    assert differ > 0  # the engine really routed some tokens elsewhere
    assert d_replay.mean() < d_free.mean()  # and following it removes that part of the mismatch
