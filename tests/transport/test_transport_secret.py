"""Shared secret: env var, 0600 file, clear errors; per-run keys (events of another run rejected as wrong_run)."""

import os
import shutil

import pytest

from megatron_tsync.transport import SecretError, generate_secret, load_secret, write_secret_file
from megatron_tsync.transport.secret import ENV_FILE_VAR, ENV_VAR


def test_env_hex() -> None:
    key = generate_secret()
    assert len(key) == 32 and key != generate_secret()
    assert load_secret(env={ENV_VAR: key.hex()}) == key
    with pytest.raises(SecretError, match="not a hex string"):
        load_secret(env={ENV_VAR: "zz" * 16})
    with pytest.raises(SecretError, match="key of 4 bytes"):
        load_secret(env={ENV_VAR: "00" * 4})


def test_missing_is_a_clear_error() -> None:
    with pytest.raises(SecretError, match=f"no shared secret configured: set {ENV_VAR}.*{ENV_FILE_VAR}"):
        load_secret(env={})


def test_file_0600(tmp_path) -> None:
    path = tmp_path / "secret"
    key = write_secret_file(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_secret(path) == key
    assert load_secret(env={ENV_FILE_VAR: str(path)}) == key
    with pytest.raises(FileExistsError):
        write_secret_file(path)
    os.chmod(path, 0o644)
    with pytest.raises(SecretError, match="mode 0644 lets group/others access it"):
        load_secret(path)
    with pytest.raises(SecretError, match="cannot open"):
        load_secret(tmp_path / "absent")
    os.chmod(path, 0o600)
    os.symlink(path, tmp_path / "link")
    with pytest.raises(SecretError, match="cannot open"):
        load_secret(tmp_path / "link")  # no symlink games


# ---- run ids: one run's key per run, events of another run rejected and counted as wrong_run

def test_run_key_is_per_run_and_needs_the_secret() -> None:
    from megatron_tsync.transport.secret import new_run_id, run_key

    secret, a, b = generate_secret(), new_run_id(), new_run_id()
    assert a != b and len(a) == 16
    assert run_key(secret, a) == run_key(secret, a) != run_key(secret, b)
    assert run_key(secret, a) != secret and run_key(generate_secret(), a) != run_key(secret, a)
    for bad in ("", "XYZ", "0123", "g" * 16, "a" * 65):
        with pytest.raises(ValueError, match="run id must be 8–64 lowercase hex digits"):
            run_key(secret, bad)


def _pump(rx, senders, seconds=1.5):
    import time

    got, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        got += rx.poll(20)
        for tx in senders:
            tx.pump(0.0)
    return got


def test_a_receiver_rejects_every_event_of_another_run(tmp_path) -> None:
    """Same secret file, two runs: the new run's receiver delivers only its own run's events; the old run's (and a
    sender of no run) are counted as wrong_run; a frame forged under another key naming the old run stays
    bad_signature (control: wrong_run is not a catch-all for failed tags)."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tsync_transport_helpers import make_small, short_tmpdir

    from megatron_tsync.transport import EventReceiver, EventSender
    from megatron_tsync.transport.codec import encode
    from megatron_tsync.transport.secret import new_run_id

    key, old, new = write_secret_file(tmp_path / "secret"), new_run_id(), new_run_id()
    d = short_tmpdir()
    ep = f"ipc://{d}/events.sock"
    try:
        with EventReceiver(ep, key, run_id=new) as rx, \
                EventSender(ep, key, "worker0", run_id=old) as stale, \
                EventSender(ep, key, "worker1") as no_run, \
                EventSender(ep, key, "worker0", run_id=new) as ours:
            for i in range(5):
                stale.send(make_small(i), timeout_s=5)
            for i in range(2):
                no_run.send(make_small(10 + i), timeout_s=5)
            for i in range(3):
                ours.send(make_small(20 + i), timeout_s=5)
            got = _pump(rx, [stale, no_run, ours])
            assert sorted(e.meta["i"] for e in got) == [20, 21, 22]
            assert ours.in_flight == 0 and stale.in_flight == 5 and no_run.in_flight == 2  # never answered
            assert rx.stats["accepted"] == 3 and rx.stats["bad_signature"] == 0
            # 7 events plus the pings of the unanswered senders: every one of them counted as wrong_run
            assert rx.stats["wrong_run"] >= 7 and rx.rejected == rx.stats["wrong_run"]
            assert rx.wrong_run_kinds["trajectory"] == 7 and sum(rx.wrong_run_kinds.values()) == rx.stats["wrong_run"]
            assert any(f"@{old}" in d and f"this is run {new}" in d for r, d in rx.recent_rejections
                       if r == "wrong_run")
            forged = encode(make_small(30), generate_secret(), sender_id=f"worker0@{old}", seq=1, epoch=7)
            import zmq

            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.connect(ep)
            sock.send(forged)
            _pump(rx, [], seconds=0.5)
            sock.close(linger=0)
            assert rx.stats["bad_signature"] == 1 and rx.wrong_run_kinds["trajectory"] == 7
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_without_run_ids_the_shared_key_is_used_as_before(tmp_path) -> None:
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tsync_transport_helpers import make_small, short_tmpdir

    from megatron_tsync.transport import EventReceiver, EventSender

    key = generate_secret()
    d = short_tmpdir()
    ep = f"ipc://{d}/events.sock"
    try:
        with EventReceiver(ep, key) as rx, EventSender(ep, key, "w") as tx:
            tx.send(make_small(1), timeout_s=5)
            assert [e.meta["i"] for e in _pump(rx, [tx], 0.5)] == [1] and rx.stats["wrong_run"] == 0
    finally:
        shutil.rmtree(d, ignore_errors=True)
