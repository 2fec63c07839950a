"""What the planner prints: the per-mode table, bucket memory per rank, recommended settings, the timeline PNG.

Bucket memory: ``memory.estimate`` (the code behind ``examples/bucket_memory.py``) with the simulated peak of open
groups on one rank (stream-trajectory; the planner opens a group's bucket when its first trajectory streams into it).

Recommendations, each from a re-simulation of stream-trajectory (so a knob is recommended only when the simulation
says it shortens the step or is needed to fit):

- ``--stream-coalesce-tokens N``: the best of 0 and a few token targets (2, 4, 8 × the mean trajectory);
- ``--sequence-packing``: on when packed microbatches (``--max-packed-tokens``) shorten the step;
- ``--max-device-buckets N`` / offload: when the bucket peak does not fit next to the model state (``costs.py``) in
  ``mem_frac`` of the GPU's memory (the rest for activations and the allocator), keep N vectors on the GPU and the
  rest in host memory (``streaming/offload.py``; N >= 2, the residency's smallest device cache); ``--max-open-groups``
  when not even that fits.

The printed advice (:func:`options`) ranks every zero-staleness way to run within the GPU's memory by its predicted
step: ``stream-group`` (no bucket vectors: a group trains once it is complete), ``stream-trajectory`` as it is (if
its bucket peak fits), with the largest ``--max-open-groups`` cap that fits (re-simulated), and with host residency
(``--max-device-buckets N``: stream-trajectory re-simulated with N device slots — ``learner.py``'s residency model:
vectors moved over the GPU's host link, ``hardware.GPUS``' ``host_link_gbs``, each microbatch's copies hidden behind
the previous microbatch — with the host arena's peak per node, ``GPUS_PER_NODE`` learner GPUs on a node, and the copy
seconds the learner waited for), and with host accumulation (``--accumulate-on-host``: no bucket vector on the GPU,
the accumulator and every bucket on the host, ``learner.py``'s ``_HostAccum`` model: a flush per microbatch behind the
next forward, host adds at ``host_add_gbs``; it fits wherever the model state does).
"""

from __future__ import annotations

import dataclasses
import statistics

from megatron_tsync.model.builder import ModelArch
from megatron_tsync.plan.costs import rank_state_gib
from megatron_tsync.plan.memory import PER_GROUP, estimate
from megatron_tsync.plan.simulate import Scenario, simulate

GIB = 1 << 30


def bucket_memory(arch: ModelArch, sc: Scenario, peak_open_groups: int) -> dict:
    lay = sc.layout
    e = estimate(arch, lay.tp, lay.pp, sc.settings.estimator, peak_open_groups, ep=lay.ep)
    state = rank_state_gib(arch, lay)
    return {"peak_open_groups": peak_open_groups, "bucket_vectors": e["bucket_vectors"],
            "vector_gib": e["vector_bytes"] / GIB, "bucket_gib": e["bucket_bytes"] / GIB, "model_state_gib": state,
            "gpu_gib": lay.spec("mem_gib")}


def recommend(arch: ModelArch, sc: Scenario, batches, base_step_s: float, mem: dict, mem_frac: float = 0.75) -> dict:
    """Settings for stream-trajectory (module docstring); each with the simulated step it gives."""
    mean_tok = statistics.mean(tr.tokens for b in batches for tr in b)
    out: dict = {}

    def step(settings) -> float:
        s2 = dataclasses.replace(sc, settings=settings)
        return simulate(s2, batches, modes=("stream-trajectory",))["stream-trajectory"]["summary"]["step_s"]

    best_n, best_s = 0, base_step_s
    for mult in (2, 4, 8):
        n = int(round(mult * mean_tok, -2))
        s = step(dataclasses.replace(sc.settings, coalesce_tokens=n))
        if s < best_s * 0.99:
            best_n, best_s = n, s
    out["stream_coalesce_tokens"] = {"value": best_n, "step_s": best_s}
    s = step(dataclasses.replace(sc.settings, sequence_packing=True))
    out["sequence_packing"] = {"value": s < base_step_s * 0.99, "step_s": s}
    free = mem["gpu_gib"] * mem_frac - mem["model_state_gib"]
    fit = max(0, int(free // mem["vector_gib"])) if mem["vector_gib"] > 0 else 0
    per_group = PER_GROUP.get(sc.settings.estimator, 2)
    if mem["bucket_vectors"] <= fit:
        out["max_device_buckets"] = {"value": None, "why": f"the peak {mem['bucket_vectors']} vectors fit "
                                     f"({fit} would, {free:.1f} GiB free of {mem['gpu_gib']:.0f} GiB × {mem_frac})"}
    elif fit >= MIN_DEVICE_VECTORS:
        out["max_device_buckets"] = {"value": fit, "why": f"{mem['bucket_vectors']} vectors at the peak, {fit} fit on "
                                     f"the GPU: offload the rest to host memory"}
    else:
        out["max_device_buckets"] = {"value": None, "why": f"bucket residency keeps {MIN_DEVICE_VECTORS} vectors on "
                                     f"the GPU, {fit} fit next to the model state ({free:.1f} GiB free): stream-group, "
                                     "or raise TP/PP", "max_open_groups": fit // per_group or None}
    return out


GPUS_PER_NODE = 8
MIN_DEVICE_VECTORS = 2  # bucket residency's smallest device cache (an origin shift touches P and Q at once)


def options(arch: ModelArch, sc: Scenario, batches, out: dict, mem: dict, mem_frac: float = 0.75) -> list[dict]:
    """The ways to run stream-trajectory or stream-group within memory, fastest first, then those that do not fit
    (``fits`` False, with ``why``). Each: ``flags``, ``step_s``, ``speedup_vs_sync``, ``bucket_gib`` per GPU,
    ``host_gib_per_node``, ``transfer_s``."""
    sync_s = out["sync"]["summary"]["step_s"] if "sync" in out else None
    free = mem["gpu_gib"] * mem_frac - mem["model_state_gib"]
    vec = mem["vector_gib"]
    fit = max(0, int(free // vec)) if vec > 0 else 0
    per_group = PER_GROUP.get(sc.settings.estimator, 2)
    node = min(GPUS_PER_NODE, sc.layout.learner_gpus)
    rows: list[dict] = []

    def add(flags, step_s, vectors, fits, why="", host_gib=0.0, transfer_s=0.0):
        rows.append({"flags": flags, "step_s": step_s, "bucket_gib": vectors * vec, "fits": fits, "why": why,
                     "host_gib_per_node": host_gib * node, "transfer_s": transfer_s,
                     "speedup_vs_sync": sync_s / step_s if sync_s and step_s else None})

    if "stream-group" in out:
        add("--rl-mode stream-group", out["stream-group"]["summary"]["step_s"], 0, True)
    st = out["stream-trajectory"]["summary"]["step_s"]
    peak = mem["bucket_vectors"]
    if sc.settings.host_accumulation:  # the simulated stream-trajectory already keeps every bucket on the host
        add("--rl-mode stream-trajectory --accumulate-on-host", st, 0, free >= 0,
            "" if free >= 0 else f"the model state leaves {free:.1f} GiB of {mem_frac:.0%} of the GPU",
            host_gib=out["stream-trajectory"]["summary"]["peak_host_vectors"] * vec,
            transfer_s=out["stream-trajectory"]["summary"]["copy_wait_s"])
        return rows
    add("--rl-mode stream-trajectory", st, peak, peak <= fit,
        "" if peak <= fit else f"{peak} bucket vectors at the peak, {fit} fit")
    cap = fit // per_group
    if peak > fit and cap >= 1:
        s2 = dataclasses.replace(sc, settings=dataclasses.replace(sc.settings, max_open_groups=cap))
        step = simulate(s2, batches, modes=("stream-trajectory",))["stream-trajectory"]["summary"]["step_s"]
        add(f"--rl-mode stream-trajectory --max-open-groups {cap}", step, cap * per_group, True)
    if peak > fit:
        n = max(fit, MIN_DEVICE_VECTORS)
        s2 = dataclasses.replace(sc, settings=dataclasses.replace(sc.settings, device_vectors=n))
        r = simulate(s2, batches, modes=("stream-trajectory",))["stream-trajectory"]["summary"]
        add(f"--rl-mode stream-trajectory --max-device-buckets {n}", r["step_s"], n, fit >= n,
            "" if fit >= n else f"bucket residency keeps {n} vectors on the GPU, {fit} fit",
            host_gib=r["peak_host_vectors"] * vec, transfer_s=r["copy_wait_s"])
    if peak > fit:  # host accumulation: nothing on the GPU beyond the grad buffer (in the model state)
        s2 = dataclasses.replace(sc, settings=dataclasses.replace(sc.settings, host_accumulation=True))
        r = simulate(s2, batches, modes=("stream-trajectory",))["stream-trajectory"]["summary"]
        add("--rl-mode stream-trajectory --accumulate-on-host", r["step_s"], 0, free >= 0,
            "" if free >= 0 else f"the model state leaves {free:.1f} GiB of {mem_frac:.0%} of the GPU",
            host_gib=r["peak_host_vectors"] * vec, transfer_s=r["copy_wait_s"])
    return sorted(rows, key=lambda r: (not r["fits"], round(r["step_s"], 2), r["bucket_gib"]))  # ties: less memory


def options_text(rows: list[dict]) -> str:
    """The advice as printed: the options within memory, ranked, then what does not fit."""
    lines = ["options within memory, fastest predicted step first:"]
    n = 0
    for r in rows:
        sp = f", {r['speedup_vs_sync']:.2f}× vs sync" if r["speedup_vs_sync"] else ""
        if not r["fits"]:
            lines.append(f"  does not fit: {r['flags']} ({r['why']}: {r['bucket_gib']:.1f} GiB of buckets per GPU)")
            continue
        n += 1
        extra = (f"; host RAM {r['host_gib_per_node']:.0f} GiB per {GPUS_PER_NODE}-GPU node, "
                 f"{r['transfer_s']:.2f} s per step waiting on copies (included)" if r["host_gib_per_node"] else "")
        lines.append(f"  {n}. {r['flags']}: step {r['step_s']:.2f} s{sp}, {r['bucket_gib']:.1f} GiB of buckets per "
                     f"GPU{extra}")
    return "\n".join(lines)


def table(out: dict) -> str:
    """Markdown: one row per mode."""
    lines = ["| mode | step s | vs sync | rollout makespan s | learner busy s | idle | tail s | sync s | bound s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m, v in out.items():
        s = v["summary"]
        lines.append(f"| {m} | {s['step_s']:.2f} | {s.get('speedup_vs_sync', float('nan')):.2f}× | "
                     f"{s['makespan_s']:.2f} | {s['learner_busy_s']:.2f} | {s['idle_frac']:.0%} | {s['tail_s']:.2f} | "
                     f"{s['sync_s']:.2f} | {s['bound_s']:.2f} |")
    return "\n".join(lines)


def plot(out: dict, path: str, title: str) -> None:
    """One steady-state step per mode (the second step, or the only one): rank 0's learner busy intervals (blue),
    every reward's landing (grey ticks), the weight sync (orange)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(out), 1, figsize=(10, 1.3 * len(out) + 0.8), sharex=True)
    axes = axes if hasattr(axes, "__len__") else [axes]
    xmax = 0.0
    for ax, (m, v) in zip(axes, out.items()):
        r = v["rows"][1] if len(v["rows"]) > 1 else v["rows"][0]
        for a, b in r.busy:
            ax.axvspan(a, b, ymin=0.3, ymax=0.9, color="tab:blue", alpha=0.8)
        ax.vlines(r.landed, 0.0, 0.25, color="grey", lw=0.6)
        ax.axvspan(r.step_s - r.sync_s, r.step_s, ymin=0.3, ymax=0.9, color="tab:orange", alpha=0.8)
        ax.set_yticks([])
        ax.set_ylabel(m, rotation=0, ha="right", va="center")
        xmax = max(xmax, r.step_s)
    axes[-1].set_xlim(0, xmax * 1.02)
    axes[-1].set_xlabel("seconds since the step's start (blue: learner rank 0 busy, grey: rewards landing, "
                        "orange: weight sync)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
