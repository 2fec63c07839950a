"""The simulation never predicts a step below its lower bound (every mode, step, layout and setting tried), the bound
is attained where no schedule can do better, and the modes order as the streaming argument says."""

import dataclasses

import pytest

from megatron_tsync.plan.costs import learner_cost, weight_sync_s
from megatron_tsync.plan.hardware import Layout, ModelCost, load_arch
from megatron_tsync.plan.learner import LearnerCost, PlannerSettings
from megatron_tsync.plan.simulate import MODES, Scenario, simulate
from megatron_tsync.plan.workload import WorkloadSpec, build_batch


def _scenario(model="qwen3-8b", settings=PlannerSettings(), opd=False, **layout):
    arch = load_arch(model)
    lay = Layout(**layout)
    cost = ModelCost.of(arch)
    return Scenario(cost=cost, layout=lay, learner=learner_cost(arch, lay, teacher=cost if opd else None),
                    settings=settings, sync_s=weight_sync_s(cost, lay), opd=opd)


CASES = [
    dict(),
    dict(model="qwen3-30b-a3b", learner_gpus=8, ep=2, rollout_gpus=8, rollout_tp=2, gpu="h200"),
    dict(pp=2, settings=PlannerSettings(sequence_packing=True, coalesce_tokens=4000)),
    dict(learner_gpus=64, tp=2, settings=PlannerSettings(max_open_groups=2)),
    dict(opd=True, gpu="b200"),
    dict(learner_gpus=4, settings=PlannerSettings(dp_assignment="group")),
    dict(learner_gpus=4, settings=PlannerSettings(dp_assignment="group", device_vectors=4)),
    dict(learner_gpus=4, pp=2, settings=PlannerSettings(dp_assignment="group", host_accumulation=True)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("profile,scale", [("swe-like", 3.0), ("uniform", 0.2)])
def test_never_below_the_bound(case, profile, scale):
    sc = _scenario(**CASES[case])
    batches = [build_batch(WorkloadSpec(prompts=8, group_size=4, profile=profile, latency_scale=scale, seed=case), k)
               for k in range(3)]
    out = simulate(sc, batches)
    for m in MODES:
        for r in out[m]["rows"]:
            assert r.step_s >= r.bound_s * (1 - 1e-12), (m, r.step, r.step_s, r.bound_s)
            assert r.busy_s > 0 and r.idle_s >= 0


def test_sync_accounting_and_modes_ordered():
    """No per-microbatch overhead, no folds, one rank: a sync step is exactly its last reward + the work of the
    trajectories it trains + barrier + weight sync; with spread-out rewards streaming beats sync."""
    sc = _scenario(learner_gpus=1)
    lc = dataclasses.replace(sc.learner, overhead_s=0.0, fold_s=0.0)
    sc = dataclasses.replace(sc, learner=lc)
    batches = [build_batch(WorkloadSpec(prompts=4, group_size=4, latency_scale=2.0), k) for k in range(2)]
    r = simulate(sc, batches, ("sync",))["sync"]["rows"][1]
    rewards = {}
    for tr in batches[1]:
        rewards.setdefault(tr.group_id, set()).add(tr.reward)
    trained = [tr for tr in batches[1] if len(rewards[tr.group_id]) > 1]  # all-equal groups: skipped
    assert 0 < len(trained) < len(batches[1])
    work = sum(lc.microbatch_s(tr.tokens) for tr in trained)
    assert r.step_s == pytest.approx(r.last_reward_s + work + lc.barrier_s + sc.sync_s, rel=1e-9)
    spread = [build_batch(WorkloadSpec(prompts=8, group_size=4, latency_scale=5.0), k) for k in range(3)]
    s = {m: v["summary"] for m, v in simulate(sc, spread).items()}
    assert s["stream-trajectory"]["step_s"] <= s["stream-group"]["step_s"] < s["sync"]["step_s"]
    assert s["stream-trajectory"]["tail_s"] < s["sync"]["tail_s"]
    assert s["sync"]["peak_open_groups"] == 0 < s["stream-trajectory"]["peak_open_groups"]


def test_learner_cost_scales_with_the_layout():
    arch = load_arch("qwen3-8b")
    one, four = learner_cost(arch, Layout(tp=1)), learner_cost(arch, Layout(tp=4))
    assert one.per_token_s == pytest.approx(4 * four.per_token_s)
    assert LearnerCost(0.5, 0.01, 1e-6).microbatch_s(100) == pytest.approx(0.5 + 1.0 + 0.01)


def test_paper_fit_recovers_a_known_step(monkeypatch):
    """``--scenario paper`` fits the learner's MFU and the tool-latency scale to the paper's sync step and idle share
    (plan/scenarios.py): on a small workload whose step at (0.3, 0.5) is known, the fit finds a point with that step
    and idle share again, and the long-horizon workload's turns and context caps hold."""
    from megatron_tsync.plan import scenarios

    small = dict(scenarios.PAPER_WORKLOAD, prompts=4, group_size=4, calls=12, max_calls=40, max_context=6000)
    monkeypatch.setattr(scenarios, "PAPER_WORKLOAD", small)
    monkeypatch.setattr(scenarios, "_batches", lambda scale, workload=small, **kw: [
        build_batch(WorkloadSpec(**{**workload, **kw}, latency_scale=scale), k) for k in range(scenarios.STEPS)])
    known = scenarios._sync("qwen3.5-27b", 0.3, 0.5)
    monkeypatch.setitem(scenarios.PAPER, "grpo", {"sync": known["step_s"], "idle": known["idle_frac"]})
    mfu, scale = scenarios.fit("qwen3.5-27b")
    got = scenarios._sync("qwen3.5-27b", mfu, scale)
    assert got["step_s"] == pytest.approx(known["step_s"], rel=0.02)
    assert got["idle_frac"] == pytest.approx(known["idle_frac"], abs=0.02)
    trajs = scenarios._batches(scale)[0]
    assert max(len(t.turns) for t in trajs) <= 41 and max(t.tokens for t in trajs) <= 6000
    assert len({len(t.turns) for t in trajs}) > 3  # turns vary per trajectory


def test_group_assignment_opens_fewer_groups_per_rank():
    """--dp-assignment group in the planner (the trainer's DataParallelAssigner): at DP 4 on the swe-like profile a
    rank holds buckets for about a quarter of the open groups instead of all of them, at about the same step; spill
    (a group's member to the least-loaded rank when its group's rank runs ahead) keeps arrival order's step within
    2 % at clearly fewer open groups per rank."""
    batches = [build_batch(WorkloadSpec(prompts=32, group_size=8, latency_scale=3.0), k) for k in range(3)]
    out = {}
    for how in ("arrival", "group", "spill"):
        sc = _scenario(learner_gpus=4, settings=PlannerSettings(dp_assignment=how))
        out[how] = simulate(sc, batches, ("sync", "stream-trajectory"))["stream-trajectory"]["summary"]
    print({how: (v["peak_open_groups"], round(v["step_s"], 2)) for how, v in out.items()})
    assert out["group"]["peak_open_groups"] * 2 <= out["arrival"]["peak_open_groups"]
    assert out["group"]["step_s"] <= 1.1 * out["arrival"]["step_s"]
    assert out["spill"]["peak_open_groups"] * 4 <= out["arrival"]["peak_open_groups"] * 3
    assert out["spill"]["step_s"] <= 1.02 * out["arrival"]["step_s"]


def test_frontier_first_closes_groups_sooner_when_engines_are_full():
    """--rollout-frontier-first in the planner: with engines at their concurrency cap (16 sequences, 64 trajectories
    each), admitting earlier groups first lowers the learner's peak of open groups in stream-trajectory; without a
    full engine (cap 256) it changes nothing."""
    batches = [build_batch(WorkloadSpec(prompts=32, group_size=8, latency_scale=3.0), k) for k in range(3)]
    out = {}
    for cap in (16, 256):
        for frontier in (False, True):
            sc = _scenario(max_concurrency=cap, frontier_first=frontier)
            out[cap, frontier] = simulate(sc, batches, ("stream-trajectory",))["stream-trajectory"]["summary"]
    print({k: (v["peak_open_groups"], round(v["step_s"], 1)) for k, v in out.items()})
    assert out[16, True]["peak_open_groups"] < out[16, False]["peak_open_groups"]
    assert out[256, True] == out[256, False]


def test_bucket_residency_moves_vectors_and_waits_only_for_what_compute_does_not_hide():
    """Bucket residency in the planner (PlannerSettings.device_vectors, the trainer's --max-device-buckets): with 4
    device slots vectors go to the host and back, the step is never shorter than with every vector on the GPU, and
    the copy time waited for falls with the host link's bandwidth (PCIe Gen5 on an H100, NVLink-C2C on a GH200)."""
    batches = [build_batch(WorkloadSpec(prompts=32, group_size=8, latency_scale=3.0), k) for k in range(3)]
    out = {}
    for gpu in ("h100", "gh200"):
        for dv in (None, 4):
            sc = _scenario(gpu=gpu, learner_gpus=4, settings=PlannerSettings(device_vectors=dv))
            out[gpu, dv] = simulate(sc, batches, ("stream-trajectory",))["stream-trajectory"]["summary"]
    for gpu in ("h100", "gh200"):
        assert out[gpu, None]["moved_vectors"] == out[gpu, None]["peak_host_vectors"] == 0
        assert out[gpu, 4]["moved_vectors"] > 0 and out[gpu, 4]["peak_host_vectors"] > 0
        assert out[gpu, 4]["step_s"] >= out[gpu, None]["step_s"] - 1e-9
    assert 0 < out["gh200", 4]["copy_wait_s"] < out["h100", 4]["copy_wait_s"]


def test_host_accumulation_flushes_and_waits_only_for_what_the_forward_does_not_hide():
    """Host accumulation in the planner (PlannerSettings.host_accumulation, the trainer's --accumulate-on-host): the
    scratch is flushed (moved vectors > 0), the host holds the accumulator + 2 vectors per open group, the step is
    never shorter than with every vector on the GPU, and the learner's wait grows as the host's memory bandwidth falls
    (control: a host add 100× slower) and shrinks with a faster link and host (GH200)."""
    batches = [build_batch(WorkloadSpec(prompts=32, group_size=8, latency_scale=3.0), k) for k in range(3)]
    out = {}
    for gpu, add in (("h100", None), ("h100", 0.576), ("gh200", None)):
        for host in (False, True):
            sc = _scenario(gpu=gpu, learner_gpus=4, host_add_gbs=add, settings=PlannerSettings(host_accumulation=host))
            out[gpu, add, host] = simulate(sc, batches, ("stream-trajectory",))["stream-trajectory"]["summary"]
    h = out["h100", None, True]
    assert out["h100", None, False]["moved_vectors"] == 0 and h["moved_vectors"] > 0
    assert h["peak_host_vectors"] == 1 + 2 * h["peak_open_groups"]
    assert h["step_s"] >= out["h100", None, False]["step_s"] - 1e-9
    assert out["gh200", None, True]["copy_wait_s"] < h["copy_wait_s"] < out["h100", 0.576, True]["copy_wait_s"]
    assert out["h100", 0.576, True]["step_s"] > h["step_s"]


def test_host_accumulation_cost_model_matches_the_cpu_path():
    """The planner's flush model (one vector: D2H copy at ``host_link_gbs`` + host add of 12 bytes per element at
    ``host_add_gbs``; on CPU the two run one after the other) against ``HostAccumulation``'s measured seconds on this
    machine's "cpu" constants, within a factor of 3 (2 shared cores: timings vary)."""
    import torch

    from megatron_tsync.plan.hardware import GPUS
    from megatron_tsync.streaming.buckets import BucketPool, GradVector
    from megatron_tsync.streaming.host_accum import HostAccumulation

    class _Router:
        def __init__(self, n):
            self.accumulator = GradVector([torch.zeros(n)])

    r = _Router(16 << 20)  # 64 MiB fp32
    h = HostAccumulation(r, threaded=False)
    pool = BucketPool(r.accumulator)
    h.begin_step(1)
    q = h.acquire(pool, "Q")
    for dest in ([(q, 1.0)], [(h.accumulator, 1.0)]) * 2:
        h.route(dest)
        h.begin_backward()
        r.accumulator.parts[0].fill_(1.0)
        h.flush()
    s = h.step_stats()
    assert s["flushes"] == 4 and s["d2h_bytes"] == 4 * (64 << 20)
    measured = (s["d2h_s"] + s["host_add_s"]) / 4
    n_bytes = 64 << 20
    model = n_bytes / (GPUS["cpu"]["host_link_gbs"] * 1e9) + 3 * n_bytes / (GPUS["cpu"]["host_add_gbs"] * 1e9)
    print(f"flush of 64 MiB: measured {measured:.4f} s, model {model:.4f} s", s)
    assert model / 3 < measured < model * 3
    assert torch.equal(h.accumulator.parts[0], torch.full((16 << 20,), 2.0))  # 2 flushes into the accumulator
