"""Streaming exactness under TP=2, PP=2 and DP=2 (two gloo processes each).

float64: streamed vs sync gradient ≤ 1e-12 relative on every layout (estimators, aggregations, clip with
ratio ≠ 1, KL/entropy strategies; see ``_workers/stream_worker.py``). float32, 3 Adam steps: Δ_k of each
streaming mode against sync is reported next to the permutation control, and every float32 run's distance to
the float64 run from the same θ0 is asserted: streaming is as close to the exact update as float32 sync is.

Two torchruns serve the whole module: the ``stream_reports`` fixture launches the worker once for tp2 and once for
pp2 then dp2 (``LAUNCHES``; the pair costs about what tp2 alone does, and one launch's start-up, imports and
rendezvous of three processes, is saved), when a test first needs it, with every check of those layouts that the
selected tests need; each test reads its own report. (One launch for all three layouts took up to 114 s for the first
test under three xdist workers.) The default tier (``-m "not slow"``) runs the float64 check on all three layouts; the
packing and float32 checks are ``slow`` and join the same launch when selected.
"""

import json
import os

import pytest

from ._launch import item_param, selected_params, torchrun

WORKER = os.path.join(os.path.dirname(__file__), "_workers", "stream_worker.py")
LAYOUTS = ["tp2", "pp2", "dp2"]
LAUNCHES = [["tp2"], ["pp2", "dp2"]]  # the layouts one launch runs (one after the other in the same 2 processes)
CHECK_OF = {  # test function -> the worker check it reads (layout from its `layout` parameter, else dp2)
    "test_float64_stream_equals_sync": "f64",
    "test_float64_packed_equals_unpacked_sync": "packed",
    "test_float64_shared_prefix_and_skip": "shared",
    "test_float64_recompute_stream_equals_sync": "recompute",
    "test_float32_three_steps": "f32-sgd",
    "test_float32_adam_delta_k_report": "f32-adam",
}


def _pair(item):
    check = CHECK_OF.get(getattr(item, "originalname", item.name))
    return None if check is None else f"{item_param(item, 'layout', 'dp2')}:{check}"


@pytest.fixture(scope="module")
def stream_reports(request, tmp_path_factory):
    """report(layout, check): the worker's JSON for that pair; one launch per group of LAUNCHES for every pair of
    its layouts that the session selected (a pair asked for outside that plan gets a launch of its own)."""
    out = tmp_path_factory.mktemp("stream_parallel")
    planned = selected_params(request, _pair)
    launched: set[int] = set()

    def report(layout, check):
        path = out / f"{layout}-{check}.json"
        group = next(i for i, g in enumerate(LAUNCHES) if layout in g)
        if group not in launched:
            launched.add(group)
            mine = [pair for pair in planned if pair.split(":", 1)[0] in LAUNCHES[group]]
            if mine:
                torchrun(WORKER, ["--out-dir", str(out), "--checks", *mine])
        if not path.exists():
            torchrun(WORKER, ["--out-dir", str(out), "--checks", f"{layout}:{check}"])
        with open(path) as f:
            return json.load(f)

    return report


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float64_stream_equals_sync(layout, stream_reports):
    rep = stream_reports(layout, "f64")
    assert rep["tp"] * rep["pp"] * rep["dp"] == 2
    for row in rep["result"]:
        assert row["stream-trajectory"] < 1e-12, row
        assert row["stream-group"] < 1e-12, row
    got = {row.get("by_group") for row in rep["result"]}  # --dp-assignment group / balanced (a group on one DP rank)
    assert {"group", "balanced", "spill"} <= got, got  # spill: a group's members may span both DP ranks
    assert rep["dp"] == 1 or any(row["split_groups"] for row in rep["result"] if row["by_group"] == "spill")
    frontier = [row["frontier"] for row in rep["result"] if "frontier" in row]  # frontier-first arrival order
    print(layout, "frontier-first order", frontier)
    assert len(frontier) == 2 and all(f["vs_sync"] < 1e-12 for f in frontier), frontier
    # the direct path (trajectories of complete groups straight into the accumulator) ran on this rank
    assert sum(row["stats"]["direct"] for row in rep["result"] if "stats" in row) > 0
    resident = [row["resident"] for row in rep["result"] if "resident" in row]
    print(layout, "bucket residency", resident)
    assert len(resident) == 2, rep["result"]
    for r in resident:  # bucket residency (--max-device-buckets 2, groups interleaved): exact copies
        assert r["vs_sync"] < 1e-12, r
    assert any(r["to_host"] > 0 and r["to_device"] > 0 for r in resident), resident  # vectors really moved
    host = [(m, h) for row in rep["result"] if "host_accum" in row for m, h in row["host_accum"].items()]
    print(layout, "host accumulation", host)
    assert len(host) == 4, rep["result"]
    for mode, h in host:  # --accumulate-on-host, every vector on the host: stream-trajectory flushes per destination
        assert h["vs_sync"] < 1e-12 and h["d2h_bytes"] > 0, h  # change; stream-group (accumulator only) once
        assert h["flushes"] > 1 and h["peak_host"] > 2 if mode == "stream-trajectory" else h["flushes"] == 1, h


def test_float64_objective_equal_in_every_mode_and_layout(stream_reports):
    """train/loss (``training/objective.py``) of the same batch: equal in sync, stream-trajectory and stream-group on
    every layout (≤ 1e-12), and across layouts: tp2 and dp2 build the same θ0, so their values agree case by case
    (dp2 sums two replicas' halves; rank 0, which writes the report, holds one); pp2 builds another θ0, so only the
    cases whose value does not depend on θ (ratio 1, no TIS/KL/entropy: J = −Σ A_i ν_i T_i / divisor) are
    compared there (its rank 0 is the first stage, which has no values of its own: the PP sum brings them)."""
    reps = {layout: stream_reports(layout, "f64")["result"] for layout in LAYOUTS}
    for layout, rows in reps.items():
        for row in rows:
            if "objective" not in row:
                continue  # the minibatch rows
            j = row["objective"]
            for mode in ("stream-trajectory", "stream-group"):
                assert abs(j[mode] - j["sync"]) <= 1e-12 * max(1.0, abs(j["sync"])), (layout, row)
    for tp, dp, pp in zip(reps["tp2"], reps["dp2"], reps["pp2"]):
        if "objective" not in tp:
            continue
        assert abs(tp["objective"]["sync"] - dp["objective"]["sync"]) <= 1e-12 * max(1.0, abs(tp["objective"]["sync"]))
        if set(tp["loss_keys"]) <= {"aggregation"}:
            assert abs(pp["objective"]["sync"] - tp["objective"]["sync"]) <= 1e-12, (tp, pp)
    assert any(abs(r["objective"]["sync"]) > 1e-3 for r in reps["dp2"] if "objective" in r)  # not all zero


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_float64_packed_equals_unpacked_sync(layout, stream_reports):
    """Sequence packing on: sync, stream-trajectory (also with --pack-across-groups: row-split weight gradients,
    TP's input-gradient all-reduce and vocab-parallel embedding, PP's stages; and with --stream-full-microbatches:
    items waiting for fuller packs, closes waiting for them, the same decisions on every stage) and stream-group vs
    the unpacked sync gradient ≤ 1e-12."""
    rep = stream_reports(layout, "packed")
    for row in rep["result"]:
        for mode in ("sync", "stream-trajectory", "stream-group", "stream-trajectory-mixed",
                     "stream-trajectory-mixed-full"):
            assert row[mode] < 1e-12, (mode, row)
        mb = row["microbatches"]
        assert mb["sync"] < mb["sync-unpacked"], row  # packing really packed
        assert mb["stream-trajectory-mixed"] <= mb["stream-trajectory"], row
    fewer = [r["microbatches"]["stream-trajectory-mixed"] < r["microbatches"]["stream-trajectory"] for r in rep["result"]]
    assert any(fewer), rep["result"]  # mixing really mixed
    assert any(r["waited_for_full"] > 0 for r in rep["result"]), rep["result"]  # items really waited


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2", "tp2"])
def test_float64_recompute_stream_equals_sync(layout, stream_reports):
    """--recompute-granularity full (uniform, block) and selective under PP 2 / TP 2: sync, stream-trajectory and
    packed stream-trajectory with recomputation == sync without ≤ 1e-12 (float64)."""
    rep = stream_reports(layout, "recompute")["result"]
    assert len(rep) == 9, rep
    assert max(rep.values()) <= 1e-12, rep


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float64_shared_prefix_and_skip(layout, stream_reports):
    """--shared-prefix + --skip-zero-advantage: sync, stream-trajectory and stream-group vs sync with neither
    ≤ 1e-12; the shared prefix and the skip really happened (sync and stream-group, whole groups at once)."""
    rep = stream_reports(layout, "shared")
    for row in rep["result"]:
        for mode in ("sync", "stream-trajectory", "stream-group"):
            assert row[mode] < 1e-12, (mode, row)
        for mode in ("sync", "stream-group"):
            st = row["stats"][mode]
            assert st["shared_prefix_items"] > 0 and st["skipped_zero_advantage"] > 0, (mode, st)
        assert row["stats"]["sync-plain"]["shared_prefix_items"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_float32_three_steps(layout, stream_reports):
    """SGD (momentum 0.9), 3 steps: streaming is as close to the exact float64 update as float32 sync is.

    A reordering control leaves each microbatch's backward bit-identical; streaming backprops h_i and applies
    A_i later, so its rounding differs the way any other float32 implementation's would. The fair check is the
    distance to the float64 run from the same θ0.
    """
    rep = stream_reports(layout, "f32-sgd")["result"]
    err = rep["error_vs_float64"]
    base = max(err["sync"], err["sync-permuted"])
    assert err["stream-trajectory"] <= 2.0 * base, err
    assert err["stream-group"] <= 2.0 * base, err
    assert rep["delta_k_permutation_control"] > 0  # the control really reorders


@pytest.mark.slow
def test_float32_adam_delta_k_report(stream_reports):
    """Adam, 3 steps, DP=2: Δ_k next to the permutation control (reported; Adam amplifies rounding of
    near-zero coordinates, so the figures are noisy: see the issue note). Sanity bound only."""
    rep = stream_reports("dp2", "f32-adam")["result"]
    print("adam", rep)
    assert rep["delta_k"]["stream-trajectory"] < 1e-3
    assert rep["error_vs_float64"]["stream-trajectory"] < 1e-3
