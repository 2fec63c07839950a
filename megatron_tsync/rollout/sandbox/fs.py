"""Host side of the sandbox's file areas: per-call scratch dirs and persistent workspaces, their quota and removal.

An area is a directory ``<scratch_root>/<kind>_<owner pid>_<random>``. As root it is a fresh tmpfs mounted there with
``size=disk_bytes,nr_inodes=max_files,mode=0700,uid=gid=<the call's uid>``: writes beyond the quota fail inside the
call with ENOSPC (bytes or inodes), the host disk is never touched, and removal is one ``umount2(MNT_DETACH)`` plus
one ``rmdir`` whatever the call left inside (a 3,000-deep tree, 0000 modes, millions of files). Without root (no
mount) an area is a plain directory, unquota'd, removed by :func:`remove_tree`, which is iterative (no recursion
limit, no PATH_MAX limit: it walks with ``openat``/``unlinkat`` relative to one open directory at a time).

Nothing here raises on removal: :func:`remove_area` returns False and remembers the path, and every later call of
:func:`retry_leftovers` (the sandbox calls it after each call) and :func:`sweep_stale` (at start-up: areas of dead
owner pids, e.g. after a SIGKILL) try again. Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import stat
import tempfile
import threading

__all__ = ["create_area", "remove_area", "remove_tree", "retry_leftovers", "sweep_stale", "can_mount_tmpfs",
           "leftovers"]

_MNT_DETACH = 2
_MS_NOSUID, _MS_NODEV = 2, 4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_lock = threading.Lock()
_leftovers: set[str] = set()


def _mount_tmpfs(path: str, size: int, inodes: int, uid: int | None) -> None:
    opts = f"size={max(4096, int(size))},nr_inodes={max(16, int(inodes))},mode=0700"
    if uid is not None:
        opts += f",uid={uid},gid={uid}"
    if _libc.mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts.encode()) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount tmpfs on {path}: {os.strerror(e)}")


def _is_mountpoint(path: str) -> bool:
    try:
        return os.stat(path).st_dev != os.stat(os.path.dirname(path)).st_dev
    except OSError:
        return False


def can_mount_tmpfs(root: str) -> tuple[bool, str]:
    """Whether areas under `root` can be size-limited tmpfs mounts (probed by mounting one)."""
    if os.geteuid() != 0:
        return False, "not root: areas are plain directories (no quota)"
    d = tempfile.mkdtemp(prefix="probe_", dir=root)
    try:
        _mount_tmpfs(d, 1 << 20, 64, None)
    except OSError as e:
        os.rmdir(d)
        return False, str(e)
    remove_area(d)
    return True, "tmpfs per area (size, nr_inodes)"


def create_area(root: str, kind: str, uid: int | None, disk_bytes: int, max_files: int, tmpfs: bool) -> str:
    """A new empty area owned by `uid` (mode 0700); a tmpfs with the quota when `tmpfs`, else a directory."""
    path = tempfile.mkdtemp(prefix=f"{kind}_{os.getpid()}_", dir=root)
    try:
        if tmpfs:
            _mount_tmpfs(path, disk_bytes, max_files, uid)
        elif uid is not None:
            os.chown(path, uid, uid)
        os.chmod(path, 0o700)
    except BaseException:
        remove_area(path)
        raise
    return path


def remove_area(path: str) -> bool:
    """Unmount (if a mount) and remove `path`; never raises. False (and remembered for a retry) if something stayed."""
    try:
        if _is_mountpoint(path):
            _libc.umount2(path.encode(), _MNT_DETACH)
        try:
            os.rmdir(path)  # the usual case: an unmounted tmpfs leaves an empty directory
        except OSError:
            if os.path.lexists(path):
                remove_tree(path)
        ok = not os.path.lexists(path)
    except BaseException:  # noqa: BLE001 — removal must never take the caller down
        ok = False
    with _lock:
        (_leftovers.discard if ok else _leftovers.add)(path)
    return ok


def retry_leftovers() -> int:
    """Retry the areas a previous removal could not finish; returns how many are still left."""
    with _lock:
        todo = list(_leftovers)
    for p in todo:
        remove_area(p)
    with _lock:
        return len(_leftovers)


def leftovers() -> list[str]:
    with _lock:
        return sorted(_leftovers)


def remove_tree(path: str) -> None:
    """Remove `path` and everything below it without recursion (depth and path length unbounded). Never follows
    symlinks; makes directories writable where their mode forbids it. Raises OSError only for a real failure."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    names: list[str] = []  # names from `path` down to the current directory
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        while True:
            sub = _clear_files(fd)
            if sub is not None:  # descend into the first subdirectory
                child = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd, names = child, names + [sub]
                continue
            if not names:
                break
            parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = parent
            os.rmdir(names.pop(), dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)


def _clear_files(fd: int) -> str | None:
    """Unlink every non-directory in the directory `fd`; return the name of one subdirectory, if any."""
    try:
        os.fchmod(fd, 0o700)
    except OSError:
        pass
    sub = None
    with os.scandir(fd) as it:
        for e in it:
            if e.is_dir(follow_symlinks=False):
                sub = sub or e.name
            else:
                os.unlink(e.name, dir_fd=fd)
    return sub


def sweep_stale(root: str) -> int:
    """Remove areas under `root` whose owner pid (in the name) is dead, e.g. after a SIGKILL. Returns the count."""
    n = 0
    try:
        entries = os.listdir(root)
    except OSError:
        return 0
    for name in entries:
        parts = name.split("_")
        if len(parts) < 3 or not parts[1].isdigit() or int(parts[1]) == os.getpid():
            continue
        try:
            os.kill(int(parts[1]), 0)
            continue  # owner alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        n += remove_area(os.path.join(root, name))
    return n
