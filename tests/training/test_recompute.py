"""Activation recomputation (``--recompute-granularity full|selective``, ``--recompute-method``,
``--recompute-num-layers``) is exact and saves memory: float64, one process.

The learner's gradient with recomputation equals the one without (same step) and streamed equals sync with it on,
for GRPO (stream-trajectory, packing) and OPD (stream-trajectory, and stream-turn, whose KV-kept turn forward
checkpoints the same layers with torch's checkpoint). PP 2 / TP 2: ``test_streaming_parallel.py`` (slow). The built ``TransformerConfig`` carries the flags, and the tensors
autograd keeps for a long trajectory shrink (the control: without recomputation they do not).
"""

import pytest
import torch

from megatron_tsync.config import ConfigError, ModelConfig
from megatron_tsync.model.builder import PrecisionConfig, build_model
from megatron_tsync.streaming.ready_queue import ListSource
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
from megatron_tsync.training.opd_learner import SavedBytes
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

from .stream_cases import TINY, arrival_order, make_samples, spec_for

TOL = 1e-12
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
RECOMPUTE = {
    "off": {},
    "full-uniform-1": FULL,
    "full-block-1": dict(FULL, recompute_method="block"),
    "selective": dict(recompute_granularity="selective"),
}


def _model64(**recompute):
    ddp = wrap_ddp(build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0, **recompute))
    return ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))


@pytest.fixture(scope="module")
def models(megatron_single):
    return {name: _model64(**kw) for name, kw in RECOMPUTE.items()}


def gradient(model64, mode, samples, order, **kw):
    ddp, opt = model64
    learner = Learner(ddp, opt, LearnerConfig(mode=mode, **kw))
    got = {}
    learner.grad_hook = lambda d: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
    sizes, shape = shape_for(samples)
    learner.train_step(ListSource(order), sizes, shape)
    return got["g"]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("name", ["full-uniform-1", "full-block-1", "selective"])
def test_grpo_streamed_equals_sync_with_recompute(models, name, packing):
    samples = make_samples(31, reward_kind="binary")
    kw = dict(estimator="grpo", reward_spec=spec_for("binary"))
    if packing:
        kw.update(sequence_packing=True, max_packed_tokens=64)
    ref = gradient(models["off"], "sync", samples, samples, estimator="grpo", reward_spec=spec_for("binary"))
    on_sync = gradient(models[name], "sync", samples, samples, **kw)
    on_stream = gradient(models[name], "stream-trajectory", samples, arrival_order(samples, 5), **kw)
    assert rel(on_sync, ref) <= TOL  # recompute on == off, same step
    assert rel(on_stream, ref) <= TOL  # streamed with recompute == sync without
    assert ref.norm() > 0


@pytest.mark.parametrize("name", ["full-uniform-1", "full-block-1", "selective"])
def test_opd_with_recompute_equals_sync(megatron_single, name):
    """OPD: stream-trajectory (megatron's forward) and stream-turn (the KV-kept incremental forward, which
    checkpoints the same layers: ``model.incremental.recompute_plan``) with recomputation == sync without, and
    stream-turn keeps fewer bytes for the backward than without."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_workers"))
    import opd_worker as W

    samples, ends = W.make_trajectories(301)
    case = W.CASES["token-mean"]
    ref, _ = W.grads("sync", case, samples, ends, None)
    _, plain = W.grads("stream-turn", case, samples, ends, None)
    for mode, head_first in (("stream-trajectory", False), ("stream-turn", False), ("stream-turn", True)):
        g, res = W.grads(mode, case, samples, ends, None, head_first=head_first, recompute=RECOMPUTE[name])
        assert res.mode == mode
        assert W.rel(g, ref) <= TOL, (mode, head_first)
        if mode == "stream-turn":
            assert res.peak_graph_bytes < plain.peak_graph_bytes, (res.peak_graph_bytes, plain.peak_graph_bytes)


def test_config_refusals_and_transformer_config(megatron_single):
    """megatron-core's rules are refused at config time, one line each; the built config carries the flags."""
    for bad, word in [(dict(recompute_granularity="full"), "needs model.recompute_method"),
                      (dict(recompute_granularity="full", recompute_method="uniform"), "needs model.recompute_method"),
                      (dict(recompute_granularity="selective", recompute_num_layers=1), "full only"),
                      (dict(recompute_method="block"), "need model.recompute_granularity"),
                      (dict(FULL, recompute_num_layers=0), ">= 1"),
                      (dict(recompute_granularity="offload"), "must be one of"),
                      (dict(FULL, moe_router_replay=True), "moe_router_replay with model.recompute_granularity")]:
        with pytest.raises(ConfigError, match=word):
            ModelConfig(**bad)
    assert ModelConfig().recompute_overrides() == {}
    assert ModelConfig(**FULL).recompute_overrides() == FULL
    with pytest.raises(ValueError, match="between 1 and the layers of one pipeline stage"):
        build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0, **dict(FULL, recompute_num_layers=3))
    for name, kw in RECOMPUTE.items():
        cfg = build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0, **kw).config
        assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == (
            kw.get("recompute_granularity"), kw.get("recompute_method"), kw.get("recompute_num_layers")), name


def test_flags_parse_into_the_model_section():
    from megatron_tsync.arguments import parse_args

    argv = ["--rl-algorithm", "opd", "--rl-mode", "stream-turn", "--teacher-model", "/t", "--model", "/m"]
    assert parse_args(argv).model.recompute_overrides() == {}
    cfg = parse_args(argv + ["--recompute-granularity", "full", "--recompute-method", "block",
                             "--recompute-num-layers", "2"])
    assert cfg.model.recompute_overrides() == dict(FULL, recompute_method="block", recompute_num_layers=2)


def test_moe_gradient_unchanged_by_recompute(megatron_single):
    """A tiny Qwen3-MoE (4 experts, top-2; no router replay, which is refused with recomputation): the gradient of a
    forward/backward with full or selective recomputation is the one without."""
    from megatron_tsync.model.builder import ModelArch

    arch = ModelArch(family="qwen3_moe", vocab_size=256, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                     num_attention_heads=2, num_kv_heads=1, head_dim=16, qk_layernorm=True, num_experts=4,
                     moe_router_topk=2, moe_ffn_hidden_size=32)

    def grads(**kw):
        m = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0, **kw)
        ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
        m(ids, torch.arange(40).unsqueeze(0), None).pow(2).sum().backward()  # (1, 40, V)
        return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])

    off = grads()
    for name in ("full-uniform-1", "selective"):
        assert rel(grads(**RECOMPUTE[name]), off) <= TOL, name
    with pytest.raises(ValueError, match="router replay with activation recomputation is refused"):
        grads(moe_enable_routing_replay=True, **RECOMPUTE["selective"])


def _saved_bytes(model64, T=512):
    ddp, _ = model64
    ids = torch.randint(0, TINY.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    saved = SavedBytes(ddp.parameters())
    with saved():
        out = ddp(ids, torch.arange(T).unsqueeze(0), None)  # (1, T, V)
    out.sum().backward()
    ddp.zero_grad_buffer()
    return saved.bytes


def test_recompute_saves_activations(models):
    """Each setting keeps fewer bytes for the backward on a 512-token sequence than no recomputation."""
    got = {name: _saved_bytes(m) for name, m in models.items()}
    assert got["full-uniform-1"] < 0.5 * got["off"], got  # layer inputs only (+ the head)
    assert got["full-block-1"] < got["off"], got  # one of two layers
    assert got["selective"] < got["off"], got  # the attention's saved tensors
    assert got["full-uniform-1"] < got["full-block-1"], got


@pytest.mark.slow
def test_long_trajectory_streamed_equals_sync_with_recompute(tmp_path):
    """One 200-turn, 16,400-token trajectory (and a short member of its group) in float64 on a model smaller than
    TINY (``_workers/long_trajectory_worker.py``): streamed with full recomputation == sync ≤ 1e-12, == streamed
    without; the peak RSS and the bytes autograd keeps are lower with it. One single-process run: the streamed step
    with recomputation first, then without (the RSS high-water mark must rise during the second), then sync."""
    import json
    import os

    from ._launch import torchrun

    worker = os.path.join(os.path.dirname(__file__), "_workers", "long_trajectory_worker.py")
    out = str(tmp_path / "long")
    torchrun(worker, [out, "16400"], nproc=1)
    rep = json.load(open(out + ".json"))
    grads = torch.load(out + ".pt")
    print("long trajectory:", rep)
    on, off = grads["on"], grads["off"]
    assert rep["on"]["tokens"] >= 16000 and rep["on"]["turns"] == 200, rep
    assert rel(on["streamed"], on["sync"]) <= TOL
    assert rel(on["streamed"], off["streamed"]) <= TOL
    assert rep["on"]["saved_mib"] < 0.5 * rep["off"]["saved_mib"], rep
    assert rep["on"]["peak_rss_mib"] < rep["off"]["peak_rss_mib"], rep


def test_run_context_recomputes_the_policy_only(megatron_single, tiny_dir):
    """The flags reach the trained model through ``RunContext``; the frozen KL reference is built without them."""
    import types

    from megatron_tsync.arguments import parse_args
    from megatron_tsync.model.builder import unwrap
    from megatron_tsync.runtime.context import RunContext

    cfg = parse_args(["--model", tiny_dir, "--kl-mode", "loss", "--kl-coef", "0.1", *sum(
        ([f"--{k.replace('_', '-')}", str(v)] for k, v in FULL.items()), [])])
    ctx = RunContext(cfg, types.SimpleNamespace(stop=False))
    pc, rc = unwrap(ctx.ddp).config, unwrap(ctx.reference.model).config
    assert (pc.recompute_granularity, pc.recompute_method, pc.recompute_num_layers) == ("full", "uniform", 1)
    assert rc.recompute_granularity is None
