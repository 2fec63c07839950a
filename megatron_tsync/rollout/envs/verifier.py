"""The hidden-test verifier: runs a task's tests on the final workspace where the agent cannot reach them.

After the episode (the agent's processes are all dead: every sandboxed call kills its pid namespace)::

    final workspace ──copy (regular files only; no symlinks, no conftest.py / pytest.ini / tox.ini / setup.cfg /
                     pyproject.toml / sitecustomize.py / usercustomize.py / *.pth / __pycache__ / .git, nothing under
                     the task's protected paths)──► fresh verifier dir V (a new private uid, never the agent's)
    task test files ──restored──► V (the task's own bytes: editing, deleting, renaming, shadowing them is moot)
    + a sentinel test (random name, always fails) + decoy tests when the task has them (see below)
    sandboxed call in V:  python -I -S -B  <bundle>/boot.py     (no site: no sitecustomize, .pth, user site)
        boot: sys.path = [pytest bundle] + stdlib ... + [V]   (V appended: a workspace json.py / xml/ / _pytest/
              cannot shadow the stdlib or pytest), then pytest.main with
              -c <bundle>/verifier.ini --rootdir V -p no:cacheprovider --import-mode=append
              --junitxml V/.tsync_<nonce>/report.xml -o junit_suite_name=<nonce>  (+ --noconftest) NODE_IDS
        env: PYTEST_DISABLE_PLUGIN_AUTOLOAD=1, PYTHONNOUSERSITE=1; wall / cpu / memory limits of the sandbox
    verdict (trusted process) from the junit XML + the runner's exit status, never from printed text:
        reward 1 iff the report exists (read with O_NOFOLLOW, regular file, size-capped), names the run's nonce,
        pytest exited 1 (some tests failed: the sentinel and decoys must), every must-pass test passed, every
        must-fail test (decoys, sentinel) failed; otherwise 0 with the reason.

Why decoys. The code under test runs inside the pytest process, so it can rewrite anything that process writes
(the report included) or patch pytest itself. A forced pass ("everything passes", a patched runner, a fake report
plus ``os._exit``) is caught by tests that must FAIL: the sentinel, and, for tasks that give expected values
(swe-lite, terminal-lite), decoys: each real check ``assert EXPR == expected`` is shuffled in with copies whose
expected value is wrong, under random names. To pass the real ones and fail the decoys a solution must tell them
apart, i.e. compute the right value: solve the task. For loaded tasks with arbitrary pytest files (SWE-bench style)
only the sentinel applies: it stops blanket forgeries, not a solution that targets this verifier's report by name.

Enforcement is the sandbox's (``Sandbox.enforcement()``): on the development VM (root, namespaces) the run has its
own uid, a read-only root with /tmp masked, no network, pid namespace, rlimits and a cgroup. Where the sandbox cannot
drop the uid or mount (an unprivileged CI runner), the copy rules, ``-I -S``, the restored tests, the sentinel, the
decoys and the report checks still hold, but the agent's code runs as the verifier's own user (not tested here).

The pytest bundle: pytest and its pure-Python dependencies are copied once per process from the trusted
interpreter's installation into a root-owned, read-only directory (the sandbox's python need not have pytest; the
rollout worker needs ``pip install pytest``). Standard library + rollout.sandbox only.
"""

from __future__ import annotations

import compileall
import importlib.metadata
import importlib.util
import os
import secrets
import shutil
import stat
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from megatron_tsync.rollout.envs.workspace_tools import hidden_mounts
from megatron_tsync.rollout.sandbox import Mount, Sandbox, SandboxConfig

__all__ = ["TestSpec", "Verdict", "HiddenTestVerifier", "DENY_NAMES"]

DENY_NAMES = frozenset({"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "sitecustomize.py",
                        "usercustomize.py", "__pycache__", ".git", ".pytest_cache", ".hg", ".svn"})
DENY_SUFFIXES = (".pth", ".pyc", ".pyo")
MAX_FILES = 5000
MAX_COPY_BYTES = 64 << 20
MAX_REPORT_BYTES = 16 << 20
BUNDLE_MOUNT = "/run/tsync_pytest_bundle"
"""Where the pytest bundle is bind-mounted (read-only) inside the verifier's sandbox (/run is masked there)."""
_BUNDLE_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py")
_OPTIONAL_PACKAGES = ("py", "pygments")

_BOOT_SRC = r'''
import sys
bundle, vdir = sys.argv[1], sys.argv[2]
sys.path.insert(0, bundle)
import pytest, _pytest.junitxml, _pytest.python, _pytest.runner, xml.etree.ElementTree  # before V is importable
sys.path.append(vdir)
sys.argv = ["pytest"] + sys.argv[3:]
sys.exit(int(pytest.main(sys.argv[1:])))
'''

_INI = """[pytest]
addopts =
python_files = test_*.py
python_classes = Test*
python_functions = test_*
junit_family = xunit2
junit_logging = no
"""


@dataclass(frozen=True)
class TestSpec:
    """What the verifier runs for a task."""

    test_files: Mapping[str, str | bytes]
    """Relative path -> content, restored into the verifier dir after the workspace copy (they win)."""
    must_pass: Sequence[str]
    """Node ids (``tests/test_a.py::test_x``) that must pass; a bare file path means every test in it (at least one)."""
    must_fail: Sequence[str] = ()
    """Node ids that must fail (decoys)."""
    protected: Sequence[str] = ()
    """Workspace paths (files or directories) never copied from the workspace (the task's tests)."""
    noconftest: bool = True
    """Run pytest with ``--noconftest`` (tasks whose restored tests need no conftest.py)."""
    copy_all: bool = True
    """Copy every allowed regular file of the workspace (False: only ``*.py``)."""
    __test__ = False  # not a pytest test class


@dataclass(frozen=True)
class Verdict:
    reward: float
    reason: str
    verify_s: float = 0.0
    outcomes: dict = field(default_factory=dict)
    """Node id -> "passed" / "failed" / "error" / "skipped" / "missing", for must-pass and must-fail tests."""
    exit_code: int | None = None


_bundle_lock = threading.Lock()
_bundle_dir: str | None = None


def pytest_bundle() -> str:
    """The root-owned, world-readable directory with pytest, its dependencies, boot.py and verifier.ini."""
    global _bundle_dir
    with _bundle_lock:
        if _bundle_dir is not None and os.path.isdir(_bundle_dir):
            return _bundle_dir
        if importlib.util.find_spec("pytest") is None:
            raise RuntimeError("the hidden-test verifier needs pytest in the rollout worker's Python "
                               "(pip install 'pytest>=8'); it is copied into the sandbox from there")
        d = tempfile.mkdtemp(prefix="tsync_pytest_bundle_")
        for name in _BUNDLE_PACKAGES:
            found = importlib.util.find_spec(name)
            if found is None or not found.origin:
                if name in _OPTIONAL_PACKAGES:
                    continue
                raise RuntimeError(f"the hidden-test verifier needs {name!r} (a pytest dependency)")
            if found.submodule_search_locations:
                src = list(found.submodule_search_locations)[0]
                shutil.copytree(src, os.path.join(d, name), ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(found.origin, os.path.join(d, os.path.basename(found.origin)))
        for dist in ("pytest", "pluggy", "iniconfig", "packaging", "pygments"):  # versions via importlib.metadata
            try:
                info = importlib.metadata.distribution(dist)._path  # a PathDistribution of an installed package
            except (importlib.metadata.PackageNotFoundError, AttributeError):
                continue
            shutil.copytree(info, os.path.join(d, os.path.basename(info)))
        with open(os.path.join(d, "boot.py"), "w") as f:
            f.write(_BOOT_SRC)
        with open(os.path.join(d, "verifier.ini"), "w") as f:
            f.write(_INI)
        # bytecode once, here: the sandbox runs pytest with -B from a read-only mount, so without it every
        # verification compiled pytest from source (0.38 → 0.15 s to import it on one core); a sandbox Python of
        # another version ignores these .pyc files
        compileall.compile_dir(d, quiet=1)
        for dirpath, dirs, names in os.walk(d):
            os.chmod(dirpath, 0o755)
            for n in names:
                os.chmod(os.path.join(dirpath, n), 0o644)
        _bundle_dir = d
        return d


def _denied(rel: str, protected: Sequence[str]) -> bool:
    parts = rel.split("/")
    if any(p in DENY_NAMES for p in parts) or rel.endswith(DENY_SUFFIXES):
        return True
    return any(rel == p.rstrip("/") or rel.startswith(p.rstrip("/") + "/") for p in protected)


def collect_workspace(src: str, spec: TestSpec) -> dict[str, tuple[bytes, bool]]:
    """The allowed regular files of `src` (see the module docstring): relative path -> (content, executable).

    Symlinks, devices, FIFOs and sockets are skipped; files are opened with O_NOFOLLOW. Raises ValueError past the
    limits.
    """
    out: dict[str, tuple[bytes, bool]] = {}
    total = 0
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(os.path.join(src, rel_dir) if rel_dir else src) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
            if _denied(rel, spec.protected):
                continue
            if e.is_dir(follow_symlinks=False):
                stack.append(rel)
                continue
            if not e.is_file(follow_symlinks=False) or (not spec.copy_all and not rel.endswith(".py")):
                continue
            fd = os.open(os.path.join(src, rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    continue
                total += st.st_size
                if total > MAX_COPY_BYTES or len(out) >= MAX_FILES:
                    raise ValueError(f"workspace exceeds the verifier's copy limits ({MAX_FILES} files, "
                                     f"{MAX_COPY_BYTES} bytes)")
                with os.fdopen(fd, "rb", closefd=False) as f:
                    out[rel] = (f.read(MAX_COPY_BYTES), bool(st.st_mode & 0o100))
            finally:
                os.close(fd)
    return out


def _nodeid_key(nodeid: str) -> tuple[str, str]:
    """``tests/test_a.py::TestC::test_x[1]`` -> (junit classname, name) = ("tests.test_a.TestC", "test_x[1]")."""
    path, _, rest = nodeid.partition("::")
    parts = rest.split("::")
    module = path[:-3] if path.endswith(".py") else path
    return ".".join([module.replace("/", "."), *parts[:-1]]), parts[-1]


def read_report(path: str, nonce: str) -> dict[tuple[str, str], str]:
    """(classname, name) -> outcome from a junit XML file; ValueError if it is not this run's report."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"no test report ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_REPORT_BYTES:
            raise ValueError("test report is not a regular file of bounded size")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_REPORT_BYTES + 1)
    finally:
        os.close(fd)
    try:
        root = ET.fromstring(data)
    except ET.ParseError as e:
        raise ValueError(f"test report is not valid XML ({e})") from None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if len(suites) != 1 or suites[0].get("name") != nonce:
        raise ValueError("test report does not belong to this verification run")
    out: dict[tuple[str, str], str] = {}
    for case in suites[0].iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        kinds = {child.tag for child in case}
        outcome = ("error" if "error" in kinds else "failed" if "failure" in kinds else
                   "skipped" if "skipped" in kinds else "passed")
        if key in out and out[key] != outcome:  # a test reported twice (setup passed, teardown failed): worst wins
            outcome = "error"
        out[key] = outcome
    return out


class HiddenTestVerifier:
    """Runs a :class:`TestSpec` on a final workspace (see the module docstring)."""

    def __init__(self, sandbox: Sandbox | None = None, config: SandboxConfig | None = None):
        self.sandbox = sandbox or Sandbox(config or SandboxConfig(
            wall_timeout_s=60.0, cpu_seconds=60, memory_bytes=2 << 30, max_output_bytes=4 << 20, max_processes=64))

    def verify(self, workspace_dir: str, spec: TestSpec) -> Verdict:
        """Verdict of `spec` on the final workspace `workspace_dir` (read, never written). Never raises for anything
        the workspace contains; raises RuntimeError if pytest is missing in this process."""
        t0 = time.monotonic()
        nonce = "tsync" + secrets.token_hex(8)
        bundle = pytest_bundle()
        try:
            copied = collect_workspace(workspace_dir, spec)
        except (ValueError, OSError) as e:
            return Verdict(0.0, f"workspace not verifiable: {e}", time.monotonic() - t0)
        sentinel = f"_tsync_sentinel_{nonce}/test_{nonce}.py"
        report_rel = f".tsync_{nonce}/report.xml"
        files = {rel: data for rel, (data, _) in copied.items()}
        files.update(spec.test_files)  # the task's own tests win over anything the workspace holds
        files[sentinel] = f"def test_{nonce}():\n    assert False, {nonce!r}\n"
        files[f".tsync_{nonce}/.keep"] = b""
        try:
            ws = self.sandbox.workspace()
        except Exception as e:  # noqa: BLE001 - no area / uid: a verifier failure, not the agent's
            return Verdict(0.0, f"verifier could not open a sandbox: {type(e).__name__}: {e}", time.monotonic() - t0)
        try:
            try:
                ws.write_files(files)
                for rel, (_, executable) in copied.items():
                    if executable and rel not in spec.test_files:
                        os.chmod(os.path.join(ws.path, rel), 0o755)
            except (OSError, ValueError) as e:
                return Verdict(0.0, f"workspace not verifiable: {e}", time.monotonic() - t0)
            # the bundle is bind-mounted read-only where the sandbox has a mount namespace (it masks /tmp); without
            # one the host path is visible as it is
            mounted = bool(self.sandbox._caps.get("ro_root"))
            where = BUNDLE_MOUNT if mounted else bundle
            args = ["-c", f"{where}/verifier.ini", "--rootdir", ws.path, "-p", "no:cacheprovider",
                    "--import-mode=append", "--junitxml", os.path.join(ws.path, report_rel),
                    "-o", f"junit_suite_name={nonce}", "-q", "--tb=line", "-rN"]
            if spec.noconftest:
                args.append("--noconftest")
            targets = sorted({n.partition("::")[0] for n in [*spec.must_pass, *spec.must_fail]} | {sentinel})
            res = ws.run([self.sandbox.python, "-I", "-S", "-B", f"{where}/boot.py", where, ws.path, *args, *targets],
                         env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONNOUSERSITE": "1"},
                         mounts={BUNDLE_MOUNT: Mount(bundle, read_only=True), **hidden_mounts(self.sandbox)}
                         if mounted else None)
            return self._judge(res, os.path.join(ws.path, report_rel), nonce, spec,
                               f"{sentinel}::test_{nonce}", t0)
        finally:
            ws.close()

    async def verify_async(self, workspace_dir: str, spec: TestSpec) -> Verdict:
        import asyncio

        from megatron_tsync.rollout.sandbox import _get_executor

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_get_executor(self.sandbox._max_workers), self.verify, workspace_dir, spec)

    @staticmethod
    def _judge(res, report: str, nonce: str, spec: TestSpec, sentinel: str, t0: float) -> Verdict:
        dt = lambda: time.monotonic() - t0  # noqa: E731
        if res.exit_code is None or res.exit_code < 0:
            return Verdict(0.0, f"test run failed: {res.error}", dt(), exit_code=res.exit_code)
        try:
            cases = read_report(report, nonce)
        except ValueError as e:
            return Verdict(0.0, f"{e} (pytest exit {res.exit_code})", dt(), exit_code=res.exit_code)
        outcomes: dict[str, str] = {}
        bad: list[str] = []
        for nodeid in spec.must_pass:
            if "::" in nodeid:
                got = cases.get(_nodeid_key(nodeid), "missing")
            else:  # a whole file: every test in it, at least one
                module = _nodeid_key(nodeid + "::x")[0]
                found = [o for (cls, _), o in cases.items() if cls == module or cls.startswith(module + ".")]
                got = "missing" if not found else "passed" if all(o == "passed" for o in found) else "failed"
            outcomes[nodeid] = got
            if got != "passed":
                bad.append(f"{nodeid} {got}")
        for nodeid in [*spec.must_fail, sentinel]:
            got = cases.get(_nodeid_key(nodeid), "missing")
            outcomes[nodeid] = got
            if got not in ("failed", "error"):
                bad.append(f"must-fail test {nodeid} {got}")
        if res.exit_code != 1:  # 1 = "some tests failed": the sentinel always does
            bad.insert(0, f"pytest exit status {res.exit_code}, expected 1")
        if bad:
            return Verdict(0.0, "; ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""), dt(),
                           outcomes, res.exit_code)
        return Verdict(1.0, f"{len(spec.must_pass)} must-pass passed, {len(spec.must_fail) + 1} must-fail failed",
                       dt(), outcomes, res.exit_code)
