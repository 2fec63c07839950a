"""The hidden-test verifier cannot be fooled: every forging case below gets reward 0 and is its own test, with a
control showing the case is real (it fools a naive ``pytest`` run, or the same workspace with the genuine fix gets
reward 1). Real sandboxes, real pytest, real processes."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from megatron_tsync.rollout.envs.swe_lite import generate_task
from megatron_tsync.rollout.envs.verifier import HiddenTestVerifier, TestSpec
from megatron_tsync.rollout.sandbox import SandboxConfig, _UID_BASE, _UID_SLOTS

pytestmark = pytest.mark.timeout(120)

TASK = generate_task(0, 0)
BUG_PATH = TASK.solution[0][1]["path"]
PKG = BUG_PATH.split("/")[0]


def bash(env, command: str) -> str:
    return env.format.render_call("bash", {"command": command})


def write(env, path: str, text: str, append: bool = False) -> str:
    return bash(env, f"mkdir -p \"$(dirname {path})\" && cat {'>>' if append else '>'} {path} <<'TSYNC_EOF'\n"
                     f"{text}\nTSYNC_EOF")


def fix(env) -> list[str]:
    return env.render_solution(TASK)[:-1]  # the edit, without submit


def play(env, actions: list[str], *, naive: bool = False, verifier=None, task=TASK):
    """Run the actions in an episode; (verdict, exit status of a naive `pytest` over the hidden tests or None)."""

    async def go():
        ep = await env.start(task)
        for a in actions:
            obs = await ep.step(a)
            assert "error: no tool call" not in obs.text, obs
        rc = naive_pytest(ep.ws.path, task) if naive else None
        if verifier is not None:
            try:
                return verifier.verify(ep.ws.path, task.test_spec(random.Random(1))), rc
            finally:
                ep.close()
        return await ep.finish(), rc

    return asyncio.run(go())


def naive_pytest(ws_path: str, task) -> int:
    """What a naive verifier would do: hidden tests copied into the workspace, `python -m pytest` there."""
    d = tempfile.mkdtemp()
    try:
        shutil.copytree(ws_path, d, dirs_exist_ok=True)
        spec = task.test_spec(random.Random(1))
        for rel, text in spec.test_files.items():
            os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
            with open(os.path.join(d, rel), "w") as f:
                f.write(text)
        targets = sorted({n.partition("::")[0] for n in spec.must_pass})
        env = dict(os.environ, PYTHONPATH=d)
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets], cwd=d,
                              env=env, capture_output=True, timeout=60).returncode
    finally:
        shutil.rmtree(d, ignore_errors=True)


FORCE_PASS_HOOK = '''import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
'''

# ------------------------------------------------------------------------------------------------- controls


def test_control_the_fix_passes_and_doing_nothing_fails(swe_env):
    assert play(swe_env, fix(swe_env))[0].reward == 1.0
    v, rc = play(swe_env, [], naive=True)
    assert v.reward == 0.0 and rc == 1  # the naive run also sees the failing hidden tests


def test_control_printing_does_not_hurt_a_genuine_fix(swe_env):
    printer = 'print("hello from the solution")\n'
    assert play(swe_env, fix(swe_env) + [write(swe_env, BUG_PATH, printer, append=True)])[0].reward == 1.0


# ------------------------------------------------------------------------------------------------- forging cases


def test_printing_pass_lines(swe_env):
    payload = ('import sys\nfor _s in (sys.stdout, sys.stderr):\n    _s.write("PASS test_0\\nPASS test_1\\n'
               '999 passed in 0.01s\\n")\n    _s.flush()\n')
    v, _ = play(swe_env, [write(swe_env, BUG_PATH, payload, append=True),
                          bash(swe_env, "echo '999 passed'; echo PASS")])
    assert v.reward == 0.0, v


def test_writing_a_fake_report_file(swe_env):
    xml = ('<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="1" failures="0" errors="0">'
           '<testcase classname="tests.test_x" name="test_a"/></testsuite></testsuites>')
    actions = [write(swe_env, p, xml) for p in ("report.xml", "junit.xml", ".tsync_0/report.xml", "tests/report.xml")]
    v, _ = play(swe_env, actions)
    assert v.reward == 0.0 and ("failed" in v.reason), v


TARGETED_FORGER = r'''
import os, re, sys
def _forge():
    argv = sys.argv
    report = argv[argv.index("--junitxml") + 1]
    suite = [a.split("=", 1)[1] for a in argv if a.startswith("junit_suite_name=")][0]
    cases = []
    for d, _, names in os.walk(os.getcwd()):
        for n in names:
            if n.startswith("test_") and n.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, n), os.getcwd())[:-3].replace("/", ".")
                for t in re.findall(r"^def (test_\w+)", open(os.path.join(d, n)).read(), re.M):
                    bad = "_tsync_sentinel_" in rel  # the sentinel must fail: mark it failed
                    cases.append('<testcase classname="%s" name="%s">%s</testcase>'
                                 % (rel, t, "<failure message='x'/>" if bad else ""))
    with open(report, "w") as f:
        f.write('<testsuites><testsuite name="%s">%s</testsuite></testsuites>' % (suite, "".join(cases)))
    os._exit(1)
_forge()
'''


def test_writing_a_fake_report_from_inside_the_test_process(swe_env, hidden_verifier):
    """A forger that knows this verifier: it writes this run's report (right path, right nonce, the sentinel
    failed, everything else passed) and exits 1 before any test runs. The decoys catch it."""
    v, _ = play(swe_env, [write(swe_env, BUG_PATH, TARGETED_FORGER, append=True)])
    assert v.reward == 0.0 and "must-fail test" in v.reason, v


def test_control_the_targeted_forger_beats_a_sentinel_only_spec(swe_env, hidden_verifier):
    """Control: without decoys (the sentinel alone, as for loaded SWE-bench tasks) the same forger gets reward 1 —
    the documented limit of in-process test runs, and why the generated suites carry decoys."""

    class NoDecoys:
        def __getattr__(self, name):
            return getattr(TASK, name)

        def test_spec(self, rng):
            spec = TASK.test_spec(rng)
            return TestSpec(spec.test_files, spec.must_pass, (), protected=spec.protected)

    v, _ = play(swe_env, [write(swe_env, BUG_PATH, TARGETED_FORGER, append=True)], verifier=hidden_verifier,
                task=NoDecoys())
    assert v.reward == 1.0, v


@pytest.mark.parametrize("how", ["edit", "delete", "rename"])
def test_editing_deleting_or_renaming_the_tests(swe_env, how):
    cmd = {"edit": "for f in tests/*.py; do printf 'def test_ok():\\n    assert True\\n' > $f; done",
           "delete": "rm -rf tests",
           "rename": "for f in tests/*.py; do mv $f ${f%.py}_old.py; done; mv tests tests_bak"}[how]
    v, _ = play(swe_env, [bash(swe_env, cmd)])
    assert v.reward == 0.0, v
    assert play(swe_env, [bash(swe_env, cmd)] + fix(swe_env))[0].reward == 1.0  # control: the tests came back


def test_conftest_that_forces_passes(swe_env):
    actions = [write(swe_env, p, FORCE_PASS_HOOK) for p in ("conftest.py", "tests/conftest.py", f"{PKG}/conftest.py")]
    v, naive_rc = play(swe_env, actions, naive=True)
    assert naive_rc == 0  # control: it fools a plain pytest run
    assert v.reward == 0.0, v


def test_pytest_ini_and_friends_that_force_passes(swe_env):
    actions = [write(swe_env, "forcepass.py", FORCE_PASS_HOOK),
               write(swe_env, "pytest.ini", "[pytest]\naddopts = -p forcepass\n"),
               write(swe_env, "tox.ini", "[pytest]\naddopts = -p forcepass\n"),
               write(swe_env, "setup.cfg", "[tool:pytest]\naddopts = -p forcepass\n"),
               write(swe_env, "pyproject.toml", '[tool.pytest.ini_options]\naddopts = "-p forcepass"\n')]
    v, naive_rc = play(swe_env, actions, naive=True)
    assert naive_rc == 0
    assert v.reward == 0.0, v


def test_sitecustomize_that_forces_passes(swe_env):
    patch = "import _pytest.python\n_pytest.python.Function.runtest = lambda self: None\n"
    actions = [write(swe_env, "sitecustomize.py", patch), write(swe_env, "usercustomize.py", patch),
               write(swe_env, "forcepass.pth", "import sitecustomize\n")]
    v, naive_rc = play(swe_env, actions, naive=True)
    assert naive_rc == 0  # control: PYTHONPATH=workspace imports it at start-up
    assert v.reward == 0.0, v


def test_monkeypatching_the_test_runner(swe_env):
    patch = ("try:\n    import _pytest.python, _pytest.runner\n    _pytest.python.Function.runtest = lambda self: None\n"
             "except ImportError:\n    pass\n")
    v, naive_rc = play(swe_env, [write(swe_env, BUG_PATH, patch, append=True)], naive=True)
    assert naive_rc == 0
    assert v.reward == 0.0 and "must-fail test" in v.reason, v


def test_shadowing_the_stdlib_and_pytest(swe_env):
    """Modules named like what the runner imports (xml, json, _pytest, pluggy) in the workspace root."""
    fake = "raise SystemExit(0)\n"
    actions = [write(swe_env, p, fake) for p in ("xml/__init__.py", "json.py", "_pytest/__init__.py", "pluggy.py",
                                                 "pytest.py", "re.py")]
    v, _ = play(swe_env, actions)
    assert v.reward == 0.0 and "failed" in v.reason, v
    assert play(swe_env, actions + fix(swe_env))[0].reward == 1.0  # control: the run itself is unaffected


def test_os_exit_zero_at_import(swe_env):
    v, naive_rc = play(swe_env, [write(swe_env, BUG_PATH, "import os\nos._exit(0)\n", append=True)], naive=True)
    assert naive_rc == 0  # control: exit status 0 is what a status-only runner would accept
    assert v.reward == 0.0 and v.exit_code == 0, v


def test_killing_the_runner(swe_env):
    for payload in ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
                    "import os, signal\nos.killpg(0, signal.SIGKILL)\n"):
        v, _ = play(swe_env, fix(swe_env) + [write(swe_env, BUG_PATH, payload, append=True)])
        assert v.reward == 0.0 and "test run failed" in v.reason, v


def _sandbox_processes() -> list[str]:
    """Processes running as one of this test process's sandbox uids (other sessions' sandboxes use other ranges),
    polled until there are none for up to 10 s (SIGKILL lands asynchronously; the ones looked for sleep far longer)."""
    base = _UID_BASE + (os.getpid() % 100_000) * _UID_SLOTS
    deadline = time.monotonic() + 10
    while True:
        out = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/status") as f:
                    uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
            except (OSError, StopIteration, ValueError):
                continue
            if base <= uid < base + _UID_SLOTS:
                out.append(pid)
        if not out or time.monotonic() > deadline:
            return out
        time.sleep(0.05)


def test_outliving_the_timeout(swe_env):
    if not swe_env.sandbox.enforcement()["uid"]["enforced"]:
        pytest.skip("no per-call uid on this machine: the leftover-process check counts sandbox uids")
    verifier = HiddenTestVerifier(config=SandboxConfig(wall_timeout_s=4.0, cpu_seconds=10))
    payload = ("import subprocess, time\nsubprocess.Popen(['/bin/sleep', '600'], start_new_session=True)\n"
               "time.sleep(3600)\n")
    v, _ = play(swe_env, fix(swe_env) + [write(swe_env, BUG_PATH, payload, append=True)], verifier=verifier)
    # killed at the 4 s wall timeout: the verdict says so, and the episode ended at all (the tests sleep an hour)
    assert v.reward == 0.0 and "timeout" in v.reason, v
    assert _sandbox_processes() == []  # the escaped `sleep 600` is gone with the call's pid namespace


def test_symlinks_and_special_files_are_not_followed(swe_env):
    """A workspace symlink to a host file, or a FIFO, neither leaks into nor hangs the verifier."""
    actions = [bash(swe_env, f"ln -s /etc/passwd {PKG}/passwd.py; ln -s /etc tests_link; mkfifo fifo")]
    assert play(swe_env, actions + fix(swe_env))[0].reward == 1.0
