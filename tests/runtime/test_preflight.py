"""Start-up mistakes are caught before anything expensive or lasting (``runtime/preflight.py``, ``arguments.py``):

- each pre-flight case in-process (``preflight.check`` on the parsed config: the message names the flag and the fix);
- the entry point on all of them in one subprocess: exit code 2, exactly one ``[tsync] error:`` line, no traceback,
  no ``--save`` folder, and neither megatron nor transformers imported (so it is cheap by construction);
- a flag typo: one line with "did you mean", exit 2; ``--help`` imports neither torch nor megatron;
- MASTER_PORT taken (a two-rank launch's rank 0): one line naming MASTER_PORT, exit 2;
- the end-of-run worker close message; two single-process trainers at once without MASTER_PORT (slow).
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from megatron_tsync.arguments import parse_args
from megatron_tsync.runtime import preflight as pf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JSONL = ["--task", "examples.jsonl_tasks:swe-jsonl", "--verifier", "unit_tests", "--reward-kind", "bounded",
         "--reward-range", "0", "1"]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=ROOT, **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "TSYNC_DEBUG", "TSYNC_TASK_FILE"):
        if k not in extra:
            env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory):
    """The tiny model, and a copy of its config.json alone (no tokenizer, no weights)."""
    bare = tmp_path_factory.mktemp("pf") / "no_tokenizer"
    bare.mkdir()
    with open(os.path.join(tiny_dir, "config.json")) as f:
        (bare / "config.json").write_text(f.read())
    return tiny_dir, str(bare)


def _error(argv) -> str:
    with pytest.raises(pf.PreflightError) as e:
        pf.check(parse_args(argv))
    return str(e.value)


def test_missing_tokenizer(models):
    msg = _error(["--model", models[1]])
    assert "no tokenizer" in msg and "tokenizer.json" in msg and models[1] in msg


def test_missing_and_broken_task_file(models, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(ROOT)  # examples.jsonl_tasks, as from the repository root
    monkeypatch.setenv("TSYNC_TASK_FILE", str(tmp_path / "absent.jsonl"))
    assert "absent.jsonl: no such task file" in _error(["--model", models[0], *JSONL])
    (tmp_path / "bad.jsonl").write_text('{"id": 1,\n')
    monkeypatch.setenv("TSYNC_TASK_FILE", str(tmp_path / "bad.jsonl"))
    assert "bad.jsonl:1: not valid JSON" in _error(["--model", models[0], *JSONL])
    monkeypatch.setenv("TSYNC_TASK_FILE", os.path.join(ROOT, "examples", "qwen_swe", "sample_tasks.jsonl"))
    assert pf.check(parse_args(["--model", models[0], *JSONL, "--seq-length", "4096"])) == []


def test_task_verifier_mismatch_and_unknown_task(models):
    msg = _error(["--model", models[0], "--verifier", "unit_tests", "--reward-kind", "bounded", "--reward-range",
                  "0", "1"])
    assert "--task arithmetic-calculator with --verifier unit_tests" in msg and "exact_answer" in msg
    assert "unknown task 'nope'" in _error(["--model", models[0], "--task", "nope"])


def test_tp_must_divide_heads_kv_heads_and_layers(models):
    assert "does not divide the 4 attention heads" in _error(["--model", models[0], "--tensor-model-parallel-size",
                                                              "3"])
    msg = _error(["--model", models[0], "--tensor-model-parallel-size", "4"])  # 4 heads, 2 KV heads
    assert "does not divide the 2 key/value heads" in msg and "TP sizes that fit: 1, 2" in msg
    assert "does not divide the 2 layers" in _error(["--model", models[0], "--pipeline-model-parallel-size", "3"])
    with pytest.raises(pf.PreflightError, match="expert-model-parallel-size 2 does not divide the data-parallel"):
        pf.check(parse_args(["--model", models[0], "--expert-model-parallel-size", "2"]), world_size=3)


def test_router_replay_needs_a_moe_model(models):
    assert "--moe-router-replay needs a MoE model" in _error(["--model", models[0], "--moe-router-replay"])


def _dump(root, routed: bool) -> str:
    """A one-step rollout dump of two trajectories, with router-replay routing (P, L, k) when ``routed``."""
    import torch

    from megatron_tsync.runtime.rollout_io import dump_rollouts
    from megatron_tsync.streaming.ready_queue import Sample

    samples = [Sample(f"s0g0t{i}", "s0g0", 2, torch.arange(8), torch.ones(8), float(i), policy_version=0,
                      behaviour_logp=-torch.rand(8, dtype=torch.float64),
                      routing=torch.randint(0, 4, (7, 2, 2), dtype=torch.uint8) if routed else None) for i in range(2)]
    dump_rollouts(str(root), 0, samples, ["s0g0"])
    return str(root)


def test_replay_of_a_routed_dump_names_router_replay(models, tmp_path):
    """A dump recorded with --moe-router-replay (routing.{i} tensors) replayed without the flag: one error naming it
    (the model would route by itself: another gradient than the recorded one); a dump without routing replays."""
    msg = _error(["--model", models[0], "--replay-rollouts", _dump(tmp_path / "routed", True)])
    assert "step_0000000 carries MoE routing for 2 trajectories" in msg and "add --moe-router-replay" in msg, msg
    assert pf.check(parse_args(["--model", models[0], "--replay-rollouts", _dump(tmp_path / "plain", False)])) == []


def test_short_seq_length(models):
    msg = _error(["--model", models[0], "--seq-length", "24", "--max-new-tokens", "8"])
    assert "--seq-length 24 is too short for a correct answer" in msg
    warn = pf.check(parse_args(["--model", models[0], "--seq-length", "40", "--max-new-tokens", "8"]))
    assert len(warn) == 1 and "--max-turns 4 × --max-new-tokens 8" in warn[0]
    assert pf.check(parse_args(["--model", models[0]])) == []


# The entry point on every case above in one process: exit 2, one line, no traceback, nothing written, nothing heavy.
_ENTRY = r"""
import contextlib, io, json, os, sys
from megatron_tsync.train import main
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    os.environ.pop("TSYNC_TASK_FILE", None)
    if name == "task_file":
        os.environ["TSYNC_TASK_FILE"] = "absent.jsonl"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    out[name] = [code, err.getvalue()]
out["heavy"] = sorted(m for m in ("megatron", "transformers", "torch.distributed.run") if m in sys.modules)
print(json.dumps(out))
"""


def test_entry_point_errors_are_one_line_exit_2_and_write_nothing(models, tmp_path):
    model, bare = models
    save = str(tmp_path / "ck")
    common = ["--save", save, "--no-progress"]
    cases = {"tokenizer": ["--model", bare], "task_file": ["--model", model, *JSONL],
             "verifier": ["--model", model, "--verifier", "unit_tests", "--reward-kind", "bounded", "--reward-range",
                          "0", "1"],
             "tp": ["--model", model, "--tensor-model-parallel-size", "3"],
             "seq": ["--model", model, "--seq-length", "24", "--max-new-tokens", "8"],
             "typo": ["--model", model, "--lerning-rate", "1e-4"],
             "routing": ["--model", model, "--replay-rollouts", _dump(tmp_path / "dump", True)]}
    p = subprocess.run([sys.executable, "-c", _ENTRY, json.dumps({k: [*v, *common] for k, v in cases.items()})],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got.pop("heavy") == [], "pre-flight must fail before megatron / transformers are imported"
    for name, (code, err) in got.items():
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, (name, code, err)
        if name == "typo":  # argparse's "PROG: error: ...", one line, not the usage
            assert ": error: unrecognized argument --lerning-rate" in lines[0], err
        else:
            assert lines[0].startswith("[tsync] error: "), (name, err)
    assert "did you mean --lr?" in got["typo"][1]
    assert "absent.jsonl: no such task file" in got["task_file"][1]
    assert "add --moe-router-replay" in got["routing"][1]
    assert not os.path.exists(save) and not os.path.exists(tmp_path / "runs")


def test_typo_suggestions_share_the_config_hint(tmp_path, capsys):
    from megatron_tsync.arguments import build_parser, suggest_flag

    p = build_parser()
    assert suggest_flag("--lerning-rate", p) == "--lr"
    assert suggest_flag("--seq-lenght", p) == "--seq-length"
    assert suggest_flag("--zzzz", p) is None
    (tmp_path / "c.yaml").write_text("lerning_rate: 0.1\n")
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(tmp_path / "c.yaml")])
    assert e.value.code == 2 and "did you mean 'lr'?" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        parse_args(["--rl-mod", "sync", "--zzzz"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--rl-mod (did you mean --rl-mode?), --zzzz" in err


def test_help_imports_neither_torch_nor_megatron():
    code = ("import contextlib, io, sys\nfrom megatron_tsync.train import main\nout = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n    try: main(['--help'])\n    except SystemExit as e: rc = e.code\n"
            "print(rc, 'torch' in sys.modules, 'megatron' in sys.modules, '(default: 0.2)' in out.getvalue())")
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["0", "False", "False", "True"], p.stdout + p.stderr


@pytest.mark.slow
def test_master_port_in_use_is_one_line(models, tmp_path):
    """Rank 0 of a two-process launch (srun-style: RANK/WORLD_SIZE set, nobody else holds the store) on a taken
    MASTER_PORT: the store cannot listen; one line naming MASTER_PORT, exit 2, no --save folder."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "megatron_tsync.train", "--model", models[0], "--no-progress",
                            "--save", str(tmp_path / "ck")], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300, env=_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_PORT=str(port),
                                                 MASTER_ADDR="127.0.0.1"))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert [ln for ln in lines if "error" in ln] == [lines[-1]] and lines[-1].startswith("[tsync] error: MASTER_PORT "
                                                                                         f"{port}"), p.stderr
    assert not os.path.exists(tmp_path / "ck")


def test_close_message_says_stopped_not_crashed():
    from megatron_tsync.runtime.fleet import close_message

    assert close_message([0, 0], set(), 10) == "rollout workers closed: 2 exited 0"
    msg = close_message([0, -9], {1}, 10)
    assert "1 exited 0" in msg and "1 stopped" in msg and "-9" not in msg
    assert "worker 0: -15" in close_message([-15, 0], set(), 10)


@pytest.mark.slow
def test_two_single_process_trainers_at_once_without_master_port(models, tmp_path):
    """World of one: an in-process store, no port; two started at the same moment both finish, and their rollout
    workers exit 0 at the close."""
    args = ["--model", models[0], "--rl-mode", "sync", "--train-iters", "1", "--group-size", "2",
            "--global-batch-size", "2", "--rollout-workers", "1", "--max-turns", "1", "--max-new-tokens", "8",
            "--seq-length", "64", "--no-progress"]
    procs = []
    for i in (0, 1):
        d = tmp_path / f"run{i}"
        d.mkdir()
        procs.append(subprocess.Popen([sys.executable, "-m", "megatron_tsync.train", *args, "--save", str(d / "ck")],
                                      cwd=d, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
        assert "rollout workers closed: 1 exited 0" in out, out[-2000:]


def test_eval_interval_needs_the_whole_model_on_rank_0_and_a_held_out_split(models, monkeypatch):
    tp2 = ["--model", models[0], "--tensor-model-parallel-size", "2"]
    with pytest.raises(pf.PreflightError) as e:
        pf.check(parse_args([*tp2, "--eval-interval", "5"]), world_size=2)
    assert "--eval-interval" in str(e.value) and "TP 2, PP 1, EP 1, CP 1" in str(e.value) and "evaluate.py" in str(e.value)
    assert pf.check(parse_args(tp2), world_size=2) == []  # control: without --eval-interval
    from megatron_tsync.runtime.tasks import ArithmeticCalculatorTask

    def no_split(self, step, num_groups, seed, *, split="train"):
        if split != "train":
            raise ValueError("this task has no eval split")
        return orig(self, step, num_groups, seed)

    orig = ArithmeticCalculatorTask.sample_prompts
    monkeypatch.setattr(ArithmeticCalculatorTask, "sample_prompts", no_split)
    msg = _error(["--model", models[0], "--eval-interval", "5"])
    assert "gives no held-out prompts" in msg and "no eval split" in msg
    assert pf.check(parse_args(["--model", models[0]])) == []  # control: without --eval-interval


def test_tp_without_a_launcher_names_torchrun_and_wandb_needs_wandb(models, monkeypatch):
    """TP 2 started as one plain process: the error says to launch with torchrun; under a launcher it is the plain
    world-size rule. --wandb-project without the wandb package: one line naming the install (was a traceback)."""
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    msg = _error(["--model", models[0], "--tensor-model-parallel-size", "2"])
    assert "not a multiple of TP × PP × CP = 2 × 1 × 1" in msg and "torchrun --nproc-per-node 2" in msg
    cfg = parse_args(["--model", models[0], "--tensor-model-parallel-size", "2"])
    monkeypatch.setenv("SLURM_PROCID", "0")  # launched (srun), 3 ranks
    with pytest.raises(pf.PreflightError) as e:
        pf.check(cfg, world_size=3)
    assert "the 3 processes are not a multiple" in str(e.value) and "torchrun" not in str(e.value)
    monkeypatch.delenv("SLURM_PROCID")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    msg = _error(["--model", models[0], "--wandb-project", "p"])
    assert msg.startswith("--wandb-project p: the wandb package is not installed (pip install wandb)")
