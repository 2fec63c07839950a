"""Checkpoints: a run saves at step k, continues to k+n (the uninterrupted reference) and is SIGKILLed; a new
process resumes from the checkpoint; its steps k+1..k+n must be bitwise equal (losses and every parameter,
torch.equal) to the reference. Adam, fp32, clip_grad 1, weight decay,
data drawn from the restored RNG streams. DP=2 with the distributed optimizer: one first run saves the same step
in both shardings (two checkpoints), one resume launch resumes from each in turn.

Launches (the ``ckpt_runs`` fixture): one first launch and one resume launch per group of tests (``GROUPS``: one
process; TP=2; DP=2 with the distributed optimizer) for every selected test of the group: its resume job, and then,
in the resume launch's processes, the group's integrity cases (damaged checkpoints at TP 1 and TP 2, the injected
ENOSPC) on their own model and folders, in place of a launch each. The real-tmpfs full-disk test has a launch of its own
(it runs under unshare + mount)."""

import importlib.util
import json
import os
import signal

import pytest
import torch

from megatron_tsync.training import checkpointing as ck

from ._launch import item_param, selected_params

_spec = importlib.util.spec_from_file_location(
    "conv_common", os.path.join(os.path.dirname(__file__), "_workers", "conv_common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

WORKER = os.path.join(common.WORKERS, "ckpt_resume_worker.py")
INTEGRITY = os.path.join(common.WORKERS, "ckpt_integrity_worker.py")
SHARDINGS = ["dp_reshardable", "fully_reshardable"]

# test -> (processes, what it reads): the resume jobs and integrity cases that one pair of launches runs
PLAN = {
    "test_resume_is_bitwise_single_process": (1, "resume"),
    "test_a_damaged_latest_checkpoint_names_the_file_and_falls_back": (1, "damage"),
    "test_an_injected_enospc_during_save_says_so_and_keeps_the_previous_checkpoint": (1, "enospc-inject"),
    "test_resume_is_bitwise_tp2": (2, "tp2"),
    "test_resume_is_bitwise_dp2_distributed_optimizer": (2, "dp2"),
    "test_a_damaged_checkpoint_is_refused_on_every_rank_at_tp2": (2, "damage-tp2"),
}


def _planned(item):
    name = getattr(item, "originalname", item.name)
    if name not in PLAN:
        return None
    return PLAN[name] + (item_param(item, "sharding"),)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), family="llama", seed=3)


@pytest.fixture(scope="module")
def small_hf(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "small"), seed=3, hidden=64, layers=1, heads=2,
                           kv_heads=1)


def _first_and_resume(hf_dir, tmp_path, nproc, jobs, integrity):
    """The first run (one process group: every job saves at step 3, one checkpoint per sharding, and runs on to step
    6; then the launch is SIGKILLed) and one resume launch that resumes every job from each of its checkpoints in
    turn, then runs the integrity cases; checks what both launches must do. ``jobs``: {name: (tp, dist_opt,
    shardings or None)}. Returns {name: {sharding: (full prefix, resumed prefix)}}."""
    first, resume, got = [], [], {}
    for name, (tp, dist_opt, shardings) in jobs.items():
        names = shardings or [None]
        ckpts = [str(tmp_path / (f"ckpt-{name}" if s is None else f"ckpt-{name}-{s}")) for s in names]
        outs = [str(tmp_path / (f"res-{name}" if s is None else f"res-{name}-{s}")) for s in names]
        full = str(tmp_path / f"full-{name}")
        job = {"tp": tp, "dist_opt": dist_opt, "ckpt": ckpts, **({"sharding": shardings} if shardings else {})}
        first += ["--job", json.dumps({**job, "out": [full]})]
        resume += ["--job", json.dumps({**job, "out": outs})]
        got[name] = {s: (full, o) for s, o in zip(names, outs)}
    base = [WORKER, "--hf", hf_dir, "--save-step", "3", "--extra-steps", "3"]
    if jobs:
        rc, log, t_first = common.run_isolated(base + ["--mode", "first", *first], nproc=nproc, timeout=900)
        assert rc != 0, "the first run must die by SIGKILL"
        if nproc == 1:
            assert rc == -signal.SIGKILL, log[-4000:]
        for by_sharding in got.values():
            for full, _ in by_sharding.values():
                for r in range(nproc):
                    assert os.path.exists(f"{full}.rank{r}"), log[-4000:]
        for arg in first[1::2]:
            for ckpt in json.loads(arg)["ckpt"]:
                assert ck.latest_step(ckpt) == 3
                assert not any(n.endswith(".tmp") for n in os.listdir(ckpt))
    for spec in integrity:
        resume += ["--integrity", json.dumps(spec)]
    rc, log, t_res = common.run_isolated(base + ["--mode", "resume", *resume], nproc=nproc, timeout=900)
    assert rc == 0, log[-4000:]
    print(f"wall s: first {t_first if jobs else 0:.1f} resume {t_res:.1f} ({len(jobs)} job(s), {len(integrity)} "
          "integrity case(s))")
    return got


# what one pair of launches (first, resume) runs: the one-process work together; at two processes TP=2 with the TP=2
# integrity case, and DP=2 on its own (all three in one pair took the first test near the 90 s cap under CI load)
GROUPS = [("resume", "damage", "enospc-inject"), ("tp2", "damage-tp2"), ("dp2",)]


@pytest.fixture(scope="module")
def ckpt_runs(request, hf_dir, small_hf, tmp_path_factory):
    """runs(what): the results of one first launch and one resume launch for every selected test of what's group
    (GROUPS: the resume jobs, then the integrity cases in the resume launch's processes). Returns {what: result}: a
    resume job's {sharding: (full, resumed)} prefixes, an integrity case's result file prefix."""
    planned = selected_params(request, _planned)
    done = {}

    def runs(what):
        gi = next(i for i, g in enumerate(GROUPS) if what in g)
        if gi not in done:
            done[gi] = None
            nproc = 1 if gi == 0 else 2
            tmp = tmp_path_factory.mktemp(f"ckpt{gi}")
            mine = [p for p in planned if p[1] in GROUPS[gi]]
            whats = {w for _, w, _ in mine} | {what}
            jobs, integrity, out = {}, [], {}
            if "resume" in whats:
                jobs["resume"] = (1, False, None)
            if "tp2" in whats:
                jobs["tp2"] = (2, False, None)
            if "dp2" in whats:
                jobs["dp2"] = (1, True, [s for _, w, s in mine if w == "dp2"] or SHARDINGS)
            for case in ("damage", "enospc-inject", "damage-tp2"):
                if case in whats:
                    root = tmp / case
                    root.mkdir()
                    out[case] = str(tmp / f"{case}.json")
                    integrity.append({"case": case.split("-")[0], "inject": case == "enospc-inject",
                                      "tp": 2 if case.endswith("tp2") else 1, "hf": small_hf, "root": str(root),
                                      "out": out[case]})
            out.update(_first_and_resume(hf_dir, tmp, nproc, jobs, integrity))
            done[gi] = out
        assert done[gi] is not None, "the launches of this group failed (see the first test's error)"
        return done[gi][what]

    return runs


def _same_as_uninterrupted(nproc, full, res):
    for r in range(nproc):
        a = torch.load(f"{full}.rank{r}")
        b = torch.load(f"{res}.rank{r}")
        assert len(a["losses"]) == len(b["losses"]) == 3
        for x, y in zip(a["losses"], b["losses"]):
            assert torch.equal(x, y), (a["losses"], b["losses"])
        assert sorted(a["params"]) == sorted(b["params"])
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k
    print(f"losses {[float(x) for x in a['losses']]}")


def test_resume_is_bitwise_single_process(ckpt_runs):
    _same_as_uninterrupted(1, *ckpt_runs("resume")[None])


@pytest.mark.slow
def test_resume_is_bitwise_tp2(ckpt_runs):
    _same_as_uninterrupted(2, *ckpt_runs("tp2")[None])


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_resume_is_bitwise_dp2_distributed_optimizer(ckpt_runs, sharding):
    """DP=2 with the distributed optimizer: the first launch saves the same step in every selected sharding, the
    resume launch resumes from each in turn."""
    _same_as_uninterrupted(2, *ckpt_runs("dp2")[sharding])


def test_latest_step_and_meta(tmp_path):
    assert ck.latest_step(str(tmp_path)) is None
    (tmp_path / ck.TRACKER).write_text("12\n")
    assert ck.latest_step(str(tmp_path)) == 12
    assert ck.iter_dir("/x", 12) == "/x/iter_0000012"


# ---------------------------------------------------------------------------------------------------------------------
# integrity: checksums, damaged checkpoints, --load-fallback, a full disk, --keep-last-checkpoints
# ---------------------------------------------------------------------------------------------------------------------

def _integrity(args, tmp_path, prefix):
    """The integrity worker under a wrapper (unshare + mount, as run_isolated runs a process, with the wrapper in
    front); the other integrity cases run in the resume launches (``ckpt_runs``)."""
    import subprocess
    import sys

    out = tmp_path / "res.json"
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(common.free_port()), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = " ".join([*prefix, "&&", "exec", sys.executable, INTEGRITY, *args, "--out", str(out)])
    p = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], cwd=common.REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_names_the_file_and_falls_back(ckpt_runs):
    """A flipped bit, a truncated file, a missing file in the latest checkpoint: each is refused before anything is
    loaded, naming the file; with fallback the previous checkpoint loads bitwise. keep_last 2 kept steps 2 and 3.
    Control: the undamaged checkpoint loads step 3. (Run in the one-process resume launch, after its resume.)"""
    with open(ckpt_runs("damage")) as f:
        r = json.load(f)
    assert r["kept"] == [2, 3] and r["manifest_complete"]
    assert r["control_step"] == 3 and r["control_equal"]
    for how, words in (("bitflip", "SHA-256 differs"), ("truncate", "truncated"), ("missing", "missing")):
        c = r[how]
        assert c["raised"] and c["path"] == c["damaged"] and c["damaged"] in c["raised"], c
        assert words in c["raised"] and "--load-fallback" in c["raised"] and c["untouched"], c
        assert (c["fallback_step"], c["fallback_state"], c["fallback_equal"]) == (2, {"step": 2}, True), c


@pytest.mark.slow
def test_a_damaged_checkpoint_is_refused_on_every_rank_at_tp2(ckpt_runs):
    """TP=2 (two processes, files hashed and checked round-robin over the ranks): both ranks raise the same error
    naming the file, and both fall back to step 2 bitwise. (Run in the two-process resume launch, after its
    resumes.)"""
    out = ckpt_runs("damage-tp2")
    ranks = []
    for r in (0, 1):
        with open(f"{out}.rank{r}") as f:
            ranks.append(json.load(f))
    for r in ranks:
        assert r["kept"] == [2, 3] and r["control_step"] == 3 and r["control_equal"]
        for how in ("bitflip", "truncate", "missing"):
            c = r[how]
            assert c["raised"] and c["damaged"] in c["raised"] and c["untouched"], c
            assert (c["fallback_step"], c["fallback_equal"]) == (2, True), c
    assert all(ranks[0][h]["raised"] == ranks[1][h]["raised"] for h in ("bitflip", "truncate", "missing"))


def _check_full_disk(r):
    assert r["raised"] and r["raised"].startswith("no space left on device while saving step 2") and r["disk_full"]
    assert "the latest checkpoint is still step 1" in r["raised"]
    assert r["latest"] == 1 and r["left"] == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert r["load_step"] == 1 and r["load_equal"]


@pytest.mark.slow
def test_a_full_disk_during_save_says_so_and_keeps_the_previous_checkpoint(small_hf, tmp_path):
    """A real full filesystem: an 8 MiB tmpfs (private mount namespace), filled up to half a checkpoint before the
    second save. torch's own message would be "unexpected pos 704 vs 598"."""
    import shutil as sh

    if sh.which("unshare") is None:
        pytest.skip("no unshare(1): the injected-ENOSPC test covers the path")
    root = tmp_path / "fs"
    root.mkdir()
    probe = __import__("subprocess").run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=8m tmpfs {root}"],
                                         capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here ({probe.stderr.strip()}): the injected-ENOSPC "
                    "test covers the path")
    _check_full_disk(_integrity(["--case", "enospc", "--hf", small_hf, "--root", str(root)], tmp_path,
                                prefix=("mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(root))))


@pytest.mark.slow  # the tmpfs test above needs a mount; this one does not
def test_an_injected_enospc_during_save_says_so_and_keeps_the_previous_checkpoint(ckpt_runs):
    """torch.save writes half its file, then raises OSError(ENOSPC) (what a full disk does to a plain write). (Run
    in the one-process resume launch, after its resume.)"""
    with open(ckpt_runs("enospc-inject")) as f:
        _check_full_disk(json.load(f))


def test_prune_and_saved_steps(tmp_path):
    for s in (1, 2, 5, 7):
        d = tmp_path / f"iter_{s:07d}"
        d.mkdir()
        (d / ck.META).write_text("{}")
    (tmp_path / "iter_0000009.tmp").mkdir()  # an interrupted save is not a checkpoint
    (tmp_path / "reference").mkdir()
    assert ck.saved_steps(str(tmp_path)) == [1, 2, 5, 7]
    assert ck.prune(str(tmp_path), 2) == [1, 2] and ck.saved_steps(str(tmp_path)) == [5, 7]
    assert (tmp_path / "reference").is_dir() and (tmp_path / "iter_0000009.tmp").is_dir()
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        ck.prune(str(tmp_path), 0)


def test_unreadable_meta_and_tracker_name_their_file(tmp_path):
    (tmp_path / ck.TRACKER).write_text("seven")
    with pytest.raises(ValueError, match=f"{tmp_path / ck.TRACKER}: expected an iteration number"):
        ck.latest_step(str(tmp_path))
    d = tmp_path / "iter_0000003"
    d.mkdir()
    (d / ck.META).write_text('{"step": 3')  # truncated JSON
    with pytest.raises(ck.CheckpointCorrupt, match=f"{d / ck.META}: unreadable"):
        ck.read_meta(str(tmp_path), 3)


def test_verify_without_a_process_group(tmp_path):
    """``ckpt_integrity`` on plain files: a pre-checksum checkpoint (no manifest) is reported unverified, an unreadable
    manifest and an altered file are named. Control: the intact folder verifies."""
    from megatron_tsync.training import ckpt_integrity as ci

    d = tmp_path / "iter_0000001"
    (d / "rng").mkdir(parents=True)
    (d / "a.distcp").write_bytes(b"x" * 1000)
    (d / "rng" / "rank_00000.pt").write_bytes(b"y" * 10)
    assert ci.verify(str(d)) is False  # format 1: nothing to verify against
    ci.write_manifest(str(d))
    assert ci.verify(str(d)) is True
    (d / "a.distcp").write_bytes(b"x" * 999 + b"z")
    with pytest.raises(ci.CheckpointCorrupt, match=f"{d / 'a.distcp'}: SHA-256 differs"):
        ci.verify(str(d))
    (d / ci.MANIFEST).write_text("{")
    with pytest.raises(ci.CheckpointCorrupt, match=f"{d / ci.MANIFEST}: unreadable checksum manifest"):
        ci.verify(str(d))
