"""``--trainer-cpus`` / ``--rollout-cpus`` (runtime/affinity.py): every flag moves the real processes' masks, read
from ``/proc/<pid>/status`` ``Cpus_allowed_list`` — the trainer rank, the rollout workers the fleet starts, and the
sandboxed tool calls a worker starts; bad values are errors naming the flag; an overlap is warned.

Pinning is done in child processes (never in the pytest process). Needs >= 2 usable cores (else skipped)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_tsync.arguments import parse_args
from megatron_tsync.config import RolloutConfig, parse_cpu_list
from megatron_tsync.runtime import affinity

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORES = sorted(os.sched_getaffinity(0))
needs2 = pytest.mark.skipif(len(CORES) < 2, reason="needs 2 usable cores")


def _py(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TSYNC_LOG="WARNING")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _allowed(pid) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))
    except (OSError, StopIteration):
        return None


# ------------------------------------------------------------------------------------------------ parsing
def test_cpu_list_syntax_and_format():
    assert parse_cpu_list("0-3,8") == (0, 1, 2, 3, 8)
    assert parse_cpu_list("8, 1,1-2") == (1, 2, 8)
    assert affinity.fmt((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"
    for bad in ("", "a", "3-1", "-1", "1,,2"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_flags_land_in_config_and_bad_syntax_names_the_flag(capsys):
    cfg = parse_args(["--trainer-cpus", "0-3,8", "--rollout-cpus", "4-7"])
    assert cfg.parallel.trainer_cpus == "0-3,8" and cfg.rollout.cpus == "4-7"
    assert parse_args([]).parallel.trainer_cpus is None and parse_args([]).rollout.cpus is None
    for flag in ("--trainer-cpus", "--rollout-cpus"):
        with pytest.raises(SystemExit) as e:
            parse_args([flag, "2-0"])
        assert e.value.code == 2 and flag in capsys.readouterr().err


def test_shares_are_contiguous_and_disjoint():
    cpus = tuple(range(7))
    parts = [affinity.share(cpus, 3, i) for i in range(3)]
    assert parts == [(0, 1, 2), (3, 4), (5, 6)]
    assert affinity.share((4, 5), 3, 2) == (4, 5)  # fewer cores than processes: all share the list
    assert affinity.share((4, 5), 1, 0) == (4, 5)


def test_cores_that_do_not_exist_or_are_not_allowed_are_errors():
    n = os.cpu_count()
    with pytest.raises(affinity.AffinityError, match=r"--trainer-cpus .*not available .*this machine has"):
        affinity.resolve(f"0,{n + 3}", "--trainer-cpus")
    with pytest.raises(affinity.AffinityError, match=r"--rollout-cpus 0: core\(s\) 0 not available"):
        affinity.resolve("0", "--rollout-cpus", allowed={1})
    assert affinity.resolve("0", "--rollout-cpus", allowed={0, 1}) == (0,)  # control: an allowed core passes


# ------------------------------------------------------------------------------------------------ processes
_TRAINER = """
    import os, threading, time, logging
    logging.basicConfig(level="WARNING")
    from megatron_tsync.arguments import parse_args
    from megatron_tsync.runtime import affinity
    import torch
    ev = threading.Event()
    t = threading.Thread(target=ev.wait, daemon=True); t.start()   # a thread that exists before the pinning
    cfg = parse_args({argv!r})
    affinity.setup_trainer(cfg, 0, 0, 1)
    def allowed(path):
        return next(l.split()[1] for l in open(path) if l.startswith("Cpus_allowed_list"))
    print("MAIN", allowed("/proc/self/status"))
    print("THREAD", allowed(f"/proc/self/task/{{t.native_id}}/status"))
    print("TORCH", torch.get_num_threads())
    print("WORKER0", affinity.worker_cpus(cfg.rollout, 0, True))
"""


def _lines(out: str) -> dict:
    return {w.split(" ", 1)[0]: w.split(" ", 1)[1] for w in out.splitlines() if w.split(" ")[0].isupper()}


@needs2
@pytest.mark.slow
def test_trainer_flag_pins_every_thread_and_sets_torch_threads():
    a, b = CORES[0], CORES[1]
    p = _py(_TRAINER.format(argv=["--trainer-cpus", f"{a},{b}", "--rollout-workers", "1"]))
    assert p.returncode == 0, p.stderr
    got = _lines(p.stdout)
    assert got["MAIN"] == got["THREAD"] == affinity.fmt((a, b)) and got["TORCH"] == "2"
    assert "trainer cores" in p.stdout and f"rollout workers on {affinity.fmt(CORES)}" in p.stdout
    assert got["WORKER0"] == str(tuple(CORES))  # no --rollout-cpus: workers get the start-up cores, not the pin
    p = _py(_TRAINER.format(argv=["--trainer-cpus", str(a), "--rollout-cpus", str(b)]))
    got = _lines(p.stdout)
    assert got["MAIN"] == got["THREAD"] == str(a) and got["TORCH"] == "1" and got["WORKER0"] == f"({b},)"
    assert "overlap" not in p.stderr
    # control: without the flags nothing moves
    p = _py(_TRAINER.format(argv=["--rollout-workers", "1"]))
    got = _lines(p.stdout)
    assert got["MAIN"] == got["THREAD"] == affinity.fmt(CORES) and "trainer unpinned" in p.stdout


@needs2
def test_overlap_is_warned_not_refused():
    a = CORES[0]
    p = _py(_TRAINER.format(argv=["--trainer-cpus", f"{a}", "--rollout-cpus", f"{a},{CORES[1]}"]))
    assert p.returncode == 0, p.stderr
    assert f"overlap on core(s) {a}" in p.stderr


_WORKER = """
    import os
    from megatron_tsync.config import RolloutConfig
    from megatron_tsync.runtime import affinity
    from megatron_tsync.rollout.sandbox import Sandbox, SandboxConfig
    import torch
    cpus = affinity.setup_worker(RolloutConfig(cpus={cpus!r}, num_workers=2), 1, started_by_trainer=False)
    r = Sandbox(SandboxConfig()).run(code="print(next(l.split()[1] for l in open('/proc/self/status') "
                                          "if l.startswith('Cpus_allowed_list')))")
    assert r.ok, r
    print("TOOL", r.stdout.strip())
    print("TORCH", torch.get_num_threads())
"""


@needs2
@pytest.mark.slow
def test_worker_flag_pins_the_worker_and_its_sandboxed_tool_calls():
    b = CORES[1]
    p = _py(_WORKER.format(cpus=str(b)))
    assert p.returncode == 0, p.stderr
    assert _lines(p.stdout) == {"TOOL": str(b), "TORCH": "1"}
    p = _py(_WORKER.format(cpus=None))  # control: no flag, the tool call runs on every core
    assert p.returncode == 0, p.stderr
    assert _lines(p.stdout)["TOOL"] == affinity.fmt(CORES)


def test_external_worker_checks_its_own_cores():
    with pytest.raises(affinity.AffinityError, match="--rollout-cpus"):
        affinity.setup_worker(RolloutConfig(cpus=str(os.cpu_count() + 1)), 0, started_by_trainer=False)


def test_train_cli_refuses_a_core_that_does_not_exist(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    bad = str(os.cpu_count() + 2)
    p = subprocess.run([sys.executable, "-m", "megatron_tsync.train", "--model", str(tmp_path / "none"),
                        "--rollout-cpus", bad], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"--rollout-cpus {bad}" in p.stderr and "not available" in p.stderr, p.stderr
    assert p.stderr.startswith("[tsync] error: ") and "Traceback" not in p.stderr  # pre-flight: before the model


# ------------------------------------------------------------------------------------------------ live run
def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


@needs2
@pytest.mark.slow
def test_live_run_trainer_and_worker_processes_are_disjoint(tmp_path):
    """The real trainer (``python -m megatron_tsync.train``) and the worker it starts, read while they run."""
    from megatron_tsync.model.tiny_model import make_tiny_model
    from tests.conftest import free_port

    make_tiny_model(str(tmp_path / "model"), seed=0)
    a, b = CORES[0], CORES[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    argv = ["--model", str(tmp_path / "model"), "--group-size", "2", "--global-batch-size", "4", "--rollout-workers",
            "1", "--max-turns", "2", "--max-new-tokens", "16", "--seq-length", "128", "--train-iters", "2",
            "--no-progress", "--trainer-cpus", str(a), "--rollout-cpus", str(b), "--rollout-dir", str(tmp_path / "rp")]
    p = subprocess.Popen([sys.executable, "-m", "megatron_tsync.train", *argv], cwd=tmp_path, env=env,
                         stdout=open(tmp_path / "out.txt", "w"), stderr=subprocess.STDOUT)
    trainer, workers, below = [], set(), set()  # below: the workers' children (sandboxed tool calls)
    deadline = time.time() + 300
    while p.poll() is None and time.time() < deadline:
        trainer.append(_allowed(p.pid))
        for c in _children(p.pid):
            workers.add(_allowed(c))
            below.update(_allowed(g) for g in _children(c))
        time.sleep(0.05)
    out = (tmp_path / "out.txt").read_text()
    assert p.wait(timeout=30) == 0, out[-3000:]
    trainer = [c for c in trainer if c is not None]
    workers.discard(None)
    # the full set only before the pinning; the rollout core only for the moment the main thread starts the worker
    # (``affinity.children_on`` sets the starting thread's mask, which /proc/PID/status reports); then core a
    assert set(trainer) <= {str(a), str(b), affinity.fmt(CORES)} and trainer[-1] == str(a), trainer
    assert workers == {str(b)}, workers
    below.discard(None)
    assert below <= {str(b)}, below  # every tool-call process caught running was on the rollout core
    assert f"trainer cores {a}" in out and f"rollout cores {b}" in out
    log = (tmp_path / "rp" / "worker_logs" / "worker0.log").read_text()
    assert f"cpus {b} (--rollout-cpus {b}), torch threads 1" in log


@needs2
def test_children_start_on_the_given_cores_and_the_parent_keeps_its_own():
    b = CORES[1]
    p = _py(f"""
        import os, subprocess, sys
        from megatron_tsync.runtime import affinity
        before = os.sched_getaffinity(0)
        code = "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('Cpus_allowed_list')))"
        with affinity.children_on(({b},)):
            child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
        free = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
        print("CHILD", child); print("FREE", free); print("KEPT", os.sched_getaffinity(0) == before)
    """)
    assert p.returncode == 0, p.stderr
    assert _lines(p.stdout) == {"CHILD": str(b), "FREE": affinity.fmt(CORES), "KEPT": "True"}  # FREE: control
