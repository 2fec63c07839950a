"""runtime.worker.score_trajectory: what a rollout worker sends as a trajectory's reward and status. A verifier's
reward the task's declared spec does not admit (a binary task's 0.5, a bounded task's 1.5) is sent as a failed
trajectory with the task's floor, never as an off-spec reward (the learner's edge checks it again:
tests/runtime/test_validation.py); in-spec rewards go through unchanged (the control)."""

import asyncio
import math
from types import SimpleNamespace

import pytest

from megatron_tsync.algorithms.streamability import RewardSpec
from megatron_tsync.runtime.worker import score_trajectory


class _Codec:
    def decode(self, ids):
        return " ".join(map(str, ids))


class _Verifier:
    """A custom verifier that returns whatever it was built with (the bug under test is its reward)."""

    def __init__(self, reward):
        self.reward = reward

    async def evaluate(self, text, task):
        return SimpleNamespace(reward=self.reward)


def _score(reward, spec):
    traj = SimpleNamespace(error=None, token_ids=[1, 2, 3], prompt_len=1, loss_mask=[0, 1, 1])
    inst = SimpleNamespace(verifier_task=lambda: None)
    return asyncio.run(score_trajectory(traj, _Codec(), inst, None, _Verifier(reward), float(spec.lo), spec))


@pytest.mark.parametrize("spec,reward,ok", [
    (RewardSpec.binary(), 1.0, True), (RewardSpec.binary(), 0.0, True), (RewardSpec.binary(), 0.5, False),
    (RewardSpec.binary(), 2.0, False), (RewardSpec.bounded(-1.0, 1.0), 0.3, True),
    (RewardSpec.bounded(-1.0, 1.0), 1.5, False), (RewardSpec.continuous(), 1e6, True),
    (RewardSpec.binary(), math.nan, False)])
def test_off_spec_rewards_are_sent_as_failed_with_the_floor(spec, reward, ok):
    r, status, err = _score(reward, spec)
    if ok:
        assert (r, status, err) == (reward, "ok", "")
    else:
        assert status == "error" and r == spec.lo and ("off-spec" in err or "non-finite" in err), (r, status, err)


def test_an_engines_bad_log_probs_are_sent_as_failed_not_a_dead_worker():
    """An engine bug (a NaN or -1e4 behaviour log-prob) would make the sender's schema check raise and kill the
    worker; the worker reports the trajectory failed with the task's lowest reward instead, and that event is valid.
    Control: a valid trajectory is sent as it is."""
    import numpy as np

    from megatron_tsync.runtime.worker import bad_logprobs, reported
    from tests.runtime.test_validation import _traj

    ok = _traj("s0g0t0")
    assert reported(ok, -1.0) is ok and bad_logprobs(ok) is None
    for poison in (float("nan"), -1e4):
        ev = _traj("s0g0t0")
        ev.logprobs[3] = poison
        out = reported(ev, -1.0)
        assert out.status == "error" and out.reward == -1.0 and out.error.startswith("bad_logprob: TrajectoryEvent.")
        assert not np.any(out.logprobs) and out.traj_id == ev.traj_id
        out.validate()  # sendable
