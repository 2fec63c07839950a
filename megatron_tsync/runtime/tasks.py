"""RL tasks: a registry of prompt sources with their reward, plus the quickstart task ``arithmetic-calculator``.

A task is any object with (the :class:`Task` protocol)::

    name: str                                   # registry key
    verifier: str                               # a name in rollout.verifiers ("exact_answer", ...)
    verifier_kwargs: dict                       # passed to get_verifier
    reward_spec: RewardSpec                     # what the learner may assume about rewards (binary / bounded)
    sample_prompts(step, num_groups, seed, *, split="train") -> list[TaskInstance]   # one instance per group
    demonstration_segments(inst) -> list[(text, is_action)]   # a correct transcript, split as the agent loop sees it
    demonstration(inst) -> str                  # "".join of the segments: the full correct transcript

``sample_prompts`` is a pure function of ``(step, num_groups, seed, split)``: the same arguments give the same
instances on every rank and in every run, and group ``g`` of a step does not depend on ``num_groups``. The
``"eval"`` split is disjoint from ``"train"`` (an instance belongs to exactly one split, decided by a hash of its
content), so held-out evaluation never sees a training prompt.

``demonstration_segments`` pairs each piece of text with whether the policy generates it (``True``: an action the
loss is taken on) or the environment/user supplies it (``False``: the prompt, ``<result>...</result>`` tool output).
Tokenising each segment on its own reproduces the token sequence of the agent loop, which encodes the prompt and each
tool result separately and appends the generated tokens in between.

The arithmetic task. Prompt ``<s>Q: 37+18*4 ``; the correct transcript is::

    <s>Q: 37+18*4 <tool>calculator: 37+18*4</tool><result>109</result><answer>109</answer>
    \\_____prompt_/\\____________action____________/\\___tool output__/\\______action______/

``<result>109</result>`` is appended by the environment (the sandboxed ``calculator`` tool of
``rollout/tools.py``), never generated. Reward: ``exact_answer`` (binary 0/1) by default, or ``answer_with_format``
(bounded shaped reward). Difficulty knobs: operand count (``min_operands``..``max_operands``), operand range
(``max_value``) and the operators. Without the tool the tiny model cannot multiply; with it the task reduces to
copying the expression into the call and the result into the answer, which a short supervised warm start teaches
only partially (see ``examples/tiny_agent/README.md`` for measured success rates).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import zlib
from collections.abc import Iterator
from typing import Any, Callable, Protocol, runtime_checkable

from megatron_tsync.algorithms.streamability import RewardSpec

__all__ = [
    "TaskInstance", "Task", "register_task", "register_task_family", "get_task", "task_from_config", "available_tasks",
    "ArithmeticCalculatorTask",
    "evaluate_expression",
]


@dataclasses.dataclass(frozen=True)
class TaskInstance:
    """One prompt of a task. ``answer`` is what the verifier compares against; ``meta`` is task specific."""

    prompt_text: str
    answer: Any
    meta: dict = dataclasses.field(default_factory=dict)

    def verifier_task(self) -> dict:
        """The mapping the verifiers read (``{"answer": ..., **meta}``)."""
        return {**self.meta, "answer": self.answer}


@runtime_checkable
class Task(Protocol):
    """Contract of a task (see the module docstring)."""

    name: str
    verifier: str
    verifier_kwargs: dict
    reward_spec: RewardSpec

    def sample_prompts(self, step: int, num_groups: int, seed: int, *, split: str = "train") -> list[TaskInstance]: ...

    def demonstration_segments(self, inst: TaskInstance) -> list[tuple[str, bool]]: ...

    def demonstration(self, inst: TaskInstance) -> str: ...


_REGISTRY: dict[str, Callable[..., Task]] = {}


def register_task(name: str) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    """Decorator: register a task class (or factory) under `name`; :func:`get_task` instantiates it."""

    def deco(factory):
        _REGISTRY[name] = factory
        return factory

    return deco


def get_task(name: str, **kwargs: Any) -> Task:
    """A new instance of the task registered as `name` (kwargs go to its constructor: difficulty, verifier ...).

    ``"some.module:task-name"`` first imports ``some.module`` (which registers its tasks with :func:`register_task`),
    then looks up ``task-name``: how recipes outside the package (``examples/``) bring their own tasks, in the trainer
    and in every rollout worker alike (the module must be importable there: run from the repository root).
    ``reasoning-gym:NAME[:k=v,...]`` is reasoning-gym's dataset NAME (``runtime/reasoning_gym_task.py``).
    """
    prefix, _, rest = name.partition(":")
    if name not in _REGISTRY and (prefix in _FAMILIES or prefix in _FAMILY_MODULES):  # "reasoning-gym:chain_sum"
        import importlib

        if prefix not in _FAMILIES:  # its module registers it (imported on first use: an optional dependency)
            importlib.import_module(_FAMILY_MODULES[prefix])
        return _FAMILIES[prefix](rest, **kwargs)
    if name not in _REGISTRY and ":" in name:
        import importlib

        module, _, key = name.partition(":")
        importlib.import_module(module)
        if key in _REGISTRY:
            return _REGISTRY[key](**kwargs)
    try:
        factory = _REGISTRY[name]
    except KeyError:
        families = ", ".join(f"{p}:NAME" for p in sorted(set(_FAMILIES) | set(_FAMILY_MODULES)))
        raise KeyError(f"unknown task {name!r}; available: {', '.join(sorted(_REGISTRY))}, {families}") from None
    return factory(**kwargs)


def task_from_config(rollout) -> Task:
    """The run's task from its ``RolloutConfig`` (the trainer, its pre-flight and every rollout worker build it here,
    so they draw from the same pool): ``get_task(rollout.task, verifier=rollout.verifier)``, and
    ``keep_trivial_tasks=True`` with ``--tau2-keep-trivial-tasks``, which only τ² tasks accept."""
    kwargs: dict[str, Any] = {"verifier": rollout.verifier}
    if rollout.tau2_keep_trivial_tasks:
        kwargs["keep_trivial_tasks"] = True
    try:
        return get_task(rollout.task, **kwargs)
    except TypeError as e:
        if "keep_trivial_tasks" not in str(e):
            raise
        raise ValueError(f"--tau2-keep-trivial-tasks applies to τ² tasks (megatron_tsync.runtime.tau2_tasks:NAME) "
                         f"only; task {rollout.task} takes no such option") from None


_FAMILIES: dict[str, Callable[..., Task]] = {}
_FAMILY_MODULES = {"reasoning-gym": "megatron_tsync.runtime.reasoning_gym_task"}
"""Task families, named ``PREFIX:REST``: the factory registered for ``PREFIX`` gets ``REST`` (``reasoning-gym:NAME``:
``runtime/reasoning_gym_task.py``); a built-in family's module is imported when one of its names is first asked for."""


def register_task_family(prefix: str) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    """Decorator: ``factory(rest, **kwargs)`` builds the task named ``PREFIX:REST`` (see :func:`get_task`)."""

    def deco(factory):
        _FAMILIES[prefix] = factory
        return factory

    return deco


def available_tasks() -> list[str]:
    return sorted(_REGISTRY)


def read_jsonl(path: str) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` of each non-blank line of a JSONL task file; every error names ``path:line``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such task file")
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not UTF-8 ({e})") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({getattr(e, 'msg', e)} at column "
                                 f"{getattr(e, 'colno', '?')})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
            yield n, rec


# ------------------------------------------------------------------------------------------------------ arithmetic
_PRECEDENCE = {"+": 1, "-": 1, "*": 2}


def evaluate_expression(expr: str) -> int:
    """Integer value of ``a op b op c ...`` with ``+ - *`` and the usual precedence (no ``eval``)."""
    nums, ops, cur = [], [], ""
    for ch in expr:
        if ch.isdigit():
            cur += ch
        elif ch in _PRECEDENCE:
            if not cur:
                raise ValueError(f"malformed expression {expr!r}")
            nums.append(int(cur))
            ops.append(ch)
            cur = ""
        else:
            raise ValueError(f"unsupported character {ch!r} in {expr!r}")
    if not cur:
        raise ValueError(f"malformed expression {expr!r}")
    nums.append(int(cur))
    terms, signs = [nums[0]], []  # fold '*' first, then + / - left to right
    for op, n in zip(ops, nums[1:]):
        if op == "*":
            terms[-1] *= n
        else:
            terms.append(n)
            signs.append(op)
    total = terms[0]
    for op, t in zip(signs, terms[1:]):
        total = total + t if op == "+" else total - t
    return total


def _mix(*parts: int) -> int:
    """A 63-bit seed from integer coordinates (splitmix64, as rollout.engine.derive_seed, without importing it)."""
    mask = (1 << 64) - 1
    x = 0
    for p in parts:
        x = (x + 0x9E3779B97F4A7C15 + (p & mask)) & mask
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & mask
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & mask
        x ^= x >> 31
    return x >> 1


_SPLITS = {"train": 0, "eval": 1}


@register_task("arithmetic-calculator")
@dataclasses.dataclass(frozen=True)
class ArithmeticCalculatorTask:
    """``Q: a op b [op c]``: call the calculator tool, then answer with its result (see the module docstring).

    Args:
        min_operands / max_operands: operand count, uniform in the range (default 2..3).
        max_value: operands are uniform integers in ``[0, max_value]`` (default 99).
        ops: operator alphabet (subset of ``+-*``).
        verifier: ``"exact_answer"`` (binary) or ``"answer_with_format"`` (bounded, shaped).
        heldout_mod: one instance in ``heldout_mod`` (by hash of the expression) belongs to the eval split.
        bos: text prepended to every prompt (the tokenizer's BOS).
    """

    min_operands: int = 2
    max_operands: int = 3
    max_value: int = 99
    ops: str = "+-*"
    verifier: str = "exact_answer"
    verifier_kwargs: dict = dataclasses.field(default_factory=dict)
    heldout_mod: int = 8
    bos: str = "<s>"
    name: str = "arithmetic-calculator"

    def __post_init__(self):
        if not 1 <= self.min_operands <= self.max_operands:
            raise ValueError(f"need 1 <= min_operands <= max_operands, got {self.min_operands}..{self.max_operands}")
        if self.max_value < 1:
            raise ValueError(f"max_value must be >= 1, got {self.max_value}")
        if not self.ops or set(self.ops) - set(_PRECEDENCE):
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {self.ops!r}")
        if self.verifier not in ("exact_answer", "answer_with_format"):
            raise ValueError(f"verifier must be 'exact_answer' or 'answer_with_format', got {self.verifier!r}")
        if self.heldout_mod < 2:
            raise ValueError(f"heldout_mod must be >= 2, got {self.heldout_mod}")

    @property
    def reward_spec(self) -> RewardSpec:
        return RewardSpec.binary(0.0, 1.0) if self.verifier == "exact_answer" else RewardSpec.bounded(0.0, 1.0)

    # ------------------------------------------------------------------ prompts
    def _split_of(self, expr: str) -> str:
        return "eval" if zlib.crc32(expr.encode()) % self.heldout_mod == 0 else "train"

    def _expression(self, rng: random.Random) -> str:
        n = rng.randint(self.min_operands, self.max_operands)
        parts = [str(rng.randint(0, self.max_value))]
        for _ in range(n - 1):
            parts += [rng.choice(self.ops), str(rng.randint(0, self.max_value))]
        return "".join(parts)

    def instance(self, expr: str, **meta: Any) -> TaskInstance:
        """The instance of a given expression (for tests and hand-written prompts)."""
        return TaskInstance(f"{self.bos}Q: {expr} ", evaluate_expression(expr), {"expression": expr, **meta})

    def sample_prompts(self, step: int, num_groups: int, seed: int, *, split: str = "train") -> list[TaskInstance]:
        """Group ``g`` of step ``step`` draws from its own generator seeded by ``(seed, split, step, g)``."""
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
        out = []
        for g in range(num_groups):
            rng = random.Random(_mix(seed, _SPLITS[split], step, g))
            for _ in range(10_000):  # rejection: keep the splits disjoint (~1/heldout_mod acceptance for eval)
                expr = self._expression(rng)
                if self._split_of(expr) == split:
                    break
            else:  # pragma: no cover - only for degenerate, tiny expression spaces
                raise RuntimeError(f"no {split} expression found; widen the difficulty settings")
            out.append(self.instance(expr, step=step, group=g, split=split))
        return out

    def make_environment(self, sandbox=None, *, delay_fn=None):
        """The rollout worker's environment: the sandboxed calculator tool and this task's answer verifier
        (``rollout/envs/calculator.py``); ``delay_fn(trajectory, turn)`` is the latency profile's tool delay."""
        from megatron_tsync.rollout.envs.calculator import CalculatorEnv

        return CalculatorEnv(sandbox, verifier=self.verifier, verifier_kwargs=self.verifier_kwargs, delay_fn=delay_fn)

    # ------------------------------------------------------------------ demonstrations
    def demonstration_segments(self, inst: TaskInstance) -> list[tuple[str, bool]]:
        expr = inst.meta["expression"]
        value = str(inst.answer)
        return [
            (inst.prompt_text, False),
            (f"<tool>calculator: {expr}</tool>", True),
            (f"<result>{value}</result>", False),
            (f"<answer>{value}</answer>", True),
        ]

    def demonstration(self, inst: TaskInstance) -> str:
        return "".join(text for text, _ in self.demonstration_segments(inst))
