"""--deterministic live: two runs of the quickstart config with one seed but different arrival orders end with
torch.equal weights after 2 steps (the arrival orders differ in at least 1 of them; every step has a non-zero
gradient, so the equality is not that of two runs that never moved).

The quickstart config (``examples/tiny_agent/config.yaml``: tiny Llama made locally, supervised warm start, embedded
engine in a rollout worker process, sandboxed calculator, stream-trajectory) with 16 trajectories a step (4 groups
of 4) to keep it short. The arrival order is changed by tool-latency jitter: run A keeps the config's uniform
latency, run B a lognormal profile with another seed (``--latency-profile FILE.json``); the tokens and rewards are
the same (asserted from the rollout dumps), the arrival orders are not (asserted too). Control: the same pair
without --deterministic (1 step: later steps' rollouts would already differ) does not end with equal weights.

Expert parallelism: the same pair with two trainer ranks at EP = 2 on a tiny Qwen3-MoE, with a KL reference
(``--ref-model``, another tiny Qwen3-MoE) and an entropy bonus (a non-zero gradient through the experts whatever the
rewards), 2 steps: torch.equal weights too (every MoE forward — policy, π_ref — in lockstep over the EP ranks; one
trajectory per slot in deterministic mode, ``training/stream_fb.py``).

Not used here: 1 vs 2 rollout workers. The rollouts themselves differ then (the agent loop seeds a trajectory's
sampling with its position in the worker's own prompt list, ``derive_seed(seed, traj.index, turn)``), so that
comparison would test the workers, not the learner.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

# each run may take its subprocess timeout (900 s) on a loaded machine: the test as a whole gets more than pytest.ini's
# 600 s (the runs, not this figure, are what takes the time)
pytestmark = pytest.mark.timeout(1800)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "examples", "tiny_agent", "config.yaml")
JITTER = {"kind": "lognormal", "mu": 0.0, "sigma": 1.0, "group_corr": 0.5, "traj_corr": 0.3, "scale": 0.1, "seed": 7}
# the EP pair's run B: tool calls of 0-1 s (× the config's --latency-scale 0.05), against 25-75 ms in run A: its few
# tool calls (well-formed after 60 warm-start steps: the arrival orders differ in both steps; 30 leave them malformed:
# no call, no delay) land in other engine batches
EP_JITTER = {"kind": "uniform", "a": 0.0, "b": 1.0, "scale": 20.0, "seed": 7}


def _env(nproc=1):
    from tests.conftest import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") + (("MASTER_PORT",) if nproc > 1 else ()):
        env.pop(k, None)  # several trainer ranks: torchrun --standalone picks the rendezvous
    return env


def _run(tmp, name, model, iters, extra, nproc=1):
    out = tmp / name
    launch = [sys.executable, "-m", "megatron_tsync.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", "-m",
        "megatron_tsync.train"]
    args = [*launch, "--config", CONFIG, "--model", str(model), "--init-tiny-model",
            "--train-iters", str(iters), "--group-size", "4", "--global-batch-size", "16", "--rollout-workers", "1",
            "--save", str(out / "ck"), "--save-interval", str(iters), "--dump-rollouts", str(out / "dump"),
            "--no-progress", "--eval-interval", "0", *extra]
    p = subprocess.run(args, cwd=tmp, env=_env(nproc), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{name} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    assert f"summary: mode stream-trajectory, {iters} steps" in p.stdout
    (out / "stdout.txt").write_text(p.stdout)
    return out


def _weights(run, tmp):
    """Every tensor of the final checkpoint (weights and optimizer state; the HF export is checked elsewhere)."""
    from tests.conftest import checkpoint_tensors

    return checkpoint_tensors(run / "ck", tmp)


def _rollouts(run, k):
    """{traj_id: (reward, tokens)} and the arrival order of step k's dump."""
    from safetensors.torch import load_file

    d = run / "dump" / f"step_{k:07d}"
    meta = json.loads((d / "rollouts.json").read_text())
    toks = load_file(str(d / "rollouts.safetensors"))["token_ids"]
    trajs = {t["traj_id"]: (t["reward"], toks[t["offset"]:t["offset"] + t["length"]].tolist())
             for t in meta["trajectories"]}
    order = [t["traj_id"] for t in sorted(meta["trajectories"], key=lambda t: t["arrival_index"])]
    return trajs, order


def _pair(tmp, model, tag, iters, extra, nproc=1, runs=None, spec=JITTER):
    jitter = tmp / "jitter.json"
    jitter.write_text(json.dumps(spec))
    a = _run(tmp, f"{tag}_a", model, iters, extra, nproc)
    b = _run(tmp, f"{tag}_b", model, iters, [*extra, "--latency-profile", str(jitter)], nproc)
    if runs is not None:
        runs += [a, b]
    orders_differ = 0
    for k in range(iters):
        (ta, oa), (tb, ob) = _rollouts(a, k), _rollouts(b, k)
        assert ta == tb, f"step {k}: the two runs sampled different trajectories (not an arrival-order test)"
        orders_differ += oa != ob
    assert orders_differ >= max(1, iters // 2), f"arrival orders differ in only {orders_differ}/{iters} steps"
    return _weights(a, tmp), _weights(b, tmp)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny model folder: made by the first run that uses it (init-tiny-model in the config), reused after."""
    return tmp_path_factory.mktemp("det_live") / "model"


@pytest.mark.slow
def test_live_runs_bitwise_equal_with_deterministic(tmp_path, model):
    runs = []
    wa, wb = _pair(tmp_path, model, "det", 2, ["--deterministic", "--no-sequence-packing"], runs=runs)
    for run in runs:  # a real update in each step (the warm-started model's groups have reward variance)
        hist = json.loads((run / "ck" / "history.json").read_text())
        assert len(hist) == 2 and all(h["grad_norm"] > 0 for h in hist), hist
    assert set(wa) == set(wb)
    differ = [n for n in wa if not torch.equal(wa[n], wb[n])]
    assert not differ, f"{len(differ)}/{len(wa)} tensors differ: {differ[:5]}"


@pytest.mark.slow
def test_control_default_mode_differs_for_different_arrival_orders(tmp_path, model):
    """The control of the test above: the same pair without --deterministic ends with different weights (so the
    check above can fail)."""
    ca, cb = _pair(tmp_path, model, "default", 1, [])
    differ = [n for n in ca if not torch.equal(ca[n], cb[n])]
    assert differ, "the default mode gave equal weights for different arrival orders: the control cannot fail"
    print(f"default mode after 1 step: {len(differ)}/{len(ca)} tensors differ, max "
          f"{max(float((ca[n] - cb[n]).abs().max()) for n in differ):.2e}")


@pytest.mark.slow
def test_live_runs_bitwise_equal_at_ep2_with_kl_reference(tmp_path):
    """Two trainer ranks at EP = 2 (torchrun, live rollouts, tiny Qwen3-MoE), --deterministic with a KL reference and
    an entropy bonus: the two arrival orders end with torch.equal weights and optimizer state after 2 steps. Also what
    the live EP = 2 run must do: the warm start's loss falls (a real gradient through the all-to-alls), every step
    accounts for its 8 trajectories (2 groups: one per rank, one per minibatch, so π_θ0 runs on one rank beside idle
    forwards) and has a non-zero gradient."""
    import re

    from megatron_tsync.model.tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "moe"), family="qwen3_moe", seed=3)
    ref = make_tiny_model(str(tmp_path / "ref"), family="qwen3_moe", seed=4)
    runs = []
    wa, wb = _pair(tmp_path, model, "ep2", 2, ["--deterministic", "--no-sequence-packing", "--expert-model-parallel-size",
                                               "2", "--sft-warmup-steps", "60", "--max-new-tokens", "24",
                                               "--global-batch-size", "8",
                                               "--kl-mode", "loss", "--kl-coef", "0.1", "--ref-model", ref,
                                               "--entropy-coef", "0.01"], nproc=2, runs=runs, spec=EP_JITTER)
    for run in runs:
        out = (run / "stdout.txt").read_text()
        assert "TP 1, PP 1, DP 2, CP 1, EP 2" in out
        first, last = map(float, re.search(r"warm start: 60 steps, loss ([\d.]+) → ([\d.]+)", out).groups())
        assert last < 0.8 * first
        hist = json.loads((run / "ck" / "history.json").read_text())
        assert [h["trajectories"] for h in hist] == [8, 8] and all(h["grad_norm"] > 0 for h in hist)
    ha, hb = (json.loads((r / "ck" / "history.json").read_text()) for r in runs)
    assert [(h["loss"], h["grad_norm"]) for h in ha] == [(h["loss"], h["grad_norm"]) for h in hb]
    assert set(wa) == set(wb)
    differ = [n for n in wa if not torch.equal(wa[n], wb[n])]
    assert not differ, f"{len(differ)}/{len(wa)} tensors differ: {differ[:5]}"
