"""Verifier attacks: each is a solution that does NOT solve its task but tries to score 1; every one must get the
honest-wrong reward 0, on generated (swe-lite, terminal-lite) and loaded (SWE-bench, Terminal-Bench style) tasks,
while the known fix scores 1. Controls show the attacks are real: they fool a naive ``pytest`` run of the hidden
tests, or the same channel with the right values injected scores 1. Real sandboxes, real pytest, real processes.
The table of attacks and verdicts is in docs/threat_model.md."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from megatron_tsync.rollout.envs.loaders import load_swebench_jsonl, load_terminal_bench_dir
from megatron_tsync.rollout.envs.probe_values import encode
from megatron_tsync.rollout.envs.probes import PROBE
from megatron_tsync.rollout.envs.swe_lite import generate_task
from megatron_tsync.rollout.envs.terminal_lite import generate_task as generate_terminal_task
from megatron_tsync.rollout.envs.verifier import HiddenTestVerifier, TestSpec
from megatron_tsync.rollout.envs.workspace_env import WorkspaceEnv
from megatron_tsync.rollout.sandbox import SandboxConfig, _UID_BASE, _UID_SLOTS
from tests.rollout.envs.suite_helpers import make_swebench_jsonl, make_terminal_bench_dir

pytestmark = pytest.mark.timeout(300)


class Case:
    """One task of one kind: its env, the file its hidden tests run (Python module or shell script), the fix."""

    def __init__(self, env, task, host: str, python: bool):
        self.env, self.task, self.host, self.python = env, task, host, python

    def bash(self, command: str) -> str:
        return self.env.format.render_call("bash", {"command": command})

    def write(self, path: str, text: str, append: bool = False) -> str:
        return self.bash(f"mkdir -p \"$(dirname {path})\" && cat {'>>' if append else '>'} {path} <<'TSYNC_EOF'\n"
                         f"{text}\nTSYNC_EOF")

    def fix(self) -> list[str]:
        return self.env.render_solution(self.task)[:-1]  # without submit

    def play(self, actions: list[str], naive: bool = False, verifier=None):
        """(verdict, exit status of a naive pytest run of the original hidden tests, or None)."""

        async def go():
            ep = await self.env.start(self.task)
            for a in actions:
                obs = await ep.step(a)
                assert "error: no tool call" not in obs.text, obs
            rc = naive_pytest(ep.ws.path, self.task) if naive else None
            if verifier is not None:
                try:
                    return verifier.verify(ep.ws.path, self.env.test_spec(self.task)), rc
                finally:
                    ep.close()
            return await ep.finish(), rc

        return asyncio.run(go())


def original_tests(task) -> dict[str, str]:
    """The hidden tests as a naive verifier would run them: expected values inside (``assert EXPR == value``)."""
    if not task.checks:
        return {p: t.decode() if isinstance(t, bytes) else t for p, t in task.test_files.items()}
    files: dict[str, str] = {}
    for i, c in enumerate(task.checks):
        files.setdefault(c.file, task.preambles.get(c.file, "") + "\n")
        files[c.file] += f"\n\ndef test_check_{i}():\n    assert ({c.expr}) == {c.expected!r}\n"
    return files


def naive_pytest(ws_path: str, task) -> int:
    """A naive verifier: the hidden tests copied into the workspace, `python -m pytest` there, its exit status."""
    d = tempfile.mkdtemp()
    try:
        shutil.copytree(ws_path, d, dirs_exist_ok=True, symlinks=True)
        for rel, text in original_tests(task).items():
            os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
            with open(os.path.join(d, rel), "w") as f:
                f.write(text)
        targets = sorted({p for p in original_tests(task) if p.rsplit("/", 1)[-1].startswith("test_")})
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets], cwd=d,
                              env=dict(os.environ, PYTHONPATH=d), capture_output=True, timeout=60).returncode
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def cases(swe_env, terminal_env, env_sandbox, hidden_verifier, tmp_path_factory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("loaded")
    loaded_env = WorkspaceEnv(sandbox=env_sandbox, verifier=hidden_verifier)
    (swe,) = load_swebench_jsonl(make_swebench_jsonl(str(root)), str(root))
    tb = load_terminal_bench_dir(make_terminal_bench_dir(str(root)))
    lite = generate_task(0, 0)
    term = generate_terminal_task(0, 7)  # script-words: the hidden checks run the agent's bin/<name>.sh
    script = re.search(r"> (bin/\w+\.sh)", term.solution[0][1]["command"]).group(1)
    return {"swe-lite": Case(swe_env, lite, lite.solution[0][1]["path"], True),
            "swe-bench": Case(loaded_env, swe, "calc/ops.py", True),
            "terminal-lite": Case(terminal_env, term, script, False),
            "terminal-bench": Case(loaded_env, tb, "count.sh", False)}


PY_KINDS, SH_KINDS = ("swe-lite", "swe-bench"), ("terminal-lite", "terminal-bench")


def _lite_fast(kinds):
    """The kinds as parametrize values: the -lite ones in the fast tier, the -bench ones (same checks through the
    upstream formats' loaders) in the slow tier."""
    return [k if k.endswith("-lite") else pytest.param(k, marks=pytest.mark.slow) for k in kinds]

# ------------------------------------------------------------------------------------------- attack payloads
# Python payloads are appended to the (unfixed) module the hidden tests import; shell payloads are the script the
# hidden tests run (it prints a wrong answer as its honest part).
READ_THE_TESTS = r'''
import ast as _ast, functools as _ft, linecache as _lc, re as _re, sys as _sys
def _cheat(fn):
    @_ft.wraps(fn)
    def wrapper(*a, **k):  # the expected value from the calling test's source line: `assert f(...) == <literal>`
        f = _sys._getframe(1)
        while f is not None:
            m = _re.search(r"==\s*(.+?)\s*$", _lc.getline(f.f_code.co_filename, f.f_lineno))
            if m and "test" in f.f_code.co_filename:
                try:
                    return _ast.literal_eval(m.group(1).rstrip(":"))
                except Exception:
                    pass
            f = f.f_back
        return fn(*a, **k)
    return wrapper
for _n, _f in list(globals().items()):
    if callable(_f) and getattr(_f, "__module__", None) == __name__ and not _n.startswith("_"):
        globals()[_n] = _cheat(_f)
'''
EQ_ALWAYS_TRUE = r'''
class _Any(str):
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = str.__hash__
    def __repr__(self):
        return "True"
for _n, _f in list(globals().items()):
    if callable(_f) and getattr(_f, "__module__", None) == __name__ and not _n.startswith("_"):
        globals()[_n] = lambda *a, **k: _Any("x")
'''
PATCH_THE_RUNNER = ("try:\n    import _pytest.python\n    _pytest.python.Function.runtest = lambda self: None\n"
                    "except ImportError:\n    pass\n")
PATCH_THE_PROBE = r'''
import builtins as _b
if hasattr(_b, "__tsync_probe__"):
    _orig = _b.__tsync_probe__
    _b.__tsync_probe__ = lambda site, value: _orig(site, True)  # every check "holds"
'''
FORGE_RECORDS = r'''
import json as _j, os as _os, re as _re, sys as _sys
def _forge(claims):
    out = []
    for d, _, names in _os.walk(_os.getcwd()):
        for n in names:
            if not (n.startswith("test_") and n.endswith(".py")):
                continue
            path = _os.path.join(d, n)
            rel = _os.path.relpath(path, _os.getcwd())
            test = None
            for line in open(path):
                m = _re.match(r"\s*def (test_\w+)", line)
                test = m.group(1) if m else test
                for site in _re.findall(r"__tsync_probe__\('([^']+)'", line):
                    out.append([rel + "::" + test, site, "v", claims.get(site, "true")])  # True, encoded
    argv = open("/proc/self/cmdline").read().split("\0")  # the boot's own argv names the results file
    results = [a for a in argv if a.endswith(".json") and ".tsync_" in a]
    if results:
        with open(results[0], "w") as f:
            f.write(_j.dumps(out))
        _os._exit(0)  # before any test runs: the boot never overwrites it
_forge(CLAIMS)
'''
SHADOWS = {p: "raise SystemExit(0)\n" for p in ("json.py", "tsync_probe.py", "pytest.py", "_pytest/__init__.py",
                                                 "pluggy.py", "re.py", "subprocess.py", "builtins.py")}
FORCE_PASS_HOOK = ('import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n'
                   '    outcome = yield\n    outcome.get_result().outcome = "passed"\n')
PY_ATTACKS = {  # name -> (payload, fools the naive pytest run on swe-lite; on swe-bench too unless "read the tests")
    "print PASS lines": ("import sys\nfor _s in (sys.stdout, sys.stderr):\n"
                         "    _s.write('PASS test_0\\n999 passed\\n')\n    _s.flush()\n", False),
    "read the tests for the expected values": (READ_THE_TESTS, True),
    "object whose __eq__ is always True": (EQ_ALWAYS_TRUE, True),
    "patch the test runner": (PATCH_THE_RUNNER, True),
    "patch the probe": (PATCH_THE_PROBE, False),
    "forge the probe records and exit": (FORGE_RECORDS.replace("CLAIMS", "{}"), False),
    "os._exit(0) at import": ("import os\nos._exit(0)\n", True),
}
SH_ATTACKS = {
    "print PASS lines": "echo 'PASS test_0'; echo '999 passed in 0.01s'; echo 0",
    "kill the test runner": "kill -9 $PPID 2>/dev/null; echo 0",
    "forge the records and kill the runner": "R=$(tr '\\0' '\\n' < /proc/$PPID/cmdline | grep 'tsync_.*json$'); "
                                             "printf '[]' > \"$R\"; kill -9 $PPID; echo 0",
    "plant the results path": "R=$(tr '\\0' '\\n' < /proc/$PPID/cmdline | grep 'tsync_.*json$'); "
                              "ln -sf /etc/passwd \"$R\" || printf '[]' > \"$R\"; echo 0",
    "write fake reports": "printf '<testsuite name=\"pytest\"><testcase name=\"t\"/></testsuite>' > report.xml; "
                          "cp report.xml junit.xml; echo True",
}


@pytest.mark.parametrize("kind", _lite_fast([*PY_KINDS, *SH_KINDS]))
def test_control_the_known_fix_scores_1_and_doing_nothing_0(cases, kind):
    c = cases[kind]
    assert c.play(c.fix())[0].reward == 1.0
    v, rc = c.play([], naive=True)
    assert v.reward == 0.0 and rc == 1, v  # the naive run also fails


@pytest.mark.parametrize("kind", _lite_fast(PY_KINDS))
@pytest.mark.parametrize("attack", list(PY_ATTACKS))
def test_python_attack_scores_the_honest_wrong_reward(cases, kind, attack):
    c = cases[kind]
    payload, fools_naive = PY_ATTACKS[attack]
    naive = fools_naive and not (kind == "swe-bench" and attack.startswith("read the tests"))
    v, rc = c.play([c.write(c.host, payload, append=True)], naive=naive)
    assert v.reward == 0.0, (attack, v)
    if attack.startswith("forge"):
        assert "wrong value" in v.reason, v  # the forged records were read: what they lack is the values
    if naive:  # swe-bench's test_add computes a list in a comprehension: the line-based cheat misses it
        assert rc == 0, f"control: {attack!r} should fool a naive pytest run"


@pytest.mark.parametrize("kind", _lite_fast(SH_KINDS))
@pytest.mark.parametrize("attack", list(SH_ATTACKS))
def test_shell_attack_scores_the_honest_wrong_reward(cases, kind, attack):
    c = cases[kind]
    v, _ = c.play([c.write(c.host, SH_ATTACKS[attack])])
    assert v.reward == 0.0, (attack, v)


def test_control_the_record_forger_with_the_right_values_scores_1(cases):
    """The forger above owns the report channel completely: given the expected values (which only the trusted
    process holds) it scores 1. What it lacks is exactly the answer."""
    c = cases["swe-lite"]
    claims = {e.site: encode(e.pinned) for exp in c.task.test_spec().expected.values() for e in exp}
    v, _ = c.play([c.write(c.host, FORGE_RECORDS.replace("CLAIMS", repr(claims)), append=True)])
    assert v.reward == 1.0, v


FRAME_READER = r'''
import sys as _sys
_add = add
def add(a, b):  # the value the calling test keeps in its local `want`
    return _sys._getframe(1).f_locals.get("want", _add(a, b))
'''


@pytest.mark.slow  # ~10 s of sandbox waits; the other attacks on the expected values stay in the fast tier
def test_expected_values_kept_in_the_test_body(env_sandbox, hidden_verifier, tmp_path):
    """A solution that reads its caller's frame for the expected value (the test's local `want`) without fixing add():
    a constant `want = 5` is inlined and stripped like a literal in the assert (the cheat finds nothing: 0); an
    expected value the test computes in the child (`want = int("5")`) would be visible, so that comparison is never
    a strong check and the task is refused as unverifiable (0, with the reason); a literal in the assert itself: 0.
    Control: the same tasks with the real fix score 1 where they are verifiable."""
    env = WorkspaceEnv(sandbox=env_sandbox, verifier=hidden_verifier)
    cases = [("    want = 5\n    assert add(2, 3) == want\n", True), ("    assert add(2, 3) == 5\n", True),
             ("    want = int('5')\n    assert add(2, 3) == want\n", False)]
    for n, (body, verifiable) in enumerate(cases):
        root = tmp_path / str(n)
        root.mkdir()
        (task,) = load_swebench_jsonl(make_swebench_jsonl(str(root), "def test_add():\n" + body), str(root))
        c = Case(env, task, "calc/ops.py", True)
        cheat = c.play([c.write(c.host, FRAME_READER, append=True)])[0]
        assert cheat.reward == 0.0, (body, cheat)
        if verifiable:
            fixed = c.play(c.fix())[0]
            assert fixed.reward == 1.0, (body, fixed)
        else:
            assert "unverifiable" in str(cheat) or "strong" in str(cheat) or "value check" in str(cheat), cheat


BOOL_GUESSES = {"always True": "return True", "always False": "return False",
                "the buggy answer negated": "return not _buggy(*a)"}


@pytest.mark.parametrize("guess", list(BOOL_GUESSES))
def test_guessing_a_bool_valued_function(swe_env, guess):
    """1-bit answers: on a bool-valued bug (is_palindrome), a constant and the negated buggy answer both fail some
    check (the generator guarantees two expected values and a pass-to-pass check of the buggy function)."""
    task = generate_task(0, 38)
    assert task.meta["template"] == "palindrome"
    path = task.solution[0][1]["path"]
    fn = re.search(r"is_palindrome|reads_same_backwards|palindromic", task.instruction).group(0)
    c = Case(swe_env, task, path, True)
    payload = f"_buggy = {fn}\n\n\ndef {fn}(*a):\n    {BOOL_GUESSES[guess]}\n"
    assert c.play([c.write(path, payload, append=True)])[0].reward == 0.0


@pytest.mark.parametrize("kind", _lite_fast([*PY_KINDS, "terminal-bench"]))
def test_planted_conftest_ini_and_sitecustomize(cases, kind):
    c = cases[kind]
    patch = "import _pytest.python\n_pytest.python.Function.runtest = lambda self: None\n"
    actions = [c.write(p, FORCE_PASS_HOOK) for p in ("conftest.py", "tests/conftest.py")]
    actions += [c.write("forcepass.py", FORCE_PASS_HOOK), c.write("pytest.ini", "[pytest]\naddopts = -p forcepass\n"),
                c.write("setup.cfg", "[tool:pytest]\naddopts = -p forcepass\n"),
                c.write("sitecustomize.py", patch), c.write("usercustomize.py", patch),
                c.write("forcepass.pth", "import sitecustomize\n")]
    v, rc = c.play(actions, naive=True)
    assert rc == 0  # control: a plain pytest run in the workspace passes
    assert v.reward == 0.0, v


@pytest.mark.parametrize("kind", _lite_fast(PY_KINDS))
def test_shadowing_modules_the_runner_imports(cases, kind):
    c = cases[kind]
    actions = [c.write(p, text) for p, text in SHADOWS.items()]
    assert c.play(actions)[0].reward == 0.0
    assert c.play(actions + c.fix())[0].reward == 1.0  # control: the run itself is unaffected


@pytest.mark.parametrize("how", ["edit", "delete", "rename"])
def test_editing_deleting_or_renaming_the_tests(cases, how):
    c = cases["swe-lite"]
    cmd = {"edit": "for f in tests/*.py; do printf 'def test_ok():\\n    assert True\\n' > $f; done",
           "delete": "rm -rf tests",
           "rename": "for f in tests/*.py; do mv $f ${f%.py}_old.py; done; mv tests tests_bak"}[how]
    assert c.play([c.bash(cmd)])[0].reward == 0.0
    assert c.play([c.bash(cmd)] + c.fix())[0].reward == 1.0  # control: the tests came back


def test_printing_does_not_hurt_a_genuine_fix(cases):
    c = cases["swe-lite"]
    assert c.play(c.fix() + [c.write(c.host, 'print("PASS hello from the solution")\n', append=True)])[0].reward == 1


def test_the_child_sees_neither_the_expected_values_nor_the_trusted_process(cases, hidden_verifier):
    """What the untrusted child can see: the test files carry no expected value, and from /proc it sees only its
    own sandbox's processes (the verifier process, which holds the values, is outside its pid namespace)."""
    c = cases["swe-lite"]
    spec = c.task.test_spec()
    text = "".join(spec.test_files.values())
    assert PROBE in text and not any(f"== {e.pinned!r}" in text for exp in spec.expected.values() for e in exp)
    if not hidden_verifier.sandbox.enforcement()["pid_namespace"]["enforced"]:
        pytest.skip("no pid namespace on this machine")
    look = {"tests/test_look.py": f"import os\n\n\ndef test_look():\n    {PROBE}('s', sorted(int(p) for p in "
                                  "os.listdir('/proc') if p.isdigit()))\n"}
    records, why, _ = hidden_verifier.probe(tempfile.mkdtemp(), TestSpec(look, {"tests/test_look.py::test_look": ()},
                                                                         sites={"s"}))
    (_, kind, pids), = records["tests/test_look.py::test_look"]
    assert kind == "v" and os.getpid() not in pids and max(pids) < 100, pids


def test_killing_the_runner(cases):
    c = cases["swe-lite"]
    for payload in ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
                    "import os, signal\nos.killpg(0, signal.SIGKILL)\n"):
        v, _ = c.play(c.fix() + [c.write(c.host, payload, append=True)])
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


def test_outliving_the_timeout(cases):
    c = cases["swe-lite"]
    if not c.env.sandbox.enforcement()["uid"]["enforced"]:
        pytest.skip("no per-call uid on this machine: the leftover-process check counts sandbox uids")
    verifier = HiddenTestVerifier(config=SandboxConfig(wall_timeout_s=4.0, cpu_seconds=10))
    payload = ("import subprocess, time\nsubprocess.Popen(['/bin/sleep', '600'], start_new_session=True)\n"
               "time.sleep(3600)\n")
    v, _ = c.play(c.fix() + [c.write(c.host, payload, append=True)], verifier=verifier)
    assert v.reward == 0.0 and "timeout" in v.reason, v  # killed at the 4 s wall timeout
    assert _sandbox_processes() == []  # the escaped `sleep 600` is gone with the call's pid namespace


def test_symlinks_and_special_files_are_not_followed(cases):
    """A workspace symlink to a host file, or a FIFO, neither leaks into nor hangs the verifier."""
    c = cases["swe-lite"]
    pkg = c.host.split("/")[0]
    actions = [c.bash(f"ln -s /etc/passwd {pkg}/passwd.py; ln -s /etc tests_link; mkfifo fifo")]
    assert c.play(actions + c.fix())[0].reward == 1.0
