"""The sandbox's fork server: one warm interpreter per :class:`~.sandbox.Sandbox` that forks the launcher of each call.

Today's other launcher (``SandboxConfig(launcher="exec")``) starts ``python -I -S -c LAUNCHER_SRC`` per call, and a
Python tool then starts a second interpreter inside the sandbox: ~2 x 12 ms of CPU per call before any isolation work.
The fork server starts once (``python -I -S -c SERVER_SRC``, a minimal environment, stdin/stdout on /dev/null, its own
session), imports and compiles the launcher once, and per call::

    parent --(SOCK_SEQPACKET: spec, fds of stdin/stdout/stderr/status/go + a reply socket)--> server
    server: fork -> child: setsid(), sends its pid on the reply socket (the parent then admits it into the call's
                           cgroup, pumps its pipes, kills its group), fds moved to 0/1/2/3/4, every other fd
                           closed, chdir(area), exec(compiled LAUNCHER_SRC): the same code, the same isolation
    parent --("wait", pid)--> server: wait4(pid) -> exit status + the tree's CPU time on the reply socket

The server never reaps a launcher before the parent asked (as with Popen the pid, and so the process group id the
parent kills, cannot be reused while the parent uses it). ``Sandbox.run_source`` (the calculator) runs trusted tool
code in the target process itself (after the rlimits, setuid and NO_NEW_PRIVS) instead of execve'ing a second
interpreter; untrusted code (``code=``, argv) is always execve'd, so no memory of the server reaches it.
``SandboxConfig.preload`` names modules the server imports at its start (reasoning-gym for its scorer): a
``run_source`` target finds them warm. Such a source may hand untrusted DATA to them (the reasoning-gym scorer's
datasets ``eval`` answers), so what the target can read of the server's memory matters: the launcher, the preloaded
modules and the specs of this server's own earlier calls (argv, env, paths; never ``files=``). Give a preloading
sandbox one purpose, so those specs are only its own.
The server exits at EOF on its control socket (the owner closed it or died). Standard library only.
"""

from __future__ import annotations

import array
import marshal
import os
import socket
import subprocess
import sys
import threading

from megatron_tsync.rollout.sandbox.launcher import LAUNCHER_SRC

__all__ = ["ForkServer", "ForkedProc", "SERVER_SRC"]

_MAX_MSG = 1 << 18
_REPLY_TIMEOUT_S = 60.0

SERVER_SRC = r'''
import array, builtins, ctypes, fcntl, marshal, os, resource, signal, socket, sys, time
import ast, gc, math  # ast, math: what the built-in tool sources import, warm in every forked target
ctl = socket.socket(fileno=int(sys.argv[1]))
LAUNCHER = compile(sys.argv[2], "<sandbox-launcher>", "exec")
for name in filter(None, sys.argv[3].split(",")):  # SandboxConfig.preload: warm in every run_source target
    try:
        __import__(name)
    except BaseException as e:  # the source's own import then reports it, in the call's result
        os.write(2, ("sandbox fork server: preload %s: %s: %s\n" % (name, type(e).__name__, e)).encode())
SOURCES, replies = {}, {}
LIBC = ctypes.CDLL(None, use_errno=True)
def child(spec, cwd, roles, reply):
    try:
        os.setsid()  # first, so the group the parent kills exists once it has the pid (as with Popen)
        reply.send(marshal.dumps(os.getpid()))
        high = {k: fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for k, fd in roles.items()}
        if "stdin" not in high:
            high["stdin"] = fcntl.fcntl(os.open("/dev/null", os.O_RDONLY), fcntl.F_DUPFD, 64)
        for n, k in enumerate(("stdin", "stdout", "stderr", "status", "go")):
            if k in high:
                os.dup2(high[k], n)
        spec["status_fd"] = 3
        if "go" in high:
            spec["go_fd"] = 4
        os.closerange(5, 1 << 20)  # the control socket, the reply sockets of this and other calls, their pipes
        os.chdir(cwd)
        gc.disable()  # a collection would write to (copy) every page of the server's objects
        exec(LAUNCHER, {"spec": spec, "SOURCES": SOURCES, "LIBC": LIBC, "__builtins__": builtins,
                        "__name__": "__main__"})
    except BaseException as e:
        try:
            os.write(2, ("sandbox fork server: %s: %s\n" % (type(e).__name__, e)).encode())
        except BaseException:
            pass
    finally:
        os._exit(125)
def cpu(who):
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime
def reap(pid):
    reply = replies.pop(pid, None)
    try:
        _, st, ru = os.wait4(pid, 0)
        out = (st, ru.ru_utime + ru.ru_stime)
    except ChildProcessError:
        out = (None, 0.0)
    if reply is not None:
        try:
            reply.send(marshal.dumps(out + (cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN))))
        except OSError:
            pass  # the caller gave up waiting
        reply.close()
def spawn(spec, cwd, names, fds):
    roles = dict(zip(names, fds))
    reply = socket.socket(fileno=roles.pop("reply"))
    try:
        src = spec.get("source")
        if src is not None and src not in SOURCES:
            if len(SOURCES) >= 64:
                SOURCES.clear()
            try:
                SOURCES[src] = compile(src, "<sandbox-source>", "exec")
            except (SyntaxError, ValueError):
                pass  # compiled (and reported) in the target
        gc.freeze()  # what exists now stays out of the children's collections (fewer pages copied on write)
        pid = os.fork()
        if pid == 0:
            child(spec, cwd, roles, reply)
        replies[pid] = reply  # the child sends its pid on it (after setsid), the server the exit status later
    except BaseException:
        reply.close()  # the caller reads EOF (an error result for this call); the loop logs it and goes on
        raise
    finally:
        for fd in roles.values():
            os.close(fd)
while True:
    try:
        msg, anc, _, _ = ctl.recvmsg(MAX_MSG, socket.CMSG_SPACE(8 * 4))
    except InterruptedError:
        continue
    if not msg:
        os._exit(0)
    fds = array.array("i")
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    try:
        req = marshal.loads(msg)
        if req[0] == "wait":
            reap(req[1])
        else:
            spawn(req[1], req[2], req[3], list(fds))
    except Exception as e:
        os.write(2, ("sandbox fork server: request failed: %s: %s\n" % (type(e).__name__, e)).encode())
'''.replace("MAX_MSG", str(_MAX_MSG))


class ForkServer:
    """Parent side of one fork server (thread-safe). ``spawn`` returns a Popen-like :class:`ForkedProc`."""

    def __init__(self, python: str = sys.executable, preload: tuple[str, ...] = ()):
        """`preload`: modules the server imports once at its start (trusted code; its site-packages are then on the
        path: ``-I`` without ``-S``, single-threaded numeric libraries, the caller's ``HOME``)."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
        if preload:
            env.update({k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")},
                       MPLBACKEND="Agg", **({"HOME": os.environ["HOME"]} if "HOME" in os.environ else {}))
        flags = ["-I"] if preload else ["-I", "-S"]
        try:
            self.proc = subprocess.Popen(
                [python, *flags, "-c", SERVER_SRC, str(b.fileno()), LAUNCHER_SRC, ",".join(preload)],
                pass_fds=(b.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                env=env, start_new_session=True,
            )
        except BaseException:
            a.close()
            raise
        finally:
            b.close()
        self._ctl = a
        self._lock = threading.Lock()
        self.owner_pid = os.getpid()
        self.cpu_s = 0.0
        """CPU seconds of the server and of every launcher tree it reaped so far (user + sys)."""

    def alive(self) -> bool:
        return self.owner_pid == os.getpid() and self.proc.poll() is None

    def spawn(self, spec: dict, cwd: str, *, stdin: bool, status_fd: int, go_fd: int | None) -> "ForkedProc":
        """Fork a launcher for `spec` in `cwd` with pipes for stdin (if `stdin`), stdout and stderr; `status_fd` and
        `go_fd` (the caller's ends) are handed over and stay the caller's to close. Raises OSError/RuntimeError."""
        msg = marshal.dumps(("spawn", spec, cwd, ["reply", "stdout", "stderr", "status"]
                             + (["go"] if go_fd is not None else []) + (["stdin"] if stdin else [])))
        if len(msg) > _MAX_MSG:
            raise ValueError("command too long (pass large inputs via files= or stdin=)")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.settimeout(_REPLY_TIMEOUT_S)  # a server or child that died without a word cannot hang the call
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe() if stdin else (None, None)
        fds = [theirs.fileno(), out_w, err_w, status_fd] + ([go_fd] if go_fd is not None else []) \
            + ([in_r] if stdin else [])
        try:
            with self._lock:
                self._ctl.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except BaseException:
            for fd in (out_r, err_r, in_w):
                if fd is not None:
                    os.close(fd)
            mine.close()
            raise
        finally:
            theirs.close()
            for fd in (out_w, err_w, in_r):
                if fd is not None:
                    os.close(fd)
        try:
            data = mine.recv(64)
        except OSError:  # socket.timeout included
            data = b""
        if not data:
            for fd in (out_r, err_r, in_w):
                if fd is not None:
                    os.close(fd)
            mine.close()
            raise RuntimeError(f"sandbox fork server (pid {self.proc.pid}) is gone: {self.proc.poll()}")
        return ForkedProc(self, marshal.loads(data), mine, in_w, out_r, err_r)

    def _wait(self, pid: int, reply: socket.socket) -> tuple[int | None, float]:
        with self._lock:
            self._ctl.send(marshal.dumps(("wait", pid)))
        try:
            data = reply.recv(256)
        except OSError:
            data = b""
        reply.close()
        if not data:
            return None, 0.0
        st, tree_cpu, own, children = marshal.loads(data)
        self.cpu_s = own + children
        return st, tree_cpu

    def close(self) -> None:
        """Stop the server (EOF on its control socket); idempotent."""
        try:
            self._ctl.close()
        finally:
            if self.owner_pid == os.getpid():
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()


class ForkedProc:
    """A launcher forked by the server, with the ``subprocess.Popen`` surface the sandbox uses (pid, stdin, stdout,
    stderr, wait(), returncode)."""

    def __init__(self, server: ForkServer, pid: int, reply: socket.socket, in_w, out_r, err_r):
        self.server, self.pid, self._reply = server, pid, reply
        self.stdin = os.fdopen(in_w, "wb", 0) if in_w is not None else None
        self.stdout = os.fdopen(out_r, "rb", 0)
        self.stderr = os.fdopen(err_r, "rb", 0)
        self.returncode: int | None = None
        self.cpu_s = 0.0
        """CPU seconds (user + sys) of the launcher and every process of its tree, once waited for."""

    def wait(self) -> int | None:
        if self._reply is not None:
            reply, self._reply = self._reply, None
            st, self.cpu_s = self.server._wait(self.pid, reply)
            if st is not None:
                self.returncode = -os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)
        return self.returncode
