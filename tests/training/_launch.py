"""Run a worker script under torchrun with N gloo processes; used by the multi-process tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def torchrun(script: str, args: list[str], *, nproc: int = 2, timeout: int = 900, out_json: str | None = None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    # --standalone: torchrun's agent binds its rendezvous store on port 0 and the ranks use that store; a port
    # picked here beforehand could be taken before the agent binds it (EADDRINUSE, seen under three xdist workers)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", script, *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    if out_json:
        with open(out_json) as f:
            return json.load(f)
    return p


def selected_params(request, key) -> list:
    """key(item) for every test of the requesting module that this session will run (after -m / -k / node-id
    selection), None results dropped, first-seen order, no repeats: what a module-scoped fixture must launch so
    that one torchrun serves all of them."""
    out = []
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        v = key(item)
        if v is not None and v not in out:
            out.append(v)
    return out


def item_param(item, name, default=None):
    """The value of parametrize argument `name` of a collected test item (default when not parametrized)."""
    cs = getattr(item, "callspec", None)
    return cs.params.get(name, default) if cs is not None else default
