"""runtime/supervision.py: heartbeats both ways, the parent-death signal, signed re-dispatch files, the ledger."""

import json
import os
import subprocess
import sys
import time

import pytest

from megatron_tsync.runtime import supervision as sv
from tests.conftest import until as _until

pytestmark = pytest.mark.timeout(120)
RUN, OTHER = "0123456789abcdef", "fedcba9876543210"


def test_beat_age_is_the_readers_clock(tmp_path) -> None:
    path = str(tmp_path / "hb" / "w.json")
    r = sv.BeatReader(path)
    assert r.read() is None and r.age() is None
    w = sv.BeatWriter(path, RUN, 0.05, payload=lambda: {"step": 3}).start()
    first = r.read()  # start() wrote the first beat
    assert first["run_id"] == RUN and first["step"] == 3
    since = time.monotonic()
    assert _until(lambda: r.read()["beat"] > first["beat"])  # the writer keeps beating
    age = r.age()
    # the age restarted when the reader saw the new content (after `since`), not when it first saw the file
    assert age <= time.monotonic() - since
    w.stop(closed=True)
    assert r.read()["closed"] is True
    time.sleep(0.3)
    assert r.age() >= 0.3  # content unchanged: ages, whatever the file's mtime says
    os.utime(path)  # touching the file is not a beat (control: staleness is about the counter, not mtime)
    assert r.age() >= 0.3


class _Clock:
    """Stands in for the ``time`` module inside supervision.py: its monotonic clock only moves when a test moves it,
    so verdicts that depend on how long something took are decided by the test, not by the machine's load."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


def test_trainer_watch_verdicts(tmp_path, monkeypatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(sv, "time", clock)
    path = str(tmp_path / "trainer.json")
    watch = sv.TrainerWatch(path, RUN, timeout_s=0.3, first_wait_s=0.2)
    assert watch.verdict() is None  # absent, within the first wait
    clock.now += 0.25
    assert "no trainer heartbeat at" in watch.verdict()
    sv.write_json_atomic(path, {"run_id": RUN, "beat": 1})
    assert watch.verdict() is None
    clock.now += 0.29
    assert watch.verdict() is None  # stale, but not yet for the timeout
    clock.now += 0.11
    assert "no trainer heartbeat for 0.4s" in watch.verdict()
    sv.write_json_atomic(path, {"run_id": RUN, "beat": 2, "closed": True})
    assert watch.verdict() is None and watch.closed
    clock.now += 0.4
    assert watch.verdict() is None  # a closed trainer is not a dead one
    sv.write_json_atomic(path, {"run_id": OTHER, "beat": 1})
    assert f"now belongs to run {OTHER}" in watch.verdict()


@pytest.mark.parametrize("beat, code, says", [
    ({"beat": 1}, 75, "the trainer is gone"),  # the heartbeat stops changing: the trainer is dead
    ({"beat": 1, "closed": True}, 0, "the trainer closed: leaving"),  # closed: leave now, mid-step or not
], ids=["stale", "closed"])
def test_trainer_watch_ends_the_process(tmp_path, beat, code, says) -> None:
    """A real process with a watch (its main thread busy for an hour, as a worker mid-step) is ended by it: exit 75
    once the trainer's heartbeat is stale, exit 0 once it says the trainer closed."""
    path = str(tmp_path / "trainer.json")
    sv.write_json_atomic(path, {"run_id": RUN, **beat})
    prog = ("import time; from megatron_tsync.runtime import supervision as sv; "
            f"sv.TrainerWatch({path!r}, {RUN!r}, 0.5).start(); time.sleep(3600)")
    # the watch's exit code and reason: the watch ended it (left alone it sleeps an hour); the 60 s timeout only
    # catches a watch that never fires
    p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60)
    assert p.returncode == code and says in p.stderr, p.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux-only")
@pytest.mark.parametrize("pdeathsig", [True, False], ids=["pdeathsig", "control-without"])
def test_parent_death_signal_kills_the_child(tmp_path, pdeathsig) -> None:
    """A parent starts a child (which sets PR_SET_PDEATHSIG or not) and is SIGKILLed: the child dies with it;
    the control without the call shows the child would otherwise outlive its parent."""
    pidfile, survived = tmp_path / "child.pid", tmp_path / "survived"
    call = "sv.set_parent_death_signal(int(os.environ['PP']))" if pdeathsig else "pass"
    # once its parent is gone (it was re-parented), a child still alive says so in `survived`
    child = ("import os, sys, time; from megatron_tsync.runtime import supervision as sv; "
             f"{call}; open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
             "while os.getppid() == int(os.environ['PP']): time.sleep(0.01)\n"
             f"open({str(survived)!r}, 'w').close(); time.sleep(60)")
    parent = (f"import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}], "
              "env=dict(os.environ, PP=str(os.getpid()))); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", parent])
    try:
        assert _until(lambda: pidfile.exists() and pidfile.read_text(), timeout_s=60)
        pid = int(pidfile.read_text())
        p.kill()
        p.wait()
        if pdeathsig:  # the kernel sent it SIGKILL as the parent died; it goes (asynchronously)
            assert _until(lambda: not _alive(pid))
        else:  # control: it saw its parent gone and lived on
            assert _until(lambda: survived.exists()) and _alive(pid)
    finally:
        if pidfile.exists() and pidfile.read_text() and _alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), 9)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_assignments_are_signed_by_the_run(tmp_path) -> None:
    key, other_key = b"k" * 32, b"o" * 32
    d = str(tmp_path)
    sv.write_assignment(d, key, run_id=RUN, step=2, worker=1, n=0, version=2, traj_ids=["s2g1t0"], reason="r")
    sv.write_assignment(d, key, run_id=RUN, step=3, worker=1, n=1, version=3, traj_ids=["s3g1t1"], reason="r")
    sv.write_assignment(d, key, run_id=RUN, step=2, worker=0, n=2, version=2, traj_ids=["s2g3t0"], reason="r")
    sv.write_assignment(d, other_key, run_id=OTHER, step=2, worker=1, n=3, version=2, traj_ids=["s2g5t0"],
                        reason="another run's")
    path = sv.write_assignment(d, key, run_id=RUN, step=2, worker=1, n=4, version=2, traj_ids=["s2g7t0"], reason="r")
    data = json.load(open(path))
    data["traj_ids"] = ["s2g9t9"]  # tampered: the tag no longer verifies
    json.dump(data, open(path, "w"))
    done: set[str] = set()
    got = sv.read_assignments(d, key, run_id=RUN, worker=1, done=done, max_step=2)
    assert [a["traj_ids"] for a in got] == [["s2g1t0"]]  # not step 3, not worker 0, not the forged or other run's
    assert sv.read_assignments(d, key, run_id=RUN, worker=1, done=done, max_step=2) == []  # each read once
    assert [a["traj_ids"] for a in sv.read_assignments(d, key, run_id=RUN, worker=1, done=done, max_step=3)] == \
        [["s3g1t1"]]


def test_ledger_row_and_line() -> None:
    led = sv.StepLedger(1, ["s1g0t0", "s1g0t1", "s1g1t0", "s1g1t1"])
    led.used += ["s1g0t0", "s1g1t0", "s1g1t1"]
    assert led.missing() == ["s1g0t1"]
    led.redispatched["s1g0t1"] = (1, 0, "exited with code -9")
    led.dropped.append(("s1g0t1", "duplicate (from worker 1)"))
    led.failures.append({"worker": 1, "redispatch_s": 0.7})
    led.used.append("s1g0t1")
    assert led.row() == {"ledger_used": 4, "ledger_redispatched": 1, "ledger_dropped": 1, "worker_failures": 1,
                         "recovery_s": 0.7}
    assert led.line() == ("[tsync] step 1 ledger: 4/4 used; 1 re-dispatched from worker 1 to worker 0 (exited with "
                          "code -9): s1g0t1; 1 dropped: s1g0t1 (duplicate (from worker 1))")


def _supervisor(tmp_path, procs, retries=2):
    return sv.WorkerSupervisor(num_workers=2, groups_per_step=2, group_size=2, run_dir=str(tmp_path), run_id=RUN,
                               key=b"k" * 32, timeout_s=5.0, retries=retries, procs=procs,
                               log_tail=lambda w: f"(log of {w})")


@pytest.mark.parametrize("streamed", [False, True], ids=["redispatched", "turns-streamed-refused"])
def test_a_trajectory_with_streamed_turns_is_not_redispatched(tmp_path, streamed) -> None:
    """OPD stream-turn: a new sample cannot continue another sample's turns, so a lost trajectory whose turns were
    already streamed fails the step (naming it) instead of being re-dispatched; the control re-dispatches."""
    procs = [subprocess.Popen([sys.executable, "-c", "pass"]),
             subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]
    try:
        procs[0].wait(30)
        sup = _supervisor(tmp_path, procs)
        led = sv.StepLedger(0, [f"s0g{g}t{i}" for g in (0, 1) for i in (0, 1)])
        sup.begin(0, led, lambda gid: 0)
        if streamed:
            with pytest.raises(sv.WorkerFailure, match=r"rollout worker 0 exited with code 0; \['s0g0t1'\] had turns "
                                                       r"streamed already"):
                sup.check({"s0g0t0"}, {"s0g0t1"})
        else:
            sup.check({"s0g0t0"}, set())
            assert led.redispatched == {"s0g0t1": (0, 1, "exited with code 0")}
            got = sv.read_assignments(str(tmp_path), b"k" * 32, run_id=RUN, worker=1, done=set(), max_step=0)
            assert [a["traj_ids"] for a in got] == [["s0g0t1"]]
    finally:
        procs[1].kill()
        procs[1].wait()
