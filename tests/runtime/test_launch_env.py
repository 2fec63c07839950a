"""A rollout worker's environment (``runtime/launch_env.py``): the launcher's task variables scrubbed, its GPUs from
``--rollout-gpus``, the overlap with the trainer's GPUs refused at start-up (computed on CPU: the env each worker
gets and the error; the GPU run is ``tools/gpu_smoke.py``'s)."""

import pytest

from megatron_tsync.arguments import parse_args
from megatron_tsync.runtime import launch_env as le
from megatron_tsync.runtime.env_report import report

JOB = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
       "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n1", "PMI_RANK": "3", "PMIX_RANK": "3", "RANK": "3",
       "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n0", "MASTER_PORT": "1234",
       "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "x", "HOME": "/h", "NCCL_SOCKET_IFNAME": "ib0"}


def _cfg(*flags):
    return parse_args(["--rollout-workers", "2", *flags])


def test_scrub_keeps_the_job_and_drops_the_task():
    env = dict(JOB)
    gone = le.scrub_launcher_env(env)
    assert env == {"SLURM_JOB_ID": "7", "HOME": "/h", "NCCL_SOCKET_IFNAME": "ib0"}
    assert len(gone) == len(JOB) - 3


def test_each_spawned_worker_gets_its_gpus_and_no_task_variables():
    cfg = _cfg("--rollout-gpus", "4,5,6,7", "--rollout-engine", "vllm", "--rollout-tensor-parallel-size", "2")
    envs = [le.worker_process_env(JOB, cfg.rollout, w) for w in range(2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4,5", "6,7"]
    assert all("SLURM_PROCID" not in e and "RANK" not in e and e["SLURM_JOB_ID"] == "7" for e in envs)
    assert "CUDA_VISIBLE_DEVICES" not in le.worker_process_env(JOB, _cfg().rollout, 0)  # no flag: inherited
    assert le.worker_gpus(_cfg("--rollout-gpus", "2-3").rollout, 1) == (3,)


def test_trainer_gpus_follow_local_world_size_and_visible_devices():
    assert le.trainer_gpus({"LOCAL_WORLD_SIZE": "4"}, cuda=True) == (0, 1, 2, 3)
    assert le.trainer_gpus({"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "6,7,0"}, cuda=True) == (6, 7)
    assert le.trainer_gpus({"LOCAL_WORLD_SIZE": "4"}, cuda=False) == ()


def test_overlap_is_refused_naming_the_gpus():
    cfg = _cfg("--rollout-gpus", "3,4")
    with pytest.raises(le.PlacementError, match=r"overlaps the trainer's GPUs \[0, 1, 2, 3\] on \[3\]"):
        le.check_gpu_placement(cfg, {"LOCAL_WORLD_SIZE": "4"}, cuda=True)
    assert le.check_gpu_placement(cfg, {"LOCAL_WORLD_SIZE": "3"}, cuda=True) == ((0, 1, 2), (3, 4))
    assert le.check_gpu_placement(cfg, {"LOCAL_WORLD_SIZE": "8", "CUDA_VISIBLE_DEVICES": "0,1"}, cuda=True)
    with pytest.raises(le.PlacementError, match="1 GPU\\(s\\) for 2 worker"):
        le.check_gpu_placement(_cfg("--rollout-gpus", "5"), {}, cuda=True)
    assert le.check_gpu_placement(_cfg(), {"LOCAL_WORLD_SIZE": "8"}, cuda=True) is None  # no flag, no check


def test_bad_gpu_flags_are_argument_errors(capsys):
    for bad in (["--rollout-gpus", "4,x"], ["--rollout-gpus", "4", "--rollout-launch", "external"]):
        with pytest.raises(SystemExit) as e:
            parse_args(["--rollout-workers", "1", *bad])
        assert e.value.code == 2 and "--rollout-gpus" in capsys.readouterr().err


def test_live_trainer_refuses_an_overlap_at_start_up(monkeypatch, capsys):
    """``loop.run``'s check, before any process group or model exists (here with CUDA reported present)."""
    import torch

    from megatron_tsync.runtime import loop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(SystemExit, match="overlaps the trainer's GPUs"):
        loop.run(_cfg("--rollout-gpus", "1,2", "--model", "/nonexistent"))


def test_env_report_names_the_topology_and_the_destinations(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    from megatron_tsync.model.parallel import ParallelDims

    cfg = parse_args(["--save", str(tmp_path / "ck"), "--tensorboard-dir", str(tmp_path / "tb"), "--wandb-project",
                      "p", "--rollout-gpus", "1"])
    dims = ParallelDims(world_size=4, rank=0, local_rank=0, tp=2, pp=2, dp=1, cp=1, tp_rank=0, pp_rank=0, dp_rank=0,
                        backend="gloo")
    text = report(cfg, dims, env={"SLURM_JOB_ID": "5", "NCCL_IB_HCA": "mlx5", "CUDA_VISIBLE_DEVICES": "0"})
    for needle in ("torch ", "megatron-core ", "world size 4: TP 2, PP 2, DP 1", "SLURM_JOB_ID=5", "NCCL_IB_HCA=mlx5",
                   "CUDA_VISIBLE_DEVICES=0; rollout GPUs 1", f"checkpoints: {tmp_path / 'ck'}",
                   f"tensorboard: {tmp_path / 'tb'}", f"wandb: project p, offline, {tmp_path / 'ck' / 'wandb'}",
                   "rollout plane: "):
        assert needle in text, (needle, text)
