"""Agentic coding tasks read from a JSONL file, for the GPU recipes (``examples/qwen_swe``, ``examples/qwen_terminal``).

Select with ``--task examples.jsonl_tasks:swe-jsonl`` (or ``terminal-jsonl``) from the repository root: the trainer and
every rollout worker import this module by that name (``runtime.tasks.get_task``). The file is named by the
environment variable ``TSYNC_TASK_FILE`` (exported to the rollout workers by ``sbatch --export=ALL``).

One JSON object per line::

    {"id": "fizzbuzz-1",                         # unique; decides the split (crc32(id) % heldout_mod == 0: eval)
     "prompt": "Write fizzbuzz(n) ...",          # the problem statement (wrapped in the chat template below)
     "files": {"util.py": "..."},                # optional files in the verification sandbox
     "tests": ["assert fizzbuzz(3) == 'Fizz'"],  # snippets: each needs an `assert EXPR == LITERAL`; swe-jsonl
                                                 # imports solution.py, terminal-jsonl calls sh('sh solution.sh')
     "solution_path": "solution.py",             # optional (default solution.py / solution.sh)
     "solution": "def fizzbuzz(n): ..."}         # optional reference solution (supervised warm start)

Reward: the ``unit_tests`` verifier (``rollout/verifiers.py``): the fraction of tests passing when the *last fenced
code block* of the agent's final text (outside ``<result>`` blocks) is written to ``solution_path``, judged by split
verification (the sandbox reports values, the literals stay outside: docs/threat_model.md; a ``test_command``
printing PASS lines is refused at load time, as is a snippet without an ``== literal`` check); bounded in
[0, 1], so the learner uses the bounded-reward clip rule. Tools during the episode: ``<tool>python: CODE</tool>``
and ``<tool>shell: CMD</tool>`` (``rollout/tools.py``; a fresh sandbox per call, without the task's files — the
agent sees the problem statement, not a repository checkout: a real SWE environment needs a tool that mounts it).

Prompts use the Qwen2.5 chat template (``<|im_start|>`` ...); the agent-loop markers ``<tool>``, ``</tool>``,
``<answer>``, ``</answer>`` must be single tokens of the tokenizer (``examples/qwen_swe/add_agent_tokens.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import zlib
from typing import Any

from megatron_tsync.algorithms.streamability import RewardSpec
from megatron_tsync.rollout.verifiers import plan_snippet
from megatron_tsync.runtime.tasks import TaskInstance, read_jsonl, register_task

SYSTEM = {
    "swe": ("You are a software engineer. Solve the task in Python. You may run code with <tool>python: CODE</tool>; "
            "its output comes back in <result>...</result>. When done, reply with <answer> followed by the complete "
            "solution module in one ```python fenced block, then </answer>."),
    "terminal": ("You are working in a Unix shell. You may run commands with <tool>shell: COMMAND</tool>; the output "
                 "comes back in <result>...</result>. When done, reply with <answer> followed by the final script in "
                 "one ```sh fenced block, then </answer>."),
}
TEMPLATE = "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def _mix(*parts: int) -> int:
    return zlib.crc32(json.dumps(parts).encode())


@dataclasses.dataclass(frozen=True)
class JsonlTask:
    """Problems of a JSONL file; ``kind`` "swe" (solution.py) or "terminal" (solution.sh)."""

    path: str | None = None  # None: $TSYNC_TASK_FILE
    kind: str = "swe"
    verifier: str = "unit_tests"
    verifier_kwargs: dict = dataclasses.field(default_factory=dict)
    heldout_mod: int = 10
    name: str = "swe-jsonl"

    def __post_init__(self):
        if self.kind not in SYSTEM:
            raise ValueError(f"kind must be one of {sorted(SYSTEM)}, got {self.kind!r}")
        if self.verifier != "unit_tests":
            raise ValueError(f"{self.name}: rewards come from the unit_tests verifier, got --verifier "
                             f"{self.verifier!r}")

    @property
    def reward_spec(self) -> RewardSpec:
        return RewardSpec.bounded(0.0, 1.0)  # fraction of tests passed

    # ------------------------------------------------------------------ data
    def records(self, split: str) -> list[dict]:
        path = self.path or os.environ.get("TSYNC_TASK_FILE")
        if not path:
            raise ValueError(f"{self.name}: set TSYNC_TASK_FILE to the JSONL file of problems")
        out = []
        for n, rec in read_jsonl(path):  # errors name path:line
            if "id" not in rec or "prompt" not in rec or not rec.get("tests"):
                raise ValueError(f"{path}:{n}: a problem needs 'id', 'prompt' and 'tests'")
            if rec.get("test_command"):
                raise ValueError(f"{path}:{n}: 'test_command' is not supported (a solution can print its PASS "
                                 "lines); write 'tests' snippets that assert values (docs/threat_model.md)")
            try:
                for i, src in enumerate(rec["tests"]):
                    plan_snippet(src, i)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
            in_eval = zlib.crc32(str(rec["id"]).encode()) % self.heldout_mod == 0
            if in_eval == (split == "eval"):
                out.append(rec)
        if not out:
            raise ValueError(f"{path}: no problems in the {split!r} split")
        return out

    def instance(self, rec: dict, **meta: Any) -> TaskInstance:
        default_path = "solution.py" if self.kind == "swe" else "solution.sh"
        verifier_meta = {"tests": rec.get("tests"),
                         "files": rec.get("files") or {}, "solution_path": rec.get("solution_path", default_path)}
        prompt = TEMPLATE.format(system=SYSTEM[self.kind], prompt=rec["prompt"])
        return TaskInstance(prompt, rec.get("solution"), {"id": rec["id"], **verifier_meta, **meta})

    def sample_prompts(self, step: int, num_groups: int, seed: int, *, split: str = "train") -> list[TaskInstance]:
        """Group ``g`` of step ``step``: a problem drawn with a generator seeded by ``(seed, split, step, g)``."""
        recs = self.records(split)
        out = []
        for g in range(num_groups):
            rng = random.Random(_mix(seed, split, step, g))
            out.append(self.instance(rng.choice(recs), step=step, group=g, split=split))
        return out

    # ------------------------------------------------------------------ demonstrations
    def demonstration_segments(self, inst: TaskInstance) -> list[tuple[str, bool]]:
        if inst.answer is None:
            raise ValueError(f"problem {inst.meta['id']!r} has no reference 'solution' (needed for the warm start)")
        lang = "python" if self.kind == "swe" else "sh"
        return [(inst.prompt_text, False), (f"<answer>\n```{lang}\n{inst.answer}\n```\n</answer>", True)]

    def demonstration(self, inst: TaskInstance) -> str:
        return "".join(text for text, _ in self.demonstration_segments(inst))


@register_task("swe-jsonl")
def swe_jsonl(**kwargs) -> JsonlTask:
    return JsonlTask(kind="swe", name="swe-jsonl", **kwargs)


@register_task("terminal-jsonl")
def terminal_jsonl(**kwargs) -> JsonlTask:
    return JsonlTask(kind="terminal", name="terminal-jsonl", **kwargs)
