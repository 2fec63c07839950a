"""Sandbox containment tests: real subprocesses, real limits. A check the machine cannot enforce is skipped with the
reason reported by ``Sandbox.enforcement()``; every misbehaving call must leave a clear error and a healthy sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import resource
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from megatron_tsync.rollout.sandbox import _UID_BASE, _UID_SLOTS, Mount, Sandbox, SandboxConfig, ToolResult

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.timeout(60)


QUICK_S = 3.0  # the wall timeout of the `quick` sandbox, the one the timeout tests use


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    """A 60 s wall timeout: calls that are not about the timeout never depend on how busy the machine is (the CPU,
    memory, process and output limits stop the hostile ones)."""
    return Sandbox(SandboxConfig(wall_timeout_s=60.0, cpu_seconds=5, memory_bytes=512 << 20, max_output_bytes=65536,
                                 max_processes=16, max_file_bytes=1 << 20))


@pytest.fixture(scope="module")
def quick(sb) -> Sandbox:
    """`sb` with a short wall timeout, for the tests ABOUT the timeout: they assert on the mechanism (the result names
    the timeout, no process of the call survives it), never on an upper wall bound."""
    return Sandbox(dataclasses.replace(sb.config, wall_timeout_s=QUICK_S))


def require(sb: Sandbox, what: str) -> None:
    e = sb.enforcement()[what]
    if not e["enforced"]:
        pytest.skip(f"{what} not enforced on this machine: {e['how']}")


def assert_healthy(sb: Sandbox) -> None:
    r = sb.run(["echo", "still-alive"])
    assert r.ok and r.stdout == "still-alive\n" and r.error is None, r


def _live_pids(match) -> list[int]:
    """Non-zombie processes for which match(pid) holds, polled until there are none for up to 10 s (SIGKILL delivery
    is asynchronous: 10 s is far beyond its latency on a loaded machine, and short of the sleeps these tests look
    for, which therefore cannot pass the check by simply finishing)."""
    deadline = time.monotonic() + 10.0
    while True:
        found = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    if "\nState:\tZ" not in status and match(pid, status):
                        found.append(int(pid))
                except (OSError, ValueError):
                    pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def procs_with(marker: str) -> list[int]:
    return _live_pids(lambda pid, _: marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes())


def sandbox_uid_procs() -> list[int]:
    """Live processes under any of THIS process's sandbox uids (other test processes may run sandboxes too)."""
    lo = _UID_BASE + (os.getpid() % 100_000) * _UID_SLOTS
    return _live_pids(lambda _, st: lo <= int(st.split("\nUid:")[1].split()[0]) < lo + _UID_SLOTS)


@contextlib.contextmanager
def rendezvous(sb: Sandbox):
    """A host directory every call may write, for proving that calls ran AT THE SAME TIME without timing them: each
    call drops a file there and waits until all have (:func:`rendezvous_code`), which only ever happens when they are
    all alive at once. Yields ``(path, mounts)``: pass ``mounts`` to each call (the directory is bound at the same
    path inside; without a mount namespace the host path is visible as is)."""
    d = tempfile.mkdtemp(prefix="mtsb_rv_", dir="/tmp")
    os.chmod(d, 0o777)  # every call runs as its own private uid
    try:
        yield d, ({d: Mount(d, read_only=False)} if sb._caps["ro_root"] else None)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def rendezvous_code(d: str, me: str, n: int, then: str = "") -> str:
    """Python for a call: mark `me` arrived in `d`, wait for all `n` (exit 7 naming those that came after 30 s:
    the calls did not all run at once), then run `then`."""
    return (f"import os, sys, time\nopen(os.path.join({d!r}, {me!r}), 'w').close()\n"
            "deadline = time.monotonic() + 30\n"
            f"while len(os.listdir({d!r})) < {n}:\n"
            f"    if time.monotonic() > deadline:\n"
            f"        print('NOT TOGETHER', sorted(os.listdir({d!r}))); sys.exit(7)\n"
            "    time.sleep(0.005)\n" + then)


def wide(sb: Sandbox) -> Sandbox:
    """`sb` with a 60 s wall timeout: room for a rendezvous of calls that start far apart on a loaded machine."""
    return Sandbox(dataclasses.replace(sb.config, wall_timeout_s=60.0))


# ------------------------------------------------------------------------------------------------ basics
def test_enforcement_report_is_complete(sb):
    enf = sb.enforcement()
    for key in ("wall_timeout", "output_cap", "cpu", "memory", "file_size", "uid", "processes", "network",
                "filesystem", "kill_tree", "pid_namespace", "cgroups"):
        assert isinstance(enf[key]["enforced"], bool) and enf[key]["how"], key
    assert enf["wall_timeout"]["enforced"] and enf["output_cap"]["enforced"]


def test_normal_call_runs_in_fresh_scratch_dir_removed_afterwards(sb):
    r1 = sb.run(code="import os; open('f.txt', 'w').write('x'); print(os.getcwd()); print(os.listdir('.'))")
    r2 = sb.run(["sh", "-c", "pwd; ls -A"])
    assert r1.ok and r2.ok, (r1, r2)
    cwd1, cwd2 = r1.stdout.split()[0], r2.stdout.split()[0]
    assert cwd1 != cwd2 and cwd1.startswith(sb.scratch_root)
    assert r2.stdout.split()[1:] == []  # the second call does not see the first call's file
    assert not os.path.exists(cwd1) and not os.path.exists(cwd2)


def test_stdin_files_env_and_exit_code(sb):
    r = sb.run(["cat"], stdin="hello\n" * 10000)
    assert r.ok and r.stdout == "hello\n" * 10000
    r = sb.run(["sh", "-c", "cat data/in.txt; echo $FOO"], files={"data/in.txt": "abc\n"}, env={"FOO": "bar"})
    assert r.ok and r.stdout == "abc\nbar\n"
    r = sb.run(code="x = 1\n" * 5000 + "print('big', x)")  # > inline limit: goes through main.py
    assert r.ok and r.stdout == "big 1\n", r
    r = sb.run("echo out; echo err >&2; exit 3")
    assert not r.ok and r.exit_code == 3 and r.error == "exit code 3" and r.stdout == "out\n" and r.stderr == "err\n"


def test_bad_commands_return_errors_instead_of_raising(sb):
    r = sb.run(["definitely-not-a-command-xyz"])
    assert not r.ok and "command not found" in r.error
    r = sb.run()
    assert not r.ok and "argv or code" in r.error
    r = sb.run(["/nonexistent/binary"])
    assert not r.ok and r.exit_code == 127 and "cannot start" in r.stderr
    r = sb.run(["sh", "-c", "kill -SEGV $$"])
    assert not r.ok and r.exit_code == -11 and r.error == "killed by signal 11 (SIGSEGV)"
    assert_healthy(sb)


def test_delay_is_real_wall_clock_latency(sb):
    t = time.monotonic()
    r = sb.run(["echo", "x"], delay_s=0.4)
    assert r.ok and r.wall_s >= 0.4 and time.monotonic() - t >= 0.4


# ------------------------------------------------------------------------------------------------ network
@pytest.fixture
def listener():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    yield srv.getsockname()[1]
    srv.close()


CONNECT = """
import socket, sys
s = socket.socket(); s.settimeout(2)
try:
    s.connect((sys.argv[1], int(sys.argv[2]))); print("CONNECTED")
except OSError as e:
    print("FAILED", e.errno); sys.exit(1)
"""


def test_network_connection_to_local_open_port_fails(sb, listener):
    require(sb, "network")
    r = sb.run([sb.python, "-I", "-c", CONNECT, "127.0.0.1", str(listener)])
    assert not r.ok and "CONNECTED" not in r.stdout and r.stdout.startswith("FAILED"), r
    # Control: the same port is reachable when the config allows the network, so the failure above is the sandbox.
    open_sb = Sandbox(SandboxConfig(wall_timeout_s=60.0, network=True))
    r = open_sb.run([open_sb.python, "-I", "-c", CONNECT, "127.0.0.1", str(listener)])
    assert r.ok and r.stdout == "CONNECTED\n", r
    assert_healthy(sb)


def test_network_connection_to_public_ip_fails(sb):
    require(sb, "network")
    r = sb.run([sb.python, "-I", "-c", CONNECT, "1.1.1.1", "443"])
    assert not r.ok and "CONNECTED" not in r.stdout
    assert r.stdout.strip() == f"FAILED {errno.ENETUNREACH}", r  # no route at all, not a slow timeout
    assert_healthy(sb)


# ------------------------------------------------------------------------------------------------ filesystem
WRITE = """
import sys
for path in sys.argv[1:]:
    try:
        open(path, "w").write("pwned")
        print("WROTE", path)
    except OSError as e:
        print("DENIED", path, e.strerror)
"""


def test_writes_outside_scratch_fail(sb):
    require(sb, "filesystem")
    targets = [f"/tmp/sandbox_escape_{os.getpid()}", str(REPO / f"sandbox_escape_{os.getpid()}"),
               os.path.join(sb.scratch_root, f"escape_{os.getpid()}"), f"/dev/shm/sandbox_escape_{os.getpid()}",
               f"/var/tmp/sandbox_escape_{os.getpid()}"]
    r = sb.run([sb.python, "-I", "-c", WRITE, *targets, "inside.txt"])
    assert r.ok, r
    lines = r.stdout.splitlines()
    assert lines[-1] == "WROTE inside.txt"
    for path, line in zip(targets, lines):
        assert line.startswith(f"DENIED {path}"), r.stdout
        assert not os.path.exists(path)
    assert_healthy(sb)


def test_writes_into_another_running_sandbox_dir_fail(sb):
    require(sb, "filesystem")
    # the holder runs until the test releases it (a file in its own directory), not for a fixed time: under load the
    # second sandbox's start can take longer than any fixed sleep, and the holder's directory would be gone by then
    before = set(os.listdir(sb.scratch_root))
    holder: dict[str, ToolResult] = {}
    wait = "i=0; while [ ! -e release ] && [ $i -lt 1000 ]; do sleep 0.02; i=$((i+1)); done"
    t = threading.Thread(target=lambda: holder.setdefault("r", sb.run(["sh", "-c", wait])))
    t.start()
    deadline = time.monotonic() + 60
    other = None
    while other is None and time.monotonic() < deadline:
        new = [d for d in set(os.listdir(sb.scratch_root)) - before if d.startswith("call_")]
        other = os.path.join(sb.scratch_root, new[0]) if new else None
        time.sleep(0.01)
    assert other is not None
    os.chmod(other, 0o777)  # even with permissive bits, the mount layer must refuse the write
    target = os.path.join(other, "planted.txt")
    r = sb.run([sb.python, "-I", "-c", WRITE, target])
    exists = os.path.exists(target)
    open(os.path.join(other, "release"), "w").close()
    t.join()
    assert r.stdout.startswith(f"DENIED {target}"), r
    assert not exists and holder["r"].ok


# ------------------------------------------------------------------------------------------------ processes
def test_fork_bomb_is_contained_and_machine_stays_responsive(sb, quick):
    require(sb, "processes")
    r = quick.run(["bash", "-c", ":(){ :|:& };: ; sleep 600.4321"])
    # contained: stopped by the short wall timeout (bash's fork retries and the 600 s sleep would run on), every
    # process of it gone, and the next call works
    assert not r.ok and r.error == f"timeout after {QUICK_S:.1f}s" and r.exit_code is None, r
    assert_healthy(sb)  # responsive right after
    assert procs_with("600.4321") == [] and sandbox_uid_procs() == []


def test_process_count_is_capped(sb):
    require(sb, "processes")
    code = ("import subprocess\nps = []\nfor _ in range(40):\n    try: ps.append(subprocess.Popen(['sleep', '30']))\n"
            "    except OSError: pass\nprint(len(ps))\n")
    r = sb.run(code=code)
    assert r.ok, r
    assert 1 <= int(r.stdout) < 16  # RLIMIT_NPROC=16 counts the interpreter itself too
    assert sandbox_uid_procs() == []  # the sleeps died with the call


def test_sleep_forever_hits_wall_timeout_and_no_process_survives(sb, quick):
    marker = f"{time.time_ns() % 10**6}.25"
    t = time.monotonic()
    r = quick.run(["sh", "-c", f"setsid sleep {marker}1 & (trap '' TERM HUP; sleep {marker}2) & sleep {marker}3"])
    elapsed = time.monotonic() - t
    # killed at the wall timeout: the result says so (not an exit of its own), it lasted at least the timeout, and
    # (below) none of the sleeps, each meant to run for ~marker seconds, survived it
    assert not r.ok and r.error == f"timeout after {QUICK_S:.1f}s" and r.exit_code is None, r
    assert elapsed >= QUICK_S
    require(sb, "kill_tree")
    assert procs_with(marker) == [], "a sandboxed process survived the timeout"
    assert sandbox_uid_procs() == []
    assert_healthy(sb)


def test_kill_fallback_without_pid_namespace(sb, quick):
    """The path taken on machines without a pid namespace: process group + private-uid sweep."""
    require(sb, "uid")
    degraded = Sandbox(quick.config)
    degraded._caps = {**degraded._caps, "ns": {k: v for k, v in degraded._caps["ns"].items() if k != "pid"}}
    assert not degraded.enforcement()["pid_namespace"]["enforced"]
    marker = f"{time.time_ns() % 10**6}.5"
    r = degraded.run(["sh", "-c", f"setsid sleep {marker}1 & sleep {marker}2"])
    assert r.error == f"timeout after {QUICK_S:.1f}s"
    r = degraded.run(["sh", "-c", f"setsid sleep {marker}3 & echo ok"])
    assert r.ok and r.stdout == "ok\n"
    assert procs_with(marker) == [] and sandbox_uid_procs() == []


def test_background_processes_die_with_a_normal_exit(sb):
    marker = f"{time.time_ns() % 10**6}.75"
    r = sb.run(["sh", "-c", f"setsid sleep {marker} & echo started"])
    assert r.ok and r.stdout == "started\n", r  # ok: returned when sh exited, not at the wall timeout
    require(sb, "kill_tree")
    assert procs_with(marker) == []


# ------------------------------------------------------------------------------------------------ memory / cpu / output
def test_allocating_10gb_fails_with_memory_error(sb):
    r = sb.run(code="b = bytearray(10 * 2**30)\nprint('allocated')")
    assert not r.ok and "allocated" not in r.stdout
    assert r.error.startswith("memory limit"), r
    assert "MemoryError" in r.stderr
    assert_healthy(sb)


def test_cpu_limit_kills_busy_loop():
    busy = Sandbox(SandboxConfig(wall_timeout_s=60.0, cpu_seconds=1))
    r = busy.run(code="while True: pass")
    # the CPU limit ended it, not the 60 s wall timeout: a call past its wall deadline reports the timeout instead
    assert not r.ok and r.error == "cpu time limit exceeded (1s)", r
    assert_healthy(busy)


def test_file_size_limit(sb):
    r = sb.run(code="open('big', 'wb').write(b'x' * (2 << 20))")
    assert not r.ok and "File too large" in r.stderr, r


def test_printing_100mb_is_truncated_quickly_with_bounded_memory(sb):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the peak so far
    # the child logs each 64 KiB chunk it finished writing to stderr (a few bytes each, far below the cap)
    r = sb.run(code="import sys\nchunk = 'x' * 65536\n"
                    "for i in range(1600):\n    sys.stdout.write(chunk); sys.stderr.write('%d\\n' % i)\n")
    assert not r.ok and r.truncated and r.error == "output truncated at 65536 bytes", r.error
    assert len(r.stdout) == 65536 and r.exit_code is None
    # killed as soon as stdout went over the cap (the cap, the pipe's buffer and a write in flight: a few chunks),
    # not after writing its 100 MB, nor at the wall timeout (a timed-out call reports the timeout)
    written = r.stderr.split()
    assert written == [str(i) for i in range(len(written))] and len(written) < 16, r.stderr[-200:]
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 32 * 1024  # < 32 MiB growth
    assert sandbox_uid_procs() == []
    assert_healthy(sb)


def test_stderr_flood_is_truncated_too(sb):
    r = sb.run(["sh", "-c", "yes error-line >&2"])
    assert r.truncated and len(r.stderr) == 65536 and r.error == "output truncated at 65536 bytes"
    assert_healthy(sb)


# ------------------------------------------------------------------------------------------------ concurrency
def test_concurrent_calls_are_isolated_and_thread_safe(sb):
    results: list[ToolResult | None] = [None] * 8
    sb8 = wide(sb)

    with rendezvous(sb8) as (d, mounts):
        def work(i: int) -> None:  # all 8 calls wait for each other: they only return if they ran at the same time
            results[i] = sb8.run(code=rendezvous_code(d, str(i), 8, f"print({i}, os.getuid(), os.getcwd())\n"),
                                 mounts=mounts)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    sb8.close()
    assert all(r is not None and r.ok for r in results), results
    fields = [r.stdout.split() for r in results]
    assert [int(f[0]) for f in fields] == list(range(8))
    assert len({f[2] for f in fields}) == 8  # distinct scratch dirs
    if sb.enforcement()["uid"]["enforced"]:
        assert len({f[1] for f in fields}) == 8  # distinct private uids


def test_run_async_overlaps_calls(sb):
    sb4 = wide(sb)

    async def main(d, mounts):  # each call waits for the other three: all four were in flight at once
        return await asyncio.gather(*(sb4.run_async(code=rendezvous_code(d, str(i), 4, f"print({i})\n"),
                                                    mounts=mounts, delay_s=1.0) for i in range(4)))

    with rendezvous(sb4) as (d, mounts):
        rs = asyncio.run(main(d, mounts))
    sb4.close()
    assert [r.stdout for r in rs] == [f"{i}\n" for i in range(4)] and all(r.ok for r in rs), rs
    assert all(r.wall_s >= 1.0 for r in rs)  # the 1 s delay was real in each
