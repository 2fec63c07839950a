"""``python -m megatron_tsync.plan``: predict step time per mode, speedups, bucket memory and settings for a cluster.

    python -m megatron_tsync.plan --model qwen3-8b --gpu h100 --rollout-gpus 4 --learner-gpus 4 \\
        --profile swe-like --latency-scale 5 --prompts 32 --group-size 8 --json plan.json --plot plan.png
    python -m megatron_tsync.plan --profile run/latency_trace.jsonl --model /models/Qwen3-8B/config.json ...
    python -m megatron_tsync.plan --scenario paper        # the seed paper's setting (docs/planner.md)
    python -m megatron_tsync.plan --scenario scaling      # the 8 … 1,024-GPU table (docs/planner.md)

Model in ``docs/planner.md``; the modules: ``workload`` (the batch), ``rollout`` (engines), ``learner`` (the real
StepPlanner), ``simulate`` (the step loop per mode), ``report`` (memory, settings, plot).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from megatron_tsync.plan.costs import learner_cost, weight_sync_s
from megatron_tsync.plan.hardware import GPUS, MODELS, Layout, ModelCost, load_arch
from megatron_tsync.plan.learner import PlannerSettings
from megatron_tsync.plan.memory import PER_GROUP
from megatron_tsync.plan.report import bucket_memory, options, options_text, plot, recommend, table
from megatron_tsync.plan.simulate import MODES, Scenario, simulate
from megatron_tsync.plan.workload import WorkloadSpec, build_batch


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megatron_tsync.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", choices=("paper", "scaling"), help="print a built-in study instead (docs/planner.md)")
    w = ap.add_argument_group("workload")
    w.add_argument("--profile", default="swe-like", help="latency profile: built-in name, JSON file (trace-to-profile's "
                   "output included) or the endpoint's .jsonl trace")
    w.add_argument("--latency-scale", type=float, default=1.0, help="multiplies every tool/verifier latency")
    w.add_argument("--prompts", type=int, default=32)
    w.add_argument("--group-size", type=int, default=8)
    w.add_argument("--calls", type=int, default=None, help="tool calls per trajectory (default 3; not with a .jsonl "
                   "trace, which has its own)")
    w.add_argument("--prompt-tokens", type=int, default=512)
    w.add_argument("--gen-tokens", type=int, default=256, help="median generated tokens per turn")
    w.add_argument("--gen-sigma", type=float, default=0.5, help="log-sd of the generated tokens per turn")
    w.add_argument("--tool-output-tokens", type=int, default=128)
    w.add_argument("--verify-s", type=float, default=None, help="verifier seconds per trajectory (default 0; not with "
                   "a .jsonl trace, which has its own)")
    w.add_argument("--algorithm", choices=("grpo", "opd"), default="grpo")
    w.add_argument("--estimator", default="grpo", choices=sorted(PER_GROUP))
    w.add_argument("--steps", type=int, default=5, help="simulated steps (the first is left out of the averages)")
    w.add_argument("--seed", type=int, default=0)
    h = ap.add_argument_group("model and layout")
    h.add_argument("--model", default="qwen3-8b", help=f"a config.json (or its folder) or one of {', '.join(MODELS)}")
    h.add_argument("--teacher", default=None, help="OPD: the teacher's model (default: the same as --model)")
    h.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    for name, default in (("rollout-gpus", 4), ("rollout-tp", 1), ("learner-gpus", 4), ("tp", 1), ("pp", 1), ("ep", 1),
                          ("max-concurrency", 256)):
        h.add_argument(f"--{name}", type=int, default=default)
    for name in ("mfu", "decode-mfu", "prefill-mfu", "hbm-eff", "mb-overhead-s", "decode-overhead-s", "dp-bw-gbs",
                 "sync-bw-gbs", "peak-tflops", "hbm-tbs", "mem-gib", "host-link-gbs", "host-add-gbs"):
        h.add_argument(f"--{name}", type=float, default=None,
                       help=f"overrides the layout's {name.replace('-', '_')} (plan/hardware.py: Layout, GPUS)")
    h.add_argument("--frontier-first", action="store_true",
                   help="engines admit earlier groups' sequences first (the trainer's --rollout-frontier-first)")
    s = ap.add_argument_group("trainer settings")
    s.add_argument("--max-staleness", type=int, default=1, help="async(K)")
    s.add_argument("--max-open-groups", type=int, default=None)
    s.add_argument("--accumulate-on-host", action="store_true",
                   help="the trainer's --accumulate-on-host: accumulator and buckets on the host (plan/learner.py)")
    s.add_argument("--dp-assignment", choices=("arrival", "group", "balanced", "spill"), default="arrival",
                   help="the trainer's --dp-assignment: which learner DP rank trains a trajectory (plan/learner.py)")
    s.add_argument("--modes", default=",".join(MODES))
    o = ap.add_argument_group("output")
    o.add_argument("--json", default=None)
    o.add_argument("--plot", default=None, help="PNG timeline of one step per mode")
    o.add_argument("--no-recommend", action="store_true", help="skip the settings search (faster)")
    return ap


def layout_from(a) -> Layout:
    kw = {f.name: getattr(a, f.name) for f in dataclasses.fields(Layout) if getattr(a, f.name, None) is not None}
    return Layout(**kw)


def build(a) -> tuple:
    """(arch, scenario, batches) from parsed arguments."""
    arch = load_arch(a.model)
    lay = layout_from(a)
    cost = ModelCost.of(arch)
    teacher = None
    if a.algorithm == "opd":
        teacher = ModelCost.of(load_arch(a.teacher)) if a.teacher else cost
    elif a.teacher:
        raise SystemExit("--teacher is for --algorithm opd")
    if a.profile.endswith(".jsonl") and (a.calls is not None or a.verify_s is not None):
        raise SystemExit("--calls / --verify-s: a .jsonl trace has its own tool calls and verifier times")
    settings = PlannerSettings(estimator=a.estimator, max_open_groups=a.max_open_groups,
                               host_accumulation=a.accumulate_on_host, dp_assignment=a.dp_assignment)
    sc = Scenario(cost=cost, layout=lay, learner=learner_cost(arch, lay, a.estimator, teacher), settings=settings,
                  sync_s=weight_sync_s(cost, lay), async_k=a.max_staleness, opd=a.algorithm == "opd")
    ws = WorkloadSpec(prompts=a.prompts, group_size=a.group_size, calls=3 if a.calls is None else a.calls,
                      prompt_tokens=a.prompt_tokens, gen_tokens=a.gen_tokens, gen_sigma=a.gen_sigma,
                      tool_output_tokens=a.tool_output_tokens, verify_s=a.verify_s or 0.0, profile=a.profile, latency_scale=a.latency_scale, seed=a.seed)
    return arch, sc, [build_batch(ws, k) for k in range(a.steps)]


def run(a) -> dict:
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    if a.steps < 2 or a.max_staleness < 1:
        raise SystemExit("--steps must be >= 2 (the first is a warm-up) and --max-staleness >= 1")
    arch, sc, batches = build(a)
    out = simulate(sc, batches, modes)
    st = out.get("stream-trajectory")
    report = {"modes": {m: v["summary"] for m, v in out.items()}, "layout": dataclasses.asdict(sc.layout),
              "learner_cost": dataclasses.asdict(sc.learner), "weight_sync_s": sc.sync_s,
              "model": {"total_params": sc.cost.total_params, "active_params": sc.cost.active_params}}
    if st is not None:
        mem = bucket_memory(arch, sc, st["summary"]["peak_open_groups"])
        report["bucket_memory"] = mem
        if not a.no_recommend and a.algorithm == "grpo":
            report["recommended"] = recommend(arch, sc, batches, st["summary"]["step_s"], mem)
            report["options"] = options(arch, sc, batches, out, mem)
    print(table(out))
    if "bucket_memory" in report:
        m = report["bucket_memory"]
        print(f"bucket memory per learner GPU (stream-trajectory): {m['peak_open_groups']} open groups at the peak = "
              f"{m['bucket_vectors']} vectors × {m['vector_gib']:.2f} GiB = {m['bucket_gib']:.1f} GiB, next to "
              f"{m['model_state_gib']:.1f} GiB of model state on a {m['gpu_gib']:.0f} GiB GPU")
    for k, v in report.get("recommended", {}).items():
        print(f"recommended --{k.replace('_', '-')}: {v['value']}"
              + (f" (stream-trajectory step {v['step_s']:.2f} s)" if "step_s" in v else f" ({v['why']})"))
    if report.get("options"):
        print(options_text(report["options"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    if a.plot:
        plot(out, a.plot, f"{a.model}, {sc.layout.rollout_gpus} + {sc.layout.learner_gpus} × {sc.layout.gpu}, "
                          f"{a.prompts} × {a.group_size}, {a.profile}")
        print(f"plot: {a.plot}")
    return report


def main(argv=None) -> dict:
    a = parser().parse_args(argv)
    if a.scenario:
        base = vars(parser().parse_args([]))
        extra = sorted(k for k, v in vars(a).items() if k != "scenario" and v != base[k])
        if extra:
            raise SystemExit(f"--scenario {a.scenario} fixes its own settings (docs/planner.md); drop "
                             + ", ".join("--" + k.replace("_", "-") for k in extra))
        from megatron_tsync.plan import scenarios

        return scenarios.main(a.scenario)
    return run(a)


if __name__ == "__main__":
    main(sys.argv[1:])
