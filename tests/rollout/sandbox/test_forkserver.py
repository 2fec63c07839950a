"""The fork-server launcher (the default) and ``run_source`` (the calculator runs in the isolated target itself):
every isolation property holds there too, with a control per test that shows the check can fail; the server's own
surface (its control socket, its environment, its lifetime) does not reach a call."""

import dataclasses
import os
import resource
import signal
import socket
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_tsync.rollout import tools
from megatron_tsync.rollout.sandbox import forkserver as sandbox_forkserver
from megatron_tsync.rollout.sandbox import Sandbox, SandboxConfig, uids_in_use
from tests.rollout.sandbox.test_sandbox import rendezvous, rendezvous_code, wide
from tests.conftest import until as _until

pytestmark = pytest.mark.timeout(120)

# a generous wall timeout: a fresh interpreter in new namespaces took > 3 s on a loaded 2-core machine (the exec path
# of the calculator test, one failed run); the timeout test makes its own short one (TIMEOUT_S)
CFG = dict(wall_timeout_s=30.0, cpu_seconds=3, memory_bytes=256 << 20, max_processes=16, disk_bytes=8 << 20,
           max_files=200, max_open_files=64, max_file_bytes=4 << 20, total_memory_bytes=384 << 20)
TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    s = Sandbox(SandboxConfig(**CFG))
    yield s
    s.close()


@pytest.fixture(scope="module", params=["fork-server", "exec"])
def any_sb(request, sb) -> Sandbox:
    """The isolation tests run on both launchers (exec: the old path, ``run_source`` as ``python -I -S -c``)."""
    if request.param == "fork-server":
        yield sb
    else:
        s = Sandbox(SandboxConfig(**CFG, launcher="exec"))
        yield s
        assert s._server is None


def need(sb: Sandbox, *what: str) -> None:
    caps = sb._caps
    ok = {"uid": caps["uid_drop"], "net": caps["ns"].get("net"), "pid": caps["ns"].get("pid"),
          "masks": bool(caps["masks"]), "tmpfs": caps["tmpfs"], "cgroups": sb._cgroups is not None}
    missing = [w for w in what if not ok[w]]
    if missing:
        pytest.skip(f"this machine cannot enforce {missing}")


def src(body: str) -> str:
    return textwrap.dedent(body)


def test_calculator_uses_the_fork_server_and_matches_the_exec_path(sb):
    exe = Sandbox(SandboxConfig(**CFG, launcher="exec"))
    # 991 nested minus signs: the recursion headroom of a fresh interpreter (the server's own frames do not count)
    for expr, want in [("37+18*4", "109"), ("7/2", "3.5"), ("1//0", None), ("__import__('os')", None),
                       ("-" * 991 + "1", "-1"), ("(" * 300 + "1" + ")" * 300, None)]:
        a = tools.execute_tool_call(tools.ToolCall("calculator", expr, (0, 0)), sb)
        b = tools.execute_tool_call(tools.ToolCall("calculator", expr, (0, 0)), exe)
        assert (a.ok, a.stdout, a.error) == (b.ok, b.stdout, b.error), (a, b)
        assert (a.stdout.strip() if a.ok else None) == want, a
    assert sb._server is not None and sb._server.alive()
    assert exe._server is None  # control: the exec launcher never starts a server
    # the calculator ran in the target itself (no second interpreter: its cmdline is the server's, not `-c SRC`)
    probe = "print(open('/proc/self/cmdline', 'rb').read().split(bytes(1))[4][:40])"
    r = sb.run_source(probe)
    assert r.ok and "import array, builtins" in r.stdout, r
    r = exe.run_source(probe)
    assert r.ok and "import array" not in r.stdout, r  # control: the exec path's target is a fresh interpreter


def test_bad_launcher_name_is_a_clear_error():
    with pytest.raises(ValueError, match="SandboxConfig.launcher"):
        Sandbox(SandboxConfig(launcher="zygote"))


def test_no_fd_of_the_server_reaches_a_call(sb, monkeypatch):
    probe = "import os\nprint(sorted(int(f) for f in os.listdir('/proc/self/fd')))"
    r = sb.run_source(probe)
    assert r.ok, r
    fds = eval(r.stdout)
    assert [f for f in fds if f > 2] in ([], [3]), fds  # 3: the listdir's own fd
    r = sb.run(code=probe)  # an exec'd target too
    assert r.ok and [f for f in eval(r.stdout) if f > 3] == [], r
    # control: the server itself holds its control socket (an fd > 2), and a server that forgot to close it in
    # the child would hand it to the call: the same probe sees it
    server_fds = os.listdir(f"/proc/{sb._server.proc.pid}/fd")
    assert any(int(f) > 2 for f in server_fds), server_fds
    leaky_src = sandbox_forkserver.SERVER_SRC.replace("os.closerange(5, 1 << 20)", "pass")
    assert leaky_src != sandbox_forkserver.SERVER_SRC
    monkeypatch.setattr(sandbox_forkserver, "SERVER_SRC", leaky_src)
    leaky = Sandbox(SandboxConfig(**CFG))
    try:
        r = leaky.run_source(probe)
        assert r.ok and [f for f in eval(r.stdout) if f > 4], r
    finally:
        leaky.close()


def test_environment_is_the_calls_not_the_servers_or_the_parents(sb, monkeypatch):
    monkeypatch.setenv("MTSB_SECRET", "s3cr3t")
    fresh = Sandbox(SandboxConfig(**CFG))  # its server starts now, with the secret in our environment
    try:
        r = fresh.run_source("import os\nprint(sorted(os.environ))", env={"MTSB_MINE": "1"})
        assert r.ok and "MTSB_SECRET" not in r.stdout and "MTSB_MINE" in r.stdout, r
        assert "s3cr3t" not in open(f"/proc/{fresh._server.proc.pid}/environ").read()
    finally:
        fresh.close()
    assert os.environ["MTSB_SECRET"] == "s3cr3t"  # control: the parent has it


def test_network_is_unreachable_from_run_source(any_sb):
    need(any_sb, "net")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    code = src(f"""
        import socket
        s = socket.socket(); s.settimeout(1)
        try:
            s.connect(("127.0.0.1", {port})); print("CONNECTED")
        except OSError as e:
            print("BLOCKED", e.errno)
        """)
    try:
        r = any_sb.run_source(code)
        assert r.ok and r.stdout.startswith("BLOCKED"), r
        r = Sandbox(SandboxConfig(**CFG, network=True)).run_source(code)  # control: with the network allowed
        assert r.ok and r.stdout.strip() == "CONNECTED", r
    finally:
        srv.close()


def test_host_files_and_unix_sockets_are_out_of_reach(any_sb, tmp_path):
    need(any_sb, "masks", "uid")
    path = f"/tmp/mtsb_fs_{os.getpid()}.sock"
    host = socket.socket(socket.AF_UNIX)
    host.bind(path)
    host.listen(1)
    os.chmod(path, 0o777)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    os.chmod(tmp_path, 0o755)
    code = src(f"""
        import os, socket
        s = socket.socket(socket.AF_UNIX); s.settimeout(1)
        try:
            s.connect({path!r}); print("SOCKET-CONNECTED")
        except OSError:
            print("SOCKET-BLOCKED")
        for d in ("/tmp", {str(open_dir)!r}, "/etc", "/root"):
            try:
                open(os.path.join(d, "x"), "w").write("x"); print("WROTE", d)
            except OSError as e:
                print("NOWRITE", d)
        open("mine.txt", "w").write("ok"); print("CWD-OK")
        """)
    try:
        r = any_sb.run_source(code)
        assert r.ok and "SOCKET-BLOCKED" in r.stdout and "WROTE" not in r.stdout and "CWD-OK" in r.stdout, r
        c = socket.socket(socket.AF_UNIX)
        c.connect(path)  # control: the socket is live on the host
        c.close()
        (open_dir / "y").write_text("y")  # control: the 0777 dir is writable outside the sandbox
    finally:
        host.close()
        os.unlink(path)


def test_per_call_uid_and_rlimits(any_sb):
    need(any_sb, "uid")
    code = src("""
        import os, resource
        print(os.getuid(), os.getgid(), os.getgroups(), resource.getrlimit(resource.RLIMIT_AS)[0],
              resource.getrlimit(resource.RLIMIT_NPROC)[0], resource.getrlimit(resource.RLIMIT_NOFILE)[0],
              resource.getrlimit(resource.RLIMIT_CPU)[0], resource.getrlimit(resource.RLIMIT_FSIZE)[0],
              open("/proc/self/status").read().split("NoNewPrivs:")[1].split()[0])
        """)
    sb4 = wide(any_sb)  # same limits and launcher, a 60 s wall timeout for the rendezvous
    # the 4 calls wait for each other before they print: they are alive at the same time, so a uid per call
    with rendezvous(sb4) as (d, mounts), ThreadPoolExecutor(4) as ex:
        rs = list(ex.map(lambda i: sb4.run_source(rendezvous_code(d, str(i), 4, code), mounts=mounts), range(4)))
    sb4.close()
    assert all(r.ok for r in rs), rs
    fields = [r.stdout.split(maxsplit=3) for r in rs]
    uids = {int(f[0]) for f in fields}
    assert len(uids) == 4 and all(u >= 2_000_000_000 for u in uids), fields  # a private uid per concurrent call
    rest = rs[0].stdout.split("]")[1].split()
    assert rest == [str(256 << 20), "16", "64", "3", str(4 << 20), "1"], rs[0].stdout
    # control: this process (the parent) is root with none of these limits
    assert os.getuid() == 0 and resource.getrlimit(resource.RLIMIT_AS)[0] != 256 << 20
    assert not uids_in_use()


def test_memory_cpu_file_size_and_disk_limits_in_run_source(any_sb):
    need(any_sb, "tmpfs")
    r = any_sb.run_source("x = bytearray(400 << 20)")  # above RLIMIT_AS (256 MiB)
    assert not r.ok and "memory" in r.error, r
    assert any_sb.run_source("x = bytearray(50 << 20); print('ok')").ok  # control: below it
    r = any_sb.run_source("while True: pass")
    assert not r.ok and ("cpu" in r.error or "timeout" in r.error), r
    r = any_sb.run_source("open('big', 'wb').write(b'x' * (6 << 20))")  # > RLIMIT_FSIZE 4 MiB
    assert not r.ok, r
    r = any_sb.run_source("for i in range(4): open('f%d' % i, 'wb').write(b'x' * (3 << 20))")  # 12 MiB > 8 MiB area
    assert not r.ok and "No space left" in r.stderr, r
    assert any_sb.run_source("open('f', 'wb').write(b'x' * (3 << 20)); print('ok')").ok  # control: within both


def test_timeout_kills_the_tree_and_orphans_are_gone(any_sb):
    need(any_sb, "pid")
    marker = f"mtsb_orphan_{os.getpid()}"
    code = src(f"""
        import os, subprocess, time
        subprocess.Popen(["sh", "-c", "sleep 3600; : {marker}"], start_new_session=True)
        print("started", flush=True)
        time.sleep(3600)
        """)
    short = Sandbox(dataclasses.replace(any_sb.config, wall_timeout_s=TIMEOUT_S))
    try:
        r = short.run_source(code)
    finally:
        short.close()
    # killed at the wall timeout: the call returned at all (it sleeps an hour), the result says it was the timeout,
    # and the orphan (which would sleep an hour too) is gone
    assert not r.ok and r.error == f"timeout after {TIMEOUT_S:.1f}s" and r.stdout == "started\n", r
    assert _until(lambda: not _pids_with(marker)), _pids_with(marker)  # SIGKILL lands asynchronously
    # control: the same orphan outside the sandbox does survive its parent (the check sees such a process)
    orphan = subprocess.Popen(["sh", "-c", f"sleep 60; : {marker}"], start_new_session=True)
    try:
        assert _until(lambda: _pids_with(marker))  # its cmdline shows up a moment after Popen returned
    finally:
        os.killpg(orphan.pid, signal.SIGKILL)
        orphan.wait()


def test_processes_are_capped(any_sb):
    code = src("""
        import os, time
        n = 0
        try:
            for _ in range(40):
                if os.fork() == 0:
                    time.sleep(2); os._exit(0)
                n += 1
        except OSError:
            pass
        print(n)
        """)
    r = any_sb.run_source(code)
    assert r.ok and int(r.stdout) < 16, r
    assert int(Sandbox(SandboxConfig(**{**CFG, "max_processes": 64})).run_source(code).stdout) == 40  # control


def test_concurrent_calls_and_cleanup(sb):
    with ThreadPoolExecutor(8) as ex:
        rs = list(ex.map(lambda i: tools.execute_tool_call(tools.ToolCall("calculator", f"{i}*{i}+1", (0, 0)), sb),
                         range(24)))
    assert [r.stdout.strip() for r in rs] == [str(i * i + 1) for i in range(24)], rs
    assert not uids_in_use()
    root = sb.scratch_root
    assert not [d for d in os.listdir(root) if d.startswith(f"call_{os.getpid()}_")], os.listdir(root)
    zombies = [p for p in os.listdir("/proc") if p.isdigit() and _ppid(p) == sb._server.proc.pid]
    assert not zombies, zombies  # every launcher was reaped


def test_server_survives_bad_requests_and_callers_that_gave_up(sb):
    import marshal

    srv = sb._fork_server()
    pid = srv.proc.pid
    with srv._lock:
        srv._ctl.send(b"not marshal")  # a request that fails to decode
        srv._ctl.send(marshal.dumps(("wait", 2 ** 22 + 12345)))  # a pid that is not its child
    spec_fail = sb.run_source("print('ok')", env={"X": "\0"})  # an env the launcher cannot execve/putenv
    assert not spec_fail.ok
    r = tools.execute_tool_call(tools.ToolCall("calculator", "6*7", (0, 0)), sb)
    assert r.ok and r.stdout.strip() == "42" and sb._server.proc.pid == pid and sb._server.alive(), r
    # control: a server that did crash is replaced (the pid check above would see it)
    os.kill(pid, signal.SIGKILL)
    srv.proc.wait()
    assert tools.execute_tool_call(tools.ToolCall("calculator", "1+1", (0, 0)), sb).ok and sb._server.proc.pid != pid


def test_server_restarts_after_a_crash_and_dies_with_its_owner(sb):
    srv = sb._fork_server()
    old = srv.proc.pid
    os.kill(old, signal.SIGKILL)
    srv.proc.wait(timeout=60)  # dead (the sandbox's liveness check polls this same Popen)
    r = tools.execute_tool_call(tools.ToolCall("calculator", "2+2", (0, 0)), sb)
    assert r.ok and r.stdout.strip() == "4" and sb._server.proc.pid != old, r
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from megatron_tsync.rollout.sandbox import Sandbox
        sb = Sandbox(); assert sb.run_source("print(1)").ok
        print(sb._server.proc.pid, flush=True); time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    pid = int(owner.stdout.readline())
    assert _alive(pid)  # control: alive while its owner lives
    owner.kill()
    owner.wait()
    assert _until(lambda: not _alive(pid))  # it dies with its owner (asynchronously)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _ppid(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError):
        return -1


def _pids_with(marker: str) -> list[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in open(f"/proc/{p}/cmdline", "rb").read():
                out.append(int(p))
        except OSError:
            pass
    return out
