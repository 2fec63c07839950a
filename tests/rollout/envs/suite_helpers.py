"""Runs many scripted episodes concurrently and records their latencies (shared by the suite tests)."""

from __future__ import annotations

import asyncio
import time

from megatron_tsync.rollout.envs.base import run_scripted


def run_policy(env, tasks, policy, concurrency: int = 4):
    """[(task, verdict, episode wall s)] for `policy(env, task) -> actions`, `concurrency` episodes at a time."""

    async def one(task, sem):
        async with sem:
            t0 = time.monotonic()
            verdict, _ = await run_scripted(env, task, policy(env, task))
            return task, verdict, time.monotonic() - t0

    async def main():
        sem = asyncio.Semaphore(concurrency)
        return await asyncio.gather(*(one(t, sem) for t in tasks))

    return asyncio.run(main())


def known_fix(env, task):
    return env.render_solution(task)


def do_nothing(env, task):
    return [env.format.render_call("submit", {})]


def latency_line(name: str, results) -> str:
    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    ep = [r[2] for r in results]
    ver = [r[1].verify_s for r in results]
    return (f"{name}: {len(results)} episodes; episode s p50 {pct(ep, .5):.2f} p90 {pct(ep, .9):.2f} max {max(ep):.2f}; "
            f"verifier s p50 {pct(ver, .5):.2f} p90 {pct(ver, .9):.2f} max {max(ver):.2f}")
