"""streaming.ready_queue.CoalescingSource (--stream-coalesce-ms, --stream-coalesce-tokens): arrivals close together
(or until a token target) reach the learner as one poll, the step's last arrival never waits, and the streamed update
is unchanged (float64) with fewer microbatches."""

import dataclasses

import pytest
import torch

from megatron_tsync.streaming.ready_queue import Clock, CoalescingSource, ListSource
from tests.training.stream_cases import make_samples


class VirtualClock(Clock):
    """Time moves only when a source sleeps: arrivals and windows are exact, whatever the machine's load."""

    def __init__(self):
        self.t = 0.0
        super().__init__(now=lambda: self.t, sleep=self._sleep)

    def _sleep(self, s):
        self.t += max(s, 0.0)


def _timed(n=12, gap=0.01):
    S = make_samples(2, num_groups=3)[:n]
    return S, [0.02 + gap * i for i in range(len(S))]


def _source(S, rel):
    return ListSource(S, rel, clock=VirtualClock())


def _polls(src):
    sizes, t_last = [], None
    while not src.exhausted():
        got = src.poll(0.05)
        if got:
            sizes.append(len(got))
            t_last = src.clock.now()
    return sizes, t_last


def test_window_coalesces_and_last_arrival_does_not_wait():
    S, rel = _timed()
    plain, _ = _polls(_source(S, rel))
    assert max(plain) == 1  # control: 10 ms apart, one per poll
    src = _source(S, rel)
    sizes, t_last = _polls(CoalescingSource(src, 0.045))
    assert sum(sizes) == len(S) and len(sizes) <= len(S) // 3, sizes
    assert t_last - src.t0 - rel[-1] < 0.03  # the last one returns as soon as it lands, not a window later
    with pytest.raises(ValueError):
        CoalescingSource(src, -1.0)


def _tokens(samples):
    return sum(s.token_ids.shape[0] for s in samples)


def test_token_target_collects_until_reached_and_last_arrival_does_not_wait():
    S, rel = _timed(gap=0.004)
    src = _source(S, rel)
    c = CoalescingSource(src, 0.0, min_tokens=_tokens(S[:3]) + 1)
    polls = []
    while not c.exhausted():
        got = c.poll(0.05)
        if got:
            polls.append(got)
    t_last = src.clock.now()
    assert sum(map(len, polls)) == len(S)
    assert all(_tokens(p) >= _tokens(S[:3]) + 1 for p in polls[:-1]), [len(p) for p in polls]  # each full but the last
    assert len(polls) < len(S) // 2
    assert t_last - src.t0 - rel[-1] < 0.03  # the step's last reward is not held for a target it cannot reach
    # both bounds: the window ends a poll that the token target alone would keep open
    slow = _source(S, [0.02 + 0.05 * i for i in range(len(S))])
    sizes, _ = _polls(CoalescingSource(slow, 0.02, min_tokens=10 ** 6))
    assert max(sizes) <= 2 and sum(sizes) == len(S), sizes
    with pytest.raises(ValueError):
        CoalescingSource(src, 0.0, min_tokens=-1)


def test_learner_update_unchanged_with_fewer_microbatches(megatron_single):
    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from tests.training.stream_cases import TINY, spec_for

    ddp = wrap_ddp(build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0))
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))
    out = {}
    for window in (0.0, 0.15):
        S = make_samples(4, num_groups=4)
        rel = [0.03 * i for i in range(len(S))]  # 30 ms apart: the control's learner keeps up even on a loaded machine
        L = Learner(ddp, opt, LearnerConfig(mode="stream-trajectory", reward_spec=spec_for("binary"),
                                            sequence_packing=True, poll_timeout_s=0.005))
        got = {}
        L.grad_hook = lambda d, got=got: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
        sizes, shape = shape_for(S)
        res = L.train_step(CoalescingSource(ListSource(S, rel), window), sizes, shape)
        out[window] = (got["g"], res.microbatches)
    (g0, mb0), (g1, mb1) = out[0.0], out[0.15]
    assert ((g1 - g0).norm() / g0.norm()).item() < 1e-12
    assert mb1 < mb0, (mb0, mb1)


def test_token_target_fills_polls_and_update_unchanged(megatron_single):
    """--stream-coalesce-tokens through parse_args → the runtime's source wrapping (``runtime.grpo.coalesced``) → the
    megatron learner: the same float64 update as without it, in fewer microbatches."""
    from megatron_tsync.arguments import parse_args
    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.runtime.grpo import coalesced
    from megatron_tsync.training.learner import Learner, shape_for
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from tests.training.stream_cases import TINY, spec_for

    ddp = wrap_ddp(build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0))
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))
    out = {}
    for tokens in (0, 400):
        lc = parse_args(["--rl-mode", "stream-trajectory", "--sequence-packing",
                         "--stream-coalesce-tokens", str(tokens)]).learner
        lc = dataclasses.replace(lc, reward_spec=spec_for("binary"), poll_timeout_s=0.005)
        S = make_samples(4, num_groups=4)
        src = coalesced(ListSource(S, [0.03 * i for i in range(len(S))]), lc)
        assert isinstance(src, CoalescingSource) == bool(tokens)
        L = Learner(ddp, opt, lc)
        got = {}
        L.grad_hook = lambda d, got=got: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
        sizes, shape = shape_for(S)
        res = L.train_step(src, sizes, shape)
        out[tokens] = (got["g"], res.microbatches)
    (g0, mb0), (g1, mb1) = out[0], out[400]
    assert ((g1 - g0).norm() / g0.norm()).item() < 1e-12
    assert mb1 < mb0, (mb0, mb1)


def test_coalescing_flags_are_refused_with_opd(capsys):
    """OPD streams turns as they land and never wraps its source: the flags would do nothing there."""
    from megatron_tsync.arguments import parse_args

    for flag in ("--stream-coalesce-tokens", "--stream-coalesce-ms"):
        with pytest.raises(SystemExit):
            parse_args(["--rl-algorithm", "opd", "--rl-mode", "stream-turn", flag, "10"])
        assert "OPD streams turns" in capsys.readouterr().err
