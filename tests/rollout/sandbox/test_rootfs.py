"""The sandbox's root is an allow-list (issue 45 item 2): from a tool call, walk everything visible (``os.walk("/")``
minus /proc and /sys) and find no checkout of the project, no ``.git``, no copy of the swe-lite generator's source
(its answer key), none of the decoy "other checkouts" planted where the old deny-list root left the host readable;
the interpreter and its site-packages still work (pytest, reasoning-gym import), the project itself does not, also
when a copy of it is installed inside site-packages. On the old root (read-only host + masks) the walk finds the
checkouts, their ``.git`` and the decoys (checked by running this module against the code before the change)."""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import sys
from pathlib import Path

import pytest

import megatron_tsync.rollout.envs.swe_lite_templates as templates
from megatron_tsync.rollout.envs.workspace_tools import hidden_mounts
from megatron_tsync.rollout.sandbox import Sandbox, SandboxConfig
from tests.rollout.sandbox.test_sandbox import require

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(300)

# Runs inside the call (python -I -S). Input on stdin (never on disk, never in argv): what to look for. Prints JSON.
WALK = r'''
import json, os, sys, time
a = json.loads(sys.stdin.read())
needles, decoys = [n.encode() for n in a["needles"]], set(a["decoys"])
SCAN = (".py", ".pyc", ".pyi", ".txt", ".md", ".json", ".cfg", ".toml", ".orig", ".bak", ".diff", ".patch")
found = {"git": [], "decoy": [], "named": [], "needle": []}
files, deadline, complete = 0, time.monotonic() + a["budget_s"], True
for root, dirs, names in os.walk("/"):
    if root == "/":
        dirs[:] = [d for d in dirs if d not in ("proc", "sys")]
    dirs.sort()
    if time.monotonic() > deadline:
        complete = False
        break
    for d in dirs:
        if d == ".git" or (d in ("refs", "objects") and "HEAD" in names):  # a work tree's or a bare repository's
            found["git"].append(os.path.join(root, d))
        if d in decoys:
            found["decoy"].append(os.path.join(root, d))
    for n in names:
        p = os.path.join(root, n)
        files += 1
        if n in (".git", "HEAD"):
            found["git"].append(p)
        if "swe_lite_templates" in n:
            found["named"].append(p)
        if not needles or (not n.endswith(SCAN) and "." in n):
            continue
        try:
            st = os.lstat(p)
            if not 0 < st.st_size < (4 << 20) or (st.st_mode & 0o170000) != 0o100000:
                continue
            with open(p, "rb") as f:
                data = f.read()
        except OSError:
            continue
        if any(x in data for x in needles):
            found["needle"].append(p)
print(json.dumps({"found": found, "files": files, "complete": complete}))
'''


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    return Sandbox(SandboxConfig(wall_timeout_s=280.0, cpu_seconds=280, max_output_bytes=1 << 20))


def needles() -> list[str]:
    """Distinctive phrases of the generator's source (its docstring: in every copy, its .pyc and older versions)."""
    src = Path(templates.__file__).read_text()
    out = ["The function library swe-lite builds its packages from", "the known fix is the string replacement"]
    assert all(n in src for n in out), "the needles must come from the generator's source"
    return out


@pytest.fixture
def decoys():
    """"Other checkouts" of the project (a ``.git`` with HEAD/refs/objects, the generator's source) where the old root
    left the host readable: beside the package in the repository root, under /var/lib, in $HOME. Yields their names."""
    made = []
    name = f"tsync_decoy_{secrets.token_hex(6)}"
    for parent in (REPO, Path("/var/lib"), Path.home()):
        d = parent / name
        try:
            (d / ".git" / "refs" / "heads").mkdir(parents=True)
        except OSError:
            continue
        made.append(d)
        (d / ".git" / "objects").mkdir()
        (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        envs = d / "megatron_tsync" / "rollout" / "envs"
        envs.mkdir(parents=True)
        shutil.copy(templates.__file__, envs / "swe_lite_templates.py")
        for p in [d, *d.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)  # readable by anyone: only the mount layer may hide them
    assert made, "no decoy could be planted"
    yield name, made
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def require_allow_list(sb: Sandbox) -> None:
    """Skip where the machine cannot build the allow-list root (no mount namespace), as ``enforcement()`` says."""
    require(sb, "filesystem")
    e = sb.enforcement().get("host_files")  # (absent before the allow-list: nothing to skip, the checks must fail)
    if e is not None and not e["enforced"]:
        pytest.skip(f"host files not hidden on this machine: {e['how']}")


def walk(sb: Sandbox, search: list[str], decoy_names: list[str], budget_s: float) -> dict:
    """The walk from a workspace tool call (with the mounts the workspace tools pass)."""
    with sb.workspace(files={"repo/a.py": "x = 1\n"}) as ws:
        r = ws.run([sb.python, "-I", "-S", "-c", WALK], mounts=hidden_mounts(sb),
                   stdin=json.dumps({"needles": search, "decoys": decoy_names, "budget_s": budget_s}))
    assert r.ok, r
    return json.loads(r.stdout)


def test_no_checkout_git_or_decoy_is_visible_from_a_tool_call(sb, decoys):
    require_allow_list(sb)
    name, made = decoys
    out = walk(sb, [], [name], budget_s=200)
    found = out["found"]
    assert found["decoy"] == [] and found["git"] == [] and found["named"] == [], found
    assert out["complete"] and out["files"] > 1000, out  # the walk saw the whole (allowed) tree: /usr at least
    # control: the read-only host root (the old deny-list, still the fallback) shows the decoy beside the package
    open_sb = Sandbox(sb.config)
    open_sb._caps = {**open_sb._caps, "rootfs": None}
    assert not open_sb.enforcement()["host_files"]["enforced"]
    r = open_sb.run(["/bin/sh", "-c", 'for d in "$@"; do test -e "$d/.git/HEAD" && echo "$d"; done', "sh",
                     *map(str, made)], mounts=hidden_mounts(open_sb))
    shown = set(r.stdout.split())
    assert shown and shown <= {str(d) for d in made}, r
    if not REPO.is_relative_to("/tmp"):  # the fallback mounts its own /tmp: a checkout under /tmp is hidden there too
        assert str(REPO / name) in shown, r


@pytest.mark.slow
def test_no_file_anywhere_holds_the_generators_source(sb, decoys):
    """Every readable text/.py/.pyc file of the call's view (~2 GB here) searched for the generator's docstring."""
    require_allow_list(sb)
    name, _ = decoys
    out = walk(sb, needles(), [name], budget_s=250)
    assert out["complete"], out
    assert all(v == [] for v in out["found"].values()), out["found"]


CHECK_IMPORTS = r'''
import importlib, json, os, sys
out = {}
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
        out[m] = "ok"
    except Exception as e:
        out[m] = "%s: %s" % (type(e).__name__, e)
print(json.dumps(out))
'''


@pytest.mark.parametrize("module", ["pytest", pytest.param("reasoning_gym", marks=pytest.mark.slow)])
def test_the_interpreter_and_its_site_packages_work_but_not_the_project(sb, module):
    """pytest (the verifier's), reasoning_gym (its scoring moves into the sandbox; ~10 s to import here, so slow)
    import with ``python -I``; the project, installed editable here, does not: its .pth / finder / dist-info are
    hidden and the checkout is not there."""
    require_allow_list(sb)
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed in this interpreter")
    r = sb.run([sb.python, "-I", "-c", CHECK_IMPORTS, module, "megatron_tsync"])
    assert r.ok and "Error processing" not in r.stderr and ".pth" not in r.stderr, r  # a hidden .pth: no error
    got = json.loads(r.stdout)
    assert got[module] == "ok", got
    assert got["megatron_tsync"].startswith("ModuleNotFoundError"), got
    # the checkout itself is not there; where the venv lives inside it (`.venv` of a clone, as in CI) its folder
    # exists only as the mount point's parent, holding nothing but the venv
    r = sb.run(["/bin/sh", "-c", 'test -e "$0" && echo VISIBLE; ls -A "$1" 2>/dev/null; echo done',
                os.path.dirname(templates.__file__), str(REPO)])
    inside = sys.prefix.startswith(f"{REPO}{os.sep}")
    venv_in_repo = os.path.relpath(sys.prefix, REPO).split(os.sep)[0] if inside else None
    assert r.ok and r.stdout == (f"{venv_in_repo}\n" if venv_in_repo else "") + "done\n", r


def test_a_copy_installed_inside_site_packages_is_hidden(sb, tmp_path):
    """A regular (non-editable) install of the project in a site-packages dir the root exposes, its dist-info, an
    editable install's .pth / finder and a .pth pointing into a checkout are overlaid with empty ones; the other
    entries of the same dir stay readable."""
    from megatron_tsync.rollout.sandbox import rootfs

    require_allow_list(sb)
    site, checkout = tmp_path / "site-packages", tmp_path / "checkout"
    (site / "megatron_tsync" / "rollout" / "envs").mkdir(parents=True)
    shutil.copy(templates.__file__, site / "megatron_tsync" / "rollout" / "envs" / "swe_lite_templates.py")
    (site / "megatron_tsync-0.1.0.dist-info").mkdir()
    (site / "megatron_tsync-0.1.0.dist-info" / "RECORD").write_text("megatron_tsync/__init__.py\n")
    (site / "__editable__.megatron_tsync-0.1.0.pth").write_text("import __editable___megatron_tsync_0_1_0_finder\n")
    (site / "__editable___megatron_tsync_0_1_0_finder.py").write_text(f"MAPPING = {{'x': {str(checkout)!r}}}\n")
    (checkout / "megatron_tsync").mkdir(parents=True)
    (site / "local.pth").write_text(f"{checkout}\n")
    (site / "other.pth").write_text("/nonexistent/dir\n")
    (site / "otherpkg").mkdir()
    (site / "otherpkg" / "__init__.py").write_text("X = 1\n")
    for p in [tmp_path, *tmp_path.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    paths = rootfs.interpreter_paths(sb.python)
    paths["site"] = [*paths["site"], str(site)]
    plan = rootfs.plan(sb.python, sb.scratch_root, "megatron_tsync", None, paths=paths)
    hidden = {os.path.basename(p) for p, _ in plan["hide"] if p.startswith(str(site))}
    assert hidden == {"megatron_tsync", "megatron_tsync-0.1.0.dist-info", "__editable__.megatron_tsync-0.1.0.pth",
                      "__editable___megatron_tsync_0_1_0_finder.py", "local.pth"}, plan["hide"]
    probe = Sandbox(sb.config)
    probe._caps = {**probe._caps, "rootfs": plan}
    r = probe.run(["/bin/sh", "-c", 'cd "$0" && ls -A megatron_tsync megatron_tsync-0.1.0.dist-info && '
                   'cat *.pth *_finder.py && echo ---; cat otherpkg/__init__.py; test -e "$1" || echo gone',
                   str(site), str(checkout)])
    assert r.ok, r
    assert r.stdout == ("megatron_tsync:\n\nmegatron_tsync-0.1.0.dist-info:\n/nonexistent/dir\n---\nX = 1\ngone\n"), r
