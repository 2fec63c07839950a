"""What the sandbox can enforce on this machine: probed once per process and scratch root, by running the launcher.

The probe tries each namespace alone, then the read-only remount with the tmpfs masks (the fallback), then the
allow-list root (:mod:`.rootfs`) with the interpreter the calls will use (this process's own, venv included, else a
system one), then runs :data:`PROBE_SRC` inside the full setup under a private uid: a TCP port and a 0777 unix socket
of the host must be unreachable, /tmp and a 0777 sibling dir must not be writable, the scratch dir must be, the
project's own package directory must not exist. It also checks whether size-limited tmpfs areas can be mounted and
which cgroup backend works (:mod:`.cgroup`). Standard library only.
"""

from __future__ import annotations

import json
import marshal
import os
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any

import megatron_tsync.rollout.sandbox.fs as sandbox_fs
import megatron_tsync.rollout.sandbox.rootfs as sandbox_rootfs
from megatron_tsync.rollout.sandbox.launcher import LAUNCHER_SRC, PROBE_SRC

__all__ = ["detect_capabilities", "encode_spec", "parse_status", "UID_BASE", "UID_SLOTS", "mask_dirs",
           "default_scratch_root"]

UID_BASE = 2_000_000_000
UID_SLOTS = 1000
_MASK_CANDIDATES = ("/tmp", "/var/tmp", "/run", "/dev/shm")
PROJECT = __name__.split(".")[0]
"""The project whose source a call must not see (its imported package, and any install of it: :mod:`.rootfs`)."""
_caps_lock = threading.Lock()
_caps_cache: dict[str, dict[str, Any]] = {}


def default_scratch_root() -> str:
    return os.path.join(tempfile.gettempdir(), "megatron_tsync_sandbox")


def encode_spec(spec: dict) -> str:
    return marshal.dumps(spec).hex()


def parse_status(raw: bytes) -> dict[str, Any]:
    """The launcher's ``key value`` status lines -> dict (exit/signal: int, cpu_s: float, else str)."""
    out: dict[str, Any] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        key, _, value = line.partition(" ")
        try:
            out[key] = int(value) if key in ("exit", "signal") else float(value) if key == "cpu_s" else value
        except ValueError:
            out[key] = value
    return out


def mask_dirs(scratch_root: str, python: str | None) -> tuple[list[str], list[str]]:
    """Directories hidden behind an empty read-only tmpfs in each call: the shared temp/runtime dirs (where host unix
    sockets live) and the scratch root (other calls' areas). A dir holding the sandbox's Python is left out."""
    cands, notes = [], []
    for d in (*_MASK_CANDIDATES, scratch_root):
        real = os.path.realpath(d)
        if os.path.isdir(real) and real != "/" and real not in cands:
            cands.append(real)
    out = []
    for d in sorted(cands, key=len):
        if any(d.startswith(m + "/") for m in out):
            continue  # already hidden by a parent mask
        if python and os.path.realpath(python).startswith(d + "/"):
            notes.append(f"{d} not masked: the sandbox's Python lives there")
            continue
        out.append(d)
    return out, notes


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


def ensure_root_dir(path: str) -> None:
    """Create the scratch root 0711 (a sandbox uid may traverse to its own dir, not list the others)."""
    if not os.path.isdir(path):
        os.makedirs(path, mode=0o711, exist_ok=True)
        os.chmod(path, 0o711)  # makedirs' mode is filtered by the umask


def _launch_raw(spec: dict, cwd: str, timeout: float) -> tuple[int, bytes, dict[str, Any]]:
    """Run the launcher without the output/timeout machinery (capability probes only)."""
    r, w = os.pipe()
    spec = dict(spec, status_fd=w)
    try:
        p = subprocess.run(
            [sys.executable, "-I", "-S", "-c", LAUNCHER_SRC, encode_spec(spec)],
            cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, pass_fds=(w,),
            start_new_session=True,
        )
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired:
        rc, out = -1, b""
    finally:
        os.close(w)
    with os.fdopen(r, "rb") as f:
        status = parse_status(f.read())
    return rc, out, status


def detect_capabilities(scratch_root: str | None = None) -> dict[str, Any]:
    """Probe once per process (and scratch root) which isolation mechanisms work on this machine."""
    root = os.path.abspath(scratch_root or default_scratch_root())
    with _caps_lock:
        if root in _caps_cache:
            return _caps_cache[root]
        caps = _probe(root)
        _caps_cache[root] = caps
        return caps


def _probe(root: str) -> dict[str, Any]:
    ensure_root_dir(root)
    sandbox_fs.sweep_stale(root)
    is_root = os.geteuid() == 0
    python = _sandbox_python()
    masks, mask_notes = mask_dirs(root, python)
    caps: dict[str, Any] = {"root": is_root, "python": python, "ns": {}, "ro_root": False, "uid_drop": False,
                            "masks": [], "rootfs": None, "python_host": python, "notes": list(mask_notes)}
    caps["tmpfs"], caps["tmpfs_note"] = sandbox_fs.can_mount_tmpfs(root)
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
            rc, _, st = _launch_raw(dict(base, ns=ns, ro_root=True, ro_strict=True, masks=masks), d, 10.0)
            caps["ro_root"] = rc == 0
            caps["masks"] = masks if rc == 0 else []
            if rc != 0:
                caps["notes"].append(f"read-only remount / masks failed: {st or rc}")
        if ns.get("mnt") and caps["ro_root"]:
            caps["rootfs"], rootfs_python = _probe_rootfs(root, d, dict(base, ns=ns, masks=masks), python, caps)
            caps["python"] = python = rootfs_python or python
        if is_root and python:
            caps["uid_drop"] = True
        elif is_root:
            caps["notes"].append("no Python interpreter executable by an unprivileged uid; uid drop disabled")
    caps["probe"] = _probe_isolation(root, caps, base)
    return caps


def package_dir() -> str | None:
    """The directory of the imported project package (hidden from calls)."""
    mod = sys.modules.get(PROJECT)
    f = getattr(mod, "__file__", None)
    return os.path.dirname(os.path.realpath(f)) if f else None


def _probe_rootfs(root: str, d: str, base: dict, python: str | None,
                  caps: dict[str, Any]) -> tuple[dict | None, str | None]:
    """(plan, interpreter) of the allow-list root: the first candidate interpreter (this process's own, venv included;
    then the host-accessible one) that starts inside it under an unprivileged uid; (None, None) if none does."""
    uid = UID_BASE + (os.getpid() % 100_000) * UID_SLOTS + UID_SLOTS - 1 if caps["root"] else None
    for cand in dict.fromkeys(c for c in (sys.executable, python) if c and os.path.isabs(c)):
        try:
            plan = sandbox_rootfs.plan(cand, root, PROJECT, package_dir())
        except (OSError, RuntimeError, ValueError) as e:
            caps["notes"].append(f"allow-list root for {cand}: {e}")
            continue
        if uid is not None:
            os.chown(d, uid, uid)
        rc, out, st = _launch_raw(dict(base, rootfs=plan, uid=uid, gid=uid,
                                       argv=[cand, "-I", "-S", "-c", "import os; print(os.getcwd())"]), d, 20.0)
        if rc == 0 and out.decode(errors="replace").strip() == d:
            return plan, cand
        caps["notes"].append(f"allow-list root for {cand} failed: rc={rc} {st.get('setup_error', '')}".rstrip())
    return None, None


def _probe_isolation(root: str, caps: dict[str, Any], base: dict) -> dict[str, Any]:
    """Run PROBE_SRC inside the full setup: what a call can reach and write, empirically."""
    sibling = tempfile.mkdtemp(dir=root)
    os.chmod(sibling, 0o777)  # permission alone would allow the write: only the mount setup may block it
    sock_dir = tempfile.mkdtemp(prefix="mtsb_probe_sock_")  # in the host's temp dir, where sockets live
    os.chmod(sock_dir, 0o755)
    sock_path = os.path.join(sock_dir, "s")
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    usrv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        usrv.bind(sock_path)
        os.chmod(sock_path, 0o777)
        usrv.listen(8)
        with tempfile.TemporaryDirectory(dir=root) as d:
            uid = UID_BASE + (os.getpid() % 100_000) * UID_SLOTS + UID_SLOTS - 1
            if caps["uid_drop"]:
                os.chown(d, uid, uid)
            spec = dict(base, ns=caps["ns"], ro_root=caps["ro_root"], masks=caps["masks"], hide_sockets=True,
                        rootfs=caps["rootfs"], argv=[caps["python"] or sys.executable, "-I", "-S", "-c", PROBE_SRC,
                                                     str(srv.getsockname()[1]), sibling, sock_path,
                                                     package_dir() or "/nonexistent"],
                        uid=uid if caps["uid_drop"] else None, gid=uid if caps["uid_drop"] else None)
            rc, out, st = _launch_raw(spec, d, 20.0)
            try:
                return json.loads(out.decode().strip().splitlines()[-1])
            except (ValueError, IndexError):
                caps["notes"].append(f"probe failed: rc={rc} status={st}")
                return {}
    finally:
        srv.close()
        usrv.close()
        sandbox_fs.remove_area(sock_dir)
        sandbox_fs.remove_area(sibling)
