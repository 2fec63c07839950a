"""The learner on the Qwen3.5-style hybrid (model/qwen35.py), float64, one process: streamed == sync ≤ 1e-12.

- GRPO / RLOO with PPO clip (π_old from the trainer: bucketed trajectories; from the engine: the clip rule), a KL
  loss term (second backward), sequence packing (block-causal packs: the linear layers restart their state at each
  segment): stream-trajectory (two arrival orders) and stream-group gradients equal sync; the linear-attention
  parameters (in_proj, conv1d, A_log, dt_bias, out_norm) and the gated attention all get gradient;
- several minibatches and epochs (SGD with a real learning rate): weights after the step equal sync's;
- OPD: the incremental forward (the linear layers' conv window and recurrent state kept like K/V) equals the full
  forward, and stream-turn / stream-trajectory gradients equal sync (tests/training/_workers/opd_worker.py's cases
  on this model), the turn-cut control does not.
"""

import os
import sys

import pytest
import torch

from megatron_tsync.model import hf_conversion as hc
from megatron_tsync.model.builder import PrecisionConfig, build_model

TOL = 1e-12


@pytest.fixture(scope="module")
def tiny_q35(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("q35s") / "qwen3_5"), family="qwen3.5", hidden=64, seed=3)


def _load64(tiny_q35, **kw):
    arch, state = hc.load_hf_dir(tiny_q35)
    model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0, **kw)
    hc.load_hf_into_model(model, {k: v.double() for k, v in state.items()})
    return model


@pytest.fixture(scope="module")
def q35_ddp(tiny_q35, megatron_single):
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    ddp = wrap_ddp(_load64(tiny_q35))
    return ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))


_PARTS = {"in_proj": "self_attention.in_proj.", "conv1d": "conv1d.", "A_log": "A_log", "dt_bias": "dt_bias",
          "out_norm": "out_norm.", "gated_qkv": "linear_qkv.", "q_norm": "q_layernorm."}


def _step(q35_ddp, mode, samples, order, **kw):
    from megatron_tsync.streaming.ready_queue import ListSource
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for

    ddp, opt = q35_ddp
    learner = Learner(ddp, opt, LearnerConfig(mode=mode, **kw))
    got = {}

    def hook(d):
        got["g"] = torch.cat([b.grad_data.clone() for b in d.buffers])
        got["norms"] = {k: sum(p.main_grad.norm().item() for n, p in ddp.named_parameters() if s in n)
                        for k, s in _PARTS.items()}

    learner.grad_hook = hook
    sizes, shape = shape_for(samples)
    res = learner.train_step(ListSource(order), sizes, shape)
    return got["g"], got["norms"], res


@pytest.mark.parametrize("estimator,reward,old,terms,packing", [
    ("grpo", "bounded", "trainer", {}, False),
    ("rloo", "binary", "engine", {}, False),
    ("grpo", "binary", "trainer", dict(kl_mode="loss", kl_coef=0.1, kl_kind="k3"), False),
    ("grpo", "bounded", "trainer", {}, True),
], ids=["grpo-bounded", "rloo-engine-clip", "grpo-kl", "grpo-packed"])
def test_float64_stream_equals_sync(q35_ddp, estimator, reward, old, terms, packing):
    from megatron_tsync.algorithms.policy_loss import PolicyLossConfig
    from megatron_tsync.training.stream_fb import LossConfig

    from ..training.stream_cases import arrival_order, make_samples, spec_for

    samples = make_samples(31, reward_kind=reward, vocab=256, with_ref=bool(terms))
    kw = dict(estimator=estimator, reward_spec=spec_for(reward), sequence_packing=packing,
              loss=LossConfig(policy=PolicyLossConfig(), old_logprobs=old, **terms))
    g_sync, norms, _ = _step(q35_ddp, "sync", samples, samples, **kw)
    assert all(v > 0 for v in norms.values()), norms
    worst = 0.0
    for mode, seed in (("stream-trajectory", 1), ("stream-trajectory", 2), ("stream-group", 3)):
        g, _, res = _step(q35_ddp, mode, samples, arrival_order(samples, seed), **kw)
        rel = ((g - g_sync).norm() / g_sync.norm()).item()
        worst = max(worst, rel)
        assert rel < TOL, (mode, seed, rel)
    print(f"qwen3_5 float64 {estimator} {reward} old={old} {terms or ''} packing={packing}: worst rel {worst:.2g}")


def test_packed_sync_equals_unpacked_sync(q35_ddp):
    """Sequence packing changes nothing but the microbatches: the sync gradient with packing equals without."""
    from ..training.stream_cases import make_samples, spec_for

    samples = make_samples(32, reward_kind="bounded", vocab=256)
    kw = dict(estimator="grpo", reward_spec=spec_for("bounded"))
    plain, _, _ = _step(q35_ddp, "sync", samples, samples, **kw)
    packed, _, res = _step(q35_ddp, "sync", samples, samples, sequence_packing=True, **kw)
    assert ((packed - plain).norm() / plain.norm()).item() < TOL


def test_minibatches_and_epochs(tiny_q35, megatron_single):
    """Two minibatches × two epochs, PPO clip, SGD lr 0.05: weights after the step equal sync's ≤ 1e-12 relative
    to how far they moved."""
    from megatron_tsync.streaming.ready_queue import ListSource
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from megatron_tsync.training.stream_fb import LossConfig

    from ..training.stream_cases import arrival_order, make_samples, spec_for

    samples = make_samples(21, num_groups=4, reward_kind="binary", vocab=256)
    weights = {}
    for mode, order in (("sync", samples), ("stream-trajectory", arrival_order(samples, 3)),
                        ("stream-group", arrival_order(samples, 4))):
        ddp = wrap_ddp(_load64(tiny_q35))
        opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.05, clip_grad=0))
        theta0 = torch.cat([p.detach().reshape(-1).clone() for p in ddp.parameters()])
        learner = Learner(ddp, opt, LearnerConfig(mode=mode, reward_spec=spec_for("binary"), num_minibatches=2,
                                                   epochs=2, loss=LossConfig()))
        sizes, shape = shape_for(samples)
        learner.train_step(ListSource(order), sizes, shape)
        weights[mode] = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    moved = (weights["sync"] - theta0).norm()
    assert moved > 1e-6
    for mode in ("stream-trajectory", "stream-group"):
        rel = ((weights[mode] - weights["sync"]).norm() / moved).item()
        print(f"qwen3_5 minibatches×epochs {mode}: {rel:.2g}")
        assert rel < TOL, (mode, rel)


# ---------------------------------------------------------------------------------------------- OPD
def test_incremental_forward_equals_full_forward(tiny_q35, megatron_single):
    from megatron_tsync.model.incremental import IncrementalGPT

    model = _load64(tiny_q35)
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(0))
    full = model(ids.unsqueeze(0), torch.arange(23).unsqueeze(0), None)  # (1, T, V)
    inc = IncrementalGPT(model)
    parts = [inc.head(inc.extend(ids[a:b], a)) for a, b in ((0, 5), (5, 6), (6, 17), (17, 23))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-12)
    state = inc.kv[0]  # a linear-attention layer: (conv tail (1, C, K-1), recurrent state (1, Hv, Dk, Dv))
    assert state[0].shape[-1] == model.arch.linear_conv_kernel_dim - 1 and state[1].dim() == 4


def test_opd_stream_turn_exact(tiny_q35, megatron_single, monkeypatch):
    """opd_worker's cases (token-mean; seq-mean with engine π_old and TIS) on this model: stream-trajectory and
    stream-turn (incremental forward, graph kept through the linear layers' states) equal sync ≤ 1e-12; the control
    that cuts the gradient at turn boundaries (states detached) is off by > 1e-3."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "training", "_workers"))
    import opd_worker as W

    arch, _ = hc.load_hf_dir(tiny_q35)
    monkeypatch.setattr(W, "TINY", arch)
    monkeypatch.setattr(W, "CASES", {k: W.CASES[k] for k in ("token-mean", "seq-mean-engine-tis")})
    report = W.run_cases(megatron_single, modes=("stream-trajectory", "stream-turn", "cut"))
    for case, row in report.items():
        print(f"qwen3_5 OPD {case}: " + ", ".join(f"{m} {r['rel']:.2g}" for m, r in row.items()))
        assert row["stream-trajectory"]["rel"] <= TOL and row["stream-turn"]["rel"] <= TOL, (case, row)
        assert row["cut"]["rel"] > 1e-3, (case, row)
