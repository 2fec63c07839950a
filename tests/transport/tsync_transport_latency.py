"""Latency benchmark (not a test): send → poll of a 2k-token TrajectoryEvent, worker in another process.

    OMP_NUM_THREADS=1 python tests/transport/tsync_transport_latency.py [--n 1000] [--T 2048]

The worker stamps time.monotonic_ns() (CLOCK_MONOTONIC, shared by processes) into meta just before ``send``; the
learner reads the clock right after ``poll`` returns the event.  The span therefore covers validate + msgpack + HMAC on
the worker, the socket, and HMAC + msgpack + validate on the learner.  Events are spaced by --interval-s so this is
the unloaded latency, not throughput.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tsync_transport_helpers import KEY, sender_cmd, short_tmpdir  # noqa: E402

from megatron_tsync.transport import EventReceiver  # noqa: E402


def measure(endpoint: str, n: int, T: int, interval_s: float, warmup: int) -> np.ndarray:
    with EventReceiver(endpoint, KEY, credit=256) as rx:
        proc = subprocess.Popen(sender_cmd(rx.endpoint, "bench", str(n + warmup), "0", str(T), "--stamp",
                                           "--interval-s", str(interval_s)), stdout=subprocess.DEVNULL)
        lat = []
        while len(lat) < n + warmup:
            for ev in rx.poll(100):
                lat.append(time.monotonic_ns() - ev.meta["t_ns"])
        proc.wait(30)
    return np.asarray(lat[warmup:], dtype=np.float64) / 1e3  # µs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--interval-s", type=float, default=0.002)
    ap.add_argument("--warmup", type=int, default=50)
    a = ap.parse_args()
    d = short_tmpdir()
    try:
        for name, ep in (("ipc", f"ipc://{d}/bench.sock"), ("tcp", "tcp://127.0.0.1:*")):
            us = measure(ep, a.n, a.T, a.interval_s, a.warmup)
            print(f"{name}: T={a.T} n={len(us)} median {np.median(us):.0f} us  p99 {np.percentile(us, 99):.0f} us  "
                  f"max {us.max():.0f} us")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
