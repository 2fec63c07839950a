"""Split verification: the untrusted process only *reports values*; a trusted process decides (docs/threat_model.md).

A hidden check ``assert EXPR == EXPECTED`` is never run as such where the solution's code runs. Instead:

    untrusted child (imports the solution)            trusted verifier (the rollout worker; never imports it)
    ──────────────────────────────────────            ─────────────────────────────────────────────────────────
    __tsync_probe__("site", EXPR)  ── value ──►        plain data only (a tagged JSON encoding, size-capped,
      (expected values stripped:                       decoded in linear time: ``probe_values``); compared with
       the child never sees them)                      the expected value it alone holds
                                                       (a literal of the test, a generator's value, or the
                                                       task's reference solution's value on the same check)

Whatever the solution does inside the child (patch pytest, the probe, ``builtins``, ``json``; print; write files;
exit early) it can only change *which values are claimed*: to claim the right ones it must know them, i.e. compute
them — solve the task. Objects with a forged ``__eq__`` never reach a comparison: only an encoding of plain data
leaves the child, and the trusted side decodes it into built-in types. Nor can a report buy the worker's CPU: only
the values of the probes the trusted side expects are decoded (:func:`parse_records`), the records are counted
against caps, and decoding never hashes a value the child chose (``probe_values``).

:func:`rewrite_asserts` turns the ``assert`` statements of a pytest file into probes (AST rewrite): for
``assert L op R`` with one literal operand the literal is stripped from the child's source and kept as the site's
trusted check; any other operand (and the value of a bare ``assert X``) is probed and must equal the reference
run's value. :class:`Expect` is one expected probe; :func:`judge` compares a child's records with them.
Standard library only.
"""

from __future__ import annotations

import ast
import copy
import json
import operator
import os
import re
import stat
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

from megatron_tsync.rollout.envs.probe_values import ENCODER_SRC, Budget, canon, decode, key

__all__ = ["Expect", "EXPOSED", "NOPIN", "PROBE_RUNTIME", "rewrite_asserts", "parse_records", "judge", "is_strong",
           "expectations_from_reference", "MAX_RESULTS_BYTES"]

MAX_VALUE_CHARS = 1 << 20
MAX_RESULTS_BYTES = 32 << 20
MAX_RECORDS = 100_000
"""Probe records in one report (more: the report is refused, the trajectory scores 0 with the reason)."""
MAX_RECORDS_PER_SITE = 10_000
"""Records of one probe site in one report (an assert in a loop fires once per iteration)."""
MAX_ELEMENTS = 1 << 20
"""Values and container items decoded from one report, all records together (past it: "unparsable value")."""
PROBE = "__tsync_probe__"
_WS = re.compile(r"[ \t\n\r]*")


def _no_number(s: str) -> Any:
    raise ValueError("probe results are not valid: a number where a record has strings")


_ROW = json.JSONDecoder(parse_int=_no_number, parse_float=_no_number, parse_constant=_no_number)

OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.In: "in",
       ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
EXPOSED = "exposed"
"""The op of a probe whose comparison had two non-literal operands: both are evaluated in the child, so the one that
holds the expected value (a variable computed by the test) is visible to the solution's code there; the probe is
pinned to the reference run's value but never *strong* (a loaded task needs a strong check in each FAIL_TO_PASS
test: one whose expected value the child never holds)."""
_FLIP = {"==": "==", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<="}  # literal on the left: swap sides
_EVAL = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
         ">=": operator.ge, "in": lambda a, b: _contains(b, a), "not in": lambda a, b: not _contains(b, a),
         "is": lambda a, b: a is b, "is not": lambda a, b: a is not b,
         "approx": lambda a, b: _approx(a, *b), EXPOSED: lambda a, b: True}


def _contains(container: Any, x: Any) -> bool:
    """``x in container`` where a set / dict is in :func:`probe_values.canon` form (it holds key texts)."""
    if type(container) in (set, frozenset):
        return key(frozenset(x) if type(x) is set else x) in container  # as Python's set does with a set
    if type(container) is dict:
        return key(x) in container
    return x in container


def _approx(value: Any, expected: Any, rel: float | None, abs_: float | None) -> bool:
    """``value == pytest.approx(expected, rel=rel, abs=abs_)`` for numbers and (nested) lists / tuples of them."""
    if isinstance(expected, (list, tuple)):
        return (type(value) is type(expected) and len(value) == len(expected)
                and all(_approx(v, e, rel, abs_) for v, e in zip(value, expected)))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or isinstance(expected, bool):
        return False
    if abs_ is not None and rel is None:  # pytest: an absolute tolerance alone drops the relative one
        tol = abs_
    else:
        tol = max((1e-6 if rel is None else rel) * abs(expected), 1e-12 if abs_ is None else abs_)
    return value == expected or abs(value - expected) <= tol

# The child's side: imported by the verifier's boot script / the unit-test runner from the read-only bundle. The
# solution can replace any of it; it then only changes the values claimed (see the module docstring).
PROBE_RUNTIME = r'''
import builtins, json, os
records = []
current = [None]
%(encoder)s

def probe(site, value):
    test = current[0] or os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    try:
        text, kind = _encode(value), "v"
        if len(text) > %(cap)d:
            text, kind = "too large", "u"
    except Exception as e:
        text, kind = "%%s (%%s)" %% (type(value).__name__, type(e).__name__), "u"
    records.append([test, site, kind, text])


builtins.%(probe)s = probe
''' % {"cap": MAX_VALUE_CHARS, "probe": PROBE, "encoder": ENCODER_SRC}


class _NoPin:
    def __repr__(self) -> str:
        return "NOPIN"


NOPIN = _NoPin()


@dataclass(frozen=True)
class Expect:
    """One probe a must-pass test has to report: its site, and what its value must be."""

    site: str
    pinned: Any = NOPIN
    """The exact value (plain data) the probe must report, or NOPIN (only ``op`` / no error is checked)."""
    op: str | None = None
    literal: Any = None
    """``value op literal`` must hold (the literal operand stripped from the child's source)."""
    any_kind: bool = False
    """Accept a value that is not plain data (the reference reported none either: only that the probe fires)."""

    @property
    def strong(self) -> bool:
        """Whether a solution that does not compute the value cannot satisfy this: an exact value it never sees that
        is not a bool / None (those are 1-bit guesses, e.g. a bare ``assert x`` is True in every passing run)."""
        if self.op == EXPOSED:
            return False
        if self.pinned is not NOPIN and not isinstance(self.pinned, (bool, type(None))):
            return True
        lit = self.literal[0] if self.op == "approx" else self.literal
        return self.op in ("==", "approx") and not isinstance(lit, (bool, type(None)))

    def holds(self, value: Any) -> bool:
        """Whether `value` (a decoded probe value, or plain data) passes; both sides are compared in
        :func:`probe_values.canon` form (sets and dict keys as key texts), with Python's semantics."""
        try:
            value = canon(value)
            if self.pinned is not NOPIN and not _equal(value, canon(self.pinned)):
                return False
            return self.op is None or bool(_EVAL[self.op](value, canon(self.literal)))
        except Exception:  # noqa: BLE001 - e.g. '<' between a str and an int: the check fails
            return False


def is_strong(expects: Sequence[Expect]) -> bool:
    return any(e.strong for e in expects)


def _equal(a: Any, b: Any) -> bool:
    """Python ``==`` on plain data, but a bool never equals an int (``True == 1`` would let 1-bit guesses pass)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if type(a) in (list, tuple) and type(b) in (list, tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if type(a) is dict and type(b) is dict:
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


# ------------------------------------------------------------------------------------------------ the AST rewrite
def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _approx_literal(node: ast.AST) -> tuple | None:
    """(expected, rel, abs) of ``approx(LITERAL[, rel=LITERAL][, abs=LITERAL])`` / ``pytest.approx(...)``."""
    if not (isinstance(node, ast.Call) and len(node.args) == 1 and getattr(node.func, "id", None) == "approx"
            or isinstance(node, ast.Call) and len(node.args) == 1 and getattr(node.func, "attr", None) == "approx"):
        return None
    ok, expected = _literal(node.args[0])
    kw = {k.arg: _literal(k.value) for k in node.keywords}
    if not ok or set(kw) - {"rel", "abs"} or not all(good for good, _ in kw.values()):
        return None
    return expected, kw.get("rel", (0, None))[1], kw.get("abs", (0, None))[1]


def _probe_call(site: str, node: ast.expr) -> ast.Expr:
    return ast.Expr(ast.Call(ast.Name(PROBE, ast.Load()), [ast.Constant(site), node], []))


class _Rewriter(ast.NodeTransformer):
    def __init__(self, prefix: str):
        self.prefix, self.n = prefix, 0
        self.sites: dict[str, tuple[str | None, Any]] = {}

    def _site(self, op: str | None = None, literal: Any = None) -> str:
        site = f"{self.prefix}#{self.n}"
        self.n += 1
        self.sites[site] = (op, literal)
        return site

    def visit_Assert(self, node: ast.Assert) -> Any:
        t = node.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and type(t.ops[0]) in OPS:
            op, left, right = OPS[type(t.ops[0])], t.left, t.comparators[0]
            approx = _approx_literal(right) if op == "==" else None
            if approx is not None:  # `x == pytest.approx(1.5)`: the tolerance is the trusted side's
                return _probe_call(self._site("approx", approx), left)
            lit_r, val_r = _literal(right)
            lit_l, val_l = _literal(left)
            if lit_r and not lit_l:
                return _probe_call(self._site(op, val_r), left)
            if lit_l and not lit_r and op in _FLIP:
                return _probe_call(self._site(_FLIP[op], val_l), right)
            return [_probe_call(self._site(EXPOSED), left), _probe_call(self._site(EXPOSED), right)]
        if isinstance(t, ast.Compare):  # a chain: its non-literal operands are probed (pinned by the reference)
            probed = [x for x in [t.left, *t.comparators] if not _literal(x)[0]]
            op = EXPOSED if len(probed) > 1 else None
            return [_probe_call(self._site(op), x) for x in probed] or [ast.Pass()]
        return _probe_call(self._site(), t)


def _stores(scope: ast.AST) -> dict[str, int]:
    """How often each name is bound in ``scope`` and everything nested in it (assignments, loops, imports, ``del``,
    ``global``/``nonlocal``, function/class definitions, walrus, ``with ... as``, ``except ... as``)."""
    out: dict[str, int] = {}
    for n in ast.walk(scope):
        names: list[str] = []
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names = [n.id]
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            names = list(n.names) * 2  # never a constant
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [n.name]
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names = [(a.asname or a.name).split(".")[0] for a in n.names]
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names = [n.name]
        elif isinstance(n, ast.arg):
            names = [n.arg]
        for name in names:
            out[name] = out.get(name, 0) + 1
    return out


def _inline_constants(tree: ast.Module) -> None:
    """``want = 5`` (bound once, to a literal, in a function body or at module level) whose every use is an operand of
    an ``assert`` comparison: the uses become the literal and the binding is removed, so the literal is stripped from
    the child like one written in the assert (``assert add(2, 3) == want`` is ``assert add(2, 3) == 5``). A name used
    anywhere else keeps its binding (and its comparisons stay probes of both sides: :data:`EXPOSED`)."""
    stores = _stores(tree)
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]
    for scope in scopes:
        local = stores if scope is tree else _stores(scope)
        for stmt in list(scope.body):
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
                continue
            name = stmt.targets[0].id
            if not _literal(stmt.value)[0] or local.get(name) != 1:
                continue  # bound more than once in its scope (the module: anywhere in the file): not a constant
            where = scope
            uses = [n for n in ast.walk(where) if isinstance(n, ast.Name) and n.id == name
                    and isinstance(n.ctx, ast.Load)]
            operands = [(cmp, i) for a in ast.walk(where) if isinstance(a, ast.Assert)
                        and isinstance(a.test, ast.Compare) for cmp in [a.test]
                        for i, x in enumerate([cmp.left, *cmp.comparators]) if isinstance(x, ast.Name) and x.id == name]
            if not uses or len(uses) != len(operands):
                continue
            for cmp, i in operands:
                const = copy.deepcopy(stmt.value)
                if i == 0:
                    cmp.left = const
                else:
                    cmp.comparators[i - 1] = const
            scope.body.remove(stmt)
            if not scope.body:
                scope.body.append(ast.Pass())


def rewrite_asserts(source: str, prefix: str) -> tuple[str, dict[str, tuple[str | None, Any]]]:
    """(child source, site -> (op, literal) or (None, None)) for a test file: every ``assert`` becomes probes of
    its operands; a literal operand of a single comparison is stripped (kept in the returned sites), and so is a
    constant bound to a name used only in such comparisons (:func:`_inline_constants`); a comparison of two
    non-literal operands probes both with op :data:`EXPOSED` (never a strong check). ValueError if the file is not
    valid Python."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"{prefix}: not valid Python ({e.msg}, line {e.lineno})") from None
    _inline_constants(tree)
    rw = _Rewriter(prefix)
    tree = ast.fix_missing_locations(rw.visit(tree))
    return ast.unparse(tree) + "\n", rw.sites


# ------------------------------------------------------------------------------------------------ the trusted side
def read_capped(path: str, cap: int = MAX_RESULTS_BYTES) -> bytes:
    """A regular file's bytes (O_NOFOLLOW, at most `cap`); ValueError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"no probe results ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > cap:
            raise ValueError("probe results are not a regular file of bounded size")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(cap + 1)
    finally:
        os.close(fd)


def _rows(data: bytes | str) -> list:
    """The rows of the results document (a JSON list), at most :data:`MAX_RECORDS` of them: parsed one at a time,
    so a document of millions of tiny rows is refused before they are all built. JSON numbers are refused."""
    try:
        text = data.decode() if isinstance(data, bytes) else data
        i = _WS.match(text, 0).end()
        if text[i:i + 1] != "[":
            raise ValueError("probe results are not a list")
        rows, i = [], _WS.match(text, i + 1).end()
        while text[i:i + 1] != "]":
            if rows:
                if text[i:i + 1] != ",":
                    raise ValueError("probe results are not valid JSON")
                i = _WS.match(text, i + 1).end()
            row, i = _ROW.raw_decode(text, i)
            rows.append(row)
            if len(rows) > MAX_RECORDS:
                raise ValueError(f"more than {MAX_RECORDS} probe records")
            i = _WS.match(text, i).end()
        if _WS.match(text, i + 1).end() != len(text):
            raise ValueError("probe results are not valid JSON")
        return rows
    except RecursionError:
        raise ValueError("probe results are not valid JSON (nested too deep)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"probe results are not valid JSON ({str(e)[:80]})") from None


def parse_records(data: bytes | str, expected: Mapping[str, Sequence[Expect]], sites: Collection[str] = ()
                  ) -> dict[str, list[tuple[str, str, Any]]]:
    """test id -> [(site, kind, value)] from the child's JSON records. Only the values the trusted side looks at are
    decoded (``probe_values.decode``: linear, bounded by :data:`MAX_ELEMENTS` for the whole report): a record at
    position i of a test of `expected` whose site is that test's i-th expected site, or any record of a site in
    `sites` (a reference run, whose expected values are not known yet). Any other value record keeps kind "x" and
    is never decoded: the judge fails its test (a site or a count it did not expect), as it always has. A value
    that does not decode becomes "u" ("unparsable value"); "u" records keep the child's text. ValueError for a
    malformed document, more than :data:`MAX_RECORDS` records, or more than :data:`MAX_RECORDS_PER_SITE` of one
    site."""
    rows = _rows(data)
    out: dict[str, list[tuple[str, str, Any]]] = {}
    per_site: dict[str, int] = {}
    budget = Budget(MAX_ELEMENTS)
    for row in rows:
        if not (isinstance(row, list) and len(row) == 4 and all(type(x) is str for x in row)):
            raise ValueError("malformed probe record")
        test, site, kind, text = row
        per_site[site] = per_site.get(site, 0) + 1
        if per_site[site] > MAX_RECORDS_PER_SITE:
            raise ValueError(f"more than {MAX_RECORDS_PER_SITE} probe records of site {site[:80]!r}")
        got = out.setdefault(test, [])
        want = expected.get(test, ())
        value: Any = text
        if kind == "v" and not (len(got) < len(want) and want[len(got)].site == site or site in sites):
            kind, value = "x", "value not read (a probe the verifier did not expect here)"
        elif kind == "v":
            try:
                if len(text) > MAX_VALUE_CHARS:
                    raise ValueError("too large")
                value = decode(text, budget)
            except ValueError:
                kind, value = "u", "unparsable value"
        got.append((site, kind, value))
    return out


def judge(records: Mapping[str, list[tuple[str, str, Any]]], expected: Mapping[str, Sequence[Expect]]
          ) -> tuple[list[str], list[str]]:
    """(tests whose probes all hold, failures "test: why") for every test of `expected`: the test's records must be
    exactly its expected probes, in order, each value holding."""
    passed, bad = [], []
    for test, want in expected.items():
        got = records.get(test, [])
        why = None
        if len(got) != len(want):
            why = f"{len(got)} probes reported, {len(want)} expected"
        for (site, kind, value), e in zip(got, want):
            if why:
                break
            if site != e.site:
                why = f"probe {site} reported where {e.site} was expected"
            elif kind != "v" and not e.any_kind:
                why = f"{site}: not plain data ({str(value)[:60]})"
            elif kind == "v" and not e.holds(value):
                why = f"{site}: wrong value"
        (bad.append(f"{test}: {why}") if why else passed.append(test))
    return passed, bad


def expectations_from_reference(runs: Sequence[Mapping[str, list[tuple[str, str, Any]]]],
                                 sites: Mapping[str, tuple[str | None, Any]]) -> dict[str, tuple[Expect, ...]]:
    """Expected probes from the reference solution's runs (two or more, to spot values that differ between runs:
    those are checked only for their literal comparison, if any; values that are not plain data only for being
reported). ValueError if the runs disagree on which probes
    fire or the reference itself reports something that is not plain data or fails a literal comparison."""
    first, rest = runs[0], runs[1:]
    out: dict[str, tuple[Expect, ...]] = {}
    for test, recs in first.items():
        exp = []
        for i, (site, kind, value) in enumerate(recs):
            others = [r.get(test, []) for r in rest]
            if any(len(o) != len(recs) or o[i][0] != site for o in others):
                raise ValueError(f"{test}: the reference solution's probes differ between runs")
            if site not in sites:
                raise ValueError(f"{test}: unknown probe site {site}")
            op, literal = sites[site]
            if kind != "v":  # not plain data (an object): only that the probe fires is checked
                exp.append(Expect(site, any_kind=True))
                continue
            stable = all(o[i][1] == "v" and _equal(o[i][2], value) for o in others)
            e = Expect(site, value if stable else NOPIN, op, literal)
            if op is not None and not e.holds(value):
                raise ValueError(f"{test}: the reference solution fails {site}")
            exp.append(e)
        out[test] = tuple(exp)
    return out
