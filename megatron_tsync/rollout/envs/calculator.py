"""The calculator task as an environment: ``<tool>calculator: EXPR</tool>`` -> ``<result>VALUE</result>``, verdict
from the task's answer verifier (``exact_answer`` or ``answer_with_format``, ``rollout/verifiers.py``).

The same tools and the same verifier as before (``rollout/tools.py`` in a stateless sandbox call per tool call, the
result formatted by ``format_tool_result``), so the quickstart trains exactly as it did. The calculator keeps no
state between calls, so its episode needs no workspace. ``delay_fn(trajectory, turn) -> seconds`` (optional) adds
the latency profile's real delay inside the sandboxed child, as ``agent_loop.RegistryTools`` does.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from megatron_tsync.rollout.envs.base import Observation, register_environment
from megatron_tsync.rollout.envs.verifier import Verdict

__all__ = ["CalculatorEnv", "CalculatorEpisode"]


class CalculatorEnv:
    """Episodes of answer-checked tool tasks (the arithmetic-calculator task). ``task`` objects have
    ``prompt_text`` and ``verifier_task()`` (``runtime.tasks.TaskInstance``)."""

    name = "calculator"

    def __init__(self, sandbox=None, *, verifier: str = "exact_answer", verifier_kwargs: dict | None = None,
                 delay_s: float = 0.0, delay_fn: Callable[[Any, int], float] | None = None):
        from megatron_tsync.rollout.verifiers import get_verifier

        if sandbox is None:
            from megatron_tsync.rollout.sandbox import Sandbox

            sandbox = Sandbox()
        self.sandbox = sandbox
        self.verifier = get_verifier(verifier, **(verifier_kwargs or {}))
        self.delay_s, self.delay_fn = delay_s, delay_fn

    async def start(self, task: Any) -> "CalculatorEpisode":
        return CalculatorEpisode(self, task)


class CalculatorEpisode:
    def __init__(self, env: CalculatorEnv, task: Any):
        self.env, self.task = env, task
        self.prompt: str = task.prompt_text

    async def step(self, action_text: str) -> Observation:
        from megatron_tsync.rollout import tools
        from megatron_tsync.rollout.agent_loop import CURRENT_CALL

        call = tools.parse_tool_call(action_text)
        if call is None:
            call = tools.ToolCallError("no complete <tool>NAME: ARGS</tool> call before </tool>", (0, 0))
        delay = self.env.delay_s
        ctx = CURRENT_CALL.get()
        if self.env.delay_fn is not None and ctx is not None:
            delay = float(self.env.delay_fn(*ctx))
        res = await tools.execute_tool_call_async(call, self.env.sandbox, delay)
        return Observation(tools.format_tool_result(res), ok=res.ok, tool=getattr(call, "name", None),
                           error=res.error, wall_s=res.wall_s)

    async def finish(self, transcript: str = "") -> Verdict:
        """`transcript`: the generated text after the prompt (tool results included), as the verifiers read it."""
        t0 = time.monotonic()
        score = await self.env.verifier.evaluate(transcript, self.task.verifier_task())
        return Verdict(float(score.reward), score.reason, time.monotonic() - t0)

    def close(self) -> None:
        pass


@register_environment("calculator")
def _make(**kwargs) -> CalculatorEnv:
    return CalculatorEnv(**kwargs)
