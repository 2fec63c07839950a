"""Split verification's parts in-process (no sandbox): the assert rewrite strips literal expected values, the child
runtime only lets plain data out, and the trusted judge accepts exactly the expected probes."""

from __future__ import annotations

import builtins
import json

import pytest

from megatron_tsync.rollout.envs.probe_values import Budget, canon, decode, encode
from megatron_tsync.rollout.envs.probes import (NOPIN, PROBE, PROBE_RUNTIME, Expect, expectations_from_reference,
                                                judge, parse_records, rewrite_asserts)

SRC = '''
def test_a():
    assert f(1) == 50
    assert 70 == f(2)
    assert 3 < f(3)
    x = f(4)
    assert x
    assert f(5) == g(5)
    assert 0 < f(6) < 90
'''


def run_child(src: str, **ns) -> list:
    """Execute a rewritten file with the real probe runtime (in this process) and return its records."""
    rt: dict = {}
    exec(PROBE_RUNTIME, rt)
    try:
        exec(src, ns)
        ns["test_a"]()
        return rt["records"]
    finally:
        del builtins.__tsync_probe__


def test_rewrite_strips_literal_operands_and_probes_the_rest():
    child, sites = rewrite_asserts(SRC, "t.py")
    assert not any(lit in child for lit in ("50", "70", "90")) and "assert" not in child
    assert sites == {"t.py#0": ("==", 50), "t.py#1": ("==", 70), "t.py#2": (">", 3), "t.py#3": (None, None),
                     "t.py#4": ("exposed", None), "t.py#5": ("exposed", None), "t.py#6": (None, None)}
    recs = run_child(child, f=lambda x: x * 10, g=lambda x: x + 1)
    assert [(s, decode(v, Budget(9))) for _, s, _, v in recs] == [("t.py#0", 10), ("t.py#1", 20), ("t.py#2", 30),
                                                                  ("t.py#3", 40), ("t.py#4", 50), ("t.py#5", 6),
                                                                  ("t.py#6", 60)]
    with pytest.raises(ValueError, match="not valid Python"):
        rewrite_asserts("def f(:\n", "bad.py")


def test_only_plain_data_leaves_the_child():
    class Any(str):
        def __eq__(self, other):
            return True

    class Obj:
        pass

    child, _ = rewrite_asserts("def test_a():\n    for v in VALUES:\n        assert v == 1\n", "t.py")
    values = [Any("x"), Obj(), [1, (2, {"k": {3}})], True, 2.5, b"by", {1: Obj()}, "x" * (2 << 20)]
    recs = run_child(child, VALUES=values)
    assert [k for _, _, k, _ in recs] == ["u", "u", "v", "v", "v", "v", "u", "u"]
    assert recs[0][3] == "Any (TypeError)" and recs[2][3] == '["l","i1",["t","i2",["d","sk",["s","i3"]]]]'
    assert decode(recs[2][3], Budget(9)) == canon([1, (2, {"k": {3}})])


def test_parse_records_takes_only_data():
    good = json.dumps([["t::a", "s", "v", encode([1, "x"])], ["t::a", "s2", "v", "__import__('os')"],
                       ["t::b", "s", "u", "Obj"]])
    recs = parse_records(good, {"t::a": (Expect("s"), Expect("s2")), "t::b": (Expect("s"),)})
    assert recs == {"t::a": [("s", "v", [1, "x"]), ("s2", "u", "unparsable value")], "t::b": [("s", "u", "Obj")]}
    for bad in ("not json", "{}", '[["a", "b", "c"]]', '[["a", "b", "c", 4]]', "[" * 100000, "[[1e999]]",
                '[["a", "b", "c", "d"]] x'):
        with pytest.raises(ValueError):
            parse_records(bad, {})


def test_judge_wants_exactly_the_expected_probes():
    exp = {"t::a": (Expect("s0", pinned=[1, 2]), Expect("s1", op="<", literal=5)), "t::b": (Expect("s0", 3),)}
    ok = {"t::a": [("s0", "v", [1, 2]), ("s1", "v", 4)], "t::b": [("s0", "v", 3)]}
    assert judge(ok, exp) == (["t::a", "t::b"], [])
    cases = {"wrong value": {"t::a": [("s0", "v", [1, 3]), ("s1", "v", 4)]},
             "tuple for a list": {"t::a": [("s0", "v", (1, 2)), ("s1", "v", 4)]},
             "op fails": {"t::a": [("s0", "v", [1, 2]), ("s1", "v", 6)]},
             "op type error": {"t::a": [("s0", "v", [1, 2]), ("s1", "v", "x")]},
             "missing": {"t::a": [("s0", "v", [1, 2])]},
             "extra": {"t::a": [("s0", "v", [1, 2]), ("s1", "v", 4), ("s1", "v", 4)]},
             "site swapped": {"t::a": [("s1", "v", 4), ("s0", "v", [1, 2])]},
             "not plain": {"t::a": [("s0", "u", "Obj"), ("s1", "v", 4)]}}
    for name, recs in cases.items():
        passed, bad = judge({**ok, **recs}, exp)
        assert passed == ["t::b"] and len(bad) == 1 and bad[0].startswith("t::a"), name
    assert judge({}, exp)[0] == []


def test_bools_are_not_ints_and_strength():
    assert not Expect("s", pinned=True).holds(1) and not Expect("s", pinned=1).holds(True)
    assert Expect("s", pinned=2).holds(2.0) and Expect("s", pinned={"a": [1]}).holds({"a": [1]})
    assert Expect("s", pinned=5).strong and Expect("s", op="==", literal="x").strong
    weak = [Expect("s", pinned=True), Expect("s", pinned=None), Expect("s", op="!=", literal=3),
            Expect("s", op="==", literal=False), Expect("s", op="<", literal=3), Expect("s")]
    assert not any(e.strong for e in weak)


def test_expectations_from_two_reference_runs():
    sites = {"f#0": ("==", 5), "f#1": (None, None), "f#2": (None, None)}
    run1 = {"t::a": [("f#0", "v", 5), ("f#1", "v", [1, 2]), ("f#2", "v", "/tmp/abc")]}
    run2 = {"t::a": [("f#0", "v", 5), ("f#1", "v", [1, 2]), ("f#2", "v", "/tmp/xyz")]}
    (a,) = expectations_from_reference([run1, run2], sites).values()
    assert a == (Expect("f#0", 5, "==", 5), Expect("f#1", [1, 2]), Expect("f#2", NOPIN))  # unstable: not pinned
    obj = {"t::b": [("f#1", "u", "Obj (TypeError)")]}
    (b,) = expectations_from_reference([obj, obj], sites).values()
    assert b == (Expect("f#1", any_kind=True),) and not b[0].strong
    assert judge({"t::b": [("f#1", "u", "Other")]}, {"t::b": b}) == (["t::b"], [])  # an object: only that it fires
    assert judge({"t::b": []}, {"t::b": b})[0] == []
    with pytest.raises(ValueError, match="differ between runs"):
        expectations_from_reference([run1, {"t::a": run1["t::a"][:2]}], sites)
    with pytest.raises(ValueError, match="reference solution fails"):
        bad = {"t::a": [("f#0", "v", 6)] + run1["t::a"][1:]}
        expectations_from_reference([bad, bad], sites)


def test_pytest_approx_with_literals_is_judged_with_its_tolerance():
    child, sites = rewrite_asserts("assert f() == pytest.approx(0.3)\nassert g() == approx([1.0, 2.0], abs=0.1)\n"
                                   "assert h() == approx(x)\n", "a.py")
    assert "0.3" not in child and "abs" not in child
    assert sites == {"a.py#0": ("approx", (0.3, None, None)), "a.py#1": ("approx", ([1.0, 2.0], None, 0.1)),
                     "a.py#2": ("exposed", None), "a.py#3": ("exposed", None)}
    e0, e1 = (Expect(s, op=op, literal=lit) for s, (op, lit) in list(sites.items())[:2])
    assert e0.strong and e0.holds(0.1 + 0.2) and not e0.holds(0.31) and not e0.holds("0.3") and not e0.holds(True)
    assert e1.holds([1.05, 1.95]) and not e1.holds([1.2, 2.0]) and not e1.holds((1.0, 2.0))


def test_the_probe_name_is_what_the_rewrite_calls():
    assert PROBE in rewrite_asserts("assert x\n", "p")[0] and f"builtins.{PROBE} = probe" in PROBE_RUNTIME


def test_constants_bound_in_the_test_are_stripped_and_two_sided_comparisons_are_weak():
    """`want = 5; assert add(2, 3) == want` is `assert add(2, 3) == 5` (the binding removed, the literal kept on the
    trusted side); a name used anywhere else, or bound to a computed value, stays in the child, and its comparison
    probes both sides as EXPOSED: pinned, never strong."""
    src = ("WANT = {'a': 1}\n"
           "def test_a():\n    want = 5\n    assert add(2, 3) == want\n"
           "def test_b():\n    want = 7\n    assert want == add(3, 4)\n    print(want)\n"
           "def test_c():\n    assert get() == WANT\n"
           "def test_d():\n    want = sorted([3, 1])\n    assert srt([3, 1]) == want\n")
    child, sites = rewrite_asserts(src, "t.py")
    assert "want = 5" not in child and "== 5" not in child and "'a'" not in child and "want = 7" in child and "sorted([3, 1])" in child
    assert sites == {"t.py#0": ("==", 5), "t.py#1": ("exposed", None), "t.py#2": ("exposed", None),
                     "t.py#3": ("==", {"a": 1}), "t.py#4": ("exposed", None), "t.py#5": ("exposed", None)}
    assert not Expect("t.py#4", pinned=[1, 3], op="exposed").strong and Expect("t.py#4", pinned=[1, 3]).strong
    assert Expect("t.py#4", pinned=[1, 3], op="exposed").holds([1, 3])
