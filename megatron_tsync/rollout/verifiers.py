"""Reward verifiers: a registry of async scorers, each declaring its reward range and whether it is binary.

A verifier scores the full trajectory text of one rollout against its task::

    v = get_verifier("exact_answer")
    reward = await v.score(trajectory_text, {"answer": 42})      # float in v.reward_range
    detail = await v.evaluate(trajectory_text, task)            # Score(reward, reason)

``reward_range = (lo, hi)`` and ``binary`` are part of the contract: the learner uses them for its exact clip rule
(rewards are checked to lie in the declared range; a binary verifier only ever returns lo or hi).

Tasks are mappings (or objects with attributes). Keys used by the built-ins:
- ``exact_answer`` / ``answer_with_format``: ``answer`` (int).
- ``reasoning_gym``: ``entry`` (a reasoning-gym entry; the dataset's own ``score_answer`` gives the reward, run in
  the sandbox: ``rollout/reasoning_gym_scorer.py``).
- ``unit_tests``: ``tests`` (list of Python snippets whose ``assert EXPR op LITERAL`` checks are judged here, never
  in the sandbox: :class:`UnitTests`); optional ``files`` (path -> content written to the sandbox first) and
  ``solution_path`` (default ``solution.py``) where the LAST fenced code block of the final text is written.

Answers and code are read only outside ``<result>`` blocks, so tool output cannot forge an answer; and the text a
verifier gets is :func:`verifier_transcript`: the model's generated tokens as they decode, everything else after the
prompt (tool results, a harness's messages, markers the server added) as one ``<result>`` block each with its tags
escaped, so only text the model generated can carry an answer, a tool call or a code block.
This module imports only the standard library and the rollout sandbox/tools modules (and reasoning-gym, on use).
Model text reaches no third-party parser in this process: reasoning-gym's scorer runs in the sandbox.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from megatron_tsync.rollout.sandbox import Sandbox, SandboxConfig
from megatron_tsync.rollout.tools import (
    RESULT_CLOSE, RESULT_OPEN, ToolCall, _mask_results, _neutralise, parse_tool_call,
)

__all__ = [
    "Score", "Verifier", "register_verifier", "get_verifier", "available_verifiers", "parse_answer", "answer_spans",
    "ExactAnswer", "AnswerWithFormat", "UnitTests", "ReasoningGymScore", "plan_snippet", "verifier_transcript",
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


def verifier_transcript(token_ids: Sequence[int], loss_mask: Sequence[int], prompt_len: int,
                        decode: Callable[[Sequence[int]], str]) -> str:
    """The text verifiers read of a trajectory (see the module docstring): after the prompt, each run of generated
    tokens (``loss_mask`` 1) decoded as is; each other run (an observation) decoded, one enclosing ``<result>`` ...
    ``</result>`` taken off, its ``<tool>`` / ``<result>`` / ``<answer>`` tags escaped, and put in one ``<result>``
    block. For the native agent loop this is the decoded text unchanged (its results are such blocks already)."""
    out, start, n = [], int(prompt_len), len(token_ids)
    while start < n:
        gen = bool(loss_mask[start])
        end = start
        while end < n and bool(loss_mask[end]) == gen:
            end += 1
        text = decode(list(token_ids[start:end]))
        if not gen:
            if text.startswith(RESULT_OPEN) and text.endswith(RESULT_CLOSE):
                text = text[len(RESULT_OPEN):len(text) - len(RESULT_CLOSE)]
            elif text.startswith(RESULT_OPEN):  # a result cut at the context's end
                text = text[len(RESULT_OPEN):]
            text = RESULT_OPEN + _neutralise(text) + RESULT_CLOSE
        out.append(text)
        start = end
    return "".join(out)


# ------------------------------------------------------------------------------------------------------- answers
def answer_spans(text: str, open_tag: str = "<answer>", close_tag: str = "</answer>") -> list[tuple[int, int]]:
    """(start, end) of each ``open_tag … close_tag`` body, as ``re.finditer`` of ``open(.*?)close`` (DOTALL) finds
    them, by ``str.find``: linear in the text. The regex rescans to the end for each unclosed opening, quadratic:
    56 s on 128 KB of ``<answer>`` (a 32k-token completion)."""
    spans, pos = [], 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            return spans
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:  # no later opening has a close either
            return spans
        spans.append((start + len(open_tag), end))
        pos = end + len(close_tag)
_INT_RE = re.compile(r"[+-]?\d+\Z")


def parse_answer(text: str) -> tuple[int | None, str]:
    """The integer in the last ``<answer>...</answer>`` outside ``<result>`` blocks, or (None, reason)."""
    if not isinstance(text, str):
        return None, "trajectory is not text"
    masked = _mask_results(text)
    found = answer_spans(masked)
    if not found:
        if "<answer>" in masked:
            return None, "malformed: unterminated <answer> tag"
        return None, "malformed: no <answer>...</answer> in the final text"
    raw = text[found[-1][0]:found[-1][1]].strip().replace(",", "").replace("_", "")
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
        answers = answer_spans(masked)
        well_formed = (got is not None and len(answers) == 1
                       and not masked[answers[-1][1] + len("</answer>"):].strip())
        reward = self.w_correct * correct + self.w_tool * used_tool + self.w_format * well_formed
        reason = (f"correct={correct} ({why if got is None else f'got {got}, expected {want}'}), "
                  f"used_tool={used_tool}, format={well_formed}")
        return self._clamp(Score(reward, reason))


_THEN_RESULT = re.compile(r"\s*<result>")


def _used_tool(text: str) -> bool:
    """At least one valid ``<tool>NAME: ARGS</tool>`` directly answered by a ``<result>`` block (outside
    ``<result>`` blocks itself). One pass: each call is parsed alone (its opening lies after the previous
    ``</tool>``); parsing the text up to every ``</tool><result>`` was quadratic (23 s on 64 KB)."""
    masked, close, prev = _mask_results(text), "</tool>", 0
    while (c := text.find(close, prev)) >= 0:
        if masked.startswith(close, c) and _THEN_RESULT.match(text, c + len(close)):
            start = masked.rfind("<tool>", prev, c)
            if start >= 0 and isinstance(parse_tool_call(text[start:c + len(close)]), ToolCall):
                return True
        prev = c + len(close)
    return False


# ------------------------------------------------------------------------------------------------------- reasoning-gym
@register_verifier("reasoning_gym")
class ReasoningGymScore(_Base):
    """reasoning-gym's own score (``runtime/reasoning_gym_task.py``): the dataset's ``score_answer(answer, entry)``
    on the text of the last ``<answer>…</answer>`` outside ``<result>`` blocks (None when there is none), with the
    task's ``entry``; the dataset is ``dataset`` (with ``config``), else the entry's ``metadata.source_dataset``.

    ``score_answer`` runs in the sandbox (``rollout/reasoning_gym_scorer.py``: some datasets ``eval`` the answer);
    this process only checks that a finite float in [0, 1] came back. A scorer that raises, runs past its limits or
    gives anything else raises :class:`~megatron_tsync.rollout.reasoning_gym_scorer.ScorerFailed` (the worker's
    "error" trajectory, counted under the reason code its error text starts with); never clamped. Partial credit
    for some datasets. ``sandbox``/``limits`` (a ``ScorerLimits``): the scorer's own (default: a sandbox of its own,
    started at the first answer, whose fork server has reasoning_gym imported)."""

    name = "reasoning_gym"
    reward_range = (0.0, 1.0)
    binary = False

    def __init__(self, dataset: str = "", config: dict | None = None, sandbox: Sandbox | None = None,
                 limits: Any = None):
        from megatron_tsync.rollout.reasoning_gym_scorer import ReasoningGymScorer

        self.dataset, self.config = dataset, dict(config or {})  # score_answer may read the dataset's config
        if dataset:
            self._check_dataset(dataset)  # fails now, not at the first trajectory: unknown dataset, bad config
        self.scorer = ReasoningGymScorer(limits, sandbox, self.reward_range)

    def _check_dataset(self, name: str) -> None:
        """The dataset exists and takes the config (built here once: trusted code, no model text)."""
        try:
            import reasoning_gym
        except ImportError as e:
            raise ValueError(f"reasoning-gym is not installed ({e}): "
                             "pip install 'megatron_tsync[reasoning-gym]'") from None
        reasoning_gym.create_dataset(name, seed=0, size=1, **self.config)

    async def evaluate(self, trajectory_text: str, task: Any) -> Score:
        entry = _task_get(task, "entry")
        if not isinstance(entry, Mapping):
            return Score(0.0, "task has no reasoning-gym 'entry'")
        masked = _mask_results(trajectory_text) if isinstance(trajectory_text, str) else ""
        found = answer_spans(masked)
        answer = trajectory_text[found[-1][0]:found[-1][1]].strip() if found else None
        name = self.dataset or (entry.get("metadata") or {}).get("source_dataset", "")
        if not name:
            return Score(0.0, "reasoning-gym entry names no source_dataset (and the verifier no dataset)")
        config = self.config if name == self.dataset else {}
        reward = await self.scorer.score(name, config, answer, dict(entry))
        oracle = str(entry.get("answer"))[:40]
        return Score(reward, f"{name}.score_answer({str(answer)[:40]!r}) = {reward:g} (oracle {oracle!r})")

    def close(self) -> None:
        """Stop the scorer's sandbox (its fork server)."""
        self.scorer.close()


# ------------------------------------------------------------------------------------------------------- unit tests
_FENCE_RE = re.compile(r"```[A-Za-z0-9_+-]*\n(.*?)```", re.DOTALL)
_MARK = "@@tsync-probes@@ "

# Written to the sandbox as run_tests.py after the probe runtime (envs/probes.py): runs each rewritten snippet in a
# fresh namespace (that imported the solution, for a .py solution) and prints the probe records on one last line.
_RUNNER_SRC = r'''
import json, subprocess, sys
sys.path.insert(0, ".")


def sh(cmd):
    return subprocess.run(["/bin/sh", "-c", cmd], capture_output=True, text=True, timeout=20).stdout


def read(path):
    with open(path) as f:
        return f.read()


tests = json.load(open("tests.json"))
for i, src in enumerate(tests["tests"]):
    current[0] = "t%d" % i
    ns = {"sh": sh, "read": read}
    try:
        if tests["import"]:
            exec("from solution import *\n", ns)
        exec(compile(src, "test_%d" % i, "exec"), ns)
    except BaseException as e:
        records.append(["t%d" % i, "error", "u", type(e).__name__])
sys.stdout.write("\n%s%s\n" % (MARK, json.dumps(records)))
'''


def plan_snippet(src: str, i: int) -> tuple[str, tuple]:
    """(child source, expected probes) of unit-test snippet `i`: its asserts become probes (``envs/probes.py``);
    ValueError unless every assert compares with a literal and at least one pins a value (``== literal``, not a
    bool / None): a bare ``assert f(x)`` or ``assert f(x) != 3`` is a guess, not a check."""
    from megatron_tsync.rollout.envs.probes import Expect, is_strong, rewrite_asserts

    child, sites = rewrite_asserts(src, f"t{i}")
    expects = tuple(Expect(site, op=op, literal=lit) for site, (op, lit) in sites.items())
    if any(op is None for op, _ in sites.values()):
        raise ValueError(f"test {i}: an assert that does not compare with a literal cannot be checked without "
                         "running the solution's code in the verifier")
    if not is_strong(expects):
        raise ValueError(f"test {i}: no 'assert EXPR == LITERAL' check (only guessable outcomes)")
    return child, expects


@register_verifier("unit_tests")
class UnitTests(_Base):
    """SWE-style reward: the fraction of unit-test snippets whose checks hold for the agent's solution.

    The solution is the last fenced code block of the final text (outside ``<result>``), written to
    ``solution_path``. Split verification (docs/threat_model.md): each snippet's ``assert EXPR op LITERAL`` runs in
    the sandbox as a probe that only reports ``EXPR``'s value (the literals are not in the sandbox); this process
    compares. Snippets may call ``sh(cmd)`` (stdout of ``/bin/sh -c cmd``) and ``read(path)``; a ``.py`` solution
    is imported (``from solution import *``). A timeout, crash or missing report scores 0.0 with the reason; a
    task with a ``test_command`` (PASS lines a solution can print) or a snippet without a value check is refused.
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
        from megatron_tsync.rollout.envs.probes import PROBE_RUNTIME, judge, parse_records

        tests = _task_get(task, "tests")
        if _task_get(task, "test_command"):
            return Score(0.0, "unverifiable task: 'test_command' (PASS lines the solution can print) is not "
                              "supported; give 'tests' snippets that assert values")
        if not tests:
            return Score(0.0, "task has no 'tests'")
        try:
            plans = [plan_snippet(src, i) for i, src in enumerate(tests)]
        except ValueError as e:
            return Score(0.0, f"unverifiable task: {e}")
        files = dict(_task_get(task, "files", None) or {})
        blocks = _FENCE_RE.findall(_mask_results(trajectory_text or ""))
        solution_path = _task_get(task, "solution_path", "solution.py")
        if blocks:
            files[solution_path] = blocks[-1]
        elif solution_path not in files:
            return Score(0.0, "malformed: no fenced code block with a solution")
        files["tests.json"] = json.dumps({"tests": [c for c, _ in plans], "import": solution_path == "solution.py"})
        files["run_tests.py"] = PROBE_RUNTIME + f"MARK = {_MARK!r}\n" + _RUNNER_SRC
        res = await self.sandbox.run_async([self.sandbox.python, "-I", "run_tests.py"], files=files)
        if res.error and (res.exit_code is None or res.exit_code < 0):
            return Score(0.0, f"test run failed: {res.error}")
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith(_MARK)]
        expected = {f"t{i}": exp for i, (_, exp) in enumerate(plans)}
        try:
            records = parse_records(lines[-1][len(_MARK):], expected) if lines else None
        except ValueError as e:
            return Score(0.0, f"unreadable test report: {e}")
        if records is None:
            return Score(0.0, f"no test report in the output ({res.error or f'exit {res.exit_code}'})")
        passed, _ = judge(records, expected)
        return self._clamp(Score(len(passed) / len(plans), f"{len(passed)}/{len(plans)} tests passed"))
