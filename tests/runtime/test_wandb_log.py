"""W&B next to TensorBoard (``runtime/wandb_log.py``): a real replayed run with ``--wandb-project`` and no network or
credentials writes an offline W&B run whose history has one row per step with the TensorBoard scalars (read back
from W&B's own run file), and the config; the mode rules; wandb is not imported without the flag."""

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from megatron_tsync.runtime.wandb_log import wandb_mode
from tests.runtime.test_stop import REPLAY, _env
from tests.runtime.test_train_e2e import _synthetic_dump, tiny_model  # noqa: F401 - fixture used by name


def _records(path):
    """The protobuf records of a ``run-*.wandb`` file (W&B's leveldb-style log: a 7-byte header, 32 KiB blocks,
    records with a 7-byte header of checksum, length, type = full / first / middle / last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:7]
    pos, buf, out, block = 7, b"", [], 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (n == 0 and kind == 0):
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            out.append(r)
            buf = b""
    return out


def test_mode_rules():
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode({"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}) == "offline"
    assert wandb_mode({"WANDB_MODE": "disabled"}) == "disabled"


def test_wandb_is_imported_only_with_the_flag():
    code = "import sys, megatron_tsync.runtime.loop; assert 'wandb' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())


@pytest.mark.slow  # 12 s: a trainer start-up and W&B's service process
def test_offline_run_logs_the_tensorboard_scalars(tiny_model, tmp_path):  # noqa: F811
    dump, ck, wb = (str(tmp_path / n) for n in ("dump", "ck", "wb"))
    _synthetic_dump(dump, tiny_model, steps=3)
    env = _env()
    for k in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "megatron_tsync.train", "--model", tiny_model, "--replay-rollouts", dump,
                        *REPLAY, "--train-iters", "3", "--save", ck, "--wandb-project", "tsync-test",
                        "--wandb-exp-name", "e1", "--wandb-save-dir", wb], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "W&B: project tsync-test, run e1 (offline)" in p.stdout
    runs = glob.glob(os.path.join(wb, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, os.listdir(wb)
    recs = _records(runs[0])
    hist = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            for r in recs if r.WhichOneof("record_type") == "history"]
    with open(os.path.join(ck, "history.json")) as f:
        rows = json.load(f)
    assert [h["_step"] for h in hist] == [0, 1, 2]
    for h, row in zip(hist, rows):  # the TensorBoard tags with the row's values
        assert h["rollout/reward"] == row["reward"] and h["train/grad_norm"] == row["grad_norm"]
        assert h["perf/wall_step_s"] == row["wall_step_s"] and h["train/loss"] == row["loss"]
    cfg = [r.run.config for r in recs if r.WhichOneof("record_type") == "run"][0]
    conf = {u.key: json.loads(u.value_json) for u in cfg.update}
    assert conf["rl"]["train_iters"] == 3 and conf["logging"]["wandb_project"] == "tsync-test"
