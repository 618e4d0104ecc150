"""The docs site's navigation lists every page and only pages that exist (issue 44).

``mkdocs build --strict`` (``.ci/run``) fails on warnings, but a page missing from ``nav`` is only an INFO
there: it would be built yet unreachable from the menu. This checks ``mkdocs.yml`` against ``docs/``.
"""

from __future__ import annotations

import re

from tests.support.paths import DOCS, REPO_ROOT

MKDOCS = REPO_ROOT / "mkdocs.yml"


def nav_pages() -> list[str]:
    """The page paths of mkdocs.yml's ``nav`` (relative to docs/), in order."""
    text = MKDOCS.read_text()
    nav = text[text.index("\nnav:\n"):]
    return re.findall(r"^\s+- (?:[^\n]*?: )?([\w/.-]+\.md)\s*$", nav, re.M)


def test_nav_lists_every_page_once_and_only_pages_that_exist() -> None:
    listed = nav_pages()
    assert len(listed) == len(set(listed)), f"pages listed twice: {sorted({p for p in listed if listed.count(p) > 1})}"
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert sorted(set(listed) - pages) == [], "mkdocs.yml lists pages that do not exist"
    assert sorted(pages - set(listed)) == [], "pages under docs/ that mkdocs.yml's nav does not list"


def test_nav_has_the_planned_guides() -> None:
    guides = {p for p in nav_pages() if p.startswith("guide/")}
    assert guides == {f"guide/{name}.md" for name in (
        "retention", "recache", "relative_sinks", "multi_shot", "rolling_window", "extension_points", "porting",
        "host_tier", "training", "compile_and_graphs", "warm_starts", "multi_gpu",
    )}
