"""streaming.ready_queue.CoalescingSource (--stream-coalesce-ms): arrivals close together reach the learner as one
poll, the step's last arrival never waits, and the streamed update is unchanged (float64) with fewer microbatches."""

import time

import pytest
import torch

from megatron_tsync.streaming.ready_queue import CoalescingSource, ListSource
from tests.training.stream_cases import make_samples


def _timed(n=12, gap=0.01):
    S = make_samples(2, num_groups=3)[:n]
    return S, [0.02 + gap * i for i in range(len(S))]


def _polls(src):
    sizes, t_last = [], None
    while not src.exhausted():
        got = src.poll(0.05)
        if got:
            sizes.append(len(got))
            t_last = time.perf_counter()
    return sizes, t_last


def test_window_coalesces_and_last_arrival_does_not_wait():
    S, rel = _timed()
    plain, _ = _polls(ListSource(S, rel))
    assert max(plain) <= 2  # control: 10 ms apart, one (rarely two) per poll
    src = ListSource(S, rel)
    sizes, t_last = _polls(CoalescingSource(src, 0.045))
    assert sum(sizes) == len(S) and len(sizes) <= len(S) // 3, sizes
    assert t_last - src.t0 - rel[-1] < 0.03  # the last one returns as soon as it lands, not a window later
    with pytest.raises(ValueError):
        CoalescingSource(src, -1.0)


def test_learner_update_unchanged_with_fewer_microbatches(megatron_single):
    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from tests.training.stream_cases import TINY, spec_for

    ddp = wrap_ddp(build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0))
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))
    out = {}
    for window in (0.0, 0.06):
        S = make_samples(4, num_groups=4)
        rel = [0.01 * i for i in range(len(S))]
        L = Learner(ddp, opt, LearnerConfig(mode="stream-trajectory", reward_spec=spec_for("binary"),
                                            sequence_packing=True, poll_timeout_s=0.005))
        got = {}
        L.grad_hook = lambda d, got=got: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
        sizes, shape = shape_for(S)
        res = L.train_step(CoalescingSource(ListSource(S, rel), window), sizes, shape)
        out[window] = (got["g"], res.microbatches)
    (g0, mb0), (g1, mb1) = out[0.0], out[0.06]
    assert ((g1 - g0).norm() / g0.norm()).item() < 1e-12
    assert mb1 < mb0, (mb0, mb1)
