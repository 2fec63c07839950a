"""Weight hand-off: bit-exact round trip, atomic + signed, tampering rejected, old versions collected."""

import json
import os
import threading
import time

import pytest
import torch
from tsync_transport_helpers import KEY

from megatron_tsync.transport import BadSignature, Malformed
from megatron_tsync.transport.weights import (
    FileWeightPublisher,
    WeightSubscriber,
    publish_weights,
)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(96, generator=g)  # Megatron-style: parameters are views into one flat buffer
    emb = torch.randn(16, 4, generator=g, dtype=torch.bfloat16)
    return {"decoder.w": buf[:64].view(8, 8), "decoder.b": buf[64:], "embedding": emb, "output": emb,  # tied
            "step": torch.tensor(seed, dtype=torch.int64)}


def _assert_bit_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].reshape(-1).view(torch.uint8).equal(b[k].reshape(-1).view(torch.uint8)), k


def test_round_trip_and_gc(tmp_path) -> None:
    sub = WeightSubscriber(tmp_path, KEY)
    assert sub.latest() is None and sub.latest_version() is None
    for v in (1, 2, 5):
        publish_weights(_state(v), tmp_path, v, KEY)
    version, sd = sub.latest()
    assert version == 5
    _assert_bit_equal(sd, _state(5))
    _assert_bit_equal(sub.load(2), _state(2))
    names = sorted(os.listdir(tmp_path))
    assert names == ["manifest-v000000000002.json", "manifest-v000000000005.json",
                     "weights-v000000000002.safetensors", "weights-v000000000005.safetensors"]  # keep last 2, no temp
    with pytest.raises(ValueError, match="<= latest published version 5"):
        publish_weights(_state(4), tmp_path, 4, KEY)


def test_tampered_manifest_rejected(tmp_path) -> None:
    path = publish_weights(_state(1), tmp_path, 1, KEY)
    body = json.loads(path.read_text())
    for field, value in (("sha256", "0" * 64), ("version", 2), ("size", 1)):
        path.write_text(json.dumps({**body, field: value}))
        with pytest.raises(BadSignature, match="HMAC does not verify"):
            WeightSubscriber(tmp_path, KEY).latest()
    path.write_text(json.dumps(body))
    with pytest.raises(BadSignature):
        WeightSubscriber(tmp_path, os.urandom(32)).latest()  # wrong key
    path.write_text("{not json")
    with pytest.raises(Malformed, match="not JSON"):
        WeightSubscriber(tmp_path, KEY).latest()


def test_tampered_weights_file_rejected(tmp_path) -> None:
    publish_weights(_state(1), tmp_path, 1, KEY)
    f = tmp_path / "weights-v000000000001.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x40  # flip a bit inside a tensor
    f.write_bytes(bytes(data))
    with pytest.raises(BadSignature, match="sha256"):
        WeightSubscriber(tmp_path, KEY).latest()


def test_manifest_renamed_to_another_version_rejected(tmp_path) -> None:
    publish_weights(_state(1), tmp_path, 1, KEY)
    os.rename(tmp_path / "manifest-v000000000001.json", tmp_path / "manifest-v000000000009.json")
    with pytest.raises(Malformed, match="disagree"):
        WeightSubscriber(tmp_path, KEY).latest()


def test_wait_for_while_trainer_publishes(tmp_path) -> None:
    pub = FileWeightPublisher(tmp_path, KEY)

    def trainer() -> None:
        for v in range(1, 4):
            time.sleep(0.05)
            pub.publish(_state(v), v)

    t = threading.Thread(target=trainer)
    t.start()
    version, sd = WeightSubscriber(tmp_path, KEY, poll_interval_s=0.01).wait_for(3, timeout_s=10)
    t.join()
    assert version == 3
    _assert_bit_equal(sd, _state(3))
    with pytest.raises(TimeoutError, match="version >= 4"):
        WeightSubscriber(tmp_path, KEY, poll_interval_s=0.01).wait_for(4, timeout_s=0.05)

