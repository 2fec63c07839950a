"""terminal-lite: procedurally generated shell tasks (files, text processing, small scripts) with hidden checks.

Task ``i`` of seed ``s`` is a pure function of ``(s, i)``: one of the families below with random data. The agent
works with ``bash`` / ``view`` / ``edit`` in its workspace and calls ``submit``; the verifier then copies the final
workspace (regular files only) into a fresh directory and runs the task's checks there as probes whose values
are compared outside the sandbox (``envs/checks.py``, ``envs/probes.py``): file contents, directory listings, or
the output of the agent's script on hidden inputs that the agent never saw. Expected values are computed by the generator in Python, never by the shell.

    sort-unique    distinct lines of a file, sorted, into out/...
    count-match    number of log lines with a level, into out/...
    rename-ext     rename *.txt to *.md in a directory (contents kept)
    totals         per-key sums of a CSV column, "key total" lines sorted by key
    filter-fields  first field of the ':'-separated lines whose third field matches
    replace        replace a word in every *.ini file of a directory
    largest        name of the largest file of a directory
    script-words   bin/<name>.sh FILE prints the number of words of FILE (checked on hidden files)
    script-sum     bin/<name>.sh FILE prints the sum of the integers of FILE (checked on hidden files)

Standard library only.
"""

from __future__ import annotations

import random
import zlib

from megatron_tsync.rollout.envs.base import register_environment
from megatron_tsync.rollout.envs.checks import Check
from megatron_tsync.rollout.envs.workspace_env import WorkspaceEnv, WorkspaceTask

__all__ = ["generate_task", "generate_tasks", "TerminalLiteEnv", "FAMILIES"]

CHECK_FILE = "tests/test_checks.py"
PREAMBLE = '''import os
import subprocess
import tempfile


def _read(path):
    with open(path) as f:
        return f.read()


def _ls(path):
    return sorted(os.listdir(path))


def _run_script(path, content):
    fd, name = tempfile.mkstemp(prefix="hidden_", dir=os.getcwd())
    with os.fdopen(fd, "w") as f:
        f.write(content)
    try:
        r = subprocess.run(["/bin/sh", path, name], capture_output=True, text=True, timeout=10)
    finally:
        os.unlink(name)
    return r.stdout.strip()
'''
NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory", "oscar")
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta")


def _mix(*parts: int) -> int:
    return zlib.crc32(repr(("terminal-lite",) + parts).encode())


def _sort_unique(r: random.Random):
    names = [r.choice(NAMES).capitalize() for _ in range(r.randint(5, 14))]
    src, dst = f"data/{r.choice(['names', 'people', 'guests'])}.txt", f"out/{r.choice(['sorted', 'unique'])}.txt"
    want = "".join(n + "\n" for n in sorted(set(names)))
    return ({src: "".join(n + "\n" for n in names)},
            f"`{src}` has one name per line. Write its distinct names, sorted, one per line, to `{dst}`.",
            [(f"_read({dst!r})", want)], f"mkdir -p out && sort -u {src} > {dst}")


def _count_match(r: random.Random):
    level = r.choice(["ERROR", "WARN", "INFO"])
    lines = [f"2026-01-{r.randint(10, 28)} {r.choice(['ERROR', 'WARN', 'INFO', 'DEBUG'])} {r.choice(WORDS)} "
             f"{r.randint(1, 999)}" for _ in range(r.randint(6, 20))]
    n = sum(line.split()[1] == level for line in lines)
    dst = f"out/{level.lower()}_count.txt"
    return ({"logs/app.log": "\n".join(lines) + "\n"},
            f"Count the lines of `logs/app.log` whose level (second field) is {level}; write the number to `{dst}`.",
            [(f"_read({dst!r}).strip()", str(n))], f"mkdir -p out && awk '$2 == \"{level}\"' logs/app.log | wc -l "
                                                  f"| tr -d ' ' > {dst}")


def _rename_ext(r: random.Random):
    stems = r.sample(WORDS, r.randint(2, 5))
    files = {f"docs/{s}.txt": f"{s} {r.randint(0, 99)}\n" for s in stems}
    files["docs/keep.rst"] = "keep me\n"
    checks = [("_ls('docs')", sorted([f"{s}.md" for s in stems] + ["keep.rst"]))]
    checks += [(f"_read('docs/{s}.md')", files[f"docs/{s}.txt"]) for s in stems[:2]]
    return (files, "Rename every `.txt` file in `docs/` to the same name with `.md` (keep the contents; leave "
                   "other files alone).", checks, 'for f in docs/*.txt; do mv "$f" "${f%.txt}.md"; done')


def _totals(r: random.Random):
    keys = r.sample(["north", "south", "east", "west", "central"], r.randint(2, 4))
    rows = [(r.choice(keys), r.randint(1, 500)) for _ in range(r.randint(5, 15))]
    tot: dict[str, int] = {}
    for k, v in rows:
        tot[k] = tot.get(k, 0) + v
    want = "".join(f"{k} {tot[k]}\n" for k in sorted(tot))
    return ({"data/sales.csv": "region,amount\n" + "".join(f"{k},{v}\n" for k, v in rows)},
            "`data/sales.csv` has the header `region,amount`. Write one line `REGION TOTAL` per region with the sum "
            "of its amounts, sorted by region, to `out/totals.txt`.", [("_read('out/totals.txt')", want)],
            "mkdir -p out && awk -F, 'NR > 1 {s[$1] += $2} END {for (k in s) print k, s[k]}' data/sales.csv "
            "| sort > out/totals.txt")


def _filter_fields(r: random.Random):
    shells = ["/bin/bash", "/bin/sh", "/usr/bin/zsh"]
    want_shell = r.choice(shells)
    users = [(n, 1000 + i, r.choice(shells)) for i, n in enumerate(r.sample(NAMES, r.randint(4, 9)))]
    want = "".join(f"{n}\n" for n, _, s in users if s == want_shell)
    return ({"data/users.txt": "".join(f"{n}:{u}:{s}\n" for n, u, s in users)},
            f"Each line of `data/users.txt` is `name:uid:shell`. Write the names of the users whose shell is "
            f"`{want_shell}`, in file order, one per line, to `out/users.txt` (an empty file if there are none).",
            [("_read('out/users.txt')", want)],
            f"mkdir -p out && awk -F: '$3 == \"{want_shell}\" {{print $1}}' data/users.txt > out/users.txt")


def _replace(r: random.Random):
    old, new = r.sample(["localhost", "staging", "example", "primary", "backup"], 2)
    files = {f"config/{n}.ini":
             f"[{n}]\nhost = {old}\nmirror = {old}-{r.randint(1, 9)}\nport = {r.randint(1000, 9999)}\n"
             for n in r.sample(["app", "db", "cache", "queue"], r.randint(2, 3))}
    checks = [(f"_read({p!r})", c.replace(old, new)) for p, c in sorted(files.items())]
    return (files, f"Replace every occurrence of `{old}` with `{new}` in all `.ini` files under `config/`.", checks,
            f"sed -i 's/{old}/{new}/g' config/*.ini")


def _largest(r: random.Random):
    sizes = r.sample(range(5, 400), r.randint(3, 6))
    names = r.sample(WORDS, len(sizes))
    files = {f"data/{n}.dat": "x" * s for n, s in zip(names, sizes)}
    best = names[sizes.index(max(sizes))]
    return (files, "Write the file name (without the directory) of the largest file in `data/` to "
                   "`out/largest.txt`.", [("_read('out/largest.txt').strip()", f"{best}.dat")],
            "mkdir -p out && ls -S data | head -n 1 > out/largest.txt")


def _hidden_text(r: random.Random) -> str:
    return "\n".join(" ".join(r.choice(WORDS) for _ in range(r.randint(0, 6))) for _ in range(r.randint(1, 5))) + "\n"


def _script_words(r: random.Random):
    name = r.choice(["wc_words", "count_words", "words"])
    hidden = [_hidden_text(r) for _ in range(3)]
    checks = [(f"_run_script('bin/{name}.sh', {h!r})", str(len(h.split()))) for h in hidden]
    sample = _hidden_text(r)
    return ({"sample.txt": sample},
            f"Write a shell script `bin/{name}.sh` that prints the number of words in the file given as its first "
            f"argument (just the number). For `sample.txt` it prints {len(sample.split())}.", checks,
            f"mkdir -p bin && printf '%s\\n' 'wc -w < \"$1\" | tr -d \" \"' > bin/{name}.sh")


def _script_sum(r: random.Random):
    name = r.choice(["sum", "add_up", "total"])
    hidden = ["".join(f"{r.randint(-50, 200)}\n" for _ in range(r.randint(1, 8))) for _ in range(3)]
    checks = [(f"_run_script('bin/{name}.sh', {h!r})", str(sum(int(x) for x in h.split()))) for h in hidden]
    sample = [r.randint(-9, 99) for _ in range(r.randint(2, 5))]
    return ({"numbers.txt": "".join(f"{x}\n" for x in sample)},
            f"Write a shell script `bin/{name}.sh` that prints the sum of the integers (one per line) in the file "
            f"given as its first argument. For `numbers.txt` it prints {sum(sample)}.", checks,
            f"mkdir -p bin && printf '%s\\n' 'awk \"{{s += \\$1}} END {{print s + 0}}\" \"$1\"' > bin/{name}.sh")


FAMILIES = {"sort-unique": _sort_unique, "count-match": _count_match, "rename-ext": _rename_ext, "totals": _totals,
            "filter-fields": _filter_fields, "replace": _replace, "largest": _largest,
            "script-words": _script_words, "script-sum": _script_sum}


def generate_task(seed: int, index: int) -> WorkspaceTask:
    """Task ``index`` of suite ``seed``: family ``index mod 9``, data from ``(seed, index)``."""
    family = list(FAMILIES)[index % len(FAMILIES)]
    rng = random.Random(_mix(seed, index))
    files, instruction, checks, solution = FAMILIES[family](rng)
    return WorkspaceTask(
        task_id=f"terminal-lite-{seed}-{index}", instruction=instruction, files=files,
        checks=tuple(Check(CHECK_FILE, expr, want) for expr, want in checks), preambles={CHECK_FILE: PREAMBLE},
        protected=("tests",), solution=(("bash", {"command": solution}), ("submit", {})),
        meta={"suite": "terminal-lite", "seed": seed, "index": index, "family": family})


def generate_tasks(seed: int, n: int, start: int = 0) -> list[WorkspaceTask]:
    return [generate_task(seed, i) for i in range(start, start + n)]


ROLE = "shell user solving a task in a Unix terminal"


class TerminalLiteEnv(WorkspaceEnv):
    name = "terminal-lite"

    def __init__(self, **kwargs):
        kwargs.setdefault("role", ROLE)
        super().__init__(**kwargs)


@register_environment("terminal-lite")
def _make(**kwargs) -> TerminalLiteEnv:
    return TerminalLiteEnv(**kwargs)
