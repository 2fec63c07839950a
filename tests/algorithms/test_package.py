"""The package surface: every exported name resolves, and the modules import nothing but torch and the stdlib."""

import ast
import sys
from pathlib import Path

import megatron_tsync.algorithms as alg

PKG = Path(alg.__file__).parent


def test_exports_resolve():
    for name in alg.__all__:
        assert getattr(alg, name) is not None, name


def test_pure_math_imports_only():
    allowed = {"torch", "__future__"} | set(sys.stdlib_module_names)
    for path in PKG.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, f"{path.name} imports {roots - allowed}"
