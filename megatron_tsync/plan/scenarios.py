"""Built-in studies (``python -m megatron_tsync.plan --scenario paper|scaling``), printed as markdown for
docs/planner.md. Every assumption is a constant below.

``paper``: the seed paper's setting rebuilt from what it states (``../shared/design/paper_setting.md``): 8 × B200,
4 rollout engines of one GPU and 4 learner GPUs, each learner GPU a full copy of the model (DP 4, no TP/PP/EP, the
optimizer state sharded), 32 prompts × 8, its two models by their real configs (``qwen3.5-27b``, the Gated DeltaNet
hybrid; ``glm-4.7-flash``, MLA + 64 experts top-4), trajectories of up to 300 turns and 131,072 tokens. Reported:
GRPO sync 1313.6 s with the learner idle 49.5 %, streaming 687.7 s, async 695.0 s; OPD sync 1330.3 s, streaming
685.7 s. The paper gives no per-turn figures, so the workload's shape is stated here (:data:`PAPER_WORKLOAD`: tool
calls lognormal around 60 (log-sd 0.8, at most 299), 2,048 prompt tokens, 60 generated and 350 tool-output tokens per
turn, ended at 131,072 tokens; swe-like tool latencies) and two numbers are fitted per model to the paper's GRPO sync
step: the learner's MFU so that the learner works 50.5 % of 1313.6 s, then the tool-latency scale so that the sync
step is 1313.6 s. Everything else is predicted: stream-trajectory, stream-group and async(1) under GRPO, and all four
modes under OPD (the same learner, MFU and workload, the teacher's forward on the learner GPUs, or its log-probs
from the rollout engines). Beside each prediction: its per-step
lower bound (``simulate.py``: no schedule of that work ends earlier) and the tail (learner seconds after the last
reward), which is what separates a streaming step from the rollout makespan.

``scaling``: Qwen3-8B (learner TP 2), Qwen3-32B (TP 4 × PP 2) and Qwen3-30B-A3B (learner EP 8, or DP when smaller)
on H100s, half the GPUs rollout engines (8B: one GPU each; the others: two), half the learner; two row sets: swe-like
(latencies at scale 5: median tool call 5 s, 3 calls; 512 prompt, 256 generated per turn, 128 tool-output tokens) and
long-horizon (:data:`LONG_HORIZON`, the paper's trajectory shape: ~60 turns, at most 300, up to 131,072 tokens);
max(32, GPUs) prompts × 8; 3 steps (the first left out).
Reported: stream-trajectory and async(1) over sync, open groups per rank at the peak with arrival-order and group
DP assignment, the bucket peak per learner GPU with every vector on the GPU, and stream-trajectory with group
affinity and bucket residency (:func:`_residency_row`: the device slots that fit in 75 % of the GPU beside the model
state, the host arena per 8-GPU node against :data:`HOST_GIB_PER_NODE`, the copy seconds waited per step, the
speedup lost against every vector on the GPU), or why it does not fit; then host accumulation
(:func:`_host_accumulation_row`: no bucket vector on the GPU, the host arena per node, capped by ``--max-open-groups``
where it would exceed :data:`HOST_FRAC` of :data:`HOST_GIB_PER_NODE`, the learner's waits, the speedup lost).
"""

from __future__ import annotations

import dataclasses

from megatron_tsync.plan.costs import learner_cost, weight_sync_s
from megatron_tsync.plan.hardware import Layout, ModelCost, load_arch
from megatron_tsync.plan.learner import PlannerSettings
from megatron_tsync.plan.memory import PER_GROUP, params_per_rank
from megatron_tsync.plan.report import bucket_memory
from megatron_tsync.plan.simulate import Scenario, simulate
from megatron_tsync.plan.workload import WorkloadSpec, build_batch

PAPER_WORKLOAD = dict(prompts=32, group_size=8, calls=60, calls_sigma=0.8, max_calls=299, prompt_tokens=2048,
                      gen_tokens=60, tool_output_tokens=350, max_context=131072, profile="swe-like")
PAPER_MODELS = ("qwen3.5-27b", "glm-4.7-flash")
PAPER_LAYOUT = dict(gpu="b200", rollout_gpus=4, learner_gpus=4)  # DP 4: every learner GPU a full copy
PAPER = {"grpo": {"sync": 1313.6, "stream": 687.7, "async": 695.0, "idle": 0.495},
         "opd": {"sync": 1330.3, "stream": 685.7}}
PAPER_HOST_TB = {"qwen3.5-27b": 1.30, "glm-4.7-flash": 1.49}  # pinned fp32 accumulators over the 4 ranks
STEPS = 3


def _scenario(model: str, layout: Layout, opd: bool = False, settings: PlannerSettings = PlannerSettings(),
              teacher_on_learner: bool = True):
    arch = load_arch(model)
    cost = ModelCost.of(arch)
    teacher = cost if opd and teacher_on_learner else None
    sc = Scenario(cost=cost, layout=layout, learner=learner_cost(arch, layout, teacher=teacher),
                  settings=settings, sync_s=weight_sync_s(cost, layout), opd=opd)
    return arch, sc


def _batches(scale: float, workload: dict = PAPER_WORKLOAD, **kw):
    ws = WorkloadSpec(**{**workload, **kw}, latency_scale=scale)
    return [build_batch(ws, k) for k in range(STEPS)]


def _sync(model: str, mfu: float, scale: float) -> dict:
    sc = _scenario(model, Layout(**PAPER_LAYOUT, mfu=mfu))[1]
    return simulate(sc, _batches(scale), ("sync",))["sync"]["summary"]


def _bisect(f, lo: float, hi: float, target: float, rising: bool, iters: int) -> float:
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if (f(mid) > target) == rising else (mid, hi)
    return (lo + hi) / 2


def fit(model: str, rounds: int = 2) -> tuple[float, float]:
    """(learner MFU, tool-latency scale) at which the simulated GRPO sync step is the paper's: the learner busy
    (1 − 49.5 %) of the step, then the step's length 1313.6 s. The two interact a little (which rank trains which
    trajectory follows the landing order), so the second round refits each within ±25 % of the first."""
    target = PAPER["grpo"]
    mfu, scale, lo_m, hi_m, lo_s, hi_s, iters = 0.3, 0.1, 0.02, 1.0, 0.0, 4.0, 10
    for _ in range(rounds):
        sync_s = _scenario(model, Layout(**PAPER_LAYOUT, mfu=mfu))[1].sync_s
        busy = (1 - target["idle"]) * target["sync"] - sync_s  # idle = step − weight sync − busy
        mfu = _bisect(lambda m: _sync(model, m, scale)["learner_busy_s"], lo_m, hi_m, busy, rising=False, iters=iters)
        scale = _bisect(lambda x: _sync(model, mfu, x)["step_s"], lo_s, hi_s, target["sync"], rising=True, iters=iters)
        lo_m, hi_m, lo_s, hi_s, iters = 0.8 * mfu, 1.25 * mfu, 0.8 * scale, 1.25 * scale, 6
    return mfu, scale


def _paper_row(model: str, algo: str, mfu: float, scale: float) -> dict:
    """``algo``: grpo; opd (the teacher's forward on the learner GPUs); opd-engines (teacher log-probs from the
    rollout engines, as with a vLLM teacher: the learner's work is GRPO's; the engines' teacher prefill not counted)."""
    arch, sc = _scenario(model, Layout(**PAPER_LAYOUT, mfu=mfu), opd=algo != "grpo",
                         teacher_on_learner=algo == "opd")
    batches = _batches(scale)
    s = {m: v["summary"] for m, v in simulate(sc, batches).items()}
    k = s["stream-trajectory"]["peak_open_groups"]
    p_rank = params_per_rank(arch, 1, 1)
    tokens = [tr.tokens for b in batches[1:] for tr in b]
    return {"model": model, "algorithm": algo, "mfu": mfu, "latency_scale": scale, "paper": PAPER[algo.split("-")[0]],
            "modes": s, "mean_tokens": sum(tokens) / len(tokens), "max_tokens": max(tokens),
            "bucket": bucket_memory(arch, sc, k) if algo == "grpo" else None,
            # the paper's host-memory bound per rank, 4(2k+1)P bytes, at this workload's peak open groups
            "host_bound_tb": 4 * (PER_GROUP["grpo"] * k + 1) * p_rank / 1e12 if algo == "grpo" else 0.0}


def paper() -> list[dict]:
    """Per model: fit (module docstring), then GRPO and OPD in every mode."""
    rows = []
    for model in PAPER_MODELS:
        mfu, scale = fit(model)
        rows += [_paper_row(model, algo, mfu, scale) for algo in ("grpo", "opd", "opd-engines")]
    return rows


def print_paper(rows: list[dict]) -> None:
    print("| model | algorithm | fitted MFU / tool scale | sync step s (paper) | learner idle (paper 49.5 %) | "
          "stream-trajectory s (paper) | bound s | tail s | stream-group s | async(1) s (paper) | open groups | "
          "host fp32 bound TB/rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s, p = r["modes"], r["paper"]
        st = s["stream-trajectory"]
        paper_async = f" ({p['async']:.1f})" if "async" in p else ""
        host = f"{r['host_bound_tb']:.2f}" if r["algorithm"] == "grpo" else "—"
        print(f"| {r['model']} | {r['algorithm']} | {r['mfu']:.2f} / {r['latency_scale']:.2f} | "
              f"{s['sync']['step_s']:.1f} ({p['sync']:.1f}) | {100 * s['sync']['idle_frac']:.1f} % | "
              f"{st['step_s']:.1f} ({p['stream']:.1f}) | {st['bound_s']:.1f} | {st['tail_s']:.1f} | "
              f"{s['stream-group']['step_s']:.1f} | {s['async']['step_s']:.1f}{paper_async} | "
              f"{st['peak_open_groups']} | {host} |")


SCALING_WORKLOAD = dict(prompts=32, group_size=8, calls=3, prompt_tokens=1024, gen_tokens=512, tool_output_tokens=256,
                        profile="swe-like")
SCALING_MODELS = {"qwen3-8b": dict(tp=2, rollout_tp=1), "qwen3-32b": dict(tp=4, pp=2, rollout_tp=2),
                  "qwen3-30b-a3b": dict(ep=8, rollout_tp=2, mfu=0.2)}
LONG_HORIZON = dict(PAPER_WORKLOAD, prompts=32)  # the paper's trajectory shape: ~60 turns (≤ 300), ≤ 131,072 tokens
HOST_GIB_PER_NODE = 2048.0  # an 8-GPU H100 node's host memory (DGX H100: 2 TB)
HOST_FRAC = 0.8  # of it the pinned arena may take (the rest: the OS, data loading, checkpoints)


def _residency_row(arch, sc, batches, sync_s: float) -> dict:
    """stream-trajectory with group affinity, then with bucket residency too: the device slots that fit beside the
    model state (0.75 of the GPU), the host arena per node, copy waits, and the share of the step residency costs
    against affinity with every vector on the GPU ("loss")."""
    per_group = PER_GROUP["grpo"]
    aff = dataclasses.replace(sc, settings=PlannerSettings(dp_assignment="group"))
    a = simulate(aff, batches, ("stream-trajectory",))["stream-trajectory"]["summary"]
    mem = bucket_memory(arch, aff, a["peak_open_groups"])
    free = 0.75 * mem["gpu_gib"] - mem["model_state_gib"]
    fit = max(0, int(free // mem["vector_gib"]))
    out = {"affinity_open_groups": a["peak_open_groups"], "affinity_speedup": sync_s / a["step_s"],
           "device_slots": fit, "model_state_gib": mem["model_state_gib"], "vector_gib": mem["vector_gib"]}
    out.update(_host_accumulation_row(arch, aff, batches, sync_s, a["step_s"], mem))
    if fit < 2:
        return {**out, "why": f"model state {mem['model_state_gib']:.0f} GiB + the 2 device vectors residency needs "
                              f"(2 × {mem['vector_gib']:.1f} GiB) > 75 % of {mem['gpu_gib']:.0f} GiB"}
    if mem["bucket_vectors"] <= fit:
        return {**out, "host_gib_per_node": 0.0, "copy_wait_s": 0.0, "residency_speedup": sync_s / a["step_s"],
                "loss": 0.0, "why": ""}
    res = dataclasses.replace(aff, settings=PlannerSettings(dp_assignment="group", device_vectors=fit))
    r = simulate(res, batches, ("stream-trajectory",))["stream-trajectory"]["summary"]
    node = min(8, sc.layout.learner_gpus)
    host = r["peak_host_vectors"] * mem["vector_gib"] * node
    why = "" if host <= HOST_FRAC * HOST_GIB_PER_NODE else \
        f"host arena {host:.0f} GiB/node > {HOST_FRAC:.0%} of {HOST_GIB_PER_NODE:.0f} GiB"
    return {**out, "host_gib_per_node": host, "copy_wait_s": r["copy_wait_s"], "moved_vectors": r["moved_vectors"],
            "residency_speedup": sync_s / r["step_s"], "loss": 1.0 - a["step_s"] / r["step_s"], "why": why}


def _host_accumulation_row(arch, aff, batches, sync_s: float, unlimited_s: float, mem: dict) -> dict:
    """stream-trajectory with group affinity and host accumulation (``--accumulate-on-host``): no gradient vector on
    the GPU beyond the grad buffer (in the model state), the accumulator and 2k bucket vectors per rank on the host;
    the learner's waits for the scratch (``learner._HostAccum``) and the share of the unlimited-memory step it costs
    ("host_acc_loss"). Where the host arena exceeds :data:`HOST_FRAC` of the node, re-simulated with the largest
    ``--max-open-groups`` cap that fits ("host_acc_cap"; the overflow groups stream per group); or why it does not
    fit."""
    def run(cap):
        st = PlannerSettings(dp_assignment="group", host_accumulation=True, max_open_groups=cap)
        return simulate(dataclasses.replace(aff, settings=st), batches, ("stream-trajectory",))[
            "stream-trajectory"]["summary"]

    r, cap = run(None), None
    node = min(8, aff.layout.learner_gpus)
    limit = HOST_FRAC * HOST_GIB_PER_NODE
    host = r["peak_host_vectors"] * mem["vector_gib"] * node
    if host > limit:
        cap = int((limit / node / mem["vector_gib"] - 1) // PER_GROUP["grpo"])
        if cap >= 1:
            r = run(cap)
            host = r["peak_host_vectors"] * mem["vector_gib"] * node
    why = []
    if mem["model_state_gib"] > 0.75 * mem["gpu_gib"]:
        why.append(f"model state {mem['model_state_gib']:.0f} GiB > 75 % of {mem['gpu_gib']:.0f} GiB")
    if host > limit:
        why.append(f"host {host:.0f} GiB/node > {HOST_FRAC:.0%} of {HOST_GIB_PER_NODE:.0f} GiB")
    return {"host_acc_speedup": sync_s / r["step_s"], "host_acc_loss": 1.0 - unlimited_s / r["step_s"],
            "host_acc_wait_s": r["copy_wait_s"], "host_acc_gib_per_node": host, "host_acc_cap": cap,
            "host_acc_why": "; ".join(why)}


def scaling(gpus=(8, 64, 512, 1024), models=SCALING_MODELS, scale: float = 5.0, per_gpu: int = 1,
            workloads=("swe-like", "long-horizon")) -> list[dict]:
    """``per_gpu``: prompts per GPU (at least 32 prompts), 8 trajectories each; ``workloads``: the short swe-like
    rows and the long-horizon ones (:data:`LONG_HORIZON`)."""
    rows = []
    for workload in workloads:
        for model, kw in models.items():
            for n in gpus:
                row = {"model": model, "gpus": n, "workload": workload}
                tp_pp = kw.get("tp", 1) * kw.get("pp", 1)
                if n // 2 % tp_pp:
                    rows.append({**row, "why": f"{n // 2} learner GPUs do not hold TP × PP = {tp_pp}"})
                    continue
                dp = n // 2 // tp_pp
                lay = Layout(gpu="h100", rollout_gpus=n // 2, learner_gpus=n // 2,
                             **{**kw, "ep": min(kw.get("ep", 1), dp)})
                arch, sc = _scenario(model, lay)
                shape = SCALING_WORKLOAD if workload == "swe-like" else LONG_HORIZON
                extra = dict(prompt_tokens=512, gen_tokens=256, tool_output_tokens=128) if workload == "swe-like" else {}
                batches = _batches(scale, shape, prompts=max(32, per_gpu * n), group_size=8, **extra)
                s = {m: v["summary"] for m, v in simulate(sc, batches, ("sync", "stream-trajectory", "async")).items()}
                mem = bucket_memory(arch, sc, s["stream-trajectory"]["peak_open_groups"])
                rows.append({**row, "trajectories": len(batches[0]), "sync_step_s": s["sync"]["step_s"],
                             "stream_speedup": s["stream-trajectory"]["speedup_vs_sync"],
                             "async_speedup": s["async"]["speedup_vs_sync"], "bucket": mem,
                             **_residency_row(arch, sc, batches, s["sync"]["step_s"])})
    return rows


def main(name: str) -> list[dict]:
    if name == "paper":
        rows = paper()
        print_paper(rows)
        return rows
    rows = scaling()
    print_scaling(rows)
    return rows


def print_scaling(rows: list[dict]) -> None:
    print("| workload | model | GPUs | trajectories | sync step s | stream-trajectory | async(1) | open groups/rank "
          "(arrival → group) | stream-trajectory, group | bucket GiB/GPU, arrival | device slots | host arena "
          "GiB/node | copy wait s/step | stream-trajectory, group + residency | lost to residency | within memory | "
          "host acc.: open groups cap | host GiB/node | wait s/step | stream-trajectory | lost | within memory |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        head = f"| {r['workload']} | {r['model']} | {r['gpus']} |"
        if "sync_step_s" not in r:
            print(head + " — |" * 12 + f" no: {r['why']} |" + " — |" * 5 + f" no: {r['why']} |")
            continue
        b = r["bucket"]
        res = "—" if "residency_speedup" not in r else f"{r['residency_speedup']:.2f}×"
        loss = "—" if "loss" not in r else f"{100 * r['loss']:.1f} %"
        host = "—" if "host_gib_per_node" not in r else f"{r['host_gib_per_node']:.0f}"
        wait = "—" if "copy_wait_s" not in r else f"{r['copy_wait_s']:.1f}"
        print(f"{head} {r['trajectories']} | {r['sync_step_s']:.1f} | {r['stream_speedup']:.2f}× | "
              f"{r['async_speedup']:.2f}× | {b['peak_open_groups']} → {r['affinity_open_groups']} | "
              f"{r['affinity_speedup']:.2f}× | {b['bucket_gib']:.0f} | {r['device_slots']} | {host} | {wait} | {res} | {loss} | "
              f"{'yes' if not r['why'] else 'no: ' + r['why']} | {r['host_acc_cap'] or '—'} | "
              f"{r['host_acc_gib_per_node']:.0f} | "
              f"{r['host_acc_wait_s']:.1f} | {r['host_acc_speedup']:.2f}× | {100 * r['host_acc_loss']:.1f} % | "
              f"{'yes' if not r['host_acc_why'] else 'no: ' + r['host_acc_why']} |")
