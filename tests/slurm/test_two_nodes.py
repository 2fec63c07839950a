"""slurm/train_grpo.sh on a REAL 2-node SLURM cluster on one machine (``tools/slurm_cluster.sh up --nodes 2``: nodes
tsn1/tsn2 on 127.0.0.2/127.0.0.3, each slurmd in its own UTS namespace), CPU mode (gloo, embedded engine, tiny model):
  * trainer on tsn1, 2 rollout workers on tsn2 (``ROLLOUT_NODES=1``, a job step of their own, tcp events): one
    worker SIGKILLed there mid-run is declared dead by the trainer within the heartbeat deadline, its trajectories
    re-dispatched to the other, training goes on; then a USR1 stop saves;
  * a 2-node torchrun trainer (one rank per node, gloo across the nodes) stops cleanly on USR1 and on SIGTERM.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import time

import pytest

from tests.slurm.test_sbatch import (  # noqa: F401  (fixtures)
    KILLWAIT, _cancel_leftover_jobs, _job_env, _read, _tracker, _wait_for, slurm_lock,
)
from tests.slurm.test_stop_requeue import IDLING, _assert_clean_save, _finish, _job_state, _logged_steps, _stop_record, _submit

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "tools", "slurm_cluster.sh")
# its own state dir and ports: it runs beside the 1-node cluster of the other SLURM tests
CLUSTER_2N_ENV = {"TSYNC_SLURM_DIR": os.environ.get("TSYNC_SLURM_2N_DIR", "/tmp/tsync-slurm-2n"),
                  "TSYNC_SLURMCTLD_PORT": "6837", "TSYNC_SLURMD_PORT": "6838",
                  "TSYNC_SLURMD_NICE": "-5", "TSYNC_SLURM_KILLWAIT": KILLWAIT}  # as the 1-node cluster's


@pytest.fixture(scope="module")
def slurm2():
    """SLURM_CONF of a running 2-node cluster (its own state dir and ports, beside the 1-node one)."""
    with slurm_lock():
        yield from _slurm2_cluster()


def _slurm2_cluster():
    env = dict(os.environ, **CLUSTER_2N_ENV)
    was_up = subprocess.run(["bash", CLUSTER, "status"], env=env, capture_output=True).returncode == 0
    if not was_up and os.geteuid() != 0:
        pytest.skip("standing up a SLURM cluster needs root")
    p = subprocess.run(["bash", CLUSTER, "up", "--nodes", "2"], env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0 and "apt-get" in p.stderr:
        pytest.skip(f"SLURM could not be installed: {p.stderr.strip()[-500:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    conf = re.search(r"export SLURM_CONF=(\S+)", p.stdout).group(1)
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], env=dict(env, SLURM_CONF=conf), capture_output=True,
                           text=True).stdout.split()
    assert sorted(nodes) == ["tsn1", "tsn2"], nodes
    yield conf
    if not was_up:
        subprocess.run(["bash", CLUSTER, "down"], env=env, capture_output=True, timeout=120)


def _worker_pid(spec: str) -> int:
    """The PID of the rollout worker process started on SPEC (its command line names it)."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"megatron_tsync.runtime.worker" in argv and spec.encode() in argv:
            return int(d)
    raise AssertionError(f"no worker process for {spec}")


def _uts_host(pid: int) -> str:
    """The hostname a process sees (its UTS namespace's): the node it runs on."""
    out = subprocess.run(["nsenter", "-t", str(pid), "-u", "hostname"], capture_output=True, text=True)
    return out.stdout.strip()


def test_rollout_node_worker_killed_is_redispatched(slurm2, tmp_path):
    runs = str(tmp_path / "runs")
    save = os.path.join(runs, "two-node")
    log = str(tmp_path / "job.log")
    hb = 10.0
    t0 = time.perf_counter()
    p, job = _submit(_job_env(slurm2, runs, **IDLING, ROLLOUT_NODES=1,
                              ROLLOUT_WORKERS=2, EXTRA_ARGS=f"--rollout-heartbeat-timeout {hb:g}"),
                     log, "--nodes=2", name="two-node")
    _wait_for(r"\[tsync\] step 3 ", log, p, 300)
    out = _read(log)
    assert f"job {job} on tsn1 tsn2 (head tsn1)" in out and "rollout: 2 worker(s), engine embedded, on tsn2" in out
    assert re.search(r"--rollout-endpoint tcp://127\.0\.0\.2:\d+", out), out[-3000:]
    plane = os.path.join(save, "slurm-jobs", job, "rollout_plane")
    logs = {w: _read(os.path.join(plane, "worker_logs", f"worker{w}.log")) for w in (0, 1)}
    for w in (0, 1):
        assert f"rollout worker {w} on tsn2" in logs[w], logs[w][-2000:]
    pid = _worker_pid(os.path.join(plane, "worker1.json"))
    assert _uts_host(pid) == "tsn2"
    trainer_pid = int(open(glob.glob(os.path.join(save, "slurm-jobs", job, "pids", "tsn1.*.pid"))[0]).read())
    assert _uts_host(trainer_pid) == "tsn1"
    steps_before = _logged_steps(_read(log))[-1]
    os.kill(pid, 9)
    t_kill = time.perf_counter()
    m = _wait_for(r"rollout worker 1 (sent no heartbeat for ([\d.]+)s[^\n]*) during step (\d+)", log, p, 120)
    t_detect = time.perf_counter() - t_kill  # printed, not asserted: the machine's load sets it
    assert float(m.group(2)) >= hb, m.group(0)  # declared dead by its heartbeat, never before the timeout
    k = int(m.group(3))
    _wait_for(rf"\[tsync\] step {k} ledger: [^\n]*re-dispatched from worker 1 to worker 0", log, p, 60)
    _wait_for(rf"\[tsync\] step {k + 3} ", log, p, 120)  # training goes on with worker 0 alone
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=_job_env(slurm2, runs), check=True)
    rc = _finish(p, log, 300)
    out = _read(log)
    assert rc == 0, out[-4000:]
    assert "WorkerFailure" not in out and "trainer step failed" not in out
    rec = _stop_record(save)
    assert rec["reason"] == "SIGUSR1" and rec["step"] == _logged_steps(out)[-1] > steps_before, rec
    _assert_clean_save(save, rec["step"], out)
    print(f"2 nodes, rollout node: worker killed → declared dead in {t_detect:.1f}s (heartbeat timeout {hb:g}s), "
          f"job {time.perf_counter() - t0:.0f}s", file=sys.stderr)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> str:
    """The run folder of the 2-node torchrun run: the TERM test's job resumes from the USR1 test's save."""
    return str(tmp_path_factory.mktemp("ddp") / "runs")


def _two_node_torchrun_stop(slurm2, runs: str, tmp_path, sig: str, cancel: list[str]) -> None:
    """A 2-node torchrun trainer (resuming from the run's last save, if any) trains 2 steps, then `scancel CANCEL`:
    a clean save of the last finished step, the stop record names SIG."""
    save = os.path.join(runs, "ddp")
    log = str(tmp_path / f"{sig}.log")
    t0 = time.perf_counter()
    p, job = _submit(_job_env(slurm2, runs, **IDLING, TRAINER_NODES=2), log, "--nodes=2", name="ddp")
    first = _tracker(save) if os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt")) else 0
    _wait_for(rf"\[tsync\] step {first + 2} ", log, p, 300)
    out = _read(log)
    assert "trainer: 2 node(s) × 1 rank(s)" in out and "master tsn1:" in out, out[-3000:]
    assert "world size 2" in out, out[-3000:]
    pids = glob.glob(os.path.join(save, "slurm-jobs", job, "pids", "*.pid"))
    assert sorted(os.path.basename(f).split(".")[0] for f in pids) == ["tsn1", "tsn2"], pids
    subprocess.run(["scancel", *cancel, job], env=_job_env(slurm2, runs), check=True)
    rc = _finish(p, log, 300)
    out = _read(log)
    rec = _stop_record(save)
    assert rec["reason"] == f"SIG{sig}" and rec["finished"] is False, (rec, out[-3000:])
    assert rec["step"] == _logged_steps(out)[-1] > first, (rec, _logged_steps(out)[-3:])
    _assert_clean_save(save, rec["step"], out)
    if sig == "USR1":
        assert rc == 0, out[-3000:]
    else:
        assert _job_state(job, slurm2) == "CANCELLED"
        assert "trainer exited with code 0" in out, out[-3000:]
        assert "has expired" not in out  # no signal-forwarding job step tried in an ending job
    print(f"2-node torchrun: {sig} job {time.perf_counter() - t0:.0f}s (from step {first})", file=sys.stderr)


def test_two_node_torchrun_stops_on_usr1(slurm2, ddp_runs, tmp_path):
    _two_node_torchrun_stop(slurm2, ddp_runs, tmp_path, "USR1", ["--signal=USR1", "--batch"])


def test_two_node_torchrun_stops_on_term(slurm2, ddp_runs, tmp_path):
    """After the USR1 test (it resumes from that save when there is one; a run from scratch otherwise)."""
    _two_node_torchrun_stop(slurm2, ddp_runs, tmp_path, "TERM", [])
