"""Side-by-side benchmark of the learner modes on one workload: sync, stream-group, stream-trajectory, async.

Every mode trains the same trajectories (same seeds, same prompts' token sequences, same rewards) with the real
Megatron learner on this machine, starting from the same θ0. Rewards land at the times of a rollout-plane
arrival pattern drawn from a latency profile (``--profile`` / ``--latency-profile FILE.json``); the learner sees
them on the wall clock through the same ready-queue interface the live trainer uses. The rollout plane itself
is modelled by those release times (it is not re-run per mode, so every mode sees identical data).

The arrival pattern is scaled so the rollout makespan equals ``--makespan-ratio`` × the step's learner work
(1.0 by default: "learner work per step about equal to the rollout makespan").

Reported (JSON keys are stable):
- ``modes.<mode>.step_s`` mean step time; ``modes.<mode>.idle_frac`` learner idle fraction;
  ``modes.<mode>.work_before_last_reward_frac``: share of the learner work done before the last reward landed;
- ``ideal_step_s``: makespan of a zero-overhead learner that starts each trajectory's work the instant its
  reward exists and never idles while work waits: one machine with release times, whose optimum processes jobs
  in release order: max_j (a_j + Σ_{a_i ≥ a_j} w_i) + the barrier. It is ≥ max(last arrival + its work,
  total work);
- ``speedup_vs_sync.<mode>``, ``fraction_of_ideal.<mode>`` (ideal / step time);
- ``delta_k.<mode>`` = ‖θ_mode − θ_sync‖ / ‖θ_sync − θ_0‖ after all steps (float32), next to
  ``delta_k_permutation_control`` (sync with its microbatches reordered). ``async`` trains off-policy (π_old
  from the engine, up to ``--max-staleness`` versions behind), so its Δ_k is not expected to be small.

    python tools/bench_streaming.py --profile swe-like --json out.json [--quick] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

MODES = ("sync", "stream-group", "stream-trajectory", "async")


def build_workload(steps, groups, G, seed, vocab, min_len, max_len):
    import torch

    from megatron_tsync.streaming.ready_queue import Sample

    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        batch = []
        for g in range(groups):
            p_success = rnd.random()
            for i in range(G):
                T = rnd.randint(min_len, max_len)
                mask = torch.zeros(T)
                mask[8:] = 1
                if T > 40:  # a tool-output span
                    a = rnd.randint(12, T - 20)
                    mask[a : a + 8] = 0
                beh = (-torch.rand(T, generator=gen, dtype=torch.float64) * 2 - 0.5) * mask.double()
                batch.append(Sample(f"s{k}g{g}t{i}", f"s{k}g{g}", G, torch.randint(0, vocab, (T,), generator=gen),
                                    mask, float(rnd.random() < p_success), policy_version=k, behaviour_logp=beh))
        out.append(batch)
    return out


def arrival_pattern(profile_name, steps, groups, G, seed, calls):
    """Unscaled reward-arrival times (s) per step: generation time + tool latencies + verifier, per trajectory."""
    from megatron_tsync.runtime.latency import load_latency_profile, trajectory_latencies

    out = []
    for k in range(steps):
        if profile_name == "at-once":
            out.append([0.0] * (groups * G))
            continue
        prof = load_latency_profile(profile_name, seed=seed).for_step(k)
        lat = trajectory_latencies(prof, groups, G, calls_per_traj=calls)
        rnd = random.Random(seed * 7919 + k)
        out.append([0.2 + 0.1 * rnd.random() + lat[g][i] for g in range(groups) for i in range(G)])
    return out


class Harness:
    def __init__(self, args):
        import torch

        from megatron_tsync.model.builder import ModelArch, PrecisionConfig, build_model
        from megatron_tsync.model.parallel import initialize_parallel

        torch.set_num_threads(1)
        initialize_parallel(1, 1)
        self.args = args
        self.arch = ModelArch(family="llama", vocab_size=512, hidden_size=args.hidden, ffn_hidden_size=2 * args.hidden,
                              num_layers=args.layers, num_attention_heads=4, num_kv_heads=2, head_dim=args.hidden // 4,
                              max_position_embeddings=1024)
        self.precision = PrecisionConfig()
        self.theta0 = [p.detach().clone() for p in build_model(self.arch, self.precision, seed=0).parameters()]

    def learner(self, mode):
        import dataclasses

        import torch

        from megatron_tsync.algorithms.policy_loss import PolicyLossConfig
        from megatron_tsync.algorithms.streamability import RewardSpec
        from megatron_tsync.training.learner import Learner, LearnerConfig
        from megatron_tsync.model.builder import build_model
        from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
        from megatron_tsync.training.stream_fb import LossConfig

        m = build_model(self.arch, self.precision, seed=0)
        with torch.no_grad():
            for p, q in zip(m.parameters(), self.theta0):
                p.copy_(q)
        ddp = wrap_ddp(m)
        opt = build_optimizer(ddp, OptimConfig(optimizer="adam", lr=1e-4, clip_grad=1.0))
        loss = LossConfig(policy=PolicyLossConfig(tis_cap=2.0 if mode == "async" else None))
        if mode == "async":
            loss = dataclasses.replace(loss, old_logprobs="engine")
        cfg = LearnerConfig(mode="sync" if mode == "async" else mode, estimator="grpo", loss=loss,
                            reward_spec=RewardSpec.binary(), poll_timeout_s=0.002)
        return ddp, Learner(ddp, opt, cfg)

    def measure_work(self, batch):
        """Seconds of learner work per trajectory (forward + backward, median of 3) and the barrier."""
        from megatron_tsync.streaming.planner import Dest, StepPlanner, WorkItem
        from megatron_tsync.training.learner import shape_for

        ddp, L = self.learner("sync")
        sizes, shape = shape_for(batch)
        L.exec.begin_step(StepPlanner(L.estimator, sizes, mode="sync", reward_spec=L.cfg.reward_spec,
                                      loss_kind="ppo_clip"), shape)
        work = []
        for s in batch:
            L.exec.add_sample(s)
            item = WorkItem(s.traj_id, s.group_id, s.reward, Dest.ACCUM, advantage=0.5)
            ts = []
            for _ in range(3):
                t = time.perf_counter()
                L.exec.run([item])
                ts.append(time.perf_counter() - t)
            work.append(statistics.median(ts))
        t = time.perf_counter()
        for _ in range(3):
            from megatron_tsync.training.optimizer import finalize_and_scale

            finalize_and_scale(ddp, 1.0)
            L.opt.step()
            ddp.zero_grad_buffer()
        barrier = (time.perf_counter() - t) / 3
        return work, barrier

    def run_mode(self, mode, workload, arrivals, *, permute_seed=None):
        from megatron_tsync.streaming.ready_queue import ListSource
        from megatron_tsync.training.learner import shape_for

        ddp, L = self.learner(mode)
        rows, prev_start = [], None
        for k, (batch, arr) in enumerate(zip(workload, arrivals)):
            order = sorted(range(len(batch)), key=lambda i: arr[i])
            t_start = time.perf_counter()
            if mode == "async" and k > 0:
                # rollouts of batch k started with weights v(k-1), published when step k-1 began
                offset = prev_start - t_start
            else:
                offset = 0.0
            rel = [max(0.0, arr[i] + offset) for i in order]
            samples = [batch[i] for i in order]
            if permute_seed is not None:
                perm = list(samples)
                random.Random(permute_seed + k).shuffle(perm)
                L.sync_order = [s.traj_id for s in perm]
            sizes, shape = shape_for(batch)
            res = L.train_step(ListSource(samples, rel), sizes, shape)
            prev_start = t_start
            la = max(rel)
            before = sum(max(0.0, min(b, la) - a0) for a0, b in res.busy_intervals)
            rows.append({"step_s": res.step_s, "idle_frac": res.idle_frac, "busy": res.busy_intervals,
                         "work_before_last_reward_frac": before / max(res.busy_s, 1e-9),
                         "last_arrival_s": max(rel), "tail_s": res.step_s - max(rel),
                         "peak_bucket_vectors": res.peak_bucket_vectors, "stats": res.planner_stats})
        theta = [p.detach().double().reshape(-1) for p in ddp.parameters()]
        import torch

        return rows, torch.cat(theta)


def ideal_makespan(arrivals, work, barrier):
    jobs = sorted(zip(arrivals, work))
    best, suffix = 0.0, 0.0
    for a, w in reversed(jobs):
        suffix += w
        best = max(best, a + suffix)
    return best + barrier


def main(argv=None):
    ap = argparse.ArgumentParser(description="sync vs per-group vs per-trajectory streaming vs async, one run")
    ap.add_argument("--profile", default="swe-like",
                    help="uniform | swe-like | independent | at-once (every reward at t=0)")
    ap.add_argument("--latency-profile", default=None, help="JSON latency profile (overrides --profile)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--calls", type=int, default=3, help="tool calls per trajectory")
    ap.add_argument("--min-len", type=int, default=48)
    ap.add_argument("--max-len", type=int, default=160)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--makespan-ratio", type=float, default=1.0)
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="reduced run (≤ ~3 min on 2 cores), same JSON")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG timeline of learner busy/idle per mode")
    a = ap.parse_args(argv)
    if a.quick:
        a.groups, a.group_size, a.steps, a.max_len = 4, 4, 2, 96
    if a.max_staleness != 1:
        raise SystemExit("--max-staleness other than 1 is not modelled by the benchmark yet")
    modes = [m for m in a.modes.split(",") if m]
    profile = a.latency_profile or a.profile

    import torch

    h = Harness(a)
    workload = build_workload(a.steps, a.groups, a.group_size, a.seed, 512, a.min_len, a.max_len)
    work, barrier = h.measure_work(workload[0])
    total_work = sum(work)
    raw = arrival_pattern(profile, a.steps, a.groups, a.group_size, a.seed, a.calls)
    arrivals = []
    for r in raw:
        mx = max(r)
        scale = (a.makespan_ratio * total_work / mx) if mx > 0 else 0.0
        arrivals.append([x * scale for x in r])
    ideal = statistics.mean(
        ideal_makespan(arr, [w * 1.0 for w in work], barrier) for arr in arrivals
    )
    results, thetas = {}, {}
    for m in modes:
        rows, theta = h.run_mode(m, workload, arrivals)
        results[m], thetas[m] = rows, theta
    rows_p, theta_p = h.run_mode("sync", workload, arrivals, permute_seed=1234)
    theta0 = torch.cat([p.double().reshape(-1) for p in h.theta0])

    def delta(x):
        ref = thetas["sync"]
        return float((x - ref).norm() / (ref - theta0).norm())

    out = {"profile": profile, "groups": a.groups, "group_size": a.group_size, "steps": a.steps,
           "learner_work_s": total_work, "barrier_s": barrier, "ideal_step_s": ideal, "modes": {},
           "speedup_vs_sync": {}, "fraction_of_ideal": {}, "delta_k": {},
           "delta_k_permutation_control": delta(theta_p) if "sync" in thetas else None}
    for m in modes:
        rows = results[m]
        step = statistics.mean(r["step_s"] for r in rows)
        out["modes"][m] = {"step_s": step, "idle_frac": statistics.mean(r["idle_frac"] for r in rows),
                           "tail_after_last_arrival_s": statistics.mean(r["tail_s"] for r in rows),
                           "peak_bucket_vectors": max(r["peak_bucket_vectors"] for r in rows),
                           "work_before_last_reward_frac": statistics.mean(r["work_before_last_reward_frac"] for r in rows),
                           "per_step_s": [r["step_s"] for r in rows]}
        out["fraction_of_ideal"][m] = ideal / step
        if "sync" in results:
            out["speedup_vs_sync"][m] = out["modes"]["sync"]["step_s"] / step
            out["delta_k"][m] = delta(thetas[m])
    _table(out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.plot:
        _plot(results, arrivals, a.plot, profile)
    return out


def _table(out):
    print(f"profile {out['profile']}: {out['groups']} groups x {out['group_size']}, {out['steps']} steps; "
          f"learner work {out['learner_work_s']:.2f}s/step, ideal step {out['ideal_step_s']:.2f}s")
    print(f"{'mode':<20}{'step s':>9}{'idle':>7}{'tail s':>9}{'pre-last':>9}{'vs sync':>9}{'of ideal':>10}"
          f"{'delta_k':>11}")
    for m, r in out["modes"].items():
        print(f"{m:<20}{r['step_s']:>9.2f}{r['idle_frac']:>7.0%}{r['tail_after_last_arrival_s']:>9.2f}"
              f"{r['work_before_last_reward_frac']:>9.0%}"
              f"{out['speedup_vs_sync'].get(m, float('nan')):>9.2f}{out['fraction_of_ideal'][m]:>10.2f}"
              f"{out['delta_k'].get(m, float('nan')):>11.2e}")
    print(f"{'permutation control':<20}{'':>62}{out['delta_k_permutation_control'] or float('nan'):>11.2e}")


def _plot(results, arrivals, path, profile):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 1.3 * len(results) + 0.8), sharex=True)
    axes = axes if hasattr(axes, "__len__") else [axes]
    for ax, (m, rows) in zip(axes, results.items()):
        r = rows[-1]
        for a0, a1 in r["busy"]:
            ax.axvspan(a0, a1, color="tab:blue", alpha=0.8)
        ax.axvline(r["last_arrival_s"], color="tab:red", ls="--", lw=1)
        ax.set_yticks([])
        ax.set_ylabel(m, rotation=0, ha="right", va="center")
        ax.set_xlim(0, max(rr["step_s"] for rs in results.values() for rr in rs[-1:]) * 1.02)
    axes[-1].set_xlabel("seconds since step start (last step; blue = learner busy, red = last reward)")
    fig.suptitle(f"learner timeline per mode, profile {profile}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
