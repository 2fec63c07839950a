"""The agent loop's tag format as a chat format for the OpenAI-compatible endpoint (``rollout/openai_server.py``).

Models trained on the native agent loop's transcripts (the quickstart's tiny agent: ``<s>Q: 37+18*4 <tool>calculator:
37+18*4</tool><result>109</result><answer>109</answer>``) have no chat template. This module renders OpenAI chat
messages into exactly that text, so a harness driving such a model through the endpoint produces the token sequence
the native agent loop would (tested: ``tests/rollout/test_tag_chat.py``):

- a user / system message: its content, the first one after the tokenizer's BOS (``bos_token``);
- an assistant message: its content, then each tool call as ``<tool>NAME: INPUT</tool>`` (a tool takes one string
  argument, ``input``); ``</tool>`` closes every assistant message (the end-of-turn marker, a stop token), so the
  model's turn ends where the native loop runs the tool;
- a tool message: ``<result>CONTENT</result>``, the tags ``<tool>``, ``<result>``, ``<answer>`` (and their closing
  forms) inside CONTENT escaped as the native loop escapes tool output (``&lt;answer&gt;``), so a tool message can
  neither close its block nor carry an answer or a call. The server encodes CONTENT as plain text (no special ids).

:func:`parse_tag_tool_calls` turns the last ``<tool>NAME: INPUT`` of a completion (the server strips the closing
``</tool>``) into an OpenAI tool call ``{"name": NAME, "arguments": "{\\"input\\": INPUT}"}``, with the native
parser's rules (``rollout/tools.parse_tool_call``: a malformed call stays in the content, no tool call). Limit: a
completion cut by the token cap inside an open ``<tool>NAME: ...`` is read as that call too (the server then appends
the ``</tool>`` marker with loss mask 0); the native loop would end the episode there.
"""

from __future__ import annotations

import json

__all__ = ["TAG_CHAT_TEMPLATE", "TAG_END_OF_TURN", "tag_chat_template", "parse_tag_tool_calls"]

TAG_END_OF_TURN = "</tool>"

TAG_CHAT_TEMPLATE = """
{%- for m in messages %}
    {%- if m.role == 'assistant' %}
        {{- m.content or '' }}
        {%- for c in m.tool_calls or [] %}
            {{- '<tool>' + c.function.name + ': ' + (c.function.arguments.input or '') }}
        {%- endfor %}
        {{- '</tool>' }}
    {%- elif m.role == 'tool' %}
        {{- '<result>' + (m.content | tag_escape) + '</result>' }}
    {%- else %}
        {%- if loop.first %}{{- bos_token }}{%- endif %}
        {{- m.content }}
    {%- endif %}
{%- endfor %}
"""


def tag_chat_template(tokenizer=None):
    """The :class:`ChatTemplate` of the tag format; ``tokenizer`` supplies ``bos_token`` (None: no BOS)."""
    from megatron_tsync.rollout.openai_chat import ChatTemplate

    bos = getattr(tokenizer, "bos_token", None)
    return ChatTemplate(TAG_CHAT_TEMPLATE, end_of_turn=TAG_END_OF_TURN,
                        special={"bos_token": bos} if isinstance(bos, str) else {},
                        kept_stops=("</answer>",))  # the reply's content is the generated "<answer>X</answer>"


def parse_tag_tool_calls(text: str, id_prefix: str) -> tuple[str, list[dict]]:
    """(content, OpenAI ``tool_calls``) of a completion's text without its closing ``</tool>`` (see the module
    docstring): the call must be the text's last ``<tool>`` block; the content is the text before it."""
    from megatron_tsync.rollout.tools import TOOL_CLOSE, ToolCall, parse_tool_call

    start = text.rfind("<tool>")
    if start < 0 or TOOL_CLOSE in text[start:]:
        return text.strip(), []
    call = parse_tool_call(text + TOOL_CLOSE)
    if not isinstance(call, ToolCall) or call.span[0] != start:
        return text.strip(), []
    args = json.dumps({"input": call.args}, ensure_ascii=False)
    return text[:start].strip(), [{"id": f"{id_prefix}_0", "type": "function",
                                   "function": {"name": call.name, "arguments": args}}]
