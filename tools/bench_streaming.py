"""Side-by-side benchmark of the learner modes on one workload: sync, stream-group, stream-trajectory, async.

Every mode trains the same trajectories (same seeds, same prompts' token sequences, same rewards) with the real
Megatron learner on this machine (one process, OMP_NUM_THREADS=1), starting from the same θ0. Rewards land at the
times of a rollout-plane arrival pattern drawn from a latency profile (``--profile`` / ``--latency-profile
FILE.json``); the learner sees them on the wall clock through the same ready-queue interface the live trainer uses.
The rollout plane is modelled by those release times (it is not re-run per mode, so every mode sees identical data).

Sweep. The arrival pattern is scaled so the rollout makespan equals ``ratio`` × the step's learner work (measured
once at start-up, alone; used only to place the release times) for every ratio of ``--makespan-ratio`` (a list,
default 0.25,1,4: rollouts much shorter than, equal to, much longer than the learner work). Runs are interleaved —
for each of ``--repeats`` repeats, each ratio, each mode — so drift of the shared machine hits every cell alike; the
spread is over repeats.

Ideal bound (per step, per mode, from that step's own measurements). The learner is one machine; trajectory i's
forward+backward is a job with the work w_i it actually took in that step (the executor's time per microbatch:
from its forward's start to the next one's, or to the end of the schedule call) and release r_i (its reward's
release time; the queue's clock starts after the step does, so r_i is never late). Any schedule of those jobs ends
no earlier than max_j (r_j + Σ_{r_i ≥ r_j} w_i) (every job released at or after r_j runs after r_j, one at a time),
and the barrier, as measured, comes after all of them. The learner's other busy time in the step (planning, group
closes) is added as a job released at 0. So the bound is a true lower bound on the step time *as measured*: no mode
can beat it except by timer noise (``--bound-tolerance``); every ``fraction_of_ideal`` (bound / step time) above
1 + tolerance is printed as BOUND BEATEN and listed in ``bound_violations``. What the fraction measures is
scheduling loss (the learner idle while work it could have done waited), not contention: contention inflates the
work itself, which ``learner_busy_s`` (the learner's busy seconds per step) shows.
Async: the rollouts of batch k start when step k−1 starts, so most of batch k has landed when step k begins;
its release times are taken relative to step k's start, clamped at 0. Its bound is therefore the per-step learner
work plus barrier (plus whatever of the makespan is still outstanding), not the makespan: async overlaps across
steps, and its per-step bound says so. (Its step 0 has no step before it: it waits for the batch as sync does.)

Rollout CPU (``--rollout-cpu-frac F``, ``--rollout-cpu-procs W``). With F = 0 (default) rollouts are sleeps: the
rollout plane is assumed to run on resources disjoint from the learner's. With F > 0, W busy worker processes
model a rollout plane sharing the machine: worker w owns every W-th trajectory, and while any of its trajectories
is in flight (from the moment its rollout starts until its reward lands) it burns CPU for F of the time (10 ms duty
cycle; F per batch in flight, at most 1: under async the next batch's rollouts overlap the current step). The
CPU-seconds they took are reported per step (``rollout_cpu_s``).

Reported (JSON): ``sweep.<ratio>.modes.<mode>``: ``step_s`` (mean over repeats of the mean step), ``step_s_spread``
[min, max over repeats], ``speedup_vs_sync`` (sync's step / this mode's, paired per repeat) and its spread,
``idle_frac``, ``learner_busy_s``, ``ideal_step_s``, ``fraction_of_ideal`` (mean) and ``fraction_of_ideal_max``,
``rollout_cpu_s``, ``delta_k`` = ‖θ_mode − θ_sync‖ / ‖θ_sync − θ_0‖ after all steps (float32, repeat 0), next to
``delta_k_permutation_control`` (sync with its microbatches reordered). ``async`` trains off-policy (π_old from the
engine, one version behind), so its Δ_k is not expected to be small. For older readers the top-level ``modes``,
``speedup_vs_sync``, ``fraction_of_ideal``, ``delta_k`` repeat the reference ratio's (1 if swept, else the first)
and ``ideal_step_s`` is the smallest of its per-mode bounds.

    python tools/bench_streaming.py --profile swe-like --json out.json [--quick] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
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


def scale_arrivals(raw, ratio, work_s):
    """Release times scaled so each step's last release (the rollout makespan) is ``ratio`` × ``work_s``."""
    out = []
    for r in raw:
        mx = max(r)
        scale = (ratio * work_s / mx) if mx > 0 else 0.0
        out.append([x * scale for x in r])
    return out


def ideal_bound(jobs, barrier_s):
    """Lower bound on a one-machine step: ``jobs`` = [(release_s, work_s)], then the barrier.

    max_j (r_j + Σ_{r_i ≥ r_j} w_i) + barrier: the jobs released at or after r_j all run after r_j, one at a time.
    Processing in release order without idling while work waits attains it (module docstring)."""
    best, suffix = 0.0, 0.0
    for r, w in sorted(jobs, reverse=True):
        suffix += w
        best = max(best, r + suffix)
    return best + barrier_s


def bound_violations(cells, tolerance):
    """The cells (dicts with ``fraction_of_ideal``) whose step beat its bound by more than ``tolerance``."""
    return [c for c in cells if c["fraction_of_ideal"] > 1.0 + tolerance]


class WorkRecorder:
    """Times every microbatch a learner's executor runs (forward + backward, in the schedule's own order).

    The executor times whole schedule calls (``busy``); the bound needs each trajectory's share, so this taps the
    executor's forward-step function (instance attributes of this learner only; the package is not changed): the
    microbatch's time runs from its forward's start to the next forward's start, the last one's to the end of the
    call."""

    def __init__(self, executor):
        self.calls: list[list] = []  # per schedule call: [(traj_ids, t_forward_start)], then the call's end
        self.ends: list[float] = []
        run, fwd = executor.run, executor._forward_step
        rec = self

        class _Tap:  # records which pack the schedule takes next
            def __init__(self, it):
                self.it = it

            def __next__(self):
                pack = next(self.it)
                ids = [w.traj_id for w in pack] if isinstance(pack, list) else []
                rec.calls[-1].append((ids, time.perf_counter()))
                return pack

        def timed_run(items, **kw):
            rec.calls.append([])
            try:
                run(items, **kw)
            finally:
                rec.ends.append(time.perf_counter())

        executor.run = timed_run
        executor._forward_step = lambda data_iterator, model: fwd(_Tap(data_iterator), model)

    def begin(self):
        self.calls.clear()
        self.ends.clear()

    def work(self):
        """[(traj_ids, seconds)] per microbatch since :meth:`begin`."""
        out = []
        for mbs, end in zip(self.calls, self.ends):
            for (ids, t), nxt in zip(mbs, [t for _, t in mbs[1:]] + [end]):
                out.append((ids, nxt - t))
        return out


_BURNER = r"""
import os, select, sys, time
frac, period, wins, buf = float(sys.argv[1]), 0.01, [], b""
while True:
    now = time.monotonic()
    wins = [w for w in wins if w[1] > now]
    active = sum(a <= now for a, _ in wins)  # open windows: batches in flight on this worker
    timeout = 0 if active else (min(a for a, _ in wins) - now if wins else None)
    if select.select([0], [], [], timeout)[0]:
        chunk = os.read(0, 65536)
        if not chunk:
            break
        *lines, buf = (buf + chunk).split(b"\n")
        wins += [tuple(map(float, ln.split())) for ln in lines if ln.strip()]
        continue
    if active:
        duty = min(1.0, frac * active)
        end = now + duty * period
        while time.monotonic() < end:
            pass
        time.sleep((1.0 - duty) * period)
"""


class RolloutCPU:
    """``procs`` busy worker processes standing in for a rollout plane that shares the learner's CPUs.

    :meth:`rollouts` hands each worker the in-flight window of its trajectories (every ``procs``-th one):
    [start, start + its last release]; a worker burns CPU ``frac`` × (its open windows) of the time, at most all
    of it (async: the next batch's rollouts overlap the current one's)."""

    def __init__(self, frac, procs):
        self.frac, self.procs = frac, procs
        self.ps = [] if frac <= 0 else [subprocess.Popen([sys.executable, "-c", _BURNER, str(frac)],
                                                         stdin=subprocess.PIPE) for _ in range(procs)]

    def rollouts(self, start, releases):
        for w, p in enumerate(self.ps):
            mine = releases[w :: self.procs]
            if mine and max(mine) > 0:
                p.stdin.write(f"{start} {start + max(mine)}\n".encode())
                p.stdin.flush()

    def cpu_s(self):
        """CPU-seconds the workers have used so far (Linux /proc; 0 without workers)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for p in self.ps:
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / tick

    def close(self):
        for p in self.ps:
            p.stdin.close()
            p.wait(timeout=10)


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
        """Seconds of learner work per trajectory (forward + backward, median of 3) and the barrier, alone, at
        start-up: only used to place the release times (the bound uses each step's own measurements)."""
        from megatron_tsync.streaming.planner import Dest, StepPlanner, WorkItem
        from megatron_tsync.training.learner import shape_for
        from megatron_tsync.training.optimizer import finalize_and_scale

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
            finalize_and_scale(ddp, 1.0)
            L.opt.step()
            ddp.zero_grad_buffer()
        return work, (time.perf_counter() - t) / 3

    def run_mode(self, mode, workload, arrivals, cpu, *, permute_seed=None):
        """All steps of one mode from θ0: per-step rows (timings, the step's own bound) and the final θ."""
        import torch

        from megatron_tsync.streaming.ready_queue import ListSource
        from megatron_tsync.training.learner import shape_for

        ddp, L = self.learner(mode)
        rec = WorkRecorder(L.exec)
        rows, prev_start = [], None
        for k, (batch, arr) in enumerate(zip(workload, arrivals)):
            order = sorted(range(len(batch)), key=lambda i: arr[i])
            t_start, t_mono = time.perf_counter(), time.monotonic()
            if mode != "async":
                cpu.rollouts(t_mono, arr)  # this batch's rollouts start with the step
            else:  # async: batch k+1's rollouts start now (batch 0's too, at step 0; after the last batch the
                if k == 0:  # rollouts of a next one, which a running async trainer would start, with batch 0's times)
                    cpu.rollouts(t_mono, arr)
                cpu.rollouts(t_mono, arrivals[(k + 1) % len(arrivals)])
            # async: the rollouts of batch k started with weights v(k-1), published when step k-1 began
            offset = prev_start - t_start if (mode == "async" and k > 0) else 0.0
            rel = [max(0.0, arr[i] + offset) for i in order]
            samples = [batch[i] for i in order]
            if permute_seed is not None:
                perm = list(samples)
                random.Random(permute_seed + k).shuffle(perm)
                L.sync_order = [s.traj_id for s in perm]
            sizes, shape = shape_for(batch)
            cpu0 = cpu.cpu_s()
            rec.begin()
            res = L.train_step(ListSource(samples, rel), sizes, shape)
            prev_start = t_start
            rows.append(_step_row(res, rec.work(), {s.traj_id: r for s, r in zip(samples, rel)}, cpu.cpu_s() - cpu0))
        theta = [p.detach().double().reshape(-1) for p in ddp.parameters()]
        return rows, torch.cat(theta)


def _step_row(res, mb_work, release, rollout_cpu_s):
    """One step's timings and its bound from its own measured work (module docstring)."""
    b0, b1 = res.busy_intervals[-1]  # the barrier is the step's last busy interval (one minibatch, one epoch)
    barrier = b1 - b0
    timed = [i for ids, _ in mb_work for i in ids]
    skipped = (getattr(res, "planner_stats", None) or {}).get("skipped_zero_advantage", 0)  # no work: advantage 0
    if len(set(timed)) != len(timed) or not set(timed) <= set(release) or len(timed) + skipped != len(release):
        # a trajectory's work missing (or counted twice) would bend the bound
        raise RuntimeError(f"timed {len(timed)} trajectory forward+backwards for {len(release)} trajectories "
                           f"({skipped} skipped): the executor's schedule no longer runs through the tapped forward "
                           "step")
    jobs = [(max(release[i] for i in ids), w) for ids, w in mb_work if ids]
    other = max(0.0, res.busy_s - barrier - sum(w for _, w in jobs))  # planning, group closes: released at 0
    ideal = ideal_bound(jobs + [(0.0, other)], barrier)
    la = max(release.values())
    before = sum(max(0.0, min(b, la) - a0) for a0, b in res.busy_intervals)
    return {"step_s": res.step_s, "idle_frac": res.idle_frac, "busy_s": res.busy_s, "busy": res.busy_intervals,
            "ideal_step_s": ideal, "fraction_of_ideal": ideal / res.step_s, "barrier_s": barrier,
            "work_before_last_reward_frac": before / max(res.busy_s, 1e-9), "last_arrival_s": la,
            "tail_s": res.step_s - la, "peak_bucket_vectors": res.peak_bucket_vectors, "rollout_cpu_s": rollout_cpu_s}


def run_sweep(h, a, modes, workload, raw, work_s):
    """Interleaved runs: for each repeat, each ratio, each mode. Returns cells[ratio][mode] = [rows per repeat],
    thetas[ratio][mode] (repeat 0) and the arrivals per ratio."""
    arrivals = {r: scale_arrivals(raw, r, work_s) for r in a.ratios}
    cells = {r: {m: [] for m in modes} for r in a.ratios}
    thetas = {r: {} for r in a.ratios}
    cpu = RolloutCPU(a.rollout_cpu_frac, a.rollout_cpu_procs)
    try:
        for rep in range(a.repeats):
            for r in a.ratios:
                for m in modes:
                    rows, theta = h.run_mode(m, workload, arrivals[r], cpu)
                    cells[r][m].append(rows)
                    if rep == 0:
                        thetas[r][m] = theta
                    print(f"repeat {rep} ratio {r:g} {m}: {statistics.mean(x['step_s'] for x in rows):.3f} s/step",
                          file=sys.stderr, flush=True)
        ref = a.ratios[0] if 1.0 not in a.ratios else 1.0
        control = h.run_mode("sync", workload, arrivals[ref], cpu, permute_seed=1234)[1] if "sync" in modes else None
    finally:
        cpu.close()
    return cells, thetas, arrivals, control


def _spread(xs):
    return [min(xs), max(xs)]


def summarize_cell(reps, sync_reps):
    """One (ratio, mode): means over repeats of per-repeat step means, spreads, the bound's fractions."""
    steps = [r for rows in reps for r in rows]
    step_means = [statistics.mean(r["step_s"] for r in rows) for rows in reps]
    out = {"step_s": statistics.mean(step_means), "step_s_spread": _spread(step_means),
           "per_repeat_step_s": step_means,
           "idle_frac": statistics.mean(r["idle_frac"] for r in steps),
           "learner_busy_s": statistics.mean(r["busy_s"] for r in steps),
           "learner_work_s": statistics.mean(r["busy_s"] for r in steps),  # the same: all the learner did
           "barrier_s": statistics.mean(r["barrier_s"] for r in steps),
           "ideal_step_s": statistics.mean(r["ideal_step_s"] for r in steps),
           "fraction_of_ideal": statistics.mean(r["fraction_of_ideal"] for r in steps),
           "fraction_of_ideal_max": max(r["fraction_of_ideal"] for r in steps),
           "tail_after_last_arrival_s": statistics.mean(r["tail_s"] for r in steps),
           "work_before_last_reward_frac": statistics.mean(r["work_before_last_reward_frac"] for r in steps),
           "peak_bucket_vectors": max(r["peak_bucket_vectors"] for r in steps),
           "rollout_cpu_s": statistics.mean(r["rollout_cpu_s"] for r in steps)}
    if sync_reps is not None:
        sp = [statistics.mean(x["step_s"] for x in s) / m for s, m in zip(sync_reps, step_means)]
        out["speedup_vs_sync"], out["speedup_spread"] = statistics.mean(sp), _spread(sp)
    return out


def summarize(a, profile, modes, cells, thetas, arrivals, control, work, barrier, theta0):
    """The JSON report (module docstring) from the sweep's rows; ``theta0`` flat float64."""
    out = {"profile": profile, "groups": a.groups, "group_size": a.group_size, "steps": a.steps,
           "repeats": a.repeats, "makespan_ratios": a.ratios, "startup_work_s": sum(work), "startup_barrier_s": barrier,
           "bound_tolerance": a.bound_tolerance,
           "rollout_cpu": {"frac": a.rollout_cpu_frac, "procs": a.rollout_cpu_procs if a.rollout_cpu_frac > 0 else 0,
                           "model": "none: rollouts are sleeps (disjoint rollout resources)" if a.rollout_cpu_frac <= 0
                           else f"{a.rollout_cpu_procs} busy worker process(es), CPU {a.rollout_cpu_frac:g} of each "
                                f"one's in-flight time"},
           "sweep": {}, "bound_violations": [], "delta_k_permutation_control": None}
    for r in a.ratios:
        sync = thetas[r].get("sync")
        cell = {"makespan_s": statistics.mean(max(x) for x in arrivals[r]), "modes": {}}
        for m in modes:
            c = summarize_cell(cells[r][m], cells[r].get("sync"))
            if sync is not None:
                c["delta_k"] = float((thetas[r][m] - sync).norm() / (sync - theta0).norm())
            cell["modes"][m] = c
            for rep, rows in enumerate(cells[r][m]):
                for k, row in enumerate(rows):
                    v = {"ratio": r, "mode": m, "repeat": rep, "step": k, "fraction_of_ideal": row["fraction_of_ideal"]}
                    out["bound_violations"] += bound_violations([v], a.bound_tolerance)
        out["sweep"][f"{r:g}"] = cell
    ref = 1.0 if 1.0 in a.ratios else a.ratios[0]
    refc = out["sweep"][f"{ref:g}"]["modes"]
    if control is not None:
        sync = thetas[ref]["sync"]
        out["delta_k_permutation_control"] = float((control - sync).norm() / (sync - theta0).norm())
    out.update(reference_ratio=ref, modes=refc, ideal_step_s=min(c["ideal_step_s"] for c in refc.values()),
               fraction_of_ideal={m: c["fraction_of_ideal"] for m, c in refc.items()},
               speedup_vs_sync={m: c["speedup_vs_sync"] for m, c in refc.items() if "speedup_vs_sync" in c},
               delta_k={m: c["delta_k"] for m, c in refc.items() if "delta_k" in c})
    return out


def _args(argv):
    ap = argparse.ArgumentParser(description="sync vs per-group vs per-trajectory streaming vs async, one run")
    ap.add_argument("--profile", default="swe-like",
                    help="uniform | swe-like | independent | at-once (every reward at t=0)")
    ap.add_argument("--latency-profile", default=None, help="JSON latency profile (overrides --profile)")
    ap.add_argument("--groups", type=int, default=None)
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--calls", type=int, default=3, help="tool calls per trajectory")
    ap.add_argument("--min-len", type=int, default=48)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--makespan-ratio", default="0.25,1,4",
                    help="comma-separated rollout makespan / learner work ratios, reported side by side")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats of the whole sweep (spread; default 3)")
    ap.add_argument("--rollout-cpu-frac", type=float, default=0.0,
                    help="share of each rollout's in-flight time its worker burns CPU (0: sleeps, disjoint resources)")
    ap.add_argument("--rollout-cpu-procs", type=int, default=1, help="busy rollout worker processes (with frac > 0)")
    ap.add_argument("--bound-tolerance", type=float, default=0.02,
                    help="timer noise allowed before a step beating its ideal bound is flagged")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="reduced run (defaults 4 groups x 4, 2 steps, max-len 96, 2 repeats; < 1 min on 2 cores; "
                    "those flags given explicitly still win), same JSON")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG timeline of learner busy/idle per mode (reference ratio)")
    a = ap.parse_args(argv)
    sizes = dict(groups=4, group_size=4, steps=2, max_len=96, repeats=2) if a.quick else \
        dict(groups=8, group_size=8, steps=3, max_len=160, repeats=3)
    for k, v in sizes.items():  # --quick sets the defaults; a flag given explicitly wins
        if getattr(a, k) is None:
            setattr(a, k, v)
    try:
        a.ratios = [float(x) for x in a.makespan_ratio.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--makespan-ratio {a.makespan_ratio!r}: expected comma-separated numbers such as 0.25,1,4")
    if not a.ratios or min(a.ratios) <= 0 or len(set(a.ratios)) != len(a.ratios):
        ap.error(f"--makespan-ratio {a.makespan_ratio!r}: needs distinct ratios > 0")
    if not 0.0 <= a.rollout_cpu_frac <= 1.0:
        ap.error(f"--rollout-cpu-frac {a.rollout_cpu_frac}: must be in [0, 1]")
    if a.rollout_cpu_procs < 1 or a.repeats < 1 or a.bound_tolerance < 0:
        ap.error("--rollout-cpu-procs and --repeats must be >= 1, --bound-tolerance >= 0")
    if not 16 <= a.min_len <= a.max_len:
        ap.error(f"--min-len {a.min_len} / --max-len {a.max_len}: need 16 <= min <= max tokens")
    if a.max_staleness != 1:
        ap.error("--max-staleness other than 1 is not modelled by the benchmark yet")
    bad = [m for m in a.modes.split(",") if m and m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    return a


def main(argv=None):
    a = _args(argv)
    modes = [m for m in a.modes.split(",") if m]
    profile = a.latency_profile or a.profile
    import torch

    h = Harness(a)
    workload = build_workload(a.steps, a.groups, a.group_size, a.seed, 512, a.min_len, a.max_len)
    work, barrier = h.measure_work(workload[0])
    raw = arrival_pattern(profile, a.steps, a.groups, a.group_size, a.seed, a.calls)
    cells, thetas, arrivals, control = run_sweep(h, a, modes, workload, raw, sum(work))
    theta0 = torch.cat([p.double().reshape(-1) for p in h.theta0])
    out = summarize(a, profile, modes, cells, thetas, arrivals, control, work, barrier, theta0)
    _table(out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.plot:
        ref = out["reference_ratio"]
        _plot({m: cells[ref][m][0] for m in modes}, a.plot, f"{profile}, makespan/work {ref:g}")
    return out


def _table(out):
    rc = out["rollout_cpu"]
    print(f"profile {out['profile']}: {out['groups']} groups x {out['group_size']}, {out['steps']} steps, "
          f"{out['repeats']} interleaved repeats; start-up learner work {out['startup_work_s']:.2f}s/step; "
          f"rollout CPU: {rc['model']}")
    print(f"{'ratio':>6} {'mode':<18}{'step s':>8}{'spread':>13}{'idle':>6}{'busy s':>8}{'vs sync':>8}"
          f"{'spread':>12}{'ideal s':>8}{'of ideal':>9}{'max':>6}{'roll cpu':>9}{'delta_k':>10}")
    for key, cell in out["sweep"].items():
        for m, r in cell["modes"].items():
            sp = r.get("speedup_spread", [float("nan")] * 2)
            print(f"{key:>6} {m:<18}{r['step_s']:>8.3f}{r['step_s_spread'][0]:>7.3f}-{r['step_s_spread'][1]:<5.3f}"
                  f"{r['idle_frac']:>6.0%}{r['learner_busy_s']:>8.3f}{r.get('speedup_vs_sync', float('nan')):>8.2f}"
                  f"{sp[0]:>7.2f}-{sp[1]:<4.2f}{r['ideal_step_s']:>8.3f}{r['fraction_of_ideal']:>9.2f}"
                  f"{r['fraction_of_ideal_max']:>6.2f}{r['rollout_cpu_s']:>9.2f}{r.get('delta_k', float('nan')):>10.2e}")
    pc = out["delta_k_permutation_control"]
    print(f"permutation control delta_k {float('nan') if pc is None else pc:.2e}")
    for v in out["bound_violations"]:
        print(f"BOUND BEATEN: ratio {v['ratio']:g} {v['mode']} repeat {v['repeat']} step {v['step']}: "
              f"fraction of ideal {v['fraction_of_ideal']:.3f} > 1 + {out['bound_tolerance']}")
    if not out["bound_violations"]:
        worst = max(c["fraction_of_ideal_max"] for cell in out["sweep"].values() for c in cell["modes"].values())
        print(f"no step beat its ideal bound (largest fraction of ideal {worst:.3f}, tolerance {out['bound_tolerance']})")


def _plot(results, path, title):
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
        ax.axvline(r["ideal_step_s"], color="tab:green", ls=":", lw=1)
        ax.set_yticks([])
        ax.set_ylabel(m, rotation=0, ha="right", va="center")
        ax.set_xlim(0, max(rs[-1]["step_s"] for rs in results.values()) * 1.02)
    axes[-1].set_xlabel("seconds since step start (last step; blue = learner busy, red = last reward, green = bound)")
    fig.suptitle(f"learner timeline per mode, {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
