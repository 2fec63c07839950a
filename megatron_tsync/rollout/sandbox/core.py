"""Sandboxed subprocess execution for agent tool calls and verifiers, and persistent per-trajectory workspaces.

Two ways to run a command, both never raising for a misbehaving command (the outcome, including timeouts, truncation,
quota and resource-limit kills, is reported in a :class:`ToolResult`):

- ``Sandbox.run(...)``: a stateless call. It gets a fresh scratch area (its cwd, removed afterwards).
- a :class:`Workspace`: a per-trajectory area that persists across the calls of one episode (an edit in turn 1 is
  visible in turn 3), owned by its own private uid, isolated from every other call and workspace, removed on close::

      with sandbox.workspace(files={"repo/a.py": "x = 1\\n"}, copy_from=None) as ws:   # or ws = ...; ws.close()
          ws.run(["sh", "-c", "sed -i s/1/2/ repo/a.py"])           # cwd = ws.path (same path inside and outside)
          r = ws.run(code="print(open('repo/a.py').read())")          # sees the edit
          ws.run(["python3", "-m", "pytest", "/run/tests"],           # extra mounts: target -> Mount(source, ro)
                 mounts={"/run/tests": Mount("/host/hidden_tests", read_only=True)})
          await ws.run_async(...); ws.write_files({...}); ws.read_file("repo/a.py"); ws.copy_in(src_dir, "repo")
      # closed: area unmounted and removed, uid slot returned (also at interpreter exit for a forgotten one)

  ``ws.path`` is the host path of the area (the host process may read and write it; files it writes through
  ``write_files``/``copy_in`` are chowned to ``ws.uid``). Only files persist: every process of a call dies with the
  call. Mount targets must exist, or lie under a masked dir (/tmp, /run, ...) or inside the workspace (created then;
  inside the workspace the empty mount point stays). ``Sandbox.run`` takes ``mounts=`` too.

How a call is isolated (each mechanism is probed once per process; :meth:`Sandbox.enforcement` reports the outcome)::

    parent (rollout worker thread): area = tmpfs(size=disk_bytes, nr_inodes=max_files, uid=<call uid>, mode 0700)
                                    cgroup = mtsb_<pid>_<n> (memory.limit = total_memory_bytes, pids.max)
      └─ launcher (root), new session + process group; moved into the cgroup by the parent before it forks
                   anything. Forked by the sandbox's fork server (one warm interpreter per Sandbox, started on first
                   use: :mod:`.forkserver`; the default) or, with ``SandboxConfig(launcher="exec")``, a fresh
                   `python -I -S -c LAUNCHER_SRC spec` per call: the same launcher code either way
           unshare(NEWNET | NEWNS | NEWPID | NEWIPC | NEWUTS)      network: empty netns, loopback down
           mount: / rprivate; a fresh tmpfs root holding only an ALLOW-LIST of host paths bound read-only at their
                  own paths (:mod:`.rootfs`: /usr and the merged-/usr links, a few /etc files, /dev/null & co, the
                  interpreter's prefixes and site-packages with the project's own package / dist-info / editable
                  .pth hidden), empty read-only /tmp, /var/tmp, /run, /dev/shm, the area rw at its own path, extra
                  mounts; then pivot_root into it and the host's root detached: no checkout, .git, /root, /home,
                  /work, /opt, /var of the host exists inside. Fallback where that fails (reported): every host mount
                  read-only, an empty read-only tmpfs over /tmp, /var/tmp, /run, /dev/shm and the scratch root,
                  /dev/null bound over every other host unix socket listed in /proc/net/unix
           └─ init (pid 1 of the new pid ns, PDEATHSIG=SIGKILL): mounts a fresh /proc, reaps, reports status
                └─ target: rlimits (AS, DATA, CPU, FSIZE, NPROC, NOFILE, CORE=0), setgroups([]), setgid/setuid to
                   a private unprivileged uid, PR_SET_NO_NEW_PRIVS, optional real sleep (delay_s), execve(argv);
                   for ``run_source`` (trusted tool code, e.g. the calculator) on the fork server: runs the source
                   itself instead of execve'ing a second interpreter

- wall timeout: the parent SIGKILLs the launcher's process group and every task of the call's cgroup; init dies with
  it and the kernel then kills every process left in the pid namespace (also ones that called setsid). Without a pid
  namespace the parent kills the process group, the cgroup's tasks and every process owned by the call's uid.
- output: stdout/stderr are read incrementally (64 KiB chunks) and capped at ``max_output_bytes`` per stream; the
  whole tree is killed as soon as a stream exceeds the cap, so a 100 MB print costs ~cap bytes of parent memory.
- processes: ``max_processes`` is RLIMIT_NPROC of the call's private uid (``2_000_000_000 + (pid % 100_000) *
  1000 + slot``; RLIMIT_NPROC is not enforced for root, hence a uid per call/workspace; tasks = processes and
  threads). With cgroup v2, and with v1 where no private uid is available, also the ``pids.max`` of the whole call
  (+2 for launcher and init); v1 skips the pids cgroup otherwise (joining one costs an RCU grace period per call).
- memory: RLIMIT_AS = RLIMIT_DATA = ``memory_bytes`` per process, and with a cgroup ``total_memory_bytes`` for the
  whole tree (the kernel OOM-kills inside the call at the limit; tmpfs pages the call writes count too). cgroup v2 is
  used where this process's cgroup has memory+pids delegated, else the v1 memory+pids hierarchies (see
  :mod:`.cgroup`). Without a cgroup, the init of the call's pid namespace sums the RSS of every process in it
  every 50 ms and kills them all above ``total_memory_bytes`` (shared pages counted once per process; a burst
  between two polls can go beyond, up to the hard bound ``memory_bytes * max_processes``); without a pid namespace
  either, that hard bound is all.
- files: a call sees the allow-list root above (:mod:`.rootfs`), so the generators' source, other checkouts and
  their ``.git`` do not exist for it; ``Sandbox.python`` is this process's own interpreter (a venv: its
  site-packages, so ``python -I -c "import pytest, reasoning_gym"`` works inside, ``import megatron_tsync`` not).
  Per call this costs ~35 bind mounts and a pivot_root: ``/bin/true`` on the fork server, CPU of the whole tree per
  call (median of 150, alternating call by call in one process, 2 cores shared at load 20-30): 11.6 ms with the
  read-only host root (before), 12.5 ms with the allow-list root and the same system python, 13.2 ms with the
  allow-list root and the venv's python (now the default); wall medians 89 / 93 / 92 ms, within that load's noise.
- disk: as root each area is its own tmpfs: ``disk_bytes`` and ``max_files`` (inodes, directories included) give
  ENOSPC inside the call, nothing reaches the host disk; RLIMIT_FSIZE caps one file. Writes outside the area fail with
  EROFS (read-only mounts) and EACCES (unprivileged uid).
- cleanup: an area is removed by ``umount2(MNT_DETACH)`` + ``rmdir`` (no tree walk; without tmpfs an iterative walk,
  :func:`.fs.remove_tree`), the cgroup is emptied and removed, and the uid slot is returned in a ``finally``
  of its own: nothing of a call is left behind however it ended. A failed removal is retried after later calls, and
  areas of dead owner pids are swept at start-up.
- when not root: a user namespace is tried first to obtain the other namespaces; the uid cannot be dropped, no tmpfs
  quota and no cgroup (reported as not enforced).

Measured on the development VM (Debian 12, root, kernel 6.18, cgroup v1 memory/pids + an empty v2 hierarchy): every
item above is enforced with the cgroup v1 backend. Per-call overhead (``/bin/true``, median, interleaved with the
pre-hardening sandbox in one process, load ~3 on 2 cores): 21.7 ms before, 24.7 ms now (a cgroup migration waits an
RCU grace period, ~10 ms here: the parent does it while the launcher starts, so it mostly overlaps). The quickstart's
calculator call, CPU of the whole tree (``tools/bench_tool_calls.py``, 2 cores, load ~2-3): 42 ms with the exec
launcher (two interpreter start-ups), ~9 ms with the fork server (default); wall ~28 ms, most of it the cgroup move. At its memory
limit a v1 tree may thrash (page cache re-faults) for seconds before the OOM kill. Run ``python -c "from megatron_tsync.rollout.sandbox import
Sandbox; print(Sandbox().enforcement())"`` on a new machine.

This module and the rest of the package (``rollout/sandbox/``) import only the standard library (no torch, no megatron).
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import megatron_tsync.rollout.sandbox.cgroup as sandbox_cgroup
import megatron_tsync.rollout.sandbox.fs as sandbox_fs
from megatron_tsync.rollout.sandbox.caps import UID_BASE as _UID_BASE
from megatron_tsync.rollout.sandbox.caps import UID_SLOTS as _UID_SLOTS
from megatron_tsync.rollout.sandbox.caps import default_scratch_root, detect_capabilities, encode_spec, parse_status
from megatron_tsync.rollout.sandbox.forkserver import ForkServer
from megatron_tsync.rollout.sandbox.io import Pump, write_files
from megatron_tsync.rollout.sandbox.launcher import LAUNCHER_SRC

__all__ = ["SandboxConfig", "ToolResult", "Mount", "Sandbox", "Workspace", "detect_capabilities"]

_MAX_SPEC_BYTES = 120_000  # one execve argument may be at most 128 KiB (MAX_ARG_STRLEN); the spec is hex-encoded
_INLINE_CODE_BYTES = 20_000  # larger code is written to a file instead of passed with -c
_MEMORY_POLL_S = 0.05  # without a cgroup: how often the pid namespace's init sums the RSS of the call's processes
_MEMORY_PATTERNS = re.compile(
    rb"MemoryError|Cannot allocate memory|cannot allocate memory|out of memory|std::bad_alloc|xmalloc"
)
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()
_executor_lock = threading.Lock()
_executor = None
_open_workspaces: set["Workspace"] = set()
_ws_counter = itertools.count()
LAUNCHERS = ("fork-server", "exec")


class _SourceArgv(list):
    """argv ``[python, -I, -S, -c, source]`` of :meth:`CallRunner.run_source`; a backend that knows it (the fork
    server) runs ``source`` in the isolated target itself, any other runs the argv."""

    source: str = ""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed call (all enforced per call, see the module docstring)."""

    wall_timeout_s: float = 10.0
    """Wall-clock limit of the call, including any injected delay; the whole process tree is killed at this time."""
    cpu_seconds: int = 10
    """RLIMIT_CPU of each process (SIGXCPU at the limit, SIGKILL one second later)."""
    memory_bytes: int = 1 << 30
    """RLIMIT_AS and RLIMIT_DATA of each process."""
    max_output_bytes: int = 65536
    """Cap of stdout and of stderr each; the tree is killed once a stream exceeds it."""
    max_processes: int = 64
    """Processes and threads alive at once in the call: RLIMIT_NPROC of its private uid and the cgroup's pids.max."""
    network: bool = False
    """Allow network access (no network namespace) when True."""
    scratch_root: str | None = None
    """Parent directory of the per-call scratch areas and workspaces; default ``$TMPDIR/megatron_tsync_sandbox``."""
    max_file_bytes: int = 64 << 20
    """RLIMIT_FSIZE: the largest file a process may write."""
    max_open_files: int = 256
    """RLIMIT_NOFILE."""
    total_memory_bytes: int = 2 << 30
    """Memory of the whole call (every process, and the tmpfs pages it writes): the cgroup's memory limit."""
    disk_bytes: int = 256 << 20
    """Size of a scratch area or workspace (its tmpfs): writes beyond fail with ENOSPC."""
    max_files: int = 20_000
    """Inodes (files, directories, links) of a scratch area or workspace: beyond, creating one fails with ENOSPC."""
    use_cgroups: bool = True
    """Put every call in its own cgroup when the machine allows (False: per-process rlimits only)."""
    launcher: str = "fork-server"
    """How each call's launcher starts: ``fork-server`` (forked by one warm interpreter per sandbox, and
    :meth:`CallRunner.run_source` runs in the isolated target itself: ~4x less CPU per calculator call) or ``exec``
    (a fresh ``python -I -S`` per call, and ``run_source`` a second one inside). Same isolation either way."""
    preload: tuple[str, ...] = ()
    """Modules the fork server imports once when it starts (trusted third-party code, e.g. ``("reasoning_gym",)``):
    every :meth:`CallRunner.run_source` target then finds them imported (a fork, not a 1.5 s import per call). The
    server then runs :attr:`Sandbox.preload_python` (the caller's interpreter, with its site-packages). Needs the
    fork-server launcher; the exec launcher refuses it."""


@dataclass(frozen=True)
class ToolResult:
    """Outcome of one sandboxed call. ``ok`` is True iff the command exited 0 and no limit was hit."""

    ok: bool
    stdout: str
    stderr: str
    exit_code: int | None
    """Exit status; ``-N`` when killed by signal N; None when the status is unknown (killed by the sandbox)."""
    error: str | None
    """Human-readable reason when not ok, e.g. ``timeout after 2.0s`` or ``output truncated at 65536 bytes``."""
    wall_s: float
    truncated: bool = False


@dataclass(frozen=True)
class Mount:
    """An extra bind mount of a host path into a call (``mounts={target: Mount(source, read_only)}``)."""

    source: str
    read_only: bool = True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_uid(uid: int) -> None:
    """SIGKILL every process whose real uid is `uid` (fallback when there is no pid namespace)."""
    for _ in range(3):  # a forking process may create new ones while we sweep
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            if int(line.split()[1]) == uid:
                                os.kill(int(entry), signal.SIGKILL)
                                found = True
                            break
            except (OSError, ValueError):
                continue
        if not found:
            return


def _live_uid(uid: int) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    if any(line.startswith("Uid:") and int(line.split()[1]) == uid for line in f):
                        return True
            except (OSError, ValueError):
                continue
    return False


def uids_in_use() -> set[int]:
    """The uid slots held right now by calls and open workspaces of this process (for tests and leak checks)."""
    with _uid_lock:
        return set(_uids_in_use)


class CallRunner:
    """Stateless calls, ``run_async`` and workspaces on top of a backend's hooks (``_acquire_uid``, ``_new_area``,
    ``_run_in``, ``_release_uid``; ``scratch_root``, ``config``, ``_max_workers``): the namespace :class:`Sandbox`
    and ``container.ContainerSandbox`` share them."""

    # ------------------------------------------------------------------------------------------------ running
    def run(
        self,
        argv: Sequence[str] | str | None = None,
        *,
        code: str | None = None,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        delay_s: float = 0.0,
        env: Mapping[str, str] | None = None,
        mounts: Mapping[str, Mount] | None = None,
    ) -> ToolResult:
        """Run `argv` (a list, or a string for ``/bin/sh -c``) or Python `code` in a fresh call with a fresh scratch
        workspace. Never raises.

        `files` are written into the scratch area first (relative paths); `delay_s` is a real sleep inside the
        sandboxed child before the command starts (it counts towards the wall timeout); `mounts` bind extra host
        paths (``{target: Mount(source, read_only=True)}``).
        """
        t0 = time.monotonic()
        uid = area = None
        try:
            uid = self._acquire_uid()
            area = self._new_area("call", uid, self.config.disk_bytes, self.config.max_files)
            return self._run_in(area, uid, argv, code, stdin, files, delay_s, env, mounts, t0)
        except Exception as e:  # never let a tool take down the worker
            return ToolResult(False, "", "", None, f"sandbox internal error: {type(e).__name__}: {e}",
                              time.monotonic() - t0)
        finally:
            try:
                if area is not None:
                    sandbox_fs.remove_area(area)
                sandbox_fs.retry_leftovers()
            finally:
                self._release_uid(uid)

    async def run_async(self, argv: Sequence[str] | str | None = None, **kwargs: Any) -> ToolResult:
        """:meth:`run` on a shared thread pool, for asyncio rollout loops."""
        return await _in_pool(self._max_workers, self.run, argv, **kwargs)

    def run_source(self, source: str, **kwargs: Any) -> ToolResult:
        """:meth:`run` of TRUSTED, standard-library-only Python `source` (a tool's own implementation; untrusted
        input goes in through ``stdin=``/``files=``), as ``python -I -S -c source``. With the fork-server launcher
        the call's target process runs it itself after the same isolation (no second interpreter); untrusted code
        belongs in ``code=``, which is always a fresh interpreter."""
        argv = _SourceArgv([self.python, "-I", "-S", "-c", source])
        argv.source = source
        return self.run(argv, **kwargs)

    def workspace(self, files: Mapping[str, str | bytes] | None = None, copy_from: str | None = None, *,
                  disk_bytes: int | None = None, max_files: int | None = None) -> "Workspace":
        """A new persistent workspace (use as a context manager or call ``close()``); see :class:`Workspace`."""
        return Workspace(self, files=files, copy_from=copy_from, disk_bytes=disk_bytes, max_files=max_files)



class Sandbox(CallRunner):
    """Runs commands in isolated, resource-limited subprocesses. Thread-safe; see the module docstring."""

    def __init__(self, config: SandboxConfig | None = None, *, max_workers: int = 16):
        self.config = config or SandboxConfig()
        self.scratch_root = os.path.abspath(self.config.scratch_root or default_scratch_root())
        self._caps = detect_capabilities(self.scratch_root)
        self._cgroups, self._cgroup_note = sandbox_cgroup.detect(disabled=not self.config.use_cgroups)
        self._max_workers = max_workers
        self.python: str = self._caps["python"] or sys.executable
        """Interpreter to use for Python code inside the sandbox (executable by the sandbox uid): this process's own
        (a venv's path, so ``python -I`` imports its site-packages; ``-S`` and ``run_source`` see the stdlib only)
        where the allow-list root holds, else a system one."""
        if self.config.launcher not in LAUNCHERS:
            raise ValueError(f"SandboxConfig.launcher must be one of {LAUNCHERS}, got {self.config.launcher!r}")
        if self.config.preload and self.config.launcher != "fork-server":
            raise ValueError("SandboxConfig.preload needs launcher='fork-server' (the exec launcher has no warm "
                             "interpreter to import into)")
        self.preload_python: str = sys.executable
        """The fork server's interpreter when ``preload`` is set: this process's own (a venv's ``python`` finds its
        site-packages; the resolved :attr:`python` may be the bare base interpreter)."""
        self._server: ForkServer | None = None
        self._server_lock = threading.Lock()

    def _fork_server(self) -> ForkServer:
        """This sandbox's fork server, started on first use (and again in a forked child or after it died)."""
        with self._server_lock:
            if self._server is None or not self._server.alive():
                preload = tuple(self.config.preload)  # with modules to preload: this interpreter, its site-packages
                python = self.preload_python if preload else self.python  # else the one the exec path runs sources with
                self._server = ForkServer(python, preload)
                weakref.finalize(self, self._server.close)
            return self._server

    def fork_server_cpu_s(self) -> float:
        """CPU seconds (user + sys) of the fork server and of every call tree it reaped (0 before the first call):
        what ``RUSAGE_CHILDREN`` of this process misses on the fork-server launcher (for benchmarks)."""
        return self._server.cpu_s if self._server is not None else 0.0

    def close(self) -> None:
        """Stop the fork server (a later call starts a new one); open workspaces stay usable."""
        with self._server_lock:
            server, self._server = self._server, None
        if server is not None:
            server.close()

    # ------------------------------------------------------------------------------------------------ reporting
    def enforcement(self) -> dict[str, dict[str, Any]]:
        """What is and is not enforced for this config on this machine: ``{name: {"enforced": bool, "how": str}}``."""
        from megatron_tsync.rollout.sandbox.report import enforcement

        return enforcement(self)

    def _new_area(self, kind: str, uid: int | None, disk_bytes: int, max_files: int) -> str:
        return sandbox_fs.create_area(self.scratch_root, kind, uid, disk_bytes, max_files, self._caps["tmpfs"])

    def _argv(self, argv: Sequence[str] | str | None, code: str | None, code_file: str) -> list[str]:
        if isinstance(argv, _SourceArgv):
            return argv
        if code is not None:
            inline = len(code.encode()) < _INLINE_CODE_BYTES
            return [self.python, "-I", "-c", code] if inline else [self.python, "-I", code_file]
        if isinstance(argv, str):
            return ["/bin/sh", "-c", argv]
        if not argv:
            raise ValueError("Sandbox.run needs argv or code")
        argv = [str(a) for a in argv]
        if "/" not in argv[0]:
            resolved = shutil.which(argv[0], path="/usr/local/bin:/usr/bin:/bin")
            if resolved is None:
                raise FileNotFoundError(f"command not found: {argv[0]}")
            argv[0] = resolved
        return argv

    def _spec(self, argv: list[str], area: str, uid: int | None, delay_s: float,
              env: Mapping[str, str] | None, mounts: Mapping[str, Mount] | None) -> dict:
        cfg, caps = self.config, self._caps
        ns = dict(caps["ns"])
        if cfg.network:
            ns.pop("net", None)
        base_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": area, "TMPDIR": area, "LANG": "C.UTF-8",
                    "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
        base_env.update(env or {})
        cpu = max(1, int(cfg.cpu_seconds))
        extra = []
        for tgt, m in (mounts or {}).items():
            if not isinstance(m, Mount) or not os.path.isabs(tgt):
                raise ValueError(f"mounts: want {{absolute target: Mount(source, read_only)}}, got {tgt!r}: {m!r}")
            if not os.path.exists(m.source):
                raise ValueError(f"mounts: source {m.source!r} (for {tgt!r}) does not exist")
            if not caps["ro_root"]:
                raise ValueError("mounts need a mount namespace, unavailable on this machine")
            extra.append([os.path.normpath(tgt), os.path.abspath(m.source), bool(m.read_only)])
        source = argv.source if isinstance(argv, _SourceArgv) and cfg.launcher == "fork-server" else None
        return {
            "argv": list(argv), "source": source, "env": base_env, "ns": ns, "ro_root": caps["ro_root"], "ro_strict": True,
            "masks": caps["masks"], "hide_sockets": bool(caps["masks"]), "mounts": extra,
            "rootfs": caps.get("rootfs"),
            "uid": uid, "gid": uid, "delay_s": max(0.0, float(delay_s)),
            "rlimits": {
                "RLIMIT_AS": [cfg.memory_bytes, cfg.memory_bytes],
                "RLIMIT_DATA": [cfg.memory_bytes, cfg.memory_bytes],
                "RLIMIT_CPU": [cpu, cpu + 1],
                "RLIMIT_FSIZE": [cfg.max_file_bytes, cfg.max_file_bytes],
                "RLIMIT_NOFILE": [cfg.max_open_files, cfg.max_open_files],
                "RLIMIT_CORE": [0, 0],
                **({"RLIMIT_NPROC": [cfg.max_processes, cfg.max_processes]} if uid is not None else {}),
            },
        }

    def _acquire_uid(self) -> int | None:
        if not self._caps["uid_drop"]:
            return None
        base = _UID_BASE + (os.getpid() % 100_000) * _UID_SLOTS
        with _uid_lock:
            for slot in range(_UID_SLOTS - 1):  # the last slot is the probe's
                if base + slot not in _uids_in_use:
                    _uids_in_use.add(base + slot)
                    return base + slot
        raise RuntimeError(f"more than {_UID_SLOTS - 1} concurrent sandboxes and workspaces")

    def _release_uid(self, uid: int | None) -> None:
        if uid is not None:
            if not self._caps["ns"].get("pid") and _live_uid(uid):  # with a pid namespace none can be left
                _kill_uid(uid)
            with _uid_lock:
                _uids_in_use.discard(uid)

    def _run_in(self, area, uid, argv, code, stdin, files, delay_s, env, mounts, t0) -> ToolResult:
        files = dict(files or {})
        code_file = f".sandbox_main_{next(_ws_counter)}.py"
        if code is not None and len(code.encode()) >= _INLINE_CODE_BYTES:
            files[code_file] = code
        try:
            try:
                write_files(area, files, uid)
                cmd = self._argv(argv, code, code_file)
                spec = self._spec(cmd, area, uid, delay_s, env, mounts)
            except (ValueError, FileNotFoundError) as e:
                return ToolResult(False, "", "", None, str(e), time.monotonic() - t0)
            except OSError as e:
                return ToolResult(False, "", "", None, f"cannot write files into the sandbox: {e}",
                                  time.monotonic() - t0)
            return self._execute(spec, area, uid, stdin, t0)
        finally:
            if code_file in files:
                try:
                    os.unlink(os.path.join(area, code_file))
                except OSError:
                    pass

    def _execute(self, spec: dict, area: str, uid: int | None, stdin: str | bytes | None, t0: float) -> ToolResult:
        cfg = self.config
        cg = None
        go_r = go_w = None
        if self._cgroups is not None:
            cg = self._cgroups.create(cfg.total_memory_bytes, cfg.max_processes + 2, v1_pids=uid is None)
            go_r, go_w = os.pipe()  # the launcher forks nothing before we moved it into the cgroup (see _admit)
            spec["go_fd"] = go_r
        elif self._caps["ns"].get("pid") and self._caps["ns"].get("mnt"):
            spec["poll_memory"] = [cfg.total_memory_bytes, _MEMORY_POLL_S]
        status_r, status_w = os.pipe()
        spec["status_fd"] = status_w
        blob = encode_spec(spec)
        try:
            if len(blob) > _MAX_SPEC_BYTES:
                _close(status_r, status_w, go_r, go_w)
                return ToolResult(False, "", "", None, "command too long (pass large inputs via files= or stdin=)",
                                  time.monotonic() - t0)
            try:
                if cfg.launcher == "fork-server":
                    proc = self._fork_server().spawn(spec, area, stdin=stdin is not None, status_fd=status_w,
                                                     go_fd=go_r)
                else:
                    proc = subprocess.Popen(
                        [sys.executable, "-I", "-S", "-c", LAUNCHER_SRC, blob], cwd=area,
                        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, pass_fds=(status_w,) if go_r is None else (status_w, go_r),
                        start_new_session=True,
                    )
            except BaseException:
                _close(status_r, go_w)
                raise
            finally:
                _close(status_w, go_r)
            if cg is not None:
                _admit(cg, proc.pid, go_w)
            data = stdin.encode() if isinstance(stdin, str) else stdin
            io = Pump(proc, data, cfg.max_output_bytes, t0 + cfg.wall_timeout_s)
            try:
                io.loop(lambda: self._cleanup(proc.pid, uid, cg))
            finally:
                self._cleanup(proc.pid, uid, cg)
                proc.wait()
                for f in (proc.stdout, proc.stderr, proc.stdin):
                    if f is not None:
                        f.close()
                with os.fdopen(status_r, "rb") as f:
                    raw = f.read()
            oom = cg.oom_kills() if cg is not None else 0
        finally:
            if cg is not None:
                cg.remove()
        return self._result(io, parse_status(raw), proc.returncode, time.monotonic() - t0, oom)

    def _cleanup(self, pgid: int, uid: int | None, cg: sandbox_cgroup.CallCgroup | None) -> None:
        _kill_group(pgid)
        if cg is not None:
            cg.kill()
        if uid is not None and not self._caps["ns"].get("pid"):
            _kill_uid(uid)

    def _result(self, io: Pump, st: dict, rc: int | None, wall: float, oom: int) -> ToolResult:
        cfg = self.config
        out, err = bytes(io.out), bytes(io.err)
        exit_code: int | None = st.get("exit")
        if "signal" in st:
            exit_code = -int(st["signal"])
        error: str | None = None
        if oom:  # first: a tree thrashing at its memory limit may also run into the wall timeout
            error = f"memory limit of the call ({cfg.total_memory_bytes} bytes in total: {oom} process(es) OOM-killed)"
            exit_code = None if io.timed_out else exit_code
        elif io.timed_out:
            error, exit_code = f"timeout after {cfg.wall_timeout_s:.1f}s", None
        elif io.truncated:
            error, exit_code = f"output truncated at {cfg.max_output_bytes} bytes", None
        elif "setup_error" in st:
            error = f"sandbox setup failed: {st['setup_error']}"
        elif exit_code is None:
            error = f"sandbox launcher exited with status {rc}"
        elif "memory_total" in st:
            error = (f"memory limit of the call ({cfg.total_memory_bytes} bytes in total: the tree's RSS reached "
                     f"{st['memory_total']}, all killed)")
        elif exit_code != 0 and _MEMORY_PATTERNS.search(err[-4096:]):
            error = f"memory limit ({cfg.memory_bytes} bytes per process)"
        elif exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and st.get("cpu_s", 0) >= cfg.cpu_seconds):
            error = f"cpu time limit exceeded ({cfg.cpu_seconds}s)"
        elif exit_code == -signal.SIGXFSZ:
            error = f"file size limit exceeded ({cfg.max_file_bytes} bytes)"
        elif exit_code < 0:
            error = f"killed by signal {-exit_code} ({signal.Signals(-exit_code).name})"
        elif exit_code != 0:
            error = f"exit code {exit_code}"
        return ToolResult(
            ok=error is None, stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
            exit_code=exit_code, error=error, wall_s=wall, truncated=io.truncated,
        )


def _close(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)


def _admit(cg: sandbox_cgroup.CallCgroup, pid: int, go_w: int) -> None:
    """Move the launcher into the call's cgroup, then let it go on. Done here, while the launcher's interpreter starts,
    rather than by the launcher itself: a cgroup migration waits an RCU grace period (~10 ms measured here), which
    then overlaps the start-up. On failure the launcher reads EOF and stops with a setup error."""
    try:
        cg.add(pid)
        os.write(go_w, b"1")
    except OSError:
        pass
    finally:
        os.close(go_w)


class Workspace:
    """A per-trajectory area that persists across calls; see the module docstring. Thread-safe; close() idempotent."""

    def __init__(self, sandbox: Sandbox, *, files: Mapping[str, str | bytes] | None = None,
                 copy_from: str | None = None, disk_bytes: int | None = None, max_files: int | None = None):
        self.sandbox = sandbox
        cfg = sandbox.config
        self.disk_bytes = cfg.disk_bytes if disk_bytes is None else int(disk_bytes)
        self.max_files = cfg.max_files if max_files is None else int(max_files)
        self._lock = threading.Lock()
        self._owner_pid = os.getpid()  # a forked child must not remove its parent's workspaces at its exit
        self.closed = False
        self.uid: int | None = sandbox._acquire_uid()
        """The private uid every call of this workspace runs as (None where uids cannot be dropped)."""
        try:
            self.path: str = sandbox._new_area("ws", self.uid, self.disk_bytes, self.max_files)
            """Host path of the workspace; also the cwd (same path) of its calls."""
        except BaseException:
            sandbox._release_uid(self.uid)
            raise
        with _uid_lock:
            _open_workspaces.add(self)
        try:
            if copy_from is not None:
                self.copy_in(copy_from)
            if files:
                self.write_files(files)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Workspace({self.path!r}, uid={self.uid}, {'closed' if self.closed else 'open'})"

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"workspace {self.path} is closed")

    def run(
        self,
        argv: Sequence[str] | str | None = None,
        *,
        code: str | None = None,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        delay_s: float = 0.0,
        env: Mapping[str, str] | None = None,
        mounts: Mapping[str, Mount] | None = None,
    ) -> ToolResult:
        """:meth:`Sandbox.run` with this workspace as the cwd; `files` are written into the workspace (and persist).
        Never raises."""
        t0 = time.monotonic()
        if self.closed:
            return ToolResult(False, "", "", None, f"workspace {self.path} is closed", 0.0)
        try:
            return self.sandbox._run_in(self.path, self.uid, argv, code, stdin, files, delay_s, env, mounts, t0)
        except Exception as e:  # never let a tool take down the worker
            return ToolResult(False, "", "", None, f"sandbox internal error: {type(e).__name__}: {e}",
                              time.monotonic() - t0)

    async def run_async(self, argv: Sequence[str] | str | None = None, **kwargs: Any) -> ToolResult:
        """:meth:`run` on the sandbox's thread pool."""
        return await _in_pool(self.sandbox._max_workers, self.run, argv, **kwargs)

    def write_files(self, files: Mapping[str, str | bytes]) -> None:
        """Write files (relative paths) into the workspace, owned by its uid. Raises OSError (ENOSPC over quota)."""
        self._check_open()
        write_files(self.path, files, self.uid)

    def read_file(self, rel: str) -> bytes:
        """Bytes of a workspace file (no symlink leaving the workspace is followed). Raises OSError/ValueError."""
        self._check_open()
        path = os.path.realpath(os.path.join(self.path, rel))
        if not path.startswith(self.path + os.sep):
            raise ValueError(f"path escapes the workspace: {rel!r}")
        with open(path, "rb") as f:
            return f.read()

    def copy_in(self, src: str, dest: str = "") -> None:
        """Copy the directory tree `src` (symlinks as links) into the workspace at `dest`, owned by its uid."""
        self._check_open()
        target = os.path.normpath(os.path.join(self.path, dest))
        if target != self.path and not target.startswith(self.path + os.sep):
            raise ValueError(f"copy_in destination escapes the workspace: {dest!r}")
        shutil.copytree(src, target, symlinks=True, dirs_exist_ok=True)
        if self.uid is not None:
            for dirpath, dirnames, names in os.walk(target):
                os.lchown(dirpath, self.uid, self.uid)
                for n in names + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                    os.lchown(os.path.join(dirpath, n), self.uid, self.uid)

    def close(self) -> None:
        """Remove the workspace and return its uid slot; never raises, safe to call twice."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        try:
            sandbox_fs.remove_area(self.path)
        finally:
            self.sandbox._release_uid(self.uid)
            with _uid_lock:
                _open_workspaces.discard(self)


def open_workspaces() -> list[Workspace]:
    with _uid_lock:
        return list(_open_workspaces)


@atexit.register
def _close_forgotten_workspaces() -> None:
    for ws in open_workspaces():
        if ws._owner_pid == os.getpid():
            ws.close()


async def _in_pool(max_workers: int, fn, *args: Any, **kwargs: Any):
    import asyncio
    import functools

    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_get_executor(max_workers), functools.partial(fn, *args, **kwargs))


def _get_executor(max_workers: int):
    global _executor
    from concurrent.futures import ThreadPoolExecutor

    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sandbox")
        return _executor
