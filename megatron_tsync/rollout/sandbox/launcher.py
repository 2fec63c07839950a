"""Source of the sandbox launcher and of the capability probe (run as ``python -I -S -c SRC spec`` in the child).

Both are plain strings: the launcher must start fast (no imports beyond the standard library's C-level modules), so it
is not a module of this package. See :mod:`megatron_tsync.rollout.sandbox` for the isolation it sets up.
"""

from __future__ import annotations

__all__ = ["LAUNCHER_SRC", "PROBE_SRC"]

# spec keys: argv env ns rlimits uid gid delay_s status_fd go_fd ro_root ro_strict masks mounts hide_sockets
# poll_memory source (trusted Python run by the target itself instead of execve(argv); see Sandbox.run_source)
# rootfs (the allow-list root of rootfs.py: {at, binds, links, dirs, hide}; None: the read-only host root + masks)
LAUNCHER_SRC = r'''
import ctypes, marshal, os, resource, signal, sys, time
if "spec" not in globals():  # else run by the fork server (forkserver.py), which passes it
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
libc = globals().get("LIBC") or ctypes.CDLL(None, use_errno=True)  # the fork server's, already loaded
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
def check(rc):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
def mount(src, tgt, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(src), enc(tgt), enc(fstype), flags, enc(data)))
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
NS = {"user": 0x10000000, "net": 0x40000000, "mnt": 0x00020000, "pid": 0x20000000, "ipc": 0x08000000,
      "uts": 0x04000000}
cwd = os.getcwd()
def under(p, d):
    return p == d or p.startswith(d.rstrip("/") + "/")
sockets = []
if spec.get("hide_sockets"):  # the host's path sockets, read before the network namespace hides the list
    try:
        with open("/proc/net/unix") as f:
            next(f)
            sockets = sorted({l.split(None, 7)[7].strip() for l in f if len(l.split(None, 7)) == 8})
    except (OSError, StopIteration):
        pass
    sockets = [s for s in sockets if s.startswith("/") and not under(s, cwd)
               and not any(under(s, m) for m in spec.get("masks", ()))]
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
MS_MOVE, MNT_DETACH, EINVAL = 8192, 2, 22
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}.get(
    os.uname().machine)  # syscall numbers (glibc has no wrapper); elsewhere: MS_MOVE onto / + chroot
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
def build_root(R, proc):  # the allow-list root (rootfs.py): a tmpfs at R["at"], the binds, then pivot_root into it
    def handle(p):
        try:
            return os.open(p, os.O_PATH)
        except FileNotFoundError:
            return None  # gone from the host: not exposed
    srcs = [(p, dev, handle(p)) for p, _, dev in R["binds"]]
    here, null = os.open(cwd, os.O_PATH | os.O_DIRECTORY), os.open("/dev/null", os.O_PATH)
    extra = [(tgt, os.open(src, os.O_PATH), ro) for tgt, src, ro in spec.get("mounts", ())]
    top = R["at"]
    mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    umask = os.umask(0o022)
    def point(p, fd):  # the mount point top+p for the source fd, created (parents 0755) where missing
        t = top + p
        if not os.path.lexists(t):
            if os.path.isdir("/proc/self/fd/%d" % fd):
                os.makedirs(t)
            else:
                os.makedirs(os.path.dirname(t), exist_ok=True)
                os.close(os.open(t, os.O_CREAT | os.O_WRONLY, 0o644))
        return t
    def bindfd(fd, t, flags):
        src = "/proc/self/fd/%d" % fd
        try:
            mount(src, t, None, MS_BIND)
        except OSError as e:  # a tree with locked mounts below it (user namespace) can only be bound recursively
            if e.errno != EINVAL:
                raise
            mount(src, t, None, MS_BIND | MS_REC)
        kept = os.statvfs(t).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
        mount(None, t, None, MS_REMOUNT | MS_BIND | kept | flags)
    for d in R["dirs"]:
        os.makedirs(top + d, exist_ok=True)
    for p, target in R["links"]:
        os.makedirs(os.path.dirname(top + p), exist_ok=True)
        if not os.path.lexists(top + p):
            os.symlink(target, top + p)
    for p, dev, fd in srcs:
        if fd is not None:  # devices keep dev (ro: no new nodes), everything else nodev; nothing is suid
            bindfd(fd, point(p, fd), MS_RDONLY | MS_NOSUID | (MS_NOEXEC if dev else MS_NODEV))
    bindfd(here, point(cwd, here), MS_NOSUID | MS_NODEV)
    for tgt, fd, ro in extra:
        bindfd(fd, point(tgt, fd), (MS_RDONLY if ro else 0) | MS_NOSUID | MS_NODEV)
    for p, _ in R["hide"]:  # the project inside a bound tree (site-packages): an empty dir / empty file over it
        t = top + p
        if os.path.islink(t) or not os.path.lexists(t):
            continue
        if os.path.isdir(t):
            mount("tmpfs", t, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=16,mode=555")
        else:
            bindfd(null, t, MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    for s in sockets:  # a host socket inside a bound tree: /dev/null over it (connect -> ECONNREFUSED)
        if os.path.exists(top + s):
            mount("/proc/self/fd/%d" % null, top + s, None, MS_BIND)
    if proc == "fresh":  # (init of the new pid namespace, before the host's /proc goes: a user namespace needs it)
        mount("proc", top + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
    elif proc == "host":  # no pid namespace: the host's pids are visible anyway
        mount("/proc", top + "/proc", None, MS_BIND | MS_REC)
    mount(None, top, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.umask(umask)
    os.chdir(top)
    if PIVOT_ROOT:  # pivot_root(".", "."): the old root ends up on top of the new one; detach it
        check(libc.syscall(PIVOT_ROOT, b".", b"."))
        check(libc.umount2(b".", MNT_DETACH))
    else:
        mount(".", "/", None, MS_MOVE)
        os.chroot(".")
    os.chdir(cwd)
    for fd in [here, null] + [fd for _, _, fd in srcs if fd is not None] + [fd for _, fd, _ in extra]:
        os.close(fd)
ROOT = spec.get("rootfs") if spec["ns"].get("mnt") else None
ROOT_IN_INIT = bool(ROOT) and bool(spec["ns"].get("user")) and bool(spec["ns"].get("pid"))
if ROOT and not ROOT_IN_INIT:
    try:
        build_root(ROOT, "later" if spec["ns"].get("pid") else "host")
    except OSError as e:
        fail("root filesystem", e)
def bind(tgt, ro, make):
    fd = fds[tgt]
    if make and not os.path.lexists(tgt):
        if os.path.isdir("/proc/self/fd/%d" % fd):
            os.makedirs(tgt, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(tgt), exist_ok=True)
            os.close(os.open(tgt, os.O_CREAT | os.O_WRONLY, 0o600))
    mount("/proc/self/fd/%d" % fd, tgt, None, MS_BIND | MS_REC)  # inherits the source's (read-only) flag: set it
    mount(None, tgt, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (MS_RDONLY if ro else 0))
def ro_all(keep, hidden):
    failed = []
    with open("/proc/self/mountinfo") as f:
        points = [l.split()[4] for l in f]
    for p in points:
        p = p.encode().decode("unicode_escape")
        if p in keep or any(under(p, m) and p != m for m in hidden):
            continue  # a mount below a mask (e.g. other calls' areas) is unreachable once the mask is on top
        try:
            kept = os.statvfs(p).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
            mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)
        except FileNotFoundError:
            continue  # gone since mountinfo was read (an rmdir on the host detaches it here too): nothing to reach
        except OSError as e:
            failed.append("%s: %s" % (p, e))
    return failed
if spec.get("ro_root") and not ROOT:
    try:
        mount(cwd, cwd, None, MS_BIND | MS_REC)
        os.chdir(cwd)  # the old cwd still points into the (soon read-only) parent mount
    except OSError as e:
        fail("mount(scratch)", e)
    failed = ro_all({cwd}, spec.get("masks", ()))
    if failed:
        report(ro_failed="; ".join(failed))
        if spec.get("ro_strict"):
            fail("remount read-only", "; ".join(failed))
    masks, fds = spec.get("masks", ()), {}
    try:  # handles (in this mount namespace) on the workspace and the mount sources before a mask hides them
        fds[cwd] = os.open(".", os.O_PATH | os.O_DIRECTORY)
        for tgt, src, ro in spec.get("mounts", ()):
            fds[tgt] = os.open(src, os.O_PATH)
    except OSError as e:
        fail("open mount source", e)
    try:
        for m in masks:  # empty read-only tmpfs over /tmp, /run, /dev/shm, the scratch root: hides host sockets/files
            mount("tmpfs", m, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,nr_inodes=256,mode=755")
        if any(under(cwd, m) for m in masks):
            bind(cwd, False, True)
        for tgt, src, ro in spec.get("mounts", ()):
            bind(tgt, ro, under(tgt, cwd) or any(under(tgt, m) for m in masks))
        for m in masks:
            mount(None, m, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        for s in sockets:  # a host socket elsewhere: /dev/null over it (connect -> ECONNREFUSED)
            if os.path.exists(s):
                mount("/dev/null", s, None, MS_BIND)
        os.chdir(cwd)
    except OSError as e:
        fail("mount setup", e)
    for fd in fds.values():
        os.close(fd)
if "go_fd" in spec:  # the parent moves us into the call's cgroup meanwhile: nothing is forked before that
    if os.read(spec["go_fd"], 1) != b"1":
        fail("join cgroup", "the parent could not move the launcher into the call's cgroup")
    os.close(spec["go_fd"])
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
    if ROOT_IN_INIT:
        try:
            build_root(ROOT, "fresh")
        except OSError as e:
            fail("root filesystem", e)
    elif spec["ns"].get("mnt"):
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
        except OSError as e:
            fail("mount(/proc)", e)
    if spec.get("poll_memory"):  # no cgroup: init sums the RSS of every process of its pid namespace periodically
        limit, every = spec["poll_memory"]
        page = os.sysconf("SC_PAGE_SIZE")
        def poll(signum, frame):
            total = 0
            for p in os.listdir("/proc"):
                if p.isdigit():
                    try:
                        with open("/proc/%s/statm" % p) as f:
                            total += int(f.read().split()[1]) * page
                    except (OSError, ValueError, IndexError):
                        pass
            if total > limit:
                report(memory_total=total)
                signal.setitimer(signal.ITIMER_REAL, 0)
                os.kill(-1, signal.SIGKILL)  # every process of the namespace but init itself
        signal.signal(signal.SIGALRM, poll)
        signal.setitimer(signal.ITIMER_REAL, every, every)
def run_source(src):  # trusted tool code (Sandbox.run_source), run by this isolated, uid-dropped process itself
    os.environ.clear()
    os.environ.update(spec["env"])
    depth, f = 0, sys._getframe()
    while f is not None:  # the fork server's frames below us: give the source a fresh interpreter's headroom
        depth, f = depth + 1, f.f_back
    sys.setrecursionlimit(sys.getrecursionlimit() + depth)
    sys.argv[:] = ["-c"]  # as `python -I -S -c source` has it
    rc = 0
    try:
        code = globals().get("SOURCES", {}).get(src) or compile(src, "<sandbox-source>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            sys.stderr.write("%s\n" % (e.code,))
    except BaseException as e:
        rc = 1
        try:
            sys.stderr.write("Traceback: %s: %s\n" % (type(e).__name__, e))
        except BaseException:
            pass
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except BaseException:
            rc = rc or 120
    os._exit(rc & 0xFF)
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
        if spec.get("source") is not None:
            run_source(spec["source"])
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
PROBE_SRC = r'''
import json, os, socket, sys
port, sibling, sock_path, project, scratch = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], os.getcwd()
def blocked_connect(addr, family=socket.AF_INET):
    s = socket.socket(family, socket.SOCK_STREAM)
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
                  "unix": blocked_connect(sock_path, socket.AF_UNIX),
                  "tmp": blocked_write("/tmp"), "sibling": blocked_write(sibling),
                  "scratch_ok": not blocked_write(scratch) and not blocked_write("."), "pid": len(pids) <= 3,
                  "project_hidden": not os.path.exists(project)}))
'''
