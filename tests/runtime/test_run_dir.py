"""One run per ``--save`` folder (``runtime/run_dir.py``), with real trainers (replayed rollouts, no workers):

- a second trainer on a locked folder fails at once naming the holder (pid, host, SLURM job); once the lock is
  free the same command runs, and removes a killed save's ``iter_*.tmp`` (and puts back an ``iter_*.old``);
- a resume whose run-defining config differs is an error listing each field (old → new); with
  ``--override-loaded-config`` it resumes with a warning per field; ``--train-iters`` is not run-defining.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from megatron_tsync.runtime.run_dir import RunLock, RunLocked, clean_stale, config_diff, run_config
from tests.runtime.test_stop import REPLAY, _env
from tests.runtime.test_train_e2e import _synthetic_dump, tiny_model  # noqa: F401 - fixture used by name


@pytest.fixture(scope="module")
def dump(tiny_model, tmp_path_factory):  # noqa: F811
    d = str(tmp_path_factory.mktemp("dump") / "dump")
    _synthetic_dump(d, tiny_model, steps=4)
    return d


def _run(args, cwd, **env):
    return subprocess.run([sys.executable, "-m", "megatron_tsync.train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=_env(**env))


def test_lock_is_exclusive_and_names_its_holder(tmp_path):
    lock = RunLock(str(tmp_path))
    with pytest.raises(RunLocked, match=rf'"pid": {os.getpid()}'):
        RunLock(str(tmp_path))  # flock is per open file: a second open conflicts even in this process
    lock.release()
    RunLock(str(tmp_path)).release()


def test_clean_stale_removes_tmp_and_restores_old(tmp_path, capsys):
    for d in ("iter_0000004.tmp/x", "iter_0000002", "reference/iter_0000000.tmp", "iter_0000003.old/a"):
        os.makedirs(tmp_path / d)
    gone = clean_stale(str(tmp_path))
    assert sorted(os.path.relpath(g, tmp_path) for g in gone) == ["iter_0000004.tmp", "reference/iter_0000000.tmp"]
    assert (tmp_path / "iter_0000003" / "a").exists() and not (tmp_path / "iter_0000003.old").exists()
    assert "iter_0000004.tmp" in capsys.readouterr().out


def test_run_config_diff_lists_fields():
    from megatron_tsync.arguments import parse_args

    a = run_config(parse_args(["--model", "m", "--lr", "1e-3", "--train-iters", "5"]))
    b = run_config(parse_args(["--model", "m", "--lr", "2e-3", "--group-size", "4", "--train-iters", "9"]))
    assert sorted(config_diff(a, b)) == ["optim.lr: 0.001 → 0.002", "rl.group_size: 8 → 4"]
    assert config_diff({"rl.seed": 1}, {"rl.seed": 1, "optim.lr": 3.0}) == []  # unrecorded fields are skipped


@pytest.fixture(scope="module")
def locked_then_free(tiny_model, dump, tmp_path_factory):  # noqa: F811
    """A 1-step run (``--lr 1e-3``) on a save folder first locked by this process (that attempt fails), then free:
    ``(ck, first attempt, its leftovers check, second attempt)``. The second attempt's checkpoint is also the run that
    ``test_resume_with_another_config_is_refused_unless_overridden`` resumes (a copy), one trainer start-up less."""
    ck = str(tmp_path_factory.mktemp("locked") / "ck")
    holder = RunLock(ck)
    os.makedirs(os.path.join(ck, "iter_0000007.tmp"))  # a killed save's leftovers: removed by the next run, not this
    args = ["--model", tiny_model, "--replay-rollouts", dump, *REPLAY, "--train-iters", "1", "--lr", "1e-3",
            "--save", ck]
    first = _run(args, os.path.dirname(ck), SLURM_JOB_ID="99")
    tmp_kept = os.path.isdir(os.path.join(ck, "iter_0000007.tmp"))
    holder.release()
    return ck, first, tmp_kept, _run(args, os.path.dirname(ck), SLURM_JOB_ID="99")


@pytest.mark.slow  # 14 s: two trainer start-ups
def test_second_trainer_on_a_locked_save_fails_at_once(locked_then_free):
    ck, p, tmp_kept, p2 = locked_then_free
    assert p.returncode == 1 and "is in use by another trainer" in p.stderr, p.stderr[-2000:]
    assert f'"pid": {os.getpid()}' in p.stderr and tmp_kept
    assert p2.returncode == 0, p2.stderr[-3000:]
    assert "removed 1 incomplete checkpoint folder(s)" in p2.stdout and "iter_0000007.tmp" in p2.stdout
    assert not os.path.exists(os.path.join(ck, "iter_0000007.tmp"))
    with open(os.path.join(ck, ".tsync.lock")) as f:
        assert json.load(f)["slurm_job_id"] == "99"  # the last holder's identity stays readable


@pytest.mark.slow
def test_resume_with_another_config_is_refused_unless_overridden(tiny_model, dump, locked_then_free,  # noqa: F811
                                                                  tmp_path):
    """Resumes a copy of the 1-step ``--lr 1e-3`` run of ``locked_then_free`` (its saved run config: lr 1e-3, seed
    1234)."""
    ck = str(tmp_path / "ck")
    assert locked_then_free[3].returncode == 0, locked_then_free[3].stderr[-3000:]
    shutil.copytree(locked_then_free[0], ck, ignore=shutil.ignore_patterns(".tsync.lock"))
    base = ["--model", tiny_model, "--replay-rollouts", dump, *REPLAY, "--save", ck]
    p = _run([*base, "--train-iters", "2", "--load", ck, "--lr", "2e-3", "--seed", "7"], tmp_path)
    assert p.returncode == 1 and "another experiment" in p.stderr, p.stderr[-2000:]
    assert "optim.lr: 0.001 → 0.002" in p.stderr and "rl.seed: 1234 → 7" in p.stderr
    p = _run([*base, "--train-iters", "2", "--load", ck, "--lr", "2e-3", "--seed", "7", "--override-loaded-config"],
             tmp_path)
    assert p.returncode == 0 and "resumed from" in p.stdout, p.stderr[-2000:]
    assert "--override-loaded-config: resuming" in p.stderr and "optim.lr: 0.001 → 0.002" in p.stderr
    p = _run([*base, "--train-iters", "3", "--load", ck, "--lr", "2e-3", "--seed", "7"], tmp_path)
    assert p.returncode == 0 and "at step 2" in p.stdout, p.stderr[-2000:]  # the override's config was saved
