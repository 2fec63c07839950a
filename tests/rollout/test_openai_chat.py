"""The chat side of the OpenAI endpoint without a model: templates and continuations, message checks, tool calls."""

import json

import pytest

from megatron_tsync.rollout.openai_chat import (
    DEFAULT_CHAT_TEMPLATE, ApiError, ChatTemplate, first_difference, normalize_messages, normalize_tools,
    parse_tool_calls,
)

TOOLS = normalize_tools([{"type": "function", "function": {"name": "calc"}}])


def _conversation():
    call = {"id": "c0", "type": "function", "function": {"name": "calc", "arguments": '{"e": "1+2"}'}}
    return normalize_messages([
        {"role": "system", "content": "sys"}, {"role": "user", "content": [{"type": "text", "text": "q"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0", "content": "3"},
    ])


def test_default_template_and_continuation():
    t = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
    msgs = _conversation()
    full = t.render(msgs, TOOLS, True)
    assert full == ('<|im_start|>system\nsys\n\n<tools>\n{"name": "calc"}\n</tools><|im_end|>\n'
                    '<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n'
                    '<tool_call>{"name": "calc", "arguments": {"e": "1+2"}}</tool_call><|im_end|>\n'
                    '<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n')
    # the continuation starts right after the generated end-of-turn marker, or includes it when it was not generated
    assert t.continuation(msgs[:3], msgs, TOOLS, closed=True) == \
        "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"
    assert t.continuation(msgs[:3], msgs, TOOLS, closed=False).startswith("<|im_end|>\n<|im_start|>tool\n")
    assert t.render(msgs[:2], None, True) == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nq<|im_end|>\n" \
                                             "<|im_start|>assistant\n"


def test_template_from_hf_dir_and_refusals(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "</s>",
        "chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}<|eot_id|>{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token if false }}"}))
    t = ChatTemplate.from_hf_dir(str(tmp_path))
    assert t.end_of_turn == "<|eot_id|>" and t.render([{"role": "user", "content": "x"}], None, True) == \
        "[user]x<|eot_id|>[assistant]"
    assert ChatTemplate.from_hf_dir(str(tmp_path / "missing")).source == DEFAULT_CHAT_TEMPLATE
    with pytest.raises(ValueError, match="does not close an assistant message"):
        ChatTemplate(DEFAULT_CHAT_TEMPLATE, end_of_turn="<|eot_id|>")
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")
    # a template that rewrites earlier turns once more follow cannot continue token-exactly: refused, not re-tokenised
    unstable = ChatTemplate("{{ messages | length }}:{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}")
    msgs = normalize_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                               {"role": "user", "content": "c"}])
    with pytest.raises(ApiError, match="not prefix-stable") as e:
        unstable.continuation(msgs[:2], msgs, None, True)
    assert e.value.status == 409
    failing = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
                           "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}")
    with pytest.raises(ApiError, match="user first"):
        failing.render(normalize_messages([{"role": "system", "content": "s"}]), None, True)


def test_messages_checks_and_comparison():
    msgs = _conversation()
    assert msgs[1]["content"] == "q" and msgs[2]["tool_calls"][0]["function"]["arguments"] == {"e": "1+2"}
    echoed = json.loads(json.dumps(msgs))
    echoed[2]["tool_calls"][0]["id"] = "other-id"  # ids may differ, content and calls may not
    echoed[2]["content"] = "  "
    assert first_difference(msgs[:3], echoed) is None
    echoed[2]["tool_calls"][0]["function"]["arguments"] = {"e": "1+3"}
    assert "messages[2] (assistant) differs" in first_difference(msgs[:3], echoed)
    assert "already has 3" in first_difference(msgs[:3], msgs[:3])
    with pytest.raises(ApiError, match="only assistant messages carry tool_calls"):
        normalize_messages([{"role": "user", "content": "x", "tool_calls": [{}]}])
    with pytest.raises(ApiError, match=r"tools\[0\].function.parameters must be"):
        normalize_tools([{"type": "function", "function": {"name": "f", "parameters": "x"}}])
    assert normalize_tools([]) is None


def test_parse_tool_calls():
    text = ('let me see <tool_call>{"name": "calc", "arguments": {"e": "1+2"}}</tool_call>'
            '<tool_call>{"name": "calc", "arguments": "{\\"e\\": \\"2\\"}"}</tool_call> <tool_call>{oops}</tool_call>')
    content, calls = parse_tool_calls(text, "call_0_1")
    assert [c["id"] for c in calls] == ["call_0_1_0", "call_0_1_1"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"e": "1+2"}, {"e": "2"}]
    assert content == "let me see  <tool_call>{oops}</tool_call>"  # a malformed call stays visible to the harness
    assert parse_tool_calls("plain answer", "x") == ("plain answer", [])


def test_parse_json_body_refuses_what_is_not_json_text():
    """Parsed bodies come with their string characters counted (keys included); anything that is not a JSON document
    of Unicode text is an ApiError 400 (a RecursionError or a lone surrogate used to surface as a 500)."""
    from megatron_tsync.rollout.openai_chat import MAX_JSON_DEPTH, parse_json_body

    assert parse_json_body(b'{"ab": ["cde", {"f": 1}], "g": null}') == ({"ab": ["cde", {"f": 1}], "g": None}, 7)
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json_body(nested.encode())[1] == 0  # exactly the allowed depth
    cases = [
        (b"[" + nested.encode() + b"]", "deeper than"),
        (b"[" * 200_000 + b"]" * 200_000, "deeper than"),
        (b'{"k": "\\udc00x"}', "lone UTF-16 surrogate"),
        (b'{"\\ud800": 1}', "lone UTF-16 surrogate"),
        (b'[Infinity]', "Infinity is not a JSON number"),
        (b'\xc3\x28', "not valid JSON"),
        (b'{"a": 1', "not valid JSON"),
    ]
    for body, needle in cases:
        with pytest.raises(ApiError, match=needle) as e:
            parse_json_body(body)
        assert e.value.status == 400
    assert parse_json_body('{"k": "\\ud83d\\ude00"}'.encode())[0] == {"k": "\U0001F600"}  # a valid pair is text
