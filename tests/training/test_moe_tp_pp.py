"""Qwen3-MoE at TP = 2 (sequence parallelism), PP = 2 and TP = 2 × PP = 2 with sequence packing, a shared prefix and
router replay (gloo; worker tests/training/_workers/moe_tp_pp_worker.py; 2 processes: TP=2, then PP=2 (replay,
packing, shared prefix), then EP=2 —
packing with replay and a shared prefix with replay, the ranks in expert lockstep; 4: TP=2 × PP=2), against one
process.

float64: the gradient after the barrier (HF names) in sync and stream-trajectory mode equals one process's sync
gradient to ≤ 1e-12 relative — unpacked without replay for packing and the shared prefix, unpacked with the same
replayed routing for replay. Replay: every (position, layer) the engine computed is routed exactly to the given experts (routing maps
gathered over the TP ranks' sequence shards; as many pairs checked as in one process). Controls: replay matters
(the replayed routing's gradient is ~0.4 relative from the router's own), packing really packed and padded packs of
odd length, and replay that hands every TP rank the first shard's routing (unsharded) misroutes tokens and is ~0.8
relative off.
"""

import importlib.util
import os

import pytest
import torch

from megatron_tsync.model import moe

from ._launch import torchrun
from .stream_cases import rel_error

WORKER = os.path.join(os.path.dirname(__file__), "_workers", "moe_tp_pp_worker.py")
TOL = 1e-12
# the executor replays a shared prefix's routing where moe.shared_prefix_routing exists (main after this branch):
# then TP=2 also runs --shared-prefix with replay (measured on the merge: 1.4e-14 vs one process unshared)
SHARED_REPLAY = hasattr(moe, "shared_prefix_routing")
LAUNCHES = {2: ["tp2=pack,replay,control,shared" + (",shared-replay" if SHARED_REPLAY else ""),
                "pp2=replay,pack,shared",
                "ep2=pack-replay,shared-replay"],
            4: ["tp2pp2=pack-replay"]}  # processes: layout=cases
REFERENCE = {"pack": "plain", "replay": "replay", "pack-replay": "replay", "control": "replay", "shared": "prompts",
             "shared-replay": "prompts-replay"}




@pytest.fixture(scope="module")
def single(megatron_single, tmp_path_factory):
    """The one-process sync gradients (the worker's cases, in this process), without and with replay."""
    from megatron_tsync.model.tiny_model import make_tiny_model

    spec = importlib.util.spec_from_file_location("moe_tp_pp_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    model = make_tiny_model(str(tmp_path_factory.mktemp("moe_tp_pp") / "moe"), family="qwen3_moe", seed=3)
    cases = ["plain", "replay", "prompts", "pack", "pack-replay"] + (["prompts-replay"] if SHARED_REPLAY else [])
    one = worker.run_layout(model, megatron_single, cases, modes=worker.MODES[:1])
    r = rel_error(one["grads"]["replay"]["sync"], one["grads"]["plain"]["sync"])
    print(f"one process: replayed routing vs the router's own, gradient {r:.2g} relative")
    assert r > 0.1 and one["agree"]["replay"][0] > 0 and one["agree"]["replay"][1] == 0
    return model, one


@pytest.mark.slow
def test_one_process_packing_with_and_without_replay(single):
    """One process (the reference itself): packed microbatches (some of odd length) equal unpacked ones, with and
    without replay."""
    _, one = single
    for case in ("pack", "pack-replay"):
        r = rel_error(one["grads"][case]["sync"], one["grads"][REFERENCE[case]]["sync"])
        print(f"qwen3_moe one process {case}: vs unpacked {r:.2g}")
        assert r < TOL and one["packed"][case] > 0, (case, r)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", list(LAUNCHES))
def test_moe_tp_pp_packing_replay_equal_one_process(single, tmp_path, nproc):
    """2 processes: TP=2 (packing, replay, the unsharded-replay control, shared prefix), then PP=2 (replay); 4: TP=2 ×
    PP=2 (packing and replay together)."""
    model, one = single
    torchrun(WORKER, ["--model", model, "--runs", *LAUNCHES[nproc], "--out", str(tmp_path / "got.pt")], nproc=nproc)
    everything = torch.load(str(tmp_path / "got.pt"))
    assert sorted(everything) == sorted(r.split("=")[0] for r in LAUNCHES[nproc])
    for layout, got in everything.items():
        for case in got["grads"]:
            _check(layout, case, got, one)


def _check(layout, case, got, one):
    ref = one["grads"][REFERENCE[case]]["sync"]
    same, differ = got["agree"][case]
    for mode, g in got["grads"][case].items():
        assert set(g) == set(ref)
        r, r_sync = rel_error(g, ref), rel_error(g, got["grads"][case]["sync"])
        print(f"qwen3_moe {layout} {case} {mode}: vs one process {r:.2g}, vs {layout} sync {r_sync:.2g}; routing "
              f"{same} (position, layer) as given, {differ} not")
        if case == "control":
            assert r > 0.1 and differ > 0, (r, differ)
        else:
            assert r < TOL and r_sync < TOL, (layout, case, mode, r, r_sync)
    if case in ("replay", "pack-replay"):  # every engine-computed pair of both modes, as given
        assert differ == 0 and same == 2 * one["agree"]["replay"][0]
    if case.startswith(("pack", "shared")):  # packed (shared) microbatches, some padded to a multiple of TP
        assert got["packed"][case] > 0 and (got["padded"][case] > 0) == ("tp2" in layout), (
            case, got["packed"][case], got["padded"][case])
