"""Skipped updates in the one training loop (``runtime/loop.py``, ``runtime/stop.py``): every step whose barrier
skipped its optimizer update (non-finite loss or gradient, ``training/barrier.py``) is counted in the row
(``update_skipped``, ``skipped_steps``), the progress line and TensorBoard; ``--max-consecutive-skipped-steps N`` such
steps in a row stop the run before any checkpoint (no stop record; ``run`` exits 3 with one line); 0 never stops.

Fast tests drive ``loop.train`` with a stand-in algorithm and context (the learner's side is
``tests/training/test_nonfinite.py``); the slow ones run the trainer: a replayed async run whose behaviour log-probs are
NaN stops after N steps with exit code 3 and no checkpoint, and a live async run with a forged -1e4 log-prob from a
worker holding the run's key never applies a NaN step.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time
import types

import msgpack
import numpy as np
import pytest
import torch

from megatron_tsync.arguments import parse_args
from megatron_tsync.runtime import loop
from megatron_tsync.runtime.context import grad_norm_text, skipped_text
from megatron_tsync.runtime.spec import StepOutcome
from megatron_tsync.runtime.stop import STOP_FILE, NonFiniteStop, SkipCounter, StopFlag
from tests.runtime.test_train_e2e import tiny_model  # noqa: F401 - fixture used by name


class _Ctx:
    """What ``loop.train`` uses of ``runtime.context.RunContext`` (a replay run: no fleet, no publish)."""

    def __init__(self, cfg):
        self.cfg, self.step, self.history = cfg, 0, []
        self.dims = types.SimpleNamespace(rank=0, world_size=1, is_logging_rank=True)
        self.stop = StopFlag(install=False)
        self.saves, self.histories, self.scalars = [], [], {}

    def heldout_eval(self):
        return None

    def close(self):
        pass

    def save(self):
        self.saves.append(self.step)

    def save_history(self, evals=None):
        self.histories.append([dict(r) for r in self.history])

    def write_scalars(self, row, names, k):
        for key, tag in names.items():
            if row.get(key) is not None:
                self.scalars.setdefault(tag, []).append(row[key])


class _Algo:
    """Steps in ``poisoned`` skipped their update (what the learners report: ``skipped_updates``)."""

    tb_names: dict = {}

    def __init__(self, poisoned):
        self.poisoned = set(poisoned)

    def step(self, k, fleet):
        return StepOutcome(result=types.SimpleNamespace(skipped_updates=int(k in self.poisoned), busy_s=0.0),
                           samples=[], group_order=[])

    def row(self, k, out, fleet):
        return {"step": k, "grad_norm": None if out.result.skipped_updates else 1.0}

    def line(self, row, done, total, eta_s):
        return f"[tsync] step {done} grad-norm {grad_norm_text(row)}{skipped_text(row)}"

    def summary(self, history):
        return "[tsync] summary"


def _cfg(tmp_path, *flags):
    return parse_args(["--train-iters", "6", "--save", str(tmp_path / "ck"), "--replay-rollouts",
                       str(tmp_path / "dump"), "--no-progress", *flags])


def test_n_skipped_steps_in_a_row_stop_the_run_without_a_checkpoint(tmp_path, capsys):
    ctx = _Ctx(_cfg(tmp_path, "--max-consecutive-skipped-steps", "2"))
    with pytest.raises(NonFiniteStop, match=r"stopping at step 4: 2 steps in a row \(--max-consecutive-skipped-steps "
                                            r"2\).*the weights are still policy version 3's, no checkpoint"):
        loop.train(ctx, _Algo({1, 3, 4}))  # 1 alone does not stop; 3, 4 do
    assert ctx.saves == [] and not os.path.exists(tmp_path / "ck" / STOP_FILE)  # nothing written, no requeue
    rows = ctx.histories[-1]  # the rows so far are still written (history.json)
    assert [r["update_skipped"] for r in rows] == [0, 1, 0, 1, 1]
    assert [r["skipped_steps"] for r in rows] == [0, 1, 1, 2, 3]
    assert ctx.scalars["train/skipped_steps"] == [0, 1, 1, 2, 3]  # TensorBoard
    out = capsys.readouterr().out
    assert "[tsync] step 4: optimizer update skipped (non-finite loss or gradient), weights unchanged; 2 in a row (--max-consecutive-skipped-steps 2: the run stops at 2)" in out
    assert "[tsync] step 5 grad-norm skipped skipped 3" in out and "[tsync] step 3 grad-norm 1.000 skipped 1" in out


def test_zero_never_stops_and_the_default_is_three(tmp_path):
    ctx = _Ctx(_cfg(tmp_path, "--max-consecutive-skipped-steps", "0"))  # the flag's effect: the same run goes on
    loop.train(ctx, _Algo({1, 2, 3, 4}))
    assert ctx.step == 6 and ctx.saves == [6] and ctx.history[-1]["skipped_steps"] == 4
    assert json.loads((tmp_path / "ck" / STOP_FILE).read_text())["finished"]
    assert parse_args([]).rl.max_consecutive_skipped_steps == 3
    ctx = _Ctx(_cfg(tmp_path))
    loop.train(ctx, _Algo({1, 2, 4, 5}))  # never three in a row
    assert ctx.step == 6
    with pytest.raises(NonFiniteStop, match="stopping at step 3: 3 steps in a row"):
        loop.train(_Ctx(_cfg(tmp_path)), _Algo({1, 2, 3}))
    with pytest.raises(SystemExit):
        parse_args(["--max-consecutive-skipped-steps", "-1"])


def test_skip_counter_streaks():
    c = SkipCounter(2)
    rows = [c.record(k, n) for k, n in enumerate((2, 0, 1))]  # 2: two of a step's minibatch updates skipped
    assert rows[-1] == {"update_skipped": 1, "skipped_steps": 3} and c.streak == 1
    c.check(2)  # one in a row: goes on


def test_run_turns_the_stop_into_one_line_and_exit_code_3(tmp_path, monkeypatch, capsys):
    cfg = _cfg(tmp_path)
    monkeypatch.setattr(loop, "RunContext", lambda cfg, stop: types.SimpleNamespace(dims=None))
    monkeypatch.setattr(loop.env_report, "print_report", lambda cfg, dims: None)
    monkeypatch.setattr(loop, "destroy_parallel", lambda: None)  # the session's process group stays

    def stop(ctx, algo):
        raise NonFiniteStop("stopping at step 4: 3 steps in a row ...")

    monkeypatch.setattr(loop, "train", stop)
    monkeypatch.setattr(loop, "train_spec", lambda name: types.SimpleNamespace(build=lambda ctx: None))
    with pytest.raises(SystemExit) as e:
        loop.run(cfg)
    assert e.value.code == 3
    err = capsys.readouterr().err
    assert err.strip() == "[tsync] error: stopping at step 4: 3 steps in a row ...", err


def _env():
    from tests.conftest import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def _nan_dump(root: str, model_dir: str, steps: int) -> None:
    """A replayable dump whose behaviour log-probs are NaN on the action tokens: a poison no edge sees (replay reads
    trusted files), which makes the async loss (π_old = the engine's log-probs) NaN in every step."""
    from megatron_tsync.runtime.rollout_io import dump_rollouts
    from megatron_tsync.streaming.ready_queue import Sample

    g = torch.Generator().manual_seed(0)
    for k in range(steps):
        samples = []
        for gi in range(2):
            for i in range(4):
                T = 16
                mask = torch.zeros(T)
                mask[5:] = 1
                beh = torch.where(mask > 0, torch.tensor(float("nan"), dtype=torch.float64), 0.0)
                samples.append(Sample(f"s{k}g{gi}t{i}", f"s{k}g{gi}", 4, torch.randint(0, 100, (T,), generator=g),
                                      mask, float(i % 2), policy_version=k, behaviour_logp=beh))
        dump_rollouts(root, k, samples, [f"s{k}g0", f"s{k}g1"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_poisoned_replay_stops_with_exit_code_3_and_no_checkpoint(tiny_model, tmp_path):  # noqa: F811
    dump, ck = str(tmp_path / "dump"), tmp_path / "ck"
    _nan_dump(dump, tiny_model, 4)
    p = subprocess.run([sys.executable, "-m", "megatron_tsync.train", "--model", tiny_model, "--replay-rollouts", dump,
                        "--rl-mode", "async", "--max-staleness", "1", "--group-size", "4", "--global-batch-size", "8",
                        "--seq-length", "64", "--train-iters", "4", "--max-consecutive-skipped-steps", "2",
                        "--save", str(ck), "--tensorboard-dir", str(tmp_path / "tb"), "--no-progress"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=500)
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1].startswith("[tsync] error: stopping at step 1: 2 steps in a row "
                                                        "(--max-consecutive-skipped-steps 2)"), p.stderr[-3000:]
    assert "[tsync] step 0: optimizer update skipped" in p.stdout
    assert "grad-norm skipped rejected 0 failed 0 skipped 2" in p.stdout
    assert not glob.glob(str(ck / "iter_*")) and not (ck / STOP_FILE).exists()  # no checkpoint, no stop record
    rows = json.loads((ck / "history.json").read_text())
    assert [(r["update_skipped"], r["skipped_steps"], r["grad_norm"]) for r in rows] == [(1, 1, None), (1, 2, None)]


def _forge(rdir: str, stop: threading.Event, sent: list) -> None:
    """A worker of the live run (the run's key and id) sends step 0's first trajectory with one behaviour log-prob of
    -1e4: schema-valid before issue 45, it made the async ratio exp(1e4) = inf and the step NaN."""
    from megatron_tsync.transport import EventSender, load_secret
    from megatron_tsync.transport.codec import _seal
    from tests.runtime.test_validation import _traj

    path = os.path.join(rdir, "worker0.json")
    while not os.path.exists(path) and not stop.is_set():
        time.sleep(0.05)
    with open(path) as f:
        spec = json.load(f)
    kw = {"run_id": spec["run_id"]} if spec.get("run_id") else {}
    with EventSender(spec["endpoint"], load_secret(path=spec["secret_file"]), "forger", **kw) as tx:
        ev = _traj("s0g0t0", ids=(3, 4, 5, 6, 7, 8))
        wire = ev.to_wire()
        lp = ev.logprobs.copy()
        lp[3] = -1e4
        wire["logprobs"] = ["<f4", lp.size, lp.tobytes()]
        tx._sock.send(_seal(1, msgpack.packb(wire, use_bin_type=True), tx._key, sender_id=tx.sender_id, seq=1 << 20,
                            epoch=tx.epoch, policy_version=0))
        time.sleep(1.0)
    sent.append("sent")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_live_async_run_never_applies_a_nan_step(tiny_model, tmp_path):  # noqa: F811
    from megatron_tsync.transport import write_secret_file
    from tests.conftest import free_port

    secret, rdir, ck = str(tmp_path / "secret.hex"), str(tmp_path / "plane"), tmp_path / "ck"
    write_secret_file(secret)
    stop, sent = threading.Event(), []
    t = threading.Thread(target=_forge, args=(rdir, stop, sent), daemon=True)
    t.start()
    try:
        p = subprocess.run([sys.executable, "-m", "megatron_tsync.train", "--model", tiny_model, "--group-size", "2",
                            "--global-batch-size", "4", "--rollout-workers", "1", "--max-turns", "2",
                            "--max-new-tokens", "16", "--seq-length", "128", "--train-iters", "2",
                            "--rl-mode", "async", "--max-staleness", "1", "--rollout-dir", rdir,
                            "--secret-file", secret, "--rollout-endpoint", f"tcp://127.0.0.1:{free_port()}",
                            "--save", str(ck), "--tensorboard-dir", str(tmp_path / "tb"), "--no-progress"],
                           cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=800)
    finally:
        stop.set()
        t.join(timeout=30)
    assert p.returncode == 0 and sent == ["sent"], p.stdout[-3000:] + p.stderr[-5000:]
    rows = json.loads((ck / "history.json").read_text())
    assert rows[-1]["rejected_bad_logprob"] == 1, rows[-1]
    assert all(r["grad_norm"] is not None and np.isfinite(r["grad_norm"]) and r["update_skipped"] == 0 for r in rows)
    assert rows[-1]["trajectories"] == 4  # the real worker's event for the forged id still counts
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(glob.glob(str(tmp_path / "tb" / "events*"))[0])
    ea.Reload()
    assert ea.Scalars("transport/rejected_bad_logprob")[-1].value == 1
    assert [s.value for s in ea.Scalars("train/skipped_steps")] == [0, 0]
