"""slurm/common.sh without a cluster (fast tier): what the job would launch (``TSYNC_DRY_RUN=1``, a real feature:
the exact srun steps, trainer flags and environment, nothing started or written) for every configuration variable,
and the self-requeue decision on the trainer's stop record (``tsync_maybe_requeue`` with ``scontrol`` recorded).
The real jobs (signals, requeue, concurrency) are in test_stop_requeue.py and test_sbatch.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "slurm", "train_grpo.sh")
_DROP = ("SLURM_", "TSYNC_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TRAIN_ITERS", "SAVE", "LOAD", "MODEL",
         "EXTRA_ARGS", "RUN_NAME", "ROLLOUT_", "TRAINER_", "GPUS_PER_NODE", "NPROC_PER_NODE", "WANDB_", "HF_",
         "NCCL_", "GLOO_", "CONTAINER_", "APPTAINER_", "MODULES", "ENV_SETUP", "EXIT_DURATION", "KEEP_LAST", "REQUEUE")


def _env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP)}
    env.update(TSYNC_DRY_RUN="1", TSYNC_HOME=ROOT, TSYNC_RUNS=str(tmp_path / "runs"), MODEL="/ckpt/m")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _dry(tmp_path, *args, rc=0, **extra) -> dict:
    """Runs the dry run; returns {'out': text, 'cmd': trainer argv, 'trainer': srun argv, 'rollout': srun argv}."""
    p = subprocess.run(["bash", SCRIPT, *args], env=_env(tmp_path, **extra), capture_output=True, text=True, timeout=60)
    assert p.returncode == rc, p.stdout + p.stderr
    out = p.stdout + p.stderr
    res = {"out": out}
    for key, label in (("cmd", "command"), ("trainer", "trainer step"), ("rollout", "rollout step")):
        m = re.search(rf"dry run: {label}: (.*)", out)
        res[key] = shlex.split(m.group(1)) if m else None
    if rc == 0:
        assert not os.path.exists(tmp_path / "runs"), "a dry run must not write anything"
    return res


def _flag(argv: list[str], name: str):
    return argv[argv.index(name) + 1] if name in argv else None


# ------------------------------------------------------------------------------------------------ run directories
def test_run_name_and_per_job_dirs(tmp_path):
    a = _dry(tmp_path, SLURM_JOB_NAME="exp", SLURM_ARRAY_TASK_ID=3, TSYNC_CPU=1)
    save = str(tmp_path / "runs" / "exp_3")
    assert "run name exp_3" in a["out"]
    assert _flag(a["cmd"], "--save") == save and _flag(a["cmd"], "--load") == save
    assert _flag(a["cmd"], "--rollout-dir") == f"{save}/slurm-jobs/0/rollout_plane"
    assert _flag(a["cmd"], "--secret-file") == f"{save}/slurm-jobs/0/secret.hex"
    assert _flag(a["cmd"], "--tensorboard-dir") == f"{save}/tensorboard"
    for what in ("checkpoints " + save, "tensorboard " + save, "wandb off", "rollout workers " + save):
        assert what in a["out"], a["out"]
    # no array task: the job name; an explicit RUN_NAME wins; SAVE wins over both
    b = _dry(tmp_path, SLURM_JOB_NAME="exp", TSYNC_CPU=1)
    assert _flag(b["cmd"], "--save") == str(tmp_path / "runs" / "exp")
    c = _dry(tmp_path, SLURM_JOB_NAME="exp", SLURM_ARRAY_TASK_ID=3, RUN_NAME="lr1e-6", TSYNC_CPU=1)
    assert _flag(c["cmd"], "--save") == str(tmp_path / "runs" / "lr1e-6")
    d = _dry(tmp_path, RUN_NAME="x", SAVE="/shared/ckpt", TSYNC_CPU=1)
    assert _flag(d["cmd"], "--save") == "/shared/ckpt" and _flag(d["cmd"], "--rollout-dir").startswith("/shared/ckpt/slurm-jobs/")
    bad = _dry(tmp_path, RUN_NAME="a/b", TSYNC_CPU=1, rc=2)
    assert "RUN_NAME='a/b'" in bad["out"]


def test_outside_slurm_without_dry_run_says_so(tmp_path):
    env = _env(tmp_path)
    env.pop("TSYNC_DRY_RUN")
    p = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "run this script with sbatch" in p.stderr and "TSYNC_DRY_RUN=1" in p.stderr


# ------------------------------------------------------------------------------------------------ GPU placement
def test_single_node_gpu_split(tmp_path):
    a = _dry(tmp_path, GPUS_PER_NODE=8)  # default: half for the trainer, the rest for the rollout engines
    assert _flag(a["cmd"], "--rollout-gpus") == "4,5,6,7" and _flag(a["cmd"], "--rollout-workers") == "4"
    assert "1 node(s) × 4 rank(s)" in a["out"]
    b = _dry(tmp_path, GPUS_PER_NODE=8, TRAINER_GPUS=6)
    assert _flag(b["cmd"], "--rollout-gpus") == "6,7" and "× 6 rank(s)" in b["out"]
    c = _dry(tmp_path, GPUS_PER_NODE=8, TRAINER_GPUS=4, ROLLOUT_GPUS="6,7", ROLLOUT_GPUS_PER_WORKER=2)
    assert _flag(c["cmd"], "--rollout-gpus") == "6,7" and _flag(c["cmd"], "--rollout-workers") == "1"
    assert _flag(c["cmd"], "--rollout-tensor-parallel-size") == "2"
    bad = _dry(tmp_path, GPUS_PER_NODE=8, TRAINER_GPUS=4, ROLLOUT_GPUS="3,4", rc=2)
    assert "ROLLOUT_GPUS=3,4 overlaps the trainer's GPUs 0-3" in bad["out"]
    bad = _dry(tmp_path, GPUS_PER_NODE=8, ROLLOUT_GPUS="4,9", rc=2)
    assert "GPU 9 >= GPUS_PER_NODE=8" in bad["out"]
    # rollout nodes: every trainer GPU is the trainer's, no --rollout-gpus; ROLLOUT_GPUS there is refused
    d = _dry(tmp_path, GPUS_PER_NODE=8, ROLLOUT_NODES=1, SLURM_JOB_NUM_NODES=2, SLURM_JOB_NODELIST="n1,n2")
    assert "--rollout-gpus" not in d["cmd"] and "× 8 rank(s)" in d["out"]
    bad = _dry(tmp_path, GPUS_PER_NODE=8, ROLLOUT_NODES=1, SLURM_JOB_NUM_NODES=2, SLURM_JOB_NODELIST="n1,n2",
               ROLLOUT_GPUS="4", rc=2)
    assert "ROLLOUT_GPUS=4 applies to the trainer's node only" in bad["out"]
    cpu = _dry(tmp_path, TSYNC_CPU=1)  # control: CPU mode has no GPU flag at all
    assert "--rollout-gpus" not in cpu["cmd"]


def test_rollout_nodes_step(tmp_path):
    r = _dry(tmp_path, GPUS_PER_NODE=8, ROLLOUT_NODES=2, SLURM_JOB_NUM_NODES=3, SLURM_JOB_NODELIST="n1,n2,n3",
             ROLLOUT_WORKERS=16)
    step = r["rollout"]
    assert step[:3] == ["srun", "--overlap", "--nodes=2"] and "--nodelist=n2,n3" in step and "--ntasks=16" in step
    assert "--kill-on-bad-exit=0" in step
    save = str(tmp_path / "runs" / "tsync-grpo")
    assert f"--output={save}/slurm-jobs/0/rollout_plane/worker_logs/worker%t.log" in step
    assert step[-3:] == ["rollout", "python", f"{save}/slurm-jobs/0/rollout_plane"]
    assert _flag(r["cmd"], "--rollout-launch") == "external"


# ------------------------------------------------------------------------------------------------ flags
def test_stop_checkpoint_and_wandb_flags(tmp_path):
    plain = _dry(tmp_path, TSYNC_CPU=1)
    for f in ("--exit-duration-in-mins", "--keep-last-checkpoints", "--wandb-project"):
        assert f not in plain["cmd"]
    assert "wandb off" in plain["out"]
    r = _dry(tmp_path, TSYNC_CPU=1, SLURM_JOB_NAME="exp", EXIT_DURATION_MINS=230.5, KEEP_LAST_CKPTS=3,
             WANDB_PROJECT="tsync", WANDB_MODE="offline")
    save = str(tmp_path / "runs" / "exp")
    assert _flag(r["cmd"], "--exit-duration-in-mins") == "230.5" and _flag(r["cmd"], "--keep-last-checkpoints") == "3"
    assert _flag(r["cmd"], "--wandb-project") == "tsync" and _flag(r["cmd"], "--wandb-exp-name") == "exp"
    assert _flag(r["cmd"], "--wandb-save-dir") == f"{save}/wandb"
    assert "env WANDB_MODE=offline" in r["out"] and "mode offline" in r["out"]
    r = _dry(tmp_path, TSYNC_CPU=1, WANDB_PROJECT="tsync", WANDB_EXP_NAME="lr-sweep-1", WANDB_SAVE_DIR="/w")
    assert _flag(r["cmd"], "--wandb-exp-name") == "lr-sweep-1" and _flag(r["cmd"], "--wandb-save-dir") == "/w"
    r = _dry(tmp_path, "--lr", "1e-6", TSYNC_CPU=1, EXTRA_ARGS="--seed 3")
    assert r["cmd"][-4:] == ["--seed", "3", "--lr", "1e-6"]


def test_environment_passthrough_listed(tmp_path):
    vals = dict(HF_HOME="/hf", HF_HUB_OFFLINE=1, NCCL_SOCKET_IFNAME="ib0", GLOO_SOCKET_IFNAME="eth0",
                NCCL_IB_HCA="mlx5_0,mlx5_1", NCCL_DEBUG="WARN")
    r = _dry(tmp_path, TSYNC_CPU=1, **vals)
    for k, v in vals.items():
        assert f"env {k}={v}" in r["out"], r["out"]
    assert "env HF_HOME" not in _dry(tmp_path, TSYNC_CPU=1)["out"]


# ------------------------------------------------------------------------------------------------ containers
def test_pyxis_container_options(tmp_path):
    r = _dry(tmp_path, GPUS_PER_NODE=8, ROLLOUT_NODES=1, SLURM_JOB_NUM_NODES=2, SLURM_JOB_NODELIST="n1,n2",
             CONTAINER_IMAGE="nvcr.io#nvidia/pytorch:25.01-py3", CONTAINER_MOUNTS="/lustre:/lustre",
             CONTAINER_WORKDIR="/lustre/tsync")
    for step in (r["trainer"], r["rollout"]):
        assert "--container-image=nvcr.io#nvidia/pytorch:25.01-py3" in step
        assert "--container-mounts=/lustre:/lustre" in step and "--container-workdir=/lustre/tsync" in step
        assert step.index("--container-image=nvcr.io#nvidia/pytorch:25.01-py3") < step.index("bash")
    d = _dry(tmp_path, TSYNC_CPU=1, CONTAINER_IMAGE="img.sqsh")  # default mounts: the repository and SAVE
    save = str(tmp_path / "runs" / "tsync-grpo")
    assert f"--container-mounts={ROOT}:{ROOT},{save}:{save}" in d["trainer"]
    assert f"--container-workdir={ROOT}" in d["trainer"]
    assert not any(a.startswith("--container") for a in _dry(tmp_path, TSYNC_CPU=1)["trainer"])  # control
    bad = _dry(tmp_path, TSYNC_CPU=1, CONTAINER_IMAGE="a", APPTAINER_IMAGE="b.sif", rc=2)
    assert "choose one" in bad["out"]


def test_apptainer_prefix(tmp_path):
    g = _dry(tmp_path, GPUS_PER_NODE=8, APPTAINER_IMAGE="/img/tsync.sif", CONTAINER_MOUNTS="/data:/data")
    assert "python prefix: apptainer exec --nv --bind /data:/data /img/tsync.sif" in g["out"]
    c = _dry(tmp_path, TSYNC_CPU=1, APPTAINER_IMAGE="/img/tsync.sif")  # no GPUs: no --nv
    save = str(tmp_path / "runs" / "tsync-grpo")
    assert f"python prefix: apptainer exec --bind {ROOT}:{ROOT},{save}:{save} /img/tsync.sif" in c["out"]


def test_launch_node_runs_python_behind_the_prefix(tmp_path):
    """launch_node.sh puts TSYNC_PY_PREFIX before python (what apptainer needs): a recording stand-in for it."""
    shim = tmp_path / "fake-apptainer"
    shim.write_text('#!/bin/bash\necho "prefix: $*" >>"$SHIM_LOG"\nshift 2\nexec "$@"\n')  # drop 'exec IMAGE'
    shim.chmod(0o755)
    env = dict(_env(tmp_path), TSYNC_PY_PREFIX=f"{shim} exec /img.sif", SHIM_LOG=str(tmp_path / "log"),
               TRAINER_NODES="1", NPROC_PER_NODE="1", PID_DIR=str(tmp_path))
    p = subprocess.run(["bash", os.path.join(ROOT, "slurm", "launch_node.sh"), "trainer", "python3", "-c",
                        "print('ran')"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "ran", p.stderr
    logged = (tmp_path / "log").read_text()
    assert "prefix: exec /img.sif bash" in logged and "rank python3 -c" in logged, logged


# ------------------------------------------------------------------------------------------------ environment
def test_env_setup_and_modules(tmp_path):
    setup = tmp_path / "site.sh"
    setup.write_text(f'module() {{ echo "$*" >>{tmp_path}/modules.log; }}\nTRAIN_ITERS=7\n')
    r = _dry(tmp_path, TSYNC_CPU=1, ENV_SETUP=setup, MODULES="cuda/12.4 nccl/2.21")
    assert _flag(r["cmd"], "--train-iters") == "7"  # ENV_SETUP is sourced before the configuration
    assert (tmp_path / "modules.log").read_text().splitlines() == ["load cuda/12.4", "load nccl/2.21"]
    bad = _dry(tmp_path, TSYNC_CPU=1, MODULES="cuda/12.4", rc=2)  # no module command in this shell
    assert "MODULES='cuda/12.4' is set but there is no 'module' command" in bad["out"]
    bad = _dry(tmp_path, TSYNC_CPU=1, ENV_SETUP=tmp_path / "missing.sh", rc=2)
    assert "missing.sh: no such file" in bad["out"]
    setup.write_text('module() { return 3; }\n')
    bad = _dry(tmp_path, TSYNC_CPU=1, ENV_SETUP=setup, MODULES="cuda/12.4", rc=2)
    assert "module load cuda/12.4 failed" in bad["out"]


# ------------------------------------------------------------------------------------------------ requeue decision
def _decide(tmp_path, stop: dict | None, *, start_step="3", time_left="", **env) -> tuple[int, str, str]:
    """tsync_maybe_requeue on a stop record; returns (its status, its log, what scontrol was asked)."""
    save = tmp_path / "save"
    save.mkdir(exist_ok=True)
    rec = save / "tsync_stop.json"
    if stop is None:
        rec.unlink(missing_ok=True)
    else:
        rec.write_text(json.dumps(stop))
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "scontrol").write_text(f'#!/bin/bash\necho "$*" >>{tmp_path}/scontrol.log\n')
    (bindir / "scontrol").chmod(0o755)
    (tmp_path / "scontrol.log").write_text("")
    script = (f"source {ROOT}/slurm/common.sh; SAVE={save}; START_STEP={start_step}; STOP_TIME_LEFT={time_left}; "
              "REQUEUE=${REQUEUE:-1}; REQUEUE_SIGNAL_WINDOW=${REQUEUE_SIGNAL_WINDOW:-600}; SLURM_JOB_ID=77; "
              "tsync_maybe_requeue")
    p = subprocess.run(["bash", "-c", script], env=dict(_env(tmp_path), PATH=f"{bindir}:{os.environ['PATH']}",
                                                        **{k: str(v) for k, v in env.items()}),
                       capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout + p.stderr, (tmp_path / "scontrol.log").read_text()


def test_requeue_decision(tmp_path):
    rec = lambda reason, step=5, finished=False: {"finished": finished, "reason": reason, "step": step, "time": 1.0}
    rc, out, asked = _decide(tmp_path, rec("exit-duration"))
    assert rc == 0 and asked == "requeue 77\n" and "requeueing job 77" in out
    rc, _, asked = _decide(tmp_path, rec("exit-duration"), REQUEUE=0)
    assert rc == 1 and asked == ""
    rc, out, asked = _decide(tmp_path, rec("exit-duration", step=3))  # no progress since the start: a loop
    assert rc == 1 and asked == "" and "no progress" in out
    rc, _, asked = _decide(tmp_path, rec("done", step=9, finished=True))
    assert rc == 1 and asked == ""
    rc, _, asked = _decide(tmp_path, rec("SIGUSR1"), time_left=240)  # SLURM's pre-timeout signal
    assert rc == 0 and asked == "requeue 77\n"
    rc, out, asked = _decide(tmp_path, rec("SIGUSR1"), time_left=7200)  # someone's scancel --signal=USR1
    assert rc == 1 and asked == "" and "manual stop" in out
    rc, _, asked = _decide(tmp_path, rec("SIGUSR1"), time_left=7200, REQUEUE_SIGNAL_WINDOW=10000)
    assert rc == 0 and asked == "requeue 77\n"
    for reason in ("SIGTERM", "SIGINT"):  # scancel / time limit / scontrol requeue / preemption: SLURM's call
        rc, out, asked = _decide(tmp_path, rec(reason))
        assert rc == 1 and asked == "" and "not requeued by this script" in out
    rc, out, asked = _decide(tmp_path, None)
    assert rc == 1 and asked == "" and "no " in out and "tsync_stop.json" in out


@pytest.mark.parametrize("left,secs", [("4:00:00", 14400), ("1-02:03:04", 93784), ("09:05", 545), ("UNLIMITED", "")])
def test_time_left_parse(tmp_path, left, secs):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "squeue").write_text(f"#!/bin/bash\necho {left}\n")
    (bindir / "squeue").chmod(0o755)
    p = subprocess.run(["bash", "-c", f"source {ROOT}/slurm/common.sh; SLURM_JOB_ID=1; tsync_time_left"],
                       env=dict(_env(tmp_path), PATH=f"{bindir}:{os.environ['PATH']}"), capture_output=True,
                       text=True, timeout=60)
    assert p.stdout.strip() == str(secs)
