"""Stopping, requeueing and concurrent jobs of slurm/train_grpo.sh under a REAL single-node SLURM cluster (CPU mode,
tiny model; tools/slurm_cluster.sh with a scheduler pass every second or two; the test cluster's cred_expire is 10 s
and its KillWait 120 s (see ``tests/slurm/test_sbatch.py``), so a requeued job starts again ~11 s after its requeue
instead of minutes). What SLURM does, not a simulation of it:
  * time limit (``--time=1``, no pre-timeout signal): SIGTERM to every process, SIGKILL KillWait later;
  * plain ``scancel``: the same SIGTERM to every process;
  * ``scontrol requeue``: SIGTERM to every process, then the job (same id) runs again;
  * ``EXIT_DURATION_MINS``: the trainer stops itself at a step boundary and the batch script requeues the job.
Each leaves a complete checkpoint of the last finished step (the last step the job logged), no ``.tmp``, a
``tsync_stop.json`` saying why, and the next job or allocation resumes from it and finishes. Two jobs with distinct
run names run side by side; a second job on the same run name fails fast on the trainer's lock.
The two scenarios that wait on a clock (the time limit, the exit-duration budget) submit their jobs from module
fixtures (``limit_job`` with the scancel test's job, ``exit_duration_job`` with the ``scontrol requeue`` test's) and
are checked by the module's last tests, so their clocks run while the other scenarios' jobs run and no single test
waits for a whole clock (nor for more than two job start-ups at once); every job has its own run folder, the jobs share the node
(``--exclusive=user``). A new *job* resuming from a SIGTERM save is checked in the scancel scenario, a *requeued*
job resuming in the requeue and exit-duration scenarios.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.slurm.test_sbatch import (  # noqa: F401  (fixtures)
    _SUBMITTED, ROOT, Job, _cancel_leftover_jobs, _job_env, _read, _tracker, _wait_for, slurm,
)

pytestmark = pytest.mark.slow


def _submit(env: dict, log: str, *opts: str, name: str) -> tuple[Job, str]:
    """Submits train_grpo.sh; returns the Job (over once every requeue is done) and its id."""
    p = Job(["sbatch", "--gpus-per-node=0", f"--job-name={name}", f"--output={log}", *opts,
             os.path.join(ROOT, "slurm", "train_grpo.sh")], env)
    return p, p.job_id


def _finish(p: Job, log: str, timeout: float) -> int:
    """The job's exit code once it is over (not RUNNING, PENDING/REQUEUED or COMPLETING: a signalled job's batch
    script runs on while COMPLETING, within KillWait)."""
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"job did not end in {timeout:.0f} s; log:\n{_read(log)[-4000:]}")


def _job_state(job_id: str, conf: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=dict(os.environ, SLURM_CONF=conf),
                         capture_output=True, text=True).stdout
    m = re.search(r"JobState=(\S+)", out)
    return m.group(1) if m else "?"


def _stop_record(save: str) -> dict:
    with open(os.path.join(save, "tsync_stop.json")) as f:
        return json.load(f)


def _logged_steps(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"^\[tsync\] step (\d+) reward", text, re.M)]


def _assert_clean_save(save: str, step: int, log_text: str):
    """The checkpoint of `step` is complete (tracker names it, its folder has files), nothing half-written is left."""
    assert _tracker(save) == step, log_text[-3000:]
    ckpt = os.path.join(save, f"iter_{step:07d}")
    assert os.path.isdir(ckpt) and os.listdir(ckpt), ckpt
    # half-written checkpoint files; not the rollout plane's heartbeats (rollout_plane/hb/*.PID.tmp): a worker
    # stopped between a heartbeat's write and its rename leaves one, and the next worker writes its own
    partial = [f for f in glob.glob(os.path.join(save, "**", "*.tmp"), recursive=True)
               if os.sep + os.path.join("rollout_plane", "hb") + os.sep not in f]
    assert not partial, partial
    assert f"[tsync] saved checkpoint {ckpt}" in log_text, log_text[-3000:]


def _environ(pid: int) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)


# ------------------------------------------------------------------------------------------------ SIGTERM paths
LONG = dict(TRAIN_ITERS=10_000, SAVE_INTERVAL=1000)
SHARE = "--exclusive=user"  # the scripts' header asks for whole nodes; let this user's jobs share the node
# A job that only has to be training when SLURM's timer or the trainer's budget fires: its worker sends a trajectory
# every 0.5 s (the fault-injection pace, passed through by sbatch's exported environment), so it waits for
# its rollouts as an agentic job does instead of running 0.15 s steps flat out for the minute, on the cores the rest
# of the suite runs on. A signal then lands mid-step, the case that must not lose the last finished step.
IDLING = dict(LONG, TSYNC_FAULT_PACE_S="0.5")


def _sigterm_stop(save: str, out: str) -> int:
    """The stop record of a SIGTERM stop names the last logged step, whose checkpoint is complete."""
    rec = _stop_record(save)
    assert rec["reason"] == "SIGTERM" and rec["finished"] is False, rec
    assert rec["step"] == _logged_steps(out)[-1] >= 1, (rec, _logged_steps(out))  # the last finished step
    _assert_clean_save(save, rec["step"], out)
    return rec["step"]


def _check_passthrough(p: Job, job: str, save: str, log: str) -> None:
    """Once the job trains: the pass-through variables reached its trainer rank."""
    _wait_for(r"\[tsync\] step 1 ", log, p, 300)
    pid = int(open(glob.glob(os.path.join(save, "slurm-jobs", job, "pids", "*.pid"))[0]).read())
    env = _environ(pid)
    assert env.get("HF_HUB_OFFLINE") == "1" and env.get("GLOO_SOCKET_IFNAME") == "lo", sorted(env)


# ------------------------------------------------------------------------------------------------ the early jobs
class _Early:
    """A job submitted by a module fixture before the test that requests it first, checked by its own test at the
    module's end: its clock runs while the tests between run their jobs."""

    def __init__(self, slurm: str, env: dict, log: str, save: str, *opts: str, name: str):
        self.log, self.save, self.t_submit = log, save, time.perf_counter()
        self.p, self.job = _submit(env, log, *opts, SHARE, name=name)
        _SUBMITTED.remove((self.job, slurm))  # not the per-test cleanup's (_cancel_leftover_jobs): the fixture's


@pytest.fixture(scope="module")
def limit_job(slurm, tmp_path_factory):
    """The time-limit job (--time=1: 1 minute, SLURM's minimum, enforced at slurmctld's next 30 s time-limit check, a
    compiled-in period (PERIODIC_TIMEOUT): the job ends 60-90 s after its start; the pre-timeout USR1 switched off
    with @0). Submitted with the module's first job (``sbatch`` returns at once),
    checked by ``test_time_limit_sigterm`` at the module's end; its own run folder, the node shared
    (``--exclusive=user``); cancelled here at the module's end if still there."""
    tmp = tmp_path_factory.mktemp("limit")
    runs = str(tmp / "runs")
    e = _Early(slurm, _job_env(slurm, runs, **IDLING), str(tmp / "timeout.log"), os.path.join(runs, "term-run"), "--time=1", "--signal=B:USR1@0",
               name="term-run")  # RUN_NAME = the job name
    yield e
    e.p.kill()


@pytest.fixture(scope="module")
def exit_duration_job(slurm, tmp_path_factory):
    """The exit-duration self-requeue job (a 45 s budget from the trainer's process start, then SLURM's hold of the
    requeued job: cred_expire + 1 s, then the second allocation's start-up). Its site file ends the second
    allocation's run one step after the checkpoint it resumes from and drops the budget (this check does not need it
    twice). Submitted with the ``scontrol requeue`` test's job, checked by ``test_exit_duration_self_requeue`` at the
    module's end (as ``limit_job``)."""
    tmp = tmp_path_factory.mktemp("self")
    runs = str(tmp / "runs")
    save = os.path.join(runs, "a")
    setup = tmp / "site.sh"
    setup.write_text(f'if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then\n'
                     f'  TRAIN_ITERS=$(( $(cat {save}/latest_checkpointed_iteration.txt) + 1 ))\n'
                     f'  EXIT_DURATION_MINS=\nfi\n')
    e = _Early(slurm, _job_env(slurm, runs, EXIT_DURATION_MINS=0.75, ENV_SETUP=setup, **IDLING), str(tmp / "a.log"),
               save, name="a")
    yield e
    e.p.kill()


# ------------------------------------------------------------------------------------------------ SIGTERM paths
def test_scancel_and_resume(slurm, limit_job, tmp_path):
    """Plain scancel after step 1: SIGTERM to every process, a clean save of the last finished step; a new job on
    the same run name resumes from it and finishes. The pass-through variables given to sbatch (HF_HUB_OFFLINE,
    GLOO_SOCKET_IFNAME) are in the first job's trainer rank's environment. (``limit_job``: the time-limit job starts
    beside it.)"""
    runs = str(tmp_path / "cancel")
    save = os.path.join(runs, "term-run")
    log1, log2 = str(tmp_path / "scancel.log"), str(tmp_path / "next.log")
    p, job = _submit(_job_env(slurm, runs, HF_HUB_OFFLINE=1, GLOO_SOCKET_IFNAME="lo", **LONG), log1, SHARE,
                     name="term-run")
    _check_passthrough(p, job, save, log1)  # once it trains (step 1)
    subprocess.run(["scancel", job], env=_job_env(slurm, runs), check=True)
    _finish(p, log1, 200)
    out = _read(log1)
    assert _job_state(job, slurm) == "CANCELLED", out[-3000:]
    k = _sigterm_stop(save, out)
    p, job = _submit(_job_env(slurm, runs, TRAIN_ITERS=k + 1), log2, SHARE, name="term-run")
    rc = _finish(p, log2, 300)
    out = _read(log2)
    assert rc == 0 and f"[tsync] resumed from {save} at step {k}\n" in out, out[-3000:]
    assert _stop_record(save) == {**_stop_record(save), "finished": True, "reason": "done", "step": k + 1}
    _assert_clean_save(save, k + 1, out)


def test_scontrol_requeue(slurm, exit_duration_job, tmp_path):
    """scontrol requeue: SIGTERM, a clean save, then the same job runs again and resumes from it; the site file
    sourced at each start (ENV_SETUP) ends the run one step after the checkpoint it resumes from.
    (``exit_duration_job``: the exit-duration job starts beside it.)"""
    runs = str(tmp_path / "scontrol")
    save = os.path.join(runs, "term-run")
    setup = tmp_path / "site_requeue.sh"
    setup.write_text("")
    log = str(tmp_path / "requeue.log")
    p, job = _submit(_job_env(slurm, runs, ENV_SETUP=setup, **LONG), log, SHARE, name="term-run")
    _wait_for(r"\[tsync\] step 1 ", log, p, 300)
    setup.write_text(f'TRAIN_ITERS=$(( $(cat {save}/latest_checkpointed_iteration.txt) + 1 ))\n')
    subprocess.run(["scontrol", "requeue", job], env=_job_env(slurm, runs), check=True)
    t_requeue = time.perf_counter()
    _wait_for(r"restart 1;", log, p, 400)
    t_restart = time.perf_counter() - t_requeue
    rc = _finish(p, log, 300)
    out = _read(log)
    first, second = out.split("restart 1;", 1)
    assert rc == 0, out[-3000:]
    k = _logged_steps(first)[-1]
    assert "got SIGTERM" in first and f"stop record {save}/tsync_stop.json: finished False, reason SIGTERM, step {k}" in first
    assert f"[tsync] saved checkpoint {save}/iter_{k:07d}" in first
    assert f"[tsync] resumed from {save} at step {k}\n" in second, second[-3000:]
    rec = _stop_record(save)
    assert rec == {**rec, "finished": True, "reason": "done", "step": k + 1}, rec
    _assert_clean_save(save, k + 1, out)
    assert _job_state(job, slurm) == "COMPLETED"
    print(f"scontrol requeue → restart {t_restart:.0f}s", file=sys.stderr)


# ------------------------------------------------------------------------------------------------ concurrency
def _wait_for_lock(save: str, job: str, p: Job, log: str, timeout: float) -> None:
    """Until the trainer of JOB holds the run lock of SAVE (``SAVE/.tsync.lock`` names its holder once locked)."""
    t_end = time.monotonic() + timeout
    while f'"slurm_job_id": "{job}"' not in _read(os.path.join(save, ".tsync.lock")):
        if p.poll() is not None or time.monotonic() > t_end:
            pytest.fail(f"job {job} did not take the lock of {save}; log:\n{_read(log)[-3000:]}")
        time.sleep(0.2)


def test_concurrent_jobs_and_the_run_lock(slurm, tmp_path):
    """While job A (run 'a') trains: job B on the same run name fails fast on the trainer's lock, naming A, without
    touching A; job C (run 'c') runs beside A and finishes, its per-job files inside its job directory. A is then
    cancelled (its own stop is the SIGTERM test's). C is submitted with A (their start-ups overlap), B as soon as A
    holds its run's lock (A's start-up goes on beside B's: the lock is taken before the model is built)."""
    runs = str(tmp_path / "runs")
    save_a, save_c = os.path.join(runs, "a"), os.path.join(runs, "c")
    share = SHARE
    la, lb, lc = (str(tmp_path / f"{n}.log") for n in "abc")
    pa, ja = _submit(_job_env(slurm, runs, **IDLING), la, share, name="a")
    # C: another run name, beside A
    pc, jc = _submit(_job_env(slurm, runs, TRAIN_ITERS=2), lc, share, name="c")
    _wait_for_lock(save_a, ja, pa, la, 300)
    # B: the same run name while A holds it
    pb, jb = _submit(_job_env(slurm, runs, TRAIN_ITERS=2, RUN_NAME="a"), lb, share, name="b")
    _wait_for(r"\[tsync\] step 1 ", la, pa, 300)
    _wait_for(r"\[tsync\] step 1 ", lc, pc, 300)
    assert _job_state(ja, slurm) == "RUNNING" and pa.poll() is None, _read(la)[-2000:]  # both jobs run at once
    rc_b = _finish(pb, lb, 300)
    out_b = _read(lb)
    assert rc_b != 0 and f"--save {save_a} is in use by another trainer" in out_b, out_b[-3000:]
    assert f'"slurm_job_id": "{ja}"' in out_b, out_b[-3000:]  # the message names the holder
    assert "trainer step failed" in out_b and "[tsync] step 1 " not in out_b
    rc_c = _finish(pc, lc, 400)
    out_c = _read(lc)
    assert rc_c == 0, out_c[-3000:]
    assert _stop_record(save_c)["finished"] is True and _tracker(save_c) == 2
    assert f"rollout workers {save_c}/slurm-jobs/{jc}/rollout_plane/worker_logs" in out_c
    assert not os.path.exists(os.path.join(save_c, "rollout_plane"))  # nothing per job outside the job dir
    assert _job_state(ja, slurm) == "RUNNING", _read(la)[-2000:]  # B's refusal did not touch A
    subprocess.run(["scancel", ja], env=_job_env(slurm, runs), check=True)
    _finish(pa, la, 200)
    out = _read(la)
    assert "in use by another trainer" not in out and sorted(os.listdir(os.path.join(save_a, "slurm-jobs"))) == \
        sorted([ja, jb]), out[-3000:]


# ------------------------------------------------------------------------------------------------ the early jobs' ends
def test_exit_duration_self_requeue(slurm, exit_duration_job):
    """EXIT_DURATION_MINS (``exit_duration_job``): the trainer stops at the first step boundary after the budget, saves, and the
    batch script requeues the job (no resubmit); the second allocation (its site file ends the run one step later
    and drops the budget) resumes and finishes. One job, two allocations, one job directory."""
    e = exit_duration_job
    save_a, ja = e.save, e.job
    rc_a = _finish(e.p, e.log, 500)
    out = _read(e.log)
    assert rc_a == 0, out[-4000:]
    first, second = out.split("restart 1;", 1)
    k = _logged_steps(first)[-1]
    assert k >= 1 and f"stop record {save_a}/tsync_stop.json: finished False, reason exit-duration, step {k}" in first
    assert f"trainer stop: finished=false reason=exit-duration step={k}" in first
    assert f"requeueing job {ja} (restart 1)" in first, first[-3000:]
    assert f"[tsync] resumed from {save_a} at step {k}\n" in second, second[-3000:]
    assert "restart 2;" not in second
    rec = _stop_record(save_a)
    assert rec["finished"] is True and rec["reason"] == "done" and rec["step"] == k + 1, rec
    _assert_clean_save(save_a, k + 1, out)
    assert os.listdir(os.path.join(save_a, "slurm-jobs")) == [ja]  # two allocations: one dir
    assert _job_state(ja, slurm) == "COMPLETED"
    print(f"exit-duration self-requeue: checked {time.perf_counter() - e.t_submit:.0f}s after its submission "
          f"({k} + 1 steps)", file=sys.stderr)


def test_time_limit_sigterm(slurm, limit_job):
    """The time limit (``limit_job``; --time=1, the pre-timeout USR1 switched off with @0): SLURM's SIGTERM, SIGKILL after
    KillWait; the job ends TIMEOUT with a clean save of its last step, not requeued by the batch script."""
    e = limit_job
    _finish(e.p, e.log, 300)
    out = _read(e.log)
    assert _job_state(e.job, slurm) == "TIMEOUT", out[-3000:]
    assert "got SIGTERM" in out and "got SIGUSR1" not in out, out[-3000:]
    _sigterm_stop(e.save, out)
    assert "not requeued by this script" in out
    print(f"time limit: checked {time.perf_counter() - e.t_submit:.0f}s after its submission", file=sys.stderr)
