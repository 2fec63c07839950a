"""The main job end to end, as a user runs it: ``python -m megatron_tsync.train`` in a subprocess.

- live rollouts (worker processes, sandboxed calculator, signed events) with stream-trajectory; checkpoints,
  TensorBoard, rollout dump; then a restart with ``--load`` continues at the saved step (as a TP=2 trainer under
  torchrun: the checkpoint reshards, rank 0 owns the rollout plane);
- replaying a dump in ``sync`` and in ``stream-trajectory`` with a shuffled arrival order gives the same
  weights in float64 (≤ 1e-12 relative), read from the checkpoints (tests/conftest.py::checkpoint_tensors).
"""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(args, tmp, timeout=900, nproc=1):
    """``python -m megatron_tsync.train ARGS`` in ``tmp``; ``nproc`` > 1: under torchrun (--standalone)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    from tests.conftest import free_port

    launch = ["-m"] if nproc == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
                                        "-m"]
    if nproc == 1:
        env["MASTER_PORT"] = str(free_port())
    p = subprocess.run([sys.executable, *launch, "megatron_tsync.train", *args], cwd=tmp, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"train failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    d = str(tmp_path_factory.mktemp("tiny") / "model")
    make_tiny_model(d, seed=0)
    return d


@pytest.mark.slow
def test_live_stream_trajectory_checkpoint_and_resume(tiny_model, tmp_path):
    ck, tb, dump = tmp_path / "ck", tmp_path / "tb", tmp_path / "dump"
    # one rollout worker: two (and their shares of a step) are the weight-sync test's
    common = ["--model", tiny_model, "--group-size", "2", "--global-batch-size", "4", "--rollout-workers", "1",
              "--max-turns", "2", "--max-new-tokens", "16", "--seq-length", "128", "--lr", "1e-4",
              "--rl-mode", "stream-trajectory", "--save", str(ck), "--save-interval", "1", "--no-progress"]
    out = _train([*common, "--train-iters", "2", "--tensorboard-dir", str(tb), "--dump-rollouts", str(dump),
                  "--eval-interval", "2", "--eval-prompts", "6"], tmp_path)
    assert "summary: mode stream-trajectory, 2 steps" in out
    # held-out evaluation: the first version and the end (runtime/evaluation.py), in the log, eval.json, the PNG
    assert "held-out v0: success" in out and "held-out v2: success" in out and "held-out v1" not in out
    assert "held-out success" in out.split("summary:")[1] and "(v0 → v2, 6 prompts, greedy; evaluation" in out
    evals = json.loads((ck / "eval.json").read_text())
    assert [e["version"] for e in evals] == [0, 2]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb))
    ea.Reload()
    assert [(e.step, round(e.value, 6)) for e in ea.Scalars("eval/success_rate")] == [
        (r["version"], round(r["success_rate"], 6)) for r in evals]
    assert (ck / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(tb))
    meta = json.loads((dump / "step_0000001" / "rollouts.json").read_text())
    assert len(meta["trajectories"]) == 4 and all(t["policy_version"] == 1 for t in meta["trajectories"])
    hist = json.loads((ck / "history.json").read_text())
    assert [h["step"] for h in hist] == [0, 1] and all(h["events_rejected"] == 0 for h in hist)
    # the resume is a TP=2 trainer under torchrun (the checkpoint reshards on load): rank 0 owns the rollout plane
    # and broadcasts what lands; the worker is not a member of the trainer's process group (the launcher's
    # rendezvous variables are stripped). (This run replaces test_live_rollouts_with_two_trainer_ranks.)
    out = _train([*common, "--train-iters", "3", "--load", str(ck), "--tensor-model-parallel-size", "2"], tmp_path,
                 nproc=2)
    assert "resumed from" in out and "at step 2" in out and "TP 2, PP 1" in out, out[-3000:]
    assert "summary: mode stream-trajectory" in out, out[-3000:]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert [h["step"] for h in json.loads((ck / "history.json").read_text())][-1] == 2
    saved = sorted(os.listdir(ck))
    out = _train([*common, "--train-iters", "3", "--load", str(ck)], tmp_path)  # finished: started again
    assert "nothing to do" in out and "at step 3 and --train-iters is 3" in out and "summary" not in out
    assert sorted(os.listdir(ck)) == saved  # nothing written; the stop record still says finished
    assert json.loads((ck / "tsync_stop.json").read_text())["finished"] is True


@pytest.mark.slow
def test_live_weight_sync_broadcast_equals_file(tiny_model, tmp_path):
    """--weight-sync broadcast with two rollout workers vs --weight-sync file with one, each run's workers started
    separately (--rollout-launch external, as srun would on a rollout node: the trainer only writes specs/secret
    (and, with file, the weights) to --rollout-dir and says it waits for them; each worker picks up its spec, finds
    the trainer's weight-sync store in it when broadcasting, and serves the run to its end). Step 0 starts from the
    same weights with the same seeds, so its trajectories must be token-for-token those of the file hand-off: the
    broadcast delivers the weights bit-identically, and sampling seeds do not depend on the rollout plane's shape
    (each trajectory is seeded by its global index, not by its position in a worker's prompt list: two workers
    really share the step here, so that bug changes worker 1's trajectories). Every event carries the policy version
    it was sampled with and none is rejected; nothing goes through the broadcast run's weights directory.
    (This pair of runs replaces test_external_rollout_workers, the external launch with file weights, and
    tests/runtime/test_rollout_seeds.py, one vs two workers on the same step.)"""
    from tests.conftest import free_port

    common = ["--model", tiny_model, "--group-size", "2", "--global-batch-size", "4", "--max-turns", "2",
              "--max-new-tokens", "16", "--seq-length", "128", "--lr", "1e-4", "--rl-mode", "stream-trajectory",
              "--no-progress", "--rollout-launch", "external", "--train-iters", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    runs = {}
    for sync, n in (("broadcast", 2), ("file", 1)):
        plane = tmp_path / f"plane_{sync}"
        logs = [open(tmp_path / f"worker{w}_{sync}.log", "w") for w in range(n)]
        workers = [subprocess.Popen([sys.executable, "-m", "megatron_tsync.runtime.worker",
                                     str(plane / f"worker{w}.json")], cwd=tmp_path, env=env, stdout=logs[w],
                                    stderr=subprocess.STDOUT) for w in range(n)]
        try:
            ck, dump = tmp_path / f"ck_{sync}", tmp_path / f"dump_{sync}"
            out = _train([*common, "--rollout-workers", str(n), "--rollout-dir", str(plane), "--weight-sync", sync,
                          "--weight-sync-bucket-mb", "1", "--save", str(ck), "--dump-rollouts", str(dump)], tmp_path)
            assert f"waiting for {n} external rollout worker(s)" in out and \
                "summary: mode stream-trajectory, 2 steps" in out, out[-3000:]
            hist = json.loads((ck / "history.json").read_text())
            assert all(h["events_rejected"] == 0 and h["staleness"] == 0 for h in hist), hist
            runs[sync] = dump
            for w, p in enumerate(workers):
                assert p.wait(timeout=120) == 0, (tmp_path / f"worker{w}_{sync}.log").read_text()[-3000:]
        finally:
            for w, f in zip(workers, logs):
                if w.poll() is None:
                    w.kill()
                f.close()
        spec = json.loads((plane / f"worker{n - 1}.json").read_text())
        assert spec["rollout"]["weight_sync"] == sync and spec["rollout"]["num_workers"] == n
        assert bool(spec.get("weight_sync_addr")) == (sync == "broadcast"), spec.get("weight_sync_addr")
        for k in (0, 1):
            meta = json.loads((dump / f"step_{k:07d}" / "rollouts.json").read_text())
            assert len(meta["trajectories"]) == 4 and all(t["policy_version"] == k for t in meta["trajectories"])
    assert not os.listdir(tmp_path / "plane_broadcast" / "weights")  # nothing went through files

    from megatron_tsync.runtime.rollout_io import load_rollouts

    got = {sync: {s.traj_id: s for s in load_rollouts(str(runs[sync]), 0)[0]} for sync in runs}
    assert {s.meta["worker"] for s in got["broadcast"].values()} == {0, 1}  # the two workers really shared step 0
    assert len(got["file"]) == 4 and sorted(got["broadcast"]) == sorted(got["file"])
    for tid, s in got["file"].items():
        assert torch.equal(s.token_ids, got["broadcast"][tid].token_ids), tid


def _synthetic_dump(root, model_dir, steps=2, groups=3, G=4, seed=0):
    """A rollout dump with varied rewards (a random tiny model would score 0 everywhere)."""
    from megatron_tsync.runtime.rollout_io import dump_rollouts
    from megatron_tsync.streaming.ready_queue import Sample

    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for k in range(steps):
        samples, order = [], []
        for gi in range(groups):
            gid = f"s{k}g{gi}"
            order.append(gid)
            for i in range(G):
                T = rnd.randint(12, 30)
                mask = torch.zeros(T)
                mask[5:] = 1
                mask[T // 2 : T // 2 + 3] = 0
                beh = -torch.rand(T, generator=g, dtype=torch.float64) * mask.double()
                samples.append(Sample(f"{gid}t{i}", gid, G, torch.randint(0, vocab, (T,), generator=g), mask,
                                      float(rnd.random() < 0.5) if gi else 1.0, policy_version=k, behaviour_logp=beh))
        rnd.shuffle(samples)
        dump_rollouts(root, k, samples, order)


def _hf_export(ck, out, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    from tests.conftest import free_port

    env["MASTER_PORT"] = str(free_port())
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--direction",
                        "megatron-to-hf", "--load", str(ck), "--save", str(out)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--num-minibatches", "3", "--ppo-epochs", "2", "--max-device-buckets", "2"]],
                         ids=["one-step", "minibatches-offload"])
def test_replay_sync_equals_stream_float64(tiny_model, tmp_path, extra):
    dump = tmp_path / "dump"
    _synthetic_dump(str(dump), tiny_model)
    common = ["--model", tiny_model, "--replay-rollouts", str(dump), "--train-iters", "2", "--group-size", "4",
              "--global-batch-size", "12", "--params-dtype", "float64", "--optimizer", "sgd", "--lr", "0.5",
              "--clip-grad", "0", "--seq-length", "64", "--no-progress", *extra]
    _train([*common, "--rl-mode", "sync", "--save", str(tmp_path / "ck_sync"), "--dump-grads", str(tmp_path / "g_sync")],
           tmp_path)
    _train([*common, "--rl-mode", "stream-trajectory", "--replay-shuffle-seed", "7", "--save",
            str(tmp_path / "ck_stream"), "--dump-grads", str(tmp_path / "g_stream")], tmp_path)
    from safetensors.torch import load_file

    # --dump-grads: one file per optimizer update; several updates a step (3 minibatches × 2 epochs) are named by
    # epoch and minibatch, and no file claims to be "the step's" gradient
    stems = ([f"epoch_{e}_mb_{j}" for e in range(2) for j in range(3)] if extra else [""])
    for k in range(2):
        if extra:
            assert not (tmp_path / "g_sync" / f"grad_step_{k:07d}.safetensors").exists()
        seen = []
        for stem in stems:
            name = f"grad_step_{k:07d}" + (f"_{stem}" if stem else "")
            a = load_file(str(tmp_path / "g_sync" / f"{name}.safetensors"))
            b = load_file(str(tmp_path / "g_stream" / f"{name}.safetensors"))
            assert set(a) == set(b)
            num = sum(float((a[n] - b[n]).pow(2).sum()) for n in a) ** 0.5
            den = sum(float(a[n].pow(2).sum()) for n in a) ** 0.5
            meta = json.loads((tmp_path / "g_sync" / f"{name}.json").read_text())
            assert (meta["step"], meta["epochs"], meta["minibatches"]) == (k, 2 if extra else 1, 3 if extra else 1)
            assert stem == (f"epoch_{meta['epoch']}_mb_{meta['minibatch']}" if extra else ""), (stem, meta)
            if extra and meta["minibatch"] == 0:  # group 0 alone, every reward 1: no advantage, no gradient
                assert den == 0 and num == 0, (k, stem, den, num)
                continue
            assert den > 0 and num / den < 1e-12, (k, stem, num / den)
            assert all(any(float((a[n] - c[n]).abs().max()) > 0 for n in a) for c in seen), stem  # not one copy
            seen.append(a)
        assert len(seen) == (4 if extra else 1)
    from tests.conftest import checkpoint_tensors

    wa, wb = checkpoint_tensors(tmp_path / "ck_sync", tmp_path), checkpoint_tensors(tmp_path / "ck_stream", tmp_path)
    assert sorted(wa) == sorted(wb)
    num = sum(float((wa[n].double() - wb[n].double()).pow(2).sum()) for n in wa) ** 0.5
    den = sum(float(wa[n].double().pow(2).sum()) for n in wa) ** 0.5
    # the saved weights are the trained ones: the embedding (the same tensor under both names) moved from θ0's
    w0 = load_file(os.path.join(tiny_model, "model.safetensors"))["model.embed_tokens.weight"].double()
    moved = float((wa["embedding.word_embeddings.weight"][: w0.shape[0]].double() - w0).norm())  # rows: vocab pad
    assert moved > 1e-6 and num / den < 1e-12, (num / den, moved)
    # the logged loss is the objective's value (training/objective.py): the same per step; the surrogate sum is not
    rows = [json.load(open(tmp_path / ck / "history.json")) for ck in ("ck_sync", "ck_stream")]
    for ra, rb in zip(*rows):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-12 * max(1.0, abs(ra["loss"])), (ra["loss"], rb["loss"])
    assert any(ra["loss_surrogate"] != rb["loss_surrogate"] for ra, rb in zip(*rows))


@pytest.mark.slow
def test_damaged_latest_checkpoint_refused_then_fallback_resumes_and_continues(tiny_model, tmp_path):
    """3 replayed steps saved every step with --keep-last-checkpoints 2 (iter 2 and 3 stay); one bit of the latest
    checkpoint flipped: --load refuses it naming the file; --load --load-fallback resumes from step 2 and trains step 2
    again; its final weights equal the uninterrupted run's (torch.equal: the resume is bitwise)."""
    import shutil

    dump, ck = tmp_path / "dump", tmp_path / "ck"
    _synthetic_dump(str(dump), tiny_model, steps=3)
    common = ["--model", tiny_model, "--replay-rollouts", str(dump), "--train-iters", "3", "--group-size", "4",
              "--global-batch-size", "12", "--lr", "1e-3", "--seq-length", "64", "--rl-mode", "sync", "--no-progress",
              "--save", str(ck)]  # Adam, fp32 (megatron-core 0.16's SGD optimizer cannot load its sharded state)
    _train([*common, "--save-interval", "1", "--keep-last-checkpoints", "2"], tmp_path)
    assert sorted(n for n in os.listdir(ck) if n.startswith("iter_")) == ["iter_0000002", "iter_0000003"]
    shutil.copytree(ck, tmp_path / "ck_ref")
    d3 = ck / "iter_0000003"
    shard = max((p for p in d3.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x04
    shard.write_bytes(bytes(data))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    from tests.conftest import free_port

    env["MASTER_PORT"] = str(free_port())
    p = subprocess.run([sys.executable, "-m", "megatron_tsync.train", *common, "--load", str(ck)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode != 0 and f"{shard}: SHA-256 differs" in p.stderr and "--load-fallback" in p.stderr, \
        p.stderr[-3000:]
    out = _train([*common, "--load", str(ck), "--load-fallback"], tmp_path)
    assert "at step 2" in out and "summary: mode sync, 1 steps" in out, out[-2000:]
    from tests.conftest import checkpoint_tensors

    a, b = checkpoint_tensors(tmp_path / "ck_ref", tmp_path), checkpoint_tensors(ck, tmp_path)  # weights and Adam's
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
