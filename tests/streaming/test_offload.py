"""Host offload of idle gradient buckets (``streaming/offload.py``): bit-identical gradients, bounded residency.

float64, one process. Every group open at once (interleaved arrivals), so without offload 2k (GRPO) or k
(Dr.GRPO) bucket vectors sit on the device; with ``max_device_buckets=2`` at most two do, the rest move to host
memory and back (real copies even on CPU), and the streamed gradient is ``torch.equal`` to the no-offload one.
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


def _grad(model64, samples, order, **kw):
    ddp, opt = model64
    learner = Learner(ddp, opt, LearnerConfig(mode="stream-trajectory", reward_spec=spec_for("continuous"), **kw))
    got = {}
    learner.grad_hook = lambda d: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
    sizes, shape = shape_for(samples)
    res = learner.train_step(ListSource(order), sizes, shape)
    return got["g"], res


@pytest.mark.parametrize("estimator,per_group", [("grpo", 2), ("dr_grpo", 1)])
def test_offload_is_exact_and_bounded(model64, estimator, per_group):
    samples = make_samples(7, num_groups=4, reward_kind="continuous")
    by_group = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s)
    order = [grp[i] for i in range(5) for grp in by_group.values() if i < len(grp)]  # all groups interleaved
    g_ref, r_ref = _grad(model64, samples, order, estimator=estimator)
    assert r_ref.offload is None
    assert r_ref.peak_bucket_vectors >= per_group * (len(by_group) - 1) > 2  # (the zero-variance group has no P)
    g, r = _grad(model64, samples, order, estimator=estimator, max_device_buckets=2)
    assert torch.equal(g, g_ref)
    off = r.offload
    print(estimator, "peak vectors", r_ref.peak_bucket_vectors, off)
    assert off["peak_device"] <= 2
    assert off["to_host"] > 0 and off["to_device"] > 0
    assert off["peak_device"] + off["peak_host"] >= r.peak_bucket_vectors
    assert off["device_in_use"] == off["host_in_use"] == 0  # everything folded and released at the barrier


def test_offload_needs_two_device_vectors():
    from megatron_tsync.streaming.offload import Residency

    with pytest.raises(ValueError, match=">= 2"):
        Residency(router=None, max_device=1)
