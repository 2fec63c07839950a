"""Validate the planner (``megatron_tsync.plan``) on this machine: calibrate, measure, predict, compare — one command.

    python tools/validate_plan.py --out runs/plan_validation.json           # ≈ 5–10 min on an idle 2-core machine
    python tools/validate_plan.py --quick                                    # 1 repeat, 2 steps (a smoke run)

1. Calibration: the release-time benchmark's learner (``tools/bench_streaming.py``'s Harness: the real Megatron
   learner, hidden 128, 2 layers, one process) times every trajectory's forward + backward of a batch alone, the
   whole batch in one schedule call, and the barrier (medians of 3); a least-squares line over the single calls and
   the batch call give the simulated learner's :class:`LearnerCost`: per schedule call, per microbatch, per token
   (``calibrate``). The real planner's own CPU time is counted as the simulation runs it.
2. Measurements: for each latency profile (``--profiles``, default swe-like and uniform) × batch (``--batches``,
   groups × size, default 4x4 and 8x8): the benchmark's arrival pattern scaled so the rollout makespan is
   ``--makespan-ratio`` × the calibrated learner work; each mode (sync, stream-trajectory, async) runs ``--steps``
   steps from θ0 with ``Harness.run_mode``; interleaved — for each repeat, each configuration, each mode — so drift
   of the machine hits every cell alike. A run's figure is its mean step; the spread is min–max over repeats. The
   calibration is repeated at the start of every repeat (the release times stay those placed with the first).
3. Predictions: the same release times and trajectories (token counts, rewards) through the simulator's learner
   (``plan.learner.simulate_rank``: the real StepPlanner's order, the calibrated costs). Async, as the benchmark
   runs it: step k's releases are shifted back by the duration of step k − 1 — the simulated one (clamped at 0).
   Each repeat is predicted with its own calibration; a cell's prediction is the mean over repeats.
4. The predicted-vs-measured table (markdown, README-ready) and the JSON (``--out``): per cell measured mean, spread,
   predicted, error; the machine's load average before and after. Each prediction is made before its measurement is
   looked at: nothing is fitted to the measured steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")

MODES = ("sync", "stream-trajectory", "async")


def measure(h, batch, reps: int = 3):
    """Measured learner seconds (medians of ``reps``): each trajectory alone in its own schedule call, all of them in
    one call, and the barrier (the benchmark's learner, ``Harness.measure_work``'s set-up)."""
    from megatron_tsync.streaming.planner import Dest, StepPlanner, WorkItem
    from megatron_tsync.training.learner import shape_for
    from megatron_tsync.training.optimizer import finalize_and_scale

    ddp, L = h.learner("sync")
    sizes, shape = shape_for(batch)
    L.exec.begin_step(StepPlanner(L.estimator, sizes, mode="sync", reward_spec=L.cfg.reward_spec,
                                  loss_kind="ppo_clip"), shape)
    items = []
    for s in batch:
        L.exec.add_sample(s)
        items.append(WorkItem(s.traj_id, s.group_id, s.reward, Dest.ACCUM, advantage=0.5))

    def timed(fn):
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    singles = [timed(lambda it=it: L.exec.run([it])) for it in items]
    together = timed(lambda: L.exec.run(items))

    def barrier():
        finalize_and_scale(ddp, 1.0)
        L.opt.step()
        ddp.zero_grad_buffer()

    return singles, together, timed(barrier)


def calibrate(h, batch) -> tuple[object, dict]:
    """The simulated learner's cost from measured microbatch times (module docstring, 1): a least-squares line
    a + b·T over the single calls; the batch in one call then splits a into the per-call and per-microbatch parts
    (n·overhead + call = together − b·ΣT, overhead + call = a)."""
    from megatron_tsync.plan.learner import LearnerCost

    singles, together, barrier = measure(h, batch)
    xs = [s.token_ids.shape[0] for s in batch]
    mx, my = statistics.mean(xs), statistics.mean(singles)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, singles)) / sxx if sxx > 0 else 0.0)
    a = max(0.0, my - slope * mx)
    n = len(xs)
    per_mb = min(a, max(0.0, (together - slope * sum(xs) - a) / (n - 1))) if n > 1 else a
    resid = [y - (a + slope * x) for x, y in zip(xs, singles)]
    fit = {"overhead_s": per_mb, "call_s": a - per_mb, "per_token_s": slope, "barrier_s": barrier, "points": n,
           "residual_sd_s": statistics.pstdev(resid), "together_s": together, "singles_sum_s": sum(singles)}
    return LearnerCost(overhead_s=per_mb, per_token_s=slope, barrier_s=barrier, call_s=a - per_mb,
                       planner_time=True), fit


def trajs_of(batch, step):
    """The benchmark's samples as the simulator's trajectories (same ids, token counts, rewards)."""
    from megatron_tsync.plan.workload import Traj, Turn

    out = []
    for s in batch:
        T = int(s.token_ids.shape[0])
        g = int(s.group_id.split("g")[-1])
        i = int(s.traj_id.split("t")[-1])
        out.append(Traj(g, i, (Turn(1, T - 1, 0.0),), 0.0, float(s.reward), step))
    return out


def predict(cost, workload, arrivals, mode) -> list[float]:
    """Simulated step seconds, step by step, of one benchmark run (module docstring, 3)."""
    from megatron_tsync.plan.learner import PlannerSettings, simulate_rank

    steps, prev = [], None
    for k, (batch, arr) in enumerate(zip(workload, arrivals)):
        offset = -prev if (mode == "async" and prev is not None) else 0.0
        trajs = trajs_of(batch, k)
        rel = [(max(0.0, a + offset), tr) for a, tr in zip(arr, trajs)]
        plan_mode = "sync" if mode == "async" else mode
        tl = simulate_rank(cost, PlannerSettings(), rel, plan_mode, 0, 1)
        steps.append(tl.end_s)
        prev = tl.end_s
    return steps


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default="swe-like,uniform")
    ap.add_argument("--batches", default="4x4,8x8", help="comma-separated GROUPSxSIZE")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--makespan-ratio", type=float, default=1.0)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="1 repeat, 2 steps (smoke run; no spread)")
    ap.add_argument("--out", default=None, help="JSON results")
    a = ap.parse_args(argv)
    if a.quick:
        a.repeats, a.steps = 1, 2
    try:
        a.batch_list = [tuple(int(x) for x in b.split("x")) for b in a.batches.split(",") if b]
    except ValueError:
        ap.error(f"--batches {a.batches!r}: expected GROUPSxSIZE,... such as 4x4,8x8")
    if not a.batch_list or any(len(b) != 2 or min(b) < 1 for b in a.batch_list):
        ap.error(f"--batches {a.batches!r}: expected GROUPSxSIZE,... such as 4x4,8x8")
    if a.steps < 1 or a.repeats < 1 or a.makespan_ratio <= 0:
        ap.error("--steps and --repeats must be >= 1, --makespan-ratio > 0")
    return a


def main(argv=None) -> dict:
    import bench_streaming as bs

    a = _args(argv)
    t_begin, load0 = time.time(), os.getloadavg()
    h = bs.Harness(argparse.Namespace(hidden=128, layers=2))
    configs = []
    for prof in [p for p in a.profiles.split(",") if p]:
        for groups, G in a.batch_list:
            wl = bs.build_workload(a.steps, groups, G, a.seed, 512, 48, 160)
            configs.append({"profile": prof, "groups": groups, "group_size": G, "workload": wl})
    cal = configs[-1]["workload"][0]
    cost, fit = calibrate(h, cal)
    for c in configs:  # the release times, fixed for every repeat (placed with the first calibration)
        raw = bs.arrival_pattern(c["profile"], a.steps, c["groups"], c["group_size"], a.seed, a.calls)
        work = cost.call_s + sum(cost.microbatch_s(s.token_ids.shape[0]) for s in c["workload"][0])
        c["arrivals"] = bs.scale_arrivals(raw, a.makespan_ratio, work)
        c["predicted"] = {m: [] for m in MODES}
        c["measured"] = {m: [] for m in MODES}
    fits = []
    cpu = bs.RolloutCPU(0.0, 1)
    try:
        for rep in range(a.repeats):
            if rep > 0:  # recalibrate with every repeat: the prediction uses the machine as it is now
                cost, fit = calibrate(h, cal)
            fits.append(fit)
            print(f"repeat {rep} calibration: {fit['call_s'] * 1e3:.2f} ms per schedule call + "
                  f"{fit['overhead_s'] * 1e3:.2f} ms + {fit['per_token_s'] * 1e6:.1f} µs/token per microbatch "
                  f"(residual sd {fit['residual_sd_s'] * 1e3:.2f} ms), barrier {fit['barrier_s'] * 1e3:.1f} ms",
                  file=sys.stderr, flush=True)
            for c in configs:
                for m in MODES:
                    c["predicted"][m].append(predict(cost, c["workload"], c["arrivals"], m))
                    rows, _ = h.run_mode(m, c["workload"], c["arrivals"], cpu)
                    c["measured"][m].append([r["step_s"] for r in rows])
                    print(f"repeat {rep} {c['profile']} {c['groups']}x{c['group_size']} {m}: "
                          f"{statistics.mean(r['step_s'] for r in rows):.3f} s/step (predicted "
                          f"{statistics.mean(c['predicted'][m][-1]):.3f})", file=sys.stderr, flush=True)
    finally:
        cpu.close()
    out = summarize(a, configs, fits, load0, t_begin)
    print(out["markdown"])
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


def summarize(a, configs, fits, load0, t_begin) -> dict:
    cells = []
    for c in configs:
        for m in MODES:
            runs = [statistics.mean(r) for r in c["measured"][m]]
            meas = statistics.mean(runs)
            preds = [statistics.mean(r) for r in c["predicted"][m]]
            pred = statistics.mean(preds)
            cells.append({"profile": c["profile"], "batch": f"{c['groups']}x{c['group_size']}", "mode": m,
                          "measured_step_s": meas, "spread": [min(runs), max(runs)], "per_repeat_step_s": runs,
                          "predicted_step_s": pred, "error": pred / meas - 1.0, "per_repeat_predicted_s": preds,
                          "per_repeat_error": [p / r - 1.0 for p, r in zip(preds, runs)],
                          "predicted_steps_s": c["predicted"][m], "measured_steps_s": c["measured"][m]})
    load1 = os.getloadavg()
    lines = [f"Predicted vs measured step time (tools/validate_plan.py, {a.repeats} interleaved repeats × {a.steps} "
             f"steps, makespan = {a.makespan_ratio:g} × learner work; load average {load0[0]:.2f} before, "
             f"{load1[0]:.2f} after; {os.cpu_count()} cores):", "",
             "| profile | groups × size | mode | measured s/step (min–max) | predicted s/step | error | vs fastest run |",
             "|---|---|---|---|---|---|---|"]
    for x in cells:
        lines.append(f"| {x['profile']} | {x['batch']} | {x['mode']} | {x['measured_step_s']:.3f} "
                     f"({x['spread'][0]:.3f}–{x['spread'][1]:.3f}) | {x['predicted_step_s']:.3f} | "
                     f"{x['error']:+.0%} | {x['predicted_step_s'] / x['spread'][0] - 1:+.0%} |")
    within = sum(abs(x["error"]) <= 0.15 for x in cells)
    lines += ["", f"{within} of {len(cells)} cells within ±15 %."]
    return {"calibration": fits, "cells": cells, "within_15pct": within, "load_avg_before": load0,
            "load_avg_after": load1, "cores": os.cpu_count(), "seconds": time.time() - t_begin,
            "settings": {k: v for k, v in vars(a).items() if k != "batch_list"}, "markdown": "\n".join(lines)}


if __name__ == "__main__":
    main(sys.argv[1:])
