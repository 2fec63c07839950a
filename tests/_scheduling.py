"""How the suite is split over pytest-xdist workers (``tools/test.sh``: ``-n 2 --dist loadfile
--no-loadscope-reorder``). Applied only inside xdist workers; a plain ``pytest`` run is untouched.

* One test module = one work unit (``loadfile``), so a module-scoped fixture (one torchrun serving all of a
  module's checks, a trained model shared by its tests) runs once, on one worker.
* The SLURM modules share one cluster and one munged: their cluster fixtures hold a machine-wide lock
  (``tests/slurm/test_sbatch.py::slurm_lock``), so two of them never overlap.
* Units start longest first (LPT), by ``tests/module_seconds.json`` (seconds per module, measured on a serial run;
  refresh it with ``python tools/test_durations.py --write``): the long end-to-end modules run beside the many
  short ones instead of after them. A module missing from the file counts as short.
"""

from __future__ import annotations

import json
import os

COSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "module_seconds.json")


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its module's path."""
    return nodeid.split("::", 1)[0]


def _costs() -> dict[str, float]:
    try:
        with open(COSTS) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def group_and_order(items) -> None:
    """Orders the units longest first; the order inside a unit is kept. Deterministic, so every worker collects the
    same list (xdist requires it)."""
    costs = _costs()
    unit_cost: dict[str, float] = {}
    for item in items:
        unit = unit_of(item.nodeid)
        unit_cost[unit] = unit_cost.get(unit, 0.0) + 0.0
    for path, s in costs.items():
        unit = unit_of(path)
        if unit in unit_cost:
            unit_cost[unit] += s
    first_seen = {}
    for i, item in enumerate(items):
        first_seen.setdefault(unit_of(item.nodeid), i)
    items.sort(key=lambda it: (-unit_cost[unit_of(it.nodeid)], first_seen[unit_of(it.nodeid)]))
