"""The chat side of the OpenAI-compatible endpoint (``rollout/openai_server.py``): request validation, chat templates,
token-exact continuations, and Qwen-style tool-call parsing. No sockets, no engine; standard library + jinja2.

How a multi-turn conversation becomes ONE token sequence without re-tokenising generated tokens:

- the first request of an episode renders its messages with the chat template (``add_generation_prompt``) and encodes
  the text: the prompt (loss mask 0);
- the engine's completion is appended as the exact sampled ids (loss mask 1);
- a later request must repeat the episode's conversation (the server's own replies included, compared by content
  and tool calls) and may add only non-assistant messages (tool results, user turns). Only the *new* text is
  rendered and encoded: ``continuation`` renders the conversation with and without the new messages and takes the
  difference, starting right after the end-of-turn marker that closes the last assistant message (the marker itself
  is added when the completion did not generate it, e.g. it stopped on EOS or on the length cap). Templates that
  re-render earlier turns differently once more messages follow are refused with an error, never silently re-tokenised.

Text from the request is data, the template's own text is markup: :meth:`ChatTemplate.render_marked` and
``continuation`` return a :class:`~megatron_tsync.model.tokenizer.Rendered` whose data parts are the request's
strings (message contents and names, tool-call arguments, tool schemas), found by rendering once more with each such
string between delimiters made of a per-call random nonce. The server encodes the data as plain text, so a message
that prints ``</s>`` or ``<|im_end|>`` never becomes a special token id. A template that inspects or transforms
those strings (``| trim``, ``content.split(...)``) does not reproduce its real render with the delimiters; then the
render is a plain ``str`` and the server refuses (400) a request whose strings hold special-token text.

Deviation from the OpenAI API: content parts other than text (images, audio) are refused; ``n`` must be 1.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from typing import Any

from megatron_tsync.model.tokenizer import Rendered, encode_observation

__all__ = ["ApiError", "ChatTemplate", "DEFAULT_CHAT_TEMPLATE", "normalize_messages", "normalize_tools",
           "first_difference", "parse_json_body", "parse_tool_calls", "request_strings", "encode_rendered"]

MAX_JSON_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
    """A refused request: HTTP ``status`` and a message naming the offending field (``param``)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = int(status), message, param, code

    def body(self) -> dict:
        kinds = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 409: "conflict_error"}
        kind = kinds.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# A ChatML template with Qwen-style tool calls, for models whose folder has no chat template (the tiny test models).
DEFAULT_CHAT_TEMPLATE = """
{%- set sys = messages[0].content if messages and messages[0].role == 'system' else none %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if sys %}{{- sys + '\n\n' }}{%- endif %}
    {{- '<tools>' }}
    {%- for t in tools %}{{- '\n' + (t.function | tojson) }}{%- endfor %}
    {{- '\n</tools><|im_end|>\n' }}
{%- elif sys is not none %}
    {{- '<|im_start|>system\n' + sys + '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if loop.first and m.role == 'system' %}
    {%- elif m.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' + (m.content or '') }}
        {%- for c in m.tool_calls or [] %}
            {{- '<tool_call>{"name": ' + (c.function.name | tojson) + ', "arguments": '
                + (c.function.arguments | tojson) + '}</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


class ChatTemplate:
    """A Hugging Face-style Jinja chat template (rendered in jinja2's sandbox) and its end-of-turn marker.

    Args:
        source: the template text (``tokenizer_config.json``'s ``chat_template`` or ``chat_template.jinja``).
        end_of_turn: the text that closes an assistant message (``<|im_end|>`` for ChatML/Qwen, ``<|eot_id|>`` for
            Llama 3); it is the stop marker of every completion and must appear in a rendered assistant message.
        special: ``bos_token`` / ``eos_token`` values the template may use.
        kept_stops: stop texts the format's content needs to be parsed (the tag format's ``</answer>``): a completion
            that stopped on one keeps it in the reply's content; other stop tokens (EOS) are stripped from it.
    """

    def __init__(self, source: str, *, end_of_turn: str = "<|im_end|>", special: dict[str, str] | None = None,
                 kept_stops: tuple[str, ...] = ()):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise ApiError(400, f"chat template: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined)
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                     ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        env.filters["tag_escape"] = _tag_escape
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e}") from None
        if not end_of_turn:
            raise ValueError("end_of_turn must be a non-empty string")
        self.source = source
        self.end_of_turn = end_of_turn
        self.special = dict(special or {})
        self.kept_stops = tuple(kept_stops)
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        if end_of_turn not in self.render(probe, None, False)[len(self.render(probe[:1], None, True)):]:
            raise ValueError(f"end_of_turn {end_of_turn!r} does not close an assistant message of this chat template")

    @classmethod
    def from_hf_dir(cls, path: str, *, end_of_turn: str | None = None) -> "ChatTemplate":
        """The folder's template (``chat_template.jinja`` or ``tokenizer_config.json``), else
        :data:`DEFAULT_CHAT_TEMPLATE`. ``end_of_turn`` defaults to ``<|eot_id|>`` for templates that use it, else
        ``<|im_end|>``."""
        source, special = None, {}
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
            special = {k: v for k in ("bos_token", "eos_token") if isinstance(v := cfg.get(k), str)}
            tpl = cfg.get("chat_template")
            if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
                tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
            source = tpl if isinstance(tpl, str) else None
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path) as f:
                source = f.read()
        source = source or DEFAULT_CHAT_TEMPLATE
        if end_of_turn is None:
            end_of_turn = "<|eot_id|>" if "<|eot_id|>" in source else "<|im_end|>"
        return cls(source, end_of_turn=end_of_turn, special=special)

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        try:
            return self._template.render(messages=messages, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt, **self.special)
        except ApiError:
            raise
        except Exception as e:  # a template error on a user's messages is the request's fault, with the reason
            raise ApiError(400, f"chat template failed on these messages: {type(e).__name__}: {e}") from None

    def render_marked(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        """:meth:`render` as a :class:`Rendered` whose data parts are the request's strings (see the module
        docstring); a plain ``str`` when the template inspects or transforms them."""
        text = self.render(messages, tools, add_generation_prompt)
        nonce = secrets.token_hex(8)
        open_, close = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"
        try:
            marked = self.render(_delimit(messages, open_, close), _delimit(tools, open_, close),
                                 add_generation_prompt)
        except ApiError:
            return text
        parts, pos = [], 0
        for m in re.finditer(re.escape(open_) + "(.*?)" + re.escape(close), marked, re.DOTALL):
            parts += [(marked[pos:m.start()], True), (m.group(1), False)]
            pos = m.end()
        parts.append((marked[pos:], True))
        out = Rendered(parts)
        if out != text or nonce in out:  # control flow or text depended on the strings, or delimiters left over
            return text
        return out

    def continuation(self, seen: list[dict], messages: list[dict], tools: list[dict] | None, closed: bool) -> str:
        """The text to append after an episode whose conversation is ``seen`` (ending with the server's assistant
        reply) so that the context becomes ``messages`` + generation prompt. ``closed``: the completion already
        ended with :attr:`end_of_turn` (else the marker is part of the continuation). A :class:`Rendered` (the new
        messages' strings are its data) when :meth:`render_marked` finds them, else a plain ``str``."""
        before = self.render(seen[:-1], tools, True)
        prefix = self.render(seen, tools, False)
        full = self.render(messages, tools, True)
        if not (prefix.startswith(before) and full.startswith(prefix)):
            raise ApiError(409, "the chat template renders the earlier turns differently once new messages follow "
                                "(not prefix-stable), so the episode cannot continue token-exactly")
        eot = prefix.rfind(self.end_of_turn)
        if eot < len(before):
            raise ApiError(409, f"the chat template does not close the assistant message with {self.end_of_turn!r}")
        start = eot + (len(self.end_of_turn) if closed else 0)
        marked = self.render_marked(messages, tools, True)
        return marked.tail(start) if isinstance(marked, Rendered) else full[start:]


_KEEP_KEYS = frozenset({"role", "type", "id", "tool_call_id"})  # what templates compare: never delimited


def _delimit(x: Any, open_: str, close: str, key: str | None = None) -> Any:
    """``x`` with every string (dict keys and :data:`_KEEP_KEYS` values aside) between the delimiters."""
    if isinstance(x, str):
        return x if key in _KEEP_KEYS else f"{open_}{x}{close}"
    if isinstance(x, dict):
        return {k: _delimit(v, open_, close, k) for k, v in x.items()}
    if isinstance(x, list):
        return [_delimit(v, open_, close) for v in x]
    return x


def request_strings(messages: list[dict], tools: list[dict] | None, *, data: bool = True) -> list[str]:
    """The strings of a request that are data (those :meth:`ChatTemplate.render_marked` delimits); with
    ``data=False`` the others: dict keys and the values of :data:`_KEEP_KEYS` (ids, roles, types)."""
    out: list[str] = []

    def walk(x: Any, key: str | None = None) -> None:
        if isinstance(x, str):
            if (key not in _KEEP_KEYS) == data:
                out.append(x)
        elif isinstance(x, dict):
            for k, v in x.items():
                if not data:
                    out.append(str(k))
                walk(v, k)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(messages)
    walk(tools)
    return out


def encode_rendered(codec, text: str, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The ids of a render of ``messages`` / ``tools`` (:meth:`ChatTemplate.render_marked`, ``continuation``): its
    data parts, the request's strings, as plain text (never special ids). Refused (400): a request string the
    template renders as markup (a dict key, an id) that holds special-token text, and, when the template transforms
    the strings (no parts), any request string that does."""
    strings = request_strings(messages, tools, data=False)
    if not isinstance(text, Rendered):
        strings += request_strings(messages, tools)
    for s in strings:
        if codec.encode(s) != codec.encode_text(s):
            raise ApiError(400, f"a request string holds the tokenizer's special-token text ({s[:80]!r}) where this "
                                f"chat template renders it as markup, so it cannot be kept as plain text: remove or "
                                f"escape it", "messages", "special_token_text")
    return encode_observation(codec, text) if isinstance(text, Rendered) else codec.encode(text)


def _tag_escape(s: Any) -> str:
    """The ``tag_escape`` filter: the agent loop's escaping of tool output (``rollout/tools.py``)."""
    from megatron_tsync.rollout.tools import _neutralise

    return _neutralise("" if s is None else str(s))


# ------------------------------------------------------------------------------------------------ validation

_ROLES = ("system", "developer", "user", "assistant", "tool")


def _reject_constant(name: str):
    raise ApiError(400, f"the request body is not valid JSON: {name} is not a JSON number")


def parse_json_body(body: bytes) -> tuple[Any, int]:
    """The parsed body and its number of string characters (keys included). Refused (400): invalid JSON or UTF-8,
    NaN/Infinity, nesting deeper than ``MAX_JSON_DEPTH``, strings with lone UTF-16 surrogates (not text)."""
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    chars, stack = 0, [(obj, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, str):
            chars += len(x)
            if _SURROGATE.search(x):
                raise ApiError(400, "the request body has a string with a lone UTF-16 surrogate (e.g. \\ud800): "
                                    "not Unicode text")
        elif isinstance(x, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ApiError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(x, dict):
                stack.extend((k, depth) for k in x)
                x = x.values()
            stack.extend((v, depth + 1) for v in x)
    return obj, chars


def _text_content(content: Any, where: str, *, allow_none: bool) -> str | None:
    if content is None:
        if allow_none:
            return None
        raise ApiError(400, f"{where}.content is required", where + ".content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(400, f"{where}.content[{k}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                                    f"supported", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts, not {type(content).__name__}",
                   where + ".content")


def _tool_call(call: Any, where: str) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ApiError(400, f"{where} must be an object with a 'function' object", where)
    fn = call["function"]
    name, args = fn.get("name"), fn.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{where}.function.name must be a non-empty string", where + ".function.name")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except RecursionError:
            raise ApiError(400, f"{where}.function.arguments nests JSON deeper than Python parses",
                           where + ".function.arguments") from None
        except ValueError as e:
            raise ApiError(400, f"{where}.function.arguments is not valid JSON ({e})", where + ".function.arguments")
    if not isinstance(args, dict):
        raise ApiError(400, f"{where}.function.arguments must be a JSON object", where + ".function.arguments")
    return {"id": str(call.get("id") or ""), "type": "function", "function": {"name": name, "arguments": args}}


def normalize_messages(messages: Any) -> list[dict]:
    """Validate OpenAI chat messages; return them in the canonical form the templates get (tool-call arguments
    parsed to objects, text parts joined). Raises :class:`ApiError` (400) naming the first bad field."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of message objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object, not {type(m).__name__}", where)
        role = m.get("role")
        if role not in _ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(_ROLES)}, not {role!r}", where + ".role")
        calls = m.get("tool_calls") or []
        if calls and role != "assistant":
            raise ApiError(400, f"{where}: only assistant messages carry tool_calls", where + ".tool_calls")
        if not isinstance(calls, list):
            raise ApiError(400, f"{where}.tool_calls must be a list", where + ".tool_calls")
        msg: dict[str, Any] = {"role": role,
                               "content": _text_content(m.get("content"), where, allow_none=role == "assistant")}
        if calls:
            msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise ApiError(400, f"{where}: a tool message needs a 'tool_call_id' string", where + ".tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def normalize_tools(tools: Any) -> list[dict] | None:
    """Validate the request's ``tools`` (function tools only); None when absent or empty."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", "tools")
    out = []
    for k, t in enumerate(tools):
        where = f"tools[{k}]"
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) and t["function"]["name"]):
            raise ApiError(400, f"{where} must be {{'type': 'function', 'function': {{'name': ..., ...}}}}", where)
        params = t["function"].get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ApiError(400, f"{where}.function.parameters must be a JSON schema object", where)
        out.append({"type": "function", "function": dict(t["function"])})
    return out


def _comparable(m: dict) -> tuple:
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in m.get("tool_calls", ()))
    content = m.get("content") or ""
    if m["role"] == "assistant":
        content = content.strip()
    return m["role"], content, calls, m.get("name")


def first_difference(seen: list[dict], messages: list[dict]) -> str | None:
    """Why ``messages`` does not extend the episode's conversation ``seen`` (None when it does). Assistant messages
    are compared by stripped content and tool calls (name + arguments; call ids may differ)."""
    if len(messages) <= len(seen):
        return (f"the request has {len(messages)} messages; the episode's conversation already has {len(seen)} "
                f"(with the last reply): send the whole conversation plus the new messages")
    for i, (a, b) in enumerate(zip(seen, messages)):
        if _comparable(a) != _comparable(b):
            return f"messages[{i}] ({b['role']}) differs from the episode's message {i} ({a['role']})"
    return None


# ------------------------------------------------------------------------------------------------ tool calls

_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"


def _call_blocks(text: str):
    """(start, end, body) of each ``<tool_call>…</tool_call>`` as ``re.finditer`` of ``<tool_call>\\s*(.*?)\\s*
    </tool_call>`` (DOTALL) finds them, by ``str.find``: linear (the regex is quadratic in unclosed openings: 48 s on
    128 KB of them)."""
    pos = 0
    while True:
        start = text.find(_CALL_OPEN, pos)
        if start < 0:
            return
        close = text.find(_CALL_CLOSE, start + len(_CALL_OPEN))
        if close < 0:
            return
        yield start, close + len(_CALL_CLOSE), text[start + len(_CALL_OPEN):close].strip()
        pos = close + len(_CALL_CLOSE)


def parse_tool_calls(text: str, id_prefix: str) -> tuple[str, list[dict]]:
    """Split generated text into (content, OpenAI ``tool_calls``): each ``<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`` with valid JSON becomes a call (``arguments`` as a JSON string, as the API returns it);
    a malformed block stays in the content for the harness to see."""
    calls, kept, pos = [], [], 0
    for start, end, body in _call_blocks(text):
        try:
            obj = json.loads(body)
            name, args = obj["name"], obj.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if not (isinstance(name, str) and name and isinstance(args, dict)):
                raise ValueError
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            continue
        kept.append(text[pos:start])
        pos = end
        calls.append({"id": f"{id_prefix}_{len(calls)}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
    kept.append(text[pos:])
    return "".join(kept).strip(), calls
