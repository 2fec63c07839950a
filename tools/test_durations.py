"""Per-module and per-test seconds of a test run, from the file ``TSYNC_DURATIONS_JSON=path`` makes
(``tests/_suite_report.py``).

    python tools/test_durations.py runs/durations.json            # modules by seconds, then the 15 slowest tests
    python tools/test_durations.py runs/durations.json --write    # also refresh tests/module_seconds.json, the
                                                                  # costs xdist's longest-first order reads
Measure on a serial run (``pytest -p no:xdist``): under xdist a test's seconds include the other worker's load.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("durations", help="the JSON that TSYNC_DURATIONS_JSON names")
    ap.add_argument("--write", action="store_true", help="refresh tests/module_seconds.json")
    args = ap.parse_args(argv)
    with open(args.durations) as f:
        run = json.load(f)
    per_module: dict[str, float] = defaultdict(float)
    for nodeid, t in run["tests"].items():
        per_module[nodeid.split("::", 1)[0]] += t["s"]
    print(f"total {run['total_s']:.0f} s, {len(run['tests'])} tests, {len(per_module)} modules")
    for path, s in sorted(per_module.items(), key=lambda kv: -kv[1]):
        print(f"{s:8.1f} s  {path}")
    print("15 slowest tests:")
    for nodeid, t in sorted(run["tests"].items(), key=lambda kv: -kv[1]["s"])[:15]:
        print(f"{t['s']:8.1f} s  {nodeid}")
    if args.write:
        out = os.path.join(ROOT, "tests", "module_seconds.json")
        with open(out, "w") as f:
            json.dump({k: round(v, 1) for k, v in sorted(per_module.items())}, f, indent=1)
            f.write("\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
