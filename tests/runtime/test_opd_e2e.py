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
import torch

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


@pytest.fixture(scope="module")
def opd_models(tmp_path_factory):
    """examples/opd/make_models.py once for the module: a teacher after 150 supervised steps, a student after 10 (the
    live tests' teacher and student: the same tokenizer, the student well behind)."""
    tmp = tmp_path_factory.mktemp("opd_models")
    root = tmp / "models"
    _run([os.path.join(ROOT, "examples", "opd", "make_models.py"), str(root), "--teacher-steps", "150",
          "--student-steps", "10"], tmp)
    return root


@pytest.mark.slow
def test_opd_stream_turn_reverse_kl_falls(opd_models, tmp_path):
    root = opd_models
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
def test_opd_full_vocab_stream_turn_pp2_matches_one_process(opd_models, tmp_path):
    """``--opd-objective full-vocab --rl-mode stream-turn``, live rollouts: one process and PP=2 (torchrun, gloo: rank 0
    owns the rollout plane and broadcasts the chunks, each stage runs its layers per turn) train the same first step
    (from the module's teacher and student: the runs only need the same θ0, not a particular one)."""
    root = opd_models
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


def _opd_dump(root, model_dir, steps=2, groups=2, G=4, seed=0):
    """A rollout dump with recorded teacher log-probs and turn ends (what an OPD run with --dump-rollouts writes):
    an OPD replay needs no teacher model, and stream-turn learns every trajectory turn by turn."""
    from megatron_tsync.runtime.rollout_io import dump_rollouts
    from megatron_tsync.streaming.ready_queue import Sample

    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    for k in range(steps):
        samples = []
        for gi in range(groups):
            for i in range(G):
                T = int(torch.randint(14, 30, (1,), generator=g))
                mask = torch.zeros(T)
                mask[5:] = 1
                mask[T // 2 : T // 2 + 3] = 0  # a tool output between two turns
                beh = -torch.rand(T, generator=g, dtype=torch.float64) * mask.double()
                teacher = -torch.rand(T, generator=g, dtype=torch.float64) * mask.double()
                samples.append(Sample(f"s{k}g{gi}t{i}", f"s{k}g{gi}", G, torch.randint(0, vocab, (T,), generator=g),
                                      mask, 0.0, policy_version=k, behaviour_logp=beh, teacher_logp=teacher,
                                      meta={"turn_ends": [T // 2 + 3]}))
        dump_rollouts(root, k, samples, [f"s{k}g{gi}" for gi in range(groups)])


@pytest.mark.slow
def test_opd_dump_grads_stream_turn_equals_sync_float64(tmp_path):
    """``--dump-grads`` with ``--rl-algorithm opd`` (a verification run: float64, SGD, no clipping) writes each step's
    normalised gradient, ``grad_step_{k:07d}`` (one update per OPD step), and a replay in stream-turn dumps the
    gradient the synchronous path computes from the same trajectories (≤ 1e-12 relative)."""
    from safetensors.torch import load_file

    from megatron_tsync.model.tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "student"), seed=0)
    dump = tmp_path / "dump"
    _opd_dump(str(dump), model)
    common = ["-m", "megatron_tsync.train", "--rl-algorithm", "opd", "--model", model, "--replay-rollouts", str(dump),
              "--train-iters", "2", "--group-size", "4", "--global-batch-size", "8", "--params-dtype", "float64",
              "--optimizer", "sgd", "--lr", "0.5", "--clip-grad", "0", "--seq-length", "64", "--no-progress"]
    for mode in ("sync", "stream-turn"):
        out = _run([*common, "--rl-mode", mode, "--dump-grads", str(tmp_path / f"g_{mode}")], tmp_path)
        assert f"opd summary: mode {mode}, 2 steps" in out, out
    for k in range(2):
        a = load_file(str(tmp_path / "g_sync" / f"grad_step_{k:07d}.safetensors"))
        b = load_file(str(tmp_path / "g_stream-turn" / f"grad_step_{k:07d}.safetensors"))
        assert set(a) == set(b) and a["model.embed_tokens.weight"].dtype == torch.float64
        num = sum(float((a[n] - b[n]).pow(2).sum()) for n in a) ** 0.5
        den = sum(float(a[n].pow(2).sum()) for n in a) ** 0.5
        assert den > 0 and num / den < 1e-12, (k, num / den)
        meta = json.loads((tmp_path / "g_sync" / f"grad_step_{k:07d}.json").read_text())
        assert meta["step"] == k and (meta["epochs"], meta["minibatches"]) == (1, 1) and meta["divisor"] > 0
        assert abs(meta["grad_norm"] - den) <= 1e-12 * den
