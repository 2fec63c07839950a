"""Fault injection on live runs: real trainer (``python -m megatron_tsync.train``), real rollout worker processes,
real signed transport; faults are real signals.

- a rollout worker SIGKILLed mid-step, and another SIGSTOPped mid-step (hung), in one run of three workers: every
  step completes with exactly its batch's trajectories (the ledger accounts for each), the run reaches its last step,
  and in float64 each step's gradient equals the synchronous gradient on the trajectories used (replayed from the
  run's own ``--dump-rollouts`` through the sync learner) within 1e-12;
- the trainer SIGKILLed mid-step: no worker process it started is alive 5 s later (``PR_SET_PDEATHSIG``);
- the trainer SIGKILLed while workers on "other nodes" (started by the test, not by the trainer) outlive it: a new
  run with the same ``--secret-file`` on the same endpoint rejects every event of the old run's workers (counted as
  ``wrong_run``) and trains only on its own; the old workers then leave on their own (no trainer heartbeat).

Recovery times (seconds from the signal to the re-dispatch file) are printed (``pytest -s``) and bounded.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.runtime.test_train_e2e import ROOT, _train, tiny_model  # noqa: F401 - the fixture is used by name

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

COMMON = ["--group-size", "2", "--max-turns", "2", "--max-new-tokens", "16", "--seq-length", "128",
          "--rl-mode", "stream-trajectory", "--no-progress"]
EXACT = ["--params-dtype", "float64", "--optimizer", "sgd", "--lr", "0.5", "--clip-grad", "0",
         "--entropy-coef", "0.01"]  # entropy: a gradient even when every reward of a group is equal


def _env(**extra):
    from tests.conftest import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()), **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def _start(args, tmp, log, **env):
    return subprocess.Popen([sys.executable, "-m", "megatron_tsync.train", *args], cwd=tmp, env=_env(**env),
                            stdout=log, stderr=subprocess.STDOUT)


def _beat(plane, w):
    try:
        with open(os.path.join(plane, "hb", f"worker{w}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _wait(pred, timeout_s, what, proc=None, log=None):
    """``pred()``'s first truthy value, looked at every 50 ms, at least once (a budget already spent by a loaded
    machine's slow ``wait`` still gets its one look)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            break
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}) while waiting for {what}:\n{_read(log)[-4000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}:\n{_read(log)[-4000:] if log else ''}")


def _read(path):
    with open(path, errors="replace") as f:
        return f.read()


def _mid_step(plane, w, step):
    """Worker ``w``'s heartbeat once it is rolling out its own share of ``step`` and has sent some of it."""
    b = _beat(plane, w)
    return b if b and b["step"] == step and b["phase"] == "rollout" and b.get("step_sent", 0) >= 1 else None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (dead, not yet reaped by a parent that is gone too) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _assignments(plane, step):
    d = os.path.join(plane, "assign")
    out = []
    for n in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if n.startswith(f"s{step:07d}."):
            with open(os.path.join(d, n)) as f:
                out.append((os.stat(os.path.join(d, n)).st_mtime, json.load(f)))
    return out


def _rel(a, b):
    num = sum(float((a[n] - b[n]).pow(2).sum()) for n in a) ** 0.5
    den = sum(float(a[n].pow(2).sum()) for n in a) ** 0.5
    return num / den, den


def test_killed_and_hung_workers_mid_step(tiny_model, tmp_path):  # noqa: F811
    """Worker 1 SIGKILLed in step 1, worker 2 SIGSTOPped in step 2 (3 workers, 6 groups of 2, 4 steps)."""
    plane, ck, dump, g_live = (str(tmp_path / n) for n in ("plane", "ck", "dump", "g_live"))
    log = str(tmp_path / "train.log")
    args = ["--model", tiny_model, *COMMON, *EXACT, "--global-batch-size", "12", "--rollout-workers", "3",
            "--train-iters", "4", "--rollout-dir", plane, "--save", ck, "--dump-rollouts", dump, "--dump-grads",
            g_live, "--rollout-heartbeat-timeout", "3", "--rollout-retries", "2"]
    with open(log, "w") as out:
        p = _start(args, tmp_path, out, TSYNC_FAULT_PACE_S="0.6")  # events 0.6 s apart: the signals land mid-step
    stopped = None
    try:
        b = _wait(lambda: _mid_step(plane, 1, 1), 600, "worker 1 mid-way through step 1", p, log)
        t_kill = time.time()
        os.kill(b["pid"], signal.SIGKILL)
        b = _wait(lambda: _mid_step(plane, 2, 2), 600, "worker 2 mid-way through step 2", p, log)
        t_stop, stopped = time.time(), b["pid"]
        os.kill(stopped, signal.SIGSTOP)
        assert p.wait(timeout=900) == 0, _read(log)[-5000:]
    finally:
        if p.poll() is None:
            p.kill()
        if stopped is not None and _alive(stopped):
            os.kill(stopped, signal.SIGKILL)
    text = _read(log)
    assert "summary: mode stream-trajectory, 4 steps" in text, text[-3000:]
    assert not _alive(stopped), "the hung worker was not killed by the trainer"

    # the ledger: every step has exactly its 12 trajectories; what was re-dispatched, and why
    hist = {h["step"]: h for h in json.loads((tmp_path / "ck" / "history.json").read_text())}
    assert sorted(hist) == [0, 1, 2, 3] and all(h["ledger_used"] == 12 for h in hist.values()), hist
    assert [hist[k]["worker_failures"] for k in range(4)] == [0, 1, 1, 0]
    assert hist[0]["ledger_redispatched"] == 0 and 1 <= hist[1]["ledger_redispatched"] <= 3  # some were sent
    assert hist[2]["ledger_redispatched"] >= 4 + 1 and hist[3]["ledger_redispatched"] == 8  # dead workers' shares
    line1 = next(ln for ln in text.splitlines() if ln.startswith("[tsync] step 1 ledger:"))
    line2 = next(ln for ln in text.splitlines() if ln.startswith("[tsync] step 2 ledger:"))
    assert line1.startswith("[tsync] step 1 ledger: 12/12 used; ") and "from worker 1 to worker" in line1 \
        and "(exited with code -9)" in line1, line1
    assert "from worker 2 to worker 0" in line2 and "hung" in line2 and "dead since step 1" in line2, line2
    for k in range(4):  # the dump holds the batch: every id once, every trajectory of policy version k
        meta = json.loads((tmp_path / "dump" / f"step_{k:07d}" / "rollouts.json").read_text())
        ids = sorted(t["traj_id"] for t in meta["trajectories"])
        assert ids == sorted(f"s{k}g{g}t{i}" for g in range(6) for i in range(2))
        assert {t["policy_version"] for t in meta["trajectories"]} == {k}
        assert sum(1 for t in meta["trajectories"] if "redo" in t["meta"]) == hist[k]["ledger_redispatched"]

    # recovery: signal → re-dispatch file (the trainer's own figure, last heartbeat → re-dispatch, in the row)
    kill_s = min(m for m, a in _assignments(plane, 1)) - t_kill
    hang_s = min(m for m, a in _assignments(plane, 2) if "hung" in a["reason"]) - t_stop
    print(f"\nrecovery: SIGKILL → re-dispatch {kill_s:.2f}s (row {hist[1]['recovery_s']:.2f}s); "
          f"SIGSTOP → re-dispatch {hang_s:.2f}s (row {hist[2]['recovery_s']:.2f}s, heartbeat timeout 3s)")
    # a hung worker is never declared dead before its heartbeat timeout; how fast each is noticed is printed, not
    # asserted (the machine's load sets it): that the kill was seen by its exit code (-9) and the hang by the
    # heartbeat is asserted from the ledger lines above
    assert kill_s > 0 and hang_s >= 3, (kill_s, hang_s)

    # exactness: the synchronous learner on the trajectories used gives the same gradient, every step
    g_sync = str(tmp_path / "g_sync")
    _train(["--model", tiny_model, *COMMON, *EXACT, "--global-batch-size", "12", "--train-iters", "4",
            "--replay-rollouts", dump, "--rl-mode", "sync", "--dump-grads", g_sync, "--rollout-workers", "0"],
           tmp_path)
    from safetensors.torch import load_file

    worst = 0.0
    for k in range(4):
        a = load_file(os.path.join(g_sync, f"grad_step_{k:07d}.safetensors"))
        b = load_file(os.path.join(g_live, f"grad_step_{k:07d}.safetensors"))
        assert set(a) == set(b)
        rel, den = _rel(a, b)
        assert den > 0 and rel <= 1e-12, (k, rel)
        worst = max(worst, rel)
    # control: the same comparison between two different steps' trajectories is far from 1e-12
    a = load_file(os.path.join(g_sync, "grad_step_0000001.safetensors"))
    b = load_file(os.path.join(g_live, "grad_step_0000002.safetensors"))
    control = _rel(a, b)[0]
    assert control > 1e-3, control
    print(f"float64 live (faults) vs sync replay of the used trajectories: worst relative gradient error {worst:.1e} "
          f"(control, another step's trajectories: {control:.1e})")


def test_past_the_retry_budget_the_step_fails_with_a_checkpoint(tiny_model, tmp_path):  # noqa: F811
    """--rollout-retries 0: the first worker death fails the step, naming the worker and the trajectories not
    received; θ_k is saved at step k, and a resumed run (one worker) redoes step k and finishes."""
    plane, ck, log = str(tmp_path / "plane"), str(tmp_path / "ck"), str(tmp_path / "train.log")
    args = ["--model", tiny_model, *COMMON, "--global-batch-size", "4", "--rollout-workers", "2", "--train-iters", "2",
            "--rollout-dir", plane, "--save", ck, "--rollout-retries", "0"]
    with open(log, "w") as out:
        p = _start(args, tmp_path, out, TSYNC_FAULT_PACE_S="1.5")  # 2 events a step, 1.5 s apart; heartbeat 1 s
    try:
        b = _wait(lambda: _mid_step(plane, 1, 1), 600, "worker 1 mid-way through step 1", p, log)
        os.kill(b["pid"], signal.SIGKILL)
        assert p.wait(timeout=300) != 0
    finally:
        if p.poll() is None:
            p.kill()
    text = _read(log)
    assert "[tsync] step 1 failed: step 1: rollout worker 1 exited with code -9; --rollout-retries 0 spent" in text
    assert "trajectories of the step were not received from it: ['s1g1t" in text, text[-3000:]
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    resume = list(args[:-2])  # without --rollout-retries 0; one worker (not run-defining) is enough to finish
    resume[resume.index("--rollout-workers") + 1] = "1"
    out = _train([*resume, "--load", ck], tmp_path)
    assert "resumed from" in out and "at step 1" in out and "summary: mode stream-trajectory, 1 steps" in out


def test_killed_trainer_takes_its_workers_along(tiny_model, tmp_path):  # noqa: F811
    plane, log = str(tmp_path / "plane"), str(tmp_path / "train.log")
    args = ["--model", tiny_model, *COMMON, "--global-batch-size", "4", "--rollout-workers", "2", "--train-iters",
            "5", "--rollout-dir", plane, "--rollout-heartbeat-timeout", "60"]  # only the parent-death signal acts
    with open(log, "w") as out:
        p = _start(args, tmp_path, out, TSYNC_FAULT_PACE_S="2.0")  # a step lasts >= 4 s: seen by a 1 s heartbeat
    try:
        _wait(lambda: _mid_step(plane, 0, 1) or _mid_step(plane, 0, 2), 600, "worker 0 mid-way through a step", p,
              log)
        pids = [_beat(plane, w)["pid"] for w in (0, 1)]
        assert all(_alive(q) for q in pids)
        t0 = time.monotonic()
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        _wait(lambda: not any(_alive(q) for q in pids), 5 - (time.monotonic() - t0),
              "the workers to die with their trainer", log=log)
        print(f"\nworkers gone {time.monotonic() - t0:.2f}s after the trainer's SIGKILL")
    finally:
        if p.poll() is None:
            p.kill()


def test_new_run_rejects_the_old_runs_workers(tiny_model, tmp_path):  # noqa: F811
    """Old run A: workers started by the test (as srun would on rollout nodes: not the trainer's children), trainer
    SIGKILLed mid-step. New run B: same secret file, same tcp endpoint, its own workers. A's workers keep sending
    to the endpoint; B rejects every one of their frames as wrong_run and trains only on its own trajectories."""
    from tests.conftest import free_port

    secret = str(tmp_path / "secret.hex")
    from megatron_tsync.transport import write_secret_file

    write_secret_file(secret)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    plane_a, plane_b = str(tmp_path / "plane_a"), str(tmp_path / "plane_b")
    log_a, log_b = str(tmp_path / "a.log"), str(tmp_path / "b.log")
    common = ["--model", tiny_model, *COMMON, "--global-batch-size", "4", "--rollout-workers", "2",
              "--secret-file", secret, "--rollout-endpoint", endpoint]
    a_workers = []
    with open(log_a, "w") as out:
        a = _start([*common, "--train-iters", "5", "--rollout-dir", plane_a, "--rollout-launch", "external",
                    "--rollout-heartbeat-timeout", "45"], tmp_path, out)
    try:
        for w in (0, 1):
            a_workers.append(subprocess.Popen(
                [sys.executable, "-m", "megatron_tsync.runtime.worker", os.path.join(plane_a, f"worker{w}.json")],
                cwd=tmp_path, env=_env(TSYNC_FAULT_PACE_S="4.0"), stdout=open(tmp_path / f"a_w{w}.log", "w"),
                stderr=subprocess.STDOUT))
        _wait(lambda: _mid_step(plane_a, 0, 0), 600, "run A's worker 0 mid-way through its first step", a, log_a)
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=30)
        assert all(q.poll() is None for q in a_workers)  # the survivors: nothing told them yet
        with open(log_b, "w") as out:
            b = _start([*common, "--train-iters", "2", "--rollout-dir", plane_b, "--save", str(tmp_path / "ck_b")],
                       tmp_path, out)
        assert b.wait(timeout=900) == 0, _read(log_b)[-5000:]
        hist = json.loads((tmp_path / "ck_b" / "history.json").read_text())
        # B accepted exactly its own 2 x 4 trajectories: nothing of A's, no duplicate dropped
        assert [h["ledger_used"] for h in hist] == [4, 4] and all(h["ledger_dropped"] == 0 for h in hist)
        meta = json.loads((tmp_path / "plane_b" / "worker0.json").read_text())
        wrong = hist[-1]["rejected_wrong_run"]
        events = hist[-1]["wrong_run_events"]  # A's trajectories sent after its trainer died reached B: rejected
        assert events >= 1 and wrong >= events and hist[-1]["rejected_bad_signature"] == 0, hist[-1]
        print(f"\nrun B (run id {meta['run_id']}) rejected {wrong} frames of run A's workers as wrong_run "
              f"({events} trajectory events, the rest their pings)")
        # and A's workers leave by themselves once the trainer's heartbeat is stale (45 s: B has long bound the
        # endpoint and rejected their frames by then)
        for q in a_workers:
            assert q.wait(timeout=300) == 75
        assert "no trainer heartbeat" in _read(tmp_path / "a_w0.log")
    finally:
        for q in [a, *a_workers]:
            if q.poll() is None:
                q.kill()
