"""The repository's documents stand alone: every relative link in README.md,
BENCHMARKS.md and docs/ names a file inside the repository that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)(?:#[^)]*)?\)|\[`?(\.\./[^\]`]+)`?\]")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    for match in LINK.finditer(text):
        link = match.group(1) or match.group(2)
        if re.match(r"[a-z]+://", link):
            continue
        target = (doc.parent / link).resolve()
        assert target.is_relative_to(ROOT), f"{doc.name}: {link} points outside the repository"
        assert target.exists(), f"{doc.name}: {link} does not exist"


def test_a_link_out_of_the_repository_is_caught(tmp_path: Path) -> None:
    """(the check above can fail: the README once linked ../shared/DESIGN.md)"""
    links = [m.group(1) or m.group(2) for m in LINK.finditer(
        "See [`../shared/DESIGN.md`] and [notes](../shared/SYSTEMS.md).")]
    assert links == ["../shared/DESIGN.md", "../shared/SYSTEMS.md"]
