"""Split verification's parts in-process (no sandbox): the assert rewrite strips literal expected values, the child
runtime only lets plain data out, and the trusted judge accepts exactly the expected probes."""

from __future__ import annotations

import builtins
import json
import time

import pytest

from megatron_tsync.rollout.envs.probe_values import Budget, canon, decode, encode
from megatron_tsync.rollout.envs.probes import (MAX_RECORDS_PER_SITE, MAX_RESULTS_BYTES, MAX_VALUE_CHARS, NOPIN, PROBE,
                                                PROBE_RUNTIME, Expect, expectations_from_reference, judge,
                                                parse_records, rewrite_asserts)
from megatron_tsync.rollout.envs.verifier import DEFAULT_CONFIG

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


# ------------------------------------------------------------------------------------------ adversarial reports
def _child_encoder():
    rt: dict = {}
    exec(PROBE_RUNTIME, rt)
    del builtins.__tsync_probe__

    def text(value) -> str:
        rt["probe"]("s", value)
        return rt["records"].pop()[3]
    return text


child_text = _child_encoder()
"""The child runtime's encoding of a value (what its probe records)."""


def one_mib(kind: str) -> str:
    """The largest record the child may write (MAX_VALUE_CHARS) holding a set / a dict (int keys) of ints equal mod
    2**61 - 1 (one int hash), or lists nested that deep: written directly, in the child's own format, as a forger
    would (building the real set in a process is the quadratic work the attack wants the verifier to do)."""
    el = child_text(7)
    if kind == "nested":
        pre, suf = child_text([7]).split(el)
        n = (MAX_VALUE_CHARS - len(el)) // (len(pre) + len(suf))
        return pre * n + el + suf * n
    sep = child_text([7, 7]).split(el)[1]
    pre, *mid, suf = child_text({7} if kind == "set" else {7: 7}).split(el)
    parts, size, k = [], len(pre) + len(suf), 1
    while True:  # the child's text of 7 with the digits swapped: its text of the int (both formats write decimal)
        part = el.replace("7", str(k * (2**61 - 1))) + (mid[0] + el if mid else "")
        if size + len(part) + len(sep) > MAX_VALUE_CHARS:
            return pre + sep.join(parts) + suf
        parts.append(part)
        size, k = size + len(part) + len(sep), k + 1


def report(rows: list[list[str]]) -> str:
    """A results document with the rows, plus a well-behaved test ("t::ok", its one value 5) that must still pass."""
    return json.dumps([["t::ok", "ok", "v", child_text(5)], *rows])


def test_adversarial_reports_cost_the_trusted_side_little_cpu():
    """Forged reports: the largest record of hash-colliding ints in a set / a dict (every int a multiple of
    2**61 - 1: one hash), 1 MiB of nested lists, as many colliding records as fit in one report (MAX_RESULTS_BYTES)
    at sites the verifier expects and at sites it does not, a flood of tiny records. Each report's parse + judge (the
    worker's CPU, time.process_time) stays under a tenth of the solution's own CPU limit (the verifier's sandbox,
    60 s); ast.literal_eval of the first record alone took ~28 s. The well-behaved test beside them still passes; the
    forged ones fail, and a report over the record caps is refused."""
    bound = DEFAULT_CONFIG.cpu_seconds / 10
    ok = {"t::ok": (Expect("ok", pinned=5),)}
    big_set = one_mib("set")
    fit = MAX_RESULTS_BYTES // len(json.dumps(["t::x", "x#00", "v", big_set]))
    cases = {  # name -> (rows, the test's expected probes or None if the report must be refused)
        "1 MiB set of colliding ints": ([["t::x", "x#0", "v", big_set]], (Expect("x#0", pinned={1, 2}),)),
        "1 MiB dict of colliding int keys": ([["t::x", "x#0", "v", one_mib("dict")]], (Expect("x#0", pinned={1: 7}),)),
        "1 MiB of nested lists": ([["t::x", "x#0", "v", one_mib("nested")]], (Expect("x#0", pinned=[[]]),)),
        f"{fit} such sets, expected sites": ([["t::x", f"x#{i}", "v", big_set] for i in range(fit)],
                                             tuple(Expect(f"x#{i}", pinned={1, 2}) for i in range(fit))),
        f"{fit} such sets, sites nobody expects": ([["t::y", f"y#{i}", "v", big_set] for i in range(fit)],
                                                   (Expect("x#0", pinned=1),)),
        "a flood of tiny records": ([["t::x", "x#0", "v", "true"]] * (MAX_RESULTS_BYTES // 40), None),
        "one site, too many records": ([["t::x", "x#0", "v", "true"]] * (MAX_RECORDS_PER_SITE + 1), None),
    }
    for name, (rows, want) in cases.items():
        data = report(rows)
        assert len(data) <= MAX_RESULTS_BYTES, name
        t0 = time.process_time()
        try:
            passed, bad = judge(parse_records(data, {**ok, "t::x": want or ()}), {**ok, "t::x": want or ()})
        except ValueError as e:
            passed, bad = None, str(e)
        spent = time.process_time() - t0
        assert spent < bound, f"{name}: {spent:.1f} s of the worker's CPU (bound {bound:g} s)"
        if want is None:
            assert passed is None and "more than" in bad, (name, bad)
        else:
            assert passed == ["t::ok"] and len(bad) == 1 and bad[0].startswith("t::x"), (name, bad)


def test_values_compare_as_python_values():
    """The decoded forms compare exactly as the values did: a bool is no int at the top level but is one inside a set
    or as a dict key (Python's ==), 1 == 1.0, nested containers, set membership / subset ops, approx, and what the
    child refuses (non-finite floats, objects) stays "not plain data"."""
    def dec(v):
        return decode(encode(v), Budget(1000))
    assert Expect("s", pinned={1, (2, "a")}).holds(dec({1.0, (2, "a")})) and Expect("s", pinned={True}).holds(dec({1}))
    assert not Expect("s", pinned={1, 2}).holds(dec({1, 3})) and not Expect("s", pinned=1).holds(dec(True))
    assert Expect("s", pinned={"a": [1, {2}], 1: b"x"}).holds(dec({True: b"x", "a": [1.0, {2}]}))
    assert not Expect("s", pinned={"a": [1, {2}]}).holds(dec({"a": [1, {3}]}))
    assert Expect("s", op="in", literal={3, 4}).holds(dec(3)) and not Expect("s", op="in", literal={3}).holds(dec([3]))
    assert Expect("s", op="<", literal={1, 2}).holds(dec({1})) and Expect("s", op="in", literal=[{1}]).holds(dec({1}))
    assert Expect("s", op="not in", literal={1, 2}).holds(dec({2})) and not Expect("s", op="not in", literal={1: 2}).holds(dec({1}))
    assert Expect("s", op="in", literal={"k": 1}).holds(dec("k")) and Expect("s", op="is", literal=None).holds(dec(None))
    assert Expect("s", op="approx", literal=([0.3, 1.0], None, None)).holds(dec([0.1 + 0.2, 1]))
    assert Expect("s", pinned=(1, [2.5, "x"])).holds(dec((1, [2.5, "x"]))) and dec(-0.0) == 0 and dec(b"\x00") == b"\x00"
    for text in (child_text(float("inf")), child_text(float("nan")), '["s",["l"]]', '"i1_0e5"', '["q"]', '"f1e999"'):
        with pytest.raises(ValueError):
            decode(text, Budget(100))
    assert child_text(frozenset({1})) == "frozenset (TypeError)" and child_text(10**5000).endswith("(ValueError)")
