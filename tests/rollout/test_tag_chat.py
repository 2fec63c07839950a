"""The tag chat format (``rollout/tag_chat.py``): OpenAI messages of a calculator episode render to exactly the token
sequence of the native agent loop's transcript (the task's demonstration, segment by segment, as the agent loop
encodes it), and the completion parser reads the native ``<tool>NAME: ARGS`` call as an OpenAI tool call."""

import json

import pytest

from megatron_tsync.model.tokenizer import Rendered, encode_observation
from megatron_tsync.rollout.tag_chat import parse_tag_tool_calls, tag_chat_template


@pytest.fixture(scope="module")
def codec(tiny_dir):
    from transformers import AutoTokenizer

    from megatron_tsync.model.tokenizer import TokenizerCodec

    return TokenizerCodec(AutoTokenizer.from_pretrained(tiny_dir))


def test_episode_tokens_equal_native_transcript(codec):
    from megatron_tsync.runtime.tasks import get_task

    task = get_task("arithmetic-calculator")
    inst = task.instance("37+18*4")
    segs = task.demonstration_segments(inst)  # prompt, tool call, result, answer: how the agent loop encodes them
    native = [encode_observation(codec, t) if isinstance(t, Rendered) else codec.encode(t) for t, _ in segs]
    tpl = tag_chat_template(codec.tokenizer)
    bos = codec.tokenizer.bos_token
    user = [{"role": "user", "content": inst.prompt_text[len(bos):]}]
    assert encode_observation(codec, tpl.render_marked(user, None, True)) == native[0]
    # the model's first turn: "<tool>calculator: 37+18*4</tool>", generated; the server strips the end-of-turn marker
    turn1 = codec.decode(native[1])
    content, calls = parse_tag_tool_calls(turn1[: turn1.rindex("</tool>")], "call_0_0")
    assert content == "" and [c["function"]["name"] for c in calls] == ["calculator"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"input": "37+18*4"}
    reply = {"role": "assistant", "content": None,
             "tool_calls": [dict(c, function={"name": "calculator", "arguments": {"input": "37+18*4"}}) for c in calls]}
    seen = user + [reply]
    messages = seen + [{"role": "tool", "tool_call_id": calls[0]["id"], "content": "109"}]
    obs = tpl.continuation(seen, messages, None, closed=True)  # the completion generated </tool> itself
    assert isinstance(obs, Rendered) and encode_observation(codec, obs) == native[2]
    # ... and a completion cut before </tool> gets the marker appended (loss mask 0), still token-exact text
    assert tpl.continuation(seen, messages, None, closed=False) == "</tool>" + obs


@pytest.mark.parametrize("text,content,call", [
    ("<tool>calculator: 3+4", "", ("calculator", "3+4")),
    ("I will compute. <tool> calculator :  3*4 ", "I will compute.", ("calculator", "3*4")),
    ("<answer>7</answer>", "<answer>7</answer>", None),  # no call: the episode's answer
    ("<tool>calculator 3+4", "<tool>calculator 3+4", None),  # malformed (no ':'): stays text, as natively an error
    ("<tool>a: 1</tool><result>1</result>", "<tool>a: 1</tool><result>1</result>", None),  # only an open last call
])
def test_parse_tag_tool_calls(text, content, call):
    got_content, calls = parse_tag_tool_calls(text, "p")
    assert got_content == content
    if call is None:
        assert calls == []
    else:
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])["input"]) for c in calls] == [call]
