"""Runs one ``--harness-cmd`` episode and leaves no process behind (``runtime/harness.py`` starts it per episode).

    worker ──(own session)──► this supervisor (PR_SET_CHILD_SUBREAPER; PR_SET_PDEATHSIG: SIGTERM)
                                 └──(own session)──► /bin/sh -c CMD ──► whatever the harness starts

A process the harness starts stays a descendant of this supervisor whatever it does with its process group or
session (``setsid``, ``&``, a double fork): when its parent dies it is re-parented here, not to init. When the
command ends (it exits, or the worker sends SIGTERM at ``--harness-timeout``, or the worker dies), every process
below this one or still in the command's session is SIGKILLed and reaped, sweeping until none is left. The last line
on stdout is the report, JSON: ``rc`` (the command's exit status; None if it was stopped), ``left`` (those processes
found alive after the command ended or was stopped), ``killed`` (how many were SIGKILLed), ``subreaper`` (False where
``prctl`` is unavailable: then an orphan that also left the session, ``setsid`` after a double fork, escapes; the
worker logs so).

Not covered: a process that kills this supervisor (same user) or has a daemon outside the tree start one for it
(``systemd-run``, ``at``, ``ssh``). Run as a script (``python -I harness_reaper.py CMD``): standard library only.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
SWEEP_S = 10.0


class _Stop(Exception):
    pass


def _prctl(option: int, arg: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def targets(root: int, sid: int | None) -> dict[int, str]:
    """pid -> state letter of every process below `root`, or in session `sid` (the command's: found even where an
    orphan of it was re-parented to init), zombies included; from /proc."""
    children: dict[int, list[tuple[int, str]]] = {}
    out: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append((int(name), fields[0]))
        if sid is not None and int(fields[4]) == sid:
            out[int(name)] = fields[0]
    stack = [root]
    while stack:
        for pid, state in children.get(stack.pop(), ()):
            out[pid] = state
            stack.append(pid)
    return out


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def sweep(me: int, sid: int | None) -> tuple[int, int]:
    """(processes alive at the start, processes SIGKILLed): kill and reap until none of :func:`targets` is left."""
    left, killed = None, set()
    deadline = time.monotonic() + SWEEP_S
    while True:
        found = targets(me, sid)
        alive = [p for p, state in found.items() if state not in "ZX" and p != me]
        if left is None:
            left = len(alive)
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        _reap()
        if not found or time.monotonic() > deadline:
            return left, len(killed)
        time.sleep(0.001)


def main(cmd: str) -> int:
    def stop(signum, frame):
        raise _Stop

    signal.signal(signal.SIGTERM, stop)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the worker died before the line above
        return 1
    subreaper = _prctl(PR_SET_CHILD_SUBREAPER, 1)
    rc, sid = None, None
    try:
        proc = subprocess.Popen(["/bin/sh", "-c", cmd], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                start_new_session=True)
        sid = proc.pid
        while rc is None:  # reaping re-parented orphans while the command runs
            pid, status = os.waitpid(-1, 0)
            if pid == proc.pid:
                rc = proc.returncode = os.waitstatus_to_exitcode(status)
    except _Stop:  # the worker's SIGTERM: its timeout
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # from here on nothing stops the sweep
    left, killed = sweep(os.getpid(), None if subreaper else sid)  # a session id can be reused once it is empty
    sys.stdout.write(json.dumps({"rc": rc, "left": left, "killed": killed, "subreaper": subreaper}) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
