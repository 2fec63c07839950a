"""Learning-signal health (runtime/signal_health.py): a step without gradient signal is named, the run warns once
after a streak and ``--stop-on-no-signal K`` stops it (exit 1, one line)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_tsync.runtime.signal_health import WARN_AFTER, SignalHealth, fail_kind, step_signal
from megatron_tsync.streaming.ready_queue import Sample


def _s(gid: str, i: int, reward: float, fail: str | None = None) -> Sample:
    mask = torch.tensor([0.0, 0.0, 1.0, 1.0]) if fail is None else torch.zeros(4)
    meta = {} if fail is None else {"fail_kind": fail, "fail_detail": f"{fail}: boom"}
    return Sample(f"{gid}t{i}", gid, 2, torch.arange(4), mask, reward, meta=meta)


def test_step_signal_grpo_cases():
    zero_var = [_s("g0", 0, 1.0), _s("g0", 1, 1.0), _s("g1", 0, 0.0), _s("g1", 1, 0.0)]
    row, why = step_signal(zero_var, 0.0, "grpo")
    assert row == {"failed": 0, "signal_groups": 0, "no_signal": 1}
    assert "zero reward variance (reward 1 ×2, 0 ×2)" in why and "grad-norm 0" in why
    failed = [_s("g0", 0, 0.0, "harness_crash"), _s("g0", 1, 0.0, "harness_crash")]
    row, why = step_signal(failed, None, "grpo")
    assert row["failed"] == 2 and row["no_signal"] == 1 and why == "every trajectory failed or was rejected"
    # one failed (floor reward) beside one that succeeded: the successful one has a non-zero advantage
    mixed = [_s("g0", 0, 0.0, "verifier_error"), _s("g0", 1, 1.0), _s("g1", 0, 0.0), _s("g1", 1, 0.0)]
    row, why = step_signal(mixed, 0.3, "grpo")
    assert row == {"failed": 1, "signal_groups": 1, "no_signal": 0} and why == ""
    # a group whose trainable trajectories all sit at the group mean trains nothing, whatever its failed ones
    row, why = step_signal([_s("g0", 0, 0.5), _s("g0", 1, 0.0, "rejected"), _s("g0", 2, 1.0, "rejected")], 0.1,
                           "grpo")
    assert row["no_signal"] == 1


def test_step_signal_opd():
    assert step_signal([_s("g0", 0, 0.0), _s("g0", 1, 0.0)], 0.5, "opd")[0]["no_signal"] == 0  # distils either way
    row, why = step_signal([_s("g0", 0, 0.0, "rollout_error")], 0.5, "opd")
    assert row == {"failed": 1, "no_signal": 1} and "failed" in why


def test_fail_kind():
    assert fail_kind("anything", "harness_bad_reward") == "harness_bad_reward"
    assert fail_kind("rejected at the learner's edge: schema: x") == "rejected"
    assert fail_kind("verifier failed: ValueError: x") == "verifier_error"
    assert fail_kind("sandbox crashed") == "rollout_error"


def test_warns_once_after_a_streak_with_the_causes():
    h = SignalHealth("grpo")
    bad = [_s("g0", 0, 0.0, "harness_crash"), _s("g0", 1, 0.0, "harness_crash")]
    warnings = [h.observe(k, bad, 0.0)[2] for k in range(3 * WARN_AFTER)]
    assert [k for k, w in enumerate(warnings) if w] == [WARN_AFTER - 1]  # once, at the K-th step in a row
    w = warnings[WARN_AFTER - 1]
    assert f"no learning signal in {WARN_AFTER} steps in a row" in w
    assert f"{2 * WARN_AFTER} failed trajectories (harness_crash {2 * WARN_AFTER}" in w and "harness_crash: boom" in w
    assert h.stop == ""  # without --stop-on-no-signal the run goes on
    assert h.summary() == (f"no learning signal in {3 * WARN_AFTER}/{3 * WARN_AFTER} steps, failed trajectories "
                           f"{6 * WARN_AFTER}/{6 * WARN_AFTER} (harness_crash {6 * WARN_AFTER})")
    row = {**h.observe(99, bad, 0.0)[0], "no_signal_why": "x"}
    assert h.line(row) == " NO SIGNAL (x)"


def test_a_step_with_signal_resets_the_streak_and_stop_after_k():
    h = SignalHealth("grpo", stop_after=3)
    flat = [_s("g0", 0, 0.0), _s("g0", 1, 0.0)]
    good = [_s("g0", 0, 0.0), _s("g0", 1, 1.0)]
    for k, batch in enumerate([flat, flat, good, flat, flat]):
        h.observe(k, batch, 0.5)
        assert h.stop == ""
    _, why, warning = h.observe(5, flat, 0.5)
    assert warning is None and h.stop.startswith("--stop-on-no-signal 3: no learning signal in the last 3 steps "
                                                 "(up to step 5): every group has zero reward variance")
    assert "rewards of the trajectories that did not fail: 0 ×6" in h.stop


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_a_run_without_signal_says_so_and_stops(tmp_path):
    """A replayed run whose every reward is 0: each progress line says NO SIGNAL and counts the failed trajectories,
    the summary counts the steps; --stop-on-no-signal 2 stops it after step 1 (exit 1, one line, no stop record)."""
    from megatron_tsync.model.tiny_model import make_tiny_model
    from megatron_tsync.runtime.rollout_io import dump_rollouts
    from tests.conftest import free_port

    model = str(tmp_path / "model")
    make_tiny_model(model, seed=0)
    for k in range(3):
        samples = [_s(f"s{k}g{g}", i, 0.0, "harness_crash" if i == 0 else None) for g in range(2) for i in range(2)]
        for s in samples:
            s.behaviour_logp = torch.zeros(4, dtype=torch.float64)
        dump_rollouts(str(tmp_path / "dump"), k, samples, [f"s{k}g0", f"s{k}g1"])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    common = [sys.executable, "-m", "megatron_tsync.train", "--model", model, "--replay-rollouts",
              str(tmp_path / "dump"), "--group-size", "2", "--groups-per-step", "2", "--seq-length", "64",
              "--no-progress", "--train-iters", "3"]
    p = subprocess.run([*common, "--save", str(tmp_path / "ck")], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[tsync] step ")]
    assert len(lines) == 3 and all("failed 2" in ln and "NO SIGNAL (every group has zero reward variance" in ln
                                   for ln in lines), p.stdout
    assert "no learning signal in 3/3 steps, failed trajectories 6/12 (harness_crash 6), events rejected 0" in p.stdout
    rows = json.load(open(tmp_path / "ck" / "history.json"))
    assert [r["no_signal"] for r in rows] == [1, 1, 1] and [r["failed"] for r in rows] == [2, 2, 2]
    p = subprocess.run([*common, "--save", str(tmp_path / "ck2"), "--stop-on-no-signal", "2"], cwd=tmp_path,
                       env={**env, "MASTER_PORT": str(free_port())}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "error: --stop-on-no-signal 2: no learning signal in the last 2 steps (up to step 2)" in p.stderr
    assert "2 failed trajectories" not in p.stderr and "4 failed trajectories (harness_crash 4" in p.stderr
    assert not os.path.exists(tmp_path / "ck2" / "tsync_stop.json")
