"""Loaders of the standard task formats from local files (nothing is fetched) into :class:`WorkspaceTask` s.

SWE-bench style (:func:`load_swebench_jsonl`): one JSON object per line with ``instance_id``, ``problem_statement``,
``base_commit``, ``test_patch``, ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (lists, or JSON strings of lists, of pytest
node ids), optional ``patch`` (the gold fix, for scripted checks), and the repository as a local git repository or a
tarball of one: ``repo_path`` / ``repo_tarball`` in the record, or ``repo`` ("owner/name") looked up under the
loader's ``repo_root`` as ``owner__name``, ``owner/name`` or those names + ``.tar`` / ``.tar.gz`` / ``.tgz``.
Each instance is checked out at ``base_commit`` (a local ``git clone``) into the loader's cache directory, the
workspace starts as a copy of it (``.git`` included); the test patch is applied to a scratch copy only to read the
test files' new contents, which the verifier restores over the final workspace together with the repository's own
``conftest.py`` files (the workspace's are dropped). Verdict: every FAIL_TO_PASS and PASS_TO_PASS test passes.
Pytest node ids only (Django-style test labels are not supported).

Terminal-Bench style (:func:`load_terminal_bench_dir`): a task directory with ``task.yaml`` (``instruction``;
optional ``max_test_timeout_sec``), ``tests/`` (pytest files, e.g. ``test_outputs.py``, and their data), optional
``setup.sh`` (run in the workspace before the episode, as the agent's uid: Terminal-Bench's Dockerfile step),
optional ``workspace/`` (initial files) and optional ``solution.sh`` (the known solution). The tests run with the
final workspace copy as cwd (Terminal-Bench's ``/app``): they must use relative paths; the Dockerfile and
``run-tests.sh`` are not used. Verdict: every test in every ``tests/test_*.py`` passes (at least one).
Standard library (+ PyYAML for task.yaml) and the git binary.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from typing import Any

from megatron_tsync.rollout.envs.workspace_env import WorkspaceTask

__all__ = ["load_swebench_jsonl", "load_swebench_instance", "load_terminal_bench_dir"]

_DIFF_RE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


def _git(args: list[str], cwd: str, what: str, stdin: str | None = None) -> str:
    p = subprocess.run(["git", "-c", "advice.detachedHead=false", *args], cwd=cwd, input=stdin, text=True,
                       capture_output=True)
    if p.returncode != 0:
        raise ValueError(f"{what}: git {' '.join(args[:3])} failed: {p.stderr.strip()[-500:]}")
    return p.stdout


def _node_ids(rec: dict, key: str, where: str) -> list[str]:
    v = rec.get(key, [])
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise ValueError(f"{where}: field {key!r} is a string that is not a JSON list") from None
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"{where}: field {key!r} must be a list of pytest node ids")
    return v


def _repo_source(rec: dict, repo_root: str | None, where: str) -> str:
    for key in ("repo_path", "repo_tarball"):
        if rec.get(key):
            path = rec[key]
            if repo_root and not os.path.isabs(path):
                path = os.path.join(repo_root, path)
            if not os.path.exists(path):
                raise ValueError(f"{where}: {key} {path!r} does not exist")
            return path
    repo = rec.get("repo")
    if repo and repo_root:
        for name in (repo.replace("/", "__"), repo):
            for ext in ("", ".tar", ".tar.gz", ".tgz"):
                cand = os.path.join(repo_root, name + ext)
                if os.path.exists(cand):
                    return cand
    raise ValueError(f"{where}: no local repository: give 'repo_path' or 'repo_tarball', or 'repo' with a "
                     f"repo_root that holds it (nothing is downloaded)")


def _unpack(src: str, dest: str, where: str) -> str:
    """A git repository directory for `src` (a directory, or a tarball extracted under `dest`)."""
    if os.path.isdir(src):
        return src
    try:
        with tarfile.open(src) as tf:
            tf.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as e:
        raise ValueError(f"{where}: cannot extract {src}: {e}") from None
    for dirpath, dirs, _ in os.walk(dest):
        if ".git" in dirs:
            return dirpath
    raise ValueError(f"{where}: {src} holds no git repository")


def load_swebench_instance(rec: dict, cache_dir: str, *, repo_root: str | None = None,
                           where: str = "instance") -> WorkspaceTask:
    for key in ("instance_id", "problem_statement", "base_commit", "test_patch"):
        if not isinstance(rec.get(key), str) or not rec[key]:
            raise ValueError(f"{where}: missing or empty string field {key!r}")
    iid = rec["instance_id"]
    where = f"{where} ({iid})"
    f2p, p2p = _node_ids(rec, "FAIL_TO_PASS", where), _node_ids(rec, "PASS_TO_PASS", where)
    if not f2p:
        raise ValueError(f"{where}: FAIL_TO_PASS is empty")
    src = _unpack(_repo_source(rec, repo_root, where), tempfile.mkdtemp(dir=cache_dir), where)
    checkout = os.path.join(cache_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", iid))
    shutil.rmtree(checkout, ignore_errors=True)
    _git(["clone", "-q", "--no-checkout", src, checkout], cache_dir, where)
    _git(["checkout", "-q", rec["base_commit"]], checkout, where)
    test_paths = sorted({b for _, b in _DIFF_RE.findall(rec["test_patch"])})
    if not test_paths:
        raise ValueError(f"{where}: test_patch has no 'diff --git' headers")
    _git(["apply", "--check", "-"], checkout, f"{where} test_patch", rec["test_patch"])
    scratch = tempfile.mkdtemp(dir=cache_dir)
    try:  # apply the test patch to a scratch copy only: the workspace never sees the hidden tests
        shutil.copytree(checkout, scratch, symlinks=True, dirs_exist_ok=True)
        _git(["apply", "-"], scratch, f"{where} test_patch", rec["test_patch"])
        test_files = {}
        for p in test_paths:
            full = os.path.join(scratch, p)
            if os.path.isfile(full):
                with open(full, encoding="utf-8") as f:
                    test_files[p] = f.read()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for dirpath, dirs, names in os.walk(checkout):
        dirs[:] = [d for d in dirs if d != ".git"]
        if "conftest.py" in names:
            rel = os.path.relpath(os.path.join(dirpath, "conftest.py"), checkout)
            with open(os.path.join(checkout, rel), encoding="utf-8") as f:
                test_files.setdefault(rel, f.read())
    solution: tuple = ()
    if rec.get("patch"):
        marker = "TSYNC_PATCH_EOF"
        solution = (("bash", {"command": f"git apply - <<'{marker}'\n{rec['patch']}{marker}\n"}), ("submit", {}))
    return WorkspaceTask(
        task_id=iid, instruction=rec["problem_statement"], copy_from=checkout, test_files=test_files,
        must_pass=(*f2p, *p2p), protected=tuple(test_paths), noconftest=False, solution=solution,
        need_strong=tuple(f2p),
        meta={"suite": "swe-bench", "repo": rec.get("repo", ""), "base_commit": rec["base_commit"],
              "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p})


def load_swebench_jsonl(path: str, cache_dir: str, *, repo_root: str | None = None,
                        limit: int | None = None) -> list[WorkspaceTask]:
    """Every instance of a SWE-bench-style JSONL file (see the module docstring); errors name file and line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object")
            out.append(load_swebench_instance(rec, cache_dir, repo_root=repo_root or os.path.dirname(path),
                                              where=f"{path}:{n}"))
            if limit is not None and len(out) >= limit:
                break
    return out


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read task.yaml: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping")
    return data


def load_terminal_bench_dir(task_dir: str) -> WorkspaceTask:
    """One Terminal-Bench-style task directory (see the module docstring)."""
    meta = _read_yaml(os.path.join(task_dir, "task.yaml"))
    instruction = meta.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise ValueError(f"{task_dir}/task.yaml: missing or empty 'instruction'")
    tests_dir = os.path.join(task_dir, "tests")
    if not os.path.isdir(tests_dir):
        raise ValueError(f"{task_dir}: no tests/ directory")
    test_files, test_modules = {}, []
    for dirpath, _, names in os.walk(tests_dir):
        for n in sorted(names):
            full = os.path.join(dirpath, n)
            rel = "tests/" + os.path.relpath(full, tests_dir)
            with open(full, "rb") as f:
                test_files[rel] = f.read()
            if n.startswith("test_") and n.endswith(".py"):
                test_modules.append(rel)
    if not test_modules:
        raise ValueError(f"{task_dir}/tests: no test_*.py file")
    files = {}
    ws_dir = os.path.join(task_dir, "workspace")
    setup = []
    if os.path.isfile(os.path.join(task_dir, "setup.sh")):
        with open(os.path.join(task_dir, "setup.sh"), encoding="utf-8") as f:
            setup.append(f.read())
    solution: tuple = ()
    if os.path.isfile(os.path.join(task_dir, "solution.sh")):
        with open(os.path.join(task_dir, "solution.sh"), encoding="utf-8") as f:
            solution = (("bash", {"command": f.read()}), ("submit", {}))
    return WorkspaceTask(
        task_id=os.path.basename(os.path.normpath(task_dir)), instruction=instruction, files=files,
        copy_from=ws_dir if os.path.isdir(ws_dir) else None, test_files=test_files,
        must_pass=tuple(sorted(test_modules)), need_strong=tuple(sorted(test_modules)),
        protected=("tests",), noconftest=not any(p.endswith("conftest.py") for p in test_files), setup=tuple(setup),
        solution=solution, meta={"suite": "terminal-bench", **{k: v for k, v in meta.items() if k != "instruction"}})
