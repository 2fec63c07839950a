"""The first thing megatron's checkpoint-writer helper process runs (see ``checkpointing.shield_checkpoint_writer``).

A module of its own, with nothing but the standard library: that helper is a *spawned* process, which imports the
module of its initializer to unpickle it; from ``checkpointing`` it imported torch and megatron-core (2–3 CPU-s per
trainer start) to run six lines.
"""

from __future__ import annotations

import signal
import sys

SHIELDED_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


def shield_writer_process() -> None:
    """Ignore the job-wide signals (the trainer decides when to stop, and it is saving) and die with the trainer
    (``PR_SET_PDEATHSIG``, Linux)."""
    for name in SHIELDED_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
