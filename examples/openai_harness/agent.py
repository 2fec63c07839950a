"""A calculator agent written against the real ``openai`` client: the harness of ``examples/openai_harness``.

It knows nothing about training. Per episode it talks to an OpenAI-compatible endpoint (``base_url``), offers one
function tool, ``calculator``, runs the model's calls itself, and ends the episode with ``POST
/episodes/{id}/finish`` (no reward: the run's verifier scores the final answer). Two ways to run it:

- as a command, one process per episode (``--harness-cmd "python examples/openai_harness/agent.py"``): inputs from
  ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``TSYNC_EPISODE_ID``, ``TSYNC_MODEL``, ``TSYNC_TASK`` (JSON);
- as an async function, one coroutine per episode inside the rollout worker
  (``--harness-fn examples.openai_harness.agent:run_episode``, what ``config.yaml`` uses: no process per episode).
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os

import openai

CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an integer arithmetic expression (+ - * // % and parentheses).",
    "parameters": {"type": "object", "properties": {"input": {"type": "string", "description": "the expression"}},
                   "required": ["input"]}}}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """The tool: the value of an integer expression, or ``error: ...``."""

    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if abs(a) > 10**12 or abs(b) > 10**12:
                raise ValueError("number too large")
            return _OPS[type(node.op)](a, b)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only integers and + - * // % ( ) are allowed")

    try:
        return str(ev(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"


async def converse(client: "openai.AsyncOpenAI", task: dict, model: str) -> list[dict]:
    """Ask, run the calculator calls, until a reply without a tool call or ``max_turns`` replies: the messages."""
    messages: list[dict] = [{"role": "user", "content": task["prompt"]}]
    for _ in range(task.get("max_turns", 3)):
        try:
            reply = (await client.chat.completions.create(model=model, messages=messages,
                                                          tools=[CALCULATOR_TOOL])).choices[0].message
        except openai.BadRequestError as e:
            if e.code == "context_length_exceeded":  # no room for another reply: the episode is over
                break
            raise
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculator(str(args.get("input", "")))})
    return messages


async def run_episode(base_url: str, episode_id: str, task: dict, model: str, api_key: str = "tsync") -> None:
    """One episode: :func:`converse`, then finish without a reward (the run's verifier scores the answer)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120.0,
                                default_headers={"X-Episode-Id": episode_id})
    try:
        await converse(client, task, model)
        # cast_to=str: the reply's text, the same in every openai release (1.x on httpx, 3.x on httpx2)
        await client.post(f"/episodes/{episode_id}/finish", body={}, cast_to=str)
    finally:
        await client.close()


def main() -> None:
    asyncio.run(run_episode(os.environ["OPENAI_BASE_URL"], os.environ["TSYNC_EPISODE_ID"],
                            json.loads(os.environ["TSYNC_TASK"]), os.environ.get("TSYNC_MODEL", "tsync-policy"),
                            os.environ.get("OPENAI_API_KEY", "tsync")))


if __name__ == "__main__":
    main()
