"""The hidden-test verifier: runs a task's probes on the final workspace; a trusted process decides the reward.

After the episode (the agent's processes are all dead: every sandboxed call kills its pid namespace)::

    final workspace ──copy (regular files only; no symlinks, no conftest.py / pytest.ini / tox.ini / setup.cfg /
                     pyproject.toml / sitecustomize.py / usercustomize.py / *.pth / __pycache__ / .git, nothing under
                     the task's protected paths)──► fresh verifier dir V (a new private uid, never the agent's)
    task test files, rewritten to probes ──► V (``envs/probes.py``: every ``assert`` reports its operands' values;
                     literal expected operands are stripped; the task's own bytes win over the workspace's)
    sandboxed call in V:  python -I -S -B  <bundle>/boot.py     (no site: no sitecustomize, .pth, user site)
        boot: sys.path = [bundle] + stdlib ... + [V], the probe runtime installed, then pytest.main with
              -c <bundle>/verifier.ini --rootdir V -p no:cacheprovider --import-mode=append (+ --noconftest)
              and the test files; at the end the probe records are written to V/.tsync_<nonce>.json
        env: PYTEST_DISABLE_PLUGIN_AUTOLOAD=1, PYTHONNOUSERSITE=1; wall / cpu / memory limits of the sandbox
    verdict (trusted process, never the child's): the records file (O_NOFOLLOW, regular, size-capped) is parsed as
        data, bounded (only the expected probes' values are decoded; record counts capped; linear-time decoding:
        ``probes.parse_records``); every expected test must report exactly its expected probes and each value must hold (the expected
        values live only in this process). pytest's own outcomes, exit status and output are ignored.

The child runs the solution's code, so everything it reports is a claim: it can patch pytest or the probe, print,
write any file, exit early. None of that yields the expected values, which never enter the child (docs/
threat_model.md has what is and is not defended).

Enforcement is the sandbox's (``Sandbox.enforcement()``): on the development VM (root, namespaces) the run has its
own uid, a read-only root with /tmp masked, no network, pid namespace, rlimits and a cgroup. Where the sandbox cannot
drop the uid or mount (an unprivileged CI runner), the copy rules, ``-I -S`` and the split verdict still hold, but
the agent's code runs as the verifier's own user and could read the verifier process's memory (not defended).

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
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

from megatron_tsync.rollout.envs.probes import PROBE_RUNTIME, Expect, judge, parse_records, read_capped
from megatron_tsync.rollout.envs.workspace_tools import hidden_mounts
from megatron_tsync.rollout.sandbox import Mount, Sandbox, SandboxConfig

__all__ = ["TestSpec", "Verdict", "HiddenTestVerifier", "DENY_NAMES"]

DENY_NAMES = frozenset({"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "sitecustomize.py",
                        "usercustomize.py", "__pycache__", ".git", ".pytest_cache", ".hg", ".svn"})
DENY_SUFFIXES = (".pth", ".pyc", ".pyo")
MAX_FILES = 5000
MAX_COPY_BYTES = 64 << 20
BUNDLE_MOUNT = "/run/tsync_pytest_bundle"
"""Where the pytest bundle is bind-mounted (read-only) inside the verifier's sandbox (/run is masked there)."""
DEFAULT_CONFIG = SandboxConfig(wall_timeout_s=60.0, cpu_seconds=60, memory_bytes=2 << 30, max_output_bytes=4 << 20,
                               max_processes=64)
"""The verifier's sandbox by default: the solution's own time limit (60 s of CPU, 60 s wall) per verification."""
_BUNDLE_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py")
_OPTIONAL_PACKAGES = ("py", "pygments")

_BOOT_SRC = r'''
import sys
bundle, vdir, results = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, bundle)
import json, os, pytest, _pytest.python, _pytest.runner, tsync_probe  # before V is importable
sys.path.append(vdir)
sys.argv = ["pytest"] + sys.argv[4:]
pytest.main(sys.argv[1:])
data = json.dumps(tsync_probe.records).encode()
fd = os.open(results, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)  # a planted path: no report
os.write(fd, data)
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
    """Relative path -> content as the child gets it (probes, no expected values), restored over the workspace."""
    expected: Mapping[str, Sequence[Expect]]
    """Test id (``tests/test_a.py::test_x``) -> the probes it must report, in order (held by the trusted side)."""
    protected: Sequence[str] = ()
    """Workspace paths (files or directories) never copied from the workspace (the task's tests)."""
    noconftest: bool = True
    """Run pytest with ``--noconftest`` (tasks whose restored tests need no conftest.py)."""
    copy_all: bool = True
    """Copy every allowed regular file of the workspace (False: only ``*.py``)."""
    targets: Sequence[str] = ()
    """Test files to run (default: the files of ``expected``'s test ids)."""
    sites: Collection[str] = ()
    """Probe sites whose every value is decoded besides ``expected``'s (a reference run, whose expected values are
    being computed, names all sites of its rewrite); any other site's values are never parsed
    (``probes.parse_records``)."""
    __test__ = False  # not a pytest test class


@dataclass(frozen=True)
class Verdict:
    reward: float
    reason: str
    verify_s: float = 0.0
    outcomes: dict = field(default_factory=dict)
    """Test id -> "passed" / "failed" (its probes held or not)."""
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
        with open(os.path.join(d, "tsync_probe.py"), "w") as f:
            f.write(PROBE_RUNTIME)
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


class HiddenTestVerifier:
    """Runs a :class:`TestSpec` on a final workspace (see the module docstring)."""

    def __init__(self, sandbox: Sandbox | None = None, config: SandboxConfig | None = None):
        self.sandbox = sandbox or Sandbox(config or DEFAULT_CONFIG)

    def verify(self, workspace_dir: str, spec: TestSpec) -> Verdict:
        """Verdict of `spec` on the final workspace `workspace_dir` (read, never written). Never raises for anything
        the workspace contains; raises RuntimeError if pytest is missing in this process."""
        t0 = time.monotonic()
        records, why, code = self.probe(workspace_dir, spec)
        dt = time.monotonic() - t0
        if records is None:
            return Verdict(0.0, why, dt, exit_code=code)
        if not spec.expected:
            return Verdict(0.0, "task has no expected probes (unverifiable)", dt, exit_code=code)
        passed, bad = judge(records, spec.expected)
        outcomes = {**{t: "passed" for t in passed}, **{b.split(": ", 1)[0]: "failed" for b in bad}}
        if bad:
            return Verdict(0.0, "; ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""), dt,
                           outcomes, code)
        n = sum(len(v) for v in spec.expected.values())
        return Verdict(1.0, f"{len(passed)} tests, {n} probes held", dt, outcomes, code)

    def probe(self, workspace_dir: str, spec: TestSpec) -> tuple[dict | None, str, int | None]:
        """(records by test id, "", exit status) of the child run on a copy of `workspace_dir`, or (None, reason,
        exit status). The records are the child's claims, parsed as data (``probes.parse_records``)."""
        nonce = "tsync" + secrets.token_hex(8)
        bundle = pytest_bundle()
        try:
            copied = collect_workspace(workspace_dir, spec)
        except (ValueError, OSError) as e:
            return None, f"workspace not verifiable: {e}", None
        results_rel = f".tsync_{nonce}.json"
        files = {rel: data for rel, (data, _) in copied.items() if rel != results_rel}
        files.update(spec.test_files)  # the task's own tests win over anything the workspace holds
        try:
            ws = self.sandbox.workspace()
        except Exception as e:  # noqa: BLE001 - no area / uid: a verifier failure, not the agent's
            return None, f"verifier could not open a sandbox: {type(e).__name__}: {e}", None
        try:
            try:
                ws.write_files(files)
                for rel, (_, executable) in copied.items():
                    if executable and rel not in spec.test_files:
                        os.chmod(os.path.join(ws.path, rel), 0o755)
            except (OSError, ValueError) as e:
                return None, f"workspace not verifiable: {e}", None
            # the bundle is bind-mounted read-only where the sandbox has a mount namespace (it masks /tmp); without
            # one the host path is visible as it is
            mounted = bool(self.sandbox._caps.get("ro_root"))
            where = BUNDLE_MOUNT if mounted else bundle
            args = ["-c", f"{where}/verifier.ini", "--rootdir", ws.path, "-p", "no:cacheprovider",
                    "--import-mode=append", "-q", "--tb=no", "-rN"]
            if spec.noconftest:
                args.append("--noconftest")
            targets = list(spec.targets) or sorted({t.partition("::")[0] for t in spec.expected})
            results = os.path.join(ws.path, results_rel)
            res = ws.run([self.sandbox.python, "-I", "-S", "-B", f"{where}/boot.py", where, ws.path, results,
                          *args, *targets],
                         env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONNOUSERSITE": "1"},
                         mounts={BUNDLE_MOUNT: Mount(bundle, read_only=True), **hidden_mounts(self.sandbox)}
                         if mounted else None)
            if res.exit_code is None or res.exit_code < 0:
                return None, f"test run failed: {res.error}", res.exit_code
            try:
                return parse_records(read_capped(results), spec.expected, spec.sites), "", res.exit_code
            except ValueError as e:
                return None, f"{e} (exit {res.exit_code})", res.exit_code
        finally:
            ws.close()

    async def verify_async(self, workspace_dir: str, spec: TestSpec) -> Verdict:
        import asyncio

        from megatron_tsync.rollout.sandbox import _get_executor

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_get_executor(self.sandbox._max_workers), self.verify, workspace_dir, spec)
