"""The design the code points to is in the repository: every reference to it names a section of
docs/design.md that exists, and nothing points to a design file outside the project."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = re.compile("|".join([re.escape("DESIGN" + ".md"), re.escape("../" + "shared"), re.escape("/work/" + "shared")]))
REFERENCE = re.compile(r"design\.md#([a-z0-9-]+)")


def _texts() -> dict[str, str]:
    paths = [*(ROOT / "kvshard").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").rglob("*"),
             *(ROOT / "docs").rglob("*.md"), *ROOT.glob("*.md"), ROOT / "Makefile", ROOT / "pyproject.toml"]
    return {str(p.relative_to(ROOT)): p.read_text(errors="replace") for p in paths if p.is_file()}


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown, re.M)
    return {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_nothing_points_to_a_design_file_outside_the_project():
    found = [f"{path}:{text[:m.start()].count(chr(10)) + 1}" for path, text in _texts().items()
             for m in OUTSIDE.finditer(text)]
    assert found == [], f"point these into docs/design.md instead: {found}"


def test_every_design_reference_names_a_section_that_exists():
    sections = _anchors((ROOT / "docs" / "design.md").read_text())
    assert {"parallel-layout", "where-a-token-lives", "one-decode-step-of-attention", "kv-accounting"} <= sections
    references = {(path, anchor) for path, text in _texts().items() for anchor in REFERENCE.findall(text)}
    assert len(references) >= 25  # the code's references, docs' links
    missing = sorted((path, anchor) for path, anchor in references if anchor not in sections)
    assert missing == [], f"no such section of docs/design.md: {missing}"
