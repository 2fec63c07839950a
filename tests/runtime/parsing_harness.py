"""A harness that scores its own episodes the way docs/harness.md tells a harness author to: the example agent's
conversation (``examples/openai_harness/agent.py:converse``), then the final reply's content parsed for the last
``<answer>...</answer>`` (the tag format keeps the stop string ``</answer>``), compared with the value of the
prompt's expression (``Q: 37+18*4 `` -> 109), and ``{"metadata": {"reward": R}}`` on finish."""

from __future__ import annotations

import re

import openai

from examples.openai_harness.agent import calculator, converse

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def reward_of(prompt: str, content: str) -> float:
    found = ANSWER.findall(content or "")
    expected = calculator(prompt.strip().removeprefix("Q:").strip())
    return float(bool(found) and found[-1].strip() == expected)


async def run_episode(base_url: str, episode_id: str, task: dict, model: str) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="tsync", max_retries=0, timeout=120.0,
                                default_headers={"X-Episode-Id": episode_id})
    try:
        messages = await converse(client, task, model)
        reward = reward_of(task["prompt"], messages[-1].get("content", "") if len(messages) > 1 else "")
        await client.post(f"/episodes/{episode_id}/finish", body={"metadata": {"reward": reward}}, cast_to=str)
    finally:
        await client.close()
