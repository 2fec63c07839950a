"""model/parallel.py: the process group's teardown at interpreter exit."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# the atexit handler registered first runs last (LIFO): it sees the state after initialize_parallel's teardown
_SCRIPT = textwrap.dedent("""
    import atexit
    import torch.distributed as dist
    atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
    import torch
    from megatron_tsync.model.parallel import initialize_parallel
    initialize_parallel(1, 1)
    initialize_parallel(1, 1)  # idempotent: one handler, not two
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.barrier()
    print("sum", t.sum().item(), flush=True)
""")


@pytest.mark.slow
def test_a_process_that_never_destroys_its_group_is_torn_down_at_exit():
    """A script that initialises parallel state, runs gloo collectives and exits without destroy_parallel leaves
    with 0 and without a process group at finalisation (an undestroyed gloo group can abort at exit, rc -6)."""
    p = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "sum 3.0" in p.stdout
    assert "initialized at exit: False" in p.stdout, p.stdout
    assert "terminate called" not in p.stderr
