"""Sandboxed subprocess execution for agent tool calls and verifiers.

Every call to :meth:`Sandbox.run` gets a fresh scratch directory (its cwd, removed afterwards) and runs its command in
a real subprocess, so tool latency is real process latency. The call never raises for a misbehaving command: the
outcome, including timeouts, truncation and resource-limit kills, is reported in a :class:`ToolResult`.

How a call is isolated (each mechanism is probed once per process; :meth:`Sandbox.enforcement` reports the outcome)::

    parent (rollout worker thread)
      └─ launcher: `python -I -S -c _LAUNCHER_SRC spec` (root), new session + process group
           unshare(NEWNET | NEWNS | NEWPID | NEWIPC | NEWUTS)      network: empty netns, loopback down
           mount: / rprivate, scratch bind-mounted rw, every other mount remounted read-only
           └─ init (pid 1 of the new pid ns, PDEATHSIG=SIGKILL): mounts a fresh /proc, reaps, reports status
                └─ target: rlimits (AS, DATA, CPU, FSIZE, NPROC, NOFILE, CORE=0), setgroups([]), setgid/setuid to
                   a per-call unprivileged uid, PR_SET_NO_NEW_PRIVS, optional real sleep (delay_s), execve(argv)

- wall timeout: the parent SIGKILLs the launcher's process group; init dies with it and the kernel then kills every
  process left in the pid namespace (also ones that called setsid), so no orphan survives. Without a pid namespace
  the parent kills the process group and every process owned by the call's uid.
- output: stdout/stderr are read incrementally (64 KiB chunks) and capped at ``max_output_bytes`` per stream; the
  whole tree is killed as soon as a stream exceeds the cap, so a 100 MB print costs ~cap bytes of parent memory.
- processes: RLIMIT_NPROC counts processes per real uid and is not enforced for root, so each concurrent call runs
  under its own uid (``2_000_000_000 + (pid % 100_000) * 1000 + slot``); the limit then covers exactly one call.
- memory: RLIMIT_AS and RLIMIT_DATA per process (total bounded by ``memory_bytes * max_processes``). cgroups are not
  used: on machines with a cgroup-v1/hybrid hierarchy (like the development VM) there is no delegated v2 subtree.
- filesystem: writes outside the scratch dir fail with EROFS (read-only mounts) and EACCES (unprivileged uid; the
  scratch dirs of concurrent calls are 0700 and owned by other uids). Reads are limited only by file permissions.
- when not root: a user namespace is tried first to obtain the other namespaces; the uid cannot be dropped, so
  RLIMIT_NPROC then counts all processes of the invoking user (reported as not enforced per call).

Measured on the development VM (Debian 12, root, kernel 6.18, cgroup v1/v2 hybrid): every item above is enforced
(uid, processes, network, filesystem, pid namespace, wall, cpu, memory, file size, output); cgroups are not used.
Run ``python -c "from megatron_tsync.rollout.sandbox import Sandbox; print(Sandbox().enforcement())"`` on a new machine.

This module imports only the standard library (no torch, no megatron).
"""

from __future__ import annotations

import json
import marshal
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["SandboxConfig", "ToolResult", "Sandbox", "detect_capabilities"]

_READ_CHUNK = 65536
_MAX_SPEC_BYTES = 120_000  # one execve argument may be at most 128 KiB (MAX_ARG_STRLEN); the spec is hex-encoded
_INLINE_CODE_BYTES = 20_000  # larger code is written to main.py instead of passed with -c
_UID_BASE = 2_000_000_000
_UID_SLOTS = 1000
_MEMORY_PATTERNS = re.compile(
    rb"MemoryError|Cannot allocate memory|cannot allocate memory|out of memory|std::bad_alloc|xmalloc"
)


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
    """RLIMIT_NPROC of the call's private uid: processes and threads alive at once (the target included)."""
    network: bool = False
    """Allow network access (no network namespace) when True."""
    scratch_root: str | None = None
    """Parent directory of the per-call scratch dirs; default ``$TMPDIR/megatron_tsync_sandbox``."""
    max_file_bytes: int = 64 << 20
    """RLIMIT_FSIZE: the largest file a process may write."""
    max_open_files: int = 256
    """RLIMIT_NOFILE."""


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


# ----------------------------------------------------------------------------------------------------------------
# Launcher: `python -I -S -c _LAUNCHER_SRC <hex(marshal(spec))>` in the child. Standard library only.
# ----------------------------------------------------------------------------------------------------------------
_LAUNCHER_SRC = r'''
import ctypes, marshal, os, resource, signal, sys, time
spec = marshal.loads(bytes.fromhex(sys.argv[1]))  # marshal, not json: json's import costs ~8 ms per call
STATUS = spec["status_fd"]
def report(**kw):  # one "key value" line per item; values never contain newlines
    try:
        os.write(STATUS, "".join("%s %s\n" % (k, str(v).replace("\n", " ")) for k, v in kw.items()).encode())
    except OSError:
        pass
def fail(stage, exc):
    report(setup_error="%s: %s" % (stage, exc))
    os._exit(125)
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
def check(rc):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
def mount(src, tgt, fstype, flags):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(src), enc(tgt), enc(fstype), flags, None))
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
NS = {"user": 0x10000000, "net": 0x40000000, "mnt": 0x00020000, "pid": 0x20000000, "ipc": 0x08000000,
      "uts": 0x04000000}
cwd = os.getcwd()
if spec["ns"].get("user"):
    uid, gid = os.getuid(), os.getgid()
    try:
        check(libc.unshare(NS["user"]))
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write("0 %d 1" % uid)
        with open("/proc/self/gid_map", "w") as f:
            f.write("0 %d 1" % gid)
    except OSError as e:
        fail("unshare(user)", e)
flags = 0
for name, on in spec["ns"].items():
    if on and name != "user":
        flags |= NS[name]
if flags:
    try:
        check(libc.unshare(flags))
    except OSError as e:
        fail("unshare(%s)" % ",".join(n for n, on in spec["ns"].items() if on), e)
if spec["ns"].get("mnt"):
    try:  # never let our mounts (scratch bind, /proc) propagate back to the host's mount namespace
        mount(None, "/", None, MS_REC | MS_PRIVATE)
    except OSError as e:
        fail("mount(/, private)", e)
if spec.get("ro_root"):
    try:
        mount(cwd, cwd, None, MS_BIND | MS_REC)
        os.chdir(cwd)  # the old cwd still points into the (soon read-only) parent mount
    except OSError as e:
        fail("mount(scratch)", e)
    failed = []
    with open("/proc/self/mountinfo") as f:
        points = [l.split()[4] for l in f]
    for p in points:
        p = p.encode().decode("unicode_escape")
        if p == cwd:
            continue
        try:
            keep = os.statvfs(p).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
            mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
        except OSError as e:
            failed.append("%s: %s" % (p, e))
    if failed:
        report(ro_failed="; ".join(failed))
        if spec.get("ro_strict"):
            fail("remount read-only", "; ".join(failed))
def relay(status):
    if os.WIFSIGNALED(status):
        report(signal=os.WTERMSIG(status))
        return 128 + os.WTERMSIG(status)
    report(exit=os.WEXITSTATUS(status))
    return os.WEXITSTATUS(status)
if spec["ns"].get("pid"):
    init = os.fork()
    if init > 0:  # launcher: wait for init of the new pid namespace
        _, st = os.waitpid(init, 0)
        os._exit(os.WEXITSTATUS(st) if os.WIFEXITED(st) else 125)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG (the launcher is in our process group too)
    if spec["ns"].get("mnt"):
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
        except OSError as e:
            fail("mount(/proc)", e)
target = os.fork()
if target == 0:
    try:
        os.close(STATUS)
        for name, (soft, hard) in spec["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if spec.get("uid") is not None:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
        if spec.get("delay_s"):
            time.sleep(spec["delay_s"])
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as e:
        try:
            os.write(2, ("sandbox: cannot start %r: %s\n" % (spec["argv"][0], e)).encode())
        finally:
            os._exit(127)
while True:  # reap everything; stop when the target is gone (the kernel then kills the rest of the pid ns)
    try:
        pid, st, ru = os.wait4(-1, 0)
    except ChildProcessError:
        os._exit(125)
    if pid == target:
        report(cpu_s=ru.ru_utime + ru.ru_stime)
        os._exit(relay(st))
'''

# Probe run inside the sandbox once per process: checks empirically what the launcher's setup achieved.
_PROBE_SRC = r'''
import json, os, socket, sys
port, sibling, scratch = int(sys.argv[1]), sys.argv[2], os.getcwd()
def blocked_connect(addr):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(addr)
        return False
    except OSError:
        return True
    finally:
        s.close()
def blocked_write(d):
    p = os.path.join(d, "probe_%d" % os.getpid())
    try:
        with open(p, "w") as f:
            f.write("x")
    except OSError:
        return True
    os.unlink(p)
    return False
pids = [p for p in os.listdir("/proc") if p.isdigit()]
print(json.dumps({"uid": os.getuid(), "net": blocked_connect(("127.0.0.1", port)),
                  "tmp": blocked_write("/tmp"), "sibling": blocked_write(sibling),
                  "scratch_ok": not blocked_write(scratch) and not blocked_write("."), "pid": len(pids) <= 3}))
'''

_caps_lock = threading.Lock()
_caps_cache: dict[str, dict[str, Any]] = {}
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()
_executor_lock = threading.Lock()
_executor = None


def _accessible_by_others(path: str) -> bool:
    """True if `path` can be executed by an unprivileged uid (o+x on the file and every parent dir)."""
    real = os.path.realpath(path)
    parts = real.split("/")
    for i in range(2, len(parts) + 1):
        try:
            if not os.stat("/".join(parts[:i]) or "/").st_mode & 0o001:
                return False
        except OSError:
            return False
    return True


def _sandbox_python() -> str | None:
    """A Python interpreter the sandboxed (unprivileged) uid can execute."""
    if os.geteuid() != 0:
        return sys.executable
    for cand in (sys.executable, getattr(sys, "_base_executable", ""), "/usr/bin/python3", "/usr/local/bin/python3"):
        if cand and os.path.exists(cand) and _accessible_by_others(cand):
            return os.path.realpath(cand)
    return None


def _default_scratch_root() -> str:
    return os.path.join(tempfile.gettempdir(), "megatron_tsync_sandbox")


def _ensure_root_dir(path: str) -> None:
    """Create the scratch root 0711 (a sandbox uid may traverse to its own dir, not list the others)."""
    if not os.path.isdir(path):
        os.makedirs(path, mode=0o711, exist_ok=True)
        os.chmod(path, 0o711)  # makedirs' mode is filtered by the umask


def _encode_spec(spec: dict) -> str:
    return marshal.dumps(spec).hex()


def _parse_status(raw: bytes) -> dict[str, Any]:
    """The launcher's ``key value`` status lines -> dict (exit/signal: int, cpu_s: float, else str)."""
    out: dict[str, Any] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        key, _, value = line.partition(" ")
        try:
            out[key] = int(value) if key in ("exit", "signal") else float(value) if key == "cpu_s" else value
        except ValueError:
            out[key] = value
    return out


def _launch_raw(spec: dict, cwd: str, timeout: float) -> tuple[int, bytes, dict[str, Any]]:
    """Run the launcher without the output/timeout machinery (capability probes only)."""
    r, w = os.pipe()
    spec = dict(spec, status_fd=w)
    try:
        p = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _LAUNCHER_SRC, _encode_spec(spec)],
            cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, pass_fds=(w,),
            start_new_session=True,
        )
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired:
        rc, out = -1, b""
    finally:
        os.close(w)
    with os.fdopen(r, "rb") as f:
        status = _parse_status(f.read())
    return rc, out, status


def detect_capabilities(scratch_root: str | None = None) -> dict[str, Any]:
    """Probe once per process (and scratch root) which isolation mechanisms work on this machine."""
    root = os.path.abspath(scratch_root or _default_scratch_root())
    with _caps_lock:
        if root in _caps_cache:
            return _caps_cache[root]
        caps = _probe(root)
        _caps_cache[root] = caps
        return caps


def _probe(root: str) -> dict[str, Any]:
    import socket

    _ensure_root_dir(root)
    is_root = os.geteuid() == 0
    python = _sandbox_python()
    caps: dict[str, Any] = {"root": is_root, "python": python, "ns": {}, "ro_root": False, "uid_drop": False,
                            "notes": []}
    base = {"argv": ["/bin/true"], "env": {}, "rlimits": {}, "uid": None, "gid": None}
    tried = ["user"] if not is_root else []
    with tempfile.TemporaryDirectory(dir=root) as d:
        ns: dict[str, bool] = {}
        for name in tried + ["net", "mnt", "pid", "ipc", "uts"]:
            rc, _, st = _launch_raw(dict(base, ns={**ns, name: True}), d, 10.0)
            if rc == 0:
                ns[name] = True
            else:
                caps["notes"].append(f"{name} namespace unavailable: {st.get('setup_error', rc)}")
        if not is_root and not ns.get("user"):
            ns = {}  # without a user namespace an unprivileged process cannot unshare anything else
        caps["ns"] = ns
        if ns.get("mnt"):
            rc, _, st = _launch_raw(dict(base, ns=ns, ro_root=True, ro_strict=True), d, 10.0)
            caps["ro_root"] = rc == 0
            if rc != 0:
                caps["notes"].append(f"read-only remount failed: {st or rc}")
        if is_root and python:
            caps["uid_drop"] = True
        elif is_root:
            caps["notes"].append("no Python interpreter executable by an unprivileged uid; uid drop disabled")
    # Empirical check of the combined setup.
    sibling = tempfile.mkdtemp(dir=root)
    os.chmod(sibling, 0o777)  # permission alone would allow the write: only the mount setup may block it
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    try:
        with tempfile.TemporaryDirectory(dir=root) as d:
            uid = _UID_BASE + (os.getpid() % 100_000) * _UID_SLOTS + _UID_SLOTS - 1
            if caps["uid_drop"]:
                os.chown(d, uid, uid)
            spec = dict(base, ns=caps["ns"], ro_root=caps["ro_root"],
                        argv=[python or sys.executable, "-I", "-S", "-c", _PROBE_SRC, str(srv.getsockname()[1]),
                              sibling],
                        uid=uid if caps["uid_drop"] else None, gid=uid if caps["uid_drop"] else None)
            rc, out, st = _launch_raw(spec, d, 20.0)
            try:
                caps["probe"] = json.loads(out.decode().strip().splitlines()[-1])
            except (ValueError, IndexError):
                caps["probe"] = {}
                caps["notes"].append(f"probe failed: rc={rc} status={st}")
    finally:
        srv.close()
        shutil.rmtree(sibling, ignore_errors=True)
    return caps


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


class Sandbox:
    """Runs commands in isolated, resource-limited subprocesses. Thread-safe; see the module docstring."""

    def __init__(self, config: SandboxConfig | None = None, *, max_workers: int = 16):
        self.config = config or SandboxConfig()
        self.scratch_root = os.path.abspath(self.config.scratch_root or _default_scratch_root())
        self._caps = detect_capabilities(self.scratch_root)
        self._max_workers = max_workers
        self.python: str = self._caps["python"] or sys.executable
        """Interpreter to use for Python code inside the sandbox (executable by the sandbox uid)."""

    # ------------------------------------------------------------------------------------------------ reporting
    def enforcement(self) -> dict[str, dict[str, Any]]:
        """What is and is not enforced for this config on this machine: ``{name: {"enforced": bool, "how": str}}``."""
        c, cfg, probe = self._caps, self.config, self._caps.get("probe", {})
        ns = c["ns"]
        uid_ok = c["uid_drop"] and probe.get("uid", 0) != 0
        out: dict[str, dict[str, Any]] = {}

        def put(name: str, ok: bool, how: str) -> None:
            out[name] = {"enforced": bool(ok), "how": how}

        put("wall_timeout", True, f"parent kills the process group with SIGKILL after {cfg.wall_timeout_s}s")
        put("output_cap", True, f"incremental 64 KiB reads; tree killed once stdout or stderr exceeds "
                                f"{cfg.max_output_bytes} bytes")
        put("cpu", True, f"RLIMIT_CPU={cfg.cpu_seconds}s per process (SIGXCPU, then SIGKILL)")
        put("memory", True, f"RLIMIT_AS=RLIMIT_DATA={cfg.memory_bytes} bytes per process; no cgroup (total bounded by "
                            f"memory_bytes x max_processes)")
        put("file_size", True, f"RLIMIT_FSIZE={cfg.max_file_bytes} bytes")
        put("uid", uid_ok, "setuid to a private unprivileged uid per call (+ setgroups([]), NO_NEW_PRIVS)"
            if uid_ok else "not dropped: " + ("not running as root" if not c["root"] else "; ".join(c["notes"])))
        put("processes", uid_ok, f"RLIMIT_NPROC={cfg.max_processes} on the call's private uid" if uid_ok
            else "no private uid, and RLIMIT_NPROC " + ("is not enforced for root" if c["root"] else
                                                       "would count every process of the invoking user"))
        if cfg.network:
            put("network", False, "network allowed by config (network=True)")
        elif ns.get("net") and probe.get("net"):
            put("network", True, "unshare(CLONE_NEWNET): empty network namespace, loopback down (probed)")
        else:
            put("network", False, "no network namespace on this machine: " + "; ".join(c["notes"]))
        fs_ok = c["ro_root"] and probe.get("tmp") and probe.get("sibling") and probe.get("scratch_ok")
        how_fs = ("mount namespace: every mount read-only except the bind-mounted scratch dir (probed: /tmp and a "
                  "0777 sibling dir not writable)")
        if fs_ok and uid_ok:
            how_fs += "; plus unprivileged uid and 0700 scratch dirs"
        put("filesystem", bool(fs_ok), how_fs if fs_ok else
            "writes outside scratch not prevented (no read-only mount namespace); "
            + ("unprivileged uid only: world-writable dirs such as /tmp stay writable" if uid_ok else "none"))
        pid_ok = ns.get("pid") and probe.get("pid")
        put("kill_tree", bool(pid_ok or uid_ok), "pid namespace: init death kills every process in it (incl. setsid escapees)" if pid_ok
            else "process group kill" + (" + SIGKILL of every process of the call's uid" if uid_ok else
                                         " only: a process that calls setsid() can escape"))
        put("pid_namespace", bool(pid_ok), "unshare(CLONE_NEWPID) + private /proc" if pid_ok else "unavailable")
        put("cgroups", False, "not used (no delegated cgroup v2 subtree assumed); limits are per-process rlimits")
        return out

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
    ) -> ToolResult:
        """Run `argv` (a list, or a string for ``/bin/sh -c``) or Python `code` in a fresh sandbox. Never raises.

        `files` are written into the scratch dir first (relative paths); `delay_s` is a real sleep inside the
        sandboxed child before the command starts (it counts towards the wall timeout).
        """
        t0 = time.monotonic()
        try:
            return self._run(argv, code, stdin, files, delay_s, env, t0)
        except Exception as e:  # never let a tool take down the worker
            return ToolResult(False, "", "", None, f"sandbox internal error: {type(e).__name__}: {e}",
                              time.monotonic() - t0)

    async def run_async(self, argv: Sequence[str] | str | None = None, **kwargs: Any) -> ToolResult:
        """:meth:`run` on a shared thread pool, for asyncio rollout loops."""
        import asyncio
        import functools

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_get_executor(self._max_workers),
                                          functools.partial(self.run, argv, **kwargs))

    def _argv(self, argv: Sequence[str] | str | None, code: str | None) -> list[str]:
        if code is not None:
            inline = len(code.encode()) < _INLINE_CODE_BYTES
            return [self.python, "-I", "-c", code] if inline else [self.python, "-I", "main.py"]
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

    def _spec(self, argv: list[str], scratch: str, uid: int | None, delay_s: float,
              env: Mapping[str, str] | None) -> dict:
        cfg, caps = self.config, self._caps
        ns = dict(caps["ns"])
        if cfg.network:
            ns.pop("net", None)
        base_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
                    "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
        base_env.update(env or {})
        cpu = max(1, int(cfg.cpu_seconds))
        return {
            "argv": argv, "env": base_env, "ns": ns, "ro_root": caps["ro_root"], "ro_strict": True,
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
        raise RuntimeError(f"more than {_UID_SLOTS - 1} concurrent sandboxes")

    @staticmethod
    def _release_uid(uid: int | None) -> None:
        if uid is not None:
            with _uid_lock:
                _uids_in_use.discard(uid)

    def _run(self, argv, code, stdin, files, delay_s, env, t0) -> ToolResult:
        uid = self._acquire_uid()
        scratch = tempfile.mkdtemp(prefix="call_", dir=self.scratch_root)
        try:
            files = dict(files or {})
            if code is not None and len(code.encode()) >= _INLINE_CODE_BYTES:
                files["main.py"] = code
            _write_files(scratch, files)
            if uid is not None:
                for dirpath, _, names in os.walk(scratch):
                    os.chown(dirpath, uid, uid)
                    for n in names:
                        os.chown(os.path.join(dirpath, n), uid, uid)
                os.chmod(scratch, 0o700)
            try:
                cmd = self._argv(argv, code)
            except (ValueError, FileNotFoundError) as e:
                return ToolResult(False, "", "", None, str(e), time.monotonic() - t0)
            spec = self._spec(cmd, scratch, uid, delay_s, env)
            return self._execute(spec, scratch, uid, stdin, t0)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            self._release_uid(uid)

    def _execute(self, spec: dict, scratch: str, uid: int | None, stdin: str | bytes | None, t0: float) -> ToolResult:
        cfg = self.config
        status_r, status_w = os.pipe()
        spec["status_fd"] = status_w
        blob = _encode_spec(spec)
        if len(blob) > _MAX_SPEC_BYTES:
            os.close(status_r)
            os.close(status_w)
            return ToolResult(False, "", "", None, "command too long (pass large inputs via files= or stdin=)",
                              time.monotonic() - t0)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _LAUNCHER_SRC, blob], cwd=scratch,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,), start_new_session=True,
            )
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        io = _Pump(proc, data, cfg.max_output_bytes, t0 + cfg.wall_timeout_s)
        try:
            io.loop(lambda: self._cleanup(proc.pid, uid))
        finally:
            self._cleanup(proc.pid, uid)
            proc.wait()
            for f in (proc.stdout, proc.stderr, proc.stdin):
                if f is not None:
                    f.close()
            with os.fdopen(status_r, "rb") as f:
                raw = f.read()
        return self._result(io, _parse_status(raw), proc.returncode, time.monotonic() - t0)

    def _cleanup(self, pgid: int, uid: int | None) -> None:
        _kill_group(pgid)
        if uid is not None and not self._caps["ns"].get("pid"):
            _kill_uid(uid)

    def _result(self, io: "_Pump", st: dict, rc: int | None, wall: float) -> ToolResult:
        cfg = self.config
        out, err = bytes(io.out), bytes(io.err)
        exit_code: int | None = st.get("exit")
        if "signal" in st:
            exit_code = -int(st["signal"])
        error: str | None = None
        if io.timed_out:
            error, exit_code = f"timeout after {cfg.wall_timeout_s:.1f}s", None
        elif io.truncated:
            error, exit_code = f"output truncated at {cfg.max_output_bytes} bytes", None
        elif "setup_error" in st:
            error = f"sandbox setup failed: {st['setup_error']}"
        elif exit_code is None:
            error = f"sandbox launcher exited with status {rc}"
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


class _Pump:
    """Moves stdin in and stdout/stderr out of the child until EOF, the output cap, or the deadline."""

    def __init__(self, proc: subprocess.Popen, stdin: bytes | None, cap: int, deadline: float):
        self.proc, self.stdin, self.cap, self.deadline = proc, stdin, cap, deadline
        self.out, self.err = bytearray(), bytearray()
        self.timed_out = self.truncated = False

    def loop(self, kill) -> None:
        sel = selectors.DefaultSelector()
        bufs = {self.proc.stdout.fileno(): self.out, self.proc.stderr.fileno(): self.err}
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        pos, in_fd = 0, -1
        if self.stdin is not None:
            in_fd = self.proc.stdin.fileno()
            os.set_blocking(in_fd, False)
            if self.stdin:
                sel.register(in_fd, selectors.EVENT_WRITE)
            else:
                self.proc.stdin.close()
        try:
            pidfd = os.pidfd_open(self.proc.pid)
            sel.register(pidfd, selectors.EVENT_READ)
        except (AttributeError, OSError):
            pidfd = None
        killed_at: float | None = None
        try:
            while sel.get_map():
                now = time.monotonic()
                if killed_at is None and now >= self.deadline:
                    self.timed_out = True
                    kill()
                    killed_at = now
                if killed_at is not None and now - killed_at > 2.0:
                    break  # killed but a pipe is still open (a process outside our reach): stop reading
                timeout = (self.deadline - now) if killed_at is None else 0.1
                for key, _ in sel.select(max(0.0, min(timeout, 0.5))):
                    fd = key.fd
                    if fd == pidfd:  # launcher exited: take down anything it left behind, then drain the pipes
                        sel.unregister(fd)
                        kill()
                        continue
                    if fd == in_fd:
                        try:
                            pos += os.write(fd, self.stdin[pos:pos + _READ_CHUNK])
                        except (BrokenPipeError, BlockingIOError, OSError):
                            pos = len(self.stdin)
                        if pos >= len(self.stdin):
                            sel.unregister(fd)
                            self.proc.stdin.close()
                        continue
                    try:
                        chunk = os.read(fd, _READ_CHUNK)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        sel.unregister(fd)
                        continue
                    buf = bufs[fd]
                    room = self.cap - len(buf)
                    if len(chunk) > room:
                        buf += chunk[:max(room, 0)]
                        if not self.truncated and not self.timed_out:
                            self.truncated = True
                            kill()
                            killed_at = time.monotonic()
                    else:
                        buf += chunk
            if pidfd is None:  # no pidfd: the pipes are closed; wait (without reaping) for the launcher to exit
                while os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                    if time.monotonic() >= self.deadline:
                        self.timed_out = True
                        break
                    time.sleep(0.005)
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)


def _write_files(scratch: str, files: Mapping[str, str | bytes]) -> None:
    for rel, content in files.items():
        path = os.path.normpath(os.path.join(scratch, rel))
        if not path.startswith(scratch + os.sep):
            raise ValueError(f"file path escapes the scratch dir: {rel!r}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)


def _get_executor(max_workers: int):
    global _executor
    from concurrent.futures import ThreadPoolExecutor

    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sandbox")
        return _executor
