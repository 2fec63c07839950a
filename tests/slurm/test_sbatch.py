"""slurm/train_grpo.sh and slurm/train_opd.sh under a REAL single-node SLURM cluster (tools/slurm_cluster.sh).

As a user runs them: ``sbatch slurm/train_*.sh`` (the job watched until it is over) in CPU mode (``TSYNC_CPU=1``, tiny model, one rollout worker):
  * a long job from scratch stopped with ``scancel --signal=USR1 --batch`` after its first step → the batch script
    forwards SIGUSR1 to the trainer, which finishes its step, saves and exits 0 (job exit code 0); the tracker names
    the checkpoint;
  * a resubmit resumes from it, runs to its last step → job exit code 0, the trainer's summary in the job log, the
    next checkpoint and its tracker file.
The cluster fixture installs SLURM + munge with apt if missing (root); the tests skip only without root or when the
packages cannot be installed. OPD runs only when megatron_tsync has an OPD trainer (checked at run time).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "tools", "slurm_cluster.sh")

pytestmark = pytest.mark.slow
# SIGTERM → SIGKILL in the test clusters: 120 s, not the 30 s of most clusters (tools/slurm_cluster.sh's default). A
# passing job never waits for it (its processes exit first); at load 50 a TERM save of the tiny model, its rollout
# worker's close and the batch script's report took over 30 s (2026-12-07, before and after the SLURM scenarios ran two
# at a time), and SIGKILL cut them off. The tests check what a TERM does, not how fast a loaded machine saves.
KILLWAIT = "120"


# ------------------------------------------------------------------------------------------------ fixtures
_SUBMITTED: list[tuple[str, str]] = []  # (job id, SLURM_CONF) of every job submitted here


@pytest.fixture(autouse=True)
def _cancel_leftover_jobs():
    """A failed test must not leave its job running (it would hold the node for the next test)."""
    yield
    while _SUBMITTED:
        job_id, conf = _SUBMITTED.pop()
        subprocess.run(["scancel", job_id], env=dict(os.environ, SLURM_CONF=conf), capture_output=True, timeout=60)


@contextlib.contextmanager
def slurm_lock():
    """One SLURM test module at a time on this machine (pytest-xdist runs modules on several workers): the clusters
    share one munged, and a module's teardown takes its cluster down. Another worker waits here."""
    with open(os.path.join(tempfile.gettempdir(), "tsync-slurm-tests.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def slurm():
    """SLURM_CONF of a running single-node cluster (stood up here, and taken down after, if it was not running)."""
    with slurm_lock():
        yield from _slurm_cluster()


def _slurm_cluster():
    base = os.environ.get("TSYNC_SLURM_DIR", "/tmp/tsync-slurm")
    # cred_expire 10 s: a requeued job starts again ~11 s later (SLURM holds it for cred_expire + 1 s, then the next
    # scheduler pass, 1-2 s in tools/slurm_cluster.sh, starts it; cred_expire 30 s by default there, 120 s in SLURM;
    # 5 s is SLURM's minimum, and also every job step's credential lifetime: kept at 10 for loaded machines);
    # everything else as a real cluster has it
    env = dict(os.environ, TSYNC_SLURM_DIR=base)
    env.setdefault("TSYNC_SLURM_CRED_EXPIRE", "10")
    env.setdefault("TSYNC_SLURM_KILLWAIT", KILLWAIT)
    # the jobs at nice -5 (slurmd's; tools/slurm_cluster.sh): they are timed by SLURM's clocks while the other xdist
    # workers keep both cores busy, so their start-ups go first (their steps mostly wait: IDLING)
    env.setdefault("TSYNC_SLURMD_NICE", "-5")
    # 4 CPU slots on the 2-core node: the clock-bound jobs of test_stop_requeue.py run beside the other tests' jobs
    # (one CPU each; with 2 slots a third job pends until one ends)
    env.setdefault("TSYNC_SLURM_NODE_CPUS", "4")
    was_up = subprocess.run(["bash", CLUSTER, "status"], env=env, capture_output=True).returncode == 0
    if not was_up:
        if os.geteuid() != 0:
            pytest.skip("standing up a SLURM cluster (munged, slurmctld, slurmd) needs root")
        if shutil.which("sbatch") is None and shutil.which("apt-get") is None:
            pytest.skip("SLURM is not installed and there is no apt-get to install it")
    t0 = time.perf_counter()
    p = subprocess.run(["bash", CLUSTER, "up"], env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        if "apt-get" in p.stderr and ("failed" in p.stderr or "no apt-get" in p.stderr):
            pytest.skip(f"SLURM could not be installed: {p.stderr.strip()[-500:]}")
        pytest.fail(f"tools/slurm_cluster.sh up failed ({p.returncode}):\n{p.stderr[-3000:]}")
    m = re.search(r"export SLURM_CONF=(\S+)", p.stdout)
    assert m, p.stdout
    print(f"slurm cluster up in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    yield m.group(1)
    if not was_up:
        subprocess.run(["bash", CLUSTER, "down"], env=env, capture_output=True, timeout=120)


def _job_env(slurm_conf: str, runs: str, **extra) -> dict:
    env = dict(os.environ, SLURM_CONF=slurm_conf, TSYNC_CPU="1", TSYNC_RUNS=runs, TSYNC_PYTHON=sys.executable,
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for k in ("SLURM_JOB_ID", "SLURM_JOBID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TRAIN_ITERS", "SAVE", "LOAD", "MODEL", "TEACHER_MODEL", "EXTRA_ARGS"):
        env.pop(k, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


_FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "DEADLINE",
          "BOOT_FAIL")


class Job:
    """A submitted batch job, watched like a Popen: poll() is None until the job is over (requeues included) and its
    batch script has ended; returncode is its exit code (`scontrol show job` ExitCode). Polled every 0.5 s:
    `sbatch --wait` polls at 2, 4, 8, 16, 32 s, so a 12 s job returns after 42 s."""

    def __init__(self, cmd: list[str], env: dict):
        p = subprocess.run([*cmd[:1], "--parsable", *cmd[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0, p.stderr
        self.job_id, self.slurm_conf, self.args = p.stdout.strip().split(";")[0], env["SLURM_CONF"], cmd
        _SUBMITTED.append((self.job_id, self.slurm_conf))
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            out = subprocess.run(["scontrol", "show", "job", "-o", self.job_id], capture_output=True, text=True,
                                 env=dict(os.environ, SLURM_CONF=self.slurm_conf)).stdout
            state = re.search(r"JobState=(\S+)", out)
            code = re.search(r"\bExitCode=(\d+):(\d+)", out)
            if state and state.group(1) in _FINAL and code:
                self.returncode = int(code.group(1)) or (128 + int(code.group(2)) if int(code.group(2)) else 0)
        return self.returncode

    def wait(self, timeout: float):
        t_end = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > t_end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.5)
        return self.returncode

    def kill(self):
        subprocess.run(["scancel", self.job_id], env=dict(os.environ, SLURM_CONF=self.slurm_conf),
                       capture_output=True, timeout=60)


def _sbatch(script: str, env: dict, log: str, *, wait: bool = True, args=()) -> Job | int:
    """Submits; wait: the job's exit code once it is over. wait=False: the Job (to signal it meanwhile)."""
    p = Job(["sbatch", "--gpus-per-node=0", f"--output={log}", os.path.join(ROOT, "slurm", script), *args], env)
    if not wait:
        return p
    try:
        p.wait(timeout=600)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"sbatch --wait {script} did not finish in 600 s; log:\n{_read(log)[-4000:]}")
    return p.returncode


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _tracker(save: str) -> int:
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read().strip())


def _wait_for(pattern: str, log: str, proc: subprocess.Popen, timeout: float) -> re.Match:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        m = re.search(pattern, _read(log))
        if m:
            return m
        if proc.poll() is not None:
            pytest.fail(f"job ended (exit code {proc.returncode}) before {pattern!r} appeared; log:\n{_read(log)[-4000:]}")
        time.sleep(0.5)
    pytest.fail(f"{pattern!r} not in the job log after {timeout:.0f}s; log:\n{_read(log)[-4000:]}")


def _opd_available() -> bool:
    return importlib.util.find_spec("megatron_tsync.runtime.opd") is not None


# ------------------------------------------------------------------------------------------------ the lifecycle
# Two jobs per script, two tests: a long job from scratch (the job creates the tiny model) stopped after its first
# step with SIGUSR1 to the batch script (``_stop``), then a resubmit that resumes from the stop's checkpoint, finishes
# its step and exits 0 (``_resume``; it fails, not skips, when its script's stop test left no checkpoint).
_STOPPED: dict[str, tuple[str, str, int]] = {}  # script → (runs, save, step) of its stopped job


@pytest.fixture(scope="module")
def lifecycle_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lifecycle")


def _stop(script: str, slurm_conf: str, base, name: str) -> None:
    (base / script).mkdir()
    runs = str(base / script / "runs")
    save = os.path.join(runs, name)  # default SAVE = $TSYNC_RUNS/$SLURM_JOB_NAME, LOAD = SAVE
    log1 = str(base / script / "job1.log")
    t0 = time.perf_counter()
    proc = _sbatch(script, _job_env(slurm_conf, runs, TRAIN_ITERS=10_000, SAVE_INTERVAL=1000), log1, wait=False)
    job_id = proc.job_id
    _wait_for(r"\[tsync\] step 1 ", log1, proc, 300)  # step 1 done (no save: interval 1000)
    assert re.search(rf"job {job_id} on ", _read(log1))
    t_sig = time.perf_counter()
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=_job_env(slurm_conf, runs), check=True)
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"job {job_id} did not stop within 300 s of SIGUSR1; log:\n{_read(log1)[-4000:]}")
    out = _read(log1)
    assert proc.returncode == 0, f"stopped job exit code {proc.returncode}; log:\n{out[-4000:]}"
    assert "got SIGUSR1" in out and "sent SIGUSR1 to the trainer ranks" in out, out[-4000:]
    assert "trainer exited with code 0" in out, out[-4000:]
    stopped_at = _tracker(save)
    assert 1 <= stopped_at < 10_000, out[-4000:]
    assert f"[tsync] saved checkpoint {save}/iter_{stopped_at:07d}" in out, out[-4000:]
    assert os.path.isdir(os.path.join(save, f"iter_{stopped_at:07d}"))
    jobdirs = os.listdir(os.path.join(save, "slurm-jobs"))
    secret = os.path.join(save, "slurm-jobs", jobdirs[0], "secret.hex")
    assert os.stat(secret).st_mode & 0o777 == 0o600
    _STOPPED[script] = (runs, save, stopped_at)
    print(f"{script}: signal → job end {time.perf_counter() - t_sig:.0f}s, stopped job total "
          f"{time.perf_counter() - t0:.0f}s", file=sys.stderr)


def _resume(script: str, slurm_conf: str, base) -> None:
    """The checkpoint left by the stop loads: a resubmit resumes from it, runs its one step and ends with exit 0."""
    if script not in _STOPPED:
        pytest.fail(f"no stopped {script} job to resume (its stop test failed or did not run)")
    runs, save, stopped_at = _STOPPED[script]
    log2 = str(base / script / "job2.log")
    t0 = time.perf_counter()
    rc = _sbatch(script, _job_env(slurm_conf, runs, TRAIN_ITERS=stopped_at + 1), log2)
    out = _read(log2)
    assert rc == 0, f"job 2 exit code {rc}; log:\n{out[-4000:]}"
    assert f"[tsync] resumed from {save} at step {stopped_at}" in out, out[-4000:]
    assert re.search(r"\[tsync\] (opd )?summary: .*, 1 steps,", out), out[-4000:]  # opd: "[tsync] opd summary:"
    assert "trainer exited with code 0" in out
    assert _tracker(save) == stopped_at + 1 and os.path.isdir(os.path.join(save, f"iter_{stopped_at + 1:07d}"))
    print(f"{script}: resume after stop {time.perf_counter() - t0:.0f}s", file=sys.stderr)


def test_grpo_sbatch_usr1_stop(slurm, lifecycle_dir):
    _stop("train_grpo.sh", slurm, lifecycle_dir, "tsync-grpo")


def test_grpo_sbatch_resume(slurm, lifecycle_dir):
    _resume("train_grpo.sh", slurm, lifecycle_dir)


def test_opd_sbatch_usr1_stop(slurm, lifecycle_dir):
    if not _opd_available():
        pytest.skip("OPD trainer not available (megatron_tsync.runtime.opd is missing)")
    _stop("train_opd.sh", slurm, lifecycle_dir, "tsync-opd")


def test_opd_sbatch_resume(slurm, lifecycle_dir):
    if not _opd_available():
        pytest.skip("OPD trainer not available (megatron_tsync.runtime.opd is missing)")
    _resume("train_opd.sh", slurm, lifecycle_dir)


# ------------------------------------------------------------------------------------------------ refusals
def test_rollout_nodes_refused_with_reason(slurm, tmp_path):
    """ROLLOUT_NODES > 0 needs nodes of its own: on a one-node allocation the job says so and exits 2."""
    log = str(tmp_path / "job.log")
    rc = _sbatch("train_grpo.sh", _job_env(slurm, str(tmp_path / "runs"), TSYNC_CPU=0, MODEL=str(tmp_path / "m"),
                                           ROLLOUT_NODES=1), log)
    out = _read(log)
    assert rc == 2, out
    assert "ROLLOUT_NODES=1" in out and "allocated nodes" in out, out


def test_script_outside_slurm_says_so(tmp_path):
    env = _job_env("/nonexistent", str(tmp_path), TSYNC_HOME=ROOT)
    p = subprocess.run(["bash", os.path.join(ROOT, "slurm", "train_grpo.sh")], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "run this script with sbatch" in p.stderr, p.stderr
