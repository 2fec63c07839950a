"""README.md and docs/*.md: every relative link resolves, every ``#anchor`` names a heading, the README stays a short
guide (at most 250 lines, the two quickstart commands) and links every docs page. Pure file reading."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

# [text](target) and ![alt](target); the text may hold `code` and nested [..] one level deep.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(path: Path):
    """(line number, text) of the lines outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed (``-`` and ``_`` kept),
    spaces to ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: keep their text
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading slug of a markdown file, with GitHub's -1, -2 ... suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path):
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        k = seen.get(slug, 0)
        seen[slug] = k + 1
        out.add(slug if k == 0 else f"{slug}-{k}")
    return out


def links(path: Path):
    """(line number, target) of every markdown link outside code (fenced blocks and inline code spans)."""
    for n, line in _prose_lines(path):
        for m in LINK.finditer(INLINE_CODE.sub("code", line)):
            yield n, m.group(1)


def broken_links(path: Path) -> list[str]:
    bad = []
    for n, target in links(path):
        if re.match(r"^(https?:|mailto:)", target, re.I):
            continue
        where = f"{path.relative_to(ROOT)}:{n}: {target}"
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / unquote(file_part)).resolve()
        if not dest.exists():
            bad.append(f"{where} (no such file or folder)")
            continue
        if anchor and dest.is_file() and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
            bad.append(f"{where} (no heading with that anchor in {dest.relative_to(ROOT)})")
    return bad


def test_the_checker_sees_links_and_anchors():
    """The checker itself: it finds links in ordinary prose and tables, skips code, and slugs like GitHub."""
    assert github_slug("Live: the real rollout plane") == "live-the-real-rollout-plane"
    assert github_slug("Bitwise mode (`--deterministic`)") == "bitwise-mode---deterministic"
    assert github_slug("Quickstart (2 CPU cores, no GPU, no downloads)") == "quickstart-2-cpu-cores-no-gpu-no-downloads"
    found = [t for _, t in links(README)]
    assert "docs/streaming.md" in found and "examples/tiny_agent/" in found, found
    assert len(found) >= 20, found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = broken_links(page)
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_readme_is_a_short_guide():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    quickstart = re.search(r"## Quickstart[^\n]*\n+```bash\n(.*?)```", text, re.S)
    assert quickstart, "no Quickstart code block"
    commands = [line.split("#")[0].strip() for line in quickstart.group(1).splitlines() if line.strip()]
    assert commands == ["bash tools/quickstart.sh", "bash tools/test.sh"], commands


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in links(README) if t.partition("#")[0]}
    missing = [str(p.relative_to(ROOT)) for p in DOCS if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"
