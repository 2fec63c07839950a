"""Reward verifiers: a registry of async scorers, each declaring its reward range and whether it is binary.

A verifier scores the full trajectory text of one rollout against its task::

    v = get_verifier("exact_answer")
    reward = await v.score(trajectory_text, {"answer": 42})      # float in v.reward_range
    detail = await v.evaluate(trajectory_text, task)            # Score(reward, reason)

``reward_range = (lo, hi)`` and ``binary`` are part of the contract: the learner uses them for its exact clip rule
(rewards are checked to lie in the declared range; a binary verifier only ever returns lo or hi).

Tasks are mappings (or objects with attributes). Keys used by the built-ins:
- ``exact_answer`` / ``answer_with_format``: ``answer`` (int).
- ``reasoning_gym``: ``entry`` (a reasoning-gym entry; the dataset's own ``score_answer`` gives the reward).
- ``unit_tests``: ``tests`` (list of Python snippets run against the solution) or ``test_command`` (shell command whose
  output reports ``N passed`` / ``M failed`` pytest-style, or ``PASS``/``FAIL`` lines); optional ``files`` (path ->
  content written to the sandbox first) and ``solution_path`` (default ``solution.py``) where the LAST fenced code
  block of the final text is written.

Answers and code are read only outside ``<result>`` blocks, so tool output cannot forge an answer.
This module imports only the standard library and the rollout sandbox/tools modules (and reasoning-gym, on use).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from megatron_tsync.rollout.sandbox import Sandbox, SandboxConfig
from megatron_tsync.rollout.tools import ToolCall, _mask_results, parse_tool_call

__all__ = [
    "Score", "Verifier", "register_verifier", "get_verifier", "available_verifiers", "parse_answer",
    "ExactAnswer", "AnswerWithFormat", "UnitTests", "ReasoningGymScore",
]


@dataclass(frozen=True)
class Score:
    reward: float
    reason: str


@runtime_checkable
class Verifier(Protocol):
    """Contract of a reward function (see the module docstring)."""

    name: str
    reward_range: tuple[float, float]
    binary: bool

    async def score(self, trajectory_text: str, task: Any) -> float: ...

    async def evaluate(self, trajectory_text: str, task: Any) -> Score: ...


_REGISTRY: dict[str, Callable[..., Verifier]] = {}


def register_verifier(name: str) -> Callable[[Callable[..., Verifier]], Callable[..., Verifier]]:
    """Decorator: register a verifier class (or factory) under `name`; it is instantiated by :func:`get_verifier`."""

    def deco(factory: Callable[..., Verifier]) -> Callable[..., Verifier]:
        _REGISTRY[name] = factory
        return factory

    return deco


def get_verifier(name: str, **kwargs: Any) -> Verifier:
    """A new instance of the verifier registered as `name` (kwargs go to its constructor)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown verifier {name!r}; available: {', '.join(sorted(_REGISTRY))}") from None
    return factory(**kwargs)


def available_verifiers() -> list[str]:
    return sorted(_REGISTRY)


def _task_get(task: Any, key: str, default: Any = None) -> Any:
    if isinstance(task, Mapping):
        return task.get(key, default)
    return getattr(task, key, default)


class _Base:
    """Shared plumbing: ``score`` = ``evaluate().reward``, clamped to the declared range."""

    name = "base"
    reward_range: tuple[float, float] = (0.0, 1.0)
    binary = False

    async def evaluate(self, trajectory_text: str, task: Any) -> Score:
        raise NotImplementedError

    async def score(self, trajectory_text: str, task: Any) -> float:
        return (await self.evaluate(trajectory_text, task)).reward

    def _clamp(self, s: Score) -> Score:
        lo, hi = self.reward_range
        return Score(min(hi, max(lo, float(s.reward))), s.reason)


# ------------------------------------------------------------------------------------------------------- answers
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INT_RE = re.compile(r"[+-]?\d+\Z")


def parse_answer(text: str) -> tuple[int | None, str]:
    """The integer in the last ``<answer>...</answer>`` outside ``<result>`` blocks, or (None, reason)."""
    if not isinstance(text, str):
        return None, "trajectory is not text"
    masked = _mask_results(text)
    found = list(_ANSWER_RE.finditer(masked))
    if not found:
        if "<answer>" in masked:
            return None, "malformed: unterminated <answer> tag"
        return None, "malformed: no <answer>...</answer> in the final text"
    raw = text[found[-1].start(1):found[-1].end(1)].strip().replace(",", "").replace("_", "")
    if not _INT_RE.match(raw):
        return None, f"malformed: answer {raw[:40]!r} is not an integer"
    if len(raw) > 4300:  # int() refuses longer strings by default anyway
        return None, "malformed: answer has too many digits"
    return int(raw), "ok"


def _expected(task: Any) -> int | None:
    try:
        return int(_task_get(task, "answer"))
    except (TypeError, ValueError):
        return None


@register_verifier("exact_answer")
class ExactAnswer(_Base):
    """1.0 iff the last ``<answer>N</answer>`` equals the task's integer ``answer``; malformed answers score 0.0."""

    name = "exact_answer"
    reward_range = (0.0, 1.0)
    binary = True

    async def evaluate(self, trajectory_text: str, task: Any) -> Score:
        want = _expected(task)
        if want is None:
            return Score(0.0, "task has no integer 'answer'")
        got, why = parse_answer(trajectory_text)
        if got is None:
            return Score(0.0, why)
        return Score(1.0, "correct") if got == want else Score(0.0, f"wrong: got {got}, expected {want}")


@register_verifier("answer_with_format")
class AnswerWithFormat(_Base):
    """Bounded shaped reward in [0, 1]: ``w_correct`` for the right answer, ``w_tool`` for at least one well-formed
    tool call that received a result, ``w_format`` for exactly one parsable ``<answer>`` that ends the text."""

    name = "answer_with_format"
    reward_range = (0.0, 1.0)
    binary = False

    def __init__(self, w_correct: float = 0.6, w_tool: float = 0.2, w_format: float = 0.2):
        weights = (w_correct, w_tool, w_format)
        if min(weights) < 0 or abs(sum(weights) - 1.0) > 1e-9:
            raise ValueError(f"weights must be >= 0 and sum to 1, got {weights}")
        self.w_correct, self.w_tool, self.w_format = weights

    async def evaluate(self, trajectory_text: str, task: Any) -> Score:
        text = trajectory_text if isinstance(trajectory_text, str) else ""
        got, why = parse_answer(text)
        want = _expected(task)
        correct = got is not None and want is not None and got == want
        used_tool = _used_tool(text)
        masked = _mask_results(text)
        answers = list(_ANSWER_RE.finditer(masked))
        well_formed = got is not None and len(answers) == 1 and not masked[answers[-1].end():].strip()
        reward = self.w_correct * correct + self.w_tool * used_tool + self.w_format * well_formed
        reason = (f"correct={correct} ({why if got is None else f'got {got}, expected {want}'}), "
                  f"used_tool={used_tool}, format={well_formed}")
        return self._clamp(Score(reward, reason))


def _used_tool(text: str) -> bool:
    """At least one valid ``<tool>NAME: ARGS</tool>`` directly answered by a ``<result>`` block."""
    for m in re.finditer(r"</tool>\s*<result>", text):
        call = parse_tool_call(text[:m.start() + len("</tool>")])
        if isinstance(call, ToolCall):
            return True
    return False


# ------------------------------------------------------------------------------------------------------- reasoning-gym
@register_verifier("reasoning_gym")
class ReasoningGymScore(_Base):
    """reasoning-gym's own score (``runtime/reasoning_gym_task.py``): the dataset's ``score_answer(answer, entry)``
    on the text of the last ``<answer>…</answer>`` outside ``<result>`` blocks (None when there is none), with the
    task's ``entry``; the dataset is ``dataset`` (with ``config``), else the entry's ``metadata.source_dataset``.
    Bounded in [0, 1] (partial credit for some datasets); never clamped: a score outside it is the worker's counted
    error, not a silent 0 or 1."""

    name = "reasoning_gym"
    reward_range = (0.0, 1.0)
    binary = False

    def __init__(self, dataset: str = "", config: dict | None = None):
        self.dataset, self.config = dataset, dict(config or {})  # score_answer may read the dataset's config
        self._scorers: dict[str, Callable] = {}
        if dataset:
            self._scorer(dataset)  # fails now, not at the first trajectory: unknown dataset, bad config

    def _scorer(self, name: str) -> Callable:
        """The dataset's ``score_answer``: the task's dataset with its config, or (no dataset given) the entry's
        ``source_dataset`` with its default config."""
        if name not in self._scorers:
            try:
                import reasoning_gym
            except ImportError as e:
                raise ValueError(f"reasoning-gym is not installed ({e}): "
                                 "pip install 'megatron_tsync[reasoning-gym]'") from None
            config = self.config if name == self.dataset else {}
            self._scorers[name] = reasoning_gym.create_dataset(name, seed=0, size=1, **config).score_answer
        return self._scorers[name]

    async def evaluate(self, trajectory_text: str, task: Any) -> Score:
        entry = _task_get(task, "entry")
        if not isinstance(entry, Mapping):
            return Score(0.0, "task has no reasoning-gym 'entry'")
        masked = _mask_results(trajectory_text) if isinstance(trajectory_text, str) else ""
        found = list(_ANSWER_RE.finditer(masked))
        answer = trajectory_text[found[-1].start(1):found[-1].end(1)].strip() if found else None
        name = self.dataset or (entry.get("metadata") or {}).get("source_dataset", "")
        if not name:
            return Score(0.0, "reasoning-gym entry names no source_dataset (and the verifier no dataset)")
        reward = float(self._scorer(name)(answer, dict(entry)))
        oracle = str(entry.get("answer"))[:40]
        return Score(reward, f"{name}.score_answer({str(answer)[:40]!r}) = {reward:g} (oracle {oracle!r})")


# ------------------------------------------------------------------------------------------------------- unit tests
_FENCE_RE = re.compile(r"```[A-Za-z0-9_+-]*\n(.*?)```", re.DOTALL)
_PYTEST_RE = {k: re.compile(rf"(\d+) {k}\b") for k in ("passed", "failed", "errors?")}

# Written to the sandbox as run_tests.py: runs each test snippet in a fresh namespace that imported the solution.
_RUNNER_SRC = r'''
import json, sys, traceback
sys.path.insert(0, ".")
tests = json.load(open("tests.json"))
for i, src in enumerate(tests):
    ns = {}
    try:
        exec("from solution import *\n", ns)
        exec(compile(src, "test_%d" % i, "exec"), ns)
        print("PASS test_%d" % i, flush=True)
    except BaseException as e:
        print("FAIL test_%d: %s: %s" % (i, type(e).__name__, str(e)[:200]), flush=True)
'''


@register_verifier("unit_tests")
class UnitTests(_Base):
    """SWE-style reward: the fraction of unit tests that pass when the agent's solution runs in the sandbox.

    The solution is the last fenced code block of the final text (outside ``<result>``), written to
    ``solution_path``. A timeout, crash of the runner or unparsable test output scores 0.0 with the reason.
    """

    name = "unit_tests"
    reward_range = (0.0, 1.0)
    binary = False

    def __init__(self, sandbox: Sandbox | None = None, config: SandboxConfig | None = None):
        self._sandbox = sandbox
        self._config = config or SandboxConfig(wall_timeout_s=30.0, cpu_seconds=30, max_output_bytes=1 << 20)

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = Sandbox(self._config)
        return self._sandbox

    async def evaluate(self, trajectory_text: str, task: Any) -> Score:
        tests = _task_get(task, "tests")
        command = _task_get(task, "test_command")
        if not tests and not command:
            return Score(0.0, "task has neither 'tests' nor 'test_command'")
        files = dict(_task_get(task, "files", None) or {})
        blocks = _FENCE_RE.findall(_mask_results(trajectory_text or ""))
        solution_path = _task_get(task, "solution_path", "solution.py")
        if blocks:
            files[solution_path] = blocks[-1]
        elif solution_path not in files:
            return Score(0.0, "malformed: no fenced code block with a solution")
        if tests:
            files["tests.json"] = json.dumps(list(tests))
            files["run_tests.py"] = _RUNNER_SRC
            res = await self.sandbox.run_async([self.sandbox.python, "-I", "run_tests.py"], files=files)
        else:
            res = await self.sandbox.run_async(["/bin/sh", "-c", command], files=files)
        if res.error and (res.exit_code is None or res.exit_code < 0):
            return Score(0.0, f"test run failed: {res.error}")
        passed, total = _count(res.stdout + "\n" + res.stderr)
        if total == 0:
            return Score(0.0, f"no test results found in output ({res.error or 'exit 0'})")
        if tests and total < len(tests):
            total = len(tests)  # a test that never reported (runner died mid-way) counts as failed
        return self._clamp(Score(passed / total, f"{passed}/{total} tests passed"))


def _count(output: str) -> tuple[int, int]:
    """(passed, total) from PASS/FAIL lines, else from a pytest summary line."""
    passed = len(re.findall(r"^PASS\b", output, re.MULTILINE))
    failed = len(re.findall(r"^FAIL\b", output, re.MULTILINE))
    if passed + failed:
        return passed, passed + failed
    counts = {k: sum(int(n) for n in r.findall(output)) for k, r in _PYTEST_RE.items()}
    p = counts["passed"]
    return p, p + counts["failed"] + counts["errors?"]
