"""Worker process for the channel tests / latency benchmark: sends N trajectory events, then flushes.

usage: tsync_transport_sender.py ENDPOINT SENDER_ID N VERSION T [--interval-s X] [--stamp]
Prints one JSON line with the sender's stats on success.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tsync_transport_helpers import KEY, make_traj  # noqa: E402

from megatron_tsync.transport import EventSender  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("sender_id")
    ap.add_argument("n", type=int)
    ap.add_argument("version", type=int)
    ap.add_argument("T", type=int)
    ap.add_argument("--interval-s", type=float, default=0.0)
    ap.add_argument("--stamp", action="store_true", help="put time.monotonic_ns() at send into meta['t_ns']")
    ap.add_argument("--ping-interval-s", type=float, default=0.2)
    a = ap.parse_args()
    events = [make_traj(i, a.version, a.T, teacher=False, meta={"i": i, "sender": a.sender_id}) for i in range(a.n)]
    with EventSender(a.endpoint, KEY, a.sender_id, ping_interval_s=a.ping_interval_s) as s:
        for ev in events:
            if a.stamp:
                ev.meta["t_ns"] = time.monotonic_ns()
            s.send(ev, timeout_s=30)
            if a.interval_s:
                end = time.monotonic() + a.interval_s
                while time.monotonic() < end:
                    s.pump(end - time.monotonic())
        s.flush(timeout_s=30)
        print(json.dumps(s.stats), flush=True)


if __name__ == "__main__":
    main()
