"""--deterministic live: two runs of the quickstart config with one seed but different arrival orders end with
torch.equal weights after 2 steps (the arrival orders differ in at least 1 of them; every step has a non-zero
gradient, so the equality is not that of two runs that never moved).

The quickstart config (``examples/tiny_agent/config.yaml``: tiny Llama made locally, supervised warm start, embedded
engine in a rollout worker process, sandboxed calculator, stream-trajectory) with 16 trajectories a step (4 groups
of 4) to keep it short; the warm start is made once for the module (``_warm_start.py``: the run's start-up, saved at
step 0) and each of the four runs loads it (``--load DIR --finetune``). The arrival order is changed by tool-latency
jitter: run A keeps the config's uniform latency, run B a lognormal profile with another seed (``--latency-profile
FILE.json``); the tokens and rewards are the same (asserted from the rollout dumps), the arrival orders are not
(asserted too). Control: the same pair
without --deterministic (1 step: later steps' rollouts would already differ) does not end with equal weights.

Expert parallelism: the same pair with two trainer ranks at EP = 2 on a tiny Qwen3-MoE, with a KL reference
(``--ref-model``, another tiny Qwen3-MoE) and an entropy bonus (a non-zero gradient through the experts whatever the
rewards), 2 steps: torch.equal weights too (every MoE forward — policy, π_ref — in lockstep over the EP ranks; one
trajectory per slot in deterministic mode, ``training/stream_fb.py``). Its own 60-step warm start in each run (the
loss must fall at EP = 2); run A is a module fixture, so each of the pair's two tests holds one two-rank run.

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
    _same_trajectories_other_orders(a, b, iters)
    return _weights(a, tmp), _weights(b, tmp)


def _same_trajectories_other_orders(a, b, iters):
    """Both runs sampled the same trajectories every step, and their arrival orders differ in at least half."""
    orders_differ = 0
    for k in range(iters):
        (ta, oa), (tb, ob) = _rollouts(a, k), _rollouts(b, k)
        assert ta == tb, f"step {k}: the two runs sampled different trajectories (not an arrival-order test)"
        orders_differ += oa != ob
    assert orders_differ >= max(1, iters // 2), f"arrival orders differ in only {orders_differ}/{iters} steps"


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """(model folder, flags): the tiny model (init-tiny-model in the config) and the config's supervised warm start,
    made once for the module by ``_warm_start.py`` (the run's own start-up, saved at step 0); each run of the dense
    pair and its control loads it with ``--load DIR --finetune`` and skips the warm start (the saved state says it is
    done) instead of repeating it: the same starting weights in every run, as when each made them itself."""
    tmp = tmp_path_factory.mktemp("det_live")
    model, ws = tmp / "model", tmp / "warm_start"
    args = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_warm_start.py"), "--config",
            CONFIG, "--model", str(model), "--init-tiny-model", "--rollout-workers", "1", "--save", str(ws),
            "--no-progress", "--eval-interval", "0"]
    p = subprocess.run(args, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"warm start failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    assert "supervised warm start: 175 steps" in p.stdout, p.stdout[-3000:]
    return model, ["--load", str(ws), "--finetune"]


@pytest.mark.slow
def test_live_runs_bitwise_equal_with_deterministic(tmp_path, warm):
    model, load = warm
    runs = []
    wa, wb = _pair(tmp_path, model, "det", 2, [*load, "--deterministic", "--no-sequence-packing"], runs=runs)
    for run in runs:  # a real update in each step (the warm-started model's groups have reward variance)
        assert "supervised warm start" not in (run / "stdout.txt").read_text()  # loaded, not redone
        hist = json.loads((run / "ck" / "history.json").read_text())
        assert len(hist) == 2 and all(h["grad_norm"] > 0 for h in hist), hist
    assert set(wa) == set(wb)
    differ = [n for n in wa if not torch.equal(wa[n], wb[n])]
    assert not differ, f"{len(differ)}/{len(wa)} tensors differ: {differ[:5]}"


@pytest.mark.slow
def test_control_default_mode_differs_for_different_arrival_orders(tmp_path, warm):
    """The control of the test above: the same pair without --deterministic ends with different weights (so the
    check above can fail)."""
    model, load = warm
    ca, cb = _pair(tmp_path, model, "default", 1, load)
    differ = [n for n in ca if not torch.equal(ca[n], cb[n])]
    assert differ, "the default mode gave equal weights for different arrival orders: the control cannot fail"
    print(f"default mode after 1 step: {len(differ)}/{len(ca)} tensors differ, max "
          f"{max(float((ca[n] - cb[n]).abs().max()) for n in differ):.2e}")


EP2_ITERS = 2


def _ep2_extra(ref):
    return ["--deterministic", "--no-sequence-packing", "--expert-model-parallel-size", "2", "--sft-warmup-steps", "60",
            "--max-new-tokens", "24", "--global-batch-size", "8", "--kl-mode", "loss", "--kl-coef", "0.1",
            "--ref-model", ref, "--entropy-coef", "0.01"]


def _check_ep2_run(run):
    """What the live EP = 2 run must do: the layout, the warm start's loss falls (a real gradient through the
    all-to-alls), every step accounts for its 8 trajectories (2 groups: one per rank, one per minibatch, so π_θ0 runs
    on one rank beside idle forwards) and has a non-zero gradient."""
    import re

    out = (run / "stdout.txt").read_text()
    assert "TP 1, PP 1, DP 2, CP 1, EP 2" in out
    first, last = map(float, re.search(r"warm start: 60 steps, loss ([\d.]+) → ([\d.]+)", out).groups())
    assert last < 0.8 * first
    hist = json.loads((run / "ck" / "history.json").read_text())
    assert [h["trajectories"] for h in hist] == [8, 8] and all(h["grad_norm"] > 0 for h in hist)
    return hist


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    """The EP = 2 pair's models and its run A (the uniform latency), made by the first test that asks and shared by
    both (each test then holds one two-rank run, not two: under the suite's 90 s per test on two busy cores)."""
    from megatron_tsync.model.tiny_model import make_tiny_model

    tmp = tmp_path_factory.mktemp("det_live_ep2")
    model = make_tiny_model(str(tmp / "moe"), family="qwen3_moe", seed=3)
    ref = make_tiny_model(str(tmp / "ref"), family="qwen3_moe", seed=4)
    runs = {}

    def get(name):
        if name not in runs:
            extra = _ep2_extra(ref)
            if name == "b":  # tool calls of 0-1 s: other engine batches, other arrival orders
                jitter = tmp / "ep2_jitter.json"
                jitter.write_text(json.dumps(EP_JITTER))
                extra += ["--latency-profile", str(jitter)]
            runs[name] = _run(tmp, f"ep2_{name}", model, EP2_ITERS, extra, nproc=2)
        return runs[name]

    return get


@pytest.mark.slow
def test_live_run_at_ep2_warm_starts_and_updates(ep2):
    """Run A of the pair below (two trainer ranks at EP = 2, live rollouts, tiny Qwen3-MoE, --deterministic, KL
    reference, entropy bonus): the layout, the warm start's loss falls, 8 trajectories and a non-zero gradient a
    step (its weights are compared with run B's below)."""
    _check_ep2_run(ep2("a"))


@pytest.mark.slow
def test_live_runs_bitwise_equal_at_ep2_with_kl_reference(ep2, tmp_path):
    """Two trainer ranks at EP = 2 (torchrun, live rollouts, tiny Qwen3-MoE), --deterministic with a KL reference and
    an entropy bonus: the two arrival orders (run A: the config's uniform latency, run B: ``EP_JITTER``) end with
    torch.equal weights and optimizer state after 2 steps, both runs having done what the test above asserts of A
    (a falling warm start, real updates in both steps)."""
    a, b = ep2("a"), ep2("b")
    ha, hb = _check_ep2_run(a), _check_ep2_run(b)
    _same_trajectories_other_orders(a, b, EP2_ITERS)
    assert [(h["loss"], h["grad_norm"]) for h in ha] == [(h["loss"], h["grad_norm"]) for h in hb]
    wa, wb = _weights(a, tmp_path), _weights(b, tmp_path)
    assert set(wa) == set(wb)
    differ = [n for n in wa if not torch.equal(wa[n], wb[n])]
    assert not differ, f"{len(differ)}/{len(wa)} tensors differ: {differ[:5]}"
