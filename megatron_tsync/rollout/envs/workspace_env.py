"""The workspace environment: a task's files in a persistent sandboxed workspace, the tools ``bash``, ``view``,
``edit``, ``submit``, and the hidden-test verdict (``envs/verifier.py``). swe-lite, terminal-lite and the
SWE-bench / Terminal-Bench loaders all produce :class:`WorkspaceTask` s for it.

An episode: ``start`` opens ``sandbox.workspace(files=task.files, copy_from=task.copy_from)`` (own uid, 0700,
isolated from every other trajectory) and runs the task's ``setup`` commands in it; each ``step`` parses the last
tool call of the model's turn (tool format "tag" or "qwen", ``envs/tool_format.py``) and runs it there; ``submit``
ends the episode; ``finish`` hands the final workspace to the verifier (fresh dir, another uid, the task's tests
restored as probes, expected values kept outside it: ``envs/probes.py``), then removes the workspace.
Standard library + rollout.sandbox only.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from megatron_tsync.rollout.envs.base import Observation, register_environment
from megatron_tsync.rollout.envs.checks import Check, render_checks
from megatron_tsync.rollout.envs.tool_format import CallError, ToolFormat, bind_args, get_tool_format
from megatron_tsync.rollout.envs.probes import Expect, expectations_from_reference, is_strong, rewrite_asserts
from megatron_tsync.rollout.envs.verifier import HiddenTestVerifier, TestSpec, Verdict
from megatron_tsync.rollout.envs.workspace_tools import WORKSPACE_TOOLS, result_text, run_workspace_tool

__all__ = ["WorkspaceTask", "WorkspaceEnv", "WorkspaceEpisode", "render_prompt", "demonstration_segments"]


@dataclass(frozen=True)
class WorkspaceTask:
    """One task of a workspace environment."""

    task_id: str
    instruction: str
    """The issue text / instruction the agent gets."""
    files: Mapping[str, str] = field(default_factory=dict)
    """Initial workspace files (relative path -> text)."""
    checks: Sequence[Check] = ()
    """Hidden checks with expected values (rendered as probes; the values stay in the trusted process)."""
    preambles: Mapping[str, str] = field(default_factory=dict)
    """Test file -> its imports/helpers, for ``checks``."""
    test_files: Mapping[str, str] = field(default_factory=dict)
    """Fixed hidden test files (loaders), restored as they are."""
    must_pass: Sequence[str] = ()
    """Node ids (or test files) of ``test_files`` that must pass."""
    protected: Sequence[str] = ("tests",)
    """Workspace paths never copied to the verifier (the task's tests live there)."""
    noconftest: bool = True
    copy_from: str | None = None
    """A local directory copied into the workspace first (loaders: the repository checkout)."""
    setup: Sequence[str] = ()
    """Shell commands run in the workspace before the episode (Terminal-Bench ``setup``)."""
    solution: Sequence[tuple[str, dict]] = ()
    """The known fix as tool calls ``(name, args)``, ending with submit (scripted policies, demonstrations)."""
    meta: Mapping[str, Any] = field(default_factory=dict)

    need_strong: Sequence[str] = ()
    """Loaded tasks: test ids (or test files) that must each carry a value check (``probes.Expect.strong``) — the
    FAIL_TO_PASS tests: a task whose fixed tests only check 1-bit outcomes is refused as unverifiable."""

    def test_spec(self) -> TestSpec:
        """The split verifier's spec of a generated task (expected values from ``checks``); loaded tasks need their
        reference solution run first: :meth:`WorkspaceEnv.test_spec`."""
        if not self.checks:
            raise ValueError(f"task {self.task_id}: no checks (a loaded task: use WorkspaceEnv.test_spec)")
        files, expected = render_checks(self.checks, dict(self.preambles))
        return TestSpec(files, expected, protected=tuple(self.protected), noconftest=self.noconftest)


def _is_test_module(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def rewrite_test_files(test_files: Mapping[str, str | bytes]) -> tuple[dict, dict]:
    """(child files, site -> (op, literal)): every test module's asserts become probes (``envs/probes.py``); other
    files (conftest.py, data) are kept as they are."""
    files, sites = {}, {}
    for path, text in test_files.items():
        if _is_test_module(path):
            src = text.decode("utf-8") if isinstance(text, bytes) else text
            files[path], s = rewrite_asserts(src, path)
            sites.update(s)
        else:
            files[path] = text
    return files, sites


def _spec_key(task: WorkspaceTask) -> str:
    """The spec cache's key: the task id and a digest of what decides its spec (two files may reuse an id)."""
    h = hashlib.sha256(repr((task.task_id, task.must_pass, task.need_strong, task.solution, task.copy_from,
                             task.setup, sorted(task.files.items()))).encode())
    for path, text in sorted(task.test_files.items()):
        h.update(path.encode() + b"\0" + (text if isinstance(text, bytes) else text.encode()) + b"\0")
    return h.hexdigest()


def select_expected(task: WorkspaceTask, expected_all: Mapping[str, tuple[Expect, ...]]
                    ) -> dict[str, tuple[Expect, ...]]:
    """The reference's expected probes of the task's must-pass tests; ValueError if a must-pass test never ran or
    a ``need_strong`` one has no value check."""
    def matching(entry: str) -> list[str]:
        if "::" in entry:
            return [t for t in expected_all if t == entry or t.startswith(entry + "[")]
        return [t for t in expected_all if t.startswith(entry + "::")]

    out: dict[str, tuple[Expect, ...]] = {}
    for entry in task.must_pass:
        out.update({t: expected_all[t] for t in matching(entry)})  # a test without asserts: nothing to check
    for entry in task.need_strong:
        if not any(is_strong(expected_all[t]) for t in matching(entry)):
            raise ValueError(f"task {task.task_id}: {entry} has no value check (no assert that pins a value the "
                             "solution cannot guess); unverifiable")
    if not out:
        raise ValueError(f"task {task.task_id}: its must-pass tests report no probes; unverifiable")
    return out


_TAG_HELP = """Tools (one call per turn, the result comes back in <result>...</result>):
<tool>bash: COMMAND</tool>   run a shell command in the repository root
<tool>view: PATH</tool>      show a file with line numbers, or list a directory
<tool>edit: {"path": "...", "old_str": "...", "new_str": "..."}</tool>   replace the one occurrence of old_str
<tool>submit: </tool>        finish; hidden tests are then run
"""


def _qwen_system(instruction_kind: str) -> str:
    import json

    tools = [{"type": "function", "function": {"name": s.name, "description": s.description, "parameters": {
        "type": "object", "properties": {p: {"type": "integer" if p.endswith("_line") else "string"} for p in s.params},
        "required": list(s.required)}}} for s in WORKSPACE_TOOLS.values()]
    return (f"You are a {instruction_kind}. Work in the repository with the tools, then call submit.\n\n# Tools\n\n"
            "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
            "signatures within <tools></tools> XML tags:\n<tools>\n" + "\n".join(json.dumps(t) for t in tools)
            + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>")


DEFAULT_ROLE = "software engineer fixing an issue"


def render_prompt(task: WorkspaceTask, tool_format: str = "tag", role: str = DEFAULT_ROLE) -> str:
    """The episode's first observation: the role, the tools in the tool format, the task's instruction."""
    if tool_format == "qwen":
        return (f"<|im_start|>system\n{_qwen_system(role)}<|im_end|>\n<|im_start|>user\n{task.instruction}"
                "<|im_end|>\n<|im_start|>assistant\n")
    return f"You are a {role}.\n{_TAG_HELP}\nTask:\n{task.instruction}\n"


def demonstration_segments(task: WorkspaceTask, tool_format: str = "tag", role: str = DEFAULT_ROLE
                           ) -> list[tuple[str, bool]]:
    """The known solution as (text, is_action) segments, observations as the environment writes them, without
    running anything (for supervised warm starts): ``edit`` -> "edited PATH at line N", ``bash`` -> its output is
    assumed empty (true for the suites' solutions), ``submit`` -> "submitted"."""
    fmt = get_tool_format(tool_format)
    segs = [(render_prompt(task, tool_format, role), False)]
    files = dict(task.files)
    for name, args in task.solution:
        if name == "edit":
            text = files[args["path"]]
            line = text[:text.index(args["old_str"])].count("\n") + 1
            files[args["path"]] = text.replace(args["old_str"], args["new_str"], 1)
            out = f"edited {args['path']} at line {line}"
        else:
            out = "submitted" if name == "submit" else ""
        segs += [(fmt.render_call(name, args), True), (fmt.render_result(out), False)]
    return segs


class WorkspaceEnv:
    """Workspace episodes (see the module docstring).

    Args:
        sandbox: the episodes' sandbox (limits of each tool call); default ``Sandbox(SandboxConfig())``.
        verifier: default :class:`HiddenTestVerifier` (its own sandbox and limits).
        tool_format: "tag" or "qwen".
        max_obs_chars: tool output kept per observation.
        role: how the system prompt names the agent.
    """

    name = "workspace"

    def __init__(self, sandbox=None, verifier: HiddenTestVerifier | None = None, tool_format: str = "tag",
                 max_obs_chars: int = 4000, role: str = DEFAULT_ROLE):
        if sandbox is None:
            from megatron_tsync.rollout.sandbox import Sandbox

            sandbox = Sandbox()
        self.sandbox = sandbox
        self.verifier = verifier or HiddenTestVerifier()
        self.format: ToolFormat = get_tool_format(tool_format)
        self.max_obs_chars = max_obs_chars
        self.role = role
        self._specs: dict[str, TestSpec | ValueError] = {}  # loaded tasks' specs (or why not) by _spec_key
        self._spec_locks: dict[str, threading.Lock] = {}
        self._spec_lock = threading.Lock()

    def prompt(self, task: WorkspaceTask) -> str:
        return render_prompt(task, self.format.name, self.role)

    async def start(self, task: WorkspaceTask) -> "WorkspaceEpisode":
        import asyncio

        loop = asyncio.get_running_loop()
        from megatron_tsync.rollout.sandbox import _get_executor

        ws = await loop.run_in_executor(_get_executor(self.sandbox._max_workers), self._open, task)
        return WorkspaceEpisode(self, task, ws)

    def _open(self, task: WorkspaceTask):
        ws = self.sandbox.workspace(files=dict(task.files), copy_from=task.copy_from)
        for cmd in task.setup:
            res = ws.run(["/bin/sh", "-c", cmd])
            if not res.ok:
                ws.close()
                raise RuntimeError(f"task {task.task_id}: setup command {cmd!r} failed: {res.error}: "
                                   f"{res.stderr[-500:]}")
        return ws

    def test_spec(self, task: WorkspaceTask) -> TestSpec:
        """The verifier's spec of `task` (blocking; loaded tasks' cached per task). Loaded tasks: the test files' asserts are
        rewritten to probes and the expected values are the task's reference solution's, run twice in a fresh
        workspace (values that differ between the runs are not pinned). ValueError for an unverifiable task (no
        reference solution, or a FAIL_TO_PASS test without a value check)."""
        if task.checks:
            return task.test_spec()
        key = _spec_key(task)
        with self._spec_lock:  # one reference computation per task, however many trajectories wait for it
            lock = self._spec_locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._specs:
                try:
                    self._specs[key] = self._loaded_spec(task)
                except ValueError as e:  # unverifiable: remembered, not recomputed per trajectory
                    self._specs[key] = e
        got = self._specs[key]
        if isinstance(got, ValueError):
            raise ValueError(str(got))
        return got

    def _loaded_spec(self, task: WorkspaceTask) -> TestSpec:
        if not task.solution:
            raise ValueError(f"task {task.task_id}: a loaded task needs its reference solution (the gold 'patch' / "
                             "solution.sh) to pin the expected values; unverifiable")
        files, sites = rewrite_test_files(task.test_files)
        targets = tuple(sorted({m.partition("::")[0] for m in task.must_pass}))
        ref_spec = TestSpec(files, {}, protected=tuple(task.protected), noconftest=task.noconftest, targets=targets,
                            sites=frozenset(sites))
        runs = [self._reference_run(task, ref_spec) for _ in range(2)]
        expected = select_expected(task, expectations_from_reference(runs, sites))
        return TestSpec(files, expected, protected=tuple(task.protected), noconftest=task.noconftest,
                        targets=targets)

    def _reference_run(self, task: WorkspaceTask, spec: TestSpec) -> dict:
        ws = self._open(task)
        try:
            for name, args in task.solution:
                if name != "submit":
                    res = run_workspace_tool(ws, name, args)
                    if not res.ok:
                        raise ValueError(f"task {task.task_id}: the reference solution's {name} failed: {res.error}")
            records, why, _ = self.verifier.probe(ws.path, spec)
        finally:
            ws.close()
        if records is None:
            raise ValueError(f"task {task.task_id}: the reference run failed: {why}")
        return records

    def render_solution(self, task: WorkspaceTask) -> list[str]:
        """The known fix as model turns in this environment's tool format."""
        return [self.format.render_call(name, args) for name, args in task.solution]


class WorkspaceEpisode:
    def __init__(self, env: WorkspaceEnv, task: WorkspaceTask, ws):
        self.env, self.task, self.ws = env, task, ws
        self.prompt = env.prompt(task)
        self.done = False
        self.turns = 0
        self.tool_s = 0.0
        self.t_start = time.monotonic()

    def _obs(self, text: str, **kw) -> Observation:
        return Observation(self.env.format.render_result(text), **kw)

    async def step(self, action_text: str) -> Observation:
        self.turns += 1
        if self.done:
            return self._obs("error: the episode is over", done=True, ok=False, error="episode over")
        call = self.env.format.parse(action_text)
        if call is None:
            msg = f"no tool call found; end the turn with {self.env.format.stop_text} after one call"
            return self._obs(f"error: {msg}", ok=False, error=msg)
        if isinstance(call, CallError):
            return self._obs(f"error: {call.message}", ok=False, error=call.message)
        if call.name == "submit":
            self.done = True
            return self._obs("submitted", done=True, tool="submit")
        spec = WORKSPACE_TOOLS.get(call.name)
        args = bind_args(call, spec.params) if spec is not None else dict(call.args)
        res = await _run_tool_async(self.ws, call.name, args)
        self.tool_s += res.wall_s
        return self._obs(result_text(res, self.env.max_obs_chars), ok=res.ok, tool=call.name, error=res.error,
                         wall_s=res.wall_s)

    async def finish(self, transcript: str = "") -> Verdict:
        """Verify the final workspace and close the episode (the verdict's ``verify_s`` is the verifier's time)."""
        import asyncio

        from megatron_tsync.rollout.sandbox import _get_executor

        try:
            loop = asyncio.get_running_loop()
            try:
                spec = await loop.run_in_executor(_get_executor(self.env.sandbox._max_workers), self.env.test_spec,
                                                  self.task)
            except ValueError as e:
                return Verdict(0.0, f"unverifiable task: {e}")
            return await self.env.verifier.verify_async(self.ws.path, spec)
        finally:
            self.close()

    def close(self) -> None:
        self.ws.close()


async def _run_tool_async(ws, name: str, args: dict):
    import asyncio

    from megatron_tsync.rollout.sandbox import _get_executor

    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_get_executor(ws.sandbox._max_workers), run_workspace_tool, ws, name, args)


@register_environment("workspace")
def _make_workspace_env(**kwargs) -> WorkspaceEnv:
    return WorkspaceEnv(**kwargs)
