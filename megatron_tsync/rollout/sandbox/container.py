"""The container sandbox backend: the namespace sandbox's call / workspace interface, with each call in a container.

``make_sandbox(backend)`` picks a backend; an environment (``envs.WorkspaceEnv``, ``HiddenTestVerifier``) can be
given either, since both expose the same API (``run`` / ``run_async`` / ``workspace`` / ``enforcement``, and
workspaces with ``path``, ``uid``, ``run``, ``run_async``, ``write_files``, ``read_file``, ``copy_in``, ``close``)::

    sb = make_sandbox("podman", SandboxConfig(wall_timeout_s=10), ContainerConfig())          # host rootfs
    sb = make_sandbox("podman", cfg, ContainerConfig(image="localhost/swebench-django:1"))    # a local image
    with sb.workspace(files={"a.py": "x = 1\\n"}) as ws:
        ws.run(["sh", "-c", "sed -i s/1/2/ a.py"]); ws.run(code="print(open('a.py').read())")
    sb.enforcement()                                        # {name: {"enforced", "how", "tested"}}
    sb.close()                                              # removes the host-rootfs dir (also at exit)

Each call is one ``podman run`` (see :mod:`.container_cli` for the exact command line and for the other
runtimes): the workspace (a host directory, a size-limited tmpfs when root, mode 0700, owned by a private uid) is
bind-mounted read-write at the same path and is the cwd; extra ``mounts={target: Mount(source, read_only)}`` are bound
too; ``--network none``; ``--memory``/``--memory-swap`` = ``total_memory_bytes`` and ``--pids-limit`` (cgroup of the
container); RLIMIT_CPU/DATA/FSIZE/NOFILE/NPROC/CORE from the :class:`.sandbox.SandboxConfig`; ``--user`` a private
uid (``1_500_000_000 + (pid % 100_000) * 1000 + slot``: disjoint from the namespace sandbox's uids); a read-only root
with private empty tmpfs dirs over /tmp, /var/tmp and /run. Only files persist across calls: each call is a new
container. The wall timeout and the output cap remove the container (``podman rm -f -t 0``), which kills every process
in it; every container is removed after its call, whatever the outcome; workspaces are removed on ``close()`` (and at
interpreter exit); containers, areas and rootfs dirs of dead owner pids are swept at start-up.

The root filesystem is an image (``ContainerConfig(image=...)``, e.g. a SWE-bench-style image already in the local
store: nothing is pulled, ``--pull never``), a directory (``rootfs=DIR``), or by default "host": an empty directory
holding the host's top-level symlinks (bin -> usr/bin, ...) with ``host_dirs`` (/usr, /etc, /opt) bound read-only,
so the host's interpreters and tools run with nothing else of the host visible. Those dirs are bound whole, which
is wider than the namespace sandbox's allow-list (:mod:`.rootfs`: a few /etc files, no /opt unless the interpreter
lives there); ``enforcement()["host_files"]`` says so. (``--rootfs /`` itself does not work
with runc: pivot_root of / fails with EBUSY, and sysfs / tmpfs targets shadow their own mount sources.)

Exit codes: a process killed by signal N is reported as ``-N`` (the runtime's status 128+N; a program that exits 129..
159 by itself is reported as a signal too); status 125, and 126/127 with the runtime's own ``Error:`` line, are setup errors.
An OOM kill (podman's ``State.OOMKilled``) is reported as the memory limit of the call; where the runtime does not
report it (runc on cgroup v1: measured), a SIGKILL nobody else sent is reported as "likely the memory limit".

The container's cgroup is the runtime's (podman with cgroupfs: ``libpod_parent/libpod-<id>`` at the top of each
hierarchy), not the rollout worker's: a cluster job's cgroup (SLURM) does not account the container's memory, only
``--memory`` bounds it. Rootless podman (not root: no ``--user``, no host tmpfs quota, no cgroup v1 limits) is
untested and reported so.

Measured on the development VM (Debian 12, root, cgroup v1 + a v2 hierarchy with one controller, no systemd):
podman 4.3.1 with crun 1.8.1 fails ("cgroups in hybrid mode not supported"), so the OCI runtime is runc when the
machine has such a hybrid hierarchy and runc is installed (``tools/install_podman.sh`` installs podman + runc).
Per-call overhead (``/bin/true``, median of 10 calls interleaved with the namespace sandbox, load ~6 on 2 cores):
podman 465-550 ms, the namespace sandbox 78-85 ms (podman client + conmon + runc start, then ``podman rm``).
Not tested here: docker (no daemon), apptainer/singularity and enroot (not packaged for Debian 12): their command
lines are written and their ``enforcement()`` entries are marked ``UNTESTED``.

Standard library only.
"""

from __future__ import annotations

import atexit
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import megatron_tsync.rollout.sandbox.container_cli as cli
import megatron_tsync.rollout.sandbox.fs as sandbox_fs
from megatron_tsync.rollout.sandbox.core import (_MEMORY_PATTERNS, CallRunner, Mount, Sandbox, SandboxConfig,
                                                 ToolResult, Workspace)
from megatron_tsync.rollout.sandbox.caps import ensure_root_dir
from megatron_tsync.rollout.sandbox.io import Pump, write_files

__all__ = ["BACKENDS", "ContainerConfig", "ContainerSandbox", "make_sandbox", "container_uids_in_use",
           "backend_table"]

BACKENDS = ("namespace", *cli.RUNTIMES)
UID_BASE = 1_500_000_000
UID_SLOTS = 1000
_INSTALL_HINT = {
    "podman": "apt-get install podman runc (or bash tools/install_podman.sh)",
    "docker": "install docker and start its daemon",
    "apptainer": "install apptainer (https://apptainer.org)", "singularity": "install apptainer or singularity",
    "enroot": "install enroot (https://github.com/NVIDIA/enroot)",
}
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()
_names = itertools.count()
_live: set["ContainerSandbox"] = set()


@dataclass(frozen=True)
class ContainerConfig:
    """Which container a :class:`ContainerSandbox` runs its calls in (limits come from :class:`SandboxConfig`)."""

    runtime: str = "podman"
    """podman (tested), docker, apptainer, singularity or enroot (command lines written, untested)."""
    image: str | None = None
    """A local image name (podman/docker), a .sif or sandbox dir (apptainer), a container name (enroot)."""
    rootfs: str | None = None
    """A root filesystem directory (``podman run --rootfs DIR``); default without an image: the host's (see module)."""
    host_dirs: tuple[str, ...] = ("/usr", "/etc", "/opt")
    """Host directories bound read-only into the default host rootfs (missing ones are skipped)."""
    python: str | None = None
    """The interpreter inside the container for ``code=`` calls; default the host's (host rootfs) or ``python3``."""
    oci_runtime: str | None = None
    """podman's OCI runtime (crun/runc); default: runc on a cgroup-v1/v2 hybrid machine where runc exists."""


def container_uids_in_use() -> set[int]:
    with _uid_lock:
        return set(_uids_in_use)


def make_sandbox(backend: str = "namespace", config: SandboxConfig | None = None,
                 container: ContainerConfig | None = None, **kwargs: Any):
    """The sandbox of `backend`: ``"namespace"`` (:class:`.sandbox.Sandbox`, the default) or a container runtime
    (:class:`ContainerSandbox`). Raises ValueError for an unknown backend, RuntimeError naming a missing binary."""
    if backend == "namespace":
        if container is not None:
            raise ValueError("make_sandbox: container= is only for a container backend, not 'namespace'")
        return Sandbox(config, **kwargs)
    if backend not in cli.RUNTIMES:
        raise ValueError(f"sandbox backend {backend!r}: want one of {', '.join(BACKENDS)}")
    c = container or ContainerConfig()
    if c.runtime != backend:
        c = ContainerConfig(**{**c.__dict__, "runtime": backend})
    return ContainerSandbox(config, c, **kwargs)


def backend_table(sb) -> str:
    """``sb.enforcement()`` of either backend as a markdown table (for notes and the README)."""
    rows = ["| what | enforced | how |", "|---|---|---|"]
    for k, v in sb.enforcement().items():
        rows.append(f"| {k} | {'yes' if v['enforced'] else 'no'} | {v['how']} |")
    return "\n".join(rows)


def _hybrid_cgroups() -> bool:
    """cgroup v1 controllers plus a v2 hierarchy with controllers of its own (crun refuses to run there)."""
    try:
        with open("/sys/fs/cgroup/unified/cgroup.controllers") as f:
            return bool(f.read().split())
    except OSError:
        return False


class ContainerSandbox(CallRunner):
    """Runs each call in a fresh container; same interface as :class:`.sandbox.Sandbox`. See the module docstring."""

    def __init__(self, config: SandboxConfig | None = None, container: ContainerConfig | None = None, *,
                 max_workers: int = 16):
        self.config = config or SandboxConfig()
        self.container = c = container or ContainerConfig()
        self.runtime = c.runtime
        if self.runtime not in cli.RUNTIMES:
            raise ValueError(f"ContainerConfig.runtime {self.runtime!r}: want one of {', '.join(cli.RUNTIMES)}")
        self.binary = cli.binary_for(self.runtime)
        if self.binary is None:
            raise RuntimeError(f"sandbox backend {self.runtime!r} needs the {self.runtime!r} binary, not found on "
                               f"PATH ({_INSTALL_HINT[self.runtime]})")
        if c.image and c.rootfs:
            raise ValueError("ContainerConfig: give image or rootfs, not both")
        if c.rootfs and not os.path.isdir(c.rootfs):
            raise ValueError(f"ContainerConfig.rootfs {c.rootfs!r} is not a directory")
        if self.runtime in ("docker", "enroot") and not c.image:
            raise ValueError(f"ContainerConfig: the {self.runtime} backend needs image= (it has no host rootfs)")
        self._max_workers = max_workers
        self.scratch_root = os.path.abspath(
            self.config.scratch_root or os.path.join(tempfile.gettempdir(), "megatron_tsync_container"))
        ensure_root_dir(self.scratch_root)
        sandbox_fs.sweep_stale(self.scratch_root)
        self.tmpfs_areas = os.geteuid() == 0 and sandbox_fs.can_mount_tmpfs(self.scratch_root)[0]
        self.cgroups = bool(self.config.use_cgroups)
        self.host_dirs = tuple(d for d in c.host_dirs if os.path.isdir(d)) if not (c.image or c.rootfs) else ()
        self.state_dir = tempfile.mkdtemp(prefix=f"state_{os.getpid()}_", dir=self.scratch_root)
        self.rootfs = c.rootfs or (self._host_rootfs() if not c.image else None)
        self.python = c.python or self._default_python()
        """Interpreter for Python code inside the container."""
        self._env = dict(os.environ)
        self.ulimits_applied = self.runtime == "podman"
        if self.runtime == "podman":
            conf = os.path.join(self.state_dir, "containers.conf")
            oci = c.oci_runtime or ("runc" if _hybrid_cgroups() and cli.binary_for("runc") else None)
            with open(conf, "w") as f:
                f.write(cli.containers_conf(self._ulimits(), oci, not os.path.isdir("/run/systemd/system")))
            self._env["CONTAINERS_CONF"] = conf
        self._caps = {"ro_root": True, "backend": self.runtime}  # extra mounts work (read by envs' hidden_mounts)
        self.closed = False
        self._sweep_containers()
        with _uid_lock:
            _live.add(self)

    # ------------------------------------------------------------------------------------------------ set-up
    def _host_rootfs(self) -> str:
        root = os.path.join(self.state_dir, "rootfs")
        os.makedirs(root, mode=0o755)
        for name in os.listdir("/"):
            p = os.path.join("/", name)
            if os.path.islink(p):  # merged-/usr links: bin -> usr/bin, lib64 -> usr/lib64, ...
                os.symlink(os.readlink(p), os.path.join(root, name))
        # runc gives a tmpfs the mode of its mount point: the first call would create /tmp 0755 (no sticky 1777)
        for d, mode in (("tmp", 0o1777), ("var/tmp", 0o1777), ("run", 0o755)):
            os.makedirs(os.path.join(root, d), exist_ok=True)
            os.chmod(os.path.join(root, d), mode)
        os.chmod(self.state_dir, 0o755)
        return root

    def _default_python(self) -> str:
        if self.host_dirs:
            real = os.path.realpath(sys.executable)
            if any(real.startswith(d + "/") for d in self.host_dirs):
                return real
            for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
                if os.path.exists(cand):
                    return cand
        return "python3"

    def _ulimits(self) -> dict[str, tuple[int, int]]:
        cfg = self.config
        cpu = max(1, int(cfg.cpu_seconds))
        return {"nofile": (cfg.max_open_files, cfg.max_open_files), "nproc": (cfg.max_processes, cfg.max_processes),
                "cpu": (cpu, cpu + 1), "data": (cfg.memory_bytes, cfg.memory_bytes),
                "fsize": (cfg.max_file_bytes, cfg.max_file_bytes), "core": (0, 0)}

    def _cmd(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run([self.binary, *args], env=self._env, capture_output=True, text=True, timeout=timeout)

    def _sweep_containers(self) -> None:
        """Remove containers of this machine's dead sandbox owners (e.g. after a SIGKILL of the worker)."""
        if self.runtime not in ("podman", "docker"):
            return
        try:
            p = self._cmd("ps", "-a", "--filter", "label=megatron_tsync.sandbox", "--format", "{{.Names}}")
        except (OSError, subprocess.TimeoutExpired):
            return
        for name in p.stdout.split():
            parts = name.split("-")
            if len(parts) == 3 and parts[1].isdigit() and not _pid_alive(int(parts[1])):
                self._remove(name)

    # ------------------------------------------------------------------------------------------------ reporting
    def enforcement(self) -> dict[str, dict[str, Any]]:
        """``{name: {"enforced": bool, "how": str, "tested": bool}}`` (same names as the namespace backend's)."""
        return cli.enforcement(self)

    capabilities = enforcement

    def workspace(self, files: Mapping[str, str | bytes] | None = None, copy_from: str | None = None, *,
                  disk_bytes: int | None = None, max_files: int | None = None) -> Workspace:
        """A persistent workspace: the namespace backend's :class:`.sandbox.Workspace` class, whose calls go through
        this sandbox's hooks (``CallRunner``)."""
        if self.closed:
            raise RuntimeError("ContainerSandbox is closed")
        return super().workspace(files, copy_from, disk_bytes=disk_bytes, max_files=max_files)

    # hooks used by sandbox.Workspace ----------------------------------------------------------------------
    def _acquire_uid(self) -> int | None:
        if os.geteuid() != 0 or self.runtime not in ("podman", "docker"):
            return None
        base = UID_BASE + (os.getpid() % 100_000) * UID_SLOTS
        with _uid_lock:
            for slot in range(UID_SLOTS):
                if base + slot not in _uids_in_use:
                    _uids_in_use.add(base + slot)
                    return base + slot
        raise RuntimeError(f"more than {UID_SLOTS} concurrent container calls and workspaces")

    def _release_uid(self, uid: int | None) -> None:
        if uid is not None:
            with _uid_lock:
                _uids_in_use.discard(uid)

    def _new_area(self, kind: str, uid: int | None, disk_bytes: int, max_files: int) -> str:
        return sandbox_fs.create_area(self.scratch_root, kind, uid, disk_bytes, max_files, self.tmpfs_areas)

    def _run_in(self, area, uid, argv, code, stdin, files, delay_s, env, mounts, t0) -> ToolResult:
        try:
            write_files(area, dict(files or {}), uid)
            spec = self._spec(area, uid, self._argv(argv, code, delay_s), env, mounts, stdin is not None)
        except ValueError as e:
            return ToolResult(False, "", "", None, str(e), time.monotonic() - t0)
        except OSError as e:
            return ToolResult(False, "", "", None, f"cannot write files into the sandbox: {e}", time.monotonic() - t0)
        return self._execute(spec, stdin, t0)

    def _argv(self, argv, code: str | None, delay_s: float) -> list[str]:
        if code is not None:
            cmd = [self.python, "-I", "-c", code]
        elif isinstance(argv, str):
            cmd = ["/bin/sh", "-c", argv]
        elif argv:
            cmd = [str(a) for a in argv]
        else:
            raise ValueError("ContainerSandbox.run needs argv or code")
        if delay_s > 0:  # a real sleep inside the container before the command (counts towards the wall timeout)
            cmd = ["/bin/sh", "-c", f'sleep {float(delay_s):.3f}; exec "$@"', "sh", *cmd]
        return cmd

    def _spec(self, area: str, uid: int | None, argv: list[str], env, mounts, interactive: bool) -> cli.CallSpec:
        cfg = self.config
        base_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": area, "TMPDIR": area, "LANG": "C.UTF-8",
                    "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
        base_env.update(env or {})
        binds = [(area, area, False)] + [(d, d, True) for d in self.host_dirs]
        for tgt, m in (mounts or {}).items():
            if not isinstance(m, Mount) or not os.path.isabs(tgt):
                raise ValueError(f"mounts: want {{absolute target: Mount(source, read_only)}}, got {tgt!r}: {m!r}")
            if not os.path.exists(m.source):
                raise ValueError(f"mounts: source {m.source!r} (for {tgt!r}) does not exist")
            if ":" in m.source or ":" in tgt or "," in m.source:
                raise ValueError(f"mounts: ':' or ',' in {m.source!r} -> {tgt!r} cannot be passed to {self.runtime}")
            binds.append((os.path.abspath(m.source), os.path.normpath(tgt), bool(m.read_only)))
        under_mask = any(self.scratch_root == d or self.scratch_root.startswith(d + "/") for d in cli.MASKED)
        return cli.CallSpec(
            name=f"mtsc-{os.getpid()}-{next(_names)}", argv=argv, env=base_env, workdir=area, mounts=binds,
            image=self.container.image, rootfs=self.rootfs, uid=uid, memory_total=cfg.total_memory_bytes,
            pids=cfg.max_processes + 1, network=cfg.network, interactive=interactive, ulimits=self._ulimits(),
            cgroups=self.cgroups, extra_tmpfs=[] if under_mask else [self.scratch_root], owner_label=str(os.getpid()))

    def _execute(self, spec: cli.CallSpec, stdin: str | bytes | None, t0: float) -> ToolResult:
        cfg = self.config
        argv = cli.build_argv(self.runtime, self.binary, spec)
        if self.runtime in ("podman", "docker") and self.container.image:
            argv.insert(2, "--pull=never")
        oci = self.runtime in ("podman", "docker")
        proc = subprocess.Popen(argv, env=self._env, cwd=self.state_dir, start_new_session=True,
                                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        oom = False
        try:
            data = stdin.encode() if isinstance(stdin, str) else stdin
            io = Pump(proc, data, cfg.max_output_bytes, t0 + cfg.wall_timeout_s)

            killers: list[subprocess.Popen] = []

            def kill() -> None:
                if proc.poll() is None and not killers:  # still running: a timeout or the output cap
                    if oci:  # not waited for here: the pump must go on draining the output meanwhile (a container
                        # blocked on a full pipe took 5 s to remove when nothing read it; 0.2 s while draining)
                        killers.append(subprocess.Popen(self._rm_argv(spec.name), env=self._env,
                                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                    else:
                        _killpg(proc.pid)

            io.loop(kill)
            for k in killers:
                k.wait()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _killpg(proc.pid)
                proc.wait()
            rc = proc.returncode
            if oci and rc == 137 and not io.timed_out:
                p = self._cmd("inspect", "--format", "{{.State.OOMKilled}}", spec.name)
                oom = p.stdout.strip() == "true"
        finally:
            for f in (proc.stdout, proc.stderr, proc.stdin):
                if f is not None:
                    f.close()
            if oci:
                self._remove(spec.name)
        return self._result(io, rc, oom, time.monotonic() - t0)

    def _rm_argv(self, name: str) -> list[str]:
        return [self.binary, "rm", "-f", *(["-t", "0"] if self.runtime == "podman" else []), name]

    def _remove(self, name: str) -> None:
        try:
            subprocess.run(self._rm_argv(name), env=self._env, capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def _result(self, io: Pump, rc: int | None, oom: bool, wall: float) -> ToolResult:
        cfg = self.config
        out, err = bytes(io.out).decode("utf-8", "replace"), bytes(io.err).decode("utf-8", "replace")
        exit_code = rc
        if rc is not None and 128 < rc < 160:
            exit_code = -(rc - 128)
        elif rc is not None and rc < 0:
            exit_code = rc
        last = err.strip().splitlines()[-1] if err.strip() else ""
        error: str | None = None
        if oom:
            error = f"memory limit of the call ({cfg.total_memory_bytes} bytes in total: OOM-killed in the container)"
        elif rc == 137 and self.cgroups and not (io.timed_out or io.truncated):
            # runc on cgroup v1 leaves State.OOMKilled false after an OOM kill (measured): say what it likely was
            error = (f"killed by SIGKILL: likely the memory limit of the call ({cfg.total_memory_bytes} bytes in "
                     f"total; {self.runtime} reported no OOM kill)")
        elif io.timed_out:
            error, exit_code = f"timeout after {cfg.wall_timeout_s:.1f}s", None
        elif io.truncated:
            error, exit_code = f"output truncated at {cfg.max_output_bytes} bytes", None
        elif self.runtime in ("podman", "docker") and (rc == 125 or rc in (126, 127) and last.startswith("Error: ")):
            error = f"container setup failed ({self.runtime} status {rc}): {last[7:]}"
        elif exit_code is not None and exit_code > 0 and _MEMORY_PATTERNS.search(err[-4096:].encode()):
            error = f"memory limit ({cfg.memory_bytes} bytes per process)"
        elif exit_code == -24:
            error = f"cpu time limit exceeded ({cfg.cpu_seconds}s)"
        elif exit_code == -25:
            error = f"file size limit exceeded ({cfg.max_file_bytes} bytes)"
        elif exit_code is not None and exit_code < 0:
            error = f"killed by signal {-exit_code}"
        elif exit_code != 0:
            error = f"exit code {exit_code}"
        return ToolResult(ok=error is None, stdout=out, stderr=err, exit_code=exit_code, error=error, wall_s=wall,
                          truncated=io.truncated)

    # ------------------------------------------------------------------------------------------------ closing
    def close(self) -> None:
        """Remove this sandbox's state (rootfs dir, containers.conf); later calls fail (close workspaces first)."""
        if self.closed:
            return
        self.closed = True
        sandbox_fs.remove_area(self.state_dir)
        with _uid_lock:
            _live.discard(self)

    def __enter__(self) -> "ContainerSandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, 9)
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _close_all() -> None:
    with _uid_lock:
        todo = list(_live)
    for sb in todo:
        sb.close()
