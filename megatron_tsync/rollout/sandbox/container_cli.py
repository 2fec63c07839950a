"""Command lines of the container runtimes behind :class:`.container.ContainerSandbox`, and what each enforces.

One :class:`CallSpec` (argv, env, cwd = the workspace, mounts, limits) becomes one runtime invocation:

- ``podman`` (TESTED on Debian 12, podman 4.3.1 + runc 1.1.5): ``podman run --name N --network none --memory M
  --memory-swap M --pids-limit P --user U:U --read-only --read-only-tmpfs=false --tmpfs /tmp,/var/tmp,/run
  (notmpcopyup) -v ws:ws:rw -v src:tgt:ro -w ws [--rootfs DIR | IMAGE] argv``. rlimits go through a generated
  ``containers.conf`` (``default_ulimits``; ``CONTAINERS_CONF``): podman 4.3.1 ignored ``--ulimit`` on the command
  line here (the OCI spec kept nofile=1048576, which crun/runc then failed to set without CAP_SYS_RESOURCE).
- ``docker`` (UNTESTED: no daemon on the development machine): the same flags less ``--rootfs`` (an image is needed),
  rlimits as ``--ulimit``.
- ``apptainer`` / ``singularity`` (UNTESTED: not installable from Debian 12): ``exec --containall --cleanenv
  --no-home --pwd ws --bind ws:ws:rw,src:tgt:ro [--net --network none] [--memory M --pids-limit P] IMAGE argv``; runs
  as the calling user (no uid switch); network and cgroup limits need root (or the site's setuid/cgroup setup).
- ``enroot`` (UNTESTED): ``enroot start --mount ws:ws --mount src:tgt:ro --env K=V NAME sh -c 'cd ws && exec argv'``;
  no network isolation, no memory/pids limits of its own (on clusters SLURM/pyxis's cgroup provides them), runs as
  the calling user.

Standard library only.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RUNTIMES", "TESTED", "CallSpec", "build_argv", "binary_for", "containers_conf", "enforcement"]

RUNTIMES = ("podman", "docker", "apptainer", "singularity", "enroot")
TESTED = {"podman": True, "docker": False, "apptainer": False, "singularity": False, "enroot": False}
MASKED = ("/tmp", "/var/tmp", "/run")
"""Directories that get an empty private tmpfs in each podman/docker container (host unix sockets live there)."""


@dataclass
class CallSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    workdir: str
    mounts: list[tuple[str, str, bool]]  # (source, target, read_only); the workspace is the first, read-write
    image: str | None
    rootfs: str | None
    uid: int | None
    memory_total: int
    pids: int
    network: bool
    interactive: bool
    ulimits: dict[str, tuple[int, int]] = field(default_factory=dict)
    cgroups: bool = True
    extra_tmpfs: list[str] = field(default_factory=list)
    owner_label: str = ""


def binary_for(runtime: str) -> str | None:
    """The runtime's binary on PATH, or None (``singularity`` falls back to ``apptainer`` and back)."""
    names = {"apptainer": ("apptainer", "singularity"), "singularity": ("singularity", "apptainer")}.get(
        runtime, (runtime,))
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    return None


def containers_conf(ulimits: dict[str, tuple[int, int]], runtime: str | None, cgroupfs: bool) -> str:
    """A ``containers.conf`` carrying the rlimits (and the OCI runtime / cgroup manager where needed)."""
    lim = ", ".join(f'"{k}={s}:{h}"' for k, (s, h) in ulimits.items())
    out = ["[containers]", f"default_ulimits = [{lim}]", "[engine]"]
    if cgroupfs:  # no systemd: podman's default systemd cgroup manager and journald events cannot work
        out += ['cgroup_manager = "cgroupfs"', 'events_logger = "file"']
    if runtime:
        out.append(f'runtime = "{runtime}"')
    return "\n".join(out) + "\n"


def _oci_common(s: CallSpec, tmpfs_opts: str = "") -> list[str]:
    a = ["--name", s.name, "--label", f"megatron_tsync.sandbox={s.owner_label}"]
    if not s.network:
        a += ["--network", "none"]
    if s.cgroups:
        a += ["--memory", str(s.memory_total), "--memory-swap", str(s.memory_total), "--pids-limit", str(s.pids)]
    if s.uid is not None:
        a += ["--user", f"{s.uid}:{s.uid}"]
    a += ["--read-only"]
    for d in (*MASKED, *s.extra_tmpfs):
        a += ["--tmpfs", f"{d}:rw,nosuid,nodev,size=16m,mode=1777{tmpfs_opts}"]
    for src, tgt, ro in s.mounts:
        a += ["-v", f"{src}:{tgt}:{'ro' if ro else 'rw'}"]
    a += ["-w", s.workdir]
    for k, v in s.env.items():
        a += ["--env", f"{k}={v}"]
    if s.interactive:
        a += ["-i"]
    return a


def _podman(binary: str, s: CallSpec) -> list[str]:
    # --init: catatonit is pid 1 (reaps, forwards signals), so the command is not the namespace's init, which would
    # ignore signals it has no handler for (a `kill -TERM $$` would do nothing)
    a = [binary, "run", "--init", "--read-only-tmpfs=false", "--passwd=false", "--no-hosts"]
    # notmpcopyup: by default the runtime copies the rootfs's content of a tmpfs target into it (with the host's /
    # as rootfs: all of the host's /tmp, 88 s measured here)
    a += _oci_common(s, ",notmpcopyup")
    a += ["--rootfs", s.rootfs] if s.rootfs else [s.image]
    return a + s.argv


def _docker(binary: str, s: CallSpec) -> list[str]:  # UNTESTED
    if s.rootfs:
        raise ValueError("docker has no --rootfs: give the container backend an image")
    a = [binary, "run"] + _oci_common(s)
    for k, (soft, hard) in s.ulimits.items():
        a += ["--ulimit", f"{k}={soft}:{hard}"]
    return a + [s.image] + s.argv


def _apptainer(binary: str, s: CallSpec) -> list[str]:  # UNTESTED
    a = [binary, "exec", "--containall", "--cleanenv", "--no-home", "--pwd", s.workdir]
    binds = [f"{src}:{tgt}:{'ro' if ro else 'rw'}" for src, tgt, ro in s.mounts]
    a += ["--bind", ",".join(binds)]
    if not s.network:
        a += ["--net", "--network", "none"]
    if s.cgroups:
        a += ["--memory", str(s.memory_total), "--pids-limit", str(s.pids)]
    for k, v in s.env.items():
        a += ["--env", f"{k}={v}"]
    return a + [s.rootfs or s.image] + s.argv


def _enroot(binary: str, s: CallSpec) -> list[str]:  # UNTESTED
    a = [binary, "start"]
    for src, tgt, ro in s.mounts:
        a += ["--mount", f"{src}:{tgt}" + (":ro" if ro else "")]
    for k, v in s.env.items():
        a += ["--env", f"{k}={v}"]
    return a + [s.image or s.rootfs, "/bin/sh", "-c", 'cd "$0" && exec "$@"', s.workdir] + s.argv


def build_argv(runtime: str, binary: str, spec: CallSpec) -> list[str]:
    builders = {"podman": _podman, "docker": _docker, "apptainer": _apptainer, "singularity": _apptainer,
                "enroot": _enroot}
    if runtime not in builders:
        raise ValueError(f"container runtime {runtime!r}: want one of {', '.join(RUNTIMES)}")
    return builders[runtime](binary, spec)


def enforcement(sb) -> dict[str, dict[str, Any]]:
    """What a :class:`ContainerSandbox` enforces: ``{name: {"enforced": bool, "how": str, "tested": bool}}``.

    "tested" is True only for rootful podman (what the test suite runs); the other runtimes' entries (and rootless
    podman's) say what their flags ask for, unverified."""
    cfg, rt = sb.config, sb.runtime
    root = os.geteuid() == 0
    tested = TESTED[rt] and root  # rootless podman (user namespace, no cgroup v1 limits) has not been run
    oci = rt in ("podman", "docker")
    out: dict[str, dict[str, Any]] = {}

    def put(name: str, ok: bool, how: str) -> None:
        out[name] = {"enforced": bool(ok), "how": ("" if tested else "UNTESTED: ") + how, "tested": tested}

    kill = (f"`{rt} rm -f -t 0` of the container" if oci else "SIGKILL of the runtime's process group")
    put("wall_timeout", True, f"parent: {kill} after {cfg.wall_timeout_s}s")
    put("output_cap", True, f"incremental 64 KiB reads; call killed once stdout or stderr exceeds "
                            f"{cfg.max_output_bytes} bytes")
    rl = oci and (rt == "docker" or sb.ulimits_applied)
    put("cpu", rl, f"RLIMIT_CPU={cfg.cpu_seconds}s per process" if rl else "no rlimits set by this runtime")
    put("memory", rl, f"RLIMIT_DATA={cfg.memory_bytes} bytes per process (podman has no RLIMIT_AS ulimit)"
        if rl else "no per-process limit")
    cg = sb.cgroups and rt != "enroot"
    put("memory_total", cg, f"--memory={cfg.total_memory_bytes} (+ --memory-swap, same) cgroup of the container: "
        "OOM kill inside" if cg else "no cgroup limit from the sandbox (use the cluster's job cgroup)")
    put("file_size", rl, f"RLIMIT_FSIZE={cfg.max_file_bytes} bytes" if rl else "no limit")
    put("disk_quota", sb.tmpfs_areas, f"the workspace is a host tmpfs of size={cfg.disk_bytes} bytes" if
        sb.tmpfs_areas else "no quota: the workspace is a plain directory (tmpfs needs root)")
    put("file_count", sb.tmpfs_areas, f"tmpfs nr_inodes={cfg.max_files}" if sb.tmpfs_areas else "no limit")
    uid_ok = oci and root
    put("uid", uid_ok, "--user to a private unprivileged uid per call / workspace (no capabilities)" if uid_ok else
        "runs as the calling user" + ("" if oci else " (the runtime has no uid switch)"))
    procs = cg or rl
    put("processes", procs, f"--pids-limit={cfg.max_processes + 1} of the container; RLIMIT_NPROC="
        f"{cfg.max_processes} of its private uid" if procs else "no limit")
    if cfg.network:
        put("network", False, "network allowed by config (network=True)")
    elif rt == "enroot":
        put("network", False, "enroot shares the host's network namespace")
    else:
        put("network", True, "--network none: a network namespace with loopback only"
            + ("" if oci else " (needs root or the site's setuid configuration)"))
    put("unix_sockets", oci, "private empty tmpfs over /tmp, /var/tmp, /run; a host rootfs exposes only "
        + ", ".join(sb.host_dirs) + " (read-only)" if oci else "host paths bound by the runtime's defaults")
    put("filesystem", oci, "read-only root (--read-only), read-only extra mounts; only the workspace and the "
        "private tmpfs dirs are writable" if oci else "runtime default (apptainer: read-only image; enroot: rw)")
    own = sb.container.image or sb.container.rootfs
    pkg = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the imported package
    exposed = [d for d in sb.host_dirs if pkg == d or pkg.startswith(d.rstrip("/") + "/")]
    put("host_files", bool(own) or not exposed, "the container's own root (image or rootfs dir): no host path but "
        "the workspace and extra mounts" if own else "host rootfs: " + ", ".join(sb.host_dirs) + " bound WHOLE "
        "(read-only; unlike the namespace sandbox's allow-list of rootfs.py, all of them are readable) and the "
        "imported package hidden by the environments' mount" + (f"; the package lies under {exposed[0]}" if exposed
                                                                else ""))
    put("pid_namespace", rt != "enroot", "the container's own pid namespace" if rt != "enroot" else "none")
    put("kill_tree", True, f"{kill}: every process of the container dies with it" if oci else
        "process group kill of the runtime")
    put("cgroups", cg, "cgroup of the container (podman: cgroupfs manager without systemd)" if cg else
        "not used")
    put("cleanup", True, ("container removed by `rm -f` after every call (also after a timeout), containers of dead "
                          "owners swept at start-up; " if oci else "") + "workspace area unmounted and removed")
    return out
