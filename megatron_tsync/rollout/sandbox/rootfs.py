"""The root filesystem of a sandboxed call: an ALLOW-LIST of host paths bound read-only onto a fresh, empty tmpfs.

The launcher (:data:`.launcher.LAUNCHER_SRC`) mounts a tmpfs, binds into it, at the same paths, only what
:func:`plan` lists, then ``pivot_root``s into it and detaches the host's root: nothing else of the host exists inside
a call (no /work, /root, /home, /opt, /var, /srv, /mnt, no other checkout, no ``.git``)::

    /usr, /bin, /sbin, /lib* ........ the system's binaries and libraries (merged-/usr symlinks are recreated as links)
    /etc/{passwd,group,hosts,...} ... the few files libc, the shell and Python read (ETC_FILES; nothing else of /etc)
    /dev/{null,zero,full,random,urandom}, /dev/{fd,stdin,stdout,stderr} -> /proc/self/fd/..., /dev/shm (empty)
    /proc ........................... a fresh proc of the call's own pid namespace (mounted by the call's init)
    the interpreter ................. each prefix of ``python`` (the venv's and its base's): pyvenv.cfg, bin/, lib*/;
                                      the stdlib and site-packages dirs where they lie elsewhere
    /tmp, /var/tmp, /run ............ empty and read-only (as the masks of the old deny-list); TMPDIR/HOME = the area
    the call's area (its cwd) ....... read-write, at its host path; extra ``mounts=`` at their targets
    everything else ................. absent (ENOENT); the tmpfs itself is read-only once built

The project's own source stays out even where a bound tree holds it (:func:`project_hides`): the imported package's
directory, and in every exposed site-packages dir the project's package, its ``*.dist-info`` / ``*.egg-info`` /
``*.egg-link``, its ``__editable__*`` finder and any ``.pth`` naming the project or a path holding it get an empty
read-only tmpfs (dirs) or ``/dev/null`` (files) over them: an editable install's ``.pth`` then adds nothing, a regular
install's copy reads as an empty directory. A ``.pth`` pointing into a checkout could not expose it anyway (the
checkout is not in the list); hiding it keeps ``python -I`` quiet.

Standard library only. The plan is computed once per process (``caps.detect_capabilities``) and passed to every
call's launcher in its spec (plain lists: marshal-able).
"""

from __future__ import annotations

import json
import os
import subprocess

__all__ = ["plan", "interpreter_paths", "project_hides", "SYSTEM_DIRS", "ETC_FILES", "DEVICES", "EMPTY_DIRS"]

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("passwd", "group", "hosts", "host.conf", "nsswitch.conf", "resolv.conf", "gai.conf", "ld.so.cache",
             "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "alternatives", "os-release", "mime.types",
             "protocols", "services", "locale.alias", "inputrc", "magic", "magic.mime", "fonts", "ssl", "pki",
             "ca-certificates", "ca-certificates.conf")
"""What of /etc a call sees (those that exist): name service and loader config, Debian's alternatives links (awk, vi,
... point there), fonts (matplotlib), the public CA certificates (for ``SandboxConfig(network=True)``; /etc/ssl/private
stays 0700 root), Python's own config dirs (``/etc/python3*``, added by :func:`plan`)."""
DEVICES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = (("/dev/fd", "/proc/self/fd"), ("/dev/stdin", "/proc/self/fd/0"), ("/dev/stdout", "/proc/self/fd/1"),
             ("/dev/stderr", "/proc/self/fd/2"))
EMPTY_DIRS = ("/tmp", "/var/tmp", "/run", "/dev/shm", "/proc")

_QUERY_SRC = r'''
import json, site, sys, sysconfig
pre = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
print(json.dumps({"prefixes": pre, "site": site.getsitepackages(pre),
                  "stdlib": [sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]}))
'''


def _under(p: str, d: str) -> bool:
    return p == d or p.startswith(d.rstrip("/") + "/")


def interpreter_paths(python: str) -> dict:
    """``{"prefixes", "site", "stdlib"}`` of `python` (asked of the interpreter itself, ``-I``: no environment)."""
    out = subprocess.run([python, "-I", "-c", _QUERY_SRC], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"})
    if out.returncode != 0:
        raise RuntimeError(f"cannot ask {python} for its paths: {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _links_to(path: str) -> list[str]:
    """Every hop of the symlink chain from `path` (the path itself first)."""
    hops, seen = [os.path.abspath(path)], set()
    while os.path.islink(hops[-1]) and hops[-1] not in seen and len(hops) < 40:
        seen.add(hops[-1])
        hops.append(os.path.normpath(os.path.join(os.path.dirname(hops[-1]), os.readlink(hops[-1]))))
    return hops


def _norm_name(name: str) -> str:
    return name.lower().replace("-", "_")


def project_hides(site_dirs, project: str, package_dir: str | None) -> list[list]:
    """``[[path, is_dir]]``: what of the project an exposed site-packages dir holds (see the module docstring)."""
    proj = _norm_name(project)
    out: dict[str, bool] = {}
    if package_dir:
        out[os.path.realpath(package_dir)] = True
    for d in site_dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            p, n = os.path.join(d, name), _norm_name(name)
            if (n == proj or (n.startswith(proj + "_") and n.endswith((".dist_info", ".egg_info", ".egg_link")))
                    or (n.startswith("__editable__") and proj in n)):
                out[p] = os.path.isdir(p) and not os.path.islink(p)
            elif n.endswith(".pth") and _pth_exposes(p, proj):
                out[p] = False
    return [[p, is_dir] for p, is_dir in sorted(out.items())]


def _pth_exposes(pth: str, proj: str) -> bool:
    """A .pth that names the project, or adds a directory holding its package to sys.path."""
    try:
        with open(pth, encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return False
    if proj in _norm_name(text):
        return True
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "import ", "import\t")):
            d = os.path.join(os.path.dirname(pth), line)
            if os.path.isdir(os.path.join(d, proj)):
                return True
    return False


def plan(python: str, at: str, project: str, package_dir: str | None, paths: dict | None = None) -> dict:
    """The root of every call for interpreter `python`: ``{"at", "binds", "links", "dirs", "hide"}``.

    ``at``: the (host) directory the launcher mounts the new root's tmpfs on, inside the call's mount namespace only;
    ``binds``: ``[[host path, is_dir, is_device]]``, bound read-only at the same path; ``links``: ``[[path, target]]``
    symlinks to create; ``dirs``: empty directories; ``hide``: ``[[path, is_dir]]`` overlays inside bound trees.
    `paths` is :func:`interpreter_paths` of `python` (asked when None)."""
    paths = paths if paths is not None else interpreter_paths(python)
    binds: dict[str, tuple[bool, bool]] = {}
    links: dict[str, str] = {}

    def covered(p: str) -> bool:
        return any(_under(p, b) for b in binds) or any(_under(p, ln) for ln in links)

    def add(p: str) -> None:
        """Bind host path `p` (a symlink as a link, then its target)."""
        p = os.path.normpath(p)
        if p == "/" or covered(p) or not os.path.lexists(p):
            return
        if os.path.islink(p):
            links[p] = os.readlink(p)
            add(os.path.join(os.path.dirname(p), links[p]))
            return
        for b in [b for b in binds if _under(b, p)]:
            del binds[b]  # a parent replaces binds below it
        binds[p] = (os.path.isdir(p), False)

    for d in SYSTEM_DIRS:
        add(d)
    for name in ETC_FILES + tuple(sorted(n for n in _listdir("/etc") if n.startswith("python3"))):
        add(os.path.join("/etc", name))
    for pre in dict.fromkeys(os.path.normpath(p) for p in paths["prefixes"]):
        if pre == "/":
            continue
        for part in ("pyvenv.cfg", "bin", "lib", "lib64", "lib32"):
            add(os.path.join(pre, part))
    for d in list(paths["stdlib"]) + list(paths["site"]):
        if d and os.path.isdir(d):
            add(d)
    for hop in _links_to(python):
        add(hop)
    for dev in DEVICES:
        p = "/dev/" + dev
        if os.path.exists(p):
            binds[p] = (False, True)
    for p, target in DEV_LINKS:
        links[p] = target
    site_dirs = [d for d in paths["site"] if os.path.isdir(d)]
    hides = [h for h in project_hides(site_dirs, project, package_dir) if covered(h[0])]
    return {"at": at, "binds": [[p, d, dev] for p, (d, dev) in sorted(binds.items())],
            "links": sorted([p, t] for p, t in links.items()), "dirs": list(EMPTY_DIRS), "hide": hides}


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []
