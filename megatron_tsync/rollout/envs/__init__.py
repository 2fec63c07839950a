"""Agentic environments (issue 13): the episode protocol (``base``), tool-call formats (``tool_format``), the
workspace environment with its tools and the hidden-test verifier, and the built-in suites / loaders.

Importing the package registers the built-in environments (``get_environment``): "workspace", "swe-lite",
"terminal-lite", "calculator".
"""

from megatron_tsync.rollout.envs import calculator, swe_lite, terminal_lite, workspace_env  # noqa: F401 - registration
