"""Row-split weight gradients (model/row_split.py) and ``--pack-across-groups``: float64, one process.

- The wrapped model's one backward of a packed microbatch with per-row destinations and coefficients equals, for
  every destination, a separate plain autograd backward of its own segments' loss scaled row by row (an independent
  path: megatron's own layers, no wrappers active, one microbatch per segment).
- stream-trajectory with packed microbatches that mix groups, rewards and the accumulator equals batch-synchronous
  training ≤ 1e-12 (every estimator family: P and Q buckets, α known, the accumulator), also with deferred items
  inside a mixed microbatch (PPO clip, ratio ≠ 1) and with Qwen3's QK-norm and tied embeddings.
- Refusals: a parameter the wrappers cannot split, a flag combination the executor cannot serve.
"""

import pytest
import torch

from megatron_tsync.algorithms.policy_loss import PolicyLossConfig
from megatron_tsync.model import row_split
from megatron_tsync.model.builder import ModelArch, PrecisionConfig, build_model
from megatron_tsync.model.logprobs import token_logprobs
from megatron_tsync.streaming.ready_queue import ListSource
from megatron_tsync.training.learner import Learner, LearnerConfig
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
from megatron_tsync.training.packing import layout_for, share_key
from megatron_tsync.training.stream_fb import LossConfig

from ..training.stream_cases import TINY, arrival_order, make_samples, prompt_groups, spec_for
from ..training.test_packing import gradient, rel

TOL = 1e-12
# every parameter kind the wrappers split: QK-norm weights, a QKV bias (Qwen2's), a tied output layer
QWEN = ModelArch(family="qwen3", vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                 num_attention_heads=4, num_kv_heads=2, head_dim=16, qk_layernorm=True, tie_word_embeddings=True,
                 qkv_bias=True)


def _ddp(arch):
    ddp = wrap_ddp(build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0))
    return ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))


@pytest.fixture(scope="module")
def model64(megatron_single):
    return _ddp(TINY)


@pytest.fixture(scope="module")
def qwen64(megatron_single):
    return _ddp(QWEN)


def _spy_mixed(monkeypatch):
    """Number of distinct share keys of every microbatch the executor plans."""
    from megatron_tsync.training import packing, stream_fb

    seen = []

    def spy(items, length, max_tokens, key=None):
        out = packing.plan_microbatches(items, length, max_tokens, key=key)
        seen.extend(len({share_key(it) for it in p}) for p in out)
        return out

    monkeypatch.setattr(stream_fb, "plan_microbatches", spy)
    return seen


# ------------------------------------------------------------------------------------------ the split itself
def test_split_backward_equals_per_destination_backwards(qwen64):
    """Three segments, two destinations with row coefficients (one segment in both): each destination's split
    gradient equals the plain backward of Σ_k c_k·loss_k over its segments, each segment alone."""
    ddp, _ = qwen64
    gpt = ddp.module
    row_split.install(gpt)
    ddp.zero_grad_buffer()
    g = torch.Generator().manual_seed(3)
    segs = [torch.randint(0, 256, (n,), generator=g) for n in (7, 5, 9)]
    lay = layout_for([len(s) for s in segs])
    ids = torch.cat(segs).unsqueeze(0)
    pos = lay.position_ids()
    params = [p for p in gpt.parameters() if p.requires_grad]
    dest_coefs = [{0: 1.0, 2: -0.5}, {1: 2.0, 2: 3.0}]  # destination -> {segment: coefficient}
    sinks = [{id(p): torch.zeros_like(p) for p in params} for _ in dest_coefs]
    plan = row_split.RowPlan()
    with row_split.active(plan):
        logits = gpt(ids, pos.unsqueeze(0), None, packed_seq_params=lay.packed_seq_params(torch.device("cpu")))
    plan.spans = []
    for k, (a, b) in enumerate(lay.segments()):  # segment 2 has two targets: one GEMM, added twice
        targets = [(lambda p, s=sink: s[id(p)], coefs[k]) for coefs, sink in zip(dest_coefs, sinks) if k in coefs]
        plan.spans.append(row_split.RowSpan(a, b, targets))
    weights = [torch.randn(logits.shape[-1], generator=g, dtype=torch.float64) for _ in segs]
    loss = sum((logits[0, a:b] * w).sum() for (a, b), w in zip(lay.segments(), weights))
    for p in params:
        p.grad = None
    loss.backward()
    assert all(p.grad is None for p in params)
    assert all(not p.main_grad.any() for p in params)  # every parameter's gradient went to the destinations only
    for coefs, sink in zip(dest_coefs, sinks):
        ddp.zero_grad_buffer()  # the plain backward lands in main_grad (megatron's DDP hooks)
        ref = 0.0
        for k, c in coefs.items():
            out = gpt(segs[k].unsqueeze(0), torch.arange(len(segs[k])).unsqueeze(0), None)
            ref = ref + c * (out[0] * weights[k]).sum()
        ref.backward()
        for p in params:
            want = p.main_grad
            assert torch.allclose(sink[id(p)], want, rtol=1e-11, atol=1e-13), (tuple(p.shape),
                                                                                (sink[id(p)] - want).abs().max())
    ddp.zero_grad_buffer()  # the learner's steps start from a zero accumulator


def test_install_refuses_what_it_cannot_split(megatron_single):
    from megatron_tsync.model import moe

    arch = ModelArch(family="qwen3_moe", vocab_size=128, hidden_size=32, ffn_hidden_size=64, num_layers=1,
                     num_attention_heads=2, num_kv_heads=1, head_dim=16, qk_layernorm=True, num_experts=2,
                     moe_router_topk=1, moe_ffn_hidden_size=32)
    assert moe  # the MoE spec: router and expert weights are not row-split
    with pytest.raises(ValueError, match="cannot split the gradient"):
        row_split.install(build_model(arch, seed=0))


# ------------------------------------------------------------------------------------------ the learner
@pytest.mark.parametrize("estimator,reward", [("grpo", "binary"), ("grpo", "bounded"), ("dr_grpo", "continuous"),
                                              ("rloo", "binary"), ("grpo_batch_std", "binary"),
                                              ("grpo_unbiased", "bounded")])
def test_mixed_microbatches_equal_sync(model64, monkeypatch, estimator, reward):
    samples = make_samples(11, num_groups=4, reward_kind=reward)
    kw = dict(estimator=estimator, reward_spec=spec_for(reward))
    g_sync, _, _ = gradient(model64, "sync", samples, samples, **kw)
    mixed = _spy_mixed(monkeypatch)
    for seed in (1, 2):
        order = ListSource(arrival_order(samples, seed), batch=5)
        g, res, L = gradient(model64, "stream-trajectory", samples, order, packing=120, pack_across_groups=True,
                             wait_for_variance=False, **kw)
        assert rel(g, g_sync) < TOL, (seed, rel(g, g_sync))
        assert res.planner_stats["bucketed"] > 0
    assert max(mixed) > 1, mixed  # some microbatches really mixed destinations


def test_mixed_microbatches_fewer_than_shared_key_packing(model64):
    """Same arrivals: mixing needs fewer microbatches than packing by destination, for the same update."""
    samples = make_samples(12, num_groups=4, reward_kind="binary")
    counts = {}
    for mix in (False, True):
        g, res, _ = gradient(model64, "stream-trajectory", samples, ListSource(arrival_order(samples, 3), batch=6),
                             packing=4096, pack_across_groups=mix, wait_for_variance=False)
        counts[mix] = (res.microbatches, g)
    assert counts[True][0] < counts[False][0], counts
    assert rel(counts[True][1], counts[False][1]) < TOL


def test_mixed_with_deferred_items(model64, monkeypatch):
    """PPO clip with engine log-probs (ratio ≠ 1): items deferred after their forward inside a mixed microbatch add
    nothing there and run again at group close."""
    samples = make_samples(7, reward_kind="bounded", num_groups=4)
    kw = dict(estimator="grpo", reward_spec=spec_for("bounded"),
              loss=LossConfig(policy=PolicyLossConfig(), old_logprobs="engine"))
    g_sync, _, _ = gradient(model64, "sync", samples, samples, **kw)
    mixed = _spy_mixed(monkeypatch)
    for seed in (5, 6):
        g, res, _ = gradient(model64, "stream-trajectory", samples, ListSource(arrival_order(samples, seed), batch=6),
                             packing=200, pack_across_groups=True, **kw)
        assert rel(g, g_sync) < TOL, (seed, rel(g, g_sync))
        assert res.planner_stats["deferred"] > 0
    assert max(mixed) > 1


def test_mixed_qwen3_tied(qwen64):
    """QK-norm weights and a tied output layer (the embedding gets both terms) through mixed microbatches."""
    samples = make_samples(11, num_groups=4, reward_kind="binary")
    g_sync, _, _ = gradient(qwen64, "sync", samples, samples)
    g, _, _ = gradient(qwen64, "stream-trajectory", samples, ListSource(arrival_order(samples, 4), batch=7),
                       packing=4096, pack_across_groups=True, wait_for_variance=False)
    assert rel(g, g_sync) < TOL


def test_pack_across_groups_refusals(model64):
    ddp, opt = model64
    with pytest.raises(ValueError, match="--sequence-packing"):
        Learner(ddp, opt, LearnerConfig(mode="stream-trajectory", pack_across_groups=True))
    with pytest.raises(ValueError, match="--deterministic"):
        Learner(ddp, opt, LearnerConfig(mode="stream-trajectory", pack_across_groups=True, deterministic=True,
                                        sequence_packing=True))
    with pytest.raises(ValueError, match="--max-device-buckets"):
        Learner(ddp, opt, LearnerConfig(mode="stream-trajectory", pack_across_groups=True, sequence_packing=True,
                                        max_device_buckets=2))


def test_logprobs_unchanged_outside_a_plan(model64):
    """Installed wrappers are inert without an active plan: the same log-probs as before installing."""
    ddp, _ = model64
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    before = token_logprobs(ddp.module, ids)
    row_split.install(ddp.module)
    assert torch.equal(token_logprobs(ddp.module, ids), before)


def test_mixed_bf16_weights(megatron_single):
    """bf16 weights (fp32 or bf16 grad buffers, whatever megatron's DDP makes): the split GEMMs add into them without a
    dtype error, and the update is the unmixed one up to bf16 rounding."""
    ddp = wrap_ddp(build_model(TINY, PrecisionConfig(bf16=True), seed=0))
    model = (ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0)))
    samples = make_samples(11, num_groups=4, reward_kind="binary")
    got = {}
    for mix in (False, True):
        g, _, _ = gradient(model, "stream-trajectory", samples, ListSource(arrival_order(samples, 4), batch=7),
                           packing=4096, pack_across_groups=mix, wait_for_variance=False)
        got[mix] = g.double()
    assert rel(got[True], got[False]) < 5e-3, rel(got[True], got[False])  # 6e-4 measured


def test_mixed_beside_shared_prefix_packs(model64, monkeypatch):
    """--shared-prefix packs (one destination, routed by the moving origin) and mixed packs (fixed origin) in one
    step: both keep P = Σ (r_j − ρ)·h_j, so they alternate exactly."""
    samples = prompt_groups(5)
    kw = dict(estimator="grpo", reward_spec=spec_for("binary"), skip_zero_advantage=False)
    g_ref, _, _ = gradient(model64, "sync", samples, samples, **kw)
    mixed = _spy_mixed(monkeypatch)
    shared = 0
    for seed in (0, 1, 2):
        g, res, _ = gradient(model64, "stream-trajectory", samples, ListSource(arrival_order(samples, seed), batch=5),
                             packing=4096, shared_prefix=True, pack_across_groups=True, **kw)
        assert rel(g, g_ref) < TOL, (seed, rel(g, g_ref))
        shared += res.planner_stats["shared_prefix_items"]
    assert shared > 0 and max(mixed) > 1, (shared, mixed)
