"""Sandboxed execution of agent tool calls and verifiers (standard library only: no torch, no megatron).

One module per concern; this package re-exports the public API (``from megatron_tsync.rollout.sandbox import Sandbox``):

- :mod:`.core`: :class:`SandboxConfig`, :class:`ToolResult`, :class:`Mount`, :class:`CallRunner`, the namespace
  backend :class:`Sandbox` and its per-trajectory :class:`Workspace` (the module docstring describes the isolation);
- :mod:`.launcher`: the launcher and probe sources run inside the namespaces (plain strings, not modules);
- :mod:`.forkserver`: the warm fork server that starts each call (the default launcher);
- :mod:`.caps`: capability detection (what the kernel allows) and the spec encoding;
- :mod:`.rootfs`: the allow-list root of every call (which host paths exist inside, what of the project is hidden);
- :mod:`.cgroup`: the per-call cgroup (v2 or v1) that caps memory and pids;
- :mod:`.fs`: scratch areas (tmpfs or directories with quotas) and their removal;
- :mod:`.io`: output pumping and file writing;
- :mod:`.report`: the enforcement report;
- :mod:`.container` and :mod:`.container_cli`: the container backends (podman; the untested docker / apptainer /
  enroot command lines), ``make_sandbox``.

Every module imports its siblings by their own path (``megatron_tsync.rollout.sandbox.fs``), never this package, so
the package has no import cycle.
"""

from megatron_tsync.rollout.sandbox.core import (_MEMORY_PATTERNS, _UID_BASE, _UID_SLOTS, LAUNCHERS, CallRunner, Mount,
                                                 Sandbox, SandboxConfig, ToolResult, Workspace, _get_executor,
                                                 detect_capabilities, open_workspaces, uids_in_use)

__all__ = ["SandboxConfig", "ToolResult", "Mount", "Sandbox", "Workspace", "detect_capabilities", "CallRunner",
           "uids_in_use", "open_workspaces", "LAUNCHERS", "_MEMORY_PATTERNS", "_UID_BASE", "_UID_SLOTS",
           "_get_executor"]
