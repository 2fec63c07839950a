"""tools/bench_live.py: the summary's fields and arithmetic on known rows (fast), the flags it builds, and one
short real run of the tool (two modes, two steps, a tiny warm start; slow) whose JSON holds every field."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = importlib.util.spec_from_file_location("bench_live", os.path.join(ROOT, "tools", "bench_live.py"))
bl = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bl)

FIELDS = {"step_s", "learner_step_s", "idle_frac", "learner_busy_s", "trainer_cpu_s", "success_rate",
          "speedup_vs_sync", "busy_vs_sync", "spec_kept_frac", "microbatches", "wasted_bucket_items"}


def _run(mode, rep, walls, busy, success=None):
    success = success or [0.5] * len(walls)
    steps = [{"step": i, "wall_step_s": w, "step_time_s": w * 0.9, "idle_frac": 1 - b / w, "learner_busy_s": b,
              "trainer_cpu_s": b, "success_rate": sr} for i, (w, b, sr) in enumerate(zip(walls, busy, success))]
    return {"mode": mode, "repeat": rep, "steps": steps}


def test_summary_fields_and_paired_speedup():
    runs = [_run("sync", 0, [9.0, 2.0, 2.0], [1, 1, 1]), _run("stream-trajectory", 0, [9.0, 1.0, 1.0], [1, 1, 1]),
            _run("sync", 1, [9.0, 4.0, 4.0], [1, 1, 1]), _run("stream-trajectory", 1, [9.0, 1.0, 3.0], [1, 2, 2])]
    s = bl.summarize(runs, skip=1)
    assert set(s) == {"sync", "stream-trajectory"} and all(set(v) == FIELDS for v in s.values())
    st = s["stream-trajectory"]
    assert st["step_s"] == {"median": 1.5, "min": 1.0, "max": 2.0, "n": 2}  # step 0 (start-up) left out
    assert st["speedup_vs_sync"] == {"median": 2.0, "min": 2.0, "max": 2.0, "n": 2}  # 2/1 and 4/2, by repeat
    assert st["learner_busy_s"]["max"] == 2.0 and s["sync"]["speedup_vs_sync"]["median"] == 1.0
    assert st["busy_vs_sync"] == {"median": 1.5, "min": 1.0, "max": 2.0, "n": 2}  # 1/1 and 2/1, by repeat
    # control: with skip 0 the start-up step counts and the figures move
    assert bl.summarize(runs, skip=0)["stream-trajectory"]["step_s"]["median"] != 1.5
    text = bl.table(s, dict(bl.machine(), load_before=(1.0, 1, 1), load_after=(2.0, 2, 2)), ["--trainer-cpus", "0"])
    assert "cores" in text and "load avg 1.00 before / 2.00 after" in text and "2.00x" in text
    assert "1.50x (1.00-2.00)" in text  # the paired busy ratio is printed


def test_task_args_leave_the_run_keys_to_the_tool():
    args = bl.task_args(bl.CONFIG)
    assert "--task" in args and "--global-batch-size" in args
    assert not {"--save", "--rl-mode", "--train-iters", "--model", "--init-tiny-model"} & set(args)


def test_task_picks_the_recipe(capsys):
    assert bl.parse([]).config == bl.CONFIG
    a = bl.parse(["--task", "log-search"])
    assert a.config == bl.TASKS["log-search"] and a.config != bl.CONFIG
    args, quick = bl.task_args(a.config), bl.task_args(bl.CONFIG)
    assert args[args.index("--task") + 1] == "megatron_tsync.runtime.env_tasks:log-search"
    assert args[args.index("--seq-length") + 1] != quick[quick.index("--seq-length") + 1]
    with pytest.raises(SystemExit):
        bl.parse(["--task", "log-search", "--config", bl.CONFIG])
    assert "give one" in capsys.readouterr().err


def test_cpu_flags():
    assert bl.cpu_flags("none") == [] and bl.cpu_flags("0:1") == ["--trainer-cpus", "0", "--rollout-cpus", "1"]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        flags = bl.cpu_flags("split")
        assert flags[0] == "--trainer-cpus" and flags[2] == "--rollout-cpus"
    with pytest.raises(SystemExit):
        bl.cpu_flags("0")


def test_mode_suffixes_add_their_flags():
    a = bl.parse(["--modes", "stream-trajectory+coalesce,sync+spec,async", "--coalesce-tokens", "999"])
    assert bl.mode_flags(a, "stream-trajectory+coalesce") == ("stream-trajectory", ["--stream-coalesce-tokens", "999"])
    assert bl.mode_flags(a, "sync+spec") == ("sync", ["--speculative-rollouts"])
    assert bl.mode_flags(a, "async") == ("async", [])
    assert bl.mode_flags(a, "stream-trajectory+nowait") == ("stream-trajectory", ["--no-stream-wait-for-variance"])
    assert bl.mode_flags(a, "stream-trajectory+mix+coalesce") == (
        "stream-trajectory", ["--pack-across-groups", "--stream-coalesce-tokens", "999"])
    assert all(bl.valid_mode(m) for m in bl.MODES)
    assert not any(bl.valid_mode(m) for m in ("stream", "sync+fast", "stream-trajectory+mix+mix"))


def test_bad_modes_are_refused(capsys):
    with pytest.raises(SystemExit):
        bl.parse(["--modes", "sync,fast"])
    assert "--modes" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--cpus"):
        bl.parse(["--cpus", "split", "--cpus", "0"])
    assert bl.parse([]).cpus == ["split"] and bl.parse(["--cpus", "none", "--cpus", "0:1"]).cpus == ["none", "0:1"]


@pytest.mark.slow
def test_tool_runs_the_real_trainer_and_writes_every_field(tmp_path):
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_live.py"), "--modes", "sync,async",
                        "--repeats", "1", "--steps", "2", "--sft-steps", "1", "--warm-dir", str(tmp_path / "warm"),
                        "--work-dir", str(tmp_path / "runs"), "--out", str(out),
                        "--train-args", "--global-batch-size 8 --max-turns 2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert list(r["summary"]) == ["split"] and set(r["summary"]["split"]) == {"sync", "async"}
    assert all(set(v) == FIELDS for v in r["summary"]["split"].values())
    assert all(run["load_at_start"] >= 0 and run["cpus"] == "split" for run in r["runs"])
    assert r["machine"]["cores"] == os.cpu_count() and len(r["machine"]["load_after"]) == 3
    assert all(len(run["steps"]) == 2 and run["steps"][1]["learner_busy_s"] > 0 for run in r["runs"])
    assert "speedup vs sync" in p.stdout and "machine:" in p.stdout


def test_reward_curve_test_detects_a_shift_and_not_noise():
    """The +spec curve test: the same per-step successes up to small noise are indistinguishable (p large); a
    curve lower by 0.3 at every step is not (p small) — the control that the test can fail."""
    import random

    rng = random.Random(0)
    base = [_run("stream-trajectory", r, [1.0] * 12, [0.5] * 12, [0.4 + 0.02 * i for i in range(12)]) for r in (0, 1)]
    same = [_run("stream-trajectory+spec", r, [0.8] * 12, [0.5] * 12,
                 [0.4 + 0.02 * i + (-1) ** (i + r) * rng.uniform(0, 0.05) for i in range(12)]) for r in (0, 1)]
    lower = [_run("stream-trajectory+spec", r, [0.8] * 12, [0.5] * 12, [0.1 + 0.02 * i for i in range(12)])
             for r in (0, 1)]
    ok = bl.summarize(base + same, skip=1)["stream-trajectory+spec"]["reward_curve_vs_base"]
    bad = bl.summarize(base + lower, skip=1)["stream-trajectory+spec"]["reward_curve_vs_base"]
    assert ok["pairs"] == 22 and ok["p_value"] > 0.05 and bad["p_value"] < 1e-3, (ok, bad)


def test_model_size_makes_that_model_and_keys_its_own_warm_start(tmp_path, monkeypatch):
    """``--model-size 256x3`` writes the task's tiny Llama at that size into its own warm-start folder; a bad spec is
    refused."""
    assert bl.parse(["--model-size", "512x4"]).model_size == (512, 4) and bl.parse([]).model_size is None
    for bad in ("512", "512x", "0x4", "ax4"):
        with pytest.raises(SystemExit):
            bl.parse(["--model-size", bad])
    ran = []
    monkeypatch.setattr(bl, "_run", lambda argv, log, timeout: ran.append(argv) or 0.0)  # no SFT run: the folders only
    base = bl.task_args(bl.CONFIG)
    a = bl.parse(["--model-size", "256x3", "--warm-dir", str(tmp_path), "--sft-steps", "1", "--sft-lr", "3e-4"])
    model, _ = bl.warm_start(a, base, size=a.model_size, sft_lr=a.sft_lr)
    cfg = json.loads(open(os.path.join(model, "config.json")).read())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (256, 3) and ran and model in ran[0]
    assert ran[0][-2:] == ["--sft-warmup-lr", "0.0003"]
    d = bl.parse(["--warm-dir", str(tmp_path), "--sft-steps", "1"])
    default_model, _ = bl.warm_start(d, base, size=d.model_size, sft_lr=d.sft_lr)
    assert default_model != model and not os.path.exists(os.path.join(default_model, "config.json"))
    assert "--sft-warmup-lr" not in ran[1]


def test_warm_start_cache_is_keyed_by_the_code(tmp_path, monkeypatch):
    """The same flags with changed package code make a new warm start instead of reusing the cached one (a task-code
    change once silently reused a warm start made by the old code); unchanged code reuses it."""
    ran = []
    monkeypatch.setattr(bl, "_run", lambda argv, log, timeout: ran.append(argv) or 0.0)
    base = bl.task_args(bl.CONFIG)
    a = bl.parse(["--warm-dir", str(tmp_path), "--sft-steps", "1"])
    assert len(bl.code_fingerprint()) == 16 and bl.code_fingerprint() == bl.code_fingerprint()
    monkeypatch.setattr(bl, "code_fingerprint", lambda: "old-code")
    _, ckpt_old = bl.warm_start(a, base)
    os.makedirs(ckpt_old, exist_ok=True)
    open(os.path.join(ckpt_old, "latest_checkpointed_iteration.txt"), "w").write("0")  # made: cached from now on
    assert bl.warm_start(a, base)[1] == ckpt_old and len(ran) == 1
    monkeypatch.setattr(bl, "code_fingerprint", lambda: "new-code")
    _, ckpt_new = bl.warm_start(a, base)
    assert ckpt_new != ckpt_old and len(ran) == 2
