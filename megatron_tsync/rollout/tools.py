"""Agent tools: a registry, the text format of a tool call, and the built-in tools (all run in the sandbox).

Format. The agent emits ``<tool>NAME: ARGS</tool>`` (ARGS is free text, may span lines); the agent loop runs the tool
and appends ``<result>...</result>``. :func:`parse_tool_call` returns the LAST complete call in a text, ignoring
anything inside ``<result>`` blocks (a tool's output can never inject a call); a complete but malformed call yields a
:class:`ToolCallError` the loop can feed back to the agent.

Tools. A tool is a function ``(args: str, sandbox: Sandbox, delay_s: float) -> ToolResult`` registered with
``@register_tool(name)``. Built-ins: ``calculator`` (integer arithmetic ``+ - * / // % ( )``, parsed with ``ast`` in the
sandboxed child, never ``eval``), ``python`` (a snippet) and ``shell`` (a ``/bin/sh`` command). ``delay_s`` is a real
sleep inside the sandboxed child before the tool runs, so replayed latency profiles are real wall-clock latency.

Observations are :class:`~megatron_tsync.model.tokenizer.Rendered`: the ``<result>`` tags are markup (special tokens),
the tool's output is data, which the agent loop encodes as plain text (it never becomes a special token id).

This module imports only the standard library, :mod:`megatron_tsync.rollout.sandbox` and ``model.tokenizer``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Union

from megatron_tsync.model.tokenizer import Rendered
from megatron_tsync.rollout.sandbox import Sandbox, ToolResult

__all__ = [
    "ToolCall", "ToolCallError", "ToolFn", "register_tool", "get_tool", "available_tools", "parse_tool_call",
    "format_tool_result", "execute_tool_call", "execute_tool_call_async", "TOOL_OPEN", "TOOL_CLOSE", "RESULT_OPEN",
    "RESULT_CLOSE",
]

TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
MAX_ARGS_CHARS = 100_000

ToolFn = Callable[[str, Sandbox, float], ToolResult]
_REGISTRY: dict[str, ToolFn] = {}
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\Z")
_CALL_RE = re.compile(r"<tool>((?:(?!<tool>).)*?)</tool>", re.DOTALL)
_RESULT_RE = re.compile(r"<result>.*?(?:</result>|\Z)", re.DOTALL)


# -------------------------------------------------------------------------------------------------------- registry
def register_tool(name: str) -> Callable[[ToolFn], ToolFn]:
    """Decorator: register ``fn(args, sandbox, delay_s) -> ToolResult`` under `name` (re-registering replaces)."""
    if not _NAME_RE.match(name):
        raise ValueError(f"invalid tool name {name!r}")

    def deco(fn: ToolFn) -> ToolFn:
        _REGISTRY[name] = fn
        return fn

    return deco


def get_tool(name: str) -> ToolFn:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown tool {name!r}; available: {', '.join(sorted(_REGISTRY))}") from None


def available_tools() -> list[str]:
    return sorted(_REGISTRY)


# -------------------------------------------------------------------------------------------------------- format
@dataclass(frozen=True)
class ToolCall:
    """One parsed call. ``span`` is the (start, end) offset of ``<tool>...</tool>`` in the parsed text."""

    name: str
    args: str
    span: tuple[int, int]


@dataclass(frozen=True)
class ToolCallError:
    """A complete ``<tool>...</tool>`` block that is not a valid call; ``message`` is meant for the agent."""

    message: str
    span: tuple[int, int]


def _mask_results(text: str) -> str:
    """Blank out ``<result>`` blocks (same length, so offsets stay valid); an unterminated one runs to the end."""
    return _RESULT_RE.sub(lambda m: " " * len(m.group(0)), text)


def parse_tool_call(text: str) -> Union[ToolCall, ToolCallError, None]:
    """The last complete ``<tool>NAME: ARGS</tool>`` in `text` (outside ``<result>`` blocks).

    Returns None if there is no complete call; a :class:`ToolCallError` if the last complete block is malformed
    (no ``:``, empty or invalid name, oversized args). With nested openings (``<tool>a <tool>b: 1</tool>``) the
    innermost opening before the close is used. Leading/trailing whitespace of name and args is stripped.
    """
    if not isinstance(text, str) or TOOL_CLOSE not in text:
        return None
    matches = list(_CALL_RE.finditer(_mask_results(text)))
    if not matches:
        return None
    m = matches[-1]
    span = (m.start(), m.end())
    body = text[m.start(1):m.end(1)]
    name, sep, args = body.partition(":")
    name = name.strip()
    if not sep:
        return ToolCallError(f"malformed tool call: expected '<tool>NAME: ARGS</tool>', got {body[:80]!r}", span)
    if not name:
        return ToolCallError("malformed tool call: empty tool name", span)
    if not _NAME_RE.match(name):
        return ToolCallError(f"malformed tool call: invalid tool name {name[:40]!r}", span)
    if len(args) > MAX_ARGS_CHARS:
        return ToolCallError(f"malformed tool call: arguments longer than {MAX_ARGS_CHARS} characters", span)
    return ToolCall(name=name, args=args.strip(), span=span)


_TAG_RE = re.compile(r"<(/?)(tool|result|answer)>")


def _neutralise(s: str) -> str:
    """Stop tool output from closing the result block or forging tool calls/answers."""
    return _TAG_RE.sub(lambda m: f"&lt;{m.group(1)}{m.group(2)}&gt;", s)


def format_tool_result(result: Union[ToolResult, ToolCallError, str], max_chars: int = 2000) -> Rendered:
    """``<result>...</result>`` for the agent: stdout when ok, else ``error: ...`` plus the stderr tail.

    Tags inside the output are escaped; text beyond `max_chars` is elided (head kept) with a note. The tags are the
    markup of the returned :class:`Rendered`, the output its data.
    """
    if isinstance(result, ToolCallError):
        body = f"error: {result.message}"
    elif isinstance(result, str):
        body = result
    elif result.ok:
        body = result.stdout.rstrip("\n")
    else:
        tail = (result.stderr or "").strip()
        if len(tail) > max_chars // 2:
            tail = "..." + tail[-(max_chars // 2):]
        body = f"error: {result.error or 'failed'}"
        if result.stdout.strip():
            body += "\n" + result.stdout.rstrip("\n")
        if tail:
            body += "\n" + tail
    if len(body) > max_chars:
        body = body[:max_chars] + f"\n...[{len(body) - max_chars} more characters elided]"
    return Rendered.wrap(RESULT_OPEN, _neutralise(body), RESULT_CLOSE)


# -------------------------------------------------------------------------------------------------------- dispatch
def execute_tool_call(call: Union[ToolCall, ToolCallError], sandbox: Sandbox, delay_s: float = 0.0) -> ToolResult:
    """Run a parsed call; never raises (unknown tool, malformed call and tool crashes become error results)."""
    if isinstance(call, ToolCallError):
        return ToolResult(False, "", "", None, call.message, 0.0)
    try:
        fn = get_tool(call.name)
    except KeyError as e:
        return ToolResult(False, "", "", None, str(e.args[0]), 0.0)
    try:
        return fn(call.args, sandbox, delay_s)
    except Exception as e:  # a buggy tool must not take down the rollout worker
        return ToolResult(False, "", "", None, f"tool {call.name!r} crashed: {type(e).__name__}: {e}", 0.0)


async def execute_tool_call_async(call: Union[ToolCall, ToolCallError], sandbox: Sandbox,
                                  delay_s: float = 0.0) -> ToolResult:
    """:func:`execute_tool_call` on the sandbox's thread pool (the tool's subprocess runs while the loop awaits)."""
    import asyncio

    from megatron_tsync.rollout.sandbox import _get_executor

    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_get_executor(sandbox._max_workers), execute_tool_call, call, sandbox, delay_s)


# -------------------------------------------------------------------------------------------------------- built-ins
# Runs in the sandboxed child (Sandbox.run_source: the isolated target itself with the fork-server launcher, else
# python -I -S): reads the expression from stdin, evaluates it by walking the AST.
_CALCULATOR_SRC = r'''
import ast, sys
from math import gcd
# Exact rationals as (numerator, denominator > 0) int pairs: `fractions` would add ~10 ms of imports per call.
def fail(msg):
    sys.stderr.write(msg + "\n")
    sys.exit(2)
def q(n, d=1):
    if d < 0:
        n, d = -n, -d
    g = gcd(n, d) or 1
    return (n // g, d // g)
def floor_div(a, b):
    return a[0] * b[1] // (a[1] * b[0])
OPS = {
    ast.Add: lambda a, b: q(a[0] * b[1] + b[0] * a[1], a[1] * b[1]),
    ast.Sub: lambda a, b: q(a[0] * b[1] - b[0] * a[1], a[1] * b[1]),
    ast.Mult: lambda a, b: q(a[0] * b[0], a[1] * b[1]),
    ast.Div: lambda a, b: q(a[0] * b[1], a[1] * b[0]),
    ast.FloorDiv: lambda a, b: (floor_div(a, b), 1),
    ast.Mod: lambda a, b: OPS[ast.Sub](a, OPS[ast.Mult](b, (floor_div(a, b), 1))),
}
def ev(node):
    if isinstance(node, ast.Expression):
        return ev(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return (node.value, 1)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = ev(node.operand)
        return v if isinstance(node.op, ast.UAdd) else (-v[0], v[1])
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        a, b = ev(node.left), ev(node.right)
        if b[0] == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            fail("division by zero")
        if a[0].bit_length() + b[0].bit_length() + a[1].bit_length() + b[1].bit_length() > 100000:
            fail("result too large")
        return OPS[type(node.op)](a, b)
    fail("unsupported expression: only integers, + - * / // % and parentheses are allowed (got "
         + type(getattr(node, "op", node)).__name__ + ")")
expr = sys.stdin.read().strip()
if not expr:
    fail("empty expression")
if len(expr) > 1000:
    fail("expression too long (max 1000 characters)")
try:
    tree = ast.parse(expr, mode="eval")
except SyntaxError as e:
    fail("syntax error: %s" % (e.msg,))
except (ValueError, RecursionError, MemoryError) as e:
    fail("cannot parse expression: " + type(e).__name__)
try:
    n, d = ev(tree)
except RecursionError:
    fail("expression nested too deeply")
except Exception as e:
    fail("cannot evaluate: " + type(e).__name__)
try:
    print(n if d == 1 else repr(n / d))
except OverflowError:
    print("%d/%d" % (n, d))
'''


def _tool_error(res: ToolResult, prefix: str) -> ToolResult:
    """Give a tool's own failure (exit code 2 + stderr message) a clear error string."""
    if not res.ok and res.exit_code == 2 and res.stderr.strip():
        return dataclasses.replace(res, error=f"{prefix}: {res.stderr.strip().splitlines()[-1]}")
    return res


@register_tool("calculator")
def calculator(args: str, sandbox: Sandbox, delay_s: float = 0.0) -> ToolResult:
    """Evaluate integer arithmetic (``+ - * / // % ( )``, unary ``+ -``); ``/`` is exact, shown as a float if
    fractional. Errors (division by zero, other syntax) are error results."""
    res = sandbox.run_source(_CALCULATOR_SRC, stdin=args, delay_s=delay_s)
    return _tool_error(res, "calculator")


@register_tool("python")
def python_tool(args: str, sandbox: Sandbox, delay_s: float = 0.0) -> ToolResult:
    """Run a Python snippet (``python -I``); stdout/stderr are the result. Accepts an optional ```python fence."""
    code = _strip_fence(args)
    return sandbox.run(code=code, delay_s=delay_s)


@register_tool("shell")
def shell_tool(args: str, sandbox: Sandbox, delay_s: float = 0.0) -> ToolResult:
    """Run a ``/bin/sh -c`` command in the scratch dir."""
    return sandbox.run(["/bin/sh", "-c", _strip_fence(args)], delay_s=delay_s)


def _strip_fence(s: str) -> str:
    m = re.fullmatch(r"\s*```[A-Za-z0-9_+-]*\n(.*?)\n?```\s*", s, re.DOTALL)
    return m.group(1) if m else s
