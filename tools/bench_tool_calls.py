"""CPU and wall time of the quickstart's sandboxed calculator call: the ``exec`` launcher (a fresh ``python -I -S``
launcher per call, then the calculator in a second interpreter) vs the ``fork-server`` launcher (the default).

    OMP_NUM_THREADS=1 python tools/bench_tool_calls.py            # ~10 s on 2 cores; --json for one JSON line

Both paths run the real tool (``tools.execute_tool_call`` on a ``Sandbox``) on the quickstart's expressions (2-3
operands in [0, 99], ``+ - *``), one call at a time, in blocks of ``--calls`` interleaved between the paths (the order
alternates) and repeated ``--repeats`` times; the figures are the median over the blocks with their min-max spread.
CPU per call is user + sys of the whole process tree: this process (``RUSAGE_SELF``: the parent's share: pipes, the
scratch tmpfs, the cgroup), the launchers it reaped (``RUSAGE_CHILDREN``, exec path), and the fork server with every
launcher tree it reaped (``Sandbox.fork_server_cpu_s``). Kernel work done in kernel threads (e.g. tearing down a
network namespace) is in neither path's figure. CPU s per step = calls per step x CPU per call; the quickstart's
calls per step (``--calls-per-step``, default 62) is the count measured on examples/tiny_agent/config.yaml (64
trajectories per step, nearly all call the calculator once).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_tsync.rollout import tools  # noqa: E402
from megatron_tsync.rollout.sandbox import Sandbox, SandboxConfig  # noqa: E402

PATHS = ("exec", "fork-server")


def expressions(n: int, seed: int) -> list[str]:
    """The quickstart task's expressions (arithmetic-calculator: 2-3 operands in [0, 99], ops + - *)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(2, 3)
        out.append("".join(f"{rng.randint(0, 99)}{rng.choice('+-*') if i < k - 1 else ''}" for i in range(k)))
    return out


def _tree_cpu(sb: Sandbox) -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + sb.fork_server_cpu_s()


def block(sb: Sandbox, exprs: list[str]) -> tuple[float, float, list[str]]:
    """(CPU ms per call, wall ms per call, outputs) of one block of calls."""
    outs = []
    c0, t0 = _tree_cpu(sb), time.perf_counter()
    for e in exprs:
        r = tools.execute_tool_call(tools.ToolCall("calculator", e, (0, 0)), sb)
        outs.append(r.stdout.strip() if r.ok else f"error: {r.error}")
    wall = time.perf_counter() - t0
    return (_tree_cpu(sb) - c0) / len(exprs) * 1e3, wall / len(exprs) * 1e3, outs


def run(calls: int, repeats: int, calls_per_step: float, seed: int = 0) -> dict:
    sbs = {p: Sandbox(SandboxConfig(launcher=p)) for p in PATHS}
    for sb in sbs.values():  # warm-up: the capability probe and the fork server's start are one-off costs
        block(sb, ["1+1"])
    samples: dict[str, dict[str, list[float]]] = {p: {"cpu_ms": [], "wall_ms": []} for p in PATHS}
    for rep in range(repeats):
        exprs = expressions(calls, seed + rep)
        outs = {}
        for p in (PATHS if rep % 2 == 0 else PATHS[::-1]):
            cpu, wall, outs[p] = block(sbs[p], exprs)
            samples[p]["cpu_ms"].append(cpu)
            samples[p]["wall_ms"].append(wall)
        if outs["exec"] != outs["fork-server"]:
            raise SystemExit(f"the two paths disagree: {outs['exec'][:4]} vs {outs['fork-server'][:4]}")
        bad = [o for o in outs["exec"] if o.startswith("error")]
        if bad:
            raise SystemExit(f"calculator calls failed: {bad[:3]}")
    for sb in sbs.values():
        sb.close()
    res: dict = {"calls_per_block": calls, "repeats": repeats, "calls_per_step": calls_per_step,
                 "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count()}
    for p in PATHS:
        s = samples[p]
        res[p] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in s.items()}
        res[p]["cpu_s_per_step"] = res[p]["cpu_ms"]["median"] * calls_per_step / 1e3
    res["cpu_ratio_new_over_old"] = res["fork-server"]["cpu_ms"]["median"] / res["exec"]["cpu_ms"]["median"]
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20, help="calls per block (default 20)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved blocks per path (default 5)")
    ap.add_argument("--calls-per-step", type=float, default=62.0, help="quickstart tool calls per step (default 62)")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                    help="write the results as JSON to FILE; without FILE, print one JSON line instead of the table")
    a = ap.parse_args(argv)
    if a.calls < 1 or a.repeats < 1:
        ap.error("--calls and --repeats must be >= 1")
    res = run(a.calls, a.repeats, a.calls_per_step)
    if a.json == "-":
        print(json.dumps(res))
        return res
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"calculator tool calls: {a.calls} per block x {a.repeats} interleaved blocks per path; "
          f"load {res['load_avg_1m']:.2f} on {res['cpus']} CPUs; median [min-max] over blocks")
    print(f"{'path':<12} {'CPU ms/call':>24} {'wall ms/call':>24} {'CPU s/step':>11}")
    for p in PATHS:
        c, w = res[p]["cpu_ms"], res[p]["wall_ms"]
        print(f"{p:<12} {c['median']:8.2f} [{c['min']:6.2f}-{c['max']:6.2f}] "
              f"{w['median']:8.2f} [{w['min']:6.2f}-{w['max']:6.2f}] {res[p]['cpu_s_per_step']:11.3f}")
    print(f"calls per step {a.calls_per_step:g}; CPU per call fork-server / exec = {res['cpu_ratio_new_over_old']:.3f}")
    return res


if __name__ == "__main__":
    main()
