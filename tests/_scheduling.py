"""How the suite is split over pytest-xdist workers (``tools/test.sh``: ``-n 3 --dist loadfile
--no-loadscope-reorder`` on two cores). Applied only inside xdist workers; a plain ``pytest`` run is untouched.

* One test module = one work unit, so a module-scoped fixture (one torchrun serving all of a module's checks, a
  trained model shared by its tests) runs once, on one worker. The work units are this file's, not xdist's
  (``pytest_xdist_make_scheduler`` in ``tests/conftest.py`` returns :func:`make_scheduler`).
* The SLURM modules (``tests/slurm/``) are one unit: they share one munged, and a module's teardown takes its cluster
  down, so they run one after the other on one worker (their cluster fixtures also hold a machine-wide lock,
  ``tests/slurm/test_sbatch.py::slurm_lock``, for runs that split them some other way).
* Why three workers on two cores: the SLURM unit is the longest (it starts first) and mostly waits on SLURM's timers
  and its jobs' idle pace, so one worker holds it while the other two keep both cores busy; when it ends, its worker
  takes units like the others.
* Units start longest first (LPT), by ``tests/module_seconds.json`` (seconds per module from a measured whole run;
  refresh it with ``python tools/test_durations.py --write``): the long end-to-end modules run beside the many
  short ones instead of after them. A module missing from the file counts as short.
"""

from __future__ import annotations

import json
import os

COSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "module_seconds.json")


SERIAL_DIRS = ("tests/slurm/",)  # every module under one of these is one unit


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its module's path, or the directory for the modules that must not overlap."""
    module = nodeid.split("::", 1)[0]
    return next((d.rstrip("/") for d in SERIAL_DIRS if module.startswith(d)), module)


def make_scheduler(config, log):
    """xdist's load-scope scheduler with this file's work units (the controller splits the collection with it)."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return UnitScheduling(config, log)


def _costs() -> dict[str, float]:
    try:
        with open(COSTS) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def order_longest_first(items) -> None:
    """Orders the modules longest first; the order inside a module is kept. Deterministic, so every worker collects
    the same list (xdist requires it)."""
    costs: dict[str, float] = {}
    for module, s in _costs().items():
        costs[unit_of(module)] = costs.get(unit_of(module), 0.0) + s
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(unit_of(item.nodeid), i)
    items.sort(key=lambda it: (-costs.get(unit_of(it.nodeid), 0.0), first_seen[unit_of(it.nodeid)]))
