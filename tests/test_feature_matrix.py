"""docs/moe_matrix.md is checked against the code: every grid cell names entries of the legend; every "tested" entry
names tests that exist (file, function, parametrization id); every "gpu_smoke" entry names a check of
tools/gpu_smoke.py; every "refused" entry quotes a message the package really raises and blames megatron-core, vLLM
or the hardware — never this project's own missing code; every "open" entry (this project's own gap, a family's grid
only) says what is missing, and a refusal it quotes is raised. Pure file reading (no test is run from here)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "moe_matrix.md"
CELL_KEY = re.compile(r"\b([tgro]\d+)\b")
LEGEND = re.compile(r"^- \*\*([tgro]\d+)\*\* (tested|gpu_smoke|refused|open)\b(.*)$")
TEST_ID = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[([^\]`]+)\])?`")
SMOKE = re.compile(r"`gpu_smoke:([\w-]+)`")
QUOTE = re.compile(r"\"([^\"]{12,})\"")
OWNERS = ("megatron-core", "vLLM", "hardware")


def _tables(text: str) -> list[list[list[str]]]:
    """Markdown tables of ``text`` as rows of cells (separator rows dropped)."""
    tables, cur = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):
                cur.append(cells)
        elif cur:
            tables.append(cur)
            cur = []
    if cur:
        tables.append(cur)
    return tables


def _legend(text: str) -> dict[str, tuple[str, str]]:
    out = {}
    for line in text.splitlines():
        m = LEGEND.match(line)
        if m:
            assert m.group(1) not in out, f"legend key {m.group(1)} defined twice"
            out[m.group(1)] = (m.group(2), m.group(3))
    return out


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _package_source() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "megatron_tsync").rglob("*.py"))


def test_every_cell_names_a_legend_entry():
    text = DOC.read_text(encoding="utf-8")
    legend = _legend(text)
    families = ("glm4_moe_lite", "qwen3_5")
    grids = [t for t in _tables(text) if t and t[0][0].lower() in ("layout", "combination", "engine", *families)]
    assert [g[0][0] for g in grids] == ["layout", "combination", "engine", *families], \
        "the learner, combination, engine grids and the family grids"
    used = set()
    for grid in grids:
        header = grid[0]
        for row in grid[1:]:
            assert len(row) == len(header), row
            for col, cell in zip(header[1:], row[1:]):
                keys = CELL_KEY.findall(cell)
                assert keys, f"{row[0]} × {col}: empty cell {cell!r}"
                for k in keys:
                    assert k in legend, f"{row[0]} × {col}: {k} is not in the legend"
                    status = legend[k][0]
                    assert k[0] == status[0], f"{k}: a key's letter is its status (t/g/r/o), not {status}"
                    assert status != "open" or grid[0][0] in families, f"{k}: open cells in family grids only"
                used.update(keys)
    assert set(legend) == used, f"legend entries no cell uses: {sorted(set(legend) - used)}"


def test_tested_entries_name_existing_tests():
    legend = _legend(DOC.read_text(encoding="utf-8"))
    for key, (status, rest) in legend.items():
        if status != "tested":
            continue
        ids = TEST_ID.findall(rest)
        assert ids, f"{key}: a tested entry names its tests as `tests/...py::name`"
        for path, name, param in ids:
            f = ROOT / path
            assert f.is_file(), f"{key}: {path} does not exist"
            assert name in _functions(f), f"{key}: {path} has no test {name}"
            if param:  # the id's parts must appear in the file (parametrize values)
                src = f.read_text(encoding="utf-8")
                for part in param.split("-"):
                    assert part in src, f"{key}: {path}::{name}[{param}]: {part!r} is not among its parameters"


def test_gpu_smoke_entries_name_checks():
    legend = _legend(DOC.read_text(encoding="utf-8"))
    smoke = (ROOT / "tools" / "gpu_smoke.py").read_text(encoding="utf-8")
    for key, (status, rest) in legend.items():
        if status == "gpu_smoke":
            names = SMOKE.findall(rest)
            assert names, f"{key}: name the check as `gpu_smoke:name`"
            for n in names:
                assert f'@check("{n}")' in smoke, f"{key}: tools/gpu_smoke.py has no check {n!r}"


def test_open_entries_say_what_is_missing():
    legend = _legend(DOC.read_text(encoding="utf-8"))
    src = _package_source()
    for key, (status, rest) in legend.items():
        if status == "open":
            assert len(rest.strip(" —:-")) > 20, f"{key}: an open entry says what is missing"
            for q in QUOTE.findall(rest):
                assert q in src, f"{key}: {q!r} is not raised anywhere in megatron_tsync/"


def test_refusals_are_real_and_not_ours():
    legend = _legend(DOC.read_text(encoding="utf-8"))
    src = _package_source()
    for key, (status, rest) in legend.items():
        if status != "refused":
            continue
        owner = rest.lstrip(" —:-").split(":")[0].strip()
        assert owner in OWNERS, f"{key}: a refusal names whose limit it is ({', '.join(OWNERS)}), got {owner!r}"
        quotes = QUOTE.findall(rest)
        assert quotes, f"{key}: quote (in double quotes) a part of the error message the package raises"
        for q in quotes:
            assert q in src, f"{key}: {q!r} is not raised anywhere in megatron_tsync/"


@pytest.mark.parametrize("case", ["unknown key", "missing test", "ours"])
def test_control_checks_fail_on_bad_docs(case, tmp_path, monkeypatch):
    """The checks above can fail: a doc with an undefined key, a made-up test, a refusal that blames this project."""
    base = "| layout | sync |\n|---|---|\n| EP=2 | {cell} |\n\n| engine | load |\n|---|---|\n| vLLM | t1 |\n\n"
    docs = {"unknown key": (base.format(cell="t9") + "- **t1** tested `tests/test_feature_matrix.py::_tables`\n",
                            test_every_cell_names_a_legend_entry),
            "missing test": (base.format(cell="t1") + "- **t1** tested `tests/test_feature_matrix.py::nope`\n",
                             test_tested_entries_name_existing_tests),
            "ours": (base.format(cell="r1") + "- **t1** tested `tests/test_feature_matrix.py::_tables`\n"
                     "- **r1** refused — megatron_tsync: \"not wired yet, someone should\"\n",
                     test_refusals_are_real_and_not_ours)}
    text, check = docs[case]
    doc = tmp_path / "moe_matrix.md"
    doc.write_text(text)
    monkeypatch.setitem(globals(), "DOC", doc)
    with pytest.raises(AssertionError):
        check()
