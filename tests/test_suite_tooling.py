"""The suite's own safety nets, run on a throw-away test file in a child pytest:
  * a hanging test fails by pytest-timeout with a stack dump naming where it hung (instead of eating CI's budget),
    and the run goes on to the next test;
  * the end-of-run summary (``tests/_suite_report.py``) lists the failed tests with their first error line and the
    slowest tests, and the CPU seconds of each test with the processes it waited for; and the modules furthest over
    their recorded seconds (``tests/module_seconds.json``) and the new ones, so that growth shows in every CI log;
  * the xdist work units (``tests/_scheduling.py``): a module each, the SLURM modules one, longest first.
"""

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD_TESTS = textwrap.dedent('''
    import threading

    def blocked_forever_on_an_event():
        threading.Event().wait()  # nobody sets it: a hang, not a sleep

    def test_hangs():
        blocked_forever_on_an_event()

    def test_fails():
        assert 1 + 1 == 3, "arithmetic is broken"

    def test_passes():
        pass

    def test_waits_for_a_busy_child():
        import subprocess, sys
        subprocess.run([sys.executable, "-c", "x = 0\\nfor i in range(4_000_000): x += i"], check=True)
''')

CHILD_CONFTEST = textwrap.dedent('''
    from tests._suite_report import CpuMeter, SuiteReport

    def pytest_configure(config):
        config.pluginmanager.register(SuiteReport(), "tsync_suite_report")
        config.pluginmanager.register(CpuMeter(), "tsync_cpu_meter")
''')


def test_hang_times_out_with_a_stack_dump_and_the_summary_names_the_failures(tmp_path):
    (tmp_path / "test_child.py").write_text(CHILD_TESTS)
    (tmp_path / "conftest.py").write_text(CHILD_CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TSYNC_DURATIONS_JSON=str(tmp_path / "durations.json"))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=2",
                        "test_child.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "Timeout" in out and "blocked_forever_on_an_event" in out, out  # the dump says where it hung
    assert "2 passed" in out and "2 failed" in out, out  # the run went on after the hang
    summary = out.split("tsync suite summary", 1)[1]
    assert "4 tests" in summary and "slowest" in summary and "CPU s" in summary, summary
    assert "test_child.py::test_hangs: Failed: Timeout" in summary, summary
    assert "test_child.py::test_fails: AssertionError: arithmetic is broken" in summary, summary
    assert "test_passes:" not in summary.split("FAILED", 1)[1], summary
    # CPU seconds count the child process the test waited for (a training run's subprocess, in the real suite)
    tests = json.loads((tmp_path / "durations.json").read_text())["tests"]
    busy, idle = tests["test_child.py::test_waits_for_a_busy_child"], tests["test_child.py::test_passes"]
    assert busy["cpu_s"] >= 0.1 > idle["cpu_s"] and busy["outcome"] == "passed", tests


GROWTH_CONFTEST = textwrap.dedent('''
    import os
    from tests._suite_report import SuiteReport

    def pytest_configure(config):
        config.pluginmanager.register(SuiteReport(recorded=os.path.join(os.path.dirname(__file__), "recorded.json")),
                                      "tsync_suite_report")
''')


def test_summary_lists_the_modules_over_their_recorded_seconds_and_the_new_ones(tmp_path):
    busy = "def test_busy():\n    x = 0\n    for i in range(300_000):\n        x += i\n"
    for name in ("test_grown.py", "test_steady.py", "test_new.py"):
        (tmp_path / name).write_text(busy)
    (tmp_path / "conftest.py").write_text(GROWTH_CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    # test_grown's record is far under what any run takes, test_steady's far over; test_new has none; test_gone's
    # module did not run
    (tmp_path / "recorded.json").write_text(json.dumps({"test_grown.py": 0.0001, "test_steady.py": 500.0,
                                                        "test_gone.py": 9.0}))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TSYNC_DURATIONS_JSON", None)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "."],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    summary = out.split("tsync suite summary", 1)[1]
    over = summary.split("furthest over their recorded seconds", 1)[1].split("new modules", 1)[0]
    rows = [ln.split() for ln in over.splitlines()[1:] if ln.strip()]
    assert [r[-1] for r in rows] == ["test_grown.py"], summary  # not the steady module, nor the one that did not run
    recorded, seconds, ratio = float(rows[0][0]), float(rows[0][1]), rows[0][2]
    assert recorded == 0.0 and seconds > 0 and ratio.endswith("x"), summary
    new = summary.split("new modules", 1)[1].split("failed: none", 1)[0]
    assert [ln.split()[-1] for ln in new.splitlines()[1:] if ln.strip()] == ["test_new.py"], summary


def test_module_growth_ranks_by_seconds_over_and_keeps_ten():
    from tests._suite_report import module_growth

    recorded = {f"tests/m{i}.py": 10.0 for i in range(12)} | {"tests/small.py": 0.5, "tests/fast.py": 30.0}
    seconds = {f"tests/m{i}.py::t": 10.0 + i for i in range(12)}  # m0 on its record, m1..m11 over by 1..11 s
    seconds |= {"tests/small.py::a": 2.0, "tests/small.py::b": 2.0,  # 8x its record, but only 3.5 s over
                "tests/fast.py::t": 29.0, "tests/new.py::t": 3.0, "tests/newer.py::t": 7.0}
    over, new = module_growth(seconds, recorded)
    assert [m for m, _, _ in over] == [f"tests/m{i}.py" for i in (11, 10, 9, 8, 7, 6, 5, 4)] + [
        "tests/small.py", "tests/m3.py"]
    assert over[-2] == ("tests/small.py", 0.5, 4.0)
    assert new == [("tests/newer.py", 7.0), ("tests/new.py", 3.0)]


def test_work_units_keep_slurm_modules_together_and_start_longest_first(monkeypatch):
    from tests import _scheduling

    assert _scheduling.unit_of("tests/slurm/test_sbatch.py::test_x[a]") == "tests/slurm"
    assert _scheduling.unit_of("tests/slurm/test_two_nodes.py::test_y") == "tests/slurm"
    assert _scheduling.unit_of("tests/runtime/test_stop.py::test_z") == "tests/runtime/test_stop.py"

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    monkeypatch.setattr(_scheduling, "_costs", lambda: {"tests/a.py": 5.0, "tests/slurm/s1.py": 3.0,
                                                        "tests/slurm/s2.py": 4.0, "tests/b.py": 6.0})
    items = [Item(n) for n in ("tests/a.py::t1", "tests/c.py::t", "tests/slurm/s1.py::t", "tests/b.py::t",
                               "tests/a.py::t2", "tests/slurm/s2.py::t")]
    _scheduling.order_longest_first(items)
    # slurm (3 + 4 s) first, then b (6), a (5), unknown c last; the order inside a unit is kept
    assert [i.nodeid for i in items] == ["tests/slurm/s1.py::t", "tests/slurm/s2.py::t", "tests/b.py::t",
                                         "tests/a.py::t1", "tests/a.py::t2", "tests/c.py::t"]
