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


def order_longest_first(items) -> None:
    """Orders the modules longest first; the order inside a module is kept. Deterministic, so every worker collects
    the same list (xdist requires it)."""
    costs = _costs()
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(unit_of(item.nodeid), i)
    items.sort(key=lambda it: (-costs.get(unit_of(it.nodeid), 0.0), first_seen[unit_of(it.nodeid)]))
