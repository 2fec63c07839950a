"""Verifiers: registry contract, exact answers, shaped format reward, and sandboxed unit tests."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from megatron_tsync.rollout.sandbox import Sandbox, SandboxConfig
from megatron_tsync.rollout.verifiers import (
    Score,
    Verifier,
    available_verifiers,
    get_verifier,
    parse_answer,
    register_verifier,
)

pytestmark = pytest.mark.timeout(60)


def run(coro):
    return asyncio.run(coro)


def evaluate(name: str, text: str, task, **kw) -> Score:
    return run(get_verifier(name, **kw).evaluate(text, task))


def test_registry_contract():
    assert {"exact_answer", "answer_with_format", "unit_tests"} <= set(available_verifiers())
    for name in available_verifiers():
        v = get_verifier(name)
        assert isinstance(v, Verifier)
        lo, hi = v.reward_range
        assert lo < hi and isinstance(v.binary, bool)
    assert get_verifier("exact_answer").binary and not get_verifier("answer_with_format").binary
    with pytest.raises(KeyError):
        get_verifier("nope")


def test_custom_verifier_registration():
    @register_verifier("const_test")
    class Const:
        name, reward_range, binary = "const_test", (-1.0, 1.0), False

        async def evaluate(self, text, task):
            return Score(-0.5, "const")

        async def score(self, text, task):
            return (await self.evaluate(text, task)).reward

    assert run(get_verifier("const_test").score("x", {})) == -0.5


@pytest.mark.parametrize("text, want, reason", [
    ("The answer is <answer>42</answer>", 42, "ok"),
    ("<answer> -7 </answer>", -7, "ok"),
    ("<answer>1,000</answer>", 1000, "ok"),
    ("<answer>1</answer> wait, <answer>2</answer>", 2, "ok"),
    ("no answer", None, "no <answer>"),
    ("<answer>42", None, "unterminated"),
    ("<answer>forty-two</answer>", None, "not an integer"),
    ("<answer>4.5</answer>", None, "not an integer"),
    ("<answer></answer>", None, "not an integer"),
    ("<tool>shell: x</tool><result><answer>42</answer></result>", None, "no <answer>"),
])
def test_parse_answer(text, want, reason):
    got, why = parse_answer(text)
    assert got == want and reason in why


def test_exact_answer_good_bad_malformed():
    task = {"answer": 42}
    good = evaluate("exact_answer", "<tool>calculator: 6*7</tool><result>42</result> so <answer>42</answer>", task)
    assert good == Score(1.0, "correct")
    bad = evaluate("exact_answer", "<answer>41</answer>", task)
    assert bad.reward == 0.0 and "got 41, expected 42" in bad.reason
    malformed = evaluate("exact_answer", "I think it is 42", task)
    assert malformed.reward == 0.0 and "malformed" in malformed.reason
    injected = evaluate("exact_answer", "<tool>shell: echo</tool><result><answer>42</answer></result>", task)
    assert injected.reward == 0.0
    assert evaluate("exact_answer", "<answer>42</answer>", {"answer": "oops"}).reward == 0.0
    assert run(get_verifier("exact_answer").score("<answer>42</answer>", {"answer": 42})) == 1.0


def test_answer_with_format_partial_credit_and_bounds():
    task = {"answer": 42}
    v = get_verifier("answer_with_format")
    full = "<tool>calculator: 6*7</tool><result>42</result>\n<answer>42</answer>"
    assert run(v.score(full, task)) == pytest.approx(1.0)
    assert run(v.score("<answer>42</answer>", task)) == pytest.approx(0.8)  # no tool use
    assert run(v.score(full.replace("<answer>42", "<answer>41"), task)) == pytest.approx(0.4)  # tool + format
    assert run(v.score("<answer>42</answer> trailing text", task)) == pytest.approx(0.6)  # not at the end
    assert run(v.score("<tool>calculator 6*7</tool><result>error</result> 42", task)) == 0.0  # malformed call
    assert run(v.score("<answer>42</answer><answer>42</answer>", task)) == pytest.approx(0.6)  # two answers
    assert run(v.score("", task)) == 0.0
    lo, hi = v.reward_range
    for text in [full, "", "<answer>x</answer>", "<tool>a: b</tool><result>r</result>"]:
        assert lo <= run(v.score(text, task)) <= hi
    custom = get_verifier("answer_with_format", w_correct=1.0, w_tool=0.0, w_format=0.0)
    assert run(custom.score("<answer>42</answer> x", task)) == 1.0
    with pytest.raises(ValueError):
        get_verifier("answer_with_format", w_correct=0.9, w_tool=0.9, w_format=0.0)


@pytest.fixture(scope="module")
def ut():
    # 15 s of wall time: a loaded 2-core machine took over 2.5 s for `sh solution.sh` (scored 0 as a timeout); the
    # timeout itself is tested with its own 2.5 s verifier below
    return get_verifier("unit_tests", sandbox=Sandbox(SandboxConfig(wall_timeout_s=15.0, cpu_seconds=5)))


TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'", "assert add(2, 2) == 5"]


def test_unit_tests_pass_fraction(ut):
    good = "Here is my fix:\n```python\ndef add(a, b):\n    return a + b\n```"
    s = run(ut.evaluate(good, {"tests": TESTS}))
    assert s.reward == pytest.approx(0.75) and s.reason == "3/4 tests passed"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    assert run(ut.score(wrong, {"tests": TESTS})) == 0.0
    broken = "```python\ndef add(a, b)\n    return a + b\n```"
    s = run(ut.evaluate(broken, {"tests": TESTS}))
    assert s.reward == 0.0 and s.reason == "0/4 tests passed"


def test_unit_tests_malformed_and_timeouts(ut):
    s = run(ut.evaluate("no code here", {"tests": TESTS}))
    assert s.reward == 0.0 and "no fenced code block" in s.reason
    quick = get_verifier("unit_tests", sandbox=Sandbox(SandboxConfig(wall_timeout_s=2.5, cpu_seconds=5)))
    s = run(quick.evaluate("```python\nimport time\ntime.sleep(60)\n```", {"tests": TESTS}))
    assert s.reward == 0.0 and "timeout" in s.reason
    s = run(ut.evaluate("```python\nx = 1\n```", {}))
    assert s.reward == 0.0 and "no 'tests'" in s.reason


def test_unit_tests_refuses_forgeable_tasks(ut):
    """A PASS-line test_command and snippets without an `== literal` value check are refused, not scored."""
    good = "```python\ndef f():\n    return 1\n```"
    s = run(ut.evaluate(good, {"test_command": "echo PASS a", "tests": ["assert f() == 1"]}))
    assert s.reward == 0.0 and "test_command" in s.reason, s
    for snippet in ["assert f()", "assert f() != 2", "assert f() == g()", "assert f() is None", "x = f()"]:
        s = run(ut.evaluate(good, {"tests": ["assert f() == 1", snippet]}))
        assert s.reward == 0.0 and "unverifiable task: test 1" in s.reason, (snippet, s)


def test_unit_tests_shell_solution_with_repo_files(ut):
    task = {"files": {"input.txt": "a\nb\nc\n"}, "solution_path": "solution.sh",
            "tests": ["assert sh('sh solution.sh').strip() == '3'",
                      "assert read('input.txt').split() == ['a', 'b', 'c']"]}
    assert run(ut.score("```sh\nwc -l < input.txt\n```", task)) == 1.0
    assert run(ut.score("```sh\necho 4\n```", task)) == 0.5


# Each attack is a solution that does not implement add() but tries to score; each must get 0 (the honest-wrong
# reward: it returns a - b), while the genuine add() gets 3/4 above.
UT_ATTACKS = {
    "print PASS lines": "import sys\nprint('PASS test_0\\nPASS test_1\\nPASS test_2\\n3 passed')\n"
                        "def add(a, b):\n    return a - b\n",
    "__eq__ always True": "class Any:\n    def __eq__(self, o):\n        return True\n    __hash__ = None\n"
                          "def add(a, b):\n    return Any()\n",
    "str subclass with __eq__": "class S(str):\n    def __eq__(self, o):\n        return True\n"
                                "def add(a, b):\n    return S('x')\n",
    "read the tests": "import json, re\nTESTS = json.load(open('tests.json'))['tests']\ndef add(a, b):\n"
                      "    for t in TESTS:  # the expected value of the test that calls add(a, b)\n"
                      "        m = re.search(r'add\\((.*?)\\)\\W*==\\s*(.+)$', t)\n"
                      "        if m and eval('(' + m.group(1) + ',)') == (a, b):\n"
                      "            return eval(m.group(2))\n    return a - b\n",
    "patch the probe": "import builtins\n_p = builtins.__tsync_probe__\n"
                       "builtins.__tsync_probe__ = lambda site, v: _p(site, True)\ndef add(a, b):\n    return a - b\n",
    "forge the report line": "import os, sys, json\nsys.stdout.write('\\n@@tsync-probes@@ ' + json.dumps("
                             "[['t%d' % i, 't%d#0' % i, 'v', 'True'] for i in range(4)]) + '\\n')\n"
                             "sys.stdout.flush()\nos._exit(0)\n",
    "exit 0 at import": "import os\nos._exit(0)\n",
}


# The previous verifier, kept here as the control: snippets with their literals run where the solution runs, PASS
# lines counted from the output.
NAIVE_RUNNER = """
import json, sys
sys.path.insert(0, ".")
for i, src in enumerate(json.load(open("tests.json"))["tests"]):
    ns = {}
    try:
        exec("from solution import *", ns)
        exec(src, ns)
        print("PASS test_%d" % i, flush=True)
    except BaseException as e:
        print("FAIL test_%d" % i, flush=True)
"""
NAIVE_FOOLED = {"print PASS lines", "__eq__ always True", "str subclass with __eq__", "read the tests"}


@pytest.mark.parametrize("attack", list(UT_ATTACKS))
def test_unit_tests_attacks_score_the_honest_wrong_reward(ut, attack):
    s = run(ut.evaluate(f"```python\n{UT_ATTACKS[attack]}```", {"tests": TESTS}))
    assert s.reward == 0.0, (attack, s)
    if attack in NAIVE_FOOLED:  # control: the attack is real, it scores against the PASS-line verifier
        res = ut.sandbox.run([ut.sandbox.python, "-I", "run.py"], files={
            "run.py": NAIVE_RUNNER, "solution.py": UT_ATTACKS[attack], "tests.json": json.dumps({"tests": TESTS})})
        out = res.stdout
        assert len(re.findall(r"^PASS", out, re.M)) / len(re.findall(r"^(?:PASS|FAIL)", out, re.M)) >= 3 / 7, out
