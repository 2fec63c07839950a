"""The standard task formats from local files: a hand-made SWE-bench-style instance (a real git repository, as a
directory and as a tarball) and a Terminal-Bench-style task directory load and verify: the gold patch / solution
scores 1, doing nothing 0, and the agent cannot see or touch the hidden tests."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile

import pytest

from megatron_tsync.rollout.envs.loaders import load_swebench_jsonl, load_terminal_bench_dir
from megatron_tsync.rollout.envs.workspace_env import WorkspaceEnv
from tests.rollout.envs.suite_helpers import do_nothing, known_fix, run_policy

pytestmark = pytest.mark.timeout(300)

BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
FIXED = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
OLD_TESTS = "from calc.ops import mul\n\n\ndef test_mul():\n    assert mul(3, 4) == 12\n"
NEW_TESTS = OLD_TESTS + "\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def git(cwd, *args):
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


def diff_of(repo, path, new_text) -> str:
    with open(os.path.join(repo, path), "w") as f:
        f.write(new_text)
    out = git(repo, "diff", "--", path)
    git(repo, "checkout", "--", path)
    return out


@pytest.fixture(scope="module")
def swe_repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("swebench")
    repo = root / "acme__calc"
    (repo / "calc").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "calc" / "__init__.py").write_text("")
    (repo / "calc" / "ops.py").write_text(BUGGY)
    (repo / "tests" / "test_ops.py").write_text(OLD_TESTS)
    (repo / "tests" / "conftest.py").write_text("import sys\n")  # the repository's own conftest is restored
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "README").write_text("later commit\n")  # base_commit is not HEAD
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "later")
    git(repo, "checkout", "-q", base)
    test_patch = diff_of(repo, "tests/test_ops.py", NEW_TESTS.replace("import mul", "import add, mul"))
    gold = diff_of(repo, "calc/ops.py", FIXED)
    git(repo, "checkout", "-q", "-")
    rec = {"instance_id": "acme__calc-1", "repo": "acme/calc", "base_commit": base,
           "problem_statement": "add(2, 3) returns -1 instead of 5.", "test_patch": test_patch, "patch": gold,
           "FAIL_TO_PASS": json.dumps(["tests/test_ops.py::test_add"]), "PASS_TO_PASS": ["tests/test_ops.py::test_mul"]}
    (root / "instances.jsonl").write_text(json.dumps(rec) + "\n")
    with tarfile.open(root / "acme__calc.tar.gz", "w:gz") as tf:
        tf.add(repo, arcname="calc-src")
    tar_rec = dict(rec, instance_id="acme__calc-2", repo_tarball="acme__calc.tar.gz")
    tar_rec.pop("repo")
    (root / "tarball.jsonl").write_text(json.dumps(tar_rec) + "\n")
    return root


@pytest.fixture(scope="module")
def env(env_sandbox, hidden_verifier):
    return WorkspaceEnv(sandbox=env_sandbox, verifier=hidden_verifier)


@pytest.mark.parametrize("jsonl", ["instances.jsonl", pytest.param("tarball.jsonl", marks=pytest.mark.slow)])
def test_swebench_instance_loads_and_verifies(swe_repo, env, tmp_path, jsonl):
    (task,) = load_swebench_jsonl(str(swe_repo / jsonl), str(tmp_path))
    assert task.must_pass == ("tests/test_ops.py::test_add", "tests/test_ops.py::test_mul")
    assert "test_add" in task.test_files["tests/test_ops.py"] and "tests/conftest.py" in task.test_files
    with open(os.path.join(task.copy_from, "tests/test_ops.py")) as f:
        assert "test_add" not in f.read()  # the checkout is at base_commit, without the test patch
    assert not os.path.exists(os.path.join(task.copy_from, "README"))
    assert run_policy(env, [task], known_fix)[0][1].reward == 1.0
    v = run_policy(env, [task], do_nothing)[0][1]
    assert v.reward == 0.0 and "test_add" in v.reason, v


def test_swebench_editing_the_existing_tests_does_not_help(swe_repo, env, tmp_path):
    (task,) = load_swebench_jsonl(str(swe_repo / "instances.jsonl"), str(tmp_path))
    cheat = env.format.render_call("bash", {"command": "printf 'def test_add():\\n    pass\\n' >> tests/test_ops.py"
                                                       " && printf 'import pytest\\n' > conftest.py"})
    assert run_policy(env, [task], lambda e, t: [cheat])[0][1].reward == 0.0


def test_swebench_bad_input_names_file_line_and_field(swe_repo, tmp_path):
    bad = tmp_path / "bad.jsonl"
    rec = json.loads((swe_repo / "instances.jsonl").read_text())
    bad.write_text(json.dumps(dict(rec, FAIL_TO_PASS="not json")) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1 .*FAIL_TO_PASS"):
        load_swebench_jsonl(str(bad), str(tmp_path), repo_root=str(swe_repo))
    rec.pop("repo")
    bad.write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match="no local repository"):
        load_swebench_jsonl(str(bad), str(tmp_path))


@pytest.fixture
def tb_task(tmp_path):
    d = tmp_path / "count-errors"
    (d / "tests").mkdir(parents=True)
    (d / "workspace").mkdir()
    (d / "workspace" / "app.log").write_text("INFO a\nERROR b\nERROR c\nINFO d\n")
    (d / "task.yaml").write_text("instruction: |\n  Write the number of ERROR lines of app.log to errors.txt.\n"
                                 "difficulty: easy\nmax_test_timeout_sec: 30\n")
    (d / "setup.sh").write_text("cp app.log app.log.orig\n")
    (d / "solution.sh").write_text("grep -c ERROR app.log > errors.txt\n")
    (d / "tests" / "test_outputs.py").write_text(
        "def test_count():\n    assert open('errors.txt').read().strip() == '2'\n\n\n"
        "def test_log_untouched():\n    assert open('app.log').read() == open('app.log.orig').read()\n")
    return d


@pytest.mark.slow  # the -bench formats' end-to-end checks are in the slow tier (test_verifier.py too)
def test_terminal_bench_task_loads_and_verifies(tb_task, env):
    task = load_terminal_bench_dir(str(tb_task))
    assert task.instruction.startswith("Write the number") and task.meta["difficulty"] == "easy"
    assert task.must_pass == ("tests/test_outputs.py",)
    assert run_policy(env, [task], known_fix)[0][1].reward == 1.0
    assert run_policy(env, [task], do_nothing)[0][1].reward == 0.0
    peek = env.format.render_call("bash", {"command": "ls -a; cat tests/test_outputs.py"})
    v = run_policy(env, [task], lambda e, t: [peek, *known_fix(e, t)])  # the tests are not in the workspace
    assert v[0][1].reward == 1.0


def test_terminal_bench_bad_input_names_the_file(tb_task):
    (tb_task / "task.yaml").write_text("difficulty: easy\n")
    with pytest.raises(ValueError, match=r"task.yaml: missing or empty 'instruction'"):
        load_terminal_bench_dir(str(tb_task))


def test_the_reference_runs_once_per_task_for_a_whole_group(tb_task, env_sandbox, hidden_verifier):
    """Loaded tasks' expected values come from the reference solution, run twice per task and process — not per
    trajectory, even when a group's trajectories finish together."""

    class Counting(WorkspaceEnv):
        runs = 0

        def _reference_run(self, task, spec):
            Counting.runs += 1
            return super()._reference_run(task, spec)

    env = Counting(sandbox=env_sandbox, verifier=hidden_verifier)
    task = load_terminal_bench_dir(str(tb_task))
    results = run_policy(env, [task] * 4, known_fix, concurrency=4)
    assert [v.reward for _, v, _ in results] == [1.0] * 4 and Counting.runs == 2
