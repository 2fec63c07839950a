"""KL to a reference model in live runs (``python -m megatron_tsync.train`` with a rollout worker process), as a user
runs it. One worker: each extra worker process is another start-up of torch and the engine, and how many workers
deliver the trajectories does not change what the reference scores (several workers: tests/runtime/test_faults.py).

- ``--kl-mode reward --ref-model DIR``: every trajectory is scored by the reference when it lands (``ref_forwards``
  = trajectories per step), the KL sums are logged (``kl_sum_mean`` ≠ 0), and the update differs from the same
  run without KL: step 0's rollouts are the same (same seed, same θ0), so the gradient norms differ only through
  the KL term (on the random tiny model every reward is 0, so without KL most groups have no signal at all);
- ``--kl-mode loss`` with the default reference (frozen initial weights): saved under ``SAVE/reference`` with the
  first checkpoint; a resume with ``--load`` loads it, and its step 1 equals an uninterrupted run's. The resume starts
  from the uninterrupted run's own step-1 checkpoint (``--save-interval 1``, copied without the later step: what a
  run stopped after step 1 leaves), so two runs make the check instead of three.
"""

import json
import os
import shutil

import pytest

from tests.runtime.test_train_e2e import _train

# each run may take its subprocess timeout (900 s) on a loaded machine: the test as a whole gets more than pytest.ini's
# 600 s (the runs, not this figure, are what takes the time)
pytestmark = pytest.mark.timeout(1800)
COMMON = ["--group-size", "2", "--global-batch-size", "4", "--rollout-workers", "1", "--max-turns", "2",
          "--max-new-tokens", "16", "--seq-length", "128", "--lr", "1e-4", "--rl-mode", "stream-trajectory",
          "--no-progress"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    d = tmp_path_factory.mktemp("kl_models")
    return make_tiny_model(str(d / "policy"), seed=0), make_tiny_model(str(d / "ref"), seed=1)


def _history(path):
    return json.loads((path / "history.json").read_text())


@pytest.mark.slow
def test_live_kl_in_reward_with_ref_model(models, tmp_path):
    policy, ref = models
    kl, plain = tmp_path / "kl", tmp_path / "plain"
    _train(["--model", policy, *COMMON, "--train-iters", "2", "--kl-mode", "reward", "--kl-coef", "0.1",
            "--ref-model", ref, "--save", str(kl)], tmp_path)
    _train(["--model", policy, *COMMON, "--train-iters", "1", "--save", str(plain)], tmp_path)
    h, h0 = _history(kl), _history(plain)
    assert [r["ref_forwards"] for r in h] == [4, 4] and all(r["theta0_forwards"] == 4 for r in h)
    assert all(r["kl_sum_mean"] is not None and abs(r["kl_sum_mean"]) > 1e-3 for r in h)
    assert h[0]["reward"] == h0[0]["reward"]  # the same step-0 rollouts
    assert abs(h[0]["grad_norm"] - h0[0]["grad_norm"]) > 1e-3 * max(h[0]["grad_norm"], 1e-3), (h[0], h0[0])
    assert not os.path.exists(kl / "reference")  # --ref-model: nothing to save


@pytest.mark.slow
def test_live_kl_loss_frozen_reference_resume(models, tmp_path):
    """k3 against the frozen initial policy: its gradient is 0 at θ0 and grows as the policy moves, so step 1 of a
    resumed run equals step 1 of an uninterrupted run only if the resume restored the *initial* weights as the
    reference (a copy of the loaded weights would give a KL gradient of 0 there)."""
    policy, _ = models
    ck, full = tmp_path / "ck", tmp_path / "full"
    args = ["--model", policy, *COMMON, "--kl-mode", "loss", "--kl-coef", "0.1", "--kl-estimator", "k3"]
    _train([*args, "--train-iters", "2", "--save", str(full), "--save-interval", "1"], tmp_path)
    shutil.copytree(full, ck, ignore=shutil.ignore_patterns("iter_0000002", "rollout_plane", "history.json"))
    (ck / "latest_checkpointed_iteration.txt").write_text("1")  # the tracker as a 1-step run leaves it
    assert (ck / "reference" / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    out = _train([*args, "--train-iters", "2", "--save", str(ck), "--load", str(ck)], tmp_path)
    assert "at step 1" in out
    resumed, uninterrupted = _history(ck)[-1], _history(full)[1]
    assert resumed["step"] == uninterrupted["step"] == 1 and resumed["ref_forwards"] == 4
    assert resumed["reward"] == uninterrupted["reward"]
    assert abs(resumed["grad_norm"] - uninterrupted["grad_norm"]) <= 1e-4 * uninterrupted["grad_norm"], \
        (resumed, uninterrupted)
