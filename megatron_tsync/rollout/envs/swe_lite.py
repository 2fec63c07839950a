"""swe-lite: procedurally generated Python repositories with one injected bug, an issue, and hidden tests.

Task ``i`` of seed ``s`` is a pure function of ``(s, i)`` (no downloads, no clock)::

    <pkg>/__init__.py, <pkg>/<module>.py ...    4 functions from the template library (``swe_lite_templates``),
                                                renamed, spread over 2-3 modules; one carries an injected bug
    tests/test_<module>.py                      the repository's existing tests (pass-to-pass cases only)
    README.md
    issue: "`pkg.mod.fn(args)` returns X, but it should return Y" + the symptom

Hidden tests (never in the workspace): FAIL_TO_PASS checks of the buggy function on inputs where the bug shows
(at least 3, the issue's example and others) and PASS_TO_PASS checks of every function (at least one of the buggy
function, and its checks expect at least two different values: neither a constant answer nor, for a bool result,
the buggy answer negated passes them all); expected values are computed
by running the correct source in the generator. The verifier restores ``tests/`` from the task, renders every check
as a probe that reports its value (``envs/checks.py``), runs them on the final workspace and compares the values
outside the sandbox (``envs/probes.py``). The known fix is one ``edit`` (the injected
string replacement reversed) and ``submit``. Standard library only.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

from megatron_tsync.rollout.envs.base import register_environment
from megatron_tsync.rollout.envs.checks import Check
from megatron_tsync.rollout.envs.swe_lite_templates import TEMPLATES, Template
from megatron_tsync.rollout.envs.workspace_env import WorkspaceEnv, WorkspaceTask

__all__ = ["generate_task", "generate_tasks", "SweLiteEnv"]

PACKAGES = ("ledger", "textkit", "numkit", "shelf", "pantry", "atlas", "quill", "abacus", "tally", "sprocket",
            "harbor", "orchard", "beacon", "compass", "lantern", "meadow")
MODULES = ("core", "utils", "helpers", "ops", "text", "numbers", "tools", "calc", "convert", "series")
MIN_FAIL_TO_PASS = 3


def _mix(*parts: int) -> int:
    return zlib.crc32(repr(parts).encode()) * 2654435761 % (1 << 61)


def _call(args: tuple) -> str:
    return ", ".join(repr(a) for a in args)


def _run(ns: dict, fn: str, args: tuple) -> tuple[bool, Any]:
    try:
        return True, ns[fn](*[_copy(a) for a in args])
    except Exception as e:  # the buggy version may raise
        return False, type(e).__name__


def _constant(fails, passes) -> bool:
    """Whether every check of the buggy function expects the same value (then returning it scores)."""
    return len({(type(w).__name__, repr(w)) for w in [f[1] for f in fails] + [p[1] for p in passes]}) < 2


def _copy(v):
    import copy

    return copy.deepcopy(v)


def _layout(rng: random.Random) -> tuple[str, list[tuple[Template, str, str]]]:
    pkg = rng.choice(PACKAGES)
    templates = rng.sample(TEMPLATES, 4)
    mods = rng.sample(MODULES, rng.randint(2, 3))
    placed = []
    for i, t in enumerate(templates):
        mod = mods[i % len(mods)] if i < len(mods) else rng.choice(mods)
        placed.append((t, rng.choice(t.names), mod))
    return pkg, placed


def _module_sources(pkg: str, placed) -> dict[str, str]:
    by_mod: dict[str, list[str]] = {}
    for t, fn, mod in placed:
        by_mod.setdefault(mod, []).append(t.source.format(fn=fn))
    return {mod: f'"""{pkg}.{mod}: small helpers."""\n\n\n' + "\n\n".join(srcs) for mod, srcs in by_mod.items()}


def _cases(rng: random.Random, t: Template, fn: str, good: dict, bad: dict | None, n_pass: int):
    """(failing inputs with (expected, buggy), passing inputs with expected) for one function."""
    fails, passes, seen = [], [], set()
    for _ in range(400):
        args = t.inputs(rng)
        key = repr(args)
        if key in seen:
            continue
        seen.add(key)
        ok, want = _run(good, fn, args)
        if not ok:
            continue
        got = _run(bad, fn, args) if bad is not None else (True, want)
        same = got[0] and type(got[1]) is type(want) and got[1] == want
        if same and len(passes) < n_pass:
            passes.append((args, want))
        elif not same and len(fails) < MIN_FAIL_TO_PASS + 1:
            fails.append((args, want, got))
        if len(passes) >= n_pass and (bad is None or len(fails) > MIN_FAIL_TO_PASS):
            break
    return fails, passes


def generate_task(seed: int, index: int) -> WorkspaceTask:
    """Task ``index`` of suite ``seed`` (see the module docstring)."""
    for attempt in range(20):
        rng = random.Random(_mix(seed, index, attempt))
        task = _try_generate(rng, seed, index)
        if task is not None:
            return task
    raise RuntimeError(f"swe-lite: no valid task for seed {seed} index {index}")  # pragma: no cover


def _try_generate(rng: random.Random, seed: int, index: int) -> WorkspaceTask | None:
    pkg, placed = _layout(rng)
    sources = _module_sources(pkg, placed)
    bug_t, bug_fn, bug_mod = placed[0]
    desc, old, new = rng.choice(bug_t.mutations)
    good_src = sources[bug_mod]
    if good_src.count(old) != 1:
        return None
    buggy_src = good_src.replace(old, new, 1)
    if buggy_src.count(new) != 1:
        return None
    checks, visible = [], {}
    for t, fn, mod in placed:
        good: dict = {}
        exec(compile(sources[mod], f"{pkg}/{mod}.py", "exec"), good)  # our own template source
        bad = None
        if fn == bug_fn:
            bad = {}
            exec(compile(buggy_src, f"{pkg}/{mod}.py", "exec"), bad)
        fails, passes = _cases(rng, t, fn, good, bad, n_pass=2)
        if bad is not None and (len(fails) < MIN_FAIL_TO_PASS or not passes or _constant(fails, passes)):
            return None  # a constant answer, or (bool results) the buggy answer negated, must fail some check
        test_file = f"tests/test_{mod}.py"
        for args, want, got in fails:
            checks.append(Check(test_file, f"{fn}({_call(args)})", want, "FAIL_TO_PASS",
                                avoid=(got[1],) if got[0] else ()))
        for args, want in passes:
            checks.append(Check(test_file, f"{fn}({_call(args)})", want, "PASS_TO_PASS"))
            visible.setdefault(test_file, []).append(
                f"def test_{fn}_{len(visible.get(test_file, []))}():\n    assert {fn}({_call(args)}) == {want!r}\n")
        if fn == bug_fn:
            issue_args, issue_want, issue_got = fails[0]
    fns_of = {}
    for _, fn, mod in placed:
        fns_of.setdefault(mod, []).append(fn)
    preambles = {f"tests/test_{mod}.py": f"from {pkg}.{mod} import {', '.join(sorted(fns))}\n"
                 for mod, fns in fns_of.items()}
    files = {f"{pkg}/__init__.py": f'"""{pkg}: a small utility package."""\n',
             "README.md": f"# {pkg}\n\nUtility functions. Run the tests with `python -m pytest tests`.\n"}
    for mod, src in sources.items():
        files[f"{pkg}/{mod}.py"] = buggy_src if mod == bug_mod else src
    for path, tests in visible.items():
        files[path] = preambles[path] + "\n\n" + "\n\n".join(tests)
    got_text = f"returns `{issue_got[1]!r}`" if issue_got[0] else f"raises `{issue_got[1]}`"
    issue = (f"## `{bug_fn}` is wrong: {desc}\n\n`{pkg}.{bug_mod}.{bug_fn}({_call(issue_args)})` {got_text}, but "
             f"it should return `{issue_want!r}`.\n\nPlease fix `{bug_fn}` in `{pkg}/{bug_mod}.py` without "
             "breaking the other functions.")
    return WorkspaceTask(
        task_id=f"swe-lite-{seed}-{index}", instruction=issue, files=files, checks=tuple(checks),
        preambles=preambles, protected=("tests",),
        solution=(("edit", {"path": f"{pkg}/{bug_mod}.py", "old_str": new, "new_str": old}), ("submit", {})),
        meta={"suite": "swe-lite", "seed": seed, "index": index, "template": bug_t.key, "bug": desc,
              "fail_to_pass": sum(c.kind == "FAIL_TO_PASS" for c in checks),
              "pass_to_pass": sum(c.kind == "PASS_TO_PASS" for c in checks)})


def generate_tasks(seed: int, n: int, start: int = 0) -> list[WorkspaceTask]:
    return [generate_task(seed, i) for i in range(start, start + n)]


class SweLiteEnv(WorkspaceEnv):
    name = "swe-lite"


@register_environment("swe-lite")
def _make(**kwargs) -> SweLiteEnv:
    return SweLiteEnv(**kwargs)
