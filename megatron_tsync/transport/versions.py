"""The accepted-version window: which policy versions the learner takes events of, and which weights a worker may
roll a step out with — one rule for both sides.

With ``max_staleness`` K the window of version ``v`` is ``[max(0, v − K), v]``: K = 0 (sync and every streaming
mode) accepts exactly ``v`` — zero staleness, checked on every frame — and K > 0 (``--rl-mode async``) lets a
trajectory lag the learner by up to K optimizer steps.

The learner's :class:`VersionWindow` moves forward when the learner publishes the weights of a version and when it
begins the step of a version (the same number in every mode today); its receiver asks :meth:`VersionWindow.accepted`
for every frame (``EventReceiver(expected_version_fn=window.accepted)``), so frames of any other version are rejected
(and counted) before their payload is parsed. A worker builds the window of the step it is about to roll out and
waits for weights of at least :attr:`VersionWindow.oldest`.
"""

from __future__ import annotations

__all__ = ["VersionWindow"]


class VersionWindow:
    """``[max(0, version − max_staleness), version]``, moved forward by :meth:`advance`."""

    def __init__(self, version: int, max_staleness: int = 0):
        if version < 0 or max_staleness < 0:
            raise ValueError(f"version and max_staleness must be >= 0, got {version}, {max_staleness}")
        self.version = version
        self.max_staleness = max_staleness

    @property
    def oldest(self) -> int:
        """The oldest accepted version."""
        return max(0, self.version - self.max_staleness)

    def advance(self, version: int) -> None:
        """Make ``version`` the newest accepted one. Versions never go back: that would be a learner bug."""
        if version < self.version:
            raise ValueError(f"version window cannot move back from v{self.version} to v{version}")
        self.version = version

    def accepted(self) -> int | range:
        """What the receiver checks a frame's version against: the version itself (K = 0) or the window's range."""
        return self.version if self.max_staleness == 0 else range(self.oldest, self.version + 1)

    def __contains__(self, version: object) -> bool:
        return isinstance(version, int) and self.oldest <= version <= self.version

    def __repr__(self) -> str:
        return f"VersionWindow(v{self.oldest}..v{self.version})"
