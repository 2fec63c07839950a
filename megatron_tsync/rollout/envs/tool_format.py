"""Tool-call formats of the environments: how a model's turn names a tool, and how the observation is written back.

Two formats, one interface (:class:`ToolFormat`)::

    tag   <tool>bash: ls -la</tool>                       ->  <result>...</result>
          <tool>edit: {"path": "a.py", "old_str": "x", "new_str": "y"}</tool>
    qwen  <tool_call>\\n{"name": "bash", "arguments": {"command": "ls"}}\\n</tool_call>
          ->  <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n
              <|im_start|>assistant\\n

The tag format is the one the calculator agent was trained with (``rollout/tools.py``); its ARGS is either a JSON
object (the tool's named arguments) or plain text (the tool's first argument). The qwen format is Qwen2.5/Qwen3's
chat-template tool call; ``</tool_call>`` is the stop token of a tool turn (the agent loop's ``tool_token_ids``), and
the observation closes the assistant turn, adds a ``tool_response`` user turn and opens the next assistant turn, so
the next turn continues the token sequence exactly (generated tokens are never re-tokenised; the agent loop encodes
only the observation and appends it with loss mask 0).

Observations never carry markup the model could mistake for a turn boundary or a call: ``<|``, ``<tool_call>``,
``<tool_response>``, ``<tool>``, ``<result>`` and ``<answer>`` inside tool output are escaped, and the output is the
data of a :class:`~megatron_tsync.model.tokenizer.Rendered` whose markup is the format's wrapper: the agent loop
encodes it as plain text, so no special token (``</s>``, ``<|endoftext|>``, ``<think>``, ...) it prints becomes a
special id.
Standard library and ``model.tokenizer`` only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

from megatron_tsync.model.tokenizer import Rendered

__all__ = ["ParsedCall", "CallError", "ToolFormat", "TagFormat", "QwenFormat", "get_tool_format"]

MAX_ARGS_CHARS = 100_000


@dataclass(frozen=True)
class ParsedCall:
    name: str
    args: dict = field(default_factory=dict)
    text_arg: str | None = None
    """The plain-text ARGS of a tag call that is not a JSON object (bound to the tool's first parameter)."""


@dataclass(frozen=True)
class CallError:
    message: str


class ToolFormat(Protocol):
    name: str
    stop_text: str
    """The text that ends a tool turn (its token is the agent loop's tool token)."""

    def parse(self, turn_text: str) -> Union[ParsedCall, CallError, None]: ...

    def render_call(self, name: str, args: dict) -> str: ...

    def render_result(self, text: str) -> Rendered: ...


_ESCAPE_RE = re.compile(r"<\|" + r"|<(/?)(tool_call|tool_response|tool|result|answer)>")


def escape_output(s: str) -> str:
    """Neutralise turn/call markup inside tool output (see the module docstring)."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "<|":
            return "< |"
        return f"&lt;{m.group(1)}{m.group(2)}&gt;"

    return _ESCAPE_RE.sub(sub, s)


_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\Z")


def _check_name(name: str) -> CallError | None:
    if not name:
        return CallError("malformed tool call: empty tool name")
    if not _NAME_RE.match(name):
        return CallError(f"malformed tool call: invalid tool name {name[:40]!r}")
    return None


class TagFormat:
    """``<tool>NAME: ARGS</tool>`` -> ``<result>...</result>`` (see the module docstring)."""

    name = "tag"
    stop_text = "</tool>"

    def parse(self, turn_text: str) -> Union[ParsedCall, CallError, None]:
        from megatron_tsync.rollout.tools import ToolCallError, parse_tool_call

        call = parse_tool_call(turn_text)
        if call is None:
            return None
        if isinstance(call, ToolCallError):
            return CallError(call.message)
        args = call.args
        if args.startswith("{"):
            try:
                obj = json.loads(args)
            except RecursionError:  # not a ValueError: it would reach the agent loop as an executor failure
                return CallError("malformed tool call: arguments nest JSON too deeply")
            except ValueError as e:
                return CallError(f"malformed tool call: arguments are not valid JSON ({e})")
            if not isinstance(obj, dict):
                return CallError("malformed tool call: JSON arguments must be an object")
            return ParsedCall(call.name, obj)
        return ParsedCall(call.name, {}, text_arg=args)

    def render_call(self, name: str, args: dict) -> str:
        return f"<tool>{name}: {json.dumps(args)}</tool>"

    def render_result(self, text: str) -> Rendered:
        return Rendered.wrap("<result>", escape_output(text), "</result>")


_QWEN_CALL_RE = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)</tool_call>", re.DOTALL)


class QwenFormat:
    """Qwen's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (see the module docstring)."""

    name = "qwen"
    stop_text = "</tool_call>"
    result_open = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
    result_close = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"

    def parse(self, turn_text: str) -> Union[ParsedCall, CallError, None]:
        found = list(_QWEN_CALL_RE.finditer(turn_text or ""))
        if not found:
            return None
        body = found[-1].group(1).strip()
        if len(body) > MAX_ARGS_CHARS:
            return CallError(f"malformed tool call: longer than {MAX_ARGS_CHARS} characters")
        try:
            obj = json.loads(body)
        except RecursionError:
            return CallError("malformed tool call: JSON nested too deeply")
        except ValueError as e:
            return CallError(f"malformed tool call: not valid JSON ({e})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return CallError('malformed tool call: expected {"name": ..., "arguments": {...}}')
        err = _check_name(obj["name"])
        if err is not None:
            return err
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return CallError("malformed tool call: 'arguments' is a string that is not JSON")
        if not isinstance(args, dict):
            return CallError("malformed tool call: 'arguments' must be an object")
        return ParsedCall(obj["name"], args)

    def render_call(self, name: str, args: dict) -> str:
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"

    def render_result(self, text: str) -> Rendered:
        return Rendered.wrap(self.result_open, escape_output(text), self.result_close)


_FORMATS = {"tag": TagFormat, "qwen": QwenFormat}


def get_tool_format(name: str) -> ToolFormat:
    try:
        return _FORMATS[name]()
    except KeyError:
        raise KeyError(f"unknown tool format {name!r}; available: {', '.join(sorted(_FORMATS))}") from None


def bind_args(call: ParsedCall, params: tuple[str, ...]) -> dict[str, Any]:
    """The call's named arguments; a tag call's plain text binds to the first parameter."""
    if call.text_arg is not None:
        return {params[0]: call.text_arg} if params else {}
    return dict(call.args)
