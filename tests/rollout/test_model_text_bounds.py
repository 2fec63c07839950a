"""Model text handed to parsers in the trusted process is bounded (docs/threat_model.md, "Call sites that receive
model or tool text"):

- JSON nested past Python's recursion limit in a tool call (tag and Qwen formats, the endpoint's ``<tool_call>``
  parser and request ``arguments``) is a malformed call, not a RecursionError escaping the parser;
- finding the last ``<answer>`` and the endpoint's ``<tool_call>`` blocks is linear in the text (the regexes were
  quadratic in unclosed openings: ~50 s on 128 KB), with the regexes' results on ordinary text;
- τ²'s airline ``calculate`` (which ``eval``s in this process) refuses ``9**9**9**9`` instead of never returning.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest

pytestmark = pytest.mark.timeout(120)

DEEP = "[" * 60_000  # under MAX_ARGS_CHARS (100k), past the JSON decoder's recursion limit


def test_deeply_nested_json_in_a_tool_call_is_a_malformed_call():
    from megatron_tsync.rollout.envs.tool_format import CallError, get_tool_format
    from megatron_tsync.rollout.openai_chat import ApiError, normalize_messages, parse_tool_calls

    tag = get_tool_format("tag").parse('<tool>python: {"a": ' + DEEP + "</tool>")
    qwen = get_tool_format("qwen").parse('<tool_call>{"name": "x", "arguments": ' + DEEP + "</tool_call>")
    qwen_str = get_tool_format("qwen").parse('<tool_call>{"name": "x", "arguments": "' + DEEP + '"}</tool_call>')
    assert all(isinstance(c, CallError) for c in (tag, qwen, qwen_str)), (tag, qwen, qwen_str)
    assert "too deeply" in tag.message and "too deeply" in qwen.message
    text = 'hi <tool_call>{"name": "x", "arguments": ' + DEEP + '</tool_call>'
    assert parse_tool_calls(text, "c") == (text.strip(), [])  # kept in the content, as any malformed block
    msg = [{"role": "assistant", "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": DEEP}}]}]
    with pytest.raises(ApiError) as e:
        normalize_messages(msg)
    assert e.value.status == 400 and "nests JSON" in str(e.value.message)


@pytest.mark.parametrize("text", ["<answer>1</answer>", "a <answer> 2 </answer> b <answer>3</answer> c",
                                  "<answer>1<answer>2</answer>", "<answer>x", "</answer><answer>4</answer>",
                                  "<answer></answer><answer>", "no tags", "<answer>\n5\n</answer>\n"])
def test_answer_spans_are_the_regexs(text):
    from megatron_tsync.rollout.verifiers import answer_spans

    regex = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
    assert answer_spans(text) == [(m.start(1), m.end(1)) for m in regex.finditer(text)]


def _used_tool_by_prefixes(text):  # the quadratic original: the reference on short texts
    from megatron_tsync.rollout.tools import ToolCall, parse_tool_call

    return any(isinstance(parse_tool_call(text[:m.start() + len("</tool>")]), ToolCall)
               for m in re.finditer(r"</tool>\s*<result>", text))


@pytest.mark.parametrize("text", [
    "<tool>calculator: 1+1</tool> <result>2</result>", "<tool>calculator: 1+1</tool>", "<tool>bad</tool><result>x",
    "<result><tool>calculator: 1</tool><result>x</result>", "<tool>a <tool>calculator: 2</tool>\n<result>2</result>",
    "<tool>calculator: 1</tool>x<result>1</result><tool>python: 2</tool><result>", "</tool><result>",
    "<result>y</result><tool>shell: ls</tool><result>a</result>"])
def test_used_tool_is_the_prefix_scans(text):
    from megatron_tsync.rollout.verifiers import _used_tool

    assert _used_tool(text) == _used_tool_by_prefixes(text)


def test_answer_and_tool_call_scans_are_linear():
    from megatron_tsync.rollout.openai_chat import parse_tool_calls
    from megatron_tsync.rollout.verifiers import get_verifier, parse_answer

    n = 128_000  # ~32k tokens of completion
    t0 = time.perf_counter()
    assert parse_answer("<answer>" * (n // 8)) == (None, "malformed: unterminated <answer> tag")
    assert parse_tool_calls("<tool_call>" * (n // 11), "c")[1] == []
    text = "<answer>7</answer>" + "<answer>" * (n // 8)  # right, not well formed
    assert asyncio.run(get_verifier("answer_with_format").evaluate(text, {"answer": 7})).reward == pytest.approx(0.6)
    shaped = get_verifier("answer_with_format").evaluate("<tool>bad</tool><result>" * (n // 24), {"answer": 7})
    assert asyncio.run(shaped).reward == 0.0  # the used-tool check parsed every prefix: 23 s on half of this
    assert time.perf_counter() - t0 < 10.0  # the regexes took ~50 s each here
    calls = parse_tool_calls('a <tool_call> {"name": "f", "arguments": {"x": 1}} </tool_call> b '
                             '<tool_call>bad</tool_call> <tool_call>{"name": "g"}</tool_call>', "c")
    assert calls[0] == "a  b <tool_call>bad</tool_call>"
    assert [c["function"]["name"] for c in calls[1]] == ["f", "g"]


def test_tau2_calculate_guard():
    from megatron_tsync.rollout.envs.tau2_env import CALCULATE_MAX_CHARS, _BadCall, _check_calculate

    for expr in ("9**9**9**9", "2 ** 3", "1+" * CALCULATE_MAX_CHARS + "1"):
        with pytest.raises(_BadCall):
            _check_calculate("calculate", {"expression": expr})
    _check_calculate("calculate", {"expression": "(2 + 3) * 4 / 8"})
    _check_calculate("search_flights", {"expression": "9**9**9**9"})  # another tool's argument: τ²'s to validate


@pytest.mark.slow
def test_tau2_calculate_refuses_a_power_tower():
    """Through an airline episode (τ²'s own tool). ``keep_trivial_tasks``: any airline task will do, so the pool is
    not run through the do-nothing filter (an evaluator run on each of the 30 train tasks, ~45 CPU s, which is
    tests/runtime/test_tau2_tasks.py's subject, not this test's)."""
    pytest.importorskip("tau2", reason="the optional tau2 extra is not installed")
    from megatron_tsync.runtime.tasks import get_task

    rl_task = get_task("megatron_tsync.runtime.tau2_tasks:airline-scripted", verifier="tau2", keep_trivial_tasks=True)
    env = rl_task.make_environment()
    inst = rl_task.instance(rl_task.tasks("train")[0], "train")

    async def episode():
        ep = await env.start(inst.meta["env_task"])
        n = len(ep.orch.trajectory)
        tower = await ep.step('<tool>calculate: {"expression": "9**9**9**9"}</tool>')
        assert len(ep.orch.trajectory) == n  # no τ² message: nothing for the evaluator to replay
        fine = await ep.step('<tool>calculate: {"expression": "(2 + 3) * 4 / 8"}</tool>')
        return tower, fine

    tower, fine = asyncio.run(episode())
    assert not tower.ok and "powers" in tower.error, tower
    assert fine.ok and "2.5" in fine.text, fine
