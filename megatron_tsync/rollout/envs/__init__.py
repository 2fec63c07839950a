"""Agentic environments (issue 13): the episode protocol (``base``), tool-call formats (``tool_format``), the
workspace environment with its tools and the hidden-test verifier, and the built-in suites / loaders.

Importing the package registers the built-in environments (``get_environment``): "workspace", "swe-lite",
"terminal-lite", "calculator", "log-search", "tau2" (τ²-bench; its package is imported on first use).
"""

from __future__ import annotations

from typing import Any

from megatron_tsync.rollout.envs import (  # noqa: F401
    calculator, log_search, swe_lite, tau2_env, terminal_lite, workspace_env,
)
from megatron_tsync.rollout.envs.base import _REGISTRY, Environment

__all__ = ["get_environment", "available_environments"]


def get_environment(name: str, **kwargs: Any) -> Environment:
    try:
        return _REGISTRY[name](**kwargs)
    except KeyError:
        raise KeyError(f"unknown environment {name!r}; available: {', '.join(sorted(_REGISTRY))}") from None


def available_environments() -> list[str]:
    return sorted(_REGISTRY)
