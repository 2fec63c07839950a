"""What the learner may assume about a verifier's rewards (``RewardSpec``), and a contradiction between the two."""

from __future__ import annotations

import math

from megatron_tsync.config.plain import _foreign

__all__ = ["reward_spec_for_verifier", "declared_reward_spec", "reward_spec_conflict"]


def reward_spec_for_verifier(name: str):
    """What the learner may assume about a verifier's rewards (``algorithms.streamability.RewardSpec``).

    Read from the verifier's declared ``reward_range`` and ``binary`` in ``rollout.verifiers``'s registry (without
    instantiating it); a name that registry does not know (a plugin, or a verifier registered later) gets the
    default, binary rewards in {0, 1} — ``RewardSpec.check`` then fails loudly on the first reward outside it.
    """
    declared = declared_reward_spec(name)
    return declared if declared is not None else _foreign("RewardSpec").binary(0.0, 1.0)


def declared_reward_spec(name: str):
    """The ``RewardSpec`` a registered verifier declares (``reward_range``, ``binary``), or None when ``name`` is not
    in ``rollout.verifiers``'s registry (nothing is declared: the flags, or the default, stand alone)."""
    RewardSpec = _foreign("RewardSpec")
    try:
        from megatron_tsync.rollout import verifiers

        factory = verifiers._REGISTRY.get(name)
    except ImportError:
        factory = None
    if factory is None:
        return None
    lo, hi = getattr(factory, "reward_range", (0.0, 1.0))
    if getattr(factory, "binary", False):
        return RewardSpec.binary(float(lo), float(hi))
    if math.isfinite(lo) and math.isfinite(hi):
        return RewardSpec.bounded(float(lo), float(hi))
    return RewardSpec.continuous()


def _spec_text(spec) -> str:
    return {"binary": f"binary {{{spec.lo:g}, {spec.hi:g}}}", "bounded": f"bounded [{spec.lo:g}, {spec.hi:g}]",
            "continuous": "continuous (unbounded)"}[spec.kind]


def reward_spec_conflict(spec, declared, source: str) -> str | None:
    """Why ``spec`` (what the learner is told: ``learner.reward_spec``) contradicts ``declared`` (what ``source``, a
    verifier or task, says its rewards are), or None when it does not.

    ``spec`` may only assume less than the declaration: every reward ``declared`` allows must be possible under
    ``spec`` (binary {lo, hi} ⊆ bounded [a, b] ⊆ continuous). Assuming more (a narrower range, binary for a bounded
    verifier, bounds for an unbounded one) would let the exact clip rule stream on a sign that a legal reward could
    still flip, so it is refused here rather than at the first reward ``RewardSpec.check`` rejects mid-run.
    """
    if spec.kind == "continuous":
        return None
    if spec.kind == "bounded" and declared.kind != "continuous" and spec.lo <= declared.lo and declared.hi <= spec.hi:
        return None
    if spec.kind == "binary" and declared.kind == "binary" and (spec.lo, spec.hi) == (declared.lo, declared.hi):
        return None
    return (f"learner.reward_spec {_spec_text(spec)} contradicts {source}, which declares {_spec_text(declared)} "
            f"rewards: the learner may assume less than the declaration, never more (use its range, a wider bounded "
            f"range, or continuous)")
