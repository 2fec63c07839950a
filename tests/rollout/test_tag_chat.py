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


def test_a_reply_that_stopped_on_answer_keeps_it(codec):
    """The tag format's ``</answer>`` is a stop token of the run's sampling (as EOS is): the reply's content is what
    the model generated, ``<answer>-4</answer>`` (it was ``<answer>-4``, which a harness parsing the documented format
    scored 0), while EOS is still stripped."""
    from megatron_tsync.rollout.engine import Completion, SamplingConfig
    from megatron_tsync.rollout.openai_server import ChatServer

    (close,) = codec.encode("</answer>")
    eos = codec.tokenizer.eos_token_id
    turns = [codec.encode("<answer>-4</answer>"), codec.encode("<answer>7") + [eos]]

    class Engine:
        policy_version = 0

        def generate(self, prompts, sampling, n=1, *, seeds=None):
            ids = turns.pop(0)
            return [[Completion(ids, [-0.5] * len(ids), "stop", policy_version=0)] for _ in prompts]

    server = ChatServer(Engine(), codec, tag_chat_template(codec.tokenizer), tool_parser=parse_tag_tool_calls,
                        sampling=SamplingConfig(max_new_tokens=16, stop_token_ids=(eos, close)))
    try:
        for eid, want in (("a", "<answer>-4</answer>"), ("b", "<answer>7")):
            out = server.chat_completion({"model": "tsync-policy", "messages": [{"role": "user", "content": "Q: 1 "}]},
                                         {"x-episode-id": eid})
            assert out["choices"][0]["message"]["content"] == want
    finally:
        server.close()
