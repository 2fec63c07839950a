"""The environment protocol: an async, multi-turn episode per trajectory, owning its workspace, ending in a verdict.

::

    env = get_environment("swe-lite", ...)            # (rollout.envs) or CalculatorEnv(), WorkspaceEnv(...)
    ep = await env.start(task)                        # a fresh, isolated workspace for this trajectory
    ep.prompt                                         # the first observation (the task, the tools, the format)
    obs = await ep.step(model_turn_text)              # runs the turn's tool call -> Observation(text, done)
    ...                                               # until obs.done (submit) or the agent loop's limits
    verdict = await ep.finish(transcript)             # the reward, from a verifier the agent cannot reach
    # finish() closes the episode (workspace removed); close() alone discards it (e.g. on an engine error)

Token in / token out: the agent loop (``rollout/agent_loop.py``) keeps the generated token ids as sampled and
appends ``obs.text`` encoded on its own, with loss mask 0. :class:`EnvTools` is the agent loop's tool executor for
an environment: it finds the trajectory's episode in ``traj.metadata["episode"]`` (through the loop's
``CURRENT_CALL``) and, when the observation ends the episode (``submit``), sets the trajectory's finish reason to
``"done"`` so the loop stops generating.
Standard library only (the environments import the sandbox lazily). This module holds the registry
(:func:`register_environment`); the lookup (``get_environment``, ``available_environments``) lives in the package's
``__init__``, which imports the built-in environments first, so no environment module and this one import each other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

__all__ = ["Observation", "Episode", "Environment", "EnvTools", "register_environment", "run_scripted"]


@dataclass(frozen=True)
class Observation:
    text: str
    """What is appended to the context after the model's turn (already in the tool format's markup): the format's
    ``render_result``, a :class:`~megatron_tsync.model.tokenizer.Rendered` whose tool output the agent loop encodes
    as plain text (a plain ``str`` is plain text throughout)."""
    done: bool = False
    """The episode is over (the agent submitted); no further turn is generated."""
    ok: bool = True
    tool: str | None = None
    error: str | None = None
    wall_s: float = 0.0


@runtime_checkable
class Episode(Protocol):
    prompt: str

    async def step(self, action_text: str) -> Observation: ...

    async def finish(self, transcript: str = "") -> Any: ...

    def close(self) -> None: ...


@runtime_checkable
class Environment(Protocol):
    name: str

    async def start(self, task: Any) -> Episode: ...


_REGISTRY: dict[str, Callable[..., Environment]] = {}


def register_environment(name: str):
    def deco(factory):
        _REGISTRY[name] = factory
        return factory

    return deco


class EnvTools:
    """The agent loop's tool executor for environment episodes (see the module docstring)."""

    async def __call__(self, turn_text: str):
        from megatron_tsync.rollout.agent_loop import CURRENT_CALL, ToolStep

        ctx = CURRENT_CALL.get()
        if ctx is None or "episode" not in ctx[0].metadata:
            raise RuntimeError("EnvTools needs the trajectory's episode in traj.metadata['episode']")
        traj, _turn = ctx
        t0 = time.perf_counter()
        obs = await traj.metadata["episode"].step(turn_text)
        if obs.done:
            traj.finish_reason = "done"
        return ToolStep(obs.text, obs.ok, obs.tool, None, obs.error, obs.wall_s or time.perf_counter() - t0)


async def run_scripted(env: Environment, task: Any, actions: list[str]) -> tuple[Any, list[Observation]]:
    """Drive one episode with fixed model turns (tests, demonstrations): (verdict, observations). ``finish`` gets
    the text after the prompt (turns and observations), as the rollout worker passes it."""
    ep = await env.start(task)
    observations, transcript = [], ""
    try:
        for action in actions:
            obs = await ep.step(action)
            observations.append(obs)
            transcript += action + obs.text
            if obs.done:
                break
    except BaseException:
        ep.close()
        raise
    return await ep.finish(transcript), observations
