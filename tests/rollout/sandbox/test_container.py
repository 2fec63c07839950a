"""The container sandbox backend with REAL podman containers (installed by tools/install_podman.sh where missing and
possible; skipped with the reason otherwise): output and exit codes, a workspace persisting across calls, no network,
the memory limit, the wall timeout, a read-only root, and nothing left behind (no container, area or process)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

import megatron_tsync.rollout.sandbox.container_cli as cli
from megatron_tsync.rollout.sandbox import Mount, Sandbox, SandboxConfig
from megatron_tsync.rollout.sandbox.container import (UID_BASE, UID_SLOTS, ContainerConfig, ContainerSandbox,
                                                       container_uids_in_use, make_sandbox)

ROOT = Path(__file__).resolve().parents[3]
INSTALL = ROOT / "tools" / "install_podman.sh"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def podman() -> str:
    """podman on PATH (tools/install_podman.sh installs it where it is missing, as root with apt-get)."""
    if shutil.which("podman") is None and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        pytest.skip("podman is not installed (and installing it needs root and apt-get): container backend untested")
    p = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        pytest.skip(f"podman could not be installed: {p.stderr.strip()[-500:]}")
    return shutil.which("podman")


CFG = dict(cpu_seconds=5, memory_bytes=1 << 30, total_memory_bytes=128 << 20, max_processes=32,
           max_file_bytes=8 << 20, disk_bytes=16 << 20, max_files=2000)
QUICK_S = 4.0  # the wall timeout of the `quick` sandbox, the one the timeout tests use


@pytest.fixture(scope="module")
def sb(podman) -> ContainerSandbox:
    """A 60 s wall timeout: calls that are not about the timeout never depend on how busy the machine is (the CPU,
    memory and output limits stop the hostile ones)."""
    s = make_sandbox("podman", SandboxConfig(wall_timeout_s=60.0, **CFG))
    yield s
    s.close()


@pytest.fixture(scope="module")
def quick(podman) -> ContainerSandbox:
    """The same limits with a short wall timeout, for the tests ABOUT the timeout (they assert on the mechanism: the
    error names the timeout, nothing of the call is left)."""
    s = make_sandbox("podman", SandboxConfig(wall_timeout_s=QUICK_S, **CFG))
    yield s
    s.close()


def my_containers(sb: ContainerSandbox) -> list[str]:
    p = sb._cmd("ps", "-a", "--filter", f"label=megatron_tsync.sandbox={os.getpid()}", "--format", "{{.Names}}")
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def my_areas(sb: ContainerSandbox) -> list[str]:
    return [n for n in os.listdir(sb.scratch_root) if n.split("_")[1:2] == [str(os.getpid())]
            and not n.startswith("state_")]


def my_uid_procs() -> list[int]:
    lo, out = UID_BASE + (os.getpid() % 100_000) * UID_SLOTS, []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            st = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if lo <= int(st.split("\nUid:")[1].split()[0]) < lo + UID_SLOTS and "\nState:\tZ" not in st:
            out.append(int(pid))
    return out


def assert_nothing_left(sb: ContainerSandbox) -> None:
    assert my_containers(sb) == [] and my_areas(sb) == [] and container_uids_in_use() == set()
    assert my_uid_procs() == []


# ------------------------------------------------------------------------------------------------ no podman needed
def test_make_sandbox_selects_a_backend_and_names_a_missing_binary(monkeypatch):
    assert type(make_sandbox("namespace", SandboxConfig())) is Sandbox
    with pytest.raises(ValueError, match="want one of namespace, podman, docker"):
        make_sandbox("lxc")
    monkeypatch.setenv("PATH", "/nonexistent")
    for backend in ("podman", "enroot", "apptainer"):
        with pytest.raises(RuntimeError, match=f"needs the '{backend}' binary, not found on PATH"):
            make_sandbox(backend)


def test_untested_runtimes_command_lines_ask_for_the_isolation():
    spec = cli.CallSpec(name="mtsc-1-0", argv=["echo", "hi"], env={"HOME": "/w"}, workdir="/w",
                        mounts=[("/w", "/w", False), ("/src", "/t", True)], image="img:1", rootfs=None, uid=7,
                        memory_total=1 << 20, pids=9, network=False, interactive=False, ulimits={"nproc": (8, 8)})
    docker = " ".join(cli.build_argv("docker", "docker", spec))
    for flag in ("--network none", "--memory 1048576", "--memory-swap 1048576", "--pids-limit 9", "--user 7:7",
                 "--read-only", "-v /w:/w:rw", "-v /src:/t:ro", "-w /w", "--ulimit nproc=8:8", "img:1 echo hi"):
        assert flag in docker, flag
    app = " ".join(cli.build_argv("apptainer", "apptainer", spec))
    assert "--containall" in app and "--net --network none" in app and "--bind /w:/w:rw,/src:/t:ro" in app
    enroot = cli.build_argv("enroot", "enroot", spec)
    assert enroot[-3:] == ["/w", "echo", "hi"] and "/src:/t:ro" in enroot
    with pytest.raises(ValueError, match="docker has no --rootfs"):
        cli.build_argv("docker", "docker", cli.CallSpec(**{**spec.__dict__, "rootfs": "/r"}))


# ------------------------------------------------------------------------------------------------ real containers
def test_enforcement_report_names_the_namespace_backends_keys(sb):
    enf = sb.enforcement()
    for key in ("wall_timeout", "output_cap", "cpu", "memory", "memory_total", "file_size", "disk_quota", "uid",
                "processes", "network", "unix_sockets", "filesystem", "kill_tree", "pid_namespace", "cgroups",
                "cleanup"):
        assert enf[key]["enforced"] and enf[key]["tested"] and enf[key]["how"], (key, enf[key])


def test_output_exit_code_and_signal(sb):
    r = sb.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.ok, r.stdout, r.stderr, r.exit_code, r.error) == (False, "out\n", "err\n", 3, "exit code 3"), r
    r = sb.run(code="import os; print(os.getuid(), os.getcwd() == os.environ['HOME'])", stdin="")
    assert r.ok and r.exit_code == 0, r
    uid, same = r.stdout.split()
    assert UID_BASE <= int(uid) < UID_BASE + 100_000 * UID_SLOTS and same == "True"
    r = sb.run(["sh", "-c", "kill -TERM $$"])
    assert r.exit_code == -15 and not r.ok, r
    r = sb.run(["cat"], stdin="piped in")
    assert r.ok and r.stdout == "piped in", r
    r = sb.run(["/no/such/binary"])
    assert not r.ok and r.error, r


def test_workspace_edit_in_call_1_is_visible_in_call_3_and_to_no_other(sb):
    with sb.workspace(files={"pkg/calc.py": "def add(a, b):\n    return a - b\n"}) as ws, sb.workspace() as other:
        r1 = ws.run(["sed", "-i", "s/a - b/a + b/", "pkg/calc.py"])
        r2 = ws.run(["sh", "-c", "ls pkg; echo note > notes.txt"])
        r3 = ws.run(code="import sys; sys.path.insert(0, 'pkg'); import calc; print(calc.add(2, 3))")
        assert r1.ok and r2.ok and r3.ok, (r1, r2, r3)
        assert r2.stdout == "calc.py\n" and r3.stdout == "5\n"
        assert ws.read_file("notes.txt") == b"note\n" and os.stat(Path(ws.path) / "notes.txt").st_uid == ws.uid
        # controls: a stateless call and another workspace do not see it (not mounted, other uid)
        r = sb.run(["sh", "-c", "ls -A; cat pkg/calc.py"])
        assert r.stdout == "" and not r.ok, r
        r = other.run(["cat", os.path.join(ws.path, "pkg", "calc.py")])
        assert not r.ok and "a + b" not in r.stdout, r
        path = ws.path
    assert not os.path.exists(path)


def test_no_network_host_listeners_unreachable(sb, tmp_path):
    srv, usrv = socket.socket(), socket.socket(socket.AF_UNIX)
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    os.chmod(tmp_path, 0o777)
    sock_path = str(tmp_path / "s")  # under /tmp, where host sockets live
    usrv.bind(sock_path)
    os.chmod(sock_path, 0o777)
    usrv.listen(4)
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # controls: reachable from the host
        c = socket.socket(socket.AF_UNIX)
        c.connect(sock_path)
        c.close()
        code = ("import socket\nfor a in [('127.0.0.1', %d), ('1.1.1.1', 53)]:\n    try:\n"
                "        socket.create_connection(a, timeout=2); print('reached', a)\n"
                "    except OSError as e: print('blocked', e.errno)\n"
                "try:\n    socket.socket(socket.AF_UNIX).connect(%r); print('reached unix')\n"
                "except OSError as e: print('blocked', e.errno)\n"
                "print(open('/proc/net/dev').read().count(':'))") % (port, sock_path)
        r = sb.run(code=code)
    finally:
        srv.close()
        usrv.close()
    assert r.ok and "reached" not in r.stdout and r.stdout.count("blocked") == 3, r
    assert r.stdout.split()[-1] == "1", r  # one interface: lo


def test_rlimits_and_disk_quota(sb):
    r = sb.run(code="import resource as r\nfor n in 'CPU FSIZE NOFILE NPROC DATA CORE'.split():\n"
                    "    print(*r.getrlimit(getattr(r, 'RLIMIT_' + n)))")
    want = [(5, 6), (8 << 20,) * 2, (256,) * 2, (32,) * 2, (1 << 30,) * 2, (0, 0)]
    assert r.ok and r.stdout == "".join(f"{a} {b}\n" for a, b in want), r
    with sb.workspace() as ws:  # disk_bytes = 16 MiB: the workspace's tmpfs is full before 24 MiB are written
        r = ws.run(["sh", "-c", "for i in 1 2 3; do head -c 8000000 /dev/zero > f$i || exit 7; done"])
        assert r.exit_code == 7 and "No space left on device" in r.stderr, r


def test_memory_limit_of_the_call(sb):
    r = sb.run(code="b = bytearray(16 << 20); print('ok')")
    assert r.ok and r.stdout == "ok\n", r  # control: well under the limit
    r = sb.run(code="b = bytearray(400 << 20); b[::4096] = b'x' * len(b[::4096]); print('allocated')")
    assert not r.ok and "allocated" not in r.stdout and "memory limit" in r.error, r
    r = sb.run(code="b = bytearray(3 << 30)")  # over RLIMIT_DATA (1 GiB per process): MemoryError
    assert not r.ok and r.error == f"memory limit ({1 << 30} bytes per process)", r


def test_timeout_kills_the_container(sb, quick):
    marker = f"{time.time_ns() % 10**6}.25"
    t0 = time.monotonic()
    r = quick.run(["sh", "-c", f"sleep {marker} & sleep {marker}; echo never"])
    # killed at the wall timeout: the result says so, it lasted at least the timeout, nothing of it is left (below)
    assert not r.ok and r.error == f"timeout after {QUICK_S:.1f}s" and r.exit_code is None, r
    assert "never" not in r.stdout, r
    assert time.monotonic() - t0 >= QUICK_S
    left = [p for p in filter(str.isdigit, os.listdir("/proc"))
            if marker.encode() in _cmdline(p)]
    assert left == [] and my_containers(quick) == []
    r = quick.run(["echo", "alive"], delay_s=0.5)
    assert r.ok and r.stdout == "alive\n" and r.wall_s >= 0.5, r


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_read_only_root_private_tmp_and_read_only_mounts(sb, tmp_path):
    (tmp_path / "data.txt").write_text("hidden input\n")
    os.chmod(tmp_path, 0o755)
    probe = f"mtsc_probe_{os.getpid()}"
    r = sb.run(["sh", "-c", f"cat /in/data.txt; touch /in/new || echo ro-mount; touch /etc/{probe} || echo ro-etc; "
                            f"touch /usr/{probe} || echo ro-usr; touch /tmp/{probe} && echo tmp-ok; ls /work || "
                            "echo no-work"], mounts={"/in": Mount(str(tmp_path), read_only=True)})
    assert r.stdout.split("\n")[:6] == ["hidden input", "ro-mount", "ro-etc", "ro-usr", "tmp-ok", "no-work"], r.stderr
    assert not os.path.exists(f"/etc/{probe}") and not os.path.exists(f"/tmp/{probe}")
    assert not (tmp_path / "new").exists()


def test_output_cap_and_processes(sb):
    r = sb.run(code="import sys\nwhile True: sys.stdout.write('x' * 65536)")
    assert r.truncated and not r.ok and "output truncated" in r.error and len(r.stdout) <= 65536, r
    # each thread blocks until the process exits, so all the threads made are alive at once
    threads = ("import threading\nts, never = [], threading.Event()\nfor i in range(%d):\n"
               "    t = threading.Thread(target=never.wait, daemon=True); t.start(); ts.append(t)\n"
               "print('made', len(ts))")
    r = sb.run(code=threads % 8)
    assert r.ok and r.stdout == "made 8\n", r  # control
    r = sb.run(code=threads % 100)
    assert not r.ok and "made 100" not in r.stdout and "can't start new thread" in r.stderr, r  # 32 tasks at most


def test_an_environment_runs_on_the_container_backend(sb):
    """swe-lite with its tools AND its hidden-test verifier in containers: the known fix gets 1, doing nothing 0."""
    import asyncio

    from megatron_tsync.rollout.envs.base import run_scripted
    from megatron_tsync.rollout.envs.swe_lite import SweLiteEnv, generate_task
    from megatron_tsync.rollout.envs.verifier import HiddenTestVerifier

    verifier_sb = make_sandbox("podman", SandboxConfig(wall_timeout_s=60.0, cpu_seconds=30, memory_bytes=2 << 30,
                                                       total_memory_bytes=2 << 30, max_output_bytes=4 << 20))
    try:
        env = SweLiteEnv(sandbox=sb, verifier=HiddenTestVerifier(sandbox=verifier_sb))
        task = generate_task(0, 1)
        fixed, _ = asyncio.run(run_scripted(env, task, env.render_solution(task)))
        nothing, _ = asyncio.run(run_scripted(env, task, [env.format.render_call("submit", {})]))
    finally:
        verifier_sb.close()
    assert fixed.reward == 1.0 and nothing.reward == 0.0, (fixed.reason, nothing.reason)


def test_nothing_left_behind(sb, quick):
    for _ in range(3):
        with sb.workspace(files={"a": "1"}) as ws:
            ws.run(["sh", "-c", "sleep 60 & echo bg"])
    assert quick.run(["sleep", "30"]).error == f"timeout after {QUICK_S:.1f}s"  # a timeout
    assert_nothing_left(sb)
    assert_nothing_left(quick)


def test_close_removes_the_sandbox_state_and_containers_of_dead_owners_are_swept(sb):
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"mtsc-{dead.pid}-0"
    p = sb._cmd("create", "--name", name, "--label", f"megatron_tsync.sandbox={dead.pid}", "--rootfs", sb.rootfs,
                "/bin/true")
    assert p.returncode == 0, p.stderr
    listed = sb._cmd("ps", "-a", "--filter", f"label=megatron_tsync.sandbox={dead.pid}", "--format", "{{.Names}}")
    assert listed.stdout.split() == [name]  # control: the leak check sees a left-over container
    s = ContainerSandbox(SandboxConfig(wall_timeout_s=5.0), ContainerConfig())
    listed = sb._cmd("ps", "-a", "--filter", f"label=megatron_tsync.sandbox={dead.pid}", "--format", "{{.Names}}")
    assert listed.stdout.split() == []
    assert s.run(["true"]).ok
    state = s.state_dir
    assert os.path.isdir(os.path.join(state, "rootfs"))
    s.close()
    assert not os.path.exists(state)


@pytest.fixture(scope="module")
def tiny_image(podman, tmp_path_factory) -> str:
    """A local image holding only dash and its libraries (`podman import`: no registry, no network)."""
    root = tmp_path_factory.mktemp("image_root")
    (root / "bin").mkdir()
    shutil.copy("/usr/bin/dash", root / "bin" / "sh")
    libs = subprocess.run(["ldd", "/usr/bin/dash"], capture_output=True, text=True, check=True).stdout
    for lib in {w for w in libs.split() if w.startswith("/")}:
        (root / lib.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.realpath(lib), root / lib.lstrip("/"))
    name = f"localhost/mtsc-test-{os.getpid()}:1"
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    p = subprocess.run(["podman", "import", "-", name], stdin=tar.stdout, capture_output=True, text=True,
                       timeout=120)
    tar.wait()
    assert p.returncode == 0, p.stderr
    yield name
    subprocess.run(["podman", "rmi", "-f", name], capture_output=True, timeout=120)


def test_a_local_image_as_the_root_filesystem(tiny_image):
    s = make_sandbox("podman", SandboxConfig(wall_timeout_s=10.0), ContainerConfig(image=tiny_image))
    try:
        with s.workspace(files={"f": "from host\n"}) as ws:
            r = ws.run(["/bin/sh", "-c", "read x < f; echo $x; echo made > g; "
                                         "test -e /usr/bin/python3 || echo isolated; exit 4"])
            assert (r.stdout, r.exit_code) == ("from host\nisolated\n", 4), r  # the image's files, not the host's
            assert ws.read_file("g") == b"made\n"
        r = s.run(["/bin/sh", "-c", "sleep 1"])
        assert r.exit_code == 127 and "not found" in r.stderr and "setup failed" not in r.error, r  # not in image
    finally:
        s.close()
    missing = make_sandbox("podman", SandboxConfig(), ContainerConfig(image="localhost/mtsc-no-such-image:0"))
    r = missing.run(["/bin/sh", "-c", "true"])  # --pull=never: a clear error, no registry look-up
    missing.close()
    assert not r.ok and r.error.startswith("container setup failed (podman status 125)"), r
