"""Stopping, requeueing and concurrent jobs of slurm/train_grpo.sh under a REAL single-node SLURM cluster (CPU mode,
tiny model; tools/slurm_cluster.sh: KillWait=30 s as on most clusters, cred_expire=30 s so a requeued job restarts
~1 min later instead of ~2.5). What SLURM does, not a simulation of it:
  * time limit (``--time=1``, no pre-timeout signal): SIGTERM to every process, SIGKILL 30 s later;
  * plain ``scancel``: the same SIGTERM to every process;
  * ``scontrol requeue``: SIGTERM to every process, then the job (same id) runs again;
  * ``EXIT_DURATION_MINS``: the trainer stops itself at a step boundary and the batch script requeues the job.
Each leaves a complete checkpoint of the last finished step (the last step the job logged), no ``.tmp``, a
``tsync_stop.json`` saying why, and the next job or allocation resumes from it and finishes. Two jobs with distinct
run names run side by side; a second job on the same run name fails fast on the trainer's lock.
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
    ROOT, Job, _cancel_leftover_jobs, _job_env, _read, _tracker, _wait_for, slurm,
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
    assert not glob.glob(os.path.join(save, "**", "*.tmp"), recursive=True), glob.glob(os.path.join(save, "**", "*.tmp"), recursive=True)
    assert f"[tsync] saved checkpoint {ckpt}" in log_text, log_text[-3000:]


def _environ(pid: int) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)


# ------------------------------------------------------------------------------------------------ SIGTERM paths
def test_time_limit_scancel_and_requeue_each_save_and_resume(slurm, tmp_path):
    runs = str(tmp_path / "runs")
    save = os.path.join(runs, "term-run")  # RUN_NAME = the job name
    times = {}
    long = dict(TRAIN_ITERS=10_000, SAVE_INTERVAL=1000, HF_HUB_OFFLINE=1, GLOO_SOCKET_IFNAME="lo")

    # 1. the time limit: SLURM's SIGTERM (the pre-timeout USR1 is switched off with @0), SIGKILL after KillWait
    log1 = str(tmp_path / "timeout.log")
    t0 = time.perf_counter()
    p, job = _submit(_job_env(slurm, runs, **long), log1, "--time=1", "--signal=B:USR1@0", name="term-run")
    _wait_for(r"\[tsync\] step 1 ", log1, p, 300)
    pid = int(open(glob.glob(os.path.join(save, "slurm-jobs", job, "pids", "*.pid"))[0]).read())
    env = _environ(pid)  # the trainer rank got the pass-through variables
    assert env.get("HF_HUB_OFFLINE") == "1" and env.get("GLOO_SOCKET_IFNAME") == "lo", sorted(env)
    _finish(p, log1, 300)
    times["time limit"] = time.perf_counter() - t0
    out = _read(log1)
    assert _job_state(job, slurm) == "TIMEOUT", out[-3000:]
    assert "got SIGTERM" in out and "got SIGUSR1" not in out, out[-3000:]
    rec = _stop_record(save)
    assert rec["reason"] == "SIGTERM" and rec["finished"] is False, rec
    assert rec["step"] == _logged_steps(out)[-1] >= 1, (rec, _logged_steps(out))  # the last finished step
    _assert_clean_save(save, rec["step"], out)
    assert "not requeued by this script" in out
    k1 = rec["step"]

    # 2. plain scancel: SIGTERM to every process; the job resumes from the time-limit save first
    log2 = str(tmp_path / "scancel.log")
    t0 = time.perf_counter()
    p, job = _submit(_job_env(slurm, runs, **long), log2, name="term-run")
    _wait_for(rf"\[tsync\] resumed from {re.escape(save)} at step {k1}\b", log2, p, 300)
    _wait_for(rf"\[tsync\] step {k1 + 1} ", log2, p, 300)
    subprocess.run(["scancel", job], env=_job_env(slurm, runs), check=True)
    _finish(p, log2, 200)
    times["scancel"] = time.perf_counter() - t0
    out = _read(log2)
    assert _job_state(job, slurm) == "CANCELLED", out[-3000:]
    rec = _stop_record(save)
    assert rec["reason"] == "SIGTERM" and rec["finished"] is False, rec
    assert rec["step"] == _logged_steps(out)[-1] > k1, (rec, _logged_steps(out))
    _assert_clean_save(save, rec["step"], out)
    k2 = rec["step"]

    # 3. scontrol requeue: SIGTERM, the same job runs again; the site file sourced at each start (ENV_SETUP) ends
    #    the run one step after the checkpoint it resumes from
    setup = tmp_path / "site.sh"
    setup.write_text("")
    log3 = str(tmp_path / "requeue.log")
    t0 = time.perf_counter()
    p, job = _submit(_job_env(slurm, runs, ENV_SETUP=setup, **long), log3, name="term-run")
    _wait_for(rf"\[tsync\] resumed from {re.escape(save)} at step {k2}\b", log3, p, 300)
    _wait_for(rf"\[tsync\] step {k2 + 1} ", log3, p, 300)
    setup.write_text(f'TRAIN_ITERS=$(( $(cat {save}/latest_checkpointed_iteration.txt) + 1 ))\n')
    subprocess.run(["scontrol", "requeue", job], env=_job_env(slurm, runs), check=True)
    _wait_for(r"restart 1;", log3, p, 400)
    times["requeue: signal → restart"] = time.perf_counter() - t0
    rc = _finish(p, log3, 300)
    times["requeue total"] = time.perf_counter() - t0
    out = _read(log3)
    first, second = out.split("restart 1;", 1)
    assert rc == 0, out[-3000:]
    k3 = _logged_steps(first)[-1]
    assert "got SIGTERM" in first and f"stop record {save}/tsync_stop.json: finished False, reason SIGTERM, step {k3}" in first
    assert f"[tsync] saved checkpoint {save}/iter_{k3:07d}" in first
    assert f"[tsync] resumed from {save} at step {k3}\n" in second, second[-3000:]
    rec = _stop_record(save)
    assert rec == {**rec, "finished": True, "reason": "done", "step": k3 + 1}, rec
    _assert_clean_save(save, k3 + 1, out)
    assert _job_state(job, slurm) == "COMPLETED"
    print("SIGTERM paths: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()), file=sys.stderr)


# ------------------------------------------------------------------------------------------------ self-requeue, concurrency
def test_exit_duration_self_requeue_beside_concurrent_jobs(slurm, tmp_path):
    """Job A (run 'a', EXIT_DURATION_MINS=1.5): the trainer stops at a step boundary after 1.5 min, saves, and the batch
    script requeues the job (no resubmit); the second allocation (its site file ends the run one step later)
    finishes. During A's first allocation: job B on the same run name fails fast on the trainer's lock, naming A,
    without touching A; job C (run 'c') runs beside A and finishes."""
    runs = str(tmp_path / "runs")
    save_a, save_c = os.path.join(runs, "a"), os.path.join(runs, "c")
    setup = tmp_path / "site.sh"
    setup.write_text(f'if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then\n'
                     f'  TRAIN_ITERS=$(( $(cat {save_a}/latest_checkpointed_iteration.txt) + 1 ))\nfi\n')
    share = "--exclusive=user"  # the scripts' header asks for whole nodes; let this user's jobs share the node
    la, lb, lc = (str(tmp_path / f"{n}.log") for n in "abc")
    t0 = time.perf_counter()
    pa, ja = _submit(_job_env(slurm, runs, TRAIN_ITERS=10_000, SAVE_INTERVAL=1000, EXIT_DURATION_MINS=1.5,
                              ENV_SETUP=setup), la, share, name="a")
    _wait_for(r"\[tsync\] step 1 ", la, pa, 300)
    # B: the same run name while A holds it
    pb, jb = _submit(_job_env(slurm, runs, TRAIN_ITERS=2, RUN_NAME="a"), lb, share, name="b")
    rc_b = _finish(pb, lb, 300)
    t_b = time.perf_counter() - t0
    out_b = _read(lb)
    assert rc_b != 0 and f"--save {save_a} is in use by another trainer" in out_b, out_b[-3000:]
    assert f'"slurm_job_id": "{ja}"' in out_b, out_b[-3000:]  # the message names the holder
    assert "trainer step failed" in out_b and "[tsync] step 1 " not in out_b
    # C: another run name, beside A
    pc, jc = _submit(_job_env(slurm, runs, TRAIN_ITERS=2), lc, share, name="c")
    t_end = time.monotonic() + 120
    while _job_state(jc, slurm) != "RUNNING" and time.monotonic() < t_end:
        time.sleep(0.5)
    assert _job_state(jc, slurm) == "RUNNING" and _job_state(ja, slurm) == "RUNNING", _read(la)[-2000:]
    assert "requeueing" not in _read(la)  # both jobs run at once
    rc_c = _finish(pc, lc, 400)
    out_c = _read(lc)
    assert rc_c == 0, out_c[-3000:]
    assert _stop_record(save_c)["finished"] is True and _tracker(save_c) == 2
    assert f"rollout workers {save_c}/slurm-jobs/{jc}/rollout_plane/worker_logs" in out_c
    assert not os.path.exists(os.path.join(save_c, "rollout_plane"))  # nothing per job outside the job dir
    # A: two allocations, one job
    rc_a = _finish(pa, la, 500)
    elapsed = time.perf_counter() - t0
    out = _read(la)
    assert rc_a == 0, out[-4000:]
    first, second = out.split("restart 1;", 1)
    k = _logged_steps(first)[-1]
    assert k >= 1 and f"stop record {save_a}/tsync_stop.json: finished False, reason exit-duration, step {k}" in first
    assert f"trainer stop: finished=false reason=exit-duration step={k}" in first
    assert f"requeueing job {ja} (restart 1)" in first, first[-3000:]
    assert f"[tsync] resumed from {save_a} at step {k}\n" in second, second[-3000:]
    assert "restart 2;" not in second and "in use by another trainer" not in out
    rec = _stop_record(save_a)
    assert rec["finished"] is True and rec["reason"] == "done" and rec["step"] == k + 1, rec
    _assert_clean_save(save_a, k + 1, out)
    assert sorted(os.listdir(os.path.join(save_a, "slurm-jobs"))) == sorted([ja, jb])  # A's two allocations: one dir
    assert _job_state(ja, slurm) == "COMPLETED"
    print(f"exit-duration self-requeue: {elapsed:.0f}s over 2 allocations ({k} + 1 steps); lock refusal after "
          f"{t_b:.0f}s", file=sys.stderr)
