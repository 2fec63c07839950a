"""The generated environment suites as RL tasks: ``swe-lite``, ``terminal-lite`` and ``log-search`` (``rollout/envs``).

Select with ``--task megatron_tsync.runtime.env_tasks:swe-lite`` (or ``:terminal-lite``). A task instance carries its
:class:`~megatron_tsync.rollout.envs.workspace_env.WorkspaceTask` in ``meta["env_task"]``; the rollout worker opens
one episode per trajectory through :meth:`EnvSuiteTask.make_environment` (the workspace, the tools, the hidden-test
verdict as the reward: binary 0/1), so ``verifier`` names no registry verifier: it must be "hidden_tests".

The suite is ``num_tasks`` tasks of suite seed ``suite_seed``; group ``g`` of step ``k`` draws task
``mix(seed, split, k, g) mod`` the split's pool, where task ``i`` belongs to the eval split iff
``i % heldout_mod == 0``.
Demonstrations (the supervised warm start) are the known solutions with the observations the environment writes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_tsync.algorithms.streamability import RewardSpec
from megatron_tsync.runtime.tasks import TaskInstance, _mix, register_task

__all__ = ["EnvSuiteTask", "LogSearchTask"]

_SPLITS = {"train": 0, "eval": 1}


@dataclasses.dataclass(frozen=True)
class EnvSuiteTask:
    """A generated suite as a task (see the module docstring)."""

    suite: str = "swe-lite"
    num_tasks: int = 200
    suite_seed: int = 0
    tool_format: str = "tag"
    verifier: str = "hidden_tests"
    verifier_kwargs: dict = dataclasses.field(default_factory=dict)
    heldout_mod: int = 8
    verify_timeout_s: float = 60.0
    name: str = "swe-lite"

    def __post_init__(self):
        if self.suite not in ("swe-lite", "terminal-lite"):
            raise ValueError(f"suite must be 'swe-lite' or 'terminal-lite', got {self.suite!r}")
        if self.verifier != "hidden_tests":
            raise ValueError(f"task {self.name}: the reward is the environment's hidden-test verdict: --verifier "
                             f"must be 'hidden_tests', got {self.verifier!r}")
        if self.tool_format not in ("tag", "qwen"):
            raise ValueError(f"tool_format must be 'tag' or 'qwen', got {self.tool_format!r}")
        if self.num_tasks < self.heldout_mod or self.heldout_mod < 2:
            raise ValueError(f"need heldout_mod >= 2 and num_tasks >= heldout_mod, got {self.num_tasks}, "
                             f"{self.heldout_mod}")

    @property
    def reward_spec(self) -> RewardSpec:
        return RewardSpec.binary(0.0, 1.0)

    @property
    def tool_stop_text(self) -> str:
        """The text whose token ends a tool turn (the worker's ``tool_token_ids``): ``</tool>`` or ``</tool_call>``."""
        from megatron_tsync.rollout.envs.tool_format import get_tool_format

        return get_tool_format(self.tool_format).stop_text

    def _module(self):
        if self.suite == "swe-lite":
            from megatron_tsync.rollout.envs import swe_lite

            return swe_lite
        from megatron_tsync.rollout.envs import terminal_lite

        return terminal_lite

    def _role(self) -> str:
        from megatron_tsync.rollout.envs import terminal_lite, workspace_env

        return terminal_lite.ROLE if self.suite == "terminal-lite" else workspace_env.DEFAULT_ROLE

    def sample_prompts(self, step: int, num_groups: int, seed: int, *, split: str = "train") -> list[TaskInstance]:
        from megatron_tsync.rollout.envs.workspace_env import render_prompt

        if split not in _SPLITS:
            raise ValueError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
        pool = [i for i in range(self.num_tasks) if (i % self.heldout_mod == 0) == (split == "eval")]
        out = []
        for g in range(num_groups):
            index = pool[_mix(seed, _SPLITS[split], step, g) % len(pool)]
            task = self._module().generate_task(self.suite_seed, index)
            out.append(TaskInstance(render_prompt(task, self.tool_format, self._role()), None,
                                    {"env_task": task, "task_id": task.task_id, "step": step, "group": g,
                                     "split": split}))
        return out

    def make_environment(self, sandbox=None, *, delay_fn=None) -> Any:
        """The episodes' environment (``delay_fn`` is not applied: tool latency is real)."""
        from megatron_tsync.rollout.envs.verifier import HiddenTestVerifier
        from megatron_tsync.rollout.sandbox import SandboxConfig

        verifier = HiddenTestVerifier(config=SandboxConfig(
            wall_timeout_s=self.verify_timeout_s, cpu_seconds=int(self.verify_timeout_s), memory_bytes=2 << 30,
            max_output_bytes=4 << 20))
        cls = self._module().SweLiteEnv if self.suite == "swe-lite" else self._module().TerminalLiteEnv
        return cls(sandbox=sandbox, verifier=verifier, tool_format=self.tool_format, role=self._role())

    def demonstration_segments(self, inst: TaskInstance) -> list[tuple[str, bool]]:
        from megatron_tsync.rollout.envs.workspace_env import demonstration_segments

        return demonstration_segments(inst.meta["env_task"], self.tool_format, self._role())

    def demonstration(self, inst: TaskInstance) -> str:
        return "".join(text for text, _ in self.demonstration_segments(inst))


@register_task("swe-lite")
def _swe_lite(**kwargs) -> EnvSuiteTask:
    return EnvSuiteTask(**{"suite": "swe-lite", "name": "swe-lite", **kwargs})


@register_task("terminal-lite")
def _terminal_lite(**kwargs) -> EnvSuiteTask:
    return EnvSuiteTask(**{"suite": "terminal-lite", "name": "terminal-lite", **kwargs})


# ------------------------------------------------------------------------------------------------------ log-search
@register_task("log-search")
@dataclasses.dataclass(frozen=True)
class LogSearchTask:
    """``Q: code of K7?``: find the id's line in a tree of paged logs (``rollout/envs/log_search.py``) and answer
    its code. Select with ``--task megatron_tsync.runtime.env_tasks:log-search``.

    Group ``g`` of step ``k`` draws world ``mix(seed, split, k, g)``; a world belongs to the eval split iff
    ``mix(world seed) % heldout_mod == 0`` (rejection keeps the splits disjoint, as the arithmetic task does).
    Reward: ``exact_answer`` (binary). The length knobs (``files``, ``min_pages``, ``max_pages``, ``page_lines``,
    ``code_digits``) are those of :class:`~megatron_tsync.rollout.envs.log_search.LogSpec`; the demonstrated transcript
    takes ``world.pages + 3`` turns (``next`` through every page and the end marker, ``grep``, the answer).

    ``short_frac``: the share of worlds (a pure function of the world seed, in both splits alike) that are one page
    of one file: a curriculum inside every batch, meant to let the tiny model learn the two copies (the id into
    ``grep``, the code into the answer) over a ~300-token context first. Default 0: at 0.5 a 150-step warm start
    still copied neither (0 of 64 at temperature 1, 0 of 16 at 0.3: docs/benchmarks.md), and short worlds lower the
    learner's share of a sync step (idle 72 % against 65 %).

    ``warm_tiny_steps`` / ``warm_short_steps`` (default 200 / 150): the supervised warm start's curriculum
    (:meth:`warm_start_prompts`): one page of 2 lines, then one page of ``page_lines``, then the task's worlds. The
    tiny model learns both copies on the ~60-token worlds (a jump between steps 150 and 200) and carries them over
    (docs/benchmarks.md); it never learned them starting on longer worlds.
    """

    files: int = 2
    min_pages: int = 2
    max_pages: int = 4
    page_lines: int = 8
    code_digits: int = 2
    short_frac: float = 0.0
    warm_tiny_steps: int = 200
    warm_short_steps: int = 150
    verifier: str = "exact_answer"
    verifier_kwargs: dict = dataclasses.field(default_factory=dict)
    heldout_mod: int = 8
    bos: str = "<s>"
    name: str = "log-search"

    def __post_init__(self):
        self.spec  # validates the knobs
        if self.verifier != "exact_answer":
            raise ValueError(f"task {self.name}: the answer is an integer code: --verifier must be 'exact_answer', "
                             f"got {self.verifier!r}")
        if self.heldout_mod < 2:
            raise ValueError(f"heldout_mod must be >= 2, got {self.heldout_mod}")
        if not 0.0 <= self.short_frac <= 1.0:
            raise ValueError(f"short_frac must be in [0, 1], got {self.short_frac}")
        if self.warm_tiny_steps < 0 or self.warm_short_steps < 0:
            raise ValueError(f"warm_tiny_steps and warm_short_steps must be >= 0, got {self.warm_tiny_steps}, "
                             f"{self.warm_short_steps}")

    @property
    def spec(self):
        from megatron_tsync.rollout.envs.log_search import LogSpec

        return LogSpec(self.files, self.min_pages, self.max_pages, self.page_lines, self.code_digits)

    @property
    def reward_spec(self) -> RewardSpec:
        return RewardSpec.binary(0.0, 1.0)

    def instance(self, world_seed: int, **meta: Any) -> TaskInstance:
        """The instance of world ``world_seed`` (tests, hand-picked worlds)."""
        from megatron_tsync.rollout.envs.log_search import generate_world

        short = _mix(world_seed, 3) % 1000 < round(self.short_frac * 1000)
        spec = dataclasses.replace(self.spec, files=1, min_pages=1, max_pages=1) if short else self.spec
        world = generate_world(world_seed, spec)
        return TaskInstance(f"{self.bos}Q: code of {world.key}? ", world.code,
                            {"world": world, "world_seed": world_seed, "turns": world.pages + 3, **meta})

    def sample_prompts(self, step: int, num_groups: int, seed: int, *, split: str = "train") -> list[TaskInstance]:
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
        out = []
        for g in range(num_groups):
            ws = _mix(seed, _SPLITS[split], step, g)
            while (_mix(ws) % self.heldout_mod == 0) != (split == "eval"):
                ws = _mix(ws, 1)
            out.append(self.instance(ws, step=step, group=g, split=split))
        return out

    def warm_start_prompts(self, step: int, num_groups: int, seed: int) -> list[TaskInstance]:
        """The supervised warm start's batch ``step`` (``training.sft.sft_warmup``), a curriculum: the first
        ``warm_tiny_steps`` batches are worlds of one page of 2 lines (~60 tokens: where the tiny model first learns
        the two copies), the next ``warm_short_steps`` one page of ``page_lines`` lines (~300 tokens), then the
        task's own worlds. RL and the held-out split never see the easier worlds."""
        if step < self.warm_tiny_steps:
            task = dataclasses.replace(self, short_frac=1.0, page_lines=2)
        elif step < self.warm_tiny_steps + self.warm_short_steps:
            task = dataclasses.replace(self, short_frac=1.0)
        else:
            task = self
        return task.sample_prompts(step, num_groups, seed)

    def make_environment(self, sandbox=None, *, delay_fn=None) -> Any:
        """The episodes' environment: the sandboxed tools, ``delay_fn(trajectory, turn)`` (the latency profile) as
        each call's real wait, the answer verifier."""
        from megatron_tsync.rollout.envs.log_search import LogSearchEnv

        return LogSearchEnv(sandbox, verifier=self.verifier, verifier_kwargs=self.verifier_kwargs, delay_fn=delay_fn)

    def demonstration_segments(self, inst: TaskInstance) -> list[tuple[str, bool]]:
        from megatron_tsync.rollout.envs.log_search import demonstration_segments

        return demonstration_segments(inst.prompt_text, inst.meta["world"])

    def demonstration(self, inst: TaskInstance) -> str:
        return "".join(text for text, _ in self.demonstration_segments(inst))
