"""``Sandbox.enforcement()``: what a sandbox enforces with its config on this machine, from the probed capabilities.

Every entry is ``{"enforced": bool, "how": str}``; "how" says the mechanism (or why it is missing), with the numbers
of the config. Standard library only.
"""

from __future__ import annotations

from typing import Any

__all__ = ["enforcement", "backend_table"]


def enforcement(sb) -> dict[str, dict[str, Any]]:
    c, cfg, probe = sb._caps, sb.config, sb._caps.get("probe", {})
    ns = c["ns"]
    uid_ok = c["uid_drop"] and probe.get("uid", 0) != 0
    cg = sb._cgroups
    out: dict[str, dict[str, Any]] = {}

    def put(name: str, ok: bool, how: str) -> None:
        out[name] = {"enforced": bool(ok), "how": how}

    put("wall_timeout", True, f"parent kills the process group with SIGKILL after {cfg.wall_timeout_s}s")
    put("output_cap", True, f"incremental 64 KiB reads; tree killed once stdout or stderr exceeds "
                            f"{cfg.max_output_bytes} bytes")
    put("cpu", True, f"RLIMIT_CPU={cfg.cpu_seconds}s per process (SIGXCPU, then SIGKILL)")
    put("memory", True, f"RLIMIT_AS=RLIMIT_DATA={cfg.memory_bytes} bytes per process")
    hard = f"memory_bytes x max_processes = {cfg.memory_bytes * cfg.max_processes} bytes"
    poll = ns.get("pid") and ns.get("mnt")
    if cg is not None:
        how_mem = f"{sb._cgroup_note}: memory limit {cfg.total_memory_bytes} bytes for the whole call (OOM kill inside)"
    elif poll:
        how_mem = (f"no cgroup ({sb._cgroup_note}): the pid namespace's init sums the RSS of the call's processes "
                   f"every 50 ms and kills all above {cfg.total_memory_bytes} bytes (polled: a burst between polls "
                   f"is bounded only by {hard})")
    else:
        how_mem = f"no cgroup ({sb._cgroup_note}), no pid namespace: total bounded only by {hard}"
    put("memory_total", cg is not None or poll, how_mem)
    put("file_size", True, f"RLIMIT_FSIZE={cfg.max_file_bytes} bytes")
    put("disk_quota", c["tmpfs"], f"tmpfs area of size={cfg.disk_bytes} bytes (ENOSPC inside, host disk untouched)"
        if c["tmpfs"] else f"no quota: {c['tmpfs_note']}")
    put("file_count", c["tmpfs"], f"tmpfs nr_inodes={cfg.max_files} (ENOSPC inside)" if c["tmpfs"]
        else f"no limit: {c['tmpfs_note']}")
    put("uid", uid_ok, "setuid to a private unprivileged uid per call / workspace (+ setgroups([]), NO_NEW_PRIVS)"
        if uid_ok else "not dropped: " + ("not running as root" if not c["root"] else "; ".join(c["notes"])))
    nproc = f"RLIMIT_NPROC={cfg.max_processes} on the call's private uid" if uid_ok else ""
    if cg is not None and (cg.kind == "v2" or not uid_ok):
        nproc = (nproc + "; " if nproc else "") + f"pids.max={cfg.max_processes + 2} of the call's cgroup"
    put("processes", bool(nproc), nproc or "no private uid, no cgroup, and RLIMIT_NPROC " + (
        "is not enforced for root" if c["root"] else "would count every process of the invoking user"))
    if cfg.network:
        put("network", False, "network allowed by config (network=True)")
    elif ns.get("net") and probe.get("net"):
        put("network", True, "unshare(CLONE_NEWNET): empty network namespace, loopback down (probed)")
    else:
        put("network", False, "no network namespace on this machine: " + "; ".join(c["notes"]))
    rootfs = c.get("rootfs")
    sock_ok = bool(c["masks"] or rootfs) and probe.get("unix")
    if rootfs:
        how_sock = ("allow-list root: no host socket path exists inside but those under the bound system and "
                    "interpreter dirs, and /dev/null is bound over each of those listed in the host's /proc/net/unix "
                    "(probed: a 0777 socket in /tmp unreachable). Not covered: a socket bound inside a bound dir after "
                    "the call started")
    else:
        how_sock = ("empty read-only tmpfs over " + ", ".join(c["masks"]) + "; /dev/null bound over every other path "
                    "socket listed in the host's /proc/net/unix (probed: a 0777 socket in /tmp unreachable). Not "
                    "covered: a socket bound elsewhere after the call started, or one of another network namespace "
                    "outside the masked dirs")
    put("unix_sockets", sock_ok, how_sock if sock_ok else "host path sockets reachable: no mount namespace / masks")
    fs_ok = c["ro_root"] and probe.get("tmp") and probe.get("sibling") and probe.get("scratch_ok")
    if rootfs:
        fs_ok = fs_ok and probe.get("project_hidden")
        how_fs = (f"allow-list root (pivot_root into a tmpfs): {len(rootfs['binds'])} host paths bound read-only "
                  "(system dirs, a few /etc files, /dev nodes, the interpreter and its site-packages), "
                  f"{len(rootfs['hide'])} entries of the project hidden inside them, the call's area rw; nothing else "
                  "of the host exists (probed: /tmp and a 0777 sibling dir not writable, the project's package dir "
                  "absent)")
    else:
        how_fs = ("read-only host root (the allow-list root failed: see notes): every mount read-only except the "
                  "call's area; /tmp, /run, /dev/shm and other areas under empty masks; the rest of the host stays "
                  "READABLE (probed: /tmp and a 0777 sibling dir not writable)")
    if fs_ok and uid_ok:
        how_fs += "; plus unprivileged uid and 0700 areas"
    put("host_files", bool(rootfs) and probe.get("project_hidden"), "allow-list root: only the bound paths of the "
        "host exist inside a call; no checkout, .git, /root, /home, /work, /opt (see filesystem)" if rootfs else
        "NOT hidden: the read-only host root leaves every host file the call's uid may read readable (the "
        "environments still hide the imported package with a mount)")
    put("filesystem", bool(fs_ok), how_fs if fs_ok else
        "writes outside scratch not prevented (no read-only mount namespace); "
        + ("unprivileged uid only: world-writable dirs such as /tmp stay writable" if uid_ok else "none"))
    pid_ok = ns.get("pid") and probe.get("pid")
    kill_how = ("pid namespace: init death kills every process in it (incl. setsid escapees)" if pid_ok
                else "process group kill" + (" + SIGKILL of every process of the call's uid" if uid_ok else
                                             " only: a process that calls setsid() can escape"))
    if cg is not None:
        kill_how += "; + SIGKILL of every task in the call's cgroup"
    put("kill_tree", bool(pid_ok or uid_ok or cg is not None), kill_how)
    put("pid_namespace", bool(pid_ok), "unshare(CLONE_NEWPID) + private /proc" if pid_ok else "unavailable")
    put("cgroups", cg is not None, sb._cgroup_note)
    put("cleanup", True, "area: umount2(MNT_DETACH) + rmdir" + ("" if c["tmpfs"] else " / iterative tree removal")
        + "; cgroup emptied and removed; uid slot returned in its own finally; failures retried after each call")
    return out


def backend_table(sb) -> str:
    """The enforcement report as a markdown table (for notes and the README)."""
    rows = ["| what | enforced | how |", "|---|---|---|"]
    for k, v in enforcement(sb).items():
        rows.append(f"| {k} | {'yes' if v['enforced'] else 'no'} | {v['how']} |")
    return "\n".join(rows)
