"""Learning-signal health: a step that cannot move the policy is named, in every mode and algorithm.

A step has **no learning signal** when

- GRPO (every group-relative estimator: grpo, grpo_unbiased, dr_grpo, rloo): no group has a trajectory with action
  tokens whose reward differs from its group's mean (every group zero-variance, or every trajectory that varies
  failed / was rejected: a failed trajectory counts in its group with the task's lowest reward and no gradient);
- OPD: no trajectory has an action token to distil on (every one failed or was rejected);
- either: the learner's grad-norm is exactly 0.

Computed from the step's samples (the same on every trainer rank: they are broadcast) and the learner's global
grad-norm, so every rank takes the same decision. Per step the row gets ``failed`` (failed trajectories of the
step, harness episodes, verifier errors and trajectories rejected at the learner's edge alike), ``signal_groups``
(GRPO) and ``no_signal`` (0/1); the progress line says ``NO SIGNAL (why)``. After ``WARN_AFTER`` such steps in a row
(or ``--stop-on-no-signal K``, when smaller) the run warns once with the causes it can see: failures by kind with
one example each, the rewards seen, the grad-norm. ``--stop-on-no-signal K`` stops the run after K steps in a row
without signal instead (:class:`NoLearningSignal`: one line, exit status 1, no stop record — a scheduler does not
requeue it). The end-of-run summary counts the steps without signal and the failures by kind.
"""

from __future__ import annotations

import collections
import dataclasses

__all__ = ["HEALTH_TB_NAMES", "WARN_AFTER", "NoLearningSignal", "SignalHealth", "fail_kind", "step_signal"]

HEALTH_TB_NAMES = {"failed": "rollout/failed", "signal_groups": "health/signal_groups",
                   "no_signal": "health/no_signal"}
"""TensorBoard tags of :func:`step_signal`'s keys."""
WARN_AFTER = 5
"""Steps without signal in a row before the one warning (``--stop-on-no-signal K`` lowers it to K)."""
FAIL_KEY = "fail_kind"
"""``Sample.meta`` key the trainer's fleet sets on a failed trajectory (``runtime/fleet.py``); ``fail_detail``: its
error text (first 200 characters)."""


class NoLearningSignal(RuntimeError):
    """``--stop-on-no-signal K``: K steps in a row had no learning signal."""


def fail_kind(error: str, harness_reason: str | None = None) -> str:
    """The kind of a failed trajectory from its error text: the harness's reason when it names one, else
    ``rejected`` (at the learner's edge), ``verifier_error`` or ``rollout_error``."""
    if harness_reason:
        return str(harness_reason)
    if error.startswith("rejected at the learner's edge"):
        return "rejected"
    if error.startswith("verifier"):
        return "verifier_error"
    return "rollout_error"


def _trainable(s) -> bool:
    return float(s.loss_mask[1:].sum()) > 0


def step_signal(samples, grad_norm: float | None, algorithm: str) -> tuple[dict, str]:
    """(row entries, why the step has no signal or ""). ``algorithm``: "grpo" or "opd"."""
    failed = sum(1 for s in samples if FAIL_KEY in s.meta)
    row: dict = {"failed": failed}
    why = []
    if algorithm == "grpo":
        groups: dict[str, list] = collections.defaultdict(list)
        for s in samples:
            groups[s.group_id].append(s)
        signal = 0
        for members in groups.values():
            mean = sum(s.reward for s in members) / len(members)
            signal += any(_trainable(s) and s.reward != mean for s in members)
        row["signal_groups"] = signal
        if samples and not signal:
            ok = [s for s in samples if _trainable(s)]
            why.append("every trajectory failed or was rejected" if not ok else
                       f"every group has zero reward variance (reward {_rewards(ok)})")
    elif samples and not any(_trainable(s) for s in samples):
        why.append("every trajectory failed or was rejected")
    if grad_norm is not None and grad_norm == 0.0:
        why.append("grad-norm 0")
    row["no_signal"] = int(bool(why))
    return row, "; ".join(why)


def _rewards(samples, top: int = 4) -> str:
    """The rewards seen, most frequent first: ``0 ×60, 1 ×4``."""
    c = collections.Counter(round(float(s.reward), 6) for s in samples)
    parts = [f"{r:g} ×{n}" for r, n in c.most_common(top)]
    if len(c) > top:
        parts.append(f"{len(c) - top} other values")
    return ", ".join(parts) or "none"


@dataclasses.dataclass
class SignalHealth:
    """The run's watch over its steps' learning signal (one per run, every trainer rank)."""

    algorithm: str
    stop_after: int = 0  # --stop-on-no-signal K (0: never stop)
    streak: int = 0
    warned: bool = False
    stop: str = ""  # why the run must stop now (--stop-on-no-signal reached), else ""
    steps: int = 0
    no_signal_steps: int = 0
    trajectories: int = 0
    fails: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    examples: dict = dataclasses.field(default_factory=dict)  # kind -> first error text
    streak_fails: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    streak_samples: list = dataclasses.field(default_factory=list)  # (reward, trainable) of the streak, capped

    @property
    def warn_after(self) -> int:
        return min(WARN_AFTER, self.stop_after) if self.stop_after else WARN_AFTER

    def observe(self, k: int, samples, grad_norm: float | None) -> tuple[dict, str, str | None]:
        """Step ``k`` (as the progress line counts: steps done): (its row entries, why it has no signal or "", the one-time warning when it is due or None).
        At ``--stop-on-no-signal`` it sets :attr:`stop` (the loop raises :class:`NoLearningSignal` after logging the
        step)."""
        row, why = step_signal(samples, grad_norm, self.algorithm)
        self.steps += 1
        self.trajectories += len(samples)
        kinds = collections.Counter(s.meta[FAIL_KEY] for s in samples if FAIL_KEY in s.meta)
        self.fails.update(kinds)
        for s in samples:
            if FAIL_KEY in s.meta:
                self.examples.setdefault(s.meta[FAIL_KEY], str(s.meta.get("fail_detail", ""))[:200])
        if not why:
            self.streak, self.streak_fails, self.streak_samples = 0, collections.Counter(), []
            return row, "", None
        self.no_signal_steps += 1
        self.streak += 1
        self.streak_fails.update(kinds)
        self.streak_samples += [s for s in samples if FAIL_KEY not in s.meta][: max(0, 4096 - len(self.streak_samples))]
        warning = None
        if self.stop_after and self.streak >= self.stop_after:
            self.stop = (f"--stop-on-no-signal {self.stop_after}: no learning signal in the last {self.streak} "
                         f"steps (up to step {k}): {self.causes(why)}")
        elif not self.warned and self.streak >= self.warn_after:
            self.warned = True
            warning = (f"[tsync] WARNING: no learning signal in {self.streak} steps in a row (up to step {k}); the run "
                       f"cannot learn like this (--stop-on-no-signal K stops it). Causes seen: {self.causes(why)}")
        return row, why, warning

    def causes(self, why: str) -> str:
        parts = [why]
        n = sum(self.streak_fails.values())
        if n:
            kinds = ", ".join(f"{kind} {c}" for kind, c in self.streak_fails.most_common())
            parts.append(f"{n} failed trajectories ({kinds}; e.g. " + "; ".join(
                f"{kind}: {self.examples.get(kind, '')!r}" for kind, _ in self.streak_fails.most_common(2)) + ")")
        if self.streak_samples:
            parts.append(f"rewards of the trajectories that did not fail: {_rewards(self.streak_samples)}")
        return "; ".join(parts)

    def line(self, row: dict) -> str:
        """What the progress line adds for a step without signal."""
        return f" NO SIGNAL ({row.get('no_signal_why', '')})" if row.get("no_signal") else ""

    def summary(self, rejected: int | None = None) -> str:
        """The end-of-run summary's part: steps without signal, failures by kind, and (``rejected``) the run's events
        rejected by the transport."""
        kinds = ", ".join(f"{kind} {c}" for kind, c in self.fails.most_common())
        failed = sum(self.fails.values())
        return (f"no learning signal in {self.no_signal_steps}/{self.steps} steps, failed trajectories "
                f"{failed}/{self.trajectories}" + (f" ({kinds})" if kinds else "")
                + (f", events rejected {rejected}" if rejected is not None else ""))
