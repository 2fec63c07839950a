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


def run_policies(env, tasks, policies, concurrency: int = 4):
    """{policy: run_policy's list} for several policies in ONE pass: every (policy, task) episode goes through the
    same `concurrency` slots, so the slowest episodes of one policy overlap the others' (no idle tail per policy)."""

    async def one(task, policy, sem):
        async with sem:
            t0 = time.monotonic()
            verdict, _ = await run_scripted(env, task, policy(env, task))
            return task, verdict, time.monotonic() - t0

    async def main():
        sem = asyncio.Semaphore(concurrency)
        return await asyncio.gather(*(one(t, p, sem) for p in policies for t in tasks))

    out = asyncio.run(main())
    return {p: out[i * len(tasks):(i + 1) * len(tasks)] for i, p in enumerate(policies)}


def full_sweeps() -> bool:
    """TSYNC_FULL_SWEEPS=1: the exhaustive sweeps (every generated task) instead of CI's covering subsets."""
    import os

    return os.environ.get("TSYNC_FULL_SWEEPS", "") not in ("", "0")


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


# ------------------------------------------------------------------------------------------ loaded tasks on disk
def _git(cwd, *args) -> str:
    import subprocess

    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


def make_swebench_jsonl(root, test_add: str | None = None) -> str:
    """A one-instance SWE-bench-style JSONL file under `root` (a real git repository, a test patch, a gold patch):
    ``calc.ops.add`` subtracts; FAIL_TO_PASS ``test_add`` (its source: `test_add`), PASS_TO_PASS ``test_mul``.
    Returns the file's path."""
    import json
    import os

    repo = os.path.join(root, "acme__calc")
    os.makedirs(os.path.join(repo, "calc"))
    os.makedirs(os.path.join(repo, "tests"))
    files = {"calc/__init__.py": "", "calc/ops.py": "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
             "    return a * b\n", "tests/test_ops.py": "from calc.ops import mul\n\n\ndef test_mul():\n"
             "    assert mul(3, 4) == 12\n"}
    for rel, text in files.items():
        with open(os.path.join(repo, rel), "w") as f:
            f.write(text)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()

    def diff(rel, new):
        with open(os.path.join(repo, rel), "w") as f:
            f.write(new)
        out = _git(repo, "diff", "--", rel)
        _git(repo, "checkout", "--", rel)
        return out

    test_add = test_add or ("def test_add():\n    assert add(2, 3) == 5\n    want = [add(x, 1) for x in range(4)]\n"
                            "    assert want == [1, 2, 3, 4]\n    assert add(-7, 7) == add(0, 0)\n")
    tests = "from calc.ops import add, mul\n\n\ndef test_mul():\n    assert mul(3, 4) == 12\n\n\n" + test_add
    rec = {"instance_id": "acme__calc-1", "repo": "acme/calc", "base_commit": base,
           "problem_statement": "add(2, 3) returns -1 instead of 5.", "test_patch": diff("tests/test_ops.py", tests),
           "patch": diff("calc/ops.py", files["calc/ops.py"].replace("a - b", "a + b")),
           "FAIL_TO_PASS": ["tests/test_ops.py::test_add"], "PASS_TO_PASS": ["tests/test_ops.py::test_mul"]}
    path = os.path.join(root, "instances.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps(rec) + "\n")
    return path


def make_terminal_bench_dir(root) -> str:
    """A Terminal-Bench-style task directory: write ``count.sh FILE`` printing the number of ERROR lines of FILE;
    the tests run it on the workspace's log and on a hidden one, and check a file the script must not change."""
    import os

    d = os.path.join(root, "count-errors")
    os.makedirs(os.path.join(d, "tests"))
    os.makedirs(os.path.join(d, "workspace"))
    texts = {"workspace/app.log": "INFO a\nERROR b\nERROR c\nINFO d\n",
             "task.yaml": "instruction: |\n  Write count.sh: `sh count.sh FILE` prints the number of ERROR lines of "
                          "FILE.\n",
             "solution.sh": "printf 'grep -c ERROR \"$1\"\\n' > count.sh\n",
             "tests/test_outputs.py": "import subprocess\n\n\ndef count(path):\n    return subprocess.run(['sh', "
                                      "'count.sh', path], capture_output=True, text=True, timeout=10).stdout\n\n\n"
                                      "def test_on_the_log():\n    assert count('app.log').strip() == '2'\n\n\n"
                                      "def test_on_a_hidden_log():\n    with open('hidden.log', 'w') as f:\n"
                                      "        f.write('ERROR x\\nERROR y\\nWARN z\\nERROR w\\n' * 3)\n"
                                      "    assert int(count('hidden.log')) == 9\n"}
    for rel, text in texts.items():
        with open(os.path.join(d, rel), "w") as f:
            f.write(text)
    return d
