"""End-of-run summary for CI logs (loaded by ``tests/conftest.py``): total wall time, the 15 slowest tests (setup +
call + teardown), every failed test with its first error line — so that a red CI run says what failed in the
last screen of its log — and the modules that grew: the ten furthest over their recorded seconds in
``tests/module_seconds.json`` (recorded, this run, ratio) and the modules that file does not have yet (new, with their
seconds), so that growth shows in every CI log. Works under pytest-xdist: the reports it reads are the ones the
workers send back.

``TSYNC_DURATIONS_JSON=path`` also writes every test's seconds, CPU seconds and outcome there (what docs/testing.md's
and the notes' duration tables are made from). CPU seconds (:class:`CpuMeter`, in the process that runs the test):
user + system time of that process and of the child processes it waited for (a training run's subprocess, a torchrun and
its ranks) from the start of setup to the end of teardown; on two busy cores the wall seconds of a test depend on
its neighbour, its CPU seconds much less."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import pytest

_SLOWEST = 15
_GROWN = 10  # modules listed as over their recorded seconds, and new modules listed
RECORDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "module_seconds.json")


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CpuMeter:
    """Registered where tests run (the one process, or each xdist worker): puts ``cpu_s`` in the teardown report's
    ``user_properties``, which xdist sends back to the controller with the report."""

    def __init__(self):
        self.start: dict[str, float] = {}

    def pytest_runtest_logstart(self, nodeid, location):
        self.start[nodeid] = _cpu()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.when == "teardown" and item.nodeid in self.start:
            outcome.get_result().user_properties.append(("cpu_s", _cpu() - self.start.pop(item.nodeid)))


def module_growth(seconds: dict[str, float], recorded: dict[str, float], top: int = _GROWN):
    """(over, new) from this run's seconds per test and the recorded seconds per module: ``over`` is the ``top``
    modules furthest over their recorded seconds, by seconds over, as (module, recorded s, this run's s); ``new`` the
    modules with no record, as (module, this run's s), longest first. A module a run covered only partly (``-k``,
    ``-m "not slow"``) can only look shorter than its record, so it is never reported over because of that."""
    per_module: dict[str, float] = defaultdict(float)
    for nodeid, s in seconds.items():
        per_module[nodeid.split("::", 1)[0]] += s
    over = [(m, recorded[m], s) for m, s in per_module.items() if m in recorded and s > recorded[m]]
    over.sort(key=lambda r: (-(r[2] - r[1]), r[0]))
    new = sorted(((m, s) for m, s in per_module.items() if m not in recorded), key=lambda r: (-r[1], r[0]))
    return over[:top], new


def _load_recorded(path: str) -> dict[str, float]:
    try:
        with open(path) as f:
            return {k: float(v) for k, v in json.load(f).items()}
    except (OSError, ValueError, AttributeError):
        return {}


class SuiteReport:
    def __init__(self, recorded: str = RECORDED):
        self.recorded = recorded  # the per-module seconds this run is compared with
        self.t0 = time.time()
        self.seconds: dict[str, float] = defaultdict(float)
        self.failed: dict[str, str] = {}
        self.outcome: dict[str, str] = {}
        self.cpu: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------ hooks
    def pytest_runtest_logreport(self, report):
        nodeid = report.nodeid
        self.seconds[nodeid] += getattr(report, "duration", 0.0)
        cpu = dict(getattr(report, "user_properties", ()) or ()).get("cpu_s")
        if cpu is not None:
            self.cpu[nodeid] = cpu
        if report.failed:
            phase = "" if report.when == "call" else f" (in {report.when})"
            self.failed.setdefault(nodeid, _first_error_line(report) + phase)
            self.outcome[nodeid] = "failed"
        elif report.when == "call" or report.skipped:
            self.outcome.setdefault(nodeid, report.outcome)

    def pytest_collectreport(self, report):
        if report.failed:
            self.failed.setdefault(report.nodeid or "<collection>", _first_error_line(report) + " (collecting)")

    def pytest_terminal_summary(self, terminalreporter):
        total = time.time() - self.t0
        tr = terminalreporter
        tr.section("tsync suite summary")
        tr.write_line(f"total {total:.0f} s ({total / 60:.1f} min), {len(self.outcome)} tests, "
                      f"{sum(self.cpu.values()):.0f} CPU s in the tests and the processes they waited for")
        tr.write_line(f"{_SLOWEST} slowest (setup + call + teardown):")
        for nodeid, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])[:_SLOWEST]:
            tr.write_line(f"  {s:7.1f} s  {nodeid}")
        self._write_growth(tr)
        if self.failed:
            tr.write_line(f"FAILED ({len(self.failed)}):")
            for nodeid, line in self.failed.items():
                tr.write_line(f"  {nodeid}: {line}")
        else:
            tr.write_line("failed: none")
        path = os.environ.get("TSYNC_DURATIONS_JSON")
        if path:
            with open(path, "w") as f:
                json.dump({"total_s": total, "tests": {k: {"s": round(v, 3), "cpu_s": round(self.cpu.get(k, 0.0), 3),
                                                           "outcome": self.outcome.get(k, "?")}
                                                       for k, v in self.seconds.items()}}, f, indent=0)

    def _write_growth(self, tr) -> None:
        name = "tests/module_seconds.json" if self.recorded == RECORDED else self.recorded
        over, new = module_growth(self.seconds, _load_recorded(self.recorded))
        if not over:
            tr.write_line(f"modules over their recorded seconds ({name}): none")
        else:
            tr.write_line(f"modules furthest over their recorded seconds ({name}; the top {_GROWN}): "
                          "recorded s, this run s, ratio")
            for module, rec, s in over:
                ratio = f"{s / rec:6.1f}x" if rec > 0 else "    >>"
                tr.write_line(f"  {rec:8.2f}  {s:8.2f}  {ratio}  {module}")
        if new:
            tr.write_line(f"new modules (not in {name}; {len(new)}): this run s")
            for module, s in new[:_GROWN]:
                tr.write_line(f"  {s:8.2f}  {module}")
            if len(new) > _GROWN:
                tr.write_line(f"  ... and {len(new) - _GROWN} more")


def _first_error_line(report) -> str:
    """The exception line of a failure ('AssertionError: ...', 'Failed: Timeout >300.0s'), else the first line of
    its text."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None and getattr(crash, "message", ""):
        return crash.message.splitlines()[0][:300]
    text = str(getattr(report, "longrepr", "") or "")
    errs = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    return (errs[0] if errs else (text.strip().splitlines() or ["?"])[-1])[:300]

