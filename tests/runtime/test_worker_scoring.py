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
