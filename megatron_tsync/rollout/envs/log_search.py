"""log-search: find one fact in a generated tree of paged log files with ``ls`` / ``grep`` / ``cat`` / ``next``.

A long-horizon, observation-heavy task for the CPU benchmark (issue 48): most of a trajectory's tokens are tool
output (pages of log lines the learner forwards and backpropagates through and the engine only prefills), the
agent's own turns are a few tokens each, the number of turns comes from the size of the tree, and every tool call
waits on a latency profile (a real sleep in the sandboxed child: it waits, it does not burn CPU).

A world is a pure function of ``(seed, LogSpec)``: ``files`` log files ``logs/part-N.log``, each of
``min_pages..max_pages`` pages of ``page_lines`` lines ``HH:MM LEVEL service ID=CODE`` (ids: a letter and a
digit). One line holds the asked id (``K7=41``); no other id of the world starts with its letter (and no level name
holds it). The demonstrated policy (the supervised warm start's transcripts)::

    <s>Q: code of K7?
    <tool>next: </tool>   <result>== logs/part-1.log page 1/3 ==\\n09:41 WARN db M2=10\\n...</result>
    <tool>next: </tool>   <result>== logs/part-1.log page 2/3 ==\\n...</result>     (on through part-2.log ...)
    <tool>next: </tool>   <result>== end of logs; Q: code of K7? ==</result>
    <tool>grep: K7</tool>  <result>logs/part-2.log page 1: 13:02 INFO api K7=41</result>
    <answer>41</answer>

Tools (tag format, ``rollout/tools.py``'s ``<tool>NAME: ARGS</tool>``): ``ls`` (the files and their page counts),
``grep: TEXT`` (fixed string; the lines holding it, with their file and page, among the pages read so far: like
searching a pager's scroll-back, so the pages must be read first), ``cat: FILE [PAGE]`` (one page, default 1),
``next`` (the next page: the first file's first page at the start, the next file's after a file's last page, like
paging through ``cat logs/*``). The demonstrated policy takes the tree's page count + 3 turns. Status: the tiny
model (hidden 128, 2 layers) learns it only through a warm-start curriculum of easier worlds first
(``LogSearchTask.warm_start_prompts``; from the task's own worlds alone: 0 %, docs/benchmarks.md). Each call is a stateless sandboxed
call (``Sandbox.run_source``: the trusted tool source below gets the world and the parsed call as JSON on stdin: the
model's text is only data); the episode keeps the open file and page and the pages read. Reward: ``exact_answer`` on
the last ``<answer>`` (binary). The answer ends the episode (``</answer>`` is a stop token of the engine).
Standard library only (the sandbox is imported lazily).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from typing import Any, Callable

from megatron_tsync.rollout.envs.base import Observation, register_environment

__all__ = ["LogSpec", "LogWorld", "generate_world", "LogSearchEnv", "LogSearchEpisode", "TOOLS", "page_header"]

TOOLS = ("ls", "grep", "cat", "next")
LEVELS = ("INFO", "INFO", "INFO", "WARN", "DEBUG", "ERROR")
SERVICES = ("db", "web", "auth", "cache", "queue", "mail", "cron", "api", "disk", "net")
LETTERS = "CHJKLMPSTVXYZ"
"""Letters of the ids: none occurs in LEVELS, so the asked id's first letter appears nowhere else in its world."""
MAX_ARG_CHARS = 64


@dataclasses.dataclass(frozen=True)
class LogSpec:
    """The shape of a world (the task's difficulty and length knobs)."""

    files: int = 2
    """Log files per world."""
    min_pages: int = 2
    max_pages: int = 4
    """Pages per file, uniform in ``min_pages..max_pages``; the fact's page is uniform over its file's pages."""
    page_lines: int = 8
    """Lines per page (~22 tokens each with the tiny model's tokenizer)."""
    code_digits: int = 2
    """Digits of every code (the answer)."""

    def __post_init__(self):
        if not 1 <= self.files <= 99:
            raise ValueError(f"files must be in 1..99, got {self.files}")
        if not 1 <= self.min_pages <= self.max_pages:
            raise ValueError(f"need 1 <= min_pages <= max_pages, got {self.min_pages}..{self.max_pages}")
        if self.page_lines < 1:
            raise ValueError(f"page_lines must be >= 1, got {self.page_lines}")
        if not 1 <= self.code_digits <= 6:
            raise ValueError(f"code_digits must be in 1..6, got {self.code_digits}")


@dataclasses.dataclass(frozen=True)
class LogWorld:
    """One generated world: ``files`` is ``((path, (page text, ...)), ...)``; the fact ``key=code`` is on page
    ``page`` (1-based) of ``files[file_index]``."""

    files: tuple[tuple[str, tuple[str, ...]], ...]
    key: str
    code: int
    file_index: int
    page: int

    @property
    def path(self) -> str:
        return self.files[self.file_index][0]

    @property
    def pages(self) -> int:
        """Pages of the whole tree."""
        return sum(len(pages) for _, pages in self.files)


def _line(r: random.Random, ident: str, code: int, digits: int) -> str:
    return (f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d} {r.choice(LEVELS)} {r.choice(SERVICES)} "
            f"{ident}={code:0{digits}d}")


def _ident(r: random.Random, first: str) -> str:
    return f"{first}{r.randint(0, 9)}"


def generate_world(seed: int, spec: LogSpec = LogSpec()) -> LogWorld:
    """The world of ``seed`` (deterministic): see the module docstring."""
    r = random.Random(seed)
    first = r.choice(LETTERS)
    others = [c for c in LETTERS if c != first]
    key = _ident(r, first)
    lo = 10 ** (spec.code_digits - 1) if spec.code_digits > 1 else 0
    code = r.randint(lo, 10 ** spec.code_digits - 1)
    file_index = r.randrange(spec.files)
    files = []
    page_of_fact = None
    for f in range(spec.files):
        n_pages = r.randint(spec.min_pages, spec.max_pages)
        target = (r.randrange(n_pages), r.randrange(spec.page_lines)) if f == file_index else None
        pages = []
        for p in range(n_pages):
            lines = []
            for i in range(spec.page_lines):
                if target == (p, i):
                    lines.append(_line(r, key, code, spec.code_digits))
                else:
                    lines.append(_line(r, _ident(r, r.choice(others)), r.randint(lo, 10 ** spec.code_digits - 1),
                                       spec.code_digits))
            pages.append("\n".join(lines))
        if target is not None:
            page_of_fact = target[0] + 1
        files.append((f"logs/part-{f + 1}.log", tuple(pages)))
    return LogWorld(tuple(files), key, code, file_index, page_of_fact)


def page_header(path: str, page: int, n_pages: int) -> str:
    return f"== {path} page {page}/{n_pages} =="


def end_marker(key: str) -> str:
    """What ``next`` shows after the last page: the end, restating the question (like a pager's status line showing
    the search), so the id to ``grep`` is a copy from the latest tool output, not from the prompt 1,000+ tokens back
    (the tiny model could not learn that long copy: docs/benchmarks.md)."""
    return f"== end of logs; Q: code of {key}? =="


# Runs in the sandboxed child (Sandbox.run_source, trusted, standard library only). stdin: {"world": [[path,
# [page, ...]], ...], "name": tool name, "args": the call's argument text (model text: only compared, never run),
# "open": [path, page] | null, "read": [[path, page], ...] the pages shown so far}. stdout: {"ok": bool, "text":
# output, "open": [path, page] | null}.
_TOOL_SRC = r'''
import json, sys
a = json.loads(sys.stdin.read())
files = dict((p, pages) for p, pages in a["world"])
name, args, cur = a["name"], a["args"].strip(), a["open"]
def page(path, n):
    pages = files[path]
    return "== %s page %d/%d ==\n%s" % (path, n, len(pages), pages[n - 1])
def end_marker(key):
    return "== end of logs; Q: code of %s? ==" % key
def out(ok, text, cur):
    sys.stdout.write(json.dumps({"ok": ok, "text": text, "open": cur}))
    sys.exit(0)
if name == "ls":
    out(True, "\n".join("%s  %d pages" % (p, len(files[p])) for p, _ in a["world"]), cur)
if name == "grep":
    if not args:
        out(False, "grep: give the text to search for", cur)
    hits = ["%s page %d: %s" % (p, n, line) for p, pages in a["world"] for n, t in enumerate(pages, 1)
            if [p, n] in a["read"] for line in t.split("\n") if args in line]
    out(True, "\n".join(hits[:8]) if hits else "grep: no page read so far contains %s" % args, cur)
if name == "cat":
    parts = args.split()
    if not parts or len(parts) > 2:
        out(False, "cat: usage: cat: FILE [PAGE]", cur)
    path = parts[0]
    if path not in files:
        out(False, "cat: no such file: %s" % path, cur)
    n = 1
    if len(parts) == 2:
        if not parts[1].isdigit() or not 1 <= int(parts[1]) <= len(files[path]):
            out(False, "cat: %s has pages 1..%d" % (path, len(files[path])), cur)
        n = int(parts[1])
    out(True, page(path, n), [path, n])
if name == "next":
    order = [p for p, _ in a["world"]]
    if cur is None:
        path, n = order[0], 0
    else:
        path, n = cur
    if n >= len(files[path]):
        if order.index(path) + 1 == len(order):
            out(True, end_marker(a["key"]), cur)
        path, n = order[order.index(path) + 1], 0
    out(True, page(path, n + 1), [path, n + 1])
out(False, "unknown tool %s; tools: ls, grep, cat, next" % name[:20], cur)
'''


def run_tool(sandbox, world: LogWorld, name: str, args: str, cursor: tuple[str, int] | None,
             read: frozenset = frozenset(), delay_s: float = 0.0
             ) -> tuple[bool, str, tuple[str, int] | None, float, str | None]:
    """One tool call in the sandbox: (ok, output text, new cursor, wall seconds, sandbox error or None); ``read``:
    the ``(path, page)`` s shown so far (what ``grep`` searches). Blocking."""
    payload = json.dumps({"world": [[p, list(pages)] for p, pages in world.files], "name": name,
                          "args": args[:MAX_ARG_CHARS], "open": None if cursor is None else list(cursor),
                          "key": world.key,
                          "read": [list(x) for x in sorted(read)]})
    res = sandbox.run_source(_TOOL_SRC, stdin=payload, delay_s=delay_s)
    if not res.ok:
        return False, f"error: {res.error or 'tool failed'}", cursor, res.wall_s, res.error or "tool failed"
    try:
        got = json.loads(res.stdout)
        text, ok, cur = str(got["text"]), bool(got["ok"]), got["open"]
        paths = {p for p, _ in world.files}
        new = None if cur is None else (str(cur[0]), int(cur[1]))
        if new is not None and new[0] not in paths:
            raise ValueError(f"unknown file {new[0]!r}")
    except (ValueError, KeyError, TypeError, IndexError) as e:
        return False, "error: tool output unreadable", cursor, res.wall_s, f"bad tool output: {e}"
    return ok, text if ok else f"error: {text}", new, res.wall_s, None if ok else text


class LogSearchEnv:
    """Episodes of log-search worlds. ``task`` objects have ``prompt_text``, ``meta["world"]`` (a
    :class:`LogWorld`) and ``verifier_task()`` (``runtime.tasks.TaskInstance``).

    Args:
        sandbox: where every tool call runs (default ``Sandbox()``).
        verifier: a ``rollout.verifiers`` name (``exact_answer``: binary).
        delay_s / delay_fn: the tool latency (seconds, or ``delay_fn(trajectory, turn)`` from the latency profile,
            as the worker passes it); a real sleep inside the sandboxed child.
    """

    name = "log-search"

    def __init__(self, sandbox=None, *, verifier: str = "exact_answer", verifier_kwargs: dict | None = None,
                 delay_s: float = 0.0, delay_fn: Callable[[Any, int], float] | None = None):
        from megatron_tsync.rollout.verifiers import get_verifier

        if sandbox is None:
            from megatron_tsync.rollout.sandbox import Sandbox

            sandbox = Sandbox()
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.sandbox = sandbox
        self.verifier = get_verifier(verifier, **(verifier_kwargs or {}))
        self.delay_s, self.delay_fn = delay_s, delay_fn

    async def start(self, task: Any) -> "LogSearchEpisode":
        world = task.meta.get("world") if hasattr(task, "meta") else None
        if not isinstance(world, LogWorld):
            raise TypeError("log-search episodes need a task instance with meta['world'] (a LogWorld)")
        return LogSearchEpisode(self, task, world)


class LogSearchEpisode:
    def __init__(self, env: LogSearchEnv, task: Any, world: LogWorld):
        self.env, self.task, self.world = env, task, world
        self.prompt: str = task.prompt_text
        self.cursor: tuple[str, int] | None = None
        self.read: set[tuple[str, int]] = set()
        self.turns = 0
        self.tool_s = 0.0

    async def step(self, action_text: str) -> Observation:
        import asyncio

        from megatron_tsync.rollout import tools
        from megatron_tsync.rollout.agent_loop import CURRENT_CALL
        from megatron_tsync.rollout.sandbox import _get_executor

        self.turns += 1
        call = tools.parse_tool_call(action_text)
        if call is None or isinstance(call, tools.ToolCallError):
            msg = call.message if call is not None else "no complete <tool>NAME: ARGS</tool> call before </tool>"
            return Observation(tools.format_tool_result(f"error: {msg}"), ok=False, error=msg)
        delay = self.env.delay_s
        ctx = CURRENT_CALL.get()
        if self.env.delay_fn is not None and ctx is not None:
            delay = float(self.env.delay_fn(*ctx))
        loop = asyncio.get_running_loop()
        ok, text, self.cursor, wall, err = await loop.run_in_executor(
            _get_executor(self.env.sandbox._max_workers), run_tool, self.env.sandbox, self.world, call.name,
            call.args, self.cursor, frozenset(self.read), delay)
        if ok and call.name in ("cat", "next") and self.cursor is not None:
            self.read.add(self.cursor)
        self.tool_s += wall
        return Observation(tools.format_tool_result(text), ok=ok, tool=call.name, error=err, wall_s=wall)

    async def finish(self, transcript: str = "") -> Any:
        """The verdict on ``transcript`` (the text after the prompt, tool results included, as verifiers read it)."""
        from megatron_tsync.rollout.envs.verifier import Verdict

        t0 = time.monotonic()
        score = await self.env.verifier.evaluate(transcript, self.task.verifier_task())
        return Verdict(float(score.reward), score.reason, time.monotonic() - t0)

    def close(self) -> None:
        pass


def demonstration_segments(prompt: str, world: LogWorld) -> list[tuple[str, bool]]:
    """The short policy's transcript as ``(text, is_action)`` segments, observations exactly as the episode writes
    them: ``next`` through every page to the end of the logs (``world.pages + 1`` calls), ``grep`` the id (it
    searches the pages read), answer the code."""
    from megatron_tsync.rollout.tools import format_tool_result

    segs: list[tuple[str, bool]] = [(prompt, False)]

    def turn(call: str, out: str) -> None:
        segs.extend([(call, True), (format_tool_result(out), False)])

    for path, pages in world.files:
        for n in range(1, len(pages) + 1):
            turn("<tool>next: </tool>", f"{page_header(path, n, len(pages))}\n{pages[n - 1]}")
    turn("<tool>next: </tool>", end_marker(world.key))
    line = next(x for x in dict(world.files)[world.path][world.page - 1].split("\n") if world.key in x)
    turn(f"<tool>grep: {world.key}</tool>", f"{world.path} page {world.page}: {line}")
    segs.append((f"<answer>{world.code}</answer>", True))
    return segs


@register_environment("log-search")
def _make(**kwargs) -> LogSearchEnv:
    return LogSearchEnv(**kwargs)
