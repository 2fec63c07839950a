"""The learner's edge (runtime/validation.py) on a real fleet and receiver; a test plays the workers.

Every hostile event here is correctly signed with the run's key: out-of-vocabulary token ids, an over-long trajectory,
NaN in a field, a wrong group — each is rejected, counted under its reason, never reaches the learner, and the step
still completes (the rejected trajectory counts as failed once every other one is in; a valid event for the same id
still wins)."""

import json
import os
import shutil
import tempfile
import time

import msgpack
import numpy as np
import pytest

from megatron_tsync.arguments import parse_args
from megatron_tsync.runtime.fleet import open_fleet
from megatron_tsync.runtime.validation import EdgeValidator, check_tokenizer_fits, model_vocab_size, rejection_row
from megatron_tsync.transport import EventSender, TrajectoryEvent, load_secret
from megatron_tsync.transport.codec import _seal

pytestmark = pytest.mark.timeout(120)

VOCAB = 100


@pytest.fixture
def plane():
    d = tempfile.mkdtemp(prefix="tsync-edge-", dir="/tmp")  # ipc:// paths must stay short
    model = os.path.join(d, "model")
    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as f:  # what the edge reads of --model: vocab_size
        json.dump({"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 8, "intermediate_size": 16,
                   "num_hidden_layers": 1, "num_attention_heads": 2}, f)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _fleet(plane):
    cfg = parse_args(["--group-size", "2", "--groups-per-step", "2", "--rollout-workers", "1", "--seq-length", "8", "--max-new-tokens", "4",
                      "--rollout-launch", "external", "--rollout-dir", os.path.join(plane, "rp")])
    fleet = open_fleet(cfg, model_dir=os.path.join(plane, "model"), start_step=0, reward_floor=-1.0)
    fleet.begin_step(0)
    return fleet


def _sender(fleet):
    """A worker of this run: the run's secret and run id (the fleet's receiver rejects other runs' events)."""
    kw = {"run_id": fleet.spec.run_id} if getattr(fleet.spec, "run_id", None) else {}
    return EventSender(fleet.receiver.endpoint, load_secret(path=fleet.spec.secret_file), "worker0", **kw)


def _traj(tid, *, ids=(3, 4, 5, 6), reward=1.0, group=None, group_size=2, meta=None):
    n = len(ids)
    mask = np.array([0, 0] + [1] * (n - 2), np.uint8)
    return TrajectoryEvent(traj_id=tid, group_id=group or tid.rpartition("t")[0], group_size=group_size,
                           policy_version=0, token_ids=np.array(ids, np.int32), prompt_len=2, loss_mask=mask,
                           logprobs=np.where(mask == 1, -0.5, 0).astype(np.float32), reward=reward,
                           turn_spans=[(2, n)], meta=meta or {})


def _drain(source, tx, timeout_s=30.0):
    out, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out += source.poll(0.05)
        tx.pump(0.01)
        if tx.in_flight == 0:
            return out + source.poll(0.05)
    raise AssertionError(f"{tx.in_flight} events never processed")


def test_hostile_signed_events_are_rejected_counted_and_the_step_completes(plane) -> None:
    fleet = _fleet(plane)
    try:
        src = fleet.source(0, max_seq_len=8)
        with _sender(fleet) as tx:
            bad = [_traj("s0g0t0", ids=(3, 4, VOCAB, 6)),  # one id past the vocabulary: crashed the executor
                   _traj("s0g0t1", ids=tuple(range(3, 12))),  # 9 tokens > --seq-length 8
                   _traj("s0g1t0", group="s0g0"),  # a group id that is not the trajectory's
                   _traj("s0g1t1", group_size=3)]  # a group size that is not --group-size
            for ev in bad:
                tx.send(ev, timeout_s=5)
            got = _drain(src, tx)
        st = fleet.receiver.stats
        assert (st["out_of_vocab"], st["too_long"], st["bad_group"]) == (1, 1, 2)
        assert fleet.receiver.rejected == 4 and rejection_row(fleet)["rejected_out_of_vocab"] == 1
        # every trajectory of the step is accounted: failed stand-ins, the learner's floor reward, no gradient
        assert src.exhausted() and sorted(s.traj_id for s in got) == sorted(src.expected)
        assert all(s.reward == -1.0 and float(s.loss_mask.sum()) == 0 for s in got)
        assert all(int(s.token_ids.max()) < VOCAB for s in got) and src.errors == 4
    finally:
        fleet.close()


def test_a_valid_event_after_a_rejected_one_with_its_id_still_counts(plane) -> None:
    fleet = _fleet(plane)
    try:
        src = fleet.source(0, max_seq_len=8)
        with _sender(fleet) as tx:
            tx.send(_traj("s0g0t0", ids=(3, 4, 500, 6)), timeout_s=5)  # rejected first ...
            for tid in ("s0g0t1", "s0g1t0"):
                tx.send(_traj(tid), timeout_s=5)
            got = _drain(src, tx)
            assert not src.exhausted() and len(got) == 2  # s0g1t1 is still due: no stand-in yet
            # ... then the valid one for the same id, while the step is still open (sent in its own round trip: once
            # s0g1t1 is in, the rejected id's stand-in is due at once, and a later event for it is a duplicate)
            tx.send(_traj("s0g0t0", reward=0.0), timeout_s=5)
            got += _drain(src, tx)
            assert not src.exhausted() and len(got) == 3
            tx.send(_traj("s0g1t1"), timeout_s=5)
            got += _drain(src, tx)
        assert src.exhausted() and src.errors == 0 and fleet.receiver.stats["out_of_vocab"] == 1
        assert {s.traj_id: s.reward for s in got}["s0g0t0"] == 0.0  # the valid event, not a -1.0 stand-in
    finally:
        fleet.close()


@pytest.mark.parametrize("field,reason", [("reward", "non_finite"), ("meta", "non_finite"),
                                          ("logprobs", "bad_logprob"), ("logprobs_low", "bad_logprob")])
def test_nan_in_a_signed_event_is_rejected_counted_and_accounted(plane, field, reason) -> None:
    """NaN fails the codec's schema check (reason non_finite; in a log-prob bad_logprob, as a finite -1e4 behaviour
    log-prob does: below schema.LOGPROB_FLOOR); the receiver names the authentic trajectory to the edge, which
    accounts it once the others are in. Control: the same frames without NaN are delivered."""
    fleet = _fleet(plane)
    try:
        src = fleet.source(0, max_seq_len=8)
        wire = _traj("s0g0t0", meta={"latency_s": 1.5}).to_wire()
        if field == "reward":
            wire["reward"] = float("nan")
        elif field == "meta":
            wire["meta"] = {"latency_s": float("nan")}
        else:
            bad = np.nan if field == "logprobs" else -1e4
            wire["logprobs"] = ["<f4", 4, np.array([0, 0, bad, -0.5], np.float32).tobytes()]
        with _sender(fleet) as tx:  # the raw frame signed with the run's key, on the sender's connection
            tx._sock.send(_seal(1, msgpack.packb(wire, use_bin_type=True), tx._key, sender_id=tx.sender_id, seq=1 << 20,
                                epoch=tx.epoch, policy_version=0))
            for tid in ("s0g0t1", "s0g1t0", "s0g1t1"):
                tx.send(_traj(tid), timeout_s=5)
            got = _drain(src, tx)
            deadline = time.monotonic() + 5
            while not src.exhausted() and time.monotonic() < deadline:
                got += src.poll(0.05)
        assert fleet.receiver.stats[reason] == 1 and fleet.receiver.stats["accepted"] == 3
        assert rejection_row(fleet)[f"rejected_{reason}"] == 1
        assert src.exhausted() and {s.traj_id: s.reward for s in got}["s0g0t0"] == -1.0
        numbers = [v for s in got for v in (s.meta or {}).values() if not isinstance(v, str)]  # fail_kind is a name
        assert np.isfinite(numbers or [0.0]).all()
    finally:
        fleet.close()


def test_the_edge_checks_turn_events_too() -> None:
    from megatron_tsync.transport import TurnEvent

    def turn():
        mask = np.array([0] * 4 + [1] * 4, np.uint8)
        return TurnEvent(traj_id="s0g0t0", group_id="s0g0", policy_version=0, turn=0, start=4, end=8,
                         token_ids=np.arange(8, dtype=np.int32), loss_mask=mask,
                         logprobs=np.where(mask == 1, -0.5, 0).astype(np.float32))

    v = EdgeValidator(vocab_size=8, max_seq_len=8, group_size=2)
    assert v.check(turn()) is None  # control
    ev = turn()
    ev.token_ids[5] = 8
    assert v.check(ev).reason == "out_of_vocab"
    assert EdgeValidator(vocab_size=None, max_seq_len=7, group_size=2).check(turn()).reason == "too_long"


def test_model_vocab_size_reads_config(plane) -> None:
    assert model_vocab_size(os.path.join(plane, "model")) == VOCAB
    assert model_vocab_size(plane) is None


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"), seed=0, hidden=64, layers=1, heads=2,
                           kv_heads=1)


def _shrink_vocab(model, dst, vocab):
    shutil.copytree(model, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["vocab_size"] = vocab
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_a_tokenizer_larger_than_the_model_is_refused_naming_both_sizes(tiny_model, tmp_path) -> None:
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(tiny_model))
    check_tokenizer_fits(tiny_model, model_vocab_size(tiny_model))  # control: the tiny model's own tokenizer fits
    small = _shrink_vocab(tiny_model, str(tmp_path / "small"), n - 8)
    with pytest.raises(ValueError, match=rf"tokenizer has {n} tokens \(ids up to {n - 1}\) but the model's "
                                         rf"vocabulary has {n - 8}"):
        check_tokenizer_fits(small, model_vocab_size(small))


def test_the_trainer_refuses_the_mismatch_at_start_up(tiny_model, tmp_path) -> None:
    """``python -m megatron_tsync.train`` stops before building anything with a message naming both sizes."""
    import subprocess
    import sys

    from megatron.core import parallel_state  # noqa: F401  (only to fail early if megatron is missing)

    from tests.conftest import free_port

    small = _shrink_vocab(tiny_model, str(tmp_path / "small"), 64)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, "-m", "megatron_tsync.train", "--model", small, "--train-iters", "1",
                        "--no-progress"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    # pre-flight reads tokenizer.json and config.json before torch.distributed or the model: one line, exit 2
    assert p.returncode == 2 and p.stderr.startswith("[tsync] error: "), p.stderr[-3000:]
    assert "but the model's vocabulary has 64 (config.json vocab_size)" in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]


FLOOD = 500


def _inject(rdir: str, stop, log: list) -> None:
    """Plays a hostile worker of the live run in ``rdir``: correctly signed (the run's key, and its run id when the
    spec carries one) step-0 events that break one rule each, a NaN frame, an oversize frame, an off-spec reward and
    a flood of far-future step ids."""
    import zmq

    path = os.path.join(rdir, "worker0.json")
    while not os.path.exists(path) and not stop.is_set():
        time.sleep(0.05)
    with open(path) as f:
        spec = json.load(f)
    key, run_id = load_secret(path=spec["secret_file"]), spec.get("run_id")
    kw = {"run_id": run_id} if run_id else {}
    with EventSender(spec["endpoint"], key, "intruder", **kw) as tx:
        tx.send(_traj("s0g0t0", ids=(3, 4, 600, 6)), timeout_s=60)  # vocab 512
        tx.send(_traj("s0g0t1", ids=tuple(range(3, 3 + 129))), timeout_s=60)  # --seq-length 128
        wire = _traj("s0g1t0").to_wire()
        wire["meta"] = {"latency_s": float("nan")}
        tx._sock.send(_seal(1, msgpack.packb(wire, use_bin_type=True), tx._key, sender_id=tx.sender_id, seq=1 << 20,
                            epoch=tx.epoch, policy_version=0))
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(spec["endpoint"])
        raw.send(b"\0" * (70 << 20))  # > the receiver's 64 MiB limit
        tx.send(_traj("s0g0t0", reward=0.5), timeout_s=60)  # binary reward spec: off-spec
        for k in range(FLOOD):  # far-future step ids: counted, not parked
            tx.send(_traj(f"s{5 + k}g0t0"), timeout_s=60)
        tx.flush(timeout_s=60)
        time.sleep(1.0)
        raw.close()
    log.append("sent")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_live_run_survives_hostile_signed_events(tiny_model, tmp_path) -> None:
    """A live run (real workers, real transport) with an intruder holding the run's key: every hostile event is
    rejected and counted by reason in the log rows, the run finishes its steps, and (the real workers' events for the
    same ids being valid) no trajectory is lost."""
    import subprocess
    import sys
    import threading

    from megatron_tsync.transport import write_secret_file
    from tests.conftest import free_port

    secret, rdir, ck = str(tmp_path / "secret.hex"), str(tmp_path / "plane"), tmp_path / "ck"
    write_secret_file(secret)
    stop, log = threading.Event(), []
    t = threading.Thread(target=_inject, args=(rdir, stop, log), daemon=True)
    t.start()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    try:
        p = subprocess.run([sys.executable, "-m", "megatron_tsync.train", "--model", tiny_model, "--group-size", "2",
                            "--global-batch-size", "4", "--rollout-workers", "1", "--max-turns", "2",
                            "--max-new-tokens", "16", "--seq-length", "128", "--train-iters", "2",
                            "--rollout-dir", rdir, "--secret-file", secret,
                            "--rollout-endpoint", f"tcp://127.0.0.1:{free_port()}", "--save", str(ck),
                            "--tensorboard-dir", str(tmp_path / "tb"), "--no-progress"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=800)
    finally:
        stop.set()
        t.join(timeout=30)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert "summary: mode stream-trajectory, 2 steps" in p.stdout and log == ["sent"]
    last = json.loads((ck / "history.json").read_text())[-1]
    assert (last["rejected_out_of_vocab"], last["rejected_too_long"], last["rejected_non_finite"],
            last["rejected_oversize"], last["rejected_bad_reward"]) == (1, 1, 1, 1, 1), last
    # each flood event is counted once: far_future while step 0 runs, wrong_version (the receiver's version window)
    # if it lands after the learner moved to step 1
    assert last["rejected_far_future"] > 0 and last["rejected_far_future"] + last["rejected_wrong_version"] == FLOOD
    assert last["trajectories"] == 4
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import glob

    ea = EventAccumulator(glob.glob(str(tmp_path / "tb" / "events*"))[0])
    ea.Reload()
    got = {r: ea.Scalars(f"transport/rejected_{r}")[-1].value for r in ("bad_reward", "far_future", "out_of_vocab")}
    assert got == {"bad_reward": 1, "far_future": last["rejected_far_future"], "out_of_vocab": 1}, got


def test_off_spec_rewards_are_rejected_counted_and_the_step_completes(plane) -> None:
    """A reward the learner's --reward-kind/--reward-range does not admit (binary [0, 1] here: 0.5 and 2.0) used to
    raise in the streaming planner and stop the run; now it is a counted rejection and the trajectory counts as
    failed. Control: the same events with in-spec rewards are used as they are."""
    fleet = _fleet(plane)
    try:
        src = fleet.source(0, max_seq_len=8)
        with _sender(fleet) as tx:
            for ev in (_traj("s0g0t0", reward=0.5), _traj("s0g0t1", reward=2.0), _traj("s0g1t0", reward=1.0),
                       _traj("s0g1t1", reward=0.0)):
                tx.send(ev, timeout_s=5)
            got = _drain(src, tx)
        assert fleet.receiver.stats["bad_reward"] == 2 and rejection_row(fleet)["rejected_bad_reward"] == 2
        assert src.exhausted() and src.errors == 2
        assert {s.traj_id: s.reward for s in got} == {"s0g0t0": -1.0, "s0g0t1": -1.0, "s0g1t0": 1.0, "s0g1t1": 0.0}
    finally:
        fleet.close()


def _rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_far_future_floods_are_counted_not_parked(plane, monkeypatch) -> None:
    """Early trajectories are parked only for a step the run can still use (sync: the next one) and within the byte
    cap: 50,000 authentic far-future events cost a counter, not memory (nothing parked); the next step's event is
    parked (the control), and past the cap even those are dropped and counted."""
    import megatron_tsync.runtime.fleet as fleet_mod

    fleet = _fleet(plane)
    try:
        src = fleet.source(0, max_seq_len=8)
        rss0 = _rss()
        for k in range(50_000):
            src._to_sample(_traj(f"s{2 + k}g0t0"))
        grew = _rss() - rss0  # parking them all would hold ~50 MiB (measured: 49.7 MiB for 50k of these events)
        assert fleet.receiver.stats["far_future"] == 50_000 and not fleet.early and fleet.early_bytes == 0
        assert grew < 16 << 20, f"RSS grew {grew / 2**20:.1f} MiB over the flood"
        src._to_sample(_traj("s1g0t0"))  # the next step's: parked for it
        assert list(fleet.early) == [1] and fleet.early_bytes > 0
        monkeypatch.setattr(fleet_mod, "EARLY_BYTES_CAP", fleet.early_bytes + 1)
        src._to_sample(_traj("s1g0t1"))  # over the cap: dropped, counted
        assert fleet.receiver.stats["far_future"] == 50_001 and len(fleet.early[1]) == 1
        nxt = fleet.source(1, max_seq_len=8)  # the parked one is handed to its step, and the bytes are released
        assert fleet.early_bytes == 0 and [e.traj_id for e in nxt._early] == ["s1g0t0"]
    finally:
        fleet.close()


def test_remembered_rejections_are_bounded_to_ids_the_plane_can_owe() -> None:
    v = EdgeValidator(vocab_size=8, max_seq_len=8, group_size=2, groups_per_step=2, horizon=1)
    v.step = 3
    for tid in ("s3g0t0", "s4g1t1", "s2g0t0", "s5g0t0", "s3g2t0", "s3g0t2", "junk"):
        v.remember(tid, 3, "out_of_vocab", "")
    assert {s: sorted(d) for s, d in v.pending.items()} == {3: ["s3g0t0"], 4: ["s4g1t1"]}


def test_a_garbage_tokenizer_file_is_named(tiny_model, tmp_path) -> None:
    bad = str(tmp_path / "bad")
    shutil.copytree(tiny_model, bad)
    with open(os.path.join(bad, "tokenizer.json"), "w") as f:
        f.write("garbage")
    with pytest.raises(ValueError, match=r"cannot load its tokenizer from \[.*'tokenizer.json'.*JSONDecodeError"):
        check_tokenizer_fits(bad, 512)


def _turn(tid, turn, start, ids):
    from megatron_tsync.transport import TurnEvent

    end = len(ids)
    mask = np.array([0] * start + [1] * (end - start), np.uint8)
    return TurnEvent(traj_id=tid, group_id=tid.rpartition("t")[0], policy_version=0, turn=turn, start=start, end=end,
                     token_ids=np.array(ids, np.int32), loss_mask=mask,
                     logprobs=np.where(mask == 1, -0.5, 0).astype(np.float32))


def test_an_opd_turn_that_rewrites_delivered_tokens_is_rejected_and_counted(plane) -> None:
    """OPD streams each turn as it finishes; a turn whose prefix differs from the turns already delivered for its
    trajectory would train a chunk on a context the earlier chunks never saw. It is dropped and counted (bad_turn),
    the next consistent turn continues where the delivered ones ended (control), nothing raises."""
    from megatron_tsync.runtime.opd import OPDTransportSource

    fleet = _fleet(plane)
    try:
        src = OPDTransportSource(fleet, 0, 8, None)
        with _sender(fleet) as tx:
            tx.send(_turn("s0g0t0", 0, 2, (3, 4, 5)), timeout_s=5)
            first = _drain(src, tx)
            tx.send(_turn("s0g0t0", 1, 4, (3, 9, 5, 6, 7)), timeout_s=5)  # token 1 rewritten
            rewritten = _drain(src, tx)
            tx.send(_turn("s0g0t0", 1, 4, (3, 4, 5, 6, 7)), timeout_s=5)  # the consistent one
            good = _drain(src, tx)
        assert [(c.start, c.end) for c in first] == [(0, 3)] and rewritten == []
        assert [(c.start, c.end) for c in good] == [(3, 5)]
        assert fleet.receiver.stats["bad_turn"] == 1 and rejection_row(fleet)["rejected_bad_turn"] == 1
    finally:
        fleet.close()
