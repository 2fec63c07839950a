"""Group and trajectory ids of the rollout → learner wire: the one place their format is written and read.

Group ``g`` of step ``k`` is ``s{k}g{g}`` (``g`` = 0 … groups_per_step − 1, the order of the task's prompts for the
step); trajectory ``i`` of a group is ``{group_id}t{i}`` (``i`` = 0 … group_size − 1). Workers stamp these ids on
their events, the learner lists the ids a step expects from them, rollout dumps (docs/formats.md) store them.
"""

from __future__ import annotations

import re

__all__ = ["group_id", "group_ids", "traj_id", "traj_ids", "parse_traj_id"]

_TRAJ = re.compile(r"s(\d+)g(\d+)t(\d+)")


def group_id(step: int, group: int) -> str:
    """The id of group ``group`` of step ``step``: ``s{step}g{group}``."""
    return f"s{step}g{group}"


def group_ids(step: int, num_groups: int) -> list[str]:
    """The ids of a step's groups, in batch order."""
    return [group_id(step, g) for g in range(num_groups)]


def traj_id(group: str, index: int) -> str:
    """The id of trajectory ``index`` of the group with id ``group``: ``{group}t{index}``."""
    return f"{group}t{index}"


def traj_ids(step: int, num_groups: int, group_size: int) -> list[str]:
    """Every trajectory id a step expects, group-major."""
    return [traj_id(gid, i) for gid in group_ids(step, num_groups) for i in range(group_size)]


def parse_traj_id(tid: str) -> tuple[int, int, int] | None:
    """``(step, group, index)`` of a trajectory id, or None when ``tid`` is not of this format."""
    m = _TRAJ.fullmatch(tid)
    return None if m is None else (int(m[1]), int(m[2]), int(m[3]))
