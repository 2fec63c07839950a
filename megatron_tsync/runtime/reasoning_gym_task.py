"""Any reasoning-gym dataset as an RL task: ``--task reasoning-gym:NAME --verifier reasoning_gym``.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ (Apache-2.0, ``pip install
'megatron_tsync[reasoning-gym]'``) is a library of procedural generators; an entry is ``{"question", "answer",
"metadata"}`` and each dataset scores an answer with its own ``score_answer(answer, entry)`` (1.0 for the right
answer; a wrong one gets what the dataset says: 0, or partial credit, e.g. ``chain_sum`` gives ``len(oracle) /
len(answer)`` when the oracle is a substring of the answer). That is the reward here, unchanged: the verifier
``reasoning_gym`` (``rollout/verifiers.py``) hands it the text of the last ``<answer>…</answer>`` outside ``<result>``
blocks, in the sandbox (``rollout/reasoning_gym_scorer.py``: some datasets ``eval`` the answer). Rewards are bounded in
[0, 1], not binary; held-out success counts rewards of 1.

Name: ``reasoning-gym:NAME`` or ``reasoning-gym:NAME:key=value,key=value`` (the dataset's config fields, values
read as Python literals), e.g. ``reasoning-gym:chain_sum:min_terms=2,max_terms=3,max_digits=2``.

Prompt ``<s>Q: QUESTION `` (the dataset's question verbatim). The agent loop's tools are all there (``calculator``,
``python``, ``shell`` in the sandbox). Demonstrations (the supervised warm start): when the entry's
``metadata["expression"]`` is integer arithmetic that evaluates to the answer, a calculator call on it, its result,
then ``<answer>ANSWER</answer>``; otherwise the answer alone.

Splits: the dataset is built once with seed ``dataset_seed`` and ``size`` entries; group ``g`` of step ``k`` draws
indices in ``[0, size)`` from a generator seeded by ``mix(seed, split, k, g)`` until it finds an entry of its split
(the run's ``--seed`` picks the entries; the dataset stays the same), and an entry belongs to the eval split iff the CRC32 of its question is 0 mod ``heldout_mod``: a held-out question can never be a training
question (by content, whatever index or seed produced it).
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import random
import zlib
from typing import Any

from megatron_tsync.algorithms.streamability import RewardSpec
from megatron_tsync.runtime.tasks import TaskInstance, _mix, register_task_family

__all__ = ["ReasoningGymTask", "parse_task_name", "make_dataset"]

PREFIX = "reasoning-gym"
_SPLITS = {"train": 0, "eval": 1}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _import():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"reasoning-gym is not installed ({e}): "
                          "pip install 'megatron_tsync[reasoning-gym]'") from None
    return reasoning_gym


def parse_task_name(spec: str) -> tuple[str, dict]:
    """``"NAME"`` or ``"NAME:k=v,k=v"`` (the part after ``reasoning-gym:``) -> (dataset name, config)."""
    name, _, rest = spec.partition(":")
    if not name:
        raise ValueError(f"task {PREFIX}:{spec}: name a dataset, e.g. {PREFIX}:chain_sum")
    config = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ValueError(f"task {PREFIX}:{spec}: config item {item!r} is not key=value")
        try:
            config[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            config[key.strip()] = value.strip()  # a bare word: a string
    return name, config


_CACHE: dict[tuple, Any] = {}


def _dataset(name: str, config: dict, seed: int, size: int):
    rg = _import()
    if name not in rg.factory.DATASETS:
        raise ValueError(f"reasoning-gym has no dataset {name!r}; some: {', '.join(sorted(rg.factory.DATASETS)[:12])} "
                         f"… ({len(rg.factory.DATASETS)} in all)")
    try:
        return rg.create_dataset(name, seed=seed, size=size, **config)
    except (TypeError, ValueError, AssertionError) as e:
        raise ValueError(f"reasoning-gym dataset {name} with config {dict(config)}: {type(e).__name__}: {e}") from None


def make_dataset(name: str, config: dict | None = None, seed: int = 0, size: int = 100_000):
    """The reasoning-gym dataset ``name`` (cached per process: its ``score_answer`` and entries)."""
    key = (name, repr(sorted((config or {}).items())), seed, size)
    if key not in _CACHE:
        _CACHE[key] = _dataset(name, dict(config or {}), seed, size)
    return _CACHE[key]


def _int_value(expr: str) -> int | None:
    """The value of integer ``+ - *`` arithmetic with parentheses and signs (what the calculator computes), or None."""
    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(node)

    try:
        return ev(ast.parse(expr, mode="eval").body)
    except (ValueError, SyntaxError, RecursionError):
        return None


@dataclasses.dataclass(frozen=True)
class ReasoningGymTask:
    """One reasoning-gym dataset as a task (see the module docstring)."""

    dataset: str
    config: dict = dataclasses.field(default_factory=dict)
    verifier: str = "reasoning_gym"
    dataset_seed: int = 0
    size: int = 100_000
    heldout_mod: int = 8
    bos: str = "<s>"

    def __post_init__(self):
        if self.verifier != "reasoning_gym":
            raise ValueError(f"task {self.name}: the reward is the dataset's own score_answer: --verifier must be "
                             f"'reasoning_gym', got {self.verifier!r}")
        if self.heldout_mod < 2 or self.size < self.heldout_mod:
            raise ValueError(f"need heldout_mod >= 2 and size >= heldout_mod, got {self.heldout_mod}, {self.size}")
        self.generator  # noqa: B018 - the dataset exists and takes this config (errors at construction)

    @classmethod
    def from_name(cls, spec: str, **kwargs: Any) -> "ReasoningGymTask":
        """The task of ``reasoning-gym:SPEC`` (``SPEC`` = ``NAME[:k=v,...]``; ``get_task``'s family factory)."""
        name, config = parse_task_name(spec)
        return cls(name, config, **kwargs)

    @property
    def name(self) -> str:
        cfg = ",".join(f"{k}={v!r}" for k, v in sorted(self.config.items()))
        return f"{PREFIX}:{self.dataset}" + (f":{cfg}" if cfg else "")

    @property
    def verifier_kwargs(self) -> dict:
        return {"dataset": self.dataset, "config": dict(self.config)}

    @property
    def reward_spec(self) -> RewardSpec:
        return RewardSpec.bounded(0.0, 1.0)

    @property
    def generator(self):
        return make_dataset(self.dataset, self.config, self.dataset_seed, self.size)

    def split_of(self, entry: dict) -> str:
        return "eval" if zlib.crc32(entry["question"].encode()) % self.heldout_mod == 0 else "train"

    def instance(self, entry: dict, **meta: Any) -> TaskInstance:
        return TaskInstance(f"{self.bos}Q: {entry['question']} ", entry["answer"], {"entry": entry, **meta})

    def sample_prompts(self, step: int, num_groups: int, seed: int, *, split: str = "train") -> list[TaskInstance]:
        """Group ``g`` of step ``step``: the first entry of ``split`` among indices drawn from ``(seed, split,
        step, g)``."""
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
        ds, out = self.generator, []
        for g in range(num_groups):
            rng = random.Random(_mix(seed, _SPLITS[split], step, g))
            for _ in range(2_000):  # ~1/heldout_mod acceptance for eval
                index = rng.randrange(self.size)
                entry = ds[index]
                if self.split_of(entry) == split:
                    break
            else:
                raise RuntimeError(f"{self.name}: no {split} entry in 2000 draws (too few distinct questions?)")
            out.append(self.instance(entry, index=index, step=step, group=g, split=split))
        return out

    def demonstration_segments(self, inst: TaskInstance) -> list[tuple[str, bool]]:
        answer = str(inst.answer)
        expr = str(inst.meta["entry"].get("metadata", {}).get("expression", ""))
        value = _int_value(expr) if expr else None
        if value is not None and answer.lstrip("-").isdigit() and value == int(answer):
            return [(inst.prompt_text, False), (f"<tool>calculator: {expr}</tool>", True),
                    (f"<result>{value}</result>", False), (f"<answer>{answer}</answer>", True)]
        return [(inst.prompt_text, False), (f"<answer>{answer}</answer>", True)]

    def demonstration(self, inst: TaskInstance) -> str:
        return "".join(text for text, _ in self.demonstration_segments(inst))


register_task_family(PREFIX)(ReasoningGymTask.from_name)
