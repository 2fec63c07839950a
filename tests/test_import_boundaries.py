"""The package rules of ``shared/design/architecture.md``, enforced on the AST of every module.

Every ``import`` / ``from ... import`` counts, at module level or inside a function (a function-local import is a
dependency all the same), relative imports resolved. Rules:

- each top-level package of ``megatron_tsync`` may import only the packages listed for it in :data:`ALLOWED`
  (its own included); in particular ``rollout/`` never imports ``training/`` (rollout workers never load the learner)
  and ``training/`` never imports ``rollout/``; both reach the network through ``model/``;
- the pure packages import no third-party code of the kinds they must not touch (:data:`FORBIDDEN_EXTERNAL`);
- no module imports ``examples`` or ``tools`` (they import the package, never the reverse);
- no import cycle among the modules of the package (every subpackage, ``rollout/sandbox/`` and ``rollout/envs/``
  included; a subpackage is under the rules of its top-level package), a package's ``__init__`` counting as a module;
- no .py file of the package is over :data:`MAX_LINES` lines.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_tsync")

# top-level package (or root module) -> the megatron_tsync packages it may import
ALLOWED: dict[str, set[str]] = {
    "algorithms": {"algorithms"},
    "streaming": {"streaming", "algorithms"},
    "model": {"model"},
    "transport": {"transport"},
    "training": {"training", "model", "streaming", "algorithms"},
    "rollout": {"rollout", "model", "transport", "algorithms"},
    "runtime": {"runtime", "training", "rollout", "model", "streaming", "transport", "algorithms", "config"},
    # the typed config reuses the sections of the modules that consume them (loaded lazily): no rule beyond "not the
    # orchestration" (runtime/) and "not the wire" (transport/)
    "config": {"config", "training", "model", "rollout", "streaming", "algorithms"},
    "arguments": {"arguments", "config", "training", "model", "rollout", "streaming", "algorithms", "help_defaults"},
    "help_defaults": {"config"},  # the --help defaults as data; regenerated from config
    "train": {"arguments", "runtime"},
    # the planner/simulator (issue 32): the real streaming planner, the latency profiles (runtime/latency.py, standard
    # library only) and the model shapes
    "plan": {"plan", "model", "streaming", "algorithms", "runtime", "transport", "rollout"},
    "__init__": set(),
}
MAX_LINES = 800
FORBIDDEN_EXTERNAL: dict[str, tuple[str, ...]] = {
    "algorithms": ("megatron", "zmq", "socket", "msgpack", "transformers", "vllm"),
    "streaming": ("zmq", "socket", "msgpack", "vllm"),
    "transport": ("megatron", "vllm"),
    "model": ("zmq", "msgpack", "vllm"),
}


def _modules() -> dict[str, str]:
    """Dotted module name -> path, for every .py under megatron_tsync/."""
    out = {}
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = path
    return out


def imports_of(module: str, path: str) -> list[tuple[str, int]]:
    """(imported dotted name, line) for every import statement in the file, function-local ones included."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((name, node.lineno))
            # ``from megatron_tsync.x import y`` may import the submodule y
            out += [(f"{name}.{a.name}", node.lineno) for a in node.names if a.name != "*"]
    return out


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


MODULES = _modules()


def _own_imports(module: str) -> list[tuple[str, int]]:
    """Imports of megatron_tsync modules that exist (``from pkg import name`` of a non-module dropped)."""
    got = []
    for name, line in imports_of(module, MODULES[module]):
        if name.split(".")[0] != "megatron_tsync":
            continue
        while name not in MODULES and "." in name:
            name = name.rpartition(".")[0]
        if name in MODULES and name != "megatron_tsync":
            got.append((name, line))
    return got


def boundary_violations() -> list[str]:
    bad: list[str] = []
    for module, path in sorted(MODULES.items()):
        top = _top(module)
        allowed = ALLOWED.get(top)
        if allowed is None:
            bad.append(f"{module}: package {top!r} has no rule in ALLOWED (add one)")
            continue
        for name, line in _own_imports(module):
            if _top(name) not in allowed | {top}:
                bad.append(f"{path}:{line}: {module} imports {name} ({top}/ may import only {sorted(allowed)})")
        for name, line in imports_of(module, path):
            first = name.split(".")[0]
            if first in FORBIDDEN_EXTERNAL.get(top, ()):
                bad.append(f"{path}:{line}: {module} imports {name} ({top}/ must not import {first})")
            if first in ("examples", "tools"):
                bad.append(f"{path}:{line}: {module} imports {name} (examples/ and tools/ are imported by nothing)")
    return list(dict.fromkeys(bad))


def import_cycles() -> list[list[str]]:
    """Import cycles among the modules of the package (function-local imports and ``__init__``s count)."""
    inside = set(MODULES)
    graph = {m: {n for n, _ in _own_imports(m) if n in inside and n != m} for m in inside}
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return cycles


def long_files() -> list[str]:
    return [f"{path}: {n} lines" for path in sorted(MODULES.values())
            if (n := len(open(path).read().splitlines())) > MAX_LINES]


def test_every_package_imports_only_what_architecture_md_allows():
    bad = boundary_violations()
    assert not bad, "import boundary violations:\n" + "\n".join(bad)


def test_no_import_cycle_in_the_package():
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_sandbox_subpackage_is_checked():
    """rollout/sandbox/ is walked: its modules are under the rollout rules and in the cycle graph."""
    sandbox = [m for m in MODULES if m.startswith("megatron_tsync.rollout.sandbox")]
    assert {"megatron_tsync.rollout.sandbox", "megatron_tsync.rollout.sandbox.core",
            "megatron_tsync.rollout.sandbox.container"} <= set(sandbox)
    assert {_top(m) for m in sandbox} == {"rollout"}
    assert "megatron_tsync.rollout.sandbox.fs" in {n for n, _ in _own_imports("megatron_tsync.rollout.sandbox.core")}


def test_no_file_over_max_lines():
    bad = long_files()
    assert not bad, f"files over {MAX_LINES} lines (split them):\n" + "\n".join(bad)


@pytest.mark.parametrize("src, expect", [
    ("from megatron_tsync.training.model import unwrap\n", "imports megatron_tsync.training"),
    *(pytest.param(src, expect, marks=pytest.mark.slow) for src, expect in [  # the same walk, other spellings
        ("def f():\n    from megatron_tsync.training import compat\n", "imports megatron_tsync.training"),
        ("def f():\n    from ..training.hf_conversion import load_hf_dir\n", "imports megatron_tsync.training"),
        ("import megatron_tsync.training.logprobs as lp\n", "imports megatron_tsync.training")]),
])
def test_the_checker_catches_a_rollout_to_training_import(tmp_path, monkeypatch, src, expect):
    """Control: the same walk over a rollout module that imports training/ (as four of today's did) must fail."""
    fake = tmp_path / "probe.py"
    fake.write_text(src)
    monkeypatch.setitem(MODULES, "megatron_tsync.rollout.probe", str(fake))
    assert any(expect in b and "rollout.probe" in b for b in boundary_violations())


def _cycles_with(tmp_path, monkeypatch, sources: dict[str, str]) -> list[list[str]]:
    """import_cycles() with probe modules {dotted name: source} added to the package."""
    for i, (module, src) in enumerate(sources.items()):
        tmp_path.mkdir(parents=True, exist_ok=True)
        path = tmp_path / f"probe{i}.py"
        path.write_text(src)
        monkeypatch.setitem(MODULES, module, str(path))
    return import_cycles()


def test_the_cycle_check_catches_a_cycle(tmp_path, monkeypatch):
    cycles = _cycles_with(tmp_path, monkeypatch, {
        "megatron_tsync.runtime.a": "def f():\n    from megatron_tsync.runtime import b\n",
        "megatron_tsync.runtime.b": "from megatron_tsync.runtime.a import f\n"})
    assert any("megatron_tsync.runtime.a" in c and "megatron_tsync.runtime.b" in c for c in cycles)


def test_the_cycle_check_catches_a_cycle_across_packages_and_through_an_init(tmp_path, monkeypatch):
    """A subpackage's module importing its own package's ``__init__``, which imports it back, is a cycle; so is a
    function-local import between two top-level packages."""
    cycles = _cycles_with(tmp_path / "init", monkeypatch, {
        "megatron_tsync.rollout.sandbox": "from megatron_tsync.rollout.sandbox.probe import x\n",
        "megatron_tsync.rollout.sandbox.probe": "def f():\n    from megatron_tsync.rollout.sandbox import Sandbox\n"})
    assert any("megatron_tsync.rollout.sandbox.probe" in c for c in cycles)
    cycles = _cycles_with(tmp_path, monkeypatch, {
        "megatron_tsync.model.m": "def f():\n    import megatron_tsync.training.t\n",
        "megatron_tsync.training.t": "from megatron_tsync.model.m import f\n"})
    assert any("megatron_tsync.model.m" in c and "megatron_tsync.training.t" in c for c in cycles)


def test_the_line_check_catches_a_long_file(tmp_path, monkeypatch):
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    monkeypatch.setitem(MODULES, "megatron_tsync.rollout.sandbox.long", str(long))
    assert any(str(long) in b for b in long_files())
