"""On-policy distillation end to end on CPU, as a user runs it (examples/opd/README.md).

A teacher (tiny Llama after a long supervised warm start on the arithmetic task) and a barely warmed-up student of
the same tokenizer; ``python -m megatron_tsync.train --rl-algorithm opd --rl-mode stream-turn`` with live rollouts:
the student's sampled reverse KL to the teacher falls, TensorBoard has ``opd/reverse_kl``, the summary line prints;
the held-out evaluation (``--eval-interval``) runs in this mode too (``eval/*`` in TensorBoard, the summary line).
"""

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    from tests.conftest import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def _run(cmd, cwd, timeout=900):
    p = subprocess.run([sys.executable, *cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p.stdout


@pytest.mark.slow
def test_opd_stream_turn_reverse_kl_falls(tmp_path):
    root = tmp_path / "models"
    _run([os.path.join(ROOT, "examples", "opd", "make_models.py"), str(root), "--teacher-steps", "150",
          "--student-steps", "10"], tmp_path)
    tb = tmp_path / "tb"
    out = _run(["-m", "megatron_tsync.train", "--rl-algorithm", "opd", "--teacher-model", str(root / "teacher"),
                "--model", str(root / "student"), "--rl-mode", "stream-turn", "--group-size", "2",
                "--global-batch-size", "8", "--rollout-workers", "1", "--max-turns", "3", "--max-new-tokens", "24",
                "--seq-length", "128", "--lr", "1e-3", "--train-iters", "8", "--no-progress",
                "--tensorboard-dir", str(tb), "--eval-interval", "4", "--eval-prompts", "8"], tmp_path)
    assert "opd summary: mode stream-turn, 8 steps" in out, out
    summary = next(line for line in out.splitlines() if "opd summary" in line)
    assert "held-out success" in summary and "(v0 → v8, 8 prompts, greedy; evaluation" in summary
    hist = json.loads((tb / "history.json").read_text())
    kl = [h["reverse_kl"] for h in hist]
    assert len(kl) == 8 and all(h["mode"] == "stream-turn" for h in hist)
    assert sum(kl[-3:]) / 3 < 0.95 * sum(kl[:3]) / 3, kl  # the student moves toward the teacher
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(glob.glob(str(tb / "events*"))[0])
    ea.Reload()
    assert len(ea.Scalars("opd/reverse_kl")) == 8
    evals = json.loads((tb / "eval.json").read_text())  # held-out evaluation of the student: v0, every 4, the end
    assert [r["version"] for r in evals] == [0, 4, 8]
    assert [(e.step, round(e.value, 6)) for e in ea.Scalars("eval/mean_reward")] == [
        (r["version"], round(r["mean_reward"], 6)) for r in evals]


@pytest.mark.slow
def test_opd_full_vocab_stream_turn_pp2_matches_one_process(tmp_path):
    """``--opd-objective full-vocab --rl-mode stream-turn``, live rollouts: one process and PP=2 (torchrun, gloo: rank 0
    owns the rollout plane and broadcasts the chunks, each stage runs its layers per turn) train the same first step."""
    root = tmp_path / "models"
    _run([os.path.join(ROOT, "examples", "opd", "make_models.py"), str(root), "--teacher-steps", "30",
          "--student-steps", "5"], tmp_path)
    flags = ["megatron_tsync.train", "--rl-algorithm", "opd", "--teacher-model", str(root / "teacher"), "--model",
             str(root / "student"), "--rl-mode", "stream-turn", "--opd-objective", "full-vocab", "--group-size", "2",
             "--global-batch-size", "4", "--rollout-workers", "1", "--max-turns", "3", "--max-new-tokens", "16",
             "--seq-length", "128", "--lr", "1e-3", "--train-iters", "2", "--no-progress"]
    hist = {}
    for name, launch in (("pp1", ["-m"]), ("pp2", ["-m", "torch.distributed.run", "--nproc_per_node=2",
                                                   "--standalone", "-m"])):
        tb = tmp_path / f"tb_{name}"
        extra = ["--pipeline-model-parallel-size", "2"] if name == "pp2" else []
        out = _run([*launch, *flags, *extra, "--tensorboard-dir", str(tb)], tmp_path)
        assert "opd summary: mode stream-turn, 2 steps" in out, out
        hist[name] = json.loads((tb / "history.json").read_text())
    a, b = hist["pp1"][0], hist["pp2"][0]  # same θ0, same rollouts
    assert a["full_vocab_kl"] is not None and a["chunks"] == b["chunks"]
    for key in ("reverse_kl", "full_vocab_kl", "grad_norm", "loss"):
        assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a[key], b[key])
    assert all(h["mode"] == "stream-turn" for h in hist["pp1"] + hist["pp2"])



@pytest.mark.slow
def test_opd_moe_ep2_router_replay_stream_turn(tmp_path):
    """A tiny Qwen3-MoE student distilled from a MoE teacher with ``--moe-router-replay --rl-mode stream-turn`` on the
    embedded engine, two trainer ranks at expert parallelism 2 (torchrun, gloo): every turn event carries the
    engine's routing of its prefix (none is held back to the trajectory's end for lack of it), the student's turn
    forwards replay it in lockstep lanes across the EP ranks (the MoE teacher scores every turn on both), two steps
    run; the dumped trajectories carry routing. (Exactness of the same path: tests/training/test_moe_ep_opd.py.)"""
    from megatron_tsync.model.tiny_model import make_tiny_model
    from megatron_tsync.runtime.rollout_io import load_rollouts

    student = make_tiny_model(str(tmp_path / "student"), family="qwen3_moe", seed=3)
    teacher = make_tiny_model(str(tmp_path / "teacher"), family="qwen3_moe", seed=5)
    tb = tmp_path / "tb"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m",
                        "megatron_tsync.train", "--rl-algorithm", "opd", "--teacher-model", teacher, "--model", student,
                        "--moe-router-replay", "--expert-model-parallel-size", "2", "--rl-mode", "stream-turn",
                        "--group-size", "2", "--global-batch-size", "4", "--rollout-workers", "1", "--max-turns", "3",
                        "--max-new-tokens", "16", "--seq-length", "128", "--train-iters", "2", "--no-progress",
                        "--tensorboard-dir", str(tb), "--dump-rollouts", str(tmp_path / "dump")],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    assert "DP 2, CP 1, EP 2" in p.stdout and "opd summary: mode stream-turn, 2 steps" in p.stdout, p.stdout
    assert "learned at the trajectory's end" not in p.stdout + p.stderr  # every turn event had its routing
    hist = json.loads((tb / "history.json").read_text())
    assert all(h["mode"] == "stream-turn" and h["trajectories"] == 4 and h["chunks"] > 4 for h in hist)
    for step in (0, 1):
        samples, _ = load_rollouts(str(tmp_path / "dump"), step)
        assert len(samples) == 4 and all(s.routing is not None and 0 < s.routing.shape[0] < s.token_ids.numel()
                                         for s in samples)
