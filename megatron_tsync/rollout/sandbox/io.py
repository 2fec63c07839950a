"""Moving bytes in and out of a sandboxed call: the stdin/stdout/stderr pump with the output cap and the deadline,
and writing caller-provided files into a call's area. Standard library only."""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from typing import Mapping

__all__ = ["Pump", "write_files"]

_READ_CHUNK = 65536


class Pump:
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
                while _running(self.proc.pid):
                    if time.monotonic() >= self.deadline:
                        self.timed_out = True
                        break
                    time.sleep(0.005)
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)


def _running(pid: int) -> bool:
    """The launcher has not exited (not reaped: waitid(WNOWAIT) on our child, else a signal 0 to the fork server's)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] != "Z"
        except (OSError, IndexError):
            return False


def write_files(area: str, files: Mapping[str, str | bytes], uid: int | None) -> None:
    """Write `files` (relative paths) into `area`; new files and directories are owned by `uid`. Raises ValueError
    for a path that escapes the area, OSError (e.g. ENOSPC over the quota) from the write."""
    for rel, content in files.items():
        path = os.path.normpath(os.path.join(area, rel))
        if not path.startswith(area + os.sep):
            raise ValueError(f"file path escapes the sandbox area: {rel!r}")
        d, made = os.path.dirname(path), []
        while not os.path.isdir(d):
            made.append(d)
            d = os.path.dirname(d)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
        if uid is not None:
            for p in [path] + made:
                os.lchown(p, uid, uid)
