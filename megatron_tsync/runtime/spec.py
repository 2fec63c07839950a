"""What an algorithm gives the one training loop (``runtime/loop.py``): a :class:`TrainSpec` — its name and how to
build it once the run context exists — and the :class:`Algorithm` it builds (one step, its log row, its summary)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

from megatron_tsync.streaming.ready_queue import Sample


@dataclasses.dataclass
class StepOutcome:
    """What one step of an algorithm hands back to the loop."""

    result: Any  # the learner's StepResult / OPDStepResult
    samples: list[Sample]  # the step's trajectories in arrival order (for --dump-rollouts and the log row)
    group_order: list[str]  # group ids in batch order (the dump's group order)
    extra: dict = dataclasses.field(default_factory=dict)


class Algorithm(Protocol):
    """Built by ``TrainSpec.build(ctx)`` once the run context (``runtime.context.RunContext``) exists; ``fleet`` is
    the rollout plane (``runtime.fleet.RolloutFleet``) on trainer rank 0 of a live run, else None."""

    tb_names: dict[str, str]  # row key -> TensorBoard tag

    def step(self, k: int, fleet) -> StepOutcome: ...

    def row(self, k: int, out: StepOutcome, fleet) -> dict: ...

    def line(self, row: dict, done: int, total: int, eta_s: float) -> str: ...

    def summary(self, history: list[dict]) -> str: ...


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """An algorithm as the loop sees it (in the spirit of torchtitan's ``TrainSpec``)."""

    name: str
    build: Callable[[Any], Algorithm]  # RunContext -> Algorithm
