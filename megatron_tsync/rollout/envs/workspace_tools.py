"""The tools of the workspace environments: ``bash``, ``view``, ``edit`` (string replace) and ``submit``.

Every tool except ``submit`` is a real sandboxed call in the trajectory's ``sandbox.Workspace`` (its cwd), so file reads
and writes happen as the workspace's private uid under the sandbox's limits; the trusted process never opens a
workspace file for a tool (a symlink planted by the agent cannot make it read or write anything the agent could not).

    bash(command)                          /bin/sh -c COMMAND
    view(path, start_line=1, end_line=-1)  the file with line numbers (or a directory listing)
    edit(path, old_str, new_str)           replace the one occurrence of old_str (an error if 0 or >1 occurrences);
                                           old_str "" creates the file with new_str (an error if it exists)
    submit()                               ends the episode; the verifier then runs

The generators' own source is hidden from the calls: the namespace sandbox's root is an allow-list
(``sandbox/rootfs.py``: system dirs, the interpreter, the workspace; no checkout, no ``.git``, the project's package
hidden even inside site-packages), so an agent cannot read the template library's correct functions. Where a sandbox
mounts but has no allow-list root (the container backend's host rootfs, the read-only-host fallback), an empty
read-only directory is bind-mounted over the imported ``megatron_tsync`` package instead (:func:`hidden_mounts`).
Standard library + rollout.sandbox only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import os
import tempfile
import threading

from megatron_tsync.rollout.sandbox import Mount, ToolResult, Workspace

__all__ = ["ToolSpec", "WORKSPACE_TOOLS", "run_workspace_tool", "result_text"]


@dataclass(frozen=True)
class ToolSpec:
    name: str
    params: tuple[str, ...]
    required: tuple[str, ...]
    description: str


WORKSPACE_TOOLS: dict[str, ToolSpec] = {
    "bash": ToolSpec("bash", ("command",), ("command",), "Run a shell command in the repository root."),
    "view": ToolSpec("view", ("path", "start_line", "end_line"), ("path",),
                     "Show a file with line numbers (optionally lines start_line..end_line), or list a directory."),
    "edit": ToolSpec("edit", ("path", "old_str", "new_str"), ("path", "old_str", "new_str"),
                     "Replace the single occurrence of old_str in the file with new_str (old_str '' creates a file)."),
    "submit": ToolSpec("submit", (), (), "Finish: the hidden tests are run on the repository as it is now."),
}

# Runs inside the sandbox (python -I -S), arguments as JSON on stdin.
_VIEW_SRC = r'''
import json, os, sys
a = json.loads(sys.stdin.read())
p = a["path"]
if os.path.isdir(p):
    for name in sorted(os.listdir(p)):
        print(name + ("/" if os.path.isdir(os.path.join(p, name)) else ""))
    sys.exit(0)
try:
    lines = open(p, encoding="utf-8", errors="replace").read().splitlines()
except OSError as e:
    sys.stderr.write("view: %s\n" % e.strerror)
    sys.exit(2)
start = max(1, int(a.get("start_line") or 1))
end = int(a.get("end_line") or -1)
end = len(lines) if end < 0 else min(end, len(lines))
for i in range(start, end + 1):
    print("%6d\t%s" % (i, lines[i - 1]))
'''

_EDIT_SRC = r'''
import json, os, sys
a = json.loads(sys.stdin.read())
p, old, new = a["path"], a["old_str"], a["new_str"]
def fail(msg):
    sys.stderr.write("edit: " + msg + "\n")
    sys.exit(2)
if old == "":
    if os.path.exists(p):
        fail("%s exists; old_str '' only creates new files" % p)
    d = os.path.dirname(p)
    if d:
        os.makedirs(d, exist_ok=True)
    open(p, "w", encoding="utf-8").write(new)
    print("created %s (%d lines)" % (p, new.count("\n") + 1))
    sys.exit(0)
try:
    text = open(p, encoding="utf-8").read()
except (OSError, UnicodeDecodeError) as e:
    fail("cannot read %s: %s" % (p, e))
n = text.count(old)
if n != 1:
    fail("old_str occurs %d times in %s (must be exactly once)" % (n, p))
open(p, "w", encoding="utf-8").write(text.replace(old, new, 1))
line = text[:text.index(old)].count("\n") + 1
print("edited %s at line %d" % (p, line))
'''


_empty_lock = threading.Lock()
_empty_dir: list[str] = []


def hidden_mounts(sandbox) -> dict | None:
    """``{package dir: Mount(empty dir)}`` where the sandbox can mount, ``{}`` where its allow-list root already leaves
    the package out, else None (see the module docstring)."""
    if not sandbox._caps.get("ro_root"):
        return None
    if sandbox._caps.get("rootfs"):
        return {}
    with _empty_lock:
        if not _empty_dir or not os.path.isdir(_empty_dir[0]):
            d = tempfile.mkdtemp(prefix="tsync_hidden_")
            os.chmod(d, 0o555)
            _empty_dir[:] = [d]
    pkg = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # .../megatron_tsync
    return {pkg: Mount(_empty_dir[0], read_only=True)}


def _missing(spec: ToolSpec, args: dict) -> str | None:
    unknown = sorted(set(args) - set(spec.params))
    if unknown:
        return f"{spec.name}: unknown argument(s) {', '.join(unknown)}; expected {', '.join(spec.params) or 'none'}"
    missing = [p for p in spec.required if p not in args]
    if missing:
        return f"{spec.name}: missing argument(s) {', '.join(missing)}"
    for p in ("path", "old_str", "new_str", "command"):
        if p in args and not isinstance(args[p], str):
            return f"{spec.name}: argument {p!r} must be a string"
    return None


def run_workspace_tool(ws: Workspace, name: str, args: dict, *, delay_s: float = 0.0) -> ToolResult:
    """Run one tool call in the workspace (``submit`` is handled by the episode). Never raises."""
    spec = WORKSPACE_TOOLS.get(name)
    if spec is None or name == "submit":
        return ToolResult(False, "", "", None, f"unknown tool {name!r}; available: bash, view, edit, submit", 0.0)
    err = _missing(spec, args)
    if err is not None:
        return ToolResult(False, "", "", None, err, 0.0)
    py, mounts = ws.sandbox.python, hidden_mounts(ws.sandbox)
    if name == "bash":
        return ws.run(["/bin/sh", "-c", args["command"]], delay_s=delay_s, mounts=mounts)
    src = _VIEW_SRC if name == "view" else _EDIT_SRC
    res = ws.run([py, "-I", "-S", "-c", src], stdin=json.dumps(args), delay_s=delay_s, mounts=mounts)
    if not res.ok and res.exit_code == 2 and res.stderr.strip():
        import dataclasses

        return dataclasses.replace(res, error=res.stderr.strip().splitlines()[-1])
    return res


def result_text(res: ToolResult, max_chars: int = 4000) -> str:
    """What the agent sees of a tool result: stdout (+ stderr), or ``error: ...`` first; long text is elided."""
    body = res.stdout
    if res.stderr.strip():
        body += ("\n" if body and not body.endswith("\n") else "") + res.stderr
    if not res.ok:
        body = f"error: {res.error or 'failed'}\n" + body
    body = body.rstrip("\n")
    if len(body) > max_chars:
        note = f"\n...[{len(body) - max_chars} characters elided]...\n"
        body = body[: max_chars // 2] + note + body[-max_chars // 2:]
    return body


