"""Sampling seeds do not depend on the rollout plane's shape: the same step rolled out by 1 or by 2 workers gives
token-identical trajectories (each trajectory is seeded by its global index, not by its position in a worker's
prompt list — which gave 9 of 16 different trajectories before)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_one_and_two_workers_sample_the_same_trajectories(tmp_path):
    import torch

    from megatron_tsync.model.tiny_model import make_tiny_model
    from megatron_tsync.runtime.rollout_io import load_rollouts
    from tests.conftest import free_port

    model = make_tiny_model(str(tmp_path / "m"), seed=0)
    got = {}
    for workers in (1, 2):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        out = tmp_path / f"w{workers}"
        p = subprocess.run([sys.executable, "-m", "megatron_tsync.train", "--config",
                            os.path.join(ROOT, "examples", "tiny_agent", "config.yaml"), "--model", model,
                            "--rollout-workers", str(workers), "--sft-warmup-steps", "0", "--train-iters", "1",
                            "--group-size", "4", "--global-batch-size", "16", "--max-new-tokens", "24",
                            "--dump-rollouts", str(out / "dump"), "--save", str(out / "ck"), "--no-progress",
                            "--eval-interval", "0"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, f"{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
        samples, _ = load_rollouts(str(out / "dump"), 0)
        got[workers] = {s.traj_id: s for s in samples}
        assert len(got[workers]) == 16
    workers_seen = {s.meta["worker"] for s in got[2].values()}
    assert workers_seen == {0, 1}  # the control: two workers really shared the step
    for tid, s in got[1].items():
        assert torch.equal(s.token_ids, got[2][tid].token_ids), tid
