"""Stopping a run (``runtime/stop.py``) with real trainers, real signals and real rollout workers:

- a job-wide SIGTERM (``killpg``, what SLURM sends on time-out / ``scancel``) mid-step of a live run: the step in
  flight is aborted, the last finished step is saved (complete, verified), the workers and the checkpoint writer
  survive the signal (no -15), the stop record says SIGTERM / not finished, no ``.tmp`` is left, and the run resumes
  from it and finishes;
- two trainer ranks (torchrun), SIGUSR1 or SIGTERM to rank 1 only: both stop after the same step (the
  agreement), exit 0;
- ``--exit-duration-in-mins``: the run stops by itself once the budget is spent, saves, says so, and resumes;
- the worker entry ignores the job's signals and scrubs the launcher's task variables (control: a plain process
  dies of the same SIGTERM).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.runtime.test_faults import _beat, _read, _wait
from tests.runtime.test_train_e2e import _synthetic_dump, _train, tiny_model  # noqa: F401 - fixture used by name

COMMON = ["--group-size", "2", "--max-turns", "2", "--max-new-tokens", "16", "--seq-length", "128",
          "--rl-mode", "stream-trajectory", "--no-progress"]
REPLAY = ["--group-size", "4", "--global-batch-size", "12", "--seq-length", "64", "--no-progress", "--rl-mode", "sync"]
SLURM_TASK = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "11", "PMI_RANK": "0",
              "SLURM_JOB_ID": "4242"}


def _env(**extra):
    from tests.conftest import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()), **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def _environ(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)


def _ignored(pid):
    """The signals a process ignores (``SigIgn`` of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(line.split()[1] for line in f if line.startswith("SigIgn:")), 16)
    return {s for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT) if mask >> (s - 1) & 1}


def _stop_record(ck):
    with open(os.path.join(ck, "tsync_stop.json")) as f:
        return json.load(f)


def _tmp_left(ck):
    return [os.path.join(r, d) for r, ds, _ in os.walk(ck) for d in ds if d.endswith(".tmp")]


@pytest.fixture(scope="module")
def long_dump(tiny_model, tmp_path_factory):  # noqa: F811
    d = str(tmp_path_factory.mktemp("dump") / "dump")
    _synthetic_dump(d, tiny_model, steps=400)
    return d


def test_stop_flag_keeps_the_most_urgent_reason_and_aborts_only_when_allowed(tmp_path):
    from megatron_tsync.runtime.stop import StopAgreement, StopFlag, StopRequested, write_stop_file

    f = StopFlag(install=False)
    assert f.local_code() == 0 and StopAgreement(1).decide(f) == ""
    f._handler(signal.SIGUSR1, None)
    f.check_abort()  # graceful: never aborts
    f._handler(signal.SIGTERM, None)
    f._handler(signal.SIGUSR1, None)
    assert f.reason == "SIGTERM" and f.urgent and StopAgreement(1).decide(f) == "SIGTERM"
    f.check_abort()  # not abortable (several ranks): the step finishes
    f.abortable = True
    with pytest.raises(StopRequested):
        f.check_abort()
    assert StopFlag(1e-6, install=False).local_code() == 1  # the budget spent since this process started
    assert StopFlag(60.0, install=False).local_code() == 0
    write_stop_file(str(tmp_path), finished=False, reason="SIGTERM", step=3)
    assert _stop_record(str(tmp_path)) | {"time": 0} == {"finished": False, "reason": "SIGTERM", "step": 3, "time": 0}
    assert os.listdir(tmp_path) == ["tsync_stop.json"]  # the temporary name is gone


def test_worker_entry_ignores_job_signals_and_scrubs_the_launcher(tmp_path):
    """``python -m megatron_tsync.runtime.worker`` (as srun starts it on a rollout node, before its spec exists):
    SIGTERM / SIGUSR1 / SIGINT ignored. Control: a plain process dies of the same SIGTERM."""
    env = _env(TSYNC_SPEC_WAIT="60")
    w = subprocess.Popen([sys.executable, "-m", "megatron_tsync.runtime.worker", str(tmp_path / "worker0.json")],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ctl = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        _wait(lambda: _ignored(w.pid) == {signal.SIGTERM, signal.SIGUSR1, signal.SIGINT}, 60, "the worker's SIG_IGN")
        for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            w.send_signal(s)
        ctl.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert w.poll() is None, w.stdout.read().decode()[-2000:]
        assert ctl.wait(timeout=10) == -signal.SIGTERM  # control: the same signal kills an unshielded process
    finally:
        for p in (w, ctl):
            if p.poll() is None:
                p.kill()
            p.wait()


def test_worker_entry_scrubs_the_launcher_task_variables():
    """``main`` scrubs ``os.environ`` before anything else (here it then stops at the usage check): what it and its
    children see. (/proc/PID/environ shows a process's initial environment only, hence this form.)"""
    code = ("import os, sys; from megatron_tsync.runtime.worker import main; sys.argv = ['worker']; rc = main(); "
            "print(rc, sorted(k for k in os.environ if k.startswith(('SLURM_', 'PMI', 'LOCAL_', 'MASTER_'))))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=_env(**SLURM_TASK, LOCAL_WORLD_SIZE="4", PMIX_RANK="2", SLURM_STEP_NODELIST="n1"))
    assert p.stdout.split("\n")[-2] == "2 ['SLURM_JOB_ID']", p.stdout + p.stderr  # the job's identity stays


@pytest.mark.slow
def test_sigterm_mid_step_saves_the_last_finished_step_and_resumes(tiny_model, tmp_path):  # noqa: F811
    """Live run (2 embedded-engine workers, --save-interval 2, so megatron's checkpoint-writer helper process exists
    before the signal): killpg(SIGTERM) while a step k >= 3 is in flight (the first one the test sees a worker
    mid-way through: the run is long enough that one is always seen, whatever the machine's speed). The resume
    (one worker: the worker count is not run-defining) finishes step k."""
    ck, plane, log = (str(tmp_path / n) for n in ("ck", "plane", "train.log"))
    args = ["--model", tiny_model, *COMMON, "--global-batch-size", "4", "--rollout-workers", "2", "--train-iters",
            "1000", "--save", ck, "--save-interval", "2", "--rollout-dir", plane, "--rollout-gpus", "5,6"]
    with open(log, "w") as out:  # its own session: the signal goes to the trainer and everything it started
        p = subprocess.Popen([sys.executable, "-m", "megatron_tsync.train", *args], cwd=tmp_path, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True,
                             env=_env(TSYNC_FAULT_PACE_S="0.6", **SLURM_TASK))
    try:
        def mid_step():
            for w in (0, 1):
                b = _beat(plane, w)
                if b and b["step"] >= 3 and b["phase"] == "rollout" and b.get("step_sent", 0) >= 1:
                    return b
            return None

        k = _wait(mid_step, 600, "a worker mid-way through step 3 or later", p, log)["step"]
        for w, gpu in ((0, "5"), (1, "6")):  # --rollout-gpus and the scrub, as each worker process sees them
            seen = _environ(_beat(plane, w)["pid"])
            assert seen.get("CUDA_VISIBLE_DEVICES") == gpu
            assert not {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID", "PMI_RANK", "MASTER_PORT"} & set(seen)
        os.killpg(p.pid, signal.SIGTERM)
        assert p.wait(timeout=120) == 0, _read(log)[-4000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = _read(log)
    assert f"step {k} aborted (SIGTERM" in text, text[-3000:]
    closed = re.search(r"rollout workers closed: (.*)", text)[1]
    assert "failed" not in closed, closed  # every worker outlived the save (exited 0, or stopped after the grace)
    assert _stop_record(ck) | {"time": 0} == {"finished": False, "reason": "SIGTERM", "step": k, "time": 0}
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(k)
    from megatron_tsync.training.ckpt_integrity import verify

    assert verify(os.path.join(ck, f"iter_{k:07d}")), "the SIGTERM save is complete (checksummed)"
    assert _tmp_left(ck) == []
    out = _train(["--model", tiny_model, *COMMON, "--global-batch-size", "4", "--rollout-workers", "1",
                  "--train-iters", str(k + 1), "--load", ck, "--save", ck, "--rollout-dir", plane], tmp_path)
    assert "resumed from" in out and f"at step {k}" in out
    assert _stop_record(ck)["finished"] is True and _stop_record(ck)["step"] == k + 1


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["usr1", "term"])
def test_two_ranks_stop_at_the_same_step_when_one_gets_the_signal(tiny_model, long_dump, tmp_path, sig):  # noqa: F811
    """TP=2 under torchrun, replaying 80 steps; the signal to rank 1 only (SIGTERM too: with two ranks the step in
    flight finishes). Without the agreement rank 1 would leave the loop alone and rank 0 would wait for it in the
    next step's collectives (a hang, then a timeout failure): both ranks exiting 0 after the same saved step is what
    the all-reduce of the stop flag buys."""
    name = signal.Signals(sig).name
    ck, log = str(tmp_path / "ck"), str(tmp_path / "train.log")
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                              "--standalone", "-m", "megatron_tsync.train", "--model", tiny_model,
                              "--tensor-model-parallel-size", "2", "--replay-rollouts", long_dump, *REPLAY,
                              "--train-iters", "80", "--save", ck], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                             env=_env())
    try:
        _wait(lambda: "[tsync] step 3 " in _read(log), 300, "step 3", p, log)
        import psutil

        ranks = {int(_environ(c.pid).get("RANK", -1)): c.pid for c in psutil.Process(p.pid).children()}
        os.kill(ranks[1], sig)
        assert p.wait(timeout=300) == 0, _read(log)[-4000:]
    finally:
        if p.poll() is None:
            p.kill()
    text = _read(log)
    rec = _stop_record(ck)
    assert rec["reason"] == name and rec["finished"] is False and 3 <= rec["step"] < 80, rec
    assert f"stopping before step {rec['step']} ({name})" in text and "aborted" not in text
    assert text.count(f"signal {name}:") == 1  # only rank 1 got it
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == rec["step"]


@pytest.mark.slow
def test_exit_duration_stops_saves_and_resumes(tiny_model, long_dump, tmp_path):  # noqa: F811
    """--exit-duration-in-mins 0.25 on a 400-step replay (about 30 s of steps): the run stops by itself at a step
    boundary after >= 15 s, with a checkpoint of that step and a stop record saying so; a resume finishes."""
    ck = str(tmp_path / "ck")
    t0 = time.time()
    out = _train(["--model", tiny_model, "--replay-rollouts", long_dump, *REPLAY, "--train-iters", "400", "--save", ck,
                  "--exit-duration-in-mins", "0.25"], tmp_path)
    took = time.time() - t0
    rec = _stop_record(ck)
    assert rec["reason"] == "exit-duration" and rec["finished"] is False and rec["step"] < 400, (rec, took)
    assert took >= 14.0, took  # the budget is spent first (process start times have 1 s resolution)
    assert f"stopping before step {rec['step']} (exit-duration)" in out
    if rec["step"] > 0:
        with open(os.path.join(ck, "latest_checkpointed_iteration.txt")) as f:
            assert int(f.read()) == rec["step"]
    out = _train(["--model", tiny_model, "--replay-rollouts", long_dump, *REPLAY, "--train-iters", str(rec["step"] + 2),
                  "--load", ck, "--save", ck, "--exit-duration-in-mins", "30"], tmp_path)
    assert _stop_record(ck) | {"time": 0} == {"finished": True, "reason": "done", "step": rec["step"] + 2, "time": 0}
