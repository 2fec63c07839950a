"""Hidden checks with known expected values, rendered as probe files for the split verifier (``envs/probes.py``).

A :class:`Check` is ``assert EXPR == EXPECTED`` in one test file (``preamble`` holds its imports and helpers).
:func:`render_checks` writes one test per check whose body only *reports* ``EXPR``'s value
(``__tsync_probe__(site, EXPR)``); the expected values never appear in the files the untrusted child gets: they are
returned as the trusted side's :class:`~megatron_tsync.rollout.envs.probes.Expect` s. To score, a solution must make
``EXPR`` evaluate to the right values, i.e. compute them. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from megatron_tsync.rollout.envs.probes import PROBE, Expect

__all__ = ["Check", "render_checks"]


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
    """Values the buggy code gives (reporting only)."""


def render_checks(checks: Sequence[Check], preambles: dict[str, str]
                  ) -> tuple[dict[str, str], dict[str, tuple[Expect, ...]]]:
    """(child test files, test id -> expected probe) for `checks` (see the module docstring)."""
    per_file: dict[str, list[str]] = {}
    expected: dict[str, tuple[Expect, ...]] = {}
    for i, c in enumerate(checks):
        name, site = f"test_check_{i}", f"c{i}"
        per_file.setdefault(c.file, []).append(f"def {name}():\n    {PROBE}({site!r}, ({c.expr}))\n")
        expected[f"{c.file}::{name}"] = (Expect(site, pinned=c.expected),)
    files = {path: preambles.get(path, "") + "\n\n" + "\n\n".join(tests) for path, tests in per_file.items()}
    return files, expected
