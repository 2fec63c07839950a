"""tools/bench.py, the one entry point of the benchmarks: every tools/bench_*.py is listed, each shared flag maps to
a flag the benchmark really declares, a shared flag a benchmark lacks is refused with one line, and a benchmark run
through it writes its results where --json says (bench_tool_calls, the cheapest, end to end)."""

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench  # noqa: E402


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_every_benchmark_is_listed_and_its_shared_flags_exist():
    on_disk = {os.path.basename(p)[len("bench_"):-3] for p in glob.glob(os.path.join(ROOT, "tools", "bench_*.py"))}
    assert on_disk == set(bench.BENCHES)
    for name, flags in bench.BENCHES.items():
        own = bench.own_flags(name)
        for key, flag in flags.items():
            assert flag is None or flag in own, (name, key, flag)
            if flag is None:  # not silently missing: the benchmark has no flag of that name either
                assert f"--{key}" not in own, (name, key)
        assert bench.summary(name), name


def test_control_a_wrong_mapping_is_caught():
    assert "--json" not in bench.own_flags("live")  # live writes with --out: a table entry "--json" would fail above


def test_list_refusals_and_did_you_mean():
    p = _run("--list")
    assert p.returncode == 0 and all(name in p.stdout for name in bench.BENCHES), p.stdout
    p = _run("attention", "--seed", "3")
    assert p.returncode != 0 and p.stderr.strip().count("\n") == 0 and "no --seed" in p.stderr, p.stderr
    p = _run("streamin")
    assert p.returncode != 0 and "did you mean 'streaming'" in p.stderr, p.stderr
    with pytest.raises(SystemExit):
        bench.translate("microbatch", {"seed": "1"})
    assert bench.translate("live", {"json": "o.json", "repeats": "2", "seed": "5"}) == [
        "--out", "o.json", "--repeats", "2", "--seed", "5"]


def test_a_benchmark_through_the_entry_point_writes_its_json(tmp_path):
    out = tmp_path / "tool_calls.json"
    p = _run("tool_calls", "--json", str(out), "--repeats", "1", "--calls", "3")
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    assert res["repeats"] == 1 and res["calls_per_block"] == 3 and "fork-server" in res
