"""One cgroup per sandboxed call: a limit on the total memory and the total number of tasks of the call's whole tree.

Detection (once per process, :func:`detect`), first that works:

- ``v2``: the unified hierarchy, if this process's own cgroup has (or can be given) ``memory`` and ``pids`` in
  ``cgroup.subtree_control``; per call ``memory.max``, ``memory.swap.max=0``, ``pids.max``; OOM kills read from
  ``memory.events``.
- ``v1``: the ``memory`` and ``pids`` v1 hierarchies, writable (as root); per call a child of this process's own
  cgroup in each (so the call stays inside every limit this process already has): ``memory.limit_in_bytes`` (and
  ``memory.memsw.limit_in_bytes`` where swap accounting exists), ``pids.max``; OOM kills from ``memory.oom_control``.
- none: no cgroup; the memory of a call is bounded only per process (RLIMIT_AS) times RLIMIT_NPROC.

The call's cgroups are named ``mtsb_<owner pid>_<n>``; :meth:`CallCgroup.remove` kills what is left inside and
removes them (retrying while the kernel finishes tearing the tasks down); a cgroup of a dead owner pid found next to
ours is removed at detection. Standard library only.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time

__all__ = ["CgroupBackend", "CallCgroup", "detect", "leftovers"]

_counter = itertools.count()
_detect_lock = threading.Lock()
_detected: "CgroupBackend | None" = None
_leftover_lock = threading.Lock()
_leftovers: set[str] = set()


def _own_paths() -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            hid, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in (ctrls.split(",") if ctrls else [""]):
                out[c] = path
    return out


def _mounts() -> dict[str, str]:
    """controller (or "" for the cgroup2 mount) -> mount point."""
    out: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fstype, _, opts = post.split()[:3]
            point = pre.split()[4]
            if fstype == "cgroup2":
                out.setdefault("", point)
            elif fstype == "cgroup":
                for o in opts.split(","):
                    if o in ("memory", "pids"):
                        out.setdefault(o, point)
    return out


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


class CallCgroup:
    """The cgroup(s) of one call. ``procs`` are their ``cgroup.procs`` files."""

    def __init__(self, backend: "CgroupBackend", dirs: list[str]):
        self.backend, self.dirs = backend, dirs
        self.procs = [os.path.join(d, "cgroup.procs") for d in dirs]

    def oom_kills(self) -> int:
        """How many processes of the call the kernel's OOM killer killed at the memory limit."""
        d = self.dirs[0]
        text = _read(os.path.join(d, "memory.events" if self.backend.kind == "v2" else "memory.oom_control"))
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def peak_memory(self) -> int | None:
        name = "memory.peak" if self.backend.kind == "v2" else "memory.max_usage_in_bytes"
        v = _read(os.path.join(self.dirs[0], name)).strip()
        return int(v) if v.isdigit() else None

    def add(self, pid: int) -> None:
        """Move process `pid` (not yet forked: its future children follow) into the call's cgroup(s)."""
        for procs in self.procs:
            _write(procs, str(pid))

    def kill(self) -> None:
        """SIGKILL every task in the call's cgroup(s) (also ones that left the process group or the pid namespace)."""
        for d in self.dirs:
            _kill_members(d)

    def remove(self, timeout: float = 5.0) -> bool:
        """Kill every task left and remove the cgroup(s); never raises. False if one could not be removed in time
        (it is then retried whenever a later call creates its cgroup)."""
        ok = True
        for d in self.dirs:
            gone = _remove_cgroup(d, timeout)
            with _leftover_lock:
                (_leftovers.discard if gone else _leftovers.add)(d)
            ok &= gone
        return ok


def leftovers() -> list[str]:
    """Cgroups of this process's calls that could not be removed yet."""
    with _leftover_lock:
        return sorted(_leftovers)


def _retry_leftovers() -> None:
    with _leftover_lock:
        todo = list(_leftovers)
    for d in todo:
        if _remove_cgroup(d, 0.0):
            with _leftover_lock:
                _leftovers.discard(d)


def _remove_cgroup(d: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(d)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        _kill_members(d)
        time.sleep(0.002)


def _kill_members(d: str) -> None:
    for pid in _read(os.path.join(d, "cgroup.procs")).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError):
            pass


class CgroupBackend:
    """Where per-call cgroups are created (``kind`` in {"v2", "v1"}) and with which limit files."""

    def __init__(self, kind: str, parents: dict[str, str], swap_file: bool):
        self.kind, self.parents, self.swap_file = kind, parents, swap_file

    def describe(self) -> str:
        return f"cgroup {self.kind} under " + ", ".join(f"{c or 'unified'}: {p}" for c, p in self.parents.items())

    def create(self, memory_bytes: int, max_tasks: int, v1_pids: bool = True) -> CallCgroup:
        """A new cgroup (per hierarchy) with the limits. Raises OSError if it cannot be set up. With v1, `v1_pids`
        False skips the pids hierarchy: every cgroup a call joins costs the launcher an RCU grace period (~5-10 ms
        measured here), and a private uid's RLIMIT_NPROC already bounds the tree's tasks."""
        if _leftovers:
            _retry_leftovers()
        name = f"mtsb_{os.getpid()}_{next(_counter)}"
        dirs: list[str] = []
        try:
            if self.kind == "v2":
                d = os.path.join(self.parents[""], name)
                os.mkdir(d)
                dirs.append(d)
                _write(os.path.join(d, "memory.max"), str(memory_bytes))
                if os.path.exists(os.path.join(d, "memory.swap.max")):
                    _write(os.path.join(d, "memory.swap.max"), "0")
                _write(os.path.join(d, "pids.max"), str(max_tasks))
            else:
                dm, dp = os.path.join(self.parents["memory"], name), os.path.join(self.parents["pids"], name)
                os.mkdir(dm)
                dirs.append(dm)
                _write(os.path.join(dm, "memory.limit_in_bytes"), str(memory_bytes))
                if self.swap_file:
                    _write(os.path.join(dm, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                if v1_pids:
                    os.mkdir(dp)
                    dirs.append(dp)
                    _write(os.path.join(dp, "pids.max"), str(max_tasks))
        except BaseException:
            CallCgroup(self, dirs).remove(1.0)
            raise
        return CallCgroup(self, dirs)


def _try_v2(mounts: dict[str, str], own: dict[str, str]) -> CgroupBackend | None:
    if "" not in mounts or "" not in own:
        return None
    parent = os.path.join(mounts[""], own[""].lstrip("/"))
    ctl = os.path.join(parent, "cgroup.subtree_control")
    have = set(_read(ctl).split())
    if not {"memory", "pids"} <= have:
        avail = set(_read(os.path.join(parent, "cgroup.controllers")).split())
        if not {"memory", "pids"} <= avail:
            return None
        try:  # only possible in the root cgroup or a cgroup without processes of its own
            _write(ctl, "+memory +pids")
        except OSError:
            return None
    return CgroupBackend("v2", {"": parent}, True)


def _try_v1(mounts: dict[str, str], own: dict[str, str]) -> CgroupBackend | None:
    if not {"memory", "pids"} <= mounts.keys() or not {"memory", "pids"} <= own.keys():
        return None
    parents = {c: os.path.join(mounts[c], own[c].lstrip("/")) for c in ("memory", "pids")}
    if not all(os.access(p, os.W_OK) for p in parents.values()):
        return None
    swap = os.path.exists(os.path.join(parents["memory"], "memory.memsw.limit_in_bytes"))
    return CgroupBackend("v1", parents, swap)


def _sweep(backend: CgroupBackend) -> None:
    """Remove empty-able cgroups of dead owners (``mtsb_<pid>_<n>``) left next to ours, e.g. after a SIGKILL."""
    for parent in backend.parents.values():
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for n in names:
            parts = n.split("_")
            if len(parts) != 3 or parts[0] != "mtsb" or not parts[1].isdigit() or int(parts[1]) == os.getpid():
                continue
            try:
                os.kill(int(parts[1]), 0)
                continue
            except ProcessLookupError:
                _remove_cgroup(os.path.join(parent, n), 1.0)
            except PermissionError:
                continue


def detect(disabled: bool = False) -> tuple[CgroupBackend | None, str]:
    """The cgroup backend of this process (probed once by creating and removing a cgroup) and a note why/why not."""
    global _detected
    if disabled:
        return None, "disabled by config (use_cgroups=False)"
    with _detect_lock:
        if _detected is not None:
            return _detected, _detected.describe()
        notes = []
        try:
            mounts, own = _mounts(), _own_paths()
        except OSError as e:
            return None, f"cannot read cgroup membership: {e}"
        for try_ in (_try_v2, _try_v1):
            b = try_(mounts, own)
            if b is None:
                continue
            try:
                b.create(64 << 20, 8).remove(1.0)
            except OSError as e:
                notes.append(f"{b.kind}: {e}")
                continue
            _sweep(b)
            _detected = b
            return b, b.describe()
        v2 = "unified hierarchy without delegated memory+pids controllers" if "" in mounts else "no cgroup2 mount"
        v1 = "v1 memory/pids hierarchies " + ("not writable" if {"memory", "pids"} <= mounts.keys() else "absent")
        return None, "; ".join([v2, v1] + notes)
