"""Weight sync by collective broadcast over gloo (the code path NCCL runs on GPU, with CPU tensors here).

- layout and manifest units (no process group);
- the sender (this process) and 2 receiver processes: mixed dtypes incl. bf16/fp8/bool/0-d/empty, a tensor larger
  than a bucket, several versions in a row, a stale and a future version rejected and counted, forged / tampered /
  unsigned manifests rejected, and the right version still arriving after each rejection, bit-identical;
- threads in one process: a loader that stops early is drained; a sender that never sends times out;
- dead peers: a receiver whose sender dies (before sending, or mid-stream) and a sender whose receiver dies get a
  clear error within the timeout, not a hang.
"""

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from tsync_transport_helpers import HERE, KEY

from megatron_tsync.transport import BadSignature, Malformed
from megatron_tsync.transport.weight_broadcast import (
    ALIGN,
    BroadcastWeightPublisher,
    BroadcastWeightSubscriber,
    WeightSyncError,
    WeightSyncGroup,
    plan_layout,
    sign_manifest,
    verify_manifest,
)

PEER = os.path.join(HERE, "tsync_weight_peer.py")
sys.path.insert(0, HERE)
from tsync_weight_peer import digests  # noqa: E402

BUCKET = 64 << 10


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(200, generator=g)  # Megatron-style views into one buffer
    emb = torch.randn(300, 257, generator=g).to(torch.bfloat16)  # 154 KB: spans 3 buckets of 64 KiB
    return {
        "model.embed_tokens.weight": emb, "lm_head.weight": emb,  # tied: one storage under two names
        "model.layers.0.w": flat[:150].view(10, 15), "model.layers.0.b": flat[150:],
        "transposed": torch.randn(9, 7, generator=g).t(),  # non-contiguous
        "half": torch.randn(7, generator=g).half(), "double": torch.randn(3, 3, generator=g, dtype=torch.float64),
        "fp8": torch.randn(10, generator=g).to(torch.float8_e4m3fn), "mask": torch.rand(5, 3, generator=g) > 0.5,
        "int8": torch.randint(-128, 127, (13,), generator=g, dtype=torch.int8),
        "step": torch.tensor(seed, dtype=torch.int64), "empty": torch.zeros(0, 4),
        "big": torch.randn(70_000, generator=g),  # 280 KB: larger than one bucket
    }


# ------------------------------------------------------------------------------------------------ units
def test_layout_is_aligned_and_pieces_cover_every_byte():
    lay = plan_layout(_state(0), BUCKET)
    assert lay.bucket_bytes == BUCKET and all(t.offset % ALIGN == 0 for t in lay.tensors)
    covered = {t.name: 0 for t in lay.tensors}
    for (start, end), pieces in zip(lay.buckets(), lay.pieces()):
        assert end - start <= BUCKET
        for i, lo, hi in pieces:
            assert start <= lo < hi <= end
            covered[lay.tensors[i].name] += hi - lo
    assert covered == {t.name: t.nbytes for t in lay.tensors}
    with pytest.raises(TypeError, match="complex"):
        plan_layout({"c": torch.zeros(2, dtype=torch.complex64)}, BUCKET)


def test_manifest_verifies_and_rejects_forgeries():
    lay = plan_layout(_state(0), BUCKET)
    raw = sign_manifest(lay, 7, KEY)
    assert verify_manifest(raw, KEY) == (7, lay)
    with pytest.raises(BadSignature):
        verify_manifest(sign_manifest(lay, 7, bytes(32)), KEY)  # another key
    with pytest.raises(BadSignature):
        verify_manifest(raw.replace(b'"version":7', b'"version":8'), KEY)  # tampered
    with pytest.raises(BadSignature):
        verify_manifest(raw[:-32], KEY)  # unsigned
    import hashlib
    import hmac

    from megatron_tsync.transport.weight_broadcast import _DOMAIN

    body = raw[:-32].replace(b'"align":16', b'"align":8')  # authentic but inconsistent
    with pytest.raises(Malformed, match="format/align"):
        verify_manifest(body + hmac.new(KEY, _DOMAIN + body, hashlib.sha256).digest(), KEY)


# ------------------------------------------------------------------------------------------------ gloo, 3 processes
class _Forging(BroadcastWeightPublisher):
    forge: str | None = None

    def _sign(self, layout, version):
        if self.forge == "key":
            return sign_manifest(layout, version, b"\x01" * 32)
        raw = super()._sign(layout, version)
        if self.forge == "tamper":
            return raw.replace(f'"version":{version}'.encode(), f'"version":{version + 1}'.encode())
        if self.forge == "unsigned":
            return raw[:-32] + b" " * 32
        return raw


def _spawn(role, cfg, tmp_path, name):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, PEER, role, str(path)], env=env, stdout=log, stderr=subprocess.STDOUT)


def test_two_receivers_versions_rejections_bit_identical(tmp_path):
    g = WeightSyncGroup.host(3, op_timeout_s=60)
    plan = [{"expect": v} for v in (1, 2, 4, 5, 5, 5, 5, 8, 10)]
    procs = [_spawn("receive", {"host": "127.0.0.1", "port": g.port, "rank": r, "world_size": 3, "key": KEY.hex(),
                                "plan": plan, "out": str(tmp_path / f"r{r}.out")}, tmp_path, f"r{r}")
             for r in (1, 2)]

    def alive():
        for p in procs:
            if p.poll() not in (None, 0):
                raise RuntimeError(f"receiver exited with {p.returncode}: {(tmp_path / 'r1.log').read_text()[-2000:]}")

    pub = _Forging(g, KEY, bucket_bytes=BUCKET, poll_fn=alive, connect_timeout_s=120)
    sent = {}
    try:
        for v in (1, 2, 3, 4):  # receivers skip 3 (stale: they wait for 4)
            sent[v] = _state(v)
            pub.publish(sent[v], v)
        assert pub.last_stats["buckets"] >= 8 and pub.last_stats["bytes"] > 3 * BUCKET
        for forge in ("key", "tamper", "unsigned"):
            pub.forge = forge
            pub.publish(_state(5), 5)
            pub.last_version = 4  # the test re-sends v5 after each forgery
        pub.forge = None
        for v in (5, 9, 10):  # receivers wait for 8 when 9 comes: a version that can never arrive
            sent[v] = _state(v)
            pub.publish(sent[v], v)
        for p in procs:
            assert p.wait(timeout=120) == 0, (tmp_path / "r1.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        pub.close()
    for r in (1, 2):
        out = json.loads((tmp_path / f"r{r}.out").read_text())
        steps = out["steps"]
        for i, v in ((0, 1), (1, 2), (2, 4), (6, 5), (8, 10)):
            assert steps[i].get("version") == v, (r, i, steps[i])
            assert steps[i]["digests"] == digests(sent[v]), (r, v)
        assert [steps[i]["error"] for i in (3, 4, 5)] == ["BadSignature"] * 3, steps[3:6]
        assert steps[7]["error"] == "WrongVersion" and "expected weights v8, the trainer sent v9" in steps[7]["message"]
        assert out["rejected"] == {"wrong_version": 2, "bad_signature": 3}, out["rejected"]


# ------------------------------------------------------------------------------------------------ threads
def _pair(op_timeout_s=30.0):
    g0 = WeightSyncGroup.host(2, op_timeout_s=op_timeout_s)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("g", WeightSyncGroup.join(
        "127.0.0.1", g0.port, 1, 2, connect_timeout_s=30, op_timeout_s=op_timeout_s)))
    t.start()
    g0.connect(timeout_s=30)
    t.join()
    return g0, box["g"]


def test_loader_that_stops_early_is_drained_and_timeouts_are_clear():
    g0, g1 = _pair()
    pub, sub = BroadcastWeightPublisher(g0, KEY, bucket_bytes=BUCKET), BroadcastWeightSubscriber(g1, KEY)
    states = {1: _state(1), 2: _state(2)}
    sender = threading.Thread(target=lambda: [pub.publish(states[v], v) for v in (1, 2)])
    sender.start()
    try:
        receipt = sub.receive(1, timeout_s=30)
        name, first = next(iter(receipt))
        assert name == "empty" and first.shape == (0, 4)  # empty tensors come first
        receipt.drain()  # a loader gave up after one tensor: the rest of v1 must still be consumed
        v, got = sub.wait_for(2, timeout_s=30)
        assert v == 2 and digests(got) == digests(states[2])
        assert sub.last_stats["bytes"] == pub.last_stats["bytes"] > 0
    finally:
        sender.join(timeout=30)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="weights message 2"):
        sub.wait_for(3, timeout_s=0.5)
    # The caller's 0.5 s, not the group's 30 s op timeout, bounded the wait. When it ended is the only observable
    # of that, hence a time bound, kept generous: 30x the 0.5 s, still half the 30 s it must not have waited.
    assert time.monotonic() - t0 < 15
    with pytest.raises(ValueError, match="version must be an int > the last published 2"):
        pub.publish(states[1], 2)
    g0.close()
    g1.close()


# ------------------------------------------------------------------------------------------------ dead peers
@pytest.mark.parametrize("when", ["before", "mid"])
def test_receiver_whose_sender_dies_gets_a_clear_error(tmp_path, when):
    port_file = tmp_path / "port"
    proc = _spawn("send-then-die", {"key": KEY.hex(), "port_file": str(port_file), "when": when}, tmp_path, "s")
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "s.log").read_text()
            time.sleep(0.05)
        g = WeightSyncGroup.join("127.0.0.1", int(port_file.read_text()), 1, 2, connect_timeout_s=60, op_timeout_s=20)
        sub = BroadcastWeightSubscriber(g, KEY)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError) as err:
            sub.wait_for(0, timeout_s=60)
        print(f"\nsender died {when} sending: {time.monotonic() - t0:.2f}s to error: {err.value}")
        # the death itself was seen (its connection dropped), not waited out: a timeout would be a TimeoutError or a
        # store "Wait timeout" (the store wait), or gloo's "Timed out waiting ..." (the 20 s op timeout)
        msg = str(err.value)
        if when == "before":  # the store connection was lost (that branch asks whether the trainer is alive)
            assert "trainer still alive" in msg and "timeout" not in msg.lower(), msg
        else:  # gloo's pair saw the peer's socket fail
            assert "a peer died" in msg and re.search(r"Read error|Connection closed by peer", msg), msg
            assert "Timed out" not in msg, msg
        assert proc.wait(timeout=30) == 3
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sender_whose_receiver_dies_gets_a_clear_error(tmp_path):
    g = WeightSyncGroup.host(2, op_timeout_s=10)
    proc = _spawn("join-then-die", {"host": "127.0.0.1", "port": g.port, "rank": 1, "world_size": 2,
                                    "key": KEY.hex()}, tmp_path, "r")

    class PeerGone(RuntimeError):
        pass

    def alive():  # what the fleet's dead-worker check does
        if proc.poll() is not None:
            raise PeerGone(f"receiver exited with {proc.returncode}")

    pub = BroadcastWeightPublisher(g, KEY, poll_fn=alive, connect_timeout_s=60)
    try:
        t0 = time.monotonic()
        # a clear error, not a hang: the 60 s connect wait would end in a TimeoutError, which does not match
        with pytest.raises((PeerGone, WeightSyncError)) as err:
            pub.publish({"w": torch.ones(8)}, 0)
        print(f"\nreceiver died: {time.monotonic() - t0:.2f}s to error: {err.value}")
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.close()
