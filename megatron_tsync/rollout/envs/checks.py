"""Hidden checks with known expected values, rendered as pytest files with decoys (see ``envs/verifier.py``).

A :class:`Check` is ``assert EXPR == EXPECTED`` in one test file (``preamble`` holds its imports and helpers).
:func:`render_checks` writes, for one verification run, every real check and for each one a decoy (the same EXPR
with a wrong expected value, :func:`perturb`), all under random names in random order, and returns which node ids
must pass and which must fail. A solution that forces tests to pass also passes the decoys; one that fails
everything fails the real ones: the verdict needs the real values, computed by the code under test.
Standard library only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["Check", "perturb", "render_checks"]


@dataclass(frozen=True)
class Check:
    file: str
    """Test file path (relative to the repository root), e.g. ``tests/test_core.py``."""
    expr: str
    """A Python expression evaluated inside the test."""
    expected: Any
    """Its correct value (a literal: int, float, str, bool, None, list, tuple, dict)."""
    kind: str = "FAIL_TO_PASS"
    """"FAIL_TO_PASS" or "PASS_TO_PASS" (reporting only: both must pass)."""
    avoid: tuple = ()
    """Values a decoy must not expect (e.g. what the buggy code returns), besides ``expected``."""


def perturb(value: Any, rng: random.Random, avoid: Sequence[Any] = ()) -> Any:
    """A value of the same kind that differs from `value` and, where the kind allows (not for a bool whose buggy
    value is the other bool), from everything in `avoid`."""
    for bad in ([value, *avoid], [value]):
        for attempt in range(50):
            cand = _perturb_once(value, rng, attempt)
            if all(type(cand) is not type(b) or cand != b for b in bad):
                return cand
    raise ValueError(f"cannot perturb {value!r}")


def _perturb_once(v: Any, rng: random.Random, k: int) -> Any:
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + rng.choice([-3, -2, -1, 1, 2, 3]) * (1 + k)
    if isinstance(v, float):
        return round(v + rng.choice([-1.5, -0.5, 0.5, 1.5]) * (1 + k), 2)
    if isinstance(v, str):
        return v + rng.choice("xyzq") * (1 + k) if k % 2 == 0 or not v else v[:-1]
    if isinstance(v, list):
        return v + [_perturb_once(v[-1] if v else 0, rng, k)] if k % 2 == 0 or not v else v[:-1]
    if isinstance(v, tuple):
        return tuple(_perturb_once(list(v), rng, k))
    if isinstance(v, dict):
        out = dict(v)
        out[f"_decoy{k}"] = k
        return out
    if v is None:
        return 0
    raise TypeError(f"no perturbation for {type(v).__name__}")


def render_checks(checks: Sequence[Check], preambles: dict[str, str], rng: random.Random
                  ) -> tuple[dict[str, str], list[str], list[str]]:
    """Test files + (must-pass node ids, must-fail node ids) for one verification run (see the module docstring)."""
    per_file: dict[str, list[tuple[str, str, bool]]] = {}
    must_pass, must_fail = [], []
    used: set[str] = set()

    def name() -> str:
        while True:
            n = f"test_{rng.getrandbits(48):012x}"
            if n not in used:
                used.add(n)
                return n

    for c in checks:
        decoy = perturb(c.expected, rng, c.avoid)
        for value, real in ((c.expected, True), (decoy, False)):
            n = name()
            per_file.setdefault(c.file, []).append((n, f"def {n}():\n    assert ({c.expr}) == {value!r}\n", real))
            (must_pass if real else must_fail).append(f"{c.file}::{n}")
    files = {}
    for path, tests in per_file.items():
        rng.shuffle(tests)
        files[path] = preambles.get(path, "") + "\n\n" + "\n\n".join(src for _, src, _ in tests)
    return files, must_pass, must_fail
