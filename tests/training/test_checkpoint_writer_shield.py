"""megatron-core's checkpoint-writer helper (the ``multiprocessing`` manager its torch_dist save collects results
through) survives a job-wide SIGTERM / SIGUSR1 / SIGINT once ``checkpointing.shield_checkpoint_writer`` started it,
and still works; control: the manager megatron would start itself dies of the same SIGTERM (the BrokenPipeError of
a save on SLURM's time-out). The live path (a save after killpg(SIGTERM)) is in tests/runtime/test_stop.py."""

import os
import signal
import time

import pytest
from torch import multiprocessing as mp

from megatron_tsync.training import checkpointing as ck

from tests.runtime.test_supervision import _alive  # alive and not a zombie, from /proc


def test_shielded_writer_manager_survives_job_signals():
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    assert ck.shield_checkpoint_writer()
    q = fa._get_write_results_queue()  # what megatron's save uses: ours
    pid = ck._writer_manager._process.pid
    assert q is fa._results_queue and ck.shield_checkpoint_writer()  # idempotent: the same manager
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        os.kill(pid, s)
    time.sleep(0.5)
    assert ck._writer_manager._process.is_alive()
    q.put({"ok": 1})
    assert q.get(timeout=10) == {"ok": 1}


def test_control_unshielded_manager_dies_of_sigterm():
    m = mp.get_context("spawn").Manager()
    q = m.Queue()
    m._process.terminate()  # SIGTERM, as SLURM sends it to every process of the job
    m._process.join(timeout=10)
    assert m._process.exitcode == -signal.SIGTERM
    try:
        q.put(1)
        raise AssertionError("the queue still worked")
    except (BrokenPipeError, ConnectionError, EOFError, OSError):
        pass


@pytest.mark.slow  # a leak check (a trainer process and its manager); the shield's own checks stay fast
def test_shielded_writer_manager_dies_with_the_trainer():
    """``PR_SET_PDEATHSIG``: the helper does not outlive a trainer that is SIGKILLed (it ignores SIGTERM now)."""
    import subprocess
    import sys

    code = ("import time; from megatron_tsync.training import checkpointing as ck; ck.shield_checkpoint_writer(); "
            "print(ck._writer_manager._process.pid, flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(p.stdout.readline())
        assert _alive(pid)
        p.kill()
        p.wait()
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)
    finally:
        if p.poll() is None:
            p.kill()
