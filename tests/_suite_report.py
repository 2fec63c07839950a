"""End-of-run summary for CI logs (loaded by ``tests/conftest.py``): total wall time, the 15 slowest tests (setup +
call + teardown), and every failed test with its first error line — so that a red CI run says what failed in the
last screen of its log. Works under pytest-xdist: the reports it reads are the ones the workers send back.

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


class SuiteReport:
    def __init__(self):
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


def _first_error_line(report) -> str:
    """The exception line of a failure ('AssertionError: ...', 'Failed: Timeout >300.0s'), else the first line of
    its text."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None and getattr(crash, "message", ""):
        return crash.message.splitlines()[0][:300]
    text = str(getattr(report, "longrepr", "") or "")
    errs = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    return (errs[0] if errs else (text.strip().splitlines() or ["?"])[-1])[:300]

