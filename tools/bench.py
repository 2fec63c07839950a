"""One entry point for the benchmarks: ``python tools/bench.py NAME [shared flags] [the benchmark's own flags]``.

    python tools/bench.py --list                                   # every benchmark, one line each
    python tools/bench.py streaming --json out.json --repeats 3 --quick
    python tools/bench.py live --seed 7 --modes sync,stream-trajectory --steps 4
    python tools/bench.py live --task log-search --modes sync,stream-trajectory   # the observation-heavy task
    python tools/bench.py learner --help                           # the benchmark's own flags

Each benchmark stays a module of its own (``tools/bench_NAME.py``, runnable alone as before). The shared flags mean
the same thing everywhere and are translated to the benchmark's own spelling:

    --json FILE    where the benchmark writes its results (JSON)
    --repeats N    repetitions of each measured configuration (interleaved where the benchmark interleaves)
    --seed S       the seed of the workload

A shared flag that a benchmark has no equivalent for is refused with one line (never silently dropped).
Single-process CPU measurements want one torch thread: ``OMP_NUM_THREADS`` is set to 1 unless already set.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> the benchmark's own flag for each shared flag (None: it has none)
BENCHES: dict[str, dict[str, str | None]] = {
    "attention": dict(json="--json", repeats="--repeats", seed=None),
    "fixed_budget": dict(json="--out", repeats="--seeds", seed="--seed"),
    "learner": dict(json="--json", repeats="--repeats", seed=None),
    "kv_reuse": dict(json="--json", repeats="--repeats", seed=None),
    "less_work": dict(json="--json", repeats="--repeats", seed=None),
    "live": dict(json="--out", repeats="--repeats", seed="--seed"),
    "microbatch": dict(json="--json", repeats="--iters", seed=None),
    "packing": dict(json="--json", repeats="--repeats", seed=None),
    "speculation": dict(json="--json", repeats="--repeats", seed=None),
    "streaming": dict(json="--json", repeats="--repeats", seed="--seed"),
    "tool_calls": dict(json="--json", repeats="--repeats", seed=None),
    "weight_sync": dict(json="--json", repeats="--repeats", seed=None),
}
SHARED = ("json", "repeats", "seed")


def script(name: str) -> str:
    return os.path.join(HERE, f"bench_{name}.py")


def summary(name: str) -> str:
    """The first line of the benchmark's module docstring (read without importing it)."""
    with open(script(name)) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def own_flags(name: str) -> set[str]:
    """Every ``--flag`` the benchmark's parser declares (its source's add_argument calls)."""
    with open(script(name)) as f:
        tree = ast.parse(f.read())
    return {a.value for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument"
            for a in n.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}


def translate(name: str, shared: dict[str, str | None]) -> list[str]:
    """The shared flags given, in the benchmark's own spelling; a shared flag it has no equivalent for is an error."""
    out = []
    for key in SHARED:
        value = shared.get(key)
        if value is None:
            continue
        flag = BENCHES[name][key]
        if flag is None:
            raise SystemExit(f"bench.py: error: benchmark {name!r} has no --{key} (its own flags: "
                             f"python tools/bench.py {name} --help)")
        out += [flag, value]
    return out


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                add_help=False)
    p.add_argument("name", nargs="?", help="the benchmark (--list shows them)")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--json", metavar="FILE", help="results file (JSON)")
    p.add_argument("--repeats", metavar="N", help="repetitions of each measured configuration")
    p.add_argument("--seed", metavar="S", help="the workload's seed")
    a, rest = p.parse_known_args(argv)
    if a.list or a.name is None:
        if a.name is None and not a.list and ("-h" in rest or "--help" in rest or not rest):
            p.print_help()
            raise SystemExit(0 if rest else 2)
        return a, rest
    if a.name not in BENCHES:
        import difflib

        near = difflib.get_close_matches(a.name, list(BENCHES), n=1)
        raise SystemExit(f"bench.py: error: unknown benchmark {a.name!r}" + (f"; did you mean {near[0]!r}?" if near
                                                                               else f" (one of {', '.join(BENCHES)})"))
    return a, rest


def main(argv: list[str] | None = None) -> int:
    a, rest = parse(sys.argv[1:] if argv is None else list(argv))
    if a.list:
        width = max(map(len, BENCHES))
        for name in BENCHES:
            print(f"{name:<{width}}  {summary(name)}")
        return 0
    args = translate(a.name, {"json": a.json, "repeats": a.repeats, "seed": a.seed}) + rest
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if HERE not in sys.path:
        sys.path.insert(0, os.path.dirname(HERE))
    spec = importlib.util.spec_from_file_location(f"bench_{a.name}", script(a.name))
    mod = importlib.util.module_from_spec(spec)
    sys.argv = [script(a.name)] + args
    spec.loader.exec_module(mod)
    rc = mod.main(args)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
