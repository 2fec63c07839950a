"""Router replay end to end on the tiny Qwen3-MoE: the embedded engine records each position's experts during
multi-turn agent rollouts (prefill, decode, re-prefill of tool results), the trajectories carry them, and the
learner's training forward routes every token to exactly the engine's experts (``--moe-router-replay``).

Figures (printed with -s): engine-vs-trainer log-prob max/mean |Δ| with and without replay, for a float32 engine
and for a bf16 engine beside the float32 trainer (router weights × 0.02 there, so that routing is fragile).
"""

import os

import pytest
import torch

from megatron_tsync.model import moe
from megatron_tsync.streaming.ready_queue import ListSource, Sample


@pytest.fixture(scope="module")
def tiny(megatron_single, tmp_path_factory):
    from megatron_tsync.model.hf_conversion import load_hf_dir
    from megatron_tsync.model.tiny_model import make_tiny_model

    path = make_tiny_model(str(tmp_path_factory.mktemp("replay") / "moe"), family="qwen3_moe", seed=3)
    arch, state = load_hf_dir(path)
    return path, arch, state


def _rollouts(path, arch, state, precision=None, n_prompts=4):
    """Multi-turn rollouts of the real agent loop: every 6th token id ends a turn as a tool call, so most
    trajectories have 2-3 turns with tool results (re-prefilled at the next turn) in between."""
    from tokenizers import Tokenizer

    from megatron_tsync.model.tokenizer import TokenizerCodec
    from megatron_tsync.rollout.agent_loop import AgentConfig, AgentLoop, FunctionTools
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from megatron_tsync.rollout.engine import SamplingConfig

    codec = TokenizerCodec(Tokenizer.from_file(os.path.join(path, "tokenizer.json")))
    engine = EmbeddedEngine.from_arch(arch, precision, record_routing=True)
    engine.update_weights(state, 0)
    sampling = SamplingConfig(max_new_tokens=12, tool_token_ids=tuple(range(9, arch.vocab_size, 6)), seed=5)
    loop = AgentLoop(engine, codec, AgentConfig(sampling=sampling, max_turns=3, max_total_tokens=160),
                     tools=FunctionTools({}))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(9, arch.vocab_size, (n,), generator=g).tolist() for n in (5, 11, 8, 14)[:n_prompts]]
    return loop.run([p for p in prompts for _ in range(2)])


def _samples(trajs):
    out = []
    for t in trajs:
        out.append(Sample(traj_id=f"g{t.index // 2}t{t.index % 2}", group_id=f"g{t.index // 2}", group_size=2,
                          token_ids=torch.tensor(t.token_ids), loss_mask=torch.tensor(t.loss_mask, dtype=torch.float),
                          reward=float(t.index % 2), behaviour_logp=torch.tensor(t.logprobs, dtype=torch.float64),
                          routing=torch.from_numpy(t.routing)))
    return out


def _trainer(arch, state):
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.model.hf_conversion import load_hf_into_model

    m = build_model(arch, seed=0, moe_enable_routing_replay=True)
    load_hf_into_model(m, state)
    return m


class _Capture:
    """Every forward of the model: its input ids and, per MoE layer, the routing map the router produced."""

    def __init__(self, model):
        from megatron_tsync.model.builder import unwrap

        gpt = unwrap(model)
        self.calls: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self.hooks = [gpt.register_forward_pre_hook(lambda m, a: self.calls.append((a[0].detach().clone(), [])))]
        for layer in gpt.decoder.layers:
            self.hooks.append(layer.mlp.router.register_forward_hook(
                lambda m, i, o: self.calls[-1][1].append(o[1].detach().clone())))

    def close(self):
        for h in self.hooks:
            h.remove()


def _agreement(maps, routing):
    """(positions × layers that match, that differ) between (T, E) routing maps and a (P, L, k) engine record."""
    same = differ = 0
    for layer, rmap in enumerate(maps):
        eng = torch.zeros(routing.shape[0], rmap.shape[1], dtype=torch.bool)
        eng.scatter_(1, routing[:, layer].long(), True)
        eq = (rmap[: routing.shape[0]] == eng).all(-1)
        same, differ = same + int(eq.sum()), differ + int((~eq).sum())
    return same, differ


def test_engine_routing_survives_the_agent_loop(tiny):
    path, arch, state = tiny
    trajs = _rollouts(path, arch, state)
    assert max(t.num_turns for t in trajs) >= 2 and any(t.tool_calls for t in trajs)
    trainer = _trainer(arch, state)
    trainer.eval()
    for t in trajs:  # first computation wins: a turn's tokens keep their decode-time experts after re-prefill
        last = t.turn_spans[-1][1]
        assert t.routing.shape == (last - 1, arch.num_layers, arch.moe_router_topk)
        with torch.no_grad(), moe.record_routing(trainer) as rec:
            from megatron_tsync.model.logprobs import model_logits

            model_logits(trainer, torch.tensor([t.token_ids]))
        full = torch.stack(rec.indices, 1)[: last - 1].sort(-1).values
        assert torch.equal(torch.from_numpy(t.routing).long().sort(-1).values, full)  # fp32: same choices


@pytest.mark.parametrize("replay", [True, False])
def test_learner_routes_like_the_bf16_engine(tiny, replay):
    """A bf16 engine on fragile routing: without replay the learner's training forward routes some tokens
    elsewhere (the control); with replay every (position, layer) the engine computed routes exactly as it did."""
    from megatron_tsync.model.builder import PrecisionConfig
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    path, arch, state = tiny
    fragile = {k: (0.02 * v if k.endswith("mlp.gate.weight") else v) for k, v in state.items()}
    samples = _samples(_rollouts(path, arch, {k: v.to(torch.bfloat16) for k, v in fragile.items()},
                                 PrecisionConfig(bf16=True)))
    engine_routing = {tuple(s.token_ids.tolist()): s.routing for s in samples}
    if not replay:
        samples = [Sample(**{**s.__dict__, "routing": None}) for s in samples]
    ddp = wrap_ddp(_trainer(arch, fragile))
    learner = Learner(ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0)),
                      LearnerConfig(mode="stream-trajectory"))
    cap = _Capture(ddp)
    try:
        sizes, shape = shape_for(samples)
        learner.train_step(ListSource(samples), sizes, shape)
    finally:
        cap.close()
    assert len(cap.calls) == len(samples)  # one training forward per trajectory (no packing)
    same = differ = 0
    for ids, maps in cap.calls:
        a, b = _agreement(maps, engine_routing[tuple(ids[0].tolist())])
        same, differ = same + a, differ + b
    print(f"bf16 engine, fp32 learner, replay {'on' if replay else 'off'}: {differ} of {same + differ} "
          f"(position, layer) routing decisions differ from the engine's")
    if replay:
        assert differ == 0 and same > 0
    else:
        assert differ > 0  # the control: routing really is fragile here, so the replay test can fail


@pytest.mark.parametrize("engine_dtype", ["fp32", "bf16"])
def test_logprob_mismatch_with_and_without_replay(tiny, engine_dtype):
    """Engine-vs-trainer |Δ logp| on the generated tokens of real multi-turn rollouts, the trainer float32 with
    its own routing and with the engine's (fragile routing: router weights × 0.02). The figures go to the note."""
    from megatron_tsync.model.builder import PrecisionConfig
    from megatron_tsync.model.logprobs import token_logprobs

    path, arch, state = tiny
    fragile = {k: (0.02 * v if k.endswith("mlp.gate.weight") else v) for k, v in state.items()}
    bf16 = engine_dtype == "bf16"
    eng_state = {k: v.to(torch.bfloat16) for k, v in fragile.items()} if bf16 else fragile
    samples = _samples(_rollouts(path, arch, eng_state, PrecisionConfig(bf16=True) if bf16 else None))
    trainer = _trainer(arch, fragile)
    trainer.eval()
    d = {False: [], True: []}
    for s in samples:
        ids, m = s.token_ids[None], s.loss_mask[1:].bool()
        for replay in (False, True):
            with torch.no_grad(), moe.replay_microbatch(
                    trainer, moe.microbatch_routing([s.routing], [ids.shape[1]]) if replay else None):
                lp = token_logprobs(trainer, ids)[0]  # (T-1,)
            d[replay].append((lp - s.behaviour_logp[1:])[m].abs())
    off, on = torch.cat(d[False]), torch.cat(d[True])
    print(f"{engine_dtype} engine vs fp32 trainer over {on.numel()} tokens: |Δ logp| max {off.max():.3g} / mean "
          f"{off.mean():.3g} without replay, max {on.max():.3g} / mean {on.mean():.3g} with")
    assert on.numel() > 0
    if bf16:
        assert on.mean() < off.mean()
    else:  # a float32 engine routes as the trainer does: replay changes nothing and both agree to fp32 rounding
        assert on.max() < 1e-5 and off.max() < 1e-5
