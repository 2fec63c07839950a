"""Host accumulation through the learner (``streaming/host_accum.py``, ``--accumulate-on-host``).

float64, one process, six groups open at once (interleaved arrivals). The accumulator and every bucket vector live in
the host arena; megatron's grad buffer is each microbatch's scratch, flushed to the host and zeroed. sync,
stream-group and stream-trajectory with host accumulation equal sync without it ≤ 1e-12 (GRPO: P and Q per group;
Dr.GRPO: Q only), inline (the CPU default) and with the worker thread of the GPU path (the same FIFO order, real
concurrency with the next microbatch's forward). The device holds no gradient vector besides the grad buffer (no pool
allocation, no device slot, every bucket vector inside the host arena), and the host holds ≤ 4(2k+1)P bytes of vectors
(k = open groups, fp32) plus two staging chunks. The stats report D2H/H2D bytes, flushes, host add and copy seconds.
Controls: the scratch really carried gradients (flushes > 0, D2H bytes = flushes × vector bytes), and sync mode
flushes once per step (one destination: the scratch keeps accumulating).
"""

import pytest
import torch

from megatron_tsync.model.builder import PrecisionConfig, build_model
from megatron_tsync.streaming.ready_queue import ListSource
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

from ..training.stream_cases import TINY, make_samples, spec_for


@pytest.fixture(scope="module")
def model64(megatron_single):
    ddp = wrap_ddp(build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0))
    return ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))


def _grad(model, samples, order, mode="stream-trajectory", steps=1, threaded=None, **kw):
    ddp, opt = model
    learner = Learner(ddp, opt, LearnerConfig(mode=mode, reward_spec=spec_for("continuous"), **kw))
    if threaded is not None:  # the GPU path's worker thread, on CPU
        host = learner.buckets.host
        host.threaded = threaded
        if threaded:
            import threading

            host._thread = threading.Thread(target=host._work, daemon=True)
            host._thread.start()
    got = []
    learner.grad_hook = lambda d: got.append(torch.cat([b.grad_data.clone() for b in d.buffers]))
    sizes, shape = shape_for(samples)
    res = [learner.train_step(ListSource(order), sizes, shape) for _ in range(steps)]
    if learner.buckets.host is not None:
        learner.buckets.host.close()
    return got, (res[0] if steps == 1 else res), learner


def _interleaved(num_groups=6):
    samples = make_samples(7, num_groups=num_groups, reward_kind="continuous")
    by_group = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s)
    return samples, [grp[i] for i in range(5) for grp in by_group.values() if i < len(grp)], len(by_group)


@pytest.fixture(scope="module")
def sync_refs(model64):
    samples, order, k = _interleaved()
    return samples, order, k, {est: _grad(model64, samples, samples, mode="sync", estimator=est)[0][0]
                               for est in ("grpo", "dr_grpo")}


CASES = [("grpo", "stream-trajectory", None), ("dr_grpo", "stream-trajectory", None), ("grpo", "stream-group", None),
         ("grpo", "sync", None), ("grpo", "stream-trajectory", True)]


@pytest.mark.parametrize("estimator,mode,threaded", CASES)
def test_host_accumulation_is_exact_and_keeps_no_device_vector(model64, sync_refs, estimator, mode, threaded,
                                                               monkeypatch):
    samples, order, k, refs = sync_refs
    if threaded:  # staging chunks of 64 KiB: a flush is a pipeline of 7 chunks through the two staging buffers
        monkeypatch.setattr("megatron_tsync.streaming.host_accum.CHUNK_BYTES", 64 << 10)
    g_sync = refs[estimator]
    got, r, learner = _grad(model64, samples, order if mode != "sync" else samples, mode=mode, estimator=estimator,
                            accumulate_on_host=True, threaded=threaded)
    g = got[0]
    assert float((g - g_sync).norm() / g_sync.norm()) <= 1e-12
    off, host = r.offload, learner.buckets.host
    print(estimator, mode, threaded, "peak bucket vectors", r.peak_bucket_vectors, off)
    assert learner.buckets.residency is None and learner.pool.stats.allocated == 0  # no device vector was made
    assert host.owns(host.accumulator)
    vb = host.arena.layout.vector_bytes
    if threaded:
        assert off["staging_bytes"] == 2 * (64 << 10) and vb > 6 * (64 << 10)
    assert off["flushes"] >= 1 and off["d2h_bytes"] == off["flushes"] * vb and off["h2d_bytes"] == vb
    assert off["host_in_use"] == 1  # only the accumulator is left at the barrier
    assert off["device_bytes"] == off["peak_device_bytes"] == 0 and off["bytes_moved"] == off["d2h_bytes"] + vb
    if mode == "sync":
        assert off["flushes"] == 1 and r.peak_bucket_vectors == 0  # one destination all step: one flush
    if mode == "stream-trajectory":
        assert r.peak_bucket_vectors >= (2 if estimator == "grpo" else 1) * (k - 1)
        assert off["peak_host"] == 1 + r.peak_bucket_vectors  # accumulator + bucket vectors, all in the arena
        assert off["flushes"] > len(samples) // 2 and off["host_add_s"] > 0 and off["d2h_s"] > 0
    for p in learner.router.accumulator.parts:  # the scratch is megatron's own buffer, zeroed by the barrier
        assert not p.any()


def test_bucket_vectors_live_in_the_host_arena(model64, sync_refs):
    """While a step runs, every open bucket vector lies inside the host arena and ``param.main_grad`` views the grad
    buffer (the scratch), never a bucket."""
    samples, order, _, _ = sync_refs
    ddp, opt = model64
    learner = Learner(ddp, opt, LearnerConfig(reward_spec=spec_for("continuous"), accumulate_on_host=True))
    seen = []
    orig = learner.buckets.enter

    def enter(gid, reward, alpha):
        orig(gid, reward, alpha)
        host = learner.buckets.host
        seen.append(all(host.owns(v) for b in learner.buckets.buckets.values() for v in (b.q, b.p) if v is not None))
        seen.append(learner.router.current is learner.router.accumulator)

    learner.buckets.enter = enter
    sizes, shape = shape_for(samples)
    learner.train_step(ListSource(order), sizes, shape)
    assert len(seen) > 10 and all(seen)


def test_peak_host_bytes_within_the_bound(megatron_single):
    """float32, GRPO, k = 6 open groups, two steps: the arena is allocated once (the same slabs in step 2) and holds
    ≤ 4(2k+1)P bytes (P: elements of this rank's grad buffer); staging is two chunks on top (here the whole vector
    is smaller than a chunk: 2 vectors)."""
    ddp = wrap_ddp(build_model(TINY, PrecisionConfig(), seed=0))
    model = (ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0)))
    samples, order, k = _interleaved()
    P = sum(b.grad_data.numel() for b in ddp.buffers)
    _, rs, learner = _grad(model, samples, order, steps=2, accumulate_on_host=True)
    host = learner.buckets.host
    assert rs[0].offload["host_slabs"] == rs[1].offload["host_slabs"] == len(host.arena.slabs) <= 2
    for r in rs:
        off = r.offload
        print("P", P, "k", k, off)
        assert off["peak_host_bytes"] <= off["host_arena_bytes"] <= 4 * (2 * k + 1) * P
        assert off["staging_bytes"] <= 2 * 4 * P + 128


def test_refusals_and_fixed_arena(model64):
    ddp, opt = model64
    for kw, msg in ((dict(max_device_buckets=2), "device cache"), (dict(deterministic=True), "--deterministic")):
        with pytest.raises(ValueError, match="--accumulate-on-host: .*" + msg):
            Learner(ddp, opt, LearnerConfig(accumulate_on_host=True, **kw))
    samples, order, _ = _interleaved()
    from megatron_tsync.streaming.arena import ArenaFull

    with pytest.raises(ArenaFull, match="--bucket-host-gib holds 3 vectors"):
        _grad(model64, samples, order, accumulate_on_host=True, bucket_host_gib=3.5 * 0.815 / 1024)


def test_run_log_and_tensorboard_report_host_accumulation(model64, sync_refs):
    """The log row's ``offload_*`` keys carry the residency keys the progress line reads (device bytes 0) and host
    accumulation's own (D2H bytes, host add seconds), named under ``stream/`` in TensorBoard."""
    from megatron_tsync.runtime import grpo
    from megatron_tsync.streaming.host_accum import HOST_TB_NAMES, HostAccumStats
    import dataclasses

    samples, order, _, _ = sync_refs
    _, r, _ = _grad(model64, samples, order, accumulate_on_host=True)
    row = {f"offload_{k}": v for k, v in r.offload.items()}
    assert set(HOST_TB_NAMES) <= {f.name for f in dataclasses.fields(HostAccumStats)}
    assert all(grpo.TB_NAMES[f"offload_{k}"].startswith("stream/") for k in HOST_TB_NAMES)
    text = grpo._residency_text(row)
    assert text.startswith(" buckets dev 0/host ") and " add " in text


def test_minibatches_and_epochs(megatron_single):
    """M = 2 minibatches × E = 2 epochs (four barriers, each materialising the host accumulator into the grad buffer,
    then zeroing it), SGD lr 0.05, float64: the weights after the step equal device accumulation's ≤ 1e-12 (relative
    to how far they moved)."""
    from megatron_tsync.algorithms.policy_loss import PolicyLossConfig
    from megatron_tsync.training.stream_fb import LossConfig

    samples, order, _ = _interleaved(4)
    out = {}
    for host in (False, True):
        ddp = wrap_ddp(build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0))
        opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.05, clip_grad=0))
        theta0 = torch.cat([p.detach().reshape(-1).clone() for p in ddp.parameters()])
        L = Learner(ddp, opt, LearnerConfig(reward_spec=spec_for("continuous"), num_minibatches=2, epochs=2,
                                            loss=LossConfig(policy=PolicyLossConfig()), accumulate_on_host=host))
        sizes, shape = shape_for(samples)
        r = L.train_step(ListSource(order), sizes, shape)
        out[host] = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
        if host:
            assert r.offload["h2d_bytes"] == 4 * L.buckets.host.arena.layout.vector_bytes  # one per barrier
            L.buckets.host.close()
    moved = (out[False] - theta0).norm()
    assert moved > 0 and float((out[True] - out[False]).norm() / moved) <= 1e-12
