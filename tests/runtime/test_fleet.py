"""The learner side of the rollout plane without rollouts: specs, the version window, TransportSource, failures.

A fleet opened with ``--rollout-launch external`` starts no worker; a test plays the worker with an EventSender."""

import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

from megatron_tsync.arguments import parse_args
from megatron_tsync.runtime.fleet import WorkerDied, open_fleet, sv_key
from megatron_tsync.runtime.worker import WorkerSpec
from megatron_tsync.transport import EventSender, TrajectoryEvent, load_secret

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def plane():
    d = tempfile.mkdtemp(prefix="tsync-fleet-", dir="/tmp")  # ipc:// paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _fleet(plane, *flags, start_step=0, reward_floor=-1.0):
    cfg = parse_args(["--group-size", "2", "--groups-per-step", "2", "--rollout-workers", "2",
                      "--rollout-launch", "external", "--rollout-dir", plane, *flags])
    return cfg, open_fleet(cfg, model_dir="/models/m", start_step=start_step, reward_floor=reward_floor)


def _traj(tid, version, reward=1.0, status="ok"):
    gid = tid.rpartition("t")[0]
    ok = status == "ok"
    mask = np.array([0, 0, 1, 1] if ok else [0, 0, 0, 0], np.uint8)
    return TrajectoryEvent(traj_id=tid, group_id=gid, group_size=2, policy_version=version,
                           token_ids=np.array([3, 4, 5, 6], np.int32), prompt_len=2, loss_mask=mask,
                           logprobs=np.where(mask == 1, -0.5, 0).astype(np.float32), reward=reward,
                           turn_spans=[(2, 4)], status=status, error="" if ok else "sandbox crashed")


def _sender(fleet, name="worker0"):
    """A worker's sender of this fleet's run (its key is the run's: ``secret.run_key``)."""
    return EventSender(fleet.receiver.endpoint, load_secret(path=fleet.spec.secret_file), name,
                       run_id=fleet.spec.run_id)


def _drain(source, tx, timeout_s=10.0):
    """Polls the source (and services the sender, in this same thread) until every event sent was processed."""
    out, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out += source.poll(0.05)
        tx.pump(0.01)
        if tx.in_flight == 0:
            return out
    raise AssertionError(f"{tx.in_flight} events never processed")


def test_specs_carry_the_config_sections(plane) -> None:
    cfg, fleet = _fleet(plane, "--reward-kind", "bounded", "--reward-range", "0", "1", "--max-turns", "3", "--max-new-tokens", "8", "--seq-length", "64", "--top-p", "0.5",
                        "--temperature", "0.8", "--latency-profile", "uniform", start_step=3)
    try:
        specs = [WorkerSpec.from_json(os.path.join(plane, f"worker{w}.json")) for w in (0, 1)]
    finally:
        fleet.close()
    assert [s.worker_id for s in specs] == [0, 1]
    for s in specs:
        assert s.rl == cfg.rl and s.rollout == cfg.rollout  # the config itself: nothing copied by hand, nothing drifts
        assert (s.start_step, s.model_dir, s.engine_dtype, s.stream_turns) == (3, "/models/m", "float32", False)
        assert s.endpoint == f"ipc://{plane}/events.sock" and os.path.isdir(s.weights_dir)
        assert s.run_reward_spec() == cfg.learner.reward_spec  # a harness's own reward is checked against it


def test_the_fleet_owns_the_version_window(plane) -> None:
    _, fleet = _fleet(plane, start_step=1)
    try:
        assert fleet.receiver._expected_version_fn == fleet.versions.accepted
        assert fleet.versions.accepted() == 1
        fleet.publish({"w": torch.zeros(2)}, 2)
        fleet.begin_step(2)
        assert fleet.versions.accepted() == 2
    finally:
        fleet.close()
    _, fleet = _fleet(plane, "--rl-mode", "async", "--max-staleness", "2")
    try:
        fleet.begin_step(3)
        assert fleet.versions.accepted() == range(1, 4)
    finally:
        fleet.close()


def test_transport_source_takes_one_step_of_trajectories(plane) -> None:
    _, fleet = _fleet(plane, reward_floor=-1.0)
    try:
        fleet.begin_step(0)
        src = fleet.source(0, max_seq_len=64)
        assert src.expected == {"s0g0t0", "s0g0t1", "s0g1t0", "s0g1t1"}
        with _sender(fleet) as tx:
            for ev in (_traj("s0g0t0", 0, reward=1.0),
                       _traj("s0g0t1", 0, reward=0.5, status="error"),  # failed: counts with the learner's floor
                       _traj("s1g0t0", 0),  # another step's id: dropped
                       _traj("s0g1t0", 1),  # another policy version: rejected by the receiver, counted
                       _traj("s0g0t0", 0)):  # a duplicate id: dropped
                tx.send(ev, timeout_s=5)
            got = _drain(src, tx)
            assert [(s.traj_id, s.reward) for s in got] == [("s0g0t0", 1.0), ("s0g0t1", -1.0)]
            assert float(got[1].loss_mask.sum()) == 0 and src.errors == 1 and not src.exhausted()
            assert fleet.receiver.stats["wrong_version"] == 1
            for tid in ("s0g1t0", "s0g1t1"):
                tx.send(_traj(tid, 0), timeout_s=5)
            got += _drain(src, tx)
        assert src.exhausted() and [s.traj_id for s in src.samples] == [s.traj_id for s in got]
    finally:
        fleet.close()


def test_stall_timeout_comes_from_the_config(plane) -> None:
    _, fleet = _fleet(plane, "--rollout-stall-timeout", "0.3")
    try:
        src = fleet.source(0, max_seq_len=64)
        assert src.stall_timeout_s == 0.3
        with pytest.raises(TimeoutError, match=r"step 0: no trajectory for 0s; 4 missing, e.g. \['s0g0t0'"):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                src.poll(0.05)
    finally:
        fleet.close()


def test_a_dead_worker_is_named_with_its_log(plane) -> None:
    """Past the retry budget: the worker's id, exit code, log tail and the trajectories of the step not received."""
    _, fleet = _fleet(plane, "--rollout-retries", "0")
    try:
        with open(os.path.join(fleet.log_dir, "worker1.log"), "w") as f:
            f.write("loading weights\nRuntimeError: out of memory\n")
        fleet.procs += [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
                        subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])]
        fleet.procs[1].wait(30)
        src = fleet.source(0, max_seq_len=64)
        with pytest.raises(WorkerDied, match=r"(?s)step 0: rollout worker 1 exited with code 3; --rollout-retries 0 "
                                             r"spent \(1 worker failures\)\. 2 trajectories of the step were not "
                                             r"received from it: \['s0g1t0', 's0g1t1'\].*out of memory") as e:
            src.poll(0.05)
        assert (e.value.worker, e.value.step, e.value.missing) == (1, 0, ["s0g1t0", "s0g1t1"])
    finally:
        fleet.close()


def _beats(fleet, workers, interval=0.05):
    from megatron_tsync.runtime import supervision as sv

    return {w: sv.BeatWriter(os.path.join(fleet.run_dir, "hb", f"worker{w}.json"), fleet.spec.run_id, interval,
                             payload=lambda: {"step": 0}).start() for w in workers}


def test_a_hung_worker_is_redispatched_and_the_step_completes(plane) -> None:
    """Two played workers beat; worker 1 delivers one of its group's two trajectories, then falls silent. After the
    heartbeat deadline its missing one is re-dispatched to worker 0 (a signed file under the run's key, same policy
    version); worker 0 delivers it and the step completes with exactly its 4 trajectories; the ledger says so."""
    from megatron_tsync.runtime import supervision as sv

    _, fleet = _fleet(plane, "--rollout-heartbeat-timeout", "0.5")
    beats = _beats(fleet, (0, 1))
    try:
        fleet.begin_step(0)
        src = fleet.source(0, max_seq_len=64)
        with _sender(fleet, "worker0") as w0, _sender(fleet, "worker1") as w1:
            for tid in ("s0g0t0", "s0g0t1"):
                w0.send(_traj(tid, 0), timeout_s=5)
            w1.send(_traj("s0g1t0", 0), timeout_s=5)
            got = _drain(src, w0) + _drain(src, w1)
            beats[1].stop()  # hung: no more heartbeats
            deadline = time.monotonic() + 60
            while not src.ledger.failures and time.monotonic() < deadline:
                got += src.poll(0.05)
            assert src.ledger.failures and src.ledger.failures[0]["worker"] == 1
            # declared hung for its stale heartbeat, and only once the last beat was over 0.5 s old: on the fleet's
            # clock, and by the fleet's detection time against the time the worker wrote into that beat (wall
            # clocks, which may run a little off the monotonic one: 10 ms of slack)
            fail = src.ledger.failures[0]
            assert "hung" in fail["why"] and fail["last_beat_age_s"] > 0.5, fail
            assert fail["t_detect"] - fail["last_beat_time"] > 0.49, fail
            key = sv_key(load_secret(path=fleet.spec.secret_file), fleet.spec.run_id)
            todo = sv.read_assignments(plane, key, run_id=fleet.spec.run_id, worker=0, done=set(), max_step=0)
            assert [(a["traj_ids"], a["version"]) for a in todo] == [(["s0g1t1"], 0)]
            assert sv.read_assignments(plane, load_secret(path=fleet.spec.secret_file), run_id=fleet.spec.run_id,
                                       worker=0, done=set(), max_step=0) == []  # control: the bare secret won't do
            w0.send(_traj("s0g1t1", 0), timeout_s=5)
            got += _drain(src, w0)
        assert src.exhausted() and sorted(s.traj_id for s in got) == sorted(src.expected)
        assert fleet.ledgers[0].row() == {"ledger_used": 4, "ledger_redispatched": 1, "ledger_dropped": 0,
                                          "worker_failures": 1,
                                          "recovery_s": pytest.approx(fleet.ledgers[0].row()["recovery_s"])}
        assert fleet.ledgers[0].row()["recovery_s"] >= 0.5  # from the last beat to the re-dispatch
        assert fleet.ledgers[0].redispatched == {"s0g1t1": (1, 0, src.ledger.failures[0]["why"])}
        # the next step: the dead worker's whole share goes to worker 0 as the step begins
        fleet.begin_step(1)
        src1 = fleet.source(1, max_seq_len=64)
        assert sorted(fleet.ledgers[1].redispatched) == ["s1g1t0", "s1g1t1"]
        todo = sv.read_assignments(plane, key, run_id=fleet.spec.run_id, worker=0, done=set(), max_step=1)
        assert [a["traj_ids"] for a in todo if a["step"] == 1] == [["s1g1t0", "s1g1t1"]] and src1 is not None
    finally:
        for b in beats.values():
            b.stop()
        fleet.close()


def test_a_late_event_of_a_redispatched_trajectory_is_a_counted_duplicate(plane) -> None:
    _, fleet = _fleet(plane, "--rollout-heartbeat-timeout", "0.5")
    beats = _beats(fleet, (0, 1))
    try:
        src = fleet.source(0, max_seq_len=64)
        with _sender(fleet, "worker0") as w0:
            for tid in ("s0g0t0", "s0g0t1", "s0g1t0", "s0g1t1", "s0g1t1"):
                w0.send(_traj(tid, 0), timeout_s=5)
            _drain(src, w0)
        assert src.exhausted() and src.ledger.dropped == [("s0g1t1", "duplicate (from worker ?)")]
        assert fleet.ledgers[0].row()["ledger_dropped"] == 1
    finally:
        for b in beats.values():
            b.stop()
        fleet.close()


def test_async_early_trajectories_wait_for_their_step(plane) -> None:
    """--rl-mode async: a worker may finish step k+1's rollouts (with weights v_k) while step k trains; they are
    kept for step k+1 instead of being dropped (which left step k+1 short until the stall timeout)."""
    _, fleet = _fleet(plane, "--rl-mode", "async", "--max-staleness", "1")
    try:
        fleet.begin_step(0)
        src0 = fleet.source(0, max_seq_len=64)
        with _sender(fleet) as tx:
            for tid in ("s0g0t0", "s1g0t0", "s0g0t1", "s0g1t0", "s0g1t1", "s2g1t0"):
                tx.send(_traj(tid, 0), timeout_s=5)
            got = _drain(src0, tx)
        assert sorted(s.traj_id for s in got) == sorted(src0.expected) and src0.exhausted()
        # step 2 is more than --max-staleness 1 ahead: its window at step 2 is [1, 2], no v_k sampled now (k <= 0)
        # can be in it, so it is dropped at once and counted (issue 31: park only what the run can still use)
        assert {k: [e.traj_id for e in v] for k, v in fleet.early.items()} == {1: ["s1g0t0"]}
        assert fleet.receiver.stats["far_future"] == 1
        fleet.begin_step(1)  # window [0, 1]: v0 still accepted
        src1 = fleet.source(1, max_seq_len=64)
        assert [(s.traj_id, s.policy_version) for s in src1.poll(5.0)] == [("s1g0t0", 0)]  # at once, no wait
        with _sender(fleet) as tx:  # step 2's, sampled with v0 while step 1 trains: parked (1 step ahead) ...
            tx.send(_traj("s2g0t0", 0), timeout_s=5)
            _drain(src1, tx)
        assert {k: [e.traj_id for e in v] for k, v in fleet.early.items()} == {2: ["s2g0t0"]}
        fleet.begin_step(2)  # ... but step 2's window is [1, 2]: v0 is too stale by now, dropped and counted
        src2 = fleet.source(2, max_seq_len=64)
        assert src2._early == [] and fleet.early == {} and fleet.early_bytes == 0
        assert fleet.receiver.stats["wrong_version"] == 1
    finally:
        fleet.close()


def test_ipc_endpoint_short_for_a_long_run_directory(tmp_path):
    """A run directory whose events.sock path is too long for a unix socket gets a socket in the temporary
    directory (stable per run directory); a short one keeps its own; a real receiver binds and a sender connects."""
    import zmq

    from megatron_tsync.runtime.fleet import _IPC_PATH_MAX, ipc_endpoint

    short_dir = tmp_path / "rp"
    assert ipc_endpoint(str(short_dir)) == f"ipc://{short_dir}/events.sock"
    long_dir = tmp_path / ("x" * 120) / "rollout_plane"
    ep = ipc_endpoint(str(long_dir))
    assert ep.startswith("ipc://") and len(ep[len("ipc://"):].encode()) <= _IPC_PATH_MAX
    assert ep == ipc_endpoint(str(long_dir)) and ep != ipc_endpoint(str(tmp_path / ("y" * 120)))
    ctx = zmq.Context()
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(ep)
        push.connect(ep)
        push.send(b"hi")
        assert pull.poll(5000) and pull.recv() == b"hi"
        # control: the long path itself cannot be bound
        bad = ctx.socket(zmq.PULL)
        long_dir.mkdir(parents=True)
        with pytest.raises(zmq.ZMQError):
            bad.bind(f"ipc://{long_dir}/events.sock")
    finally:
        ctx.destroy(linger=0)


def test_failed_trajectories_are_named_by_kind_and_logged_once_per_kind(plane, caplog) -> None:
    """A failed trajectory's kind lands in ``meta["fail_kind"]`` (signal health counts them); the log has one line per
    kind per step, not one per trajectory; a worker cannot mark an ok trajectory failed."""
    import logging

    _, fleet = _fleet(plane, "--group-size", "3")
    try:
        fleet.begin_step(0)
        src = fleet.source(0, max_seq_len=64)
        evs = [_traj(f"s0g{g}t{i}", 0, status="error") for g in (0, 1) for i in range(3)]
        for ev in evs[:2]:
            ev.meta = {"harness_fail": "harness_crash"}
        evs[2].error = "verifier failed: ValueError: x"
        ok = _traj("s0g1t0", 0)
        ok.meta = {"fail_kind": "harness_crash"}  # an ok trajectory whose worker claims a failure kind
        evs[3] = ok
        for ev in evs:
            ev.group_size = 3
        with caplog.at_level(logging.WARNING, logger="megatron_tsync"), _sender(fleet) as tx:
            for ev in evs:
                tx.send(ev, timeout_s=5)
            got = _drain(src, tx)
        kinds = {s.traj_id: s.meta.get("fail_kind") for s in got}
        assert kinds == {"s0g0t0": "harness_crash", "s0g0t1": "harness_crash", "s0g0t2": "verifier_error",
                         "s0g1t0": None, "s0g1t1": "rollout_error", "s0g1t2": "rollout_error"}
        lines = [r.getMessage() for r in caplog.records if "failed (" in r.getMessage()]
        assert len(lines) == 3 and all("counted, not logged" in ln for ln in lines), lines
    finally:
        fleet.close()
