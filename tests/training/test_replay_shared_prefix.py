"""--moe-router-replay with --shared-prefix on the tiny Qwen3-MoE: a group's prompt runs once per microbatch and
replays the engine's prefill routing, each continuation its own trajectory's routing (``moe.shared_prefix_routing``).

Real engine routing: a bf16 embedded engine on fragile routing (router weights × 0.02) records every position's
experts during multi-turn agent rollouts (groups of 4 per prompt); the learner is float64. Checked: every
(position, layer) the engine computed routes exactly as the engine did in the shared-prefix microbatches; the
gradient with --shared-prefix equals the unshared one (≤ 1e-12, sync / stream-group / stream-trajectory; control:
without replay it moves); a member whose prompt routes otherwise is kept out of its group's prefix (counted in
``shared_prefix_routing_split``), runs unshared with its own routing and the gradient is still the unshared one
(control: replaying the group's prompt routing for it moves the gradient; forcing it into the prefix raises).
"""

import os

import pytest
import torch

from megatron_tsync.model import moe
from megatron_tsync.streaming.ready_queue import ListSource, Sample
from megatron_tsync.training.packing import prompt_length

from .test_router_replay import _agreement, _Capture

TOL = 1e-12
G = 4
REWARDS = (1.0, 0.0, 1.0, 1.0)  # per member; every group has variance


@pytest.fixture(scope="module")
def setup(megatron_single, tmp_path_factory):
    """(arch, float64 learner DDP and SGD, the rollouts' samples)."""
    from tokenizers import Tokenizer

    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.model.tiny_model import make_tiny_model
    from megatron_tsync.model.tokenizer import TokenizerCodec
    from megatron_tsync.rollout.agent_loop import AgentConfig, AgentLoop, FunctionTools
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from megatron_tsync.rollout.engine import SamplingConfig
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    path = make_tiny_model(str(tmp_path_factory.mktemp("replay_prefix") / "moe"), family="qwen3_moe", seed=3)
    arch, state = load_hf_dir(path)
    fragile = {k: (0.02 * v if k.endswith("mlp.gate.weight") else v) for k, v in state.items()}
    engine = EmbeddedEngine.from_arch(arch, PrecisionConfig(bf16=True), record_routing=True)
    engine.update_weights({k: v.to(torch.bfloat16) for k, v in fragile.items()}, 0)
    sampling = SamplingConfig(max_new_tokens=10, tool_token_ids=tuple(range(9, arch.vocab_size, 6)), seed=5)
    codec = TokenizerCodec(Tokenizer.from_file(os.path.join(path, "tokenizer.json")))
    loop = AgentLoop(engine, codec, AgentConfig(sampling=sampling, max_turns=2, max_total_tokens=120),
                     tools=FunctionTools({}))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(9, arch.vocab_size, (n,), generator=g).tolist() for n in (12, 9, 15)]
    samples = []
    for t in loop.run([p for p in prompts for _ in range(G)]):
        k, i = divmod(t.index, G)
        samples.append(Sample(traj_id=f"g{k}t{i}", group_id=f"g{k}", group_size=G, token_ids=torch.tensor(t.token_ids),
                              loss_mask=torch.tensor(t.loss_mask, dtype=torch.float), reward=REWARDS[i],
                              behaviour_logp=torch.tensor(t.logprobs, dtype=torch.float64),
                              routing=torch.from_numpy(t.routing)))
    model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0, moe_enable_routing_replay=True)
    load_hf_into_model(model, fragile)
    ddp = wrap_ddp(model)
    return arch, (ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))), samples


def _gradient(model, samples, mode, shared, order=None, capture=False):
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for

    ddp, opt = model
    learner = Learner(ddp, opt, LearnerConfig(mode=mode, shared_prefix=shared))
    got = {}
    learner.grad_hook = lambda d: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
    cap = _Capture(ddp) if capture else None
    try:
        sizes, shape = shape_for(samples)
        res = learner.train_step(ListSource(order or samples), sizes, shape)
    finally:
        if cap is not None:
            cap.close()
    return got["g"], res, cap


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _split_forward(ids, maps, samples):
    """[(sample, per-layer (T_i, E) routing maps)] of one captured forward: one whole trajectory, or a shared-prefix
    microbatch (the prompt, then each member's continuation) taken apart into its members' positions."""
    ids = ids[0]
    for s in samples:
        if torch.equal(ids, s.token_ids):
            return [(s, maps)]
    members = [s for s in samples if s.token_ids.numel() < ids.numel()
               and torch.equal(s.token_ids[: prompt_length(s.loss_mask) - 1], ids[: prompt_length(s.loss_mask) - 1])]
    o = prompt_length(members[0].loss_mask) - 1
    out, a = [], o
    while a < ids.numel():
        s = next(s for s in members if torch.equal(s.token_ids[o:], ids[a : a + s.token_ids.numel() - o]))
        b = a + s.token_ids.numel() - o
        out.append((s, [torch.cat([m[:o], m[a:b]]) for m in maps]))
        a = b
    return out


def test_the_engine_prefills_a_group_alike(setup):
    """The premise: the engine's prefill routes a group's prompt alike in every member (one batch, same padding)."""
    _, _, samples = setup
    for g in {s.group_id for s in samples}:
        S = [s for s in samples if s.group_id == g]
        o = prompt_length(S[0].loss_mask) - 1
        heads = [moe.prompt_routing(s.routing, s.token_ids.numel(), o) for s in S]
        assert all(torch.equal(h, heads[0]) for h in heads)


@pytest.mark.parametrize("replay", [True, False])
def test_learner_routes_like_the_engine_through_shared_prefixes(setup, replay):
    """Every (position, layer) the engine computed — the prompt's in its shared forward, each continuation's in its
    own segment — routes to the engine's experts; control: without replay some route elsewhere."""
    arch, model, samples = setup
    run = samples if replay else [Sample(**{**s.__dict__, "routing": None}) for s in samples]
    _, res, cap = _gradient(model, run, "sync", True, capture=True)
    assert res.planner_stats["shared_prefix_items"] == len(samples) and len(cap.calls) == 3  # one per group
    same = differ = seen = 0
    for ids, maps in cap.calls:
        for s, per_traj in _split_forward(ids, maps, samples):
            a, b = _agreement(per_traj, s.routing)
            same, differ, seen = same + a, differ + b, seen + 1
    assert seen == len(samples) and same + differ == sum(s.routing.shape[0] for s in samples) * arch.num_layers
    print(f"replay {'on' if replay else 'off'}: {differ} of {same + differ} (position, layer) differ from the engine")
    assert differ == 0 if replay else differ > 0


@pytest.fixture(scope="module")
def reference(setup):
    _, model, samples = setup
    g, res, _ = _gradient(model, samples, "sync", False)
    assert g.norm() > 0 and res.planner_stats["shared_prefix_items"] == 0
    return g


# stream-trajectory: a group's first rewards are equal, so they wait for its 0 and then share a prefix: g0's three
# into the accumulator with its close, g1's and g2's first two into their bucket at reward 1
ORDER = (0, 2, 4, 6, 3, 5, 8, 10, 1, 9, 7, 11)


def test_gradient_equals_unshared(setup, reference):
    _, model, samples = setup
    for mode in ("sync", "stream-group", "stream-trajectory"):
        g, res, _ = _gradient(model, samples, mode, True, order=[samples[i] for i in ORDER])
        print(f"replay + shared prefix, {mode}: rel {_rel(g, reference):.2e}, "
              f"{res.planner_stats['shared_prefix_items']} continuations")
        assert _rel(g, reference) < TOL, (mode, _rel(g, reference))
        assert res.planner_stats["shared_prefix_items"] == (8 if mode == "stream-trajectory" else len(samples))
        assert res.planner_stats["shared_prefix_routing_split"] == 0
    # control: the learner's own routing (no replay) gives another gradient, so the replayed routing matters here
    own = [Sample(**{**s.__dict__, "routing": None}) for s in samples]
    g, _, _ = _gradient(model, own, "sync", True)
    print(f"control, no replay: rel {_rel(g, reference):.2e}")
    assert _rel(g, reference) > 1e-6


def test_member_whose_prompt_routes_otherwise(setup, reference):
    arch, model, samples = setup
    j = 6  # g1's third member (reward 1: in stream-trajectory it would share g1's bucket prefix with g1t0)
    s = samples[j]
    o = prompt_length(s.loss_mask) - 1
    r = s.routing.clone()
    r[o // 2, 0] = torch.tensor([e for e in range(arch.num_experts) if e not in r[o // 2, 0].tolist()]
                                [: arch.moe_router_topk], dtype=r.dtype)  # other experts at one prompt position
    odd = [Sample(**{**x.__dict__, "routing": r}) if i == j else x for i, x in enumerate(samples)]
    ref, _, _ = _gradient(model, odd, "sync", False)
    for mode, shared in (("sync", len(samples) - 1), ("stream-trajectory", 6)):
        g, res, _ = _gradient(model, odd, mode, True, order=[odd[i] for i in ORDER])
        print(f"odd member, {mode}: rel {_rel(g, ref):.2e}, {res.planner_stats['shared_prefix_items']} "
              f"continuations, split {res.planner_stats['shared_prefix_routing_split']}")
        assert _rel(g, ref) < TOL, (mode, _rel(g, ref))
        assert res.planner_stats["shared_prefix_routing_split"] == 1  # it runs alone, with its own routing
        assert res.planner_stats["shared_prefix_items"] == shared
    # control: replaying the group's prompt routing for it (what sharing its group's prefix would do) moves the
    # gradient; and the microbatch routing refuses to build such a prefix
    print(f"control, the group's prompt routing for the odd member: rel {_rel(reference, ref):.2e}")
    assert _rel(reference, ref) > 1e-9
    members = [x for x in odd if x.group_id == s.group_id]
    with pytest.raises(ValueError, match="route their first"):
        moe.shared_prefix_routing([x.routing for x in members], [x.token_ids.numel() for x in members], o)
