"""megatron's checkpoint-writer helper process, shielded from the job-wide signals (see
``checkpointing.shield_checkpoint_writer``).

The helper is started at the first save, which may be the save a SIGTERM asked for, while SLURM is still signalling
every process of the job step (a time limit signals once, then ``srun`` forces the step's termination and it is
signalled again; seen in ``tests/slurm/test_stop_requeue.py``). A helper that installed its handlers as its first
Python code could be killed before that, and the save failed (EOFError while the manager started). So the signals
are *blocked* in the thread that starts it: a spawned process inherits that mask through fork and exec, and starts
with them blocked; its initializer ignores them and unblocks. In the trainer nothing is lost: a signal that arrives
meanwhile either stays pending in this thread until the mask is restored or, when the process has other threads
(heartbeats, zmq, torch's), is taken by one of them, and Python runs the handler in the main thread as usual.

A module of its own, with nothing but the standard library: the helper is a *spawned* process, which imports the
module of its initializer to unpickle it; from ``checkpointing`` it imported torch and megatron-core to run this.
"""

from __future__ import annotations

import signal
import sys

SHIELDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def shield_writer_process() -> None:
    """The helper's initializer: ignore the job-wide signals (the trainer decides when to stop, and it is saving),
    then unblock them (pending ones are discarded), and die with the trainer (``PR_SET_PDEATHSIG``, Linux)."""
    for s in SHIELDED_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SHIELDED_SIGNALS)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def start_shielded(manager) -> None:
    """``manager.start(initializer=shield_writer_process)`` with the shielded signals blocked in this thread until
    the helper has started (it answers with its address only after its initializer ran)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED_SIGNALS)
    try:
        manager.start(initializer=shield_writer_process)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
