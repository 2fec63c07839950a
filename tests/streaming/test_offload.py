"""Bucket residency through the learner (``streaming/offload.py``): exact gradients, bounded memory per tier.

float64, one process, six groups open at once (interleaved arrivals), so without residency 2k (GRPO) or k (Dr.GRPO)
bucket vectors sit on the device. Each residency setting — the tightest device cache (2 slots, every shift moves
vectors), a cache of 4 with room to prefetch the next microbatch's group, the cache sized by ``bucket_device_gib``,
a fixed host arena (``bucket_host_gib``) — gives a streamed gradient ``torch.equal`` to the no-residency run and
≤ 1e-12 from sync, with vectors really moved to the host and back. float32: the memory bound of the issue, peak host
bytes ≤ 4(2k+1)P per rank (k = 6 open groups; on a CPU machine the device cache is host memory too, so everything
counts) and device bytes ≤ the cap, allocated once over two steps.
"""

import pytest
import torch

from megatron_tsync.streaming.ready_queue import ListSource
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
from megatron_tsync.model.builder import PrecisionConfig, build_model
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

from ..training.stream_cases import TINY, make_samples, spec_for


@pytest.fixture(scope="module")
def model64(megatron_single):
    ddp = wrap_ddp(build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0))
    return ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))


def _grad(model, samples, order, mode="stream-trajectory", steps=1, **kw):
    ddp, opt = model
    learner = Learner(ddp, opt, LearnerConfig(mode=mode, reward_spec=spec_for("continuous"), **kw))
    got = []
    learner.grad_hook = lambda d: got.append(torch.cat([b.grad_data.clone() for b in d.buffers]))
    sizes, shape = shape_for(samples)
    res = [learner.train_step(ListSource(order), sizes, shape) for _ in range(steps)]
    return got[0], (res[0] if steps == 1 else res), learner


def _interleaved(num_groups=6):
    samples = make_samples(7, num_groups=num_groups, reward_kind="continuous")
    by_group = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s)
    return samples, [grp[i] for i in range(5) for grp in by_group.values() if i < len(grp)], len(by_group)


VECTOR_MIB = 0.815  # one float64 vector of TINY (checked below)
SETTINGS = {
    "cap2": dict(max_device_buckets=2),
    "cap4-prefetch": dict(max_device_buckets=4),
    "device-gib": dict(bucket_device_gib=3.5 * VECTOR_MIB / 1024),
    "host-gib": dict(max_device_buckets=3, bucket_host_gib=0.05),
}


@pytest.fixture(scope="module")
def references(model64):
    samples, order, k = _interleaved()
    out = {}
    for est in ("grpo", "dr_grpo"):
        g_sync, _, _ = _grad(model64, samples, samples, mode="sync", estimator=est)
        g_stream, r, _ = _grad(model64, samples, order, estimator=est)
        out[est] = (g_sync, g_stream, r)
    return samples, order, k, out


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("estimator,per_group", [("grpo", 2), ("dr_grpo", 1)])
def test_residency_is_exact_and_bounded(model64, references, estimator, per_group, setting):
    samples, order, k, refs = references
    g_sync, g_ref, r_ref = refs[estimator]
    assert r_ref.offload is None
    assert r_ref.peak_bucket_vectors >= per_group * (k - 1) > 2  # (the zero-variance group has no P)
    g, r, learner = _grad(model64, samples, order, estimator=estimator, **SETTINGS[setting])
    assert torch.equal(g, g_ref)
    assert float((g - g_sync).norm() / g_sync.norm()) <= 1e-12
    off = r.offload
    res = learner.buckets.residency
    assert abs(res.device_arena.layout.vector_bytes / 2**20 - VECTOR_MIB) < 0.01
    print(estimator, setting, "peak vectors", r_ref.peak_bucket_vectors, off)
    cap = {"cap2": 2, "cap4-prefetch": 4, "device-gib": 3, "host-gib": 3}[setting]
    assert off["device_slots"] == cap and off["peak_device"] <= cap
    assert off["to_host"] > 0 and off["to_device"] > 0
    assert off["peak_device"] + off["peak_host"] >= r.peak_bucket_vectors
    assert off["device_in_use"] == off["host_in_use"] == 0  # everything folded and released at the barrier
    assert off["bytes_moved"] == (off["to_host"] + off["to_device"]) * res.device_arena.layout.vector_bytes
    assert off["wait_s"] > 0  # CPU: the copies are synchronous, the learner waited for each
    assert r.peak_bucket_vectors == learner.pool.stats.peak_in_use and learner.pool.stats.allocated == 0
    if setting == "cap4-prefetch":
        assert off["prefetched"] > 0 and off["prefetch_hits"] > 0  # room for the next group's vectors: prefetched
    if setting == "host-gib":
        assert off["host_slots"] == int(0.05 * 2**30 // res.host_arena.layout.slot_bytes)


def test_peak_host_bytes_within_the_bound_and_device_bytes_within_the_cap(megatron_single):
    """float32, GRPO, k = 6 groups open at once, a device cache of 2 vectors (``bucket_device_gib``): the arenas,
    allocated once (the same slabs in the second step), hold every bucket vector (the pool allocates none); the
    accumulator plus both arenas ≤ 4(2k+1)P bytes (P: elements of this rank's grad buffer), the device cache ≤ its
    cap, and the resident device bytes ≤ the cap at every moment (peak)."""
    ddp = wrap_ddp(build_model(TINY, PrecisionConfig(), seed=0))
    model = (ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0)))
    samples, order, k = _interleaved()
    P = sum(b.grad_data.numel() for b in ddp.buffers)
    cap = 2.5 * 4 * P / 2**30  # GiB: room for 2 fp32 vectors
    _, rs, learner = _grad(model, samples, order, steps=2, bucket_device_gib=cap)
    res = learner.buckets.residency
    slabs = [s.data_ptr() for s in res.host_arena.slabs + res.device_arena.slabs]
    for r in rs:
        off = r.offload
        total = 4 * P + off["device_arena_bytes"] + off["host_arena_bytes"]
        print("P", P, "k", k, "host bytes", total, "bound", 4 * (2 * k + 1) * P, off)
        assert total <= 4 * (2 * k + 1) * P
        assert off["device_arena_bytes"] <= cap * 2**30 and off["peak_device_bytes"] <= cap * 2**30
        assert off["to_host"] > 0 and off["host_slabs"] == 1
    assert [s.data_ptr() for s in res.host_arena.slabs + res.device_arena.slabs] == slabs
    assert learner.pool.stats.allocated == 0


def test_run_log_and_tensorboard_report_residency(model64, references):
    """The log row's ``offload_*`` keys (``runtime.grpo``) include bytes per tier, bytes moved and the copy wait;
    TensorBoard names them under ``stream/``; the progress line shows them (and nothing without residency)."""
    import dataclasses

    from megatron_tsync.runtime import grpo
    from megatron_tsync.streaming.offload import TB_NAMES, OffloadStats

    samples, order, _, _ = references
    _, r, _ = _grad(model64, samples, order, max_device_buckets=2)
    row = {f"offload_{k}": v for k, v in r.offload.items()}
    assert set(TB_NAMES) <= {f.name for f in dataclasses.fields(OffloadStats)}
    assert {f"offload_{k}" for k in TB_NAMES} <= set(grpo.TB_NAMES) and all(
        grpo.TB_NAMES[f"offload_{k}"].startswith("stream/") for k in TB_NAMES)
    assert {"offload_device_bytes", "offload_host_bytes", "offload_bytes_moved", "offload_wait_s"} <= set(row)
    text = grpo._residency_text(row)
    assert text.startswith(" buckets dev ") and " moved " in text and " wait " in text
    assert grpo._residency_text({}) == ""
