"""Fixed wall-clock budget: which mode ends with the better policy after the same seconds of RL?

    python tools/bench_fixed_budget.py --budget 150 --seeds 2            # sync, stream-trajectory, async; 200 prompts
    python tools/bench_fixed_budget.py --budget 20 --seeds 2 --eval-prompts 16 --eval-points 2   # a smoke run

Every run starts from the same cached supervised warm start (``tools/bench_live.py``'s, same ``--warm-dir``) and
trains the quickstart task with the real trainer and rollout workers (``python -m megatron_tsync.train``,
``--save-interval 1``). RL time starts when the trainer publishes the first weights (its rollout plane's weights
folder fills) and the run is stopped with SIGUSR1 once ``--budget`` seconds have passed (the trainer finishes the
step in flight and saves). The policy "at b seconds" is the checkpoint after the last step whose cumulative
``wall_step_s`` (the trainer's own per-step log: rollouts, learner, the next publish; checkpoint saves excluded)
is <= b, so a mode is never credited with a step that ended after the budget. Step 0 of every run includes the
rollout workers' start-up (they build their engines while the clock runs): the same few seconds in every mode.
Modes are interleaved per seed (the order rotates), and each run uses the CPU split of ``--cpus`` (default: split
the allowed cores).

Held-out evaluation (``examples/tiny_agent/evaluate.py``'s ``evaluate``: the embedded engine, the agent loop, the
sandboxed calculator, the task's ``eval`` split, disjoint from training prompts): the same ``--eval-prompts``
prompts and sampling seed for every checkpoint, at ``--eval-points`` budgets b = B·j/P (j = 0 is the warm start
itself). Evaluation runs after all training, so it takes no CPU from any run.

Writes ``--out`` (JSON: machine, settings, per run the steps and cumulative RL seconds, every evaluation), a PNG of
held-out success against RL wall-clock (``--plot``; needs matplotlib: ``pip install -e ".[tests]"``), and prints
a table of the success at the budget per mode and seed (± its standard error) with the machine stated.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_live as bl  # noqa: E402 - the shared warm start, task flags, machine facts

ROOT = bl.ROOT
MODES = ("sync", "stream-trajectory", "async")


# ------------------------------------------------------------------------------------------------------ training
def train_for(a, base, model, ckpt, mode: str, seed: int, cpus: list[str]) -> dict:
    """One budgeted run: returns its steps' cumulative RL seconds and its checkpoint folder."""
    out = os.path.join(a.work_dir, f"s{seed}_{mode}")
    save, plane = os.path.join(out, "ckpt"), os.path.join(out, "rp")  # short: the ipc socket path is bounded
    argv = [sys.executable, "-m", "megatron_tsync.train", *base, "--model", model, "--load", ckpt, "--finetune",
            "--sft-warmup-steps", "0", "--rl-mode", mode, "--train-iters", str(a.max_steps), "--seed", str(seed),
            "--save", save, "--save-interval", "1", "--rollout-dir", plane, "--no-progress", *cpus,
            *(["--max-staleness", str(a.max_staleness)] if mode == "async" else []), *a.train_args]
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(bl._free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    with open(os.path.join(out, "train.log"), "w") as log:
        p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        t_rl0 = _wait_rl_start(p, os.path.join(plane, "weights"), a.timeout)
        # the budget, and at least one finished step (its checkpoint, --save-interval 1): a stop that lands before
        # step 0 begins (a loaded machine, a budget shorter than the start-up) would end the run with no step at
        # all; steps that end past the budget are not counted (checkpoint_at)
        first = os.path.join(save, "iter_0000001")
        while p.poll() is None and (time.perf_counter() - t_rl0 < a.budget or not os.path.isdir(first)):
            time.sleep(0.2)
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)  # finishes the step in flight, saves, exits (SIGTERM would abort it)
        rc = p.wait(timeout=a.timeout)
    if rc != 0:
        raise RuntimeError(f"{mode} seed {seed} failed ({rc}); see {out}/train.log")
    with open(os.path.join(save, "history.json")) as f:
        hist = json.load(f)
    cum, t = [], 0.0
    for h in hist:
        t += h["wall_step_s"]
        cum.append(t)
    return {"mode": mode, "seed": seed, "ckpt": save, "steps": len(hist), "cum_rl_s": cum,
            "success_rate_train": [h["success_rate"] for h in hist]}


def _wait_rl_start(p, weights_dir: str, timeout_s: float) -> float:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"the trainer exited ({p.returncode}) before its first publish")
        if os.path.isdir(weights_dir) and os.listdir(weights_dir):
            return time.perf_counter()
        time.sleep(0.05)
    raise TimeoutError(f"no first publish in {weights_dir} within {timeout_s:.0f}s")


def checkpoint_at(run: dict, budget: float) -> int:
    """The checkpoint iteration of ``run`` at ``budget`` RL seconds (0 = the warm start): steps 0..k ended by then,
    and the checkpoint after step k is iteration k + 1."""
    done = [k for k, t in enumerate(run["cum_rl_s"]) if t <= budget]
    return done[-1] + 1 if done else 0


# ------------------------------------------------------------------------------------------------------ evaluation
_EVAL = r"""
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("ev", os.path.join(sys.argv[1], "examples", "tiny_agent", "evaluate.py"))
ev = importlib.util.module_from_spec(spec); spec.loader.exec_module(ev)
import torch
from tokenizers import Tokenizer
from megatron_tsync.model.builder import build_model
from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel
from megatron_tsync.model.tokenizer import TokenizerCodec
from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
from megatron_tsync.runtime.tasks import get_task
from megatron_tsync.training.checkpointing import arch_from_checkpoint, load_checkpoint
torch.set_num_threads(1)
n, seed = int(sys.argv[2]), int(sys.argv[3])
initialize_parallel(1, 1, seed=seed)
task = get_task("arithmetic-calculator")
for item in sys.argv[4:]:
    d, step = item.rsplit(":", 1)
    model = build_model(arch_from_checkpoint(d), seed=0)
    if load_checkpoint(d, model, step=int(step), load_rng=False) is None:
        sys.exit(f"no checkpoint at iteration {step} in {d}")
    codec = TokenizerCodec(Tokenizer.from_file(os.path.join(d, "hf_assets", "tokenizer.json")))
    out = ev.evaluate(EmbeddedEngine(model), codec, task, num_prompts=n, seed=seed)
    out.pop("example")
    print("EVAL " + json.dumps({"ckpt": d, "step": int(step), **out}), flush=True)
destroy_parallel()
"""


def evaluate(a, items: list[tuple[str, int]]) -> dict[tuple[str, int], dict]:
    """Held-out success of each (checkpoint folder, iteration), one process for all."""
    if not items:
        return {}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(bl._free_port()))
    p = subprocess.run([sys.executable, "-c", _EVAL, ROOT, str(a.eval_prompts), str(a.eval_seed),
                        *(f"{d}:{s}" for d, s in items)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=a.timeout * 4)
    if p.returncode != 0:
        raise RuntimeError(f"evaluation failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    got = [json.loads(line[5:]) for line in p.stdout.splitlines() if line.startswith("EVAL ")]
    return {(g["ckpt"], g["step"]): g for g in got}


# ------------------------------------------------------------------------------------------------------ report
def curves(runs: list[dict], warm_ckpt: str, evals: dict, points: list[float]) -> list[dict]:
    """Per run: [(budget, steps done, held-out success, stderr)] at every evaluation point."""
    out = []
    for r in runs:
        pts = []
        for b in points:
            it = checkpoint_at(r, b)
            e = evals[(warm_ckpt, 0)] if it == 0 else evals[(r["ckpt"], it)]
            pts.append({"budget_s": b, "steps": it, "success_rate": e["success_rate"], "stderr": e["stderr"]})
        out.append({"mode": r["mode"], "seed": r["seed"], "points": pts})
    return out


def table(curves_: list[dict], mach: dict, cpus: list[str], budget: float) -> str:
    rows = [f"machine: {mach['cores']} cores (allowed {mach['cores_allowed']}), {mach['cpu_model']}; load avg "
            f"{mach['load_before'][0]:.2f} before / {mach['load_after'][0]:.2f} after training; cpu split "
            f"{' '.join(cpus) or 'none'}; budget {budget:.0f}s of RL",
            f"{'mode':<18} {'seed':>5} {'steps':>6} {'held-out success':>18}"]
    by_mode: dict[str, list[float]] = {}
    for c in curves_:
        last = c["points"][-1]
        by_mode.setdefault(c["mode"], []).append(last["success_rate"])
        rows.append(f"{c['mode']:<18} {c['seed']:>5} {last['steps']:>6} "
                    f"{last['success_rate']:>10.3f} ± {last['stderr']:.3f}")
    for mode, xs in by_mode.items():
        rows.append(f"{mode:<18} {'mean':>5} {'':>6} {statistics.mean(xs):>10.3f}")
    return "\n".join(rows)


def plot(curves_: list[dict], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench_fixed_budget] matplotlib is not installed (pip install -e '.[tests]'): no plot", flush=True)
        return False
    colors = {"sync": "tab:blue", "stream-trajectory": "tab:green", "async": "tab:red"}
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, c in enumerate(curves_):
        xs = [p["budget_s"] for p in c["points"]]
        ys = [p["success_rate"] for p in c["points"]]
        es = [p["stderr"] for p in c["points"]]
        ax.errorbar(xs, ys, yerr=es, color=colors.get(c["mode"], f"C{i}"), marker="o", capsize=2,
                    linestyle="-" if c["seed"] == curves_[0]["seed"] else "--", label=f"{c['mode']} seed {c['seed']}")
    ax.set_xlabel("RL wall-clock (s)")
    ax.set_ylabel("held-out success")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------------ main
def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--budget", type=float, default=150.0, help="RL seconds per run")
    p.add_argument("--seeds", type=int, default=2, help="seeds (>= 2 for the experiment)")
    p.add_argument("--seed", type=int, default=1234, help="first seed")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=10000, help="step cap (the budget stops a run first)")
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--eval-points", type=int, default=4, help="evaluations per run along the budget")
    p.add_argument("--eval-seed", type=int, default=4321)
    p.add_argument("--cpus", default="split", help="split | none | TRAINER:ROLLOUT")
    p.add_argument("--config", default=bl.CONFIG)
    p.add_argument("--sft-steps", type=int, default=None, help="warm start SFT steps (default: the config's)")
    p.add_argument("--warm-dir", default=os.path.join(ROOT, "runs", "bench_live", "warm"))
    p.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bench_fixed_budget", "runs"))
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_fixed_budget", "result.json"))
    p.add_argument("--plot", default=None, help="PNG path (default: next to --out)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--train-args", default="")
    a = p.parse_args(argv)
    a.modes = [m for m in a.modes.split(",") if m]
    if not a.modes or set(a.modes) - set(bl.MODES):
        p.error(f"--modes: choose from {bl.MODES}")
    if a.budget <= 0 or a.seeds < 1 or a.eval_points < 1 or a.eval_prompts < 1:
        p.error("--budget, --seeds, --eval-points and --eval-prompts must be positive")
    a.train_args = a.train_args.split()
    a.plot = a.plot or os.path.splitext(a.out)[0] + ".png"
    return a


def main(argv=None) -> int:
    a = parse(argv)
    base = bl.task_args(a.config)
    if a.sft_steps is None:
        import yaml

        with open(a.config) as f:
            a.sft_steps = int((yaml.safe_load(f) or {}).get("sft-warmup-steps", 0))
    mach, cpus = bl.machine(), bl.cpu_flags(a.cpus)
    model, ckpt = bl.warm_start(a, base)
    runs = []
    for i, seed in enumerate(range(a.seed, a.seed + a.seeds)):
        for mode in a.modes[i % len(a.modes):] + a.modes[:i % len(a.modes)]:
            r = train_for(a, base, model, ckpt, mode, seed, cpus)
            runs.append(r)
            print(f"[bench_fixed_budget] seed {seed} {mode}: {r['steps']} steps, last ended at "
                  f"{r['cum_rl_s'][-1] if r['cum_rl_s'] else 0:.1f}s of RL", flush=True)
    mach.update(load_before=mach.pop("load_avg"), load_after=os.getloadavg())
    points = [a.budget * j / a.eval_points for j in range(a.eval_points + 1)]
    items = {(ckpt, 0)} | {(r["ckpt"], checkpoint_at(r, b)) for r in runs for b in points if checkpoint_at(r, b)}
    evals = evaluate(a, sorted(items))
    cs = curves(runs, ckpt, evals, points)
    result = {"machine": mach, "cpu_flags": cpus, "settings": vars(a), "runs": runs, "curves": cs,
              "evals": list(evals.values())}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    text = table(cs, mach, cpus, a.budget)
    print(text)
    if plot(cs, a.plot, f"{a.budget:.0f}s RL after the warm start, {a.eval_prompts} held-out prompts; "
                        f"{mach['cores']} cores, load {mach['load_before'][0]:.1f}"):
        print(f"[bench_fixed_budget] plot {a.plot}")
    print(f"[bench_fixed_budget] wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
