"""Live benchmark of the training modes on the real rollout plane: ``python -m megatron_tsync.train`` with its own
rollout workers (embedded engine, sandboxed calculator, signed events) on the quickstart task, every mode on the
same seeds, interleaved and repeated.

    python tools/bench_live.py --repeats 3 --steps 8                      # the four modes, the machine's cores split
    python tools/bench_live.py --cpus none --modes sync,stream-trajectory  # no affinity flags (all share every core)
    python tools/bench_live.py --cpus split --cpus none                   # both, interleaved, side by side
    python tools/bench_live.py --task log-search --modes sync,stream-trajectory   # the observation-heavy task

One supervised warm start (``--sft-steps``, default the quickstart's) is made once and cached under ``--warm-dir``
(keyed by the task config, the SFT steps and the seed); every run starts from it (``--load``, step 0), so all runs
begin with the same weights. Run ``r`` of every mode uses seed ``--seed + r``; the order of the modes rotates with
``r`` (interleaved, so drift of the machine's load spreads over every mode).

Per step the trainer logs (``history.json``; ``runtime/loop.py`` and ``runtime/grpo.py``): ``wall_step_s`` (the
whole iteration, the next weights' publish included), ``step_time_s`` (the learner's step: first wait → optimizer
step), ``idle_frac`` (share of it the learner waited), ``learner_busy_s`` (the learner's compute seconds: grows
when its cores are contended) and ``trainer_cpu_s``. The first ``--skip`` steps of a run (worker start-up, engine
load) are left out. Per mode: the median over runs of each run's mean step (spread: min–max over runs), mean idle,
median busy per step, and, paired by repeat against sync (median and min–max), the speedup (sync_r / mode_r) and the
learner's busy time (mode_r / sync_r).

The machine is stated next to the numbers: cores, the cores allowed, the load average before and after, and the
CPU split used (``--cpus``: ``split`` gives the trainer the first half of the allowed cores and the rollout workers
the rest, as ``TSYNC_CPU_SPLIT=1 tools/quickstart.sh`` does; ``none`` passes no affinity flag; or
``TRAINER:ROLLOUT`` lists; repeat ``--cpus`` to compare splits: they are interleaved like the modes, and each has
its own summary, its speedups against its own sync runs). Each run records the load average at its start.
Writes ``--out`` (JSON: machine, settings, every run's per-step rows, the summary) and prints a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "tiny_agent", "config.yaml")
TASKS = {"calculator": CONFIG, "log-search": os.path.join(ROOT, "examples", "log_search", "config.yaml")}
"""``--task NAME``: the recipe whose task, rollout and RL flags the runs use (the quickstart's calculator by default;
``log-search``: the long-horizon, observation-heavy task of ``examples/log_search``, where the learner's work is
comparable to the rollouts')."""
MODES = ("sync", "stream-group", "stream-trajectory", "async", "sync+spec", "stream-trajectory+spec",
         "stream-group+coalesce", "stream-trajectory+coalesce", "stream-trajectory+nowait", "stream-trajectory+mix",
         "stream-trajectory+mix+coalesce", "stream-trajectory+mix+full")
"""The default modes; any ``BASE[+SUFFIX...]`` with a base of ``BASES`` and suffixes of ``SUFFIXES`` is accepted.
``+spec``: the mode with ``--speculative-rollouts`` (next-step first turns drafted while the learner finishes);
``+coalesce``: with ``--stream-coalesce-tokens`` (``--coalesce-tokens``: arrivals collected into fuller microbatches);
``+nowait``: with ``--no-stream-wait-for-variance`` (every trajectory into its group's bucket on arrival);
``+mix``: with ``--pack-across-groups`` (packed microbatches mix groups and rewards: row-split weight gradients);
``+full``: with ``--stream-full-microbatches`` (a packed microbatch runs once full, or at the step's end)."""
BASES = ("sync", "stream-group", "stream-trajectory", "async")
SUFFIXES = ("spec", "coalesce", "nowait", "mix", "full")
# keys of the task config a run sets itself (or that would write into the quickstart's folders); the held-out
# evaluation (it would run inside the timed steps) and the quickstart's minibatches (the measured workload is one
# optimizer step per batch, as in docs/benchmarks.md; --train-args "--num-minibatches 2" for the other) are left out
RUN_KEYS = {"model", "init-tiny-model", "sft-warmup-steps", "rl-mode", "train-iters", "seed", "save", "save-interval",
            "load", "tensorboard-dir", "max-staleness", "trainer-cpus", "rollout-cpus", "eval-interval",
            "eval-prompts", "eval-greedy", "num-minibatches"}
STEP_KEYS = ("wall_step_s", "step_time_s", "idle_frac", "learner_busy_s", "trainer_cpu_s", "success_rate",
             "spec_drafted_tokens", "spec_kept_tokens", "microbatches", "plan_wasted_bucket_items",
             "plan_waited_for_variance")


# ------------------------------------------------------------------------------------------------------ machine
def machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"host": socket.gethostname(), "platform": platform.platform(), "cpu_model": model,
            "cores": os.cpu_count(), "cores_allowed": sorted(os.sched_getaffinity(0)), "load_avg": os.getloadavg()}


def cpu_flags(spec: str) -> list[str]:
    """``split`` | ``none`` | ``TRAINER:ROLLOUT`` → the trainer's affinity flags."""
    if spec == "none":
        return []
    if spec == "split":
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            return []
        half = len(cores) // 2
        from megatron_tsync.runtime.affinity import fmt

        return ["--trainer-cpus", fmt(cores[:half]), "--rollout-cpus", fmt(cores[half:])]
    trainer, sep, rollout = spec.partition(":")
    if not sep or not trainer or not rollout:
        raise SystemExit(f"--cpus {spec!r}: split, none or TRAINER:ROLLOUT (CPU lists, e.g. 0:1 or 0-3:4-7)")
    return ["--trainer-cpus", trainer, "--rollout-cpus", rollout]


# ------------------------------------------------------------------------------------------------------ runs
def task_args(config: str) -> list[str]:
    """The task config's flags, minus those each run sets itself (``RUN_KEYS``)."""
    import yaml

    with open(config) as f:
        data = yaml.safe_load(f) or {}
    out = []
    for key, value in data.items():
        if str(key).replace("_", "-") in RUN_KEYS or value is None or value is False:
            continue
        out += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv: list[str], log_path: str, timeout_s: float) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        p = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    if p.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({p.returncode}); {log_path}:\n{tail}")
    return time.perf_counter() - t0


_WARM = ("import sys\nfrom megatron_tsync.arguments import parse_args\n"
         "from megatron_tsync.runtime.context import RunContext, StopFlag\n"
         "from megatron_tsync.model.parallel import destroy_parallel\n"
         "ctx = RunContext(parse_args(sys.argv[1:]), StopFlag())\nctx.save()\nctx.close()\ndestroy_parallel()\n")


def code_fingerprint() -> str:
    """A hash of the package's Python sources: the warm start is made by the task, tokenizer, model and SFT code, so
    a change to any of them (with the same flags) makes a new one instead of reusing a stale cached one."""
    h = hashlib.sha256()
    pkg = os.path.join(ROOT, "megatron_tsync")
    for dirpath, dirnames, files in os.walk(pkg):
        dirnames.sort()
        for name in sorted(files):
            if name.endswith((".py", ".json", ".yaml")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, pkg).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:16]


def warm_start(a, base: list[str], *, size: tuple[int, int] | None = None,
               sft_lr: float | None = None) -> tuple[str, str]:
    """(model folder, checkpoint) of the shared warm start: made once per (config, SFT steps, seed[, size, SFT lr],
    the package's code: :func:`code_fingerprint`), then reused. ``size``: (hidden, layers) of the tiny model (None:
    ``--init-tiny-model``'s); ``sft_lr``: the warm start's learning rate (None: the default)."""
    extra = ([] if size is None else [list(size)]) + ([] if sft_lr is None else [sft_lr])
    key = hashlib.sha256(json.dumps([base, a.sft_steps, a.seed, *extra, code_fingerprint()]).encode()).hexdigest()[:12]
    d = os.path.join(a.warm_dir, key)
    model, ckpt = os.path.join(d, "model"), os.path.join(d, "ckpt")
    if os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt")):
        print(f"[bench_live] warm start (cached): {ckpt}", flush=True)
        return model, ckpt
    os.makedirs(d, exist_ok=True)
    if size is not None and not os.path.exists(os.path.join(model, "config.json")):
        from megatron_tsync.model.tiny_model import make_tiny_model

        hidden, layers = size
        make_tiny_model(model, hidden=hidden, layers=layers, seed=a.seed)  # what --init-tiny-model makes, resized
    argv = [sys.executable, "-c", _WARM, *base, "--model", model, "--init-tiny-model", "--sft-warmup-steps",
            str(a.sft_steps), "--seed", str(a.seed), "--save", ckpt,
            *([] if sft_lr is None else ["--sft-warmup-lr", str(sft_lr)])]
    s = _run(argv, os.path.join(d, "warm.log"), a.timeout)
    print(f"[bench_live] warm start ({a.sft_steps} SFT steps) made in {s:.0f}s: {ckpt}", flush=True)
    return model, ckpt


def mode_flags(a, mode: str) -> tuple[str, list[str]]:
    """``--rl-mode`` and the extra training flags of a benchmark mode (``BASE[+SUFFIX...]``, ``MODES``)."""
    rl_mode, *suffixes = mode.split("+")
    flags = {"spec": ["--speculative-rollouts"], "coalesce": ["--stream-coalesce-tokens", str(a.coalesce_tokens)],
             "nowait": ["--no-stream-wait-for-variance"], "mix": ["--pack-across-groups"],
             "full": ["--stream-full-microbatches"]}
    return rl_mode, [f for sfx in suffixes for f in flags[sfx]]


def valid_mode(mode: str) -> bool:
    base, *suffixes = mode.split("+")
    return base in BASES and all(s in SUFFIXES for s in suffixes) and len(set(suffixes)) == len(suffixes)


def run_mode(a, base: list[str], model: str, ckpt: str, mode: str, rep: int, cpus: list[str], label: str) -> dict:
    out = os.path.join(a.work_dir, f"r{rep}c{a.cpus.index(label)}_{mode}")  # short: the ipc socket path is bounded
    os.makedirs(out, exist_ok=True)
    rl_mode, extra = mode_flags(a, mode)
    argv = [sys.executable, "-m", "megatron_tsync.train", *base, "--model", model, "--load", ckpt, "--finetune",
            *extra, "--sft-warmup-steps", "0", "--rl-mode", rl_mode, "--train-iters", str(a.steps), "--seed", str(a.seed + rep),
            "--tensorboard-dir", out, "--rollout-dir", os.path.join(out, "rp"), "--no-progress", *cpus,
            *(["--max-staleness", str(a.max_staleness)] if mode == "async" else []), *a.train_args]
    load = os.getloadavg()[0]
    wall = _run(argv, os.path.join(out, "train.log"), a.timeout)
    with open(os.path.join(out, "history.json")) as f:
        hist = json.load(f)
    steps = [{k: h.get(k) for k in ("step", *STEP_KEYS)} for h in hist]
    return {"mode": mode, "cpus": label, "cpu_flags": cpus, "repeat": rep, "seed": a.seed + rep, "load_at_start": load,
            "process_wall_s": wall, "steps": steps}


# ------------------------------------------------------------------------------------------------------ summary
def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else {}


def summarize(runs: list[dict], skip: int) -> dict:
    """Per mode: step time (median of the runs' mean measured step, min–max), idle fraction, learner busy and
    trainer CPU seconds per step, and the speedup and learner-busy ratio against sync paired by repeat."""
    def measured(r):
        return [s for s in r["steps"] if s["step"] >= skip] or r["steps"][-1:]

    def mean(r, k):
        xs = [s[k] for s in measured(r) if s.get(k) is not None]
        return sum(xs) / len(xs) if xs else float("nan")

    by_mode: dict[str, list[dict]] = {}
    for r in runs:
        by_mode.setdefault(r["mode"], []).append(r)
    sync = {r["repeat"]: r for r in by_mode.get("sync", [])}

    def paired(rs, f):  # f(sync run, run) for every repeat that has a sync run
        return _spread([f(sync[r["repeat"]], r) for r in rs if r["repeat"] in sync])

    out = {}
    for mode, rs in by_mode.items():
        out[mode] = {"step_s": _spread([mean(r, "wall_step_s") for r in rs]),
                     "learner_step_s": _spread([mean(r, "step_time_s") for r in rs]),
                     "idle_frac": statistics.mean(mean(r, "idle_frac") for r in rs),
                     "learner_busy_s": _spread([mean(r, "learner_busy_s") for r in rs]),
                     "trainer_cpu_s": _spread([mean(r, "trainer_cpu_s") for r in rs]),
                     "microbatches": _spread([mean(r, "microbatches") for r in rs]),
                     "wasted_bucket_items": _spread([mean(r, "plan_wasted_bucket_items") for r in rs]),
                     "success_rate": statistics.mean(mean(r, "success_rate") for r in rs),
                     "speedup_vs_sync": paired(rs, lambda s, r: mean(s, "wall_step_s") / mean(r, "wall_step_s")),
                     "busy_vs_sync": paired(rs, lambda s, r: mean(r, "learner_busy_s") / mean(s, "learner_busy_s")),
                     "spec_kept_frac": _kept_frac(rs, measured)}
    for mode in out:
        base = mode.partition("+")[0]
        if mode != base and base in by_mode:
            out[mode]["reward_curve_vs_base"] = curve_test(by_mode[base], by_mode[mode], measured)
    return out


def curve_test(base: list[dict], spec: list[dict], measured, draws: int = 20000) -> dict:
    """Is the success curve of ``spec`` runs distinguishable from ``base`` runs of the same seeds? Per-step success
    differences paired by (repeat, step); two-sided sign-flip permutation test of their mean (exchangeable under
    the null that both modes draw from one distribution per step). Returns the mean success of each, the mean
    paired difference, the number of pairs and the p-value."""
    import random as _random

    b = {(r["repeat"], s["step"]): s["success_rate"] for r in base for s in measured(r)}
    d = [s["success_rate"] - b[(r["repeat"], s["step"])] for r in spec for s in measured(r) if (r["repeat"], s["step"]) in b]
    if not d:
        return {}
    obs, rng = abs(sum(d)), _random.Random(0)
    hits = sum(abs(sum(x if rng.random() < 0.5 else -x for x in d)) >= obs - 1e-12 for _ in range(draws))
    return {"pairs": len(d), "success_base": statistics.mean(b[k] for k in b), "mean_diff": sum(d) / len(d),
            "success_spec": statistics.mean(s["success_rate"] for r in spec for s in measured(r)),
            "p_value": (hits + 1) / (draws + 1)}


def _kept_frac(rs: list[dict], measured) -> float | None:
    """Speculative modes: drafted tokens kept by verification, over every measured step of every run."""
    drafted = sum(s.get("spec_drafted_tokens") or 0 for r in rs for s in measured(r))
    kept = sum(s.get("spec_kept_tokens") or 0 for r in rs for s in measured(r))
    return kept / drafted if drafted else None


def table(summary: dict, mach: dict, cpus: list[str]) -> str:
    head = (f"machine: {mach['cores']} cores (allowed {mach['cores_allowed']}), {mach['cpu_model']}; load avg "
            f"{mach['load_before'][0]:.2f} before / {mach['load_after'][0]:.2f} after; cpu split "
            f"{' '.join(cpus) or 'none (every process on every core)'}")
    modes = [m for m in MODES if m in summary] + [m for m in summary if m not in MODES]
    w = max([18, *map(len, modes)])

    def ratio(x):
        return f"{x['median']:.2f}x ({x['min']:.2f}-{x['max']:.2f})" if x else "-"

    rows = [head, f"{'mode':<{w}} {'step s (min-max)':<20} {'idle':>5} {'busy s/step':>16} {'busy vs sync':>20} "
                  f"{'cpu s/step':>10} {'mb/step':>7} {'speedup vs sync (min-max)':>26} {'kept':>5}"]
    for mode in modes:
        s = summary[mode]
        st, b = s["step_s"], s["learner_busy_s"]
        rows.append(f"{mode:<{w}} {st['median']:6.2f} ({st['min']:.2f}-{st['max']:.2f})    {s['idle_frac']:5.0%} "
                    f"{b['median']:6.2f} ({b['min']:.2f}-{b['max']:.2f}) {ratio(s['busy_vs_sync']):>20} "
                    f"{s['trainer_cpu_s']['median']:10.2f} {s['microbatches']['median']:7.1f} "
                    f"{ratio(s['speedup_vs_sync']):>26} "
                    f"{'' if s.get('spec_kept_frac') is None else format(s['spec_kept_frac'], '5.0%'):>5}")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------------ main
def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated modes (default: all of {MODES})")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="RL steps per run")
    p.add_argument("--skip", type=int, default=1, help="first steps of a run left out (start-up)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-staleness", type=int, default=1, help="async mode's staleness")
    p.add_argument("--cpus", action="append", help="split | none | TRAINER:ROLLOUT (CPU lists); repeatable "
                                                    "(default: split)")
    p.add_argument("--task", choices=sorted(TASKS), default=None,
                   help="the recipe to bench: calculator (examples/tiny_agent, the default) or log-search "
                        "(examples/log_search); --config names any other")
    p.add_argument("--config", default=None, help="task config (YAML of training flags; default: --task's)")
    p.add_argument("--sft-steps", type=int, default=None, help="warm start SFT steps (default: the config's)")
    p.add_argument("--sft-lr", type=float, default=None, help="warm start learning rate (--sft-warmup-lr; default "
                                                                "1e-3; wider --model-size wants less, 512x4: 3e-4)")
    p.add_argument("--warm-dir", default=os.path.join(ROOT, "runs", "bench_live", "warm"))
    p.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bench_live", "runs"))
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_live", "result.json"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds per trainer process")
    p.add_argument("--coalesce-tokens", type=int, default=2048, help="the +coalesce modes' --stream-coalesce-tokens")
    p.add_argument("--train-args", default="", help="extra training flags for every run (quoted)")
    p.add_argument("--model-size", default=None, metavar="HIDDENxLAYERS",
                   help="the task's tiny Llama at another size, e.g. 512x4 (default: the config's, 128x2): where one "
                        "trajectory's microbatch is compute-bound rather than bound by per-op overhead")
    a = p.parse_args(argv)
    if a.task is not None and a.config is not None:
        p.error("--task and --config both name the recipe; give one")
    a.config = a.config or TASKS[a.task or "calculator"]
    if a.model_size is not None:
        raw = a.model_size
        try:
            a.model_size = tuple(int(x) for x in raw.lower().split("x"))
            assert len(a.model_size) == 2 and min(a.model_size) > 0
        except (ValueError, AssertionError):
            p.error(f"--model-size: expected HIDDENxLAYERS such as 512x4, got {raw!r}")
    a.modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in a.modes if not valid_mode(m)]
    if bad or not a.modes:
        p.error(f"--modes: unknown {bad}; choose BASE[+SUFFIX...] from {BASES} and {SUFFIXES} (e.g. {MODES})")
    if a.repeats < 1 or a.steps <= a.skip:
        p.error(f"--repeats must be >= 1 and --steps > --skip, got {a.repeats}, {a.steps}, {a.skip}")
    a.train_args = a.train_args.split()
    a.cpus = a.cpus or ["split"]
    for c in a.cpus:
        cpu_flags(c)  # a bad spec fails before any run
    return a


def main(argv=None) -> int:
    a = parse(argv)
    base = task_args(a.config)
    if a.sft_steps is None:
        import yaml

        with open(a.config) as f:
            a.sft_steps = int((yaml.safe_load(f) or {}).get("sft-warmup-steps", 0))
    mach = machine()
    flags = {c: cpu_flags(c) for c in a.cpus}
    model, ckpt = warm_start(a, base, size=a.model_size, sft_lr=a.sft_lr)
    runs = []
    for rep in range(a.repeats):
        order = a.modes[rep % len(a.modes):] + a.modes[:rep % len(a.modes)]  # interleaved, rotating
        for c in a.cpus[rep % len(a.cpus):] + a.cpus[:rep % len(a.cpus)]:
            for mode in order:
                r = run_mode(a, base, model, ckpt, mode, rep, flags[c], c)
                runs.append(r)
                print(f"[bench_live] repeat {rep} cpus {c} {mode}: {len(r['steps'])} steps, process "
                      f"{r['process_wall_s']:.0f}s (load {r['load_at_start']:.2f})", flush=True)
    mach.update(load_before=mach.pop("load_avg"), load_after=os.getloadavg())
    summary = {c: summarize([r for r in runs if r["cpus"] == c], a.skip) for c in a.cpus}
    result = {"machine": mach, "cpu_flags": flags, "settings": {k: v for k, v in vars(a).items()},
              "summary": summary, "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for c in a.cpus:
        print(table(summary[c], mach, flags[c]))
    print(f"[bench_live] wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
