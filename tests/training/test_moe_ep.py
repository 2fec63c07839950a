"""Qwen3-MoE training at expert parallelism 2 and tensor parallelism 2 (gloo, 2 processes) through the streaming
learner, against one process. TP=2 runs with sequence parallelism (megatron's MoE layer needs it), which pads each
trajectory to an even length inside the model.

At EP = 2 each rank holds half the experts and every MoE layer's all-to-all carries the other rank's tokens, while
the two data-parallel replicas stream different trajectories; the learner keeps them in lockstep (one gradient
destination per slot, idle microbatches where a rank has nothing). float64: the gradient (HF names, experts
gathered) of sync / stream-trajectory (two orders) / stream-group at EP = 2 equals one process's sync gradient and
each other's to ≤ 1e-12 relative, for three estimator/clip cases including two minibatches × two epochs (π_θ0
forwards in lockstep too). float32: the weights after one Adam step equal one process's to 1e-5 (as for the dense
layouts). Controls: idle microbatches did run (the ranks really were out of step), and without one destination per
slot the expert gradients were 0.6-1.6 relative off (measured while building this; the test keeps the idle count).

At EP = 2 also (``EP_CASES`` of the worker): ``--deterministic`` — one trajectory part per slot over the EP group,
each rank's backward of it into that trajectory's canonical vector — sync and stream-trajectory in two arrival
orders bitwise equal to each other and ≤ 1e-12 from one process, including a clipped case whose stream-trajectory
items defer; and a KL reference model (``--ref-model``, its forwards in lockstep) with ``--kl-mode loss`` (with and
without ``--deterministic``, there with each group on one rank: the other rank's idle slots fill a bucket its planner
never opened, which must close with the group — 2 buckets were left open at the barrier before that fix) and
``reward``; bucket offload (``--max-device-buckets 2``: vectors did move to the host); host accumulation; and the
frontier-first order (groups landing in batch order, --rollout-frontier-first) with each group on one rank
(``--dp-assignment balanced``). Control: the default
mode's two arrival orders differ in their bits.

TP = 2 and PP = 2 run the EP cases too (deterministic bitwise across modes and orders, KL loss/reward, offload).
EP = 2 × PP = 2 (4 processes, the Qwen3-30B-A3B recipe's kind of layout): one case, sync and stream-trajectory.
EP = 2 × TP = 2 (4 processes; expert TP = 2, so megatron's dispatcher gathers the tokens of this rank's experts over
TP with uneven sizes, which gloo takes through ``compat``'s padded collectives): one case, sync and stream-trajectory,
≤ 1e-12 from one process (measured ~1e-14).
The live EP = 2 run is tests/runtime/test_deterministic_live.py's EP pair.
"""

import os

import pytest
import torch

from ._launch import torchrun
from .stream_cases import rel_error

WORKER = os.path.join(os.path.dirname(__file__), "_workers", "moe_ep_worker.py")
TOL = 1e-12




@pytest.fixture(scope="module")
def single(tmp_path_factory, megatron_single):
    """The worker's ``single`` layout, run in this process (megatron_single: TP 1, PP 1, EP 1, world 1)."""
    import argparse
    import importlib.util

    from megatron_tsync.model.tiny_model import make_tiny_model

    d = tmp_path_factory.mktemp("moe_layouts")
    model = make_tiny_model(str(d / "moe"), family="qwen3_moe", seed=3)
    ref = make_tiny_model(str(d / "ref"), family="qwen3_moe", seed=4)  # the KL reference: other weights
    spec = importlib.util.spec_from_file_location("moe_ep_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    before = torch.are_deterministic_algorithms_enabled()  # the --deterministic cases turn torch's on
    try:
        _, one = worker.run_layout(argparse.Namespace(model=model, ref_model=ref, only=None), "single", megatron_single)
    finally:
        torch.use_deterministic_algorithms(before)
    return model, ref, one


@pytest.fixture(scope="module")
def four(single, tmp_path_factory):
    """EP 2 × TP 2 and EP 2 × PP 2: one 4-process launch, the layouts one after the other (4 processes starting on 2
    cores cost more than either layout's one case)."""
    model, ref_model, _ = single
    out = tmp_path_factory.mktemp("moe_four") / "got.pt"
    torchrun(WORKER, ["--model", model, "--ref-model", ref_model, "--layout", *FOUR, "--out", str(out)], nproc=4)
    return torch.load(str(out))


def _bitwise(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_one_process_deterministic_kl_offload(single):
    """One process (the reference launch): the EP cases' streamed modes equal its sync gradient, --deterministic
    bitwise in every mode and order, and --max-device-buckets 2 did move bucket vectors to the host."""
    _, _, one = single
    for case, modes in one["grads"].items():
        if not case.startswith(EP_ONLY):
            continue
        for mode, g in modes.items():
            r = rel_error(g, modes["sync"])
            print(f"qwen3_moe one process {case} {mode}: vs sync {r:.2g}")
            assert r < TOL, (case, mode, r)
        if case.startswith("det"):
            assert all(_bitwise(g, modes["sync"]) for g in modes.values()), case
    assert one["to_host"]["offload-grpo"] > 0
    assert one["flushes"]["hostacc-grpo"] > 0 and one["flushes"]["offload-grpo"] == 0  # --accumulate-on-host ran
    # the same case's sync without host accumulation (offload-grpo's sync has every vector on the "device")
    assert rel_error(one["grads"]["hostacc-grpo"]["sync"], one["grads"]["offload-grpo"]["sync"]) < TOL


EP_ONLY = ("det", "kl", "offload", "hostacc", "frontier")  # the worker's EP_CASES (every 2-process layout)
NPROC = {"ep2": 2, "tp2": 2, "pp2": 2, "tp2ep2": 4, "pp2ep2": 4}
FOUR = [k for k, n in NPROC.items() if n == 4]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(NPROC))
def test_layout_streaming_equals_one_process(single, request, tmp_path, layout):
    """EP=2 (lockstep) and TP=2 (sequence parallelism, padded to even lengths). EP=2 also: --deterministic (every
    mode bitwise equal to the others, stream-trajectory's deferrals agreed over the EP ranks) and a KL reference model
    (loss and reward), each against one process's sync gradient of the same case."""
    model, ref_model, one = single
    if layout in FOUR:  # the 4-process layouts share one launch
        ep = request.getfixturevalue("four")[layout]
    else:
        torchrun(WORKER, ["--model", model, "--ref-model", ref_model, "--layout", layout, "--out",
                          str(tmp_path / "got.pt")], nproc=NPROC[layout])
        ep = torch.load(str(tmp_path / "got.pt"))
    expect = {"grpo-bounded-trainer"} if NPROC[layout] == 4 else set(one["grads"])  # 4 processes: 1 case
    assert set(ep["grads"]) == expect
    for case, modes in ep["grads"].items():
        ref = one["grads"][case]["sync"]
        experts = [k for k in ref if ".experts." in k]
        assert experts and all(ref[k].abs().max() > 0 for k in experts)  # every expert is trained
        for mode, g in modes.items():
            assert set(g) == set(ref)
            r, r_moe = rel_error(g, ref), rel_error(g, ref, experts)
            print(f"qwen3_moe {layout} {case} {mode}: vs one process {r:.2g} (experts {r_moe:.2g})")
            assert r < TOL and r_moe < TOL, (case, mode, r, r_moe)
        if case.startswith("det"):  # bitwise: every mode and arrival order
            first = next(iter(modes.values()))
            assert all(_bitwise(g, first) for g in modes.values()), case
        assert (ep["idle"][case] > 0) == ("ep2" in layout) and one["idle"][case] == 0  # lockstep only at EP > 1
    if NPROC[layout] == 2:
        assert ep["to_host"]["offload-grpo"] > 0  # --max-device-buckets 2 did move bucket vectors to the host
        assert ep["flushes"]["hostacc-grpo"] > 0  # --accumulate-on-host: the scratch went through the host
    if layout == "ep2":
        # stream-trajectory with groups by rank (--dp-assignment balanced): trajectories of complete groups went
        # straight into the accumulator (the direct path) on this rank
        assert ep["direct"]["kl-loss-grpo-by-group"] > 0, ep["direct"]
        # the deterministic stream-trajectory runs did defer items (ratios out of the clip band): the path where the
        # EP ranks agree on a slot's deferral before its backward ran
        assert ep["deferred"]["det-rloo-binary-engine"] > 0
        # control: the default mode's two arrival orders are not bitwise equal (bitwise equality is not automatic)
        st = ep["grads"]["rloo-binary-engine"]
        assert not _bitwise(st["stream-trajectory"], st["stream-trajectory-b"])
    for mode, w in ep["weights"].items():
        r = rel_error(w, one["weights"][mode])
        print(f"qwen3_moe {layout} float32 Adam step, {mode}: weights vs one process {r:.2g}")
        assert r < 1e-5
